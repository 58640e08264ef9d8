"""One method's answer to one prompt turn in `eaglet eval`, and which methods a run compares.

    plain          eaglet's own greedy loop with a KV cache: the baseline of every speedup
    chain, tree    speculative decoding with an EAGLE-3 drafter (`decode.speculative_generate`)
    p-eagle, dflash  ... with a parallel drafter of that family: its block, one drafter pass a cycle
    hybrid, ngram  the drafter's chain (hybrid) and prompt lookup's continuation in eaglet's engine
    prompt-lookup  Hugging Face `generate(prompt_lookup_num_tokens=10)`, the no-training baseline
    hf-greedy      Hugging Face `generate` greedy: prompt lookup's own-engine baseline

llama.cpp's methods answer through their llama-servers (`engines`), vLLM's through its engines
(`vllm_methods`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Sequence, cast

import torch
from torch import nn

from eaglet.decode import (
    DecodeStats,
    Eagle3Proposer,
    HybridProposer,
    NgramProposer,
    ParallelProposer,
    Proposer,
    measure_pass_costs,
    plain_generate,
    speculative_generate,
    truncate_at_eos,
)
from eaglet.drafter import DraftModel, Eagle3Draft, ParallelDraft, predicted_positions
from eaglet.evaluate.settings import DecodeSettings
from eaglet.options import (
    BASELINE,
    EAGLE3,
    ENGINE_METHODS,
    HF_METHODS,
    LOOKUP_METHODS,
    METHODS,
    OUTSIDE_BASELINES,
    OWN_COUNTERPART,
    PARALLEL_METHODS,
)
from eaglet.target import generation_config, input_device

if TYPE_CHECKING:  # transformers' modelling code loads only with a model
    from transformers import GenerationMixin, PreTrainedModel

log = logging.getLogger(__name__)

PROMPT_LOOKUP_TOKENS = 10  # HF's own example value, and what the baseline figure was measured with


@dataclass
class Run:
    """One method's answer to one prompt turn."""

    tokens: list[int]
    wall_s: float
    target_forwards: int
    stats: DecodeStats | None = None


class ForwardCounter:
    """Counts the target's forward calls (for prompt lookup's acceptance length)."""

    def __init__(self, model: nn.Module):
        self.count = 0
        self.handle = model.register_forward_pre_hook(self._hook)

    def _hook(self, *_: Any) -> None:
        self.count += 1

    def remove(self) -> None:
        self.handle.remove()


def run_method(
    method: str, target: PreTrainedModel, drafter: DraftModel | None, ids: list[int], s: DecodeSettings
) -> Run:
    """Plain greedy, one of eaglet's engine methods or Hugging Face generate on one prompt."""
    gen = torch.Generator().manual_seed(s.seed) if s.temperature > 0 else None
    if method == BASELINE:
        toks, info = plain_generate(target, ids, s.max_new_tokens, s.eos_ids, s.temperature, s.top_p, gen)
        return Run(toks, info["wall_s"], info["target_forwards"])
    if method in ENGINE_METHODS:
        proposer, (depth, top_k, total_tokens) = engine_proposer(method, drafter, s)
        toks, stats = speculative_generate(
            target,
            proposer,
            ids,
            s.max_new_tokens,
            s.eos_ids,
            mode="tree",
            depth=depth,
            top_k=top_k,
            total_tokens=total_tokens,
            temperature=s.temperature,
            top_p=s.top_p,
            generator=gen,
        )
        return Run(toks, stats.wall_s, stats.target_forwards, stats)
    if method in HF_METHODS:
        return hf_generate(method, target, ids, s)
    raise ValueError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")


def hf_generate(method: str, target: PreTrainedModel, ids: list[int], s: DecodeSettings) -> Run:
    """Hugging Face `generate`, with prompt lookup for "prompt-lookup"; its target passes counted."""
    if s.temperature > 0:
        torch.manual_seed(s.seed)  # HF samples from the global generator
    x = torch.tensor([ids], device=input_device(target))
    config = generation_config(
        s.temperature,
        s.top_p,
        s.max_new_tokens,
        s.eos_ids[0],
        list(s.eos_ids),
        prompt_lookup_num_tokens=PROMPT_LOOKUP_TOKENS if method == "prompt-lookup" else None,
    )
    counter = ForwardCounter(target)
    try:
        t0 = time.perf_counter()
        with torch.inference_mode():
            # a causal LM generates (transformers' GenerationMixin, which PreTrainedModel's stubs lack)
            out = cast("GenerationMixin", target).generate(
                input_ids=x, attention_mask=torch.ones_like(x), generation_config=config
            )
        wall = time.perf_counter() - t0
    finally:
        counter.remove()
    toks, _ = truncate_at_eos(out[0, len(ids) :].tolist(), set(s.eos_ids))
    return Run(toks, wall, counter.count)


def drafter_limits(mode: str, s: DecodeSettings, chain_depth: int | None = None) -> tuple[int, int, int]:
    """(depth, top_k, total_tokens) of the drafter's chain or tree."""
    depth = chain_depth or s.chain
    return (depth, 1, depth) if mode == "chain" else s.tree


def drafter_family(drafter: DraftModel | None) -> str | None:
    return None if drafter is None else drafter.config.family


def refuse_wrong_family(method: str, drafter: DraftModel | None) -> None:
    """chain and tree draft with an EAGLE-3 drafter, p-eagle / dflash with a drafter of that family."""
    family = drafter_family(drafter)
    wanted = EAGLE3 if method in ("chain", "tree") else method if method in PARALLEL_METHODS else None
    if wanted is not None and family != wanted:
        fix = f"--methods {family}" if family in PARALLEL_METHODS else "--methods chain or tree"
        raise ValueError(f"method {method} drafts with the {wanted} family; this drafter is {family}: use {fix}")


