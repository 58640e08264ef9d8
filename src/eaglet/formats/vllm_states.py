"""The file vLLM's hidden-state extraction writes per request, read back by `eaglet extract
--engine vllm` (the writer is vLLM's connector: vllm_worker/eaglet_vllm_connector.py, which writes
what vLLM's ExampleHiddenStatesConnector writes).

`<request_id>.safetensors`: `hidden_states` [T, n_layers, H] in the engine's dtype, the layers in
the order of the engine's `eagle_aux_hidden_state_layer_ids` (Hugging Face numbering: id k = the
output of decoder layer k-1, id N = the last layer's output before the final norm); `token_ids`
int64 [T], the prompt. Nothing else: no loss mask, no metadata, so every field is checked
against the sample it was asked for.
"""

from __future__ import annotations

from pathlib import Path

import torch

from eaglet.formats.io import read_safetensors


def read_vllm_states(
    path: str | Path, input_ids: list[int], num_states: int, hidden_size: int, where: str
) -> list[torch.Tensor]:
    """The states of one sample as eaglet's writers take them (a list of num_states [T, H]
    tensors); a file that is not the sample's (other tokens, layers or width) is a ValueError
    naming the file and `where` (the sample)."""
    tensors = read_safetensors(path)
    states, ids = tensors.get("hidden_states"), tensors.get("token_ids")
    if states is None or ids is None:
        raise ValueError(f"{path} ({where}): vLLM's file has {sorted(tensors)}, not hidden_states and token_ids")
    if ids.tolist() != list(input_ids):
        first = next(
            (n for n, (a, b) in enumerate(zip(ids.tolist(), input_ids)) if a != b), min(len(ids), len(input_ids))
        )
        raise ValueError(
            f"{path} ({where}): vLLM's token_ids ({len(ids)}) differ from the sample's ({len(input_ids)}) "
            f"from position {first}: these states are another prompt's"
        )
    expected = (len(input_ids), num_states, hidden_size)
    if tuple(states.shape) != expected:
        raise ValueError(
            f"{path} ({where}): vLLM's hidden_states are {tuple(states.shape)}, expected {expected} "
            "(tokens, layers asked for, hidden size)"
        )
    return [states[:, j] for j in range(num_states)]
