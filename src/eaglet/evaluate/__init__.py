"""`eaglet eval`: acceptance length and real speedup of a drafter on prompt sets.

For every prompt the same target decodes the same prompt with every method, in a rotating
order so that machine drift (frequency scaling, other jobs) spreads evenly over the methods:
plain greedy, eaglet's engine with the drafter or prompt lookup, Hugging Face generate
(`methods`), llama.cpp's llama-server (`engines`). Each method's sums over a prompt set become its
figures, the table, eval.json and eval.png (`report`); `settings` is how every method decodes,
`tuning` the dtype and threads each runs at (its fastest on this machine, measured).

Entry point: `evaluate(EvalOptions(drafter_path=..., ...)) -> EvalResult`.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import torch
from tqdm import tqdm

from eaglet import formats, ranges
from eaglet.chat import MAX_CHARS_PER_TOKEN, chat_prompt_ids, cut_to_chars, stop_token_ids
from eaglet.drafter import DraftModel
from eaglet.drafter.files import load_drafter_for_target
from eaglet.evaluate.engines import FIRST_DRAFT_GAP, engine_run, engine_servers, first_draft_check, warn_on_gap
from eaglet.evaluate.vllm_methods import vllm_engines
from eaglet.evaluate.methods import (
    PROMPT_LOOKUP_TOKENS,
    Run,
    Variants,
    measured_pass_costs,
    reference_labels,
    run_method,
    variants_for,
    with_implied_methods,
    with_pass_costs,
)
from eaglet.evaluate.report import RESULTS_FILE, EvalResult, MethodTotals, format_table, summarize
from eaglet.evaluate.settings import DecodeSettings
from eaglet.evaluate.tuning import AUTO, Config
from eaglet.evaluate import tuning
from eaglet.decode import measure_drafter_pass, measure_pass_costs, target_runner
from eaglet.options import (
    BASELINE,
    DRAFTER_METHODS,
    LLAMA_CPP_METHODS,
    LOOKUP_METHODS,
    OUTSIDE_METHODS,
    OWN_COUNTERPART,
    EvalOptions,
)
from eaglet.heads import same_embeddings
from eaglet.placement import Placement, placement_from_options
from eaglet.prompts import Prompt, load_prompt_set
from eaglet.target import (
    TargetRef,
    cpu_description,
    decoder_layers,
    dtype_name,
    embedding_weight,
    input_device,
    load_target,
    load_tokenizer,
    max_positions,
    parse_dtype,
    pick_device,
    resolve_target,
    target_source,
)
from eaglet.vllm_engine import EngineOptions, engine_options_from

if TYPE_CHECKING:  # transformers' modelling code loads only with a model
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)

# What callers use; the rest is reached through its module (evaluate.methods, .engines, .report).
__all__ = [
    "evaluate",
    "EvalResult",
    "DecodeSettings",
    "MethodTotals",
    "Run",
    "FIRST_DRAFT_GAP",
    "evaluate_set",
    "Lane",
    "warm_up",
    "run_variant",
    "run_method",
    "summarize",
    "format_table",
    "with_pass_costs",
    "torch_threads",
    "load_prompt_set",
]


def evaluate(options: EvalOptions, progress: bool = True) -> EvalResult:
    """Decode every prompt of every set with plain greedy and each method; sums, table, JSON, plot.
    How every method decodes is `options`' part that `DecodeSettings` checks (max_new_tokens,
    preset, depth, chain_depth, ...). A target whose revision is not the one the drafter records is
    refused unless `other_target`. With `device_map` the target spans devices and the drafter runs
    where its inputs go. llama.cpp's methods run llama-server on `target_gguf` (default: the
    embedded target's GGUF), with `engine_f32` on its weights dequantized to f32. vLLM's methods run
    vLLM's engine on the target with the vLLM options (`eaglet.vllm_engine.engine_options_from`).
    `dtype` and `threads` "auto": each method at its fastest configuration on this machine (`tuning`;
    vLLM: `auto` is bf16 where fast, and its engines use every core)."""
    drafter_path, target, dtype, device, threads, out = (
        options.drafter_path,
        options.target,
        options.dtype,
        options.device,
        options.threads,
        options.out,
    )
    num_prompts, device_map = options.num_prompts, options.device_map
    ranges.at_least(1, num_prompts=num_prompts, threads=None if threads == AUTO else threads)
    if out is not None:
        formats.claim_output(out, "eval")  # not a file, nor another stage's folder: refused before any work
        refuse_other_results(Path(out), drafter_path)
    placed = placement_from_options(device_map, options.max_memory, options.offload_folder, device)
    vllm_options = engine_options_from(options, threads=None if threads == AUTO else threads)
    methods = with_implied_methods(options.methods)
    settings = DecodeSettings(**options.decode_settings())  # checked before anything loads
    sets = prompt_sets_by_name(options.prompt_sets, num_prompts)  # read and checked before any model loads
    configs = tuning.candidates(dtype, threads, pick_device(device).type if placed is None else "placed")
    with torch_threads(configs[0].threads if len(configs) == 1 else None):
        loaded = {
            c.dtype: load_models(drafter_path, target, methods, c.dtype, device, placed, options.other_target)
            for c in configs
        }
        models = next(iter(loaded.values()))
        settings = replace(settings, eos_ids=tuple(sorted(stop_token_ids(models.target, models.tokenizer))))
        vllm_options = replace(
            vllm_options,
            dtype=dtype_name(parse_dtype(dtype, "cpu" if placed else device)),
            max_model_len=vllm_options.max_model_len or max_positions(models.target),
        )
        with outside_engines(
            methods,
            drafter_path,
            models,
            options.target_gguf,
            out,
            settings,
            options.engine_f32,
            vllm_options,
            first_turn_ids(models.tokenizer, first_prompt(sets), max_positions(models.target)),
        ) as (runners, engines):
            variants, lanes, tuned = tuned_lanes(variants_for(methods, settings), configs, loaded)
            tuned["costs"] = pass_costs_record(lanes[BASELINE], variants)
            warm_up(
                variants,
                models.target,
                models.drafter,
                models.tokenizer,
                first_prompt(sets),
                servers=runners,
                lanes=lanes,
            )
            results, records = measure(sets, variants, models, runners, engines, progress, lanes)
        skipped = warn_skipped(records, max_positions(models.target))
        config = run_config(
            drafter_path,
            models,
            dtype,
            device_map,
            options.prompt_sets,
            num_prompts,
            methods,
            variants,
            skipped,
            engines,
            tuned,
        )
    result = EvalResult(config, results, records)
    if out is not None:
        result.save(
            Path(out),
            options.plot,
            title=f"drafter {drafter_path} | target {Path(models.ref.name).name} | {dtype}, "
            f"{settings.max_new_tokens} new tokens, T={settings.temperature:g}",
        )
    return result


# ---------------------------------------------------------------------------------------------
# The target and the drafter
# ---------------------------------------------------------------------------------------------


@dataclass
class Models:
    """The target (placed), its tokenizer and the drafter (None when no method drafts), checked
    to fit each other."""

    ref: TargetRef
    target: PreTrainedModel
    tokenizer: Any
    drafter: DraftModel | None
    drafter_revision: str | None  # the revision of the target the drafter was trained for, where recorded


def load_models(
    drafter_path: str | Path,
    target: str | None,
    methods: Sequence[str],
    dtype: str,
    device: str | None,
    placed: Placement | None,
    other_target: bool,
) -> Models:
    drafter, target_spec, trained_for = None, target, None
    if any(m in DRAFTER_METHODS for m in methods):
        drafter, target_spec, trained_for = load_drafter_for_target(drafter_path, target)
    ref = resolve_target(target_spec, target_source(target, f"{drafter_path}: the target its config.json records"))
    if trained_for and not ref.is_revision(trained_for) and not other_target:
        raise ValueError(
            f"{drafter_path}: trained for a target of revision {trained_for}; --target {ref.name} "
            f"has revision {ref.revision} (other weights): its figures would not be this drafter's "
            "on its own target; pass the drafter's own target, or --other-target to measure it on "
            "this one anyway"
        )
    tokenizer = load_tokenizer(ref)
    torch_dtype = parse_dtype(dtype)
    model = load_target(ref, torch_dtype, pick_device(device), placed)
    if drafter is not None:
        check_drafter_fits(drafter, model)
        if not other_target:
            refuse_other_embeddings(drafter, model, drafter_path)
        # the drafter drafts where the target's inputs (and its aux states) go
        drafter = drafter.to(device=input_device(model), dtype=torch_dtype).eval()
    return Models(ref, model, tokenizer, drafter, trained_for)


def refuse_other_embeddings(drafter: DraftModel, target: PreTrainedModel, drafter_path: str | Path) -> None:
    """A drafter carries its target's embeddings, frozen in training: other ones are another
    target's (the revision check misses a drafter that records none) or weights changed since."""
    copy, own = drafter.state_dict().get("embed_tokens.weight"), embedding_weight(target).detach()
    if own.device.type == "meta":  # offloaded to disk by a device map: nothing here to compare with
        return
    if copy is not None and not same_embeddings(copy.to(own.device), own):
        raise ValueError(
            f"{drafter_path}: its embed_tokens.weight is not the target's embeddings (a drafter keeps "
            "its target's, frozen in training): a drafter of another target, or its weights were "
            "changed since; pass the target it was trained for with --target, or --other-target to "
            "measure it on this one anyway"
        )


