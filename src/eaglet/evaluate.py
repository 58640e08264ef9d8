"""`eaglet eval`: acceptance length and real speedup of a drafter on prompt sets.

For every prompt the same target decodes the same prompt with every method, in a rotating
order so that machine drift (frequency scaling, other jobs) spreads evenly over the methods:

    plain          eaglet's own greedy loop with a KV cache: the baseline of every speedup
    chain, tree    speculative decoding with the drafter (`decode.speculative_generate`)
    prompt-lookup  Hugging Face `generate(prompt_lookup_num_tokens=10)`, the no-training baseline
    hf-greedy      Hugging Face `generate` greedy: prompt lookup's own-engine baseline
    llama.cpp      llama.cpp's llama-server on the target's GGUF, plain greedy: the baseline of
                   llama.cpp-eagle3 (the drafter exported to GGUF, `--spec-type draft-eagle3`) and
                   llama.cpp-ngram (llama.cpp's own n-gram lookup); one server per method, all
                   running beside eaglet's own, so they rotate with the other methods per prompt

Speedup = (method's new tokens / its seconds) / (plain's new tokens / its seconds), summed over
a prompt set; llama.cpp's speculative methods are measured against llama.cpp plain, by the
engine's own timings and counters, and llama.cpp plain against eaglet's plain. The engine's
first-draft acceptance is set beside eaglet's chain for the same drafter and prompts; a gap
beyond FIRST_DRAFT_GAP on an unquantized target without a probability floor means the engine
does not run the drafter the way eaglet trained it (layer ids, d2t, norms), elsewhere it is a
hint (`gap_verdict`). At temperature 0 every method must reproduce plain's tokens; in fp32 they do
exactly, in bf16 matmuls of different shapes round differently, so the share of identical
outputs and the mean position of the first divergence are reported instead of assumed.
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn
from tqdm import tqdm

from eaglet import formats, llama_cpp, ranges
from eaglet.data import chat_prompt_ids
from eaglet.decode import (DecodeStats, Eagle3Proposer, HybridProposer, NgramProposer, Proposer, max_positions,
                           measure_pass_costs, plain_generate, speculative_generate, truncate_at_eos)
from eaglet.draft_model import Eagle3Draft
from eaglet.export import export_drafter, load_drafter_for_target
from eaglet.regen import stop_token_ids
from eaglet.options import (ADMISSIONS, BASELINE, DEFAULT_METHODS, DEFAULT_PRESET, ENGINE_METHODS, HF_METHODS,
                            HYBRID_DRAFTS, LLAMA_CPP_BASELINE, LLAMA_CPP_METHODS, METHODS, PRESETS)
from eaglet.placement import placement_from_options
from eaglet.prompts import Prompt, load_prompt_set
from eaglet.target import (cpu_description, decoder_layers, f32_target_gguf, find_target_gguf, generation_config,
                           input_device, load_target, load_tokenizer, parse_dtype, pick_device, resolve_target)

log = logging.getLogger(__name__)

SPEC_METHODS = ("chain", "tree", "hybrid")  # eaglet's engine with the drafter
assert set(SPEC_METHODS) < set(ENGINE_METHODS)  # ngram: eaglet's engine with prompt lookup alone, no drafter
# The tree and chain shapes and the draft-probability floor are the device's preset (presets.toml).
# The cpu preset was chosen with bench/decode_sweep.py on 2 CPU cores, SmolLM2-135M and a drafter
# from `eaglet train` (4 MT-bench prompts, bf16, 1 thread): chain 2 / 3 / 4 / 5 ran at 1.14x / 1.02x /
# 0.96x / 0.86x of plain greedy, trees 4/2/6, 5/4/12, 6/8/30 at 0.95x / 0.87x / 0.77x although their
# tau was higher (1.59 / 1.68 / 1.87 vs 1.41): on a CPU every drafted token costs verification time,
# so short drafts win until the drafter is strong. The cuda preset is EAGLE-2's 60/7/10.
PROMPT_LOOKUP_TOKENS = 10  # HF's own example value, and what the baseline figure was measured with
# hybrid / ngram: the n-gram sizes looked up and the tokens the lookup adds to a cycle's tree
HYBRID_MAX_NGRAM = 3
HYBRID_LOOKUP_TOKENS = 4
HYBRID_CHAIN_DEPTH = 1
# hybrid / ngram admission (ADMISSIONS): "cost" verifies a node only where its calibrated acceptance
# pays for the longer pass (pass times measured on this machine before decoding); "all" verifies
# every proposed node
LOOKUP_METHODS = ("hybrid", "ngram")
RESULTS_FILE = "eval.json"
PLOT_FILE = "eval.png"
DRAFTER_GGUF = "drafter.gguf"  # in --out: the export llama.cpp-eagle3 ran
# llama.cpp's server for each of its methods (the drafter is exported for draft-eagle3)
LLAMA_CPP_SPECS = {LLAMA_CPP_BASELINE: None, "llama.cpp-eagle3": llama_cpp.SPEC_EAGLE3,
                   "llama.cpp-ngram": llama_cpp.SPEC_NGRAM}
assert set(LLAMA_CPP_SPECS) == set(LLAMA_CPP_METHODS)
# First-draft acceptance in llama.cpp vs eaglet's chain, same drafter and prompts: beyond this
# the two do not run the same drafter. Measured on a drafter that memorised 6 HumanEval answers:
# +0.000 with the engine on the f32 target GGUF (one model on both sides), -0.264 on the Q4_1
# one, whose quantized kernels move the states the drafter reads. A --min-draft-prob floor moves
# it too (llama.cpp applies it to a top-10 renormalised probability). So a gap is a verdict only
# on an f32 target without a floor, elsewhere a hint.
FIRST_DRAFT_GAP = 0.05


# ---------------------------------------------------------------------------------------------
# One decoding job per method
# ---------------------------------------------------------------------------------------------

@dataclass
class Run:
    """One method's answer to one prompt turn."""

    tokens: list[int]
    wall_s: float
    target_forwards: int
    stats: DecodeStats | None = None


