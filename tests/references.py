"""Writers and readers the tests need and eaglet itself does not: files in the foreign layouts eaglet
reads but never writes (speculators' flat v1, SpecForge), a reader of the drafter GGUF eaglet
writes (to hold an export against what llama.cpp would load), and plain greedy decoding as a
list of tokens (the reference every speculative method must equal)."""

from __future__ import annotations

import gzip
import io
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import gguf
import numpy as np
import torch
from torch import nn

from eaglet.decode import TargetRunner, token_budget
from eaglet.formats.gguf_drafter import (
    D2T,
    EMBEDDINGS,
    GGUF_ARCH,
    GGUF_NAMES,
    ROPE_ROWS,
    TOKENIZER_PREFIX,
    from_ggml_rope_rows,
    key,
)
from eaglet.formats.io import atomic_path, torch_save_atomic
from eaglet.formats.layouts import V1Sample, flat_v1_relative_path, specforge_relative_path


def plain_greedy(
    target: nn.Module, input_ids: Sequence[int], max_new_tokens: int, eos_ids: Sequence[int] = ()
) -> list[int]:
    """Greedy decoding through Hugging Face's own forward (`TargetRunner`), token by token: the
    reference eaglet's decoding (its fast target included) must equal."""
    runner, out, feed = TargetRunner(target), [], list(input_ids)
    budget = token_budget(len(feed), max_new_tokens, runner.max_positions)
    with torch.inference_mode():
        while len(out) < budget:
            token = int(runner.forward(feed, last_only=True)[0][-1].argmax())
            out.append(token)
            if token in eos_ids:
                break
            feed = [token]
    return out


def write_flat_v1_sample(folder: str | os.PathLike, index: int, sample: V1Sample) -> Path:
    path = Path(folder) / flat_v1_relative_path(index)
    torch_save_atomic(sample.to_dict(), path)
    return path


def write_specforge_sample(
    folder: str | os.PathLike,
    index: int,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    hidden_state: torch.Tensor,
    aux_hidden_state: torch.Tensor,
    compressed: bool = False,
) -> Path:
    """One SpecForge offline file; `aux_hidden_state` is the three aux states concatenated, [T, 3H]."""
    obj = {
        "input_ids": input_ids,
        "loss_mask": loss_mask,
        "hidden_state": hidden_state,
        "aux_hidden_state": aux_hidden_state,
    }
    path = Path(folder) / specforge_relative_path(index, compressed)
    with atomic_path(path) as tmp:
        if compressed:
            buf = io.BytesIO()
            torch.save(obj, buf)
            tmp.write_bytes(gzip.compress(buf.getvalue(), compresslevel=1))
        else:
            torch.save(obj, tmp)
    return path


@dataclass
class GGUFDrafter:
    """What a drafter GGUF holds, back in eaglet's terms."""

    metadata: dict[str, Any]  # every non-tokenizer key
    tensors: dict[str, torch.Tensor]  # eaglet names, fp32 (q/k back in Hugging Face's RoPE layout), d2t relative
    vocab_size: int  # tokens of the tokenizer it carries


def read_gguf_drafter(path: str | os.PathLike) -> GGUFDrafter:
    """Read a drafter GGUF written by `write_gguf_drafter` (or llama.cpp's converter)."""
    reader = gguf.GGUFReader(Path(path))
    arch = reader.fields["general.architecture"].contents() if "general.architecture" in reader.fields else None
    if arch != GGUF_ARCH:
        raise ValueError(f"{path}: general.architecture is {arch!r}, not {GGUF_ARCH!r}; not an EAGLE-3 drafter GGUF")
    metadata = {
        k: f.contents()
        for k, f in reader.fields.items()
        if not k.startswith(TOKENIZER_PREFIX) and not k.startswith("GGUF.")
    }
    heads = {
        "num_heads": metadata[key("attention.head_count")],
        "num_kv_heads": metadata[key("attention.head_count_kv")],
    }
    by_gguf = {g: e for e, g in GGUF_NAMES.items()}
    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        shape = tuple(int(n) for n in reversed(t.shape))  # ggml lists the fastest dimension first
        if t.name == D2T:
            absolute = torch.from_numpy(np.array(t.data, dtype=np.int64)).reshape(-1)
            tensors[D2T] = absolute - torch.arange(absolute.numel())
            continue
        data = np.array(t.data)
        if t.tensor_type == gguf.GGMLQuantizationType.BF16:
            value = torch.from_numpy(data.view(np.int16).copy()).view(torch.bfloat16).float()
        else:
            value = torch.from_numpy(data.astype(np.float32))
        value = value.reshape(shape)
        name = by_gguf.get(t.name, EMBEDDINGS if t.name == "token_embd.weight" else t.name)
        if name in ROPE_ROWS:
            value = from_ggml_rope_rows(value, heads[ROPE_ROWS[name]])
        tensors[name] = value
    vocab = len(reader.fields["tokenizer.ggml.tokens"].contents()) if "tokenizer.ggml.tokens" in reader.fields else 0
    return GGUFDrafter(metadata, tensors, vocab)