def parallel_limits(drafter: ParallelDraft) -> tuple[int, int, int]:
    """A parallel drafter's whole block, as a chain (the probability floor cuts it)."""
    n = predicted_positions(drafter.config)
    return n, 1, n


def hybrid_drafter(drafter: DraftModel, s: DecodeSettings) -> tuple[Proposer, tuple[int, int, int]]:
    """The drafter's part of a hybrid cycle: a parallel drafter's block (one pass: the cost rule
    times it as such), or an EAGLE-3 chain / tree of the hybrid's shape."""
    if isinstance(drafter, ParallelDraft):
        return ParallelProposer(drafter, s.floor), parallel_limits(drafter)
    return Eagle3Proposer(drafter, s.floor), drafter_limits(s.hybrid_draft, s, s.hybrid_chain_depth)


def engine_proposer(
    method: str, drafter: DraftModel | None, s: DecodeSettings
) -> tuple[Proposer, tuple[int, int, int]]:
    """The proposer of an engine method and the tree limits the engine verifies it under."""
    refuse_wrong_family(method, drafter)
    if method in ("chain", "tree"):
        assert isinstance(drafter, Eagle3Draft)  # (refused above otherwise)
        return Eagle3Proposer(drafter, s.floor), drafter_limits(method, s)
    if method in PARALLEL_METHODS:
        assert isinstance(drafter, ParallelDraft)
        return ParallelProposer(drafter, s.floor), parallel_limits(drafter)
    if method != "ngram" and drafter is None:
        raise ValueError(f"method {method} drafts with a drafter; none was given")
    drafted = None if method == "ngram" or drafter is None else hybrid_drafter(drafter, s)
    if s.admission == "cost":
        if not s.pass_costs:
            raise ValueError(f"{method} with cost admission needs the target's pass costs (with_pass_costs)")
        # the cost rule replaces the lookup's floor; the drafter keeps its own (it saves drafting work)
        hybrid = HybridProposer(
            None if drafted is None else drafted[0],
            NgramProposer(s.max_ngram),
            (0, 1, 0) if drafted is None else drafted[1],
            s.lookup_tokens,
            pass_costs=s.pass_costs,
        )
        return hybrid, hybrid.limits
    lookup = NgramProposer(s.max_ngram, min_prob=s.floor)
    if drafted is None:
        return lookup, (s.lookup_tokens, 1, s.lookup_tokens)
    hybrid = HybridProposer(drafted[0], lookup, drafted[1], s.lookup_tokens, s.drop_rivals)
    return hybrid, hybrid.limits


# ---------------------------------------------------------------------------------------------
# The methods of one run, and what each is compared with
# ---------------------------------------------------------------------------------------------

Variants = dict[str, tuple[str, DecodeSettings]]  # label -> (method, settings); BASELINE is one of them


def variants_for(methods: Sequence[str], s: DecodeSettings) -> Variants:
    """Plain greedy plus each method, all with the same settings (what `eaglet eval` compares)."""
    return {m: (m, s) for m in [BASELINE, *methods]}


def with_pass_costs(variants: Variants, target: PreTrainedModel, drafter: DraftModel | None = None) -> Variants:
    """`variants` with the target's pass costs measured (once, up to the largest tree any variant
    verifies) filled in where a hybrid / ngram variant admits nodes by cost (`drafter`: the
    hybrid's, whose block or chain sizes its part of the tree)."""
    needs = {
        label: s
        for label, (method, s) in variants.items()
        if method in LOOKUP_METHODS and s.admission == "cost" and not s.pass_costs
    }
    if not needs:
        return variants

    def drafted(s: DecodeSettings) -> int:
        if isinstance(drafter, ParallelDraft):
            return parallel_limits(drafter)[2]
        return drafter_limits(s.hybrid_draft, s, s.hybrid_chain_depth)[2]

    largest = max(s.lookup_tokens + (0 if variants[label][0] == "ngram" else drafted(s)) for label, s in needs.items())
    costs = tuple(measure_pass_costs(target, max_q=max(2, largest + 1)))
    log.info("target pass costs (ms, 1..%d tokens): %s", len(costs), " ".join(f"{1000 * c:.0f}" for c in costs))
    return {
        label: (method, replace(s, pass_costs=costs) if label in needs else s)
        for label, (method, s) in variants.items()
    }


def measured_pass_costs(variants: Variants) -> list[float]:
    """The pass costs the variants decoded with (one measurement for all), or none."""
    return list(next((s.pass_costs for _, s in variants.values() if s.pass_costs), ()))


def with_implied_methods(methods: Sequence[str]) -> list[str]:
    """`methods` (once each) with what they are compared against: an outside engine's speculative
    methods need that engine's plain decoding (their baseline), and its drafter methods eaglet's
    own decoding of the same drafter (the first-draft acceptance they are checked against)."""
    methods = list(dict.fromkeys(methods))
    for m in methods:
        if m not in METHODS:
            raise ValueError(f"--methods: unknown method {m!r}; choose from {', '.join(METHODS)}")
    for m in list(methods):
        for needed in (OUTSIDE_BASELINES.get(m), OWN_COUNTERPART.get(m)):
            if needed is not None and needed not in methods:
                methods.insert(0, needed)
    return methods


def reference_labels(variants: Variants) -> dict[str, str]:
    """The label each variant is compared with (speedup, identical outputs): an outside engine's
    speculative methods with that engine's plain decoding, everything else with eaglet's plain greedy."""
    plain = {m: label for label, (m, _) in variants.items()}
    return {
        label: plain.get(OUTSIDE_BASELINES.get(m, BASELINE), BASELINE)
        for label, (m, _) in variants.items()
        if label != BASELINE
    }