@dataclass
class DecodeSettings:
    max_new_tokens: int = 128
    eos_ids: tuple[int, ...] = ()
    preset: str = DEFAULT_PRESET  # fills the four shapes below and min_draft_prob where None (presets.toml)
    depth: int | None = None
    top_k: int | None = None
    total_tokens: int | None = None
    chain_depth: int | None = None
    min_draft_prob: float | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    lookup_tokens: int = HYBRID_LOOKUP_TOKENS
    max_ngram: int = HYBRID_MAX_NGRAM
    hybrid_draft: str = "chain"  # the drafter's part of a hybrid cycle: a chain or a tree
    hybrid_chain_depth: int = HYBRID_CHAIN_DEPTH  # ... that chain's depth
    drop_rivals: bool = False  # hybrid: leave out drafted siblings of a lookup token trusted beyond 1 - floor
    admission: str = "cost"  # hybrid / ngram: which proposed nodes are verified (ADMISSIONS)
    pass_costs: tuple[float, ...] = ()  # seconds of a target pass over 1, 2, ... tokens (measured: with_pass_costs)

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise ValueError(f"--preset {self.preset!r}: choose one of {', '.join(PRESETS)} (presets.toml)")
        for key, value in PRESETS[self.preset]["eval"].items():
            if getattr(self, key) is None:
                setattr(self, key, value)
        ranges.at_least(1, max_new_tokens=self.max_new_tokens, depth=self.depth, top_k=self.top_k,
                        total_tokens=self.total_tokens, chain_depth=self.chain_depth,
                        lookup_tokens=self.lookup_tokens, max_ngram=self.max_ngram,
                        hybrid_chain_depth=self.hybrid_chain_depth)
        if self.hybrid_draft not in HYBRID_DRAFTS:
            raise ValueError(f"--hybrid-draft {self.hybrid_draft!r}: choose one of {', '.join(HYBRID_DRAFTS)}")
        if self.admission not in ADMISSIONS:
            raise ValueError(f"--admission {self.admission!r}: choose one of {', '.join(ADMISSIONS)}")
        if self.drop_rivals and self.admission != "all":
            raise ValueError("--drop-rivals applies to --admission all (cost admission weighs rivals itself)")
        ranges.within(0, 1, min_draft_prob=self.min_draft_prob)
        ranges.at_least(0, temperature=self.temperature)
        ranges.within(0, 1, low_open=True, top_p=self.top_p)


class ForwardCounter:
    """Counts the target's forward calls (for prompt lookup's acceptance length)."""

    def __init__(self, model: nn.Module):
        self.count = 0
        self.handle = model.register_forward_pre_hook(self._hook)

    def _hook(self, *_: Any) -> None:
        self.count += 1

    def remove(self) -> None:
        self.handle.remove()


def run_method(method: str, target: nn.Module, drafter: Eagle3Draft | None, ids: list[int],
               s: DecodeSettings) -> Run:
    gen = torch.Generator().manual_seed(s.seed) if s.temperature > 0 else None
    if method == BASELINE:
        toks, info = plain_generate(target, ids, s.max_new_tokens, s.eos_ids, s.temperature, s.top_p, gen)
        return Run(toks, info["wall_s"], info["target_forwards"])
    if method in ENGINE_METHODS:
        proposer, (depth, top_k, total_tokens) = engine_proposer(method, drafter, s)
        toks, stats = speculative_generate(target, proposer, ids, s.max_new_tokens, s.eos_ids, mode="tree",
                                           depth=depth, top_k=top_k, total_tokens=total_tokens,
                                           temperature=s.temperature, top_p=s.top_p, generator=gen)
        return Run(toks, stats.wall_s, stats.target_forwards, stats)
    if method in HF_METHODS:
        if gen is not None:
            torch.manual_seed(s.seed)  # HF samples from the global generator
        x = torch.tensor([ids], device=input_device(target))
        config = generation_config(s.temperature, s.top_p, s.max_new_tokens, s.eos_ids[0], list(s.eos_ids),
                                   prompt_lookup_num_tokens=PROMPT_LOOKUP_TOKENS if method == "prompt-lookup" else None)
        counter = ForwardCounter(target)
        try:
            t0 = time.perf_counter()
            with torch.inference_mode():
                out = target.generate(input_ids=x, attention_mask=torch.ones_like(x), generation_config=config)
            wall = time.perf_counter() - t0
        finally:
            counter.remove()
        toks, _ = truncate_at_eos(out[0, len(ids):].tolist(), set(s.eos_ids))
        return Run(toks, wall, counter.count)
    raise ValueError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")