def check_drafter_fits(drafter: DraftModel, target: PreTrainedModel) -> None:
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
        raise ValueError(
            "the drafter does not fit this target: "
            + "; ".join(problems)
            + " (pass the target it was trained for with --target)"
        )


# An outside engine's method on one prompt (llama.cpp's servers, vLLM's engines): ids, settings -> Run
Runner = Callable[[list[int], DecodeSettings], Run]


@contextlib.contextmanager
def outside_engines(
    methods: Sequence[str],
    drafter_path: str | Path,
    models: Models,
    target_gguf: str | Path | None,
    out: str | Path | None,
    s: DecodeSettings,
    engine_f32: bool,
    vllm_options: EngineOptions,
    cost_prompt: list[int],
) -> Iterator[tuple[dict[str, Runner], dict[str, Any]]]:
    """The engines of the methods that run outside eaglet's process, started for the whole run: a
    llama-server per llama.cpp method, a vLLM engine per vLLM method. Yields each such method's
    runner and what eval.json records of the engines ({"llama_cpp": ..., "vllm": ...})."""
    with (
        engine_servers(
            methods,
            drafter_path,
            models.ref.name,
            target_gguf,
            out,
            s,
            torch.get_num_threads(),
            max_positions(models.target),
            engine_f32,
        ) as (servers, llama),
        vllm_engines(methods, drafter_path, models.drafter, models.ref.path, out, s, vllm_options, cost_prompt) as (
            vllm_runners,
            vllm,
        ),
    ):
        runners: dict[str, Runner] = {m: partial(engine_run, server, m) for m, server in servers.items()}
        yield {**runners, **vllm_runners}, {k: v for k, v in (("llama_cpp", llama), ("vllm", vllm)) if v}


