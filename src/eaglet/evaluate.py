"""`eaglet eval`: acceptance length and real speedup of a drafter on prompt sets.

For every prompt the same target decodes the same prompt with every method, in a rotating
order so that machine drift (frequency scaling, other jobs) spreads evenly over the methods:

    plain          eaglet's own greedy loop with a KV cache: the baseline of every speedup
    chain, tree    speculative decoding with the drafter (`decode.speculative_generate`)
    prompt-lookup  Hugging Face `generate(prompt_lookup_num_tokens=10)`, the no-training baseline
    hf-greedy      Hugging Face `generate` greedy: prompt lookup's own-engine baseline

Speedup = (method's new tokens / its seconds) / (plain's new tokens / its seconds), summed over
a prompt set. At temperature 0 every method must reproduce plain's tokens; in fp32 they do
exactly, in bf16 matmuls of different shapes round differently, so the share of identical
outputs and the mean position of the first divergence are reported instead of assumed.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import logging
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn
from tqdm import tqdm

from eaglet import embedded, formats, ranges
from eaglet.data import EMBEDDED_SHAREGPT, Message, ReadStats, chat_prompt_ids, iter_records, to_messages
from eaglet.decode import (DecodeStats, Eagle3Proposer, HybridProposer, NgramProposer, Proposer, max_positions,
                           measure_pass_costs, plain_generate, speculative_generate, truncate_at_eos)
from eaglet.draft_model import Eagle3Draft
from eaglet.export import load_drafter_for_target
from eaglet.regen import stop_token_ids
from eaglet.options import (ADMISSIONS, BASELINE, DEFAULT_METHODS, DEFAULT_PRESET, ENGINE_METHODS, HF_METHODS,
                            HYBRID_DRAFTS, METHODS, PRESETS, PROMPT_SETS)
from eaglet.placement import placement_from_options
from eaglet.target import (decoder_layers, generation_config, input_device, load_target, load_tokenizer, parse_dtype,
                           pick_device, resolve_target)

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
# The embedded ShareGPT's first records feed `eaglet prepare` / `eaglet regen` by default; the
# held-out prompts come from far behind them.
SHAREGPT_HELDOUT_START = 15_000  # of the 17,671 complete records the embedded file holds
RESULTS_FILE = "eval.json"
PLOT_FILE = "eval.png"


# ---------------------------------------------------------------------------------------------
# Prompt sets
# ---------------------------------------------------------------------------------------------

@dataclass
class Prompt:
    """A conversation to continue: fixed `context` messages, then each user turn in `turns`
    is answered in order (the next turn sees the target's greedy answer to the previous one)."""

    set_name: str
    id: str
    turns: list[str]
    context: list[Message] = field(default_factory=list)


def mtbench_prompts(both_turns: bool) -> Iterator[Prompt]:
    name = "mtbench-2turn" if both_turns else "mtbench"
    with open(embedded.mtbench_questions()) as f:
        for line in f:
            q = json.loads(line)
            turns = q["turns"] if both_turns else q["turns"][:1]
            yield Prompt(name, str(q["question_id"]), list(turns))


def humaneval_prompts() -> Iterator[Prompt]:
    with gzip.open(embedded.humaneval_problems(), "rt") as f:
        for line in f:
            p = json.loads(line)
            yield Prompt("humaneval", p["task_id"], [p["prompt"]])


def sharegpt_prompts(start: int = SHAREGPT_HELDOUT_START) -> Iterator[Prompt]:
    """First user turns of embedded ShareGPT chats from `start` on (held out from training)."""
    stats = ReadStats()
    for n, (sid, record) in enumerate(iter_records(EMBEDDED_SHAREGPT, stats)):
        if n < start:
            continue
        messages = to_messages(record, stats)
        if isinstance(messages, str):
            continue
        first_user = next(m for m in messages if m["role"] == "user")
        yield Prompt("sharegpt", sid, [first_user["content"]])


def jsonl_prompts(path: Path) -> Iterator[Prompt]:
    """Any JSONL: one prompt per line, `{"prompt": str}`, `{"turns": [str, ...]}` or
    `{"messages": [...]}` ending with a user message; optional `"id"`."""
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, 1):
            where = f"{path}:{line_no}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{where}: not UTF-8 ({e})") from None
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: invalid JSON ({e})") from None
            pid = str(rec.get("id", line_no)) if isinstance(rec, dict) else str(line_no)
            if isinstance(rec, dict) and isinstance(rec.get("prompt"), str):
                yield Prompt(path.stem, pid, [rec["prompt"]])
            elif isinstance(rec, dict) and isinstance(rec.get("turns"), list) and rec["turns"]:
                yield Prompt(path.stem, pid, [str(t) for t in rec["turns"]])
            elif isinstance(rec, dict) and isinstance(rec.get("messages"), list) and rec["messages"]:
                msgs = rec["messages"]
                if not all(isinstance(m, dict) and "role" in m and "content" in m for m in msgs):
                    raise ValueError(f"{where}: field 'messages': every message needs 'role' and 'content'")
                if msgs[-1]["role"] != "user":
                    raise ValueError(f"{where}: field 'messages': the last message must be the user's, "
                                     f"got {msgs[-1]['role']!r}")
                yield Prompt(path.stem, pid, [msgs[-1]["content"]], [dict(m) for m in msgs[:-1]])
            else:
                raise ValueError(f"{where}: expected a 'prompt' string, a 'turns' list or a 'messages' list")