def engine_run(server: llama_cpp.LlamaServer, method: str, ids: list[int], s: DecodeSettings) -> Run:
    """One answer from llama-server, in eval's terms, from the engine's own timings and counters:
    a step that accepted m drafted tokens is one target pass for m + 1 tokens, so the target's
    passes are the tokens it generated less the drafted ones it accepted (the prefill counted as
    one, as eaglet counts it)."""
    done, counts = server.counted_completion(ids, s.max_new_tokens, temperature=s.temperature, top_p=s.top_p,
                                             seed=s.seed)
    tokens, _ = truncate_at_eos(done.tokens, set(s.eos_ids))
    forwards = max(1, done.generated - counts.accepted)
    if not counts.drafts:
        return Run(tokens, done.seconds, forwards)
    stats = DecodeStats(new_tokens=len(tokens), target_forwards=forwards, verify_forwards=counts.drafts,
                        position_reached=counts.reached_per_position,
                        position_accepted=list(counts.accepted_per_position), wall_s=done.seconds,
                        accepted_from={method: counts.accepted})
    return Run(tokens, done.seconds, forwards, stats)


def run_variant(method: str, target: nn.Module, drafter: Eagle3Draft | None, ids: list[int], s: DecodeSettings,
                servers: dict[str, llama_cpp.LlamaServer] | None = None) -> Run:
    """`run_method`, or the method's llama-server (`servers`, by method) for llama.cpp's methods."""
    if method in LLAMA_CPP_METHODS:
        if not servers or method not in servers:
            raise ValueError(f"{method}: no llama-server is running for it")
        return engine_run(servers[method], method, ids, s)
    return run_method(method, target, drafter, ids, s)


def drafter_limits(mode: str, s: DecodeSettings, chain_depth: int | None = None) -> tuple[int, int, int]:
    """(depth, top_k, total_tokens) of the drafter's chain or tree."""
    depth = chain_depth or s.chain_depth
    return (depth, 1, depth) if mode == "chain" else (s.depth, s.top_k, s.total_tokens)


def engine_proposer(method: str, drafter: Eagle3Draft | None,
                    s: DecodeSettings) -> tuple[Proposer, tuple[int, int, int]]:
    """The proposer of an engine method and the tree limits the engine verifies it under."""
    if method in ("chain", "tree"):
        return Eagle3Proposer(drafter, s.min_draft_prob), drafter_limits(method, s)
    if s.admission == "cost":
        if not s.pass_costs:
            raise ValueError(f"{method} with cost admission needs the target's pass costs (with_pass_costs)")
        # the cost rule replaces the lookup's floor; the drafter keeps its own (it saves drafting work)
        hybrid = HybridProposer(None if method == "ngram" else Eagle3Proposer(drafter, s.min_draft_prob),
                                NgramProposer(s.max_ngram), drafter_limits(s.hybrid_draft, s, s.hybrid_chain_depth),
                                s.lookup_tokens, pass_costs=s.pass_costs)
        return hybrid, hybrid.limits
    lookup = NgramProposer(s.max_ngram, min_prob=s.min_draft_prob)
    if method == "ngram":
        return lookup, (s.lookup_tokens, 1, s.lookup_tokens)
    hybrid = HybridProposer(Eagle3Proposer(drafter, s.min_draft_prob), lookup,
                            drafter_limits(s.hybrid_draft, s, s.hybrid_chain_depth), s.lookup_tokens, s.drop_rivals)
    return hybrid, hybrid.limits


