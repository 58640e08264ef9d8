"""The target side of decoding: `TargetRunner` (the HF target with its KV cache and hooks on the
aux layers), and the entry points that run a target: `plain_generate` (the reference) and
`speculative_generate` (the core's `decode_loop` with a `TargetRunner` and a proposer).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Sequence

import torch
from torch import nn
from transformers import DynamicCache

from eaglet.decode.core import (
    DEFAULT_DEPTH,
    DEFAULT_TOP_K,
    DEFAULT_TOTAL_TOKENS,
    DecodeStats,
    TokenIds,
    as_id_list,
    decode_loop,
    keep_cache_entries,
    process_probs,
    sample_from,
    token_budget,
    tree_limits,
)
from eaglet.decode.fast import FastTarget, HFModel, fast_target_refused
from eaglet.decode.parallel import ParallelProposer
from eaglet.decode.proposers import Eagle3Proposer, Proposer
from eaglet.drafter import DraftModel, ParallelDraft
from eaglet.target import LayerCapture, decoder_layers, input_device, max_positions

if TYPE_CHECKING:  # in typing from Python 3.13; annotations are never evaluated here, only mypy reads it
    from typing_extensions import TypeIs


# ---------------------------------------------------------------------------------------------
# The target
# ---------------------------------------------------------------------------------------------


def target_runner(model: nn.Module, aux_layer_ids: list[int] | None = None) -> TargetRunner | FastTarget:
    """The runner a generation uses: `FastTarget` where it runs this model (a Llama-family target
    on one device, unless EAGLET_FAST_TARGET=0), else Hugging Face's forward (`TargetRunner`)."""
    if fast_target_refused(model) is None:
        return FastTarget(model, aux_layer_ids)
    return TargetRunner(model, aux_layer_ids)


class TargetRunner:
    """The HF target with its DynamicCache and (optionally) hooks on the aux layers."""

    def __init__(self, model: HFModel, aux_layer_ids: list[int] | None = None):
        impl = getattr(model.config, "_attn_implementation", None)
        if impl not in (None, "sdpa", "eager"):
            raise ValueError(
                f"tree verification needs a custom 4D attention mask: load the target with "
                f"attn_implementation 'sdpa' or 'eager', not {impl!r}"
            )
        self.model = model
        self.device = input_device(model)  # under a device map, the first layer's; each layer's KV cache is its own
        self.dtype = next(model.parameters()).dtype
        self.max_positions = max_positions(model)
        self.cache = DynamicCache(config=model.config)
        self.capture = LayerCapture(decoder_layers(model), aux_layer_ids) if aux_layer_ids else None
        self.forwards = 0
        self.seconds = 0.0

    def close(self) -> None:
        if self.capture is not None:
            self.capture.remove()

    @property
    def cached(self) -> int:
        return self.cache.get_seq_length()

    def forward(
        self,
        token_ids: list[int],
        positions: list[int] | None = None,
        mask: torch.Tensor | None = None,
        last_only: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [q or 1, V] (fp32) and the aux states [q, sum H] of the fed tokens."""
        t0 = time.perf_counter()
        ids = torch.tensor([token_ids], device=self.device)
        pos = None if positions is None else torch.tensor([positions], device=self.device)
        out = self.model(
            input_ids=ids,
            position_ids=pos,
            attention_mask=mask,
            cache=self.cache,
            use_cache=True,
            logits_to_keep=1 if last_only else 0,
        )
        aux = torch.cat(self.capture.take(self.device), dim=-1)[0] if self.capture is not None else None
        self.forwards += 1
        self.seconds += time.perf_counter() - t0
        return out.logits[0].float().to(self.device), aux

    def keep(self, start: int, rel: list[int]) -> None:
        """Keep cache entries [0, start) + start + rel (rel sorted): see `keep_cache_entries`."""
        keep_cache_entries(self.cache, start, rel, self.device)


# ---------------------------------------------------------------------------------------------
# Plain decoding (the reference)
# ---------------------------------------------------------------------------------------------


@torch.inference_mode()
def plain_generate(
    target: nn.Module,
    input_ids: TokenIds,
    max_new_tokens: int,
    eos_ids: Sequence[int] = (),
    temperature: float = 0.0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> tuple[list[int], dict[str, Any]]:
    """Token by token with the KV cache: greedy at temperature 0, else sampling from
    `process_probs`. Returns the new tokens (ending at the first EOS, if any) and stats."""
    prompt = as_id_list(input_ids)
    runner = target_runner(target)
    budget = token_budget(len(prompt), max_new_tokens, runner.max_positions)
    eos = set(eos_ids)
    out: list[int] = []
    t0 = time.perf_counter()
    feed = prompt
    while len(out) < budget:
        logits, _ = runner.forward(feed, last_only=True)
        tok = (
            int(logits[-1].argmax())
            if temperature <= 0
            else sample_from(process_probs(logits[-1], temperature, top_p), generator)
        )
        out.append(tok)
        if tok in eos:
            break
        feed = [tok]
    wall = time.perf_counter() - t0
    return out, {
        "new_tokens": len(out),
        "target_forwards": runner.forwards,
        "wall_s": wall,
        "tokens_per_s": len(out) / wall if wall > 0 else 0.0,
    }


# ---------------------------------------------------------------------------------------------
# Speculative decoding
# ---------------------------------------------------------------------------------------------


def is_proposer(drafter: DraftModel | Proposer) -> TypeIs[Proposer]:
    """Whether `speculative_generate` was given a `Proposer` (it drafts trees itself), not a drafter model."""
    return hasattr(drafter, "propose")


@torch.inference_mode()
def speculative_generate(
    target: nn.Module,
    drafter: DraftModel | Proposer,
    input_ids: TokenIds,
    max_new_tokens: int,
    eos_ids: Sequence[int] = (),
    mode: str = "tree",
    depth: int = DEFAULT_DEPTH,
    top_k: int = DEFAULT_TOP_K,
    total_tokens: int = DEFAULT_TOTAL_TOKENS,
    temperature: float = 0.0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    min_prob: float = 0.0,
) -> tuple[list[int], DecodeStats]:
    """Generate like `plain_generate` (token for token at T=0, in distribution at T>0) with
    drafts verified by the target. `drafter` is a drafter model (EAGLE-3, P-EAGLE or DFlash) or any
    `Proposer`; a model proposes only tokens whose path probability is >= `min_prob`."""
    limits = tree_limits(mode, depth, top_k, total_tokens)
    if is_proposer(drafter):
        if min_prob > 0:
            raise ValueError("min_prob applies to a drafter model; give a Proposer its own threshold")
        proposer: Proposer = drafter
    elif isinstance(drafter, ParallelDraft):
        proposer = ParallelProposer(drafter, min_prob)
    else:
        proposer = Eagle3Proposer(drafter, min_prob)
    if hasattr(proposer, "reset"):
        proposer.reset()
    prompt = as_id_list(input_ids)
    runner = target_runner(target, proposer.aux_layer_ids)
    try:
        return decode_loop(runner, proposer, prompt, max_new_tokens, eos_ids, limits, temperature, top_p, generator)
    finally:
        runner.close()