def first_turn_ids(tokenizer: Any, prompt: Prompt, positions: int) -> list[int]:
    """The prompt's first turn as the target reads it (cut as `turn_prompt_ids` cuts it), its last
    half of the positions at most: an untimed warm-up or a pass-cost prompt, whatever its length."""
    history = [*prompt.context, {"role": "user", "content": prompt.turns[0]}]
    return turn_prompt_ids(tokenizer, history, positions)[0][-(positions // 2) :]


@dataclass
class Lane:
    """What one variant runs on: the target and drafter in its dtype, and its CPU threads."""

    target: PreTrainedModel
    drafter: DraftModel | None
    threads: int | None
    config: Config


def tuned_lanes(
    variants: Variants, configs: list[Config], loaded: dict[str, Models]
) -> tuple[Variants, dict[str, Lane], dict[str, Any]]:
    """Each variant's lane: with several candidate configurations, the one where a pass of the
    variant's size is cheapest, from the target's pass costs timed under each (`tuning`), which also
    serve the variants that admit tokens by cost; with one, that one. Returns the variants (pass
    costs filled in), their lanes and what eval.json records of the choice."""
    drafter = next(iter(loaded.values())).drafter
    if len(configs) == 1:
        c = configs[0]
        m = loaded[c.dtype]
        with torch_threads(c.threads):
            variants = with_pass_costs(variants, m.target, m.drafter)
        lanes = {label: Lane(m.target, m.drafter, c.threads, c) for label in variants}
        return variants, lanes, {"configs": {label: c.label for label in variants}}
    max_q = max(2, *(tuning.verify_tokens(method, s, drafter) for method, s in variants.values()))
    costs: dict[Config, list[float]] = {}
    for c in configs:
        with torch_threads(c.threads):
            costs[c] = measure_pass_costs(loaded[c.dtype].target, max_q=max_q)
        log.info(
            "target pass costs at %s (ms, 1..%d tokens): %s",
            c.label,
            max_q,
            " ".join(f"{1000 * x:.0f}" for x in costs[c]),
        )
    chosen = tuning.choose(variants, costs, drafter)
    # a variant the choice leaves out (a llama.cpp method, run by its server) keeps the first lane
    chosen = {label: chosen.get(label, configs[0]) for label in variants}
    variants = {
        label: (
            method,
            replace(s, pass_costs=tuple(costs[chosen[label]]))
            if method in LOOKUP_METHODS and s.admission == "cost" and not s.pass_costs
            else s,
        )
        for label, (method, s) in variants.items()
    }
    lanes = {label: Lane(loaded[c.dtype].target, loaded[c.dtype].drafter, c.threads, c) for label, c in chosen.items()}
    return (
        variants,
        lanes,
        {
            "configs": {label: c.label for label, c in chosen.items()},
            "pass_costs_by_config_s": {c.label: costs[c] for c in configs},
        },
    )


def pass_costs_record(lane: Lane, variants: Variants) -> dict[str, Any]:
    """What a pass costs on plain greedy's lane (its dtype and threads), for eval.json and the line
    under the table: the target over 1..q new tokens (q: the largest any variant verifies, at
    least 4) as the decoder runs it, and the drafter's cycle after one new position."""
    with torch_threads(lane.threads):
        largest = max(4, *(tuning.verify_tokens(method, s, lane.drafter) for method, s in variants.values()))
        record: dict[str, Any] = {
            "config": lane.config.label,
            "runner": type(target_runner(lane.target)).__name__,
            "target_pass_s": measure_pass_costs(lane.target, max_q=min(largest, 16)),
        }
        if lane.drafter is not None:
            record["drafter_pass_s"] = measure_drafter_pass(lane.drafter)
    return record


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


# ---------------------------------------------------------------------------------------------
# The evaluation loop
# ---------------------------------------------------------------------------------------------


def run_variant(
    method: str,
    target: PreTrainedModel,
    drafter: DraftModel | None,
    ids: list[int],
    s: DecodeSettings,
    servers: dict[str, Runner] | None = None,
) -> Run:
    """`run_method`, or the method's outside engine (`servers`: its runner, by method) for the
    methods of llama.cpp and vLLM."""
    if method in OUTSIDE_METHODS:
        if not servers or method not in servers:
            raise ValueError(f"{method}: no engine is running for it")
        return servers[method](ids, s)
    return run_method(method, target, drafter, ids, s)


def first_prompt(sets: dict[str, list[Prompt]]) -> Prompt:
    return next(iter(sets.values()))[0]


def warm_up(
    variants: Variants,
    target: PreTrainedModel,
    drafter: DraftModel | None,
    tokenizer,
    prompt: Prompt,
    drafters: dict[str, DraftModel] | None = None,
    servers: dict[str, Runner] | None = None,
    lanes: dict[str, Lane] | None = None,
) -> None:
    """One short untimed run per variant: first calls pay for allocations and kernel selection."""
    positions = max_positions(target)
    ids = first_turn_ids(tokenizer, prompt, positions)  # untimed: any prompt that fits will do
    for label, (method, s) in variants.items():
        run_in_lane(
            label,
            method,
            target,
            (drafters or {}).get(label, drafter),
            ids,
            replace(s, max_new_tokens=min(8, s.max_new_tokens)),
            servers,
            lanes,
        )


def run_in_lane(
    label: str,
    method: str,
    target: PreTrainedModel,
    drafter: DraftModel | None,
    ids: list[int],
    s: DecodeSettings,
    servers: dict[str, Runner] | None,
    lanes: dict[str, Lane] | None,
) -> Run:
    """`run_variant` on the variant's lane (its dtype's models, its threads), where it has one."""
    lane = (lanes or {}).get(label)
    if lane is None:
        return run_variant(method, target, drafter, ids, s, servers)
    with torch_threads(lane.threads):
        return run_variant(method, lane.target, lane.drafter, ids, s, servers)


def rotated(labels: list[str], k: int) -> list[str]:
    k %= len(labels)
    return labels[k:] + labels[:k]


def turn_prompt_ids(tokenizer, history: list[dict[str, str]], positions: int) -> tuple[list[int], bool]:
    """The turn's prompt ids, and whether the prompt was longer still. A history of more characters
    than `positions` tokens could span (`MAX_CHARS_PER_TOKEN` each) is tokenized only up to that
    many characters: one huge prompt costs memory and time by what the target could hold, not by
    its size, and is skipped as too long."""
    cut, beyond = cut_to_chars(history, positions * MAX_CHARS_PER_TOKEN)
    return chat_prompt_ids(tokenizer, cut), beyond


def evaluate_set(
    prompts: list[Prompt],
    variants: Variants,
    target: PreTrainedModel,
    drafter: DraftModel | None,
    tokenizer,
    on_turn: Callable[[dict[str, MethodTotals]], None],
    records: list[dict[str, Any]],
    drafters: dict[str, DraftModel] | None = None,
    servers: dict[str, Runner] | None = None,
    lanes: dict[str, Lane] | None = None,
) -> dict[str, MethodTotals]:
    """Decode every turn of every prompt with each variant, in a rotating order; sums per label.
    The next turn's history holds plain greedy's answer, so every variant sees the same prompt.
    `drafters`: another drafter for some labels (drafters compared in one run); `servers`: the
    llama-servers of llama.cpp's methods; `lanes`: the models and threads of some labels (`tuned_lanes`)."""
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
            ids, beyond = turn_prompt_ids(tokenizer, history, positions)
            if beyond or len(ids) >= positions:  # no room to answer; later turns only grow
                for t in range(turn_no, len(p.turns)):
                    records.append(
                        {
                            "set": p.set_name,
                            "id": p.id,
                            "turn": t,
                            "prompt_tokens": len(ids),
                            "skipped": f"prompt of {'over ' if beyond else ''}{len(ids)} tokens leaves no room "
                            f"in the target's {positions} positions",
                        }
                    )
                    on_turn(totals)
                break
            runs = {}
            for label in rotated(labels, k):
                method, settings = variants[label]
                runs[label] = run_in_lane(
                    label, method, target, (drafters or {}).get(label, drafter), ids, settings, servers, lanes
                )
            k += 1
            for label in labels:
                totals[label].add(
                    runs[label], runs[references[label]].tokens if greedy and label in references else None
                )
            records.append(
                {
                    "set": p.set_name,
                    "id": p.id,
                    "turn": turn_no,
                    "prompt_tokens": len(ids),
                    "methods": {
                        m: {
                            "new_tokens": len(r.tokens),
                            "wall_s": round(r.wall_s, 4),
                            "target_forwards": r.target_forwards,
                            **(
                                {"identical": r.tokens == runs[references[m]].tokens}
                                if greedy and m in references
                                else {}
                            ),
                        }
                        for m, r in runs.items()
                    },
                }
            )
            answer = tokenizer.decode(runs[BASELINE].tokens, skip_special_tokens=True)
            history.append({"role": "assistant", "content": answer})
            on_turn(totals)
    return totals


def measure(
    sets: dict[str, list[Prompt]],
    variants: Variants,
    models: Models,
    servers: dict[str, Runner],
    engines: dict[str, Any],
    progress: bool,
    lanes: dict[str, Lane] | None = None,
) -> tuple[dict[str, dict[str, dict[str, Any]]], list[dict[str, Any]]]:
    """Each set's figures by method, and one record per prompt turn; a progress bar over all turns."""
    s = variants[BASELINE][1]
    n_turns = sum(len(p.turns) for prompts in sets.values() for p in prompts)
    results: dict[str, dict[str, dict[str, Any]]] = {}
    records: list[dict[str, Any]] = []
    with (
        tqdm(total=n_turns, desc="eval", unit="turn", disable=not progress, dynamic_ncols=True) as bar,
        torch.inference_mode(),
    ):
        for spec, prompts in sets.items():
            totals = evaluate_set(
                prompts,
                variants,
                models.target,
                models.drafter,
                models.tokenizer,
                progress_step(bar),
                records,
                servers=servers,
                lanes=lanes,
            )
            if totals[BASELINE].turns == 0:
                raise ValueError(
                    f"prompt set {spec!r}: every prompt is too long for the target's "
                    f"{max_positions(models.target)} positions"
                )
            name = prompts[0].set_name
            results[name] = summarize(totals, s.temperature <= 0, reference_labels(variants))
            for label, lane in (lanes or {}).items():
                if variants[label][0] not in OUTSIDE_METHODS:
                    results[name][label]["config"] = lane.config.label
            for method, own in OWN_COUNTERPART.items():
                weights = engines.get("llama_cpp", {}).get("target_weights") if method in LLAMA_CPP_METHODS else None
                warn_on_gap(name, first_draft_check(results[name], weights, s.floor, method, own), method)
    return results, records


def progress_step(bar: tqdm) -> Callable[[dict[str, MethodTotals]], None]:
    """After each turn: the bar one step on, showing each method's speedup so far."""

    def on_turn(totals: dict[str, MethodTotals]) -> None:
        bar.update(1)
        plain = totals[BASELINE]
        bar.set_postfix(
            {
                m: f"{t.tokens_per_s / plain.tokens_per_s:.2f}x"
                for m, t in totals.items()
                if m != BASELINE and plain.tokens_per_s > 0
            }
        )

    return on_turn


def warn_skipped(records: list[dict[str, Any]], positions: int) -> int:
    """How many prompt turns were too long to answer, said once."""
    skipped = sum("skipped" in r for r in records)
    if skipped:
        log.warning(
            "%d prompt turn(s) skipped: longer than the target's %d positions (listed in eval.json)", skipped, positions
        )
    return skipped


def prompt_sets_by_name(specs: Sequence[str], num_prompts: int | None) -> dict[str, list[Prompt]]:
    """Each --prompts set's prompts; two sets whose results would share a name are refused (one's
    results would replace or mix with the other's)."""
    sets = {spec: load_prompt_set(spec, num_prompts) for spec in specs}
    named: dict[str, str] = {}
    for spec, prompts in sets.items():
        name = prompts[0].set_name
        if name in named:
            raise ValueError(
                f"--prompts {named[name]} and {spec}: both sets are named {name!r} in the results; rename one file"
            )
        named[name] = spec
    return sets


def refuse_other_results(out: Path, drafter_path: str | Path) -> None:
    """An eval folder holds one drafter's results: a rerun of its eval replaces them, another
    drafter's would overwrite them unseen."""
    path = out / RESULTS_FILE
    if not path.exists():
        return
    try:
        recorded = formats.read_json(path)["config"]["drafter"]
    except (ValueError, KeyError, TypeError):
        recorded = None
    if not isinstance(recorded, str) or os.path.realpath(recorded) != os.path.realpath(drafter_path):
        raise FileExistsError(
            f"--out {out}: {path.name} holds the results of "
            f"{'another drafter, ' + repr(recorded) if isinstance(recorded, str) else 'another run'}"
            f"; nothing was written: choose another --out (or remove {path})"
        )


def run_config(
    drafter_path: str | Path,
    models: Models,
    dtype: str,
    device_map: str | None,
    prompt_sets: Sequence[str],
    num_prompts: int | None,
    methods: Sequence[str],
    variants: Variants,
    skipped: int,
    engines: dict[str, Any],
    tuned: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """What eval.json records of the run: what was measured, on what, and how it decoded."""
    return {
        "drafter": str(drafter_path),
        "target": models.ref.name,
        "target_revision": models.ref.revision,
        "drafter_target_revision": models.drafter_revision,
        "dtype": dtype,
        "device": str(input_device(models.target)),
        "device_map": device_map,
        "threads": torch.get_num_threads(),
        "cpu": cpu_description(),
        "prompt_sets": list(prompt_sets),
        "num_prompts": num_prompts,
        "methods": [BASELINE, *methods],
        **variants[BASELINE][1].record(),
        "prompt_lookup_num_tokens": PROMPT_LOOKUP_TOKENS,
        "pass_costs_s": measured_pass_costs(variants),
        "skipped_turns": skipped,
        **(tuned or {}),
        **engines,
    }