def load_prompt_set(spec: str, limit: int | None) -> list[Prompt]:
    """`mtbench`, `mtbench-2turn`, `humaneval`, `sharegpt`, or a path to a JSONL of prompts."""
    if spec in ("mtbench", "mtbench-2turn"):
        source: Iterator[Prompt] = mtbench_prompts(spec == "mtbench-2turn")
    elif spec == "humaneval":
        source = humaneval_prompts()
    elif spec == "sharegpt":
        source = sharegpt_prompts()
    elif Path(spec).is_file():
        source = jsonl_prompts(Path(spec))
    else:
        raise ValueError(f"--prompts {spec!r}: not one of {', '.join(PROMPT_SETS)} and not a file")
    out = []
    for p in source:
        if limit is not None and len(out) >= limit:
            break
        out.append(p)
    if not out:
        where = f" after record {SHAREGPT_HELDOUT_START} of the embedded ShareGPT" if spec == "sharegpt" else ""
        raise ValueError(f"--prompts {spec!r}: no usable prompts{where}")
    return out


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


def rotated(labels: list[str], k: int) -> list[str]:
    k %= len(labels)
    return labels[k:] + labels[:k]


def evaluate_set(prompts: list[Prompt], variants: Variants, target: nn.Module, drafter: Eagle3Draft | None,
                 tokenizer, on_turn: Callable[[dict[str, MethodTotals]], None],
                 records: list[dict[str, Any]], drafters: dict[str, Eagle3Draft] | None = None
                 ) -> dict[str, MethodTotals]:
    """Decode every turn of every prompt with each variant, in a rotating order; sums per label.
    The next turn's history holds plain greedy's answer, so every variant sees the same prompt.
    `drafters`: another drafter for some labels (drafters compared in one run)."""
    labels = list(variants)
    totals = {label: MethodTotals() for label in labels}
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
                runs[label] = run_method(method, target, (drafters or {}).get(label, drafter), ids, settings)
            k += 1
            reference = runs[BASELINE].tokens if greedy else None
            for label in labels:
                totals[label].add(runs[label], reference if label != BASELINE else None)
            records.append({
                "set": p.set_name, "id": p.id, "turn": turn_no, "prompt_tokens": len(ids),
                "methods": {m: {"new_tokens": len(r.tokens), "wall_s": round(r.wall_s, 4),
                                "target_forwards": r.target_forwards,
                                **({"identical": r.tokens == reference} if reference is not None and m != BASELINE
                                   else {})}
                            for m, r in runs.items()}})
            answer = tokenizer.decode(runs[BASELINE].tokens, skip_special_tokens=True)
            history.append({"role": "assistant", "content": answer})
            on_turn(totals)
    return totals


def summarize(totals: dict[str, MethodTotals], compared: bool) -> dict[str, dict[str, Any]]:
    """Each label's figures, speedups against plain greedy; `compared`: report identical outputs."""
    plain = totals[BASELINE]
    return {label: t.summary(plain if label != BASELINE else None, compared and label != BASELINE)
            for label, t in totals.items()}