def with_pass_costs(variants: Variants, target: nn.Module) -> Variants:
    """`variants` with the target's pass costs measured (once, up to the largest tree any variant
    verifies) filled in where a hybrid / ngram variant admits nodes by cost."""
    needs = {label: s for label, (method, s) in variants.items()
             if method in LOOKUP_METHODS and s.admission == "cost" and not s.pass_costs}
    if not needs:
        return variants
    largest = max(s.lookup_tokens + (0 if variants[label][0] == "ngram" else
                                     drafter_limits(s.hybrid_draft, s, s.hybrid_chain_depth)[2])
                  for label, s in needs.items())
    costs = tuple(measure_pass_costs(target, max_q=max(2, largest + 1)))
    log.info("target pass costs (ms, 1..%d tokens): %s", len(costs), " ".join(f"{1000 * c:.0f}" for c in costs))
    return {label: (method, replace(s, pass_costs=costs) if label in needs else s)
            for label, (method, s) in variants.items()}


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token (the shorter length if one is a prefix), None if equal."""
    if list(a) == list(b):
        return None
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


# ---------------------------------------------------------------------------------------------
# Aggregation
# ---------------------------------------------------------------------------------------------

def add_into(xs: list[int], ys: Sequence[int]) -> None:
    xs.extend([0] * (len(ys) - len(xs)))
    for i, y in enumerate(ys):
        xs[i] += y


@dataclass
class MethodTotals:
    """One method's sums over a prompt set."""

    turns: int = 0
    new_tokens: int = 0
    wall_s: float = 0.0
    target_forwards: int = 0
    verify_forwards: int = 0
    target_s: float = 0.0
    draft_s: float = 0.0
    position_reached: list[int] = field(default_factory=list)
    position_accepted: list[int] = field(default_factory=list)
    identical: int = 0
    divergences: list[int] = field(default_factory=list)
    accepted_from: Counter = field(default_factory=Counter)  # accepted draft tokens by proposer

    def add(self, run: Run, reference: list[int] | None) -> None:
        self.turns += 1
        self.new_tokens += len(run.tokens)
        self.wall_s += run.wall_s
        self.target_forwards += run.target_forwards
        if run.stats is not None:
            self.verify_forwards += run.stats.verify_forwards
            self.target_s += run.stats.target_s
            self.draft_s += run.stats.draft_s
            add_into(self.position_reached, run.stats.position_reached)
            add_into(self.position_accepted, run.stats.position_accepted)
            self.accepted_from.update(run.stats.accepted_from)
        if reference is not None:
            d = first_divergence(run.tokens, reference)
            if d is None:
                self.identical += 1
            else:
                self.divergences.append(d)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def summary(self, plain: MethodTotals | None, compared: bool) -> dict[str, Any]:
        out: dict[str, Any] = {
            "turns": self.turns, "new_tokens": self.new_tokens, "wall_s": round(self.wall_s, 3),
            "tokens_per_s": round(self.tokens_per_s, 3), "target_forwards": self.target_forwards,
            "tau": round(self.new_tokens / self.target_forwards, 4) if self.target_forwards else None,
        }
        if plain is not None and plain.tokens_per_s > 0:
            out["speedup"] = round(self.tokens_per_s / plain.tokens_per_s, 4)
        if self.verify_forwards:
            out["tau_verify"] = round((self.new_tokens - self.turns) / self.verify_forwards, 4)
            out["acceptance_rates"] = [round(a / r, 4) if r else None
                                       for a, r in zip(self.position_accepted, self.position_reached)]
            out["accepted_from"] = dict(sorted(self.accepted_from.items()))
            # the speedup if everything but the target and drafter passes cost nothing
            if plain is not None and plain.new_tokens and self.target_forwards:
                t_token = plain.wall_s / plain.new_tokens
                t_cycle = (self.target_s + self.draft_s) / self.target_forwards
                out["ceiling_speedup"] = round(out["tau"] * t_token / t_cycle, 4) if t_cycle > 0 else None
        if compared:
            out["identical_share"] = round(self.identical / self.turns, 4) if self.turns else None
            out["mean_first_divergence"] = (round(sum(self.divergences) / len(self.divergences), 2)
                                            if self.divergences else None)
        return out


# ---------------------------------------------------------------------------------------------
# The evaluation loop
# ---------------------------------------------------------------------------------------------

@dataclass
class EvalResult:
    config: dict[str, Any]
    sets: dict[str, dict[str, dict[str, Any]]]
    prompts: list[dict[str, Any]]
    json_path: Path | None = None
    plot_path: Path | None = None

    def table(self) -> str:
        return format_table(self.sets)

    def save(self, out: Path, plot: bool, title: str) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.json_path = out / RESULTS_FILE
        formats.write_json_atomic(self.json_path, {"config": self.config, "sets": self.sets, "prompts": self.prompts})
        if plot:
            self.plot_path = out / PLOT_FILE
            write_plot(self.sets, self.plot_path, title)


Variants = dict[str, tuple[str, DecodeSettings]]  # label -> (method, settings); BASELINE is one of them


def variants_for(methods: Sequence[str], s: DecodeSettings) -> Variants:
    """Plain greedy plus each method, all with the same settings (what `eaglet eval` compares)."""
    return {m: (m, s) for m in [BASELINE, *methods]}


def with_implied_methods(methods: Sequence[str]) -> list[str]:
    """`methods` (once each) with what they are compared against: llama.cpp's speculative
    methods need llama.cpp plain (their baseline), llama.cpp-eagle3 needs eaglet's chain (the
    first-draft acceptance it is checked against)."""
    methods = list(dict.fromkeys(methods))
    for m in methods:
        if m not in METHODS:
            raise ValueError(f"--methods: unknown method {m!r}; choose from {', '.join(METHODS)}")
    if set(methods) & set(LLAMA_CPP_METHODS) - {LLAMA_CPP_BASELINE} and LLAMA_CPP_BASELINE not in methods:
        methods.insert(0, LLAMA_CPP_BASELINE)
    if "llama.cpp-eagle3" in methods and "chain" not in methods:
        methods.insert(0, "chain")
    return methods


def reference_labels(variants: Variants) -> dict[str, str]:
    """The label each variant is compared with (speedup, identical outputs): llama.cpp's
    speculative methods with llama.cpp plain, everything else with eaglet's plain greedy."""
    engine_plain = next((label for label, (m, _) in variants.items() if m == LLAMA_CPP_BASELINE), None)
    return {label: engine_plain if m in LLAMA_CPP_METHODS and m != LLAMA_CPP_BASELINE and engine_plain else BASELINE
            for label, (m, _) in variants.items() if label != BASELINE}


def rotated(labels: list[str], k: int) -> list[str]:
    k %= len(labels)
    return labels[k:] + labels[:k]


def evaluate_set(prompts: list[Prompt], variants: Variants, target: nn.Module, drafter: Eagle3Draft | None,
                 tokenizer, on_turn: Callable[[dict[str, MethodTotals]], None],
                 records: list[dict[str, Any]], drafters: dict[str, Eagle3Draft] | None = None,
                 servers: dict[str, llama_cpp.LlamaServer] | None = None) -> dict[str, MethodTotals]:
    """Decode every turn of every prompt with each variant, in a rotating order; sums per label.
    The next turn's history holds plain greedy's answer, so every variant sees the same prompt.
    `drafters`: another drafter for some labels (drafters compared in one run); `servers`: the
    llama-servers of llama.cpp's methods."""
    labels = list(variants)
    totals = {label: MethodTotals() for label in labels}
    references = reference_labels(variants)
    greedy = variants[BASELINE][1].temperature <= 0
    positions = max_positions(target)
    k = 0
    for p in prompts:
        history = list(p.context)
        for turn_no, user_text in enumerate(p.turns):
            history.append({"role": "user", "content": user_text})
            ids = chat_prompt_ids(tokenizer, history)
            if len(ids) >= positions:  # no room to answer; later turns only grow
                for t in range(turn_no, len(p.turns)):
                    records.append({"set": p.set_name, "id": p.id, "turn": t, "prompt_tokens": len(ids),
                                    "skipped": f"prompt of {len(ids)} tokens leaves no room in the target's "
                                               f"{positions} positions"})
                    on_turn(totals)
                break
            runs = {}
            for label in rotated(labels, k):
                method, settings = variants[label]
                runs[label] = run_variant(method, target, (drafters or {}).get(label, drafter), ids, settings, servers)
            k += 1
            for label in labels:
                totals[label].add(runs[label], runs[references[label]].tokens if greedy and label in references
                                  else None)
            records.append({
                "set": p.set_name, "id": p.id, "turn": turn_no, "prompt_tokens": len(ids),
                "methods": {m: {"new_tokens": len(r.tokens), "wall_s": round(r.wall_s, 4),
                                "target_forwards": r.target_forwards,
                                **({"identical": r.tokens == runs[references[m]].tokens} if greedy and m in references
                                   else {})}
                            for m, r in runs.items()}})
            answer = tokenizer.decode(runs[BASELINE].tokens, skip_special_tokens=True)
            history.append({"role": "assistant", "content": answer})
            on_turn(totals)
    return totals


def summarize(totals: dict[str, MethodTotals], compared: bool,
              references: dict[str, str] | None = None) -> dict[str, dict[str, Any]]:
    """Each label's figures, speedups against its reference (`references`; default plain
    greedy); `compared`: report identical outputs."""
    references = references if references is not None else {label: BASELINE for label in totals if label != BASELINE}
    out = {label: t.summary(totals[references[label]] if label in references else None,
                            compared and label in references)
           for label, t in totals.items()}
    for label, ref in references.items():
        if ref != BASELINE:
            out[label]["speedup_over"] = ref
    return out


def first_draft_check(summary: dict[str, dict[str, Any]], weights: str | None = None, p_min: float = 0.0,
                      engine: str = "llama.cpp-eagle3", own: str = "chain") -> dict[str, Any] | None:
    """The engine's first-draft acceptance beside eaglet's own for the same drafter and prompts,
    the ggml type of the engine's target weights and the drafts' probability floor, written into
    the engine's row; None when either acceptance is missing."""
    try:
        theirs = summary[engine]["acceptance_rates"][0]
        ours = summary[own]["acceptance_rates"][0]
    except (KeyError, IndexError):
        return None
    if theirs is None or ours is None:
        return None
    check = {"eaglet_first_acceptance": ours, "first_acceptance_gap": round(theirs - ours, 4),
             "engine_target_weights": weights, "min_draft_prob": p_min}
    summary[engine].update(check)
    return check