def warm_up(variants: Variants, target: nn.Module, drafter: Eagle3Draft | None, tokenizer, prompt: Prompt,
            drafters: dict[str, Eagle3Draft] | None = None) -> None:
    """One short untimed run per variant: first calls pay for allocations and kernel selection."""
    ids = chat_prompt_ids(tokenizer, [*prompt.context, {"role": "user", "content": prompt.turns[0]}])
    ids = ids[-(max_positions(target) // 2):]  # untimed: any prompt that fits will do
    for label, (method, s) in variants.items():
        run_method(method, target, (drafters or {}).get(label, drafter), ids,
                   replace(s, max_new_tokens=min(8, s.max_new_tokens)))


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
             max_memory: str | None = None, offload_folder: str | None = None) -> EvalResult:
    """Decode every prompt of every set with plain greedy and each method; sums, table, JSON, plot.
    A target whose revision is not the one the drafter records is refused unless `other_target`.
    With `device_map` the target spans devices and the drafter runs where its inputs go."""
    ranges.at_least(1, num_prompts=num_prompts, threads=threads)
    placed = placement_from_options(device_map, max_memory, offload_folder, device)
    methods = list(dict.fromkeys(methods))
    for m in methods:
        if m not in METHODS:
            raise ValueError(f"--methods: unknown method {m!r}; choose from {', '.join(METHODS)}")
    with torch_threads(threads):
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

        variants = with_pass_costs(variants_for(methods, s), model)
        warm_up(variants, model, drafter, tokenizer, next(iter(sets.values()))[0])
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
                totals = evaluate_set(prompts, variants, model, drafter, tokenizer, on_turn, records)
                if totals[BASELINE].turns == 0:
                    raise ValueError(f"prompt set {spec!r}: every prompt is too long for the target's "
                                     f"{max_positions(model)} positions")
                results[name] = summarize(totals, compared=s.temperature <= 0)
        bar.close()
        skipped = [r for r in records if "skipped" in r]
        if skipped:
            log.warning("%d prompt turn(s) skipped: longer than the target's %d positions (listed in eval.json)",
                        len(skipped), max_positions(model))

        config = {"drafter": str(drafter_path), "target": ref.name, "target_revision": ref.revision,
                  "drafter_target_revision": trained_for,
                  "dtype": dtype, "device": str(dev), "device_map": device_map, "threads": torch.get_num_threads(),
                  "prompt_sets": list(prompt_sets), "num_prompts": num_prompts, "methods": [BASELINE, *methods],
                  "max_new_tokens": s.max_new_tokens, "temperature": s.temperature, "top_p": s.top_p,
                  "tree": {"depth": s.depth, "top_k": s.top_k, "total_tokens": s.total_tokens},
                  "chain_depth": s.chain_depth, "min_draft_prob": s.min_draft_prob,
                  "prompt_lookup_num_tokens": PROMPT_LOOKUP_TOKENS, "seed": s.seed,
                  "hybrid": {"draft": s.hybrid_draft, "chain_depth": s.hybrid_chain_depth, "drop_rivals": s.drop_rivals,
                             "lookup_tokens": s.lookup_tokens, "max_ngram": s.max_ngram, "admission": s.admission},
                  "pass_costs_s": list(next((vs.pass_costs for _, vs in variants.values() if vs.pass_costs), ())),
                  "skipped_turns": len(skipped)}
        result = EvalResult(config, results, records)
        if out is not None:
            result.save(Path(out), plot, title=f"drafter {drafter_path} | target {Path(ref.name).name} | {dtype}, "
                                               f"{s.max_new_tokens} new tokens, T={s.temperature:g}")
        return result


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
    head = (f"{'prompt set':<16} {'method':<14} {'turns':>5} {'tokens':>7} {'tok/s':>8} {'speedup':>8} "
            f"{'ceiling':>8} {'tau':>6} {'identical':>9} {'1st diff':>8}  acceptance per position")
    lines = [head, "-" * len(head)]
    for name, methods in sets.items():
        for m, r in methods.items():
            acc = " ".join(fmt(a, ".2f") for a in r.get("acceptance_rates", []))
            sources = r.get("accepted_from", {})
            if len(sources) > 1:  # a hybrid: who proposed the accepted tokens
                total = sum(sources.values())
                acc += "  (accepted: " + ", ".join(f"{k} {v / total:.0%}" for k, v in sources.items()) + ")"
            lines.append(f"{name:<16} {m:<14} {r['turns']:>5} {r['new_tokens']:>7} {r['tokens_per_s']:>8.2f} "
                         f"{fmt(r.get('speedup'), '.2f') + 'x' if 'speedup' in r else '-':>8} "
                         f"{fmt(r.get('ceiling_speedup'), '.2f') + 'x' if r.get('ceiling_speedup') else '-':>8} "
                         f"{fmt(r.get('tau'), '.2f'):>6} {fmt(r.get('identical_share'), '.0%'):>9} "
                         f"{fmt(r.get('mean_first_divergence'), '.1f'):>8}  {acc}")
    return "\n".join(lines)


def write_plot(sets: dict[str, dict[str, dict[str, Any]]], path: Path, title: str) -> None:
    """Left: acceptance rate per draft position (one line per set and mode). Right: speedup
    over plain greedy per set and method, each bar labelled with its tau."""
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
        bars = ax_speed.bar(xs, ys, width, label=m)
        for b, n in zip(bars, names):
            tau = sets[n].get(m, {}).get("tau")
            if tau is not None:
                ax_speed.annotate(f"τ {tau:.2f}", (b.get_x() + b.get_width() / 2, b.get_height()),
                                  ha="center", va="bottom", fontsize=7)
    ax_speed.axhline(1.0, color="gray", lw=1, ls="--")
    ax_speed.set_xticks(range(len(names)), names)
    ax_speed.set(ylabel="speedup over plain greedy", title="speedup (bar label: tau)")
    ax_speed.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    with formats.atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