def warm_up(variants: Variants, target: nn.Module, drafter: Eagle3Draft | None, tokenizer, prompt: Prompt,
            drafters: dict[str, Eagle3Draft] | None = None,
            servers: dict[str, llama_cpp.LlamaServer] | None = None) -> None:
    """One short untimed run per variant: first calls pay for allocations and kernel selection."""
    ids = chat_prompt_ids(tokenizer, [*prompt.context, {"role": "user", "content": prompt.turns[0]}])
    ids = ids[-(max_positions(target) // 2):]  # untimed: any prompt that fits will do
    for label, (method, s) in variants.items():
        run_variant(method, target, (drafters or {}).get(label, drafter), ids,
                    replace(s, max_new_tokens=min(8, s.max_new_tokens)), servers)


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """Run with n CPU threads (None: unchanged), restoring the previous count after."""
    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def evaluate(drafter_path: str | Path, target: str | None = None, prompt_sets: Sequence[str] = ("mtbench",),
             num_prompts: int | None = None, methods: Sequence[str] = DEFAULT_METHODS,
             settings: DecodeSettings | None = None, dtype: str = "bf16", device: str | None = None,
             threads: int | None = None, out: str | Path | None = None, plot: bool = True,
             progress: bool = True, other_target: bool = False, device_map: str | None = None,
             max_memory: str | None = None, offload_folder: str | None = None,
             target_gguf: str | Path | None = None, engine_f32: bool = False) -> EvalResult:
    """Decode every prompt of every set with plain greedy and each method; sums, table, JSON, plot.
    A target whose revision is not the one the drafter records is refused unless `other_target`.
    With `device_map` the target spans devices and the drafter runs where its inputs go.
    llama.cpp's methods run llama-server on `target_gguf` (default: the embedded target's GGUF),
    with `engine_f32` on its weights dequantized to f32."""
    ranges.at_least(1, num_prompts=num_prompts, threads=threads)
    placed = placement_from_options(device_map, max_memory, offload_folder, device)
    methods = with_implied_methods(methods)
    with torch_threads(threads), contextlib.ExitStack() as running:
        s = replace(settings or DecodeSettings())  # a copy: eos ids are filled in below
        dev = pick_device(device)
        torch_dtype = parse_dtype(dtype)
        drafter, target_spec, trained_for = None, target, None
        if any(m in SPEC_METHODS for m in methods):
            drafter, target_spec, trained_for = load_drafter_for_target(drafter_path, target)
        ref = resolve_target(target_spec)
        if trained_for and trained_for != ref.revision and not other_target:
            raise ValueError(f"{drafter_path}: trained for a target of revision {trained_for}; --target {ref.name} "
                             f"has revision {ref.revision} (other weights): its figures would not be this drafter's "
                             "on its own target; pass the drafter's own target, or --other-target to measure it on "
                             "this one anyway")
        tokenizer = load_tokenizer(ref)
        model = load_target(ref, torch_dtype, dev, placed)
        dev = input_device(model)  # the drafter drafts where the target's inputs (and its aux states) go
        if drafter is not None:
            check_drafter_fits(drafter, model)
            drafter = drafter.to(device=dev, dtype=torch_dtype).eval()
        s.eos_ids = tuple(sorted(stop_token_ids(model, tokenizer)))
        sets = {spec: load_prompt_set(spec, num_prompts) for spec in prompt_sets}

        servers, engine = running.enter_context(engine_servers(
            methods, drafter_path, ref.name, target_gguf, out, s, torch.get_num_threads(), max_positions(model),
            engine_f32))
        variants = with_pass_costs(variants_for(methods, s), model)
        warm_up(variants, model, drafter, tokenizer, next(iter(sets.values()))[0], servers=servers)
        n_turns = sum(len(p.turns) for ps in sets.values() for p in ps)
        bar = tqdm(total=n_turns, desc="eval", unit="turn", disable=not progress, dynamic_ncols=True)
        records: list[dict[str, Any]] = []
        results: dict[str, dict[str, dict[str, Any]]] = {}

        def on_turn(totals: dict[str, MethodTotals]) -> None:
            bar.update(1)
            plain = totals[BASELINE]
            bar.set_postfix({m: f"{t.tokens_per_s / plain.tokens_per_s:.2f}x" for m, t in totals.items()
                             if m != BASELINE and plain.tokens_per_s > 0})

        with torch.inference_mode():
            for spec, prompts in sets.items():
                name = prompts[0].set_name
                totals = evaluate_set(prompts, variants, model, drafter, tokenizer, on_turn, records, servers=servers)
                if totals[BASELINE].turns == 0:
                    raise ValueError(f"prompt set {spec!r}: every prompt is too long for the target's "
                                     f"{max_positions(model)} positions")
                results[name] = summarize(totals, s.temperature <= 0, reference_labels(variants))
                warn_on_gap(name, first_draft_check(results[name], engine.get("target_weights"), s.min_draft_prob))
        bar.close()
        skipped = [r for r in records if "skipped" in r]
        if skipped:
            log.warning("%d prompt turn(s) skipped: longer than the target's %d positions (listed in eval.json)",
                        len(skipped), max_positions(model))

        config = {"drafter": str(drafter_path), "target": ref.name, "target_revision": ref.revision,
                  "drafter_target_revision": trained_for,
                  "dtype": dtype, "device": str(dev), "device_map": device_map, "threads": torch.get_num_threads(),
                  "cpu": cpu_description(),
                  "prompt_sets": list(prompt_sets), "num_prompts": num_prompts, "methods": [BASELINE, *methods],
                  "max_new_tokens": s.max_new_tokens, "temperature": s.temperature, "top_p": s.top_p,
                  "tree": {"depth": s.depth, "top_k": s.top_k, "total_tokens": s.total_tokens},
                  "chain_depth": s.chain_depth, "min_draft_prob": s.min_draft_prob,
                  "prompt_lookup_num_tokens": PROMPT_LOOKUP_TOKENS, "seed": s.seed,
                  "hybrid": {"draft": s.hybrid_draft, "chain_depth": s.hybrid_chain_depth, "drop_rivals": s.drop_rivals,
                             "lookup_tokens": s.lookup_tokens, "max_ngram": s.max_ngram, "admission": s.admission},
                  "pass_costs_s": list(next((vs.pass_costs for _, vs in variants.values() if vs.pass_costs), ())),
                  "skipped_turns": len(skipped), **({"llama_cpp": engine} if engine else {})}
        result = EvalResult(config, results, records)
        if out is not None:
            result.save(Path(out), plot, title=f"drafter {drafter_path} | target {Path(ref.name).name} | {dtype}, "
                                               f"{s.max_new_tokens} new tokens, T={s.temperature:g}")
        return result


@contextlib.contextmanager
def engine_servers(methods: Sequence[str], drafter_path: str | Path, target_name: str, target_gguf: str | Path | None,
                   out: str | Path | None, s: DecodeSettings, threads: int, ctx_size: int, engine_f32: bool = False
                   ) -> Iterator[tuple[dict[str, llama_cpp.LlamaServer], dict[str, Any]]]:
    """llama-servers for llama.cpp's methods among `methods` (none: nothing starts), on the
    target's GGUF (with `engine_f32`, its f32 copy), with the drafter exported to GGUF
    (OUT/drafter.gguf) for llama.cpp-eagle3, drafting eaglet's chain length with its
    probability floor; and the record of what ran."""
    wanted = [m for m in methods if m in LLAMA_CPP_METHODS]
    if not wanted:
        yield {}, {}
        return
    binary = llama_cpp.server_binary()  # a missing engine is said before anything is exported
    model = find_target_gguf(target_gguf, target_name, "llama.cpp's methods run the target's GGUF")
    if engine_f32:
        model = f32_target_gguf(model)
    with tempfile.TemporaryDirectory(prefix="eaglet-eval-") as tmp:
        folder = Path(out) if out is not None else Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        draft = None
        if "llama.cpp-eagle3" in wanted:
            draft = folder / DRAFTER_GGUF
            draft.unlink(missing_ok=True)  # an earlier eval's: this run's drafter replaces it
            export_drafter(drafter_path, draft, formats.FORMAT_GGUF, target_gguf=model)
        # eaglet's own settings where llama.cpp has the same knob: its chain length and floor for
        # the drafter, its n-gram and lookup length for n-gram lookup
        ngram = llama_cpp.ngram_flags(s.max_ngram, s.lookup_tokens)
        specs = {m: llama_cpp.ServerSpec(draft if LLAMA_CPP_SPECS[m] == llama_cpp.SPEC_EAGLE3 else None,
                                         LLAMA_CPP_SPECS[m], ngram if LLAMA_CPP_SPECS[m] == llama_cpp.SPEC_NGRAM else ())
                 for m in wanted}
        options = {"threads": threads, "ctx_size": ctx_size, "draft_max": s.chain_depth,
                   "draft_p_min": s.min_draft_prob}
        record = {"server": llama_cpp.server_version(binary), "target_gguf": str(model),
                  "target_weights": formats.weight_type(model),
                  "drafter_gguf": str(draft) if draft and out is not None else None,
                  "spec_types": {m: LLAMA_CPP_SPECS[m] for m in wanted}, "ngram_flags": list(ngram), **options}
        log.info("llama.cpp (%s): %s on %s", record["server"], ", ".join(wanted), model.name)
        with llama_cpp.llama_servers(model, specs, log_dir=folder / "llama-server-logs", **options) as servers:
            yield servers, record


def gap_verdict(check: dict[str, Any]) -> str:
    """What a first-draft gap means: within the bound; beyond it on a quantized engine target,
    where quantization alone moves it, or with a probability floor, which the two engines apply
    to different probabilities; or beyond it on the same weights without a floor, a convention
    mismatch."""
    weights, p_min = check.get("engine_target_weights"), check.get("min_draft_prob") or 0.0
    if abs(check["first_acceptance_gap"]) <= FIRST_DRAFT_GAP:
        return f"within {FIRST_DRAFT_GAP}"
    if weights and weights not in formats.UNQUANTIZED:
        return (f"beyond {FIRST_DRAFT_GAP}, but the engine's target is {weights}, whose kernels move the states the "
                f"drafter reads; --engine-f32 runs eaglet's own weights and tells that from a convention mismatch")
    if p_min > 0:
        return (f"beyond {FIRST_DRAFT_GAP}, but with --min-draft-prob {p_min:g}: llama.cpp gates a draft on its top "
                f"token's probability among the drafter's 10 best, renormalised, eaglet among all of them, so "
                f"llama.cpp drafts tokens eaglet would not; --min-draft-prob 0 compares the conventions alone")
    return (f"MISMATCH: beyond {FIRST_DRAFT_GAP} on the same weights, the engine does not run the drafter as eaglet "
            f"does; check the export's conventions (aux layer ids, d2t, norms) before trusting either figure")


def warn_on_gap(set_name: str, check: dict[str, Any] | None) -> None:
    if check is not None and abs(check["first_acceptance_gap"]) > FIRST_DRAFT_GAP:
        log.warning("%s: llama.cpp's first-draft acceptance is %+.3f from eaglet's chain (%.3f): %s", set_name,
                    check["first_acceptance_gap"], check["eaglet_first_acceptance"], gap_verdict(check))


def check_drafter_fits(drafter: Eagle3Draft, target: nn.Module) -> None:
    """A drafter for another model would verify fine and accept nothing: refuse it up front."""
    tc, dc = target.config, drafter.config
    problems = []
    if dc.target_hidden_size != tc.hidden_size:
        problems.append(f"hidden size {dc.target_hidden_size} vs the target's {tc.hidden_size}")
    if dc.target_vocab_size != tc.vocab_size:
        problems.append(f"vocabulary {dc.target_vocab_size} vs the target's {tc.vocab_size}")
    n_layers = len(decoder_layers(target))
    bad = [i for i in dc.aux_layer_ids if not 0 <= i <= n_layers]
    if bad:
        problems.append(f"aux layer ids {bad} outside the target's 0..{n_layers}")
    if problems:
        raise ValueError("the drafter does not fit this target: " + "; ".join(problems)
                         + " (pass the target it was trained for with --target)")


# ---------------------------------------------------------------------------------------------
# Table and plot
# ---------------------------------------------------------------------------------------------

def fmt(x: Any, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def format_table(sets: dict[str, dict[str, dict[str, Any]]]) -> str:
    head = (f"{'prompt set':<16} {'method':<16} {'turns':>5} {'tokens':>7} {'tok/s':>8} {'speedup':>8} "
            f"{'ceiling':>8} {'tau':>6} {'identical':>9} {'1st diff':>8}  acceptance per position")
    lines = [head, "-" * len(head)]
    for name, methods in sets.items():
        for m, r in methods.items():
            acc = " ".join(fmt(a, ".2f") for a in r.get("acceptance_rates", []))
            sources = r.get("accepted_from", {})
            if len(sources) > 1:  # a hybrid: who proposed the accepted tokens
                total = sum(sources.values())
                acc += "  (accepted: " + ", ".join(f"{k} {v / total:.0%}" for k, v in sources.items()) + ")"
            lines.append(f"{name:<16} {m:<16} {r['turns']:>5} {r['new_tokens']:>7} {r['tokens_per_s']:>8.2f} "
                         f"{fmt(r.get('speedup'), '.2f') + 'x' if 'speedup' in r else '-':>8} "
                         f"{fmt(r.get('ceiling_speedup'), '.2f') + 'x' if r.get('ceiling_speedup') else '-':>8} "
                         f"{fmt(r.get('tau'), '.2f'):>6} {fmt(r.get('identical_share'), '.0%'):>9} "
                         f"{fmt(r.get('mean_first_divergence'), '.1f'):>8}  {acc}")
        lines += [first_draft_line(name, m, r) for m, r in methods.items() if "first_acceptance_gap" in r]
    return "\n".join(lines)


def first_draft_line(set_name: str, method: str, r: dict[str, Any]) -> str:
    return (f"{set_name}: {method} first-draft acceptance {r['acceptance_rates'][0]:.3f} vs eaglet's chain "
            f"{r['eaglet_first_acceptance']:.3f} (gap {r['first_acceptance_gap']:+.3f}, {gap_verdict(r)})")


def write_plot(sets: dict[str, dict[str, dict[str, Any]]], path: Path, title: str) -> None:
    """Left: acceptance rate per draft position (one line per set and mode). Right: speedup
    over plain greedy (llama.cpp's methods: over llama.cpp's plain decoding, said in the legend)
    per set and method, each bar labelled with its tau."""
    import matplotlib  # slow to import, and only the plot needs it

    matplotlib.use("Agg")  # before pyplot: no display is needed to write a PNG
    import matplotlib.pyplot as plt  # after the backend is chosen
    import matplotlib.ticker  # the axis locators below

    fig, (ax_acc, ax_speed) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, methods in sets.items():
        for m, r in methods.items():
            rates = r.get("acceptance_rates")
            if rates:
                ax_acc.plot(range(1, len(rates) + 1), [x if x is not None else float("nan") for x in rates],
                            marker="o", label=f"{name} {m}")
    ax_acc.set(xlabel="draft position", ylabel="acceptance rate", ylim=(0, 1), title="acceptance per position")
    ax_acc.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax_acc.grid(alpha=0.3)
    if ax_acc.lines:
        ax_acc.legend(fontsize=8)

    names = list(sets)
    methods = [m for m in dict.fromkeys(m for ms in sets.values() for m in ms) if m != BASELINE]
    width = 0.8 / max(1, len(methods))
    for j, m in enumerate(methods):
        xs = [i + (j - (len(methods) - 1) / 2) * width for i in range(len(names))]
        ys = [sets[n].get(m, {}).get("speedup") or 0.0 for n in names]
        over = next((sets[n][m]["speedup_over"] for n in names if sets[n].get(m, {}).get("speedup_over")), None)
        bars = ax_speed.bar(xs, ys, width, label=f"{m} (vs {over})" if over else m)
        for b, n in zip(bars, names):
            tau = sets[n].get(m, {}).get("tau")
            if tau is not None:
                ax_speed.annotate(f"τ {tau:.2f}", (b.get_x() + b.get_width() / 2, b.get_height()),
                                  ha="center", va="bottom", fontsize=7)
    ax_speed.axhline(1.0, color="gray", lw=1, ls="--")
    ax_speed.set_xticks(range(len(names)), names)
    ax_speed.set(ylabel="speedup over plain greedy (or the method in the legend)", title="speedup (bar label: tau)")
    ax_speed.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    with formats.atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
