"""vLLM's methods in `eaglet eval`: vLLM's own engine on the target, beside eaglet's decoding.

    vllm                                    plain greedy: the baseline of vLLM's speculative methods
    vllm-ngram                              vLLM's n-gram proposer (prompt lookup in the engine)
    vllm-eagle3, vllm-p-eagle, vllm-dflash  the drafter, exported for vLLM (speculators format) and served
                                            by it: the method named after the drafter's family

One engine per method (`eaglet.vllm_engine`: the offline `vllm.LLM` in vLLM's own venv), all running
for the whole evaluation, so they rotate with the other methods per prompt; one request at a time.
Wall time is the engine's `generate` call as the engine's process measures it (prefill included,
as for eaglet's methods); accepted tokens per draft position are vLLM's own counters, read before
and after each request. Each engine's draft length is eaglet's for the same method: the chain depth
for EAGLE-3 (so its first-draft acceptance is comparable with eaglet's chain), the block for the
parallel families, --lookup-tokens and --max-ngram for n-gram lookup.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from eaglet import families, formats
from eaglet.decode import DecodeStats, truncate_at_eos
from eaglet.drafter import DraftModel
from eaglet.drafter.files import read_drafter, write_engine_folder
from eaglet.evaluate.methods import Run
from eaglet.evaluate.settings import DecodeSettings
from eaglet.options import VLLM_BASELINE, VLLM_FAMILY_METHODS, VLLM_METHODS
from eaglet.vllm_engine import EngineOptions, VllmEngine, installed_version, refuse_unserved, vllm_engine

log = logging.getLogger(__name__)

DRAFTER_FOLDER = "vllm-drafter"  # in --out: the export vLLM's drafter methods ran
VLLM_LOGS = "vllm-logs"  # in --out: each engine's log


def speculative_config(
    method: str, s: DecodeSettings, export: Path | None, drafter: DraftModel | None
) -> dict[str, Any] | None:
    """vLLM's speculative config of a method (None for plain decoding)."""
    if method == VLLM_BASELINE:
        return None
    if method == "vllm-ngram":
        return {
            "method": "ngram",
            "num_speculative_tokens": s.lookup_tokens,
            "prompt_lookup_max": s.max_ngram,
            "prompt_lookup_min": 1,
        }
    family = families.family(VLLM_FAMILY_METHODS[method])
    assert export is not None and drafter is not None
    drafts = family.drafts_per_pass(drafter.config.block_size) if family.parallel else s.chain
    return family.vllm_speculative_config(str(export), drafts)


def refuse_unfit(methods: Sequence[str], drafter: DraftModel | None, version: str) -> None:
    """Before any engine starts: a drafter method needs a drafter of its family, and a vLLM that
    serves that family."""
    for method in methods:
        if method not in VLLM_FAMILY_METHODS:
            continue
        family = VLLM_FAMILY_METHODS[method]
        have = None if drafter is None else drafter.config.family
        if have != family:
            mine = f"--methods vllm-{have}" if have else "a drafter"
            raise ValueError(f"method {method} serves a {family} drafter; this drafter is {have}: use {mine}")
        refuse_unserved(family, version)


def vllm_run(engine: VllmEngine, method: str, ids: list[int], s: DecodeSettings) -> Run:
    """One answer from the engine in eval's terms: a step that accepted m drafted tokens is one
    target pass for m + 1 tokens, so the target's passes are the tokens generated less the drafted
    ones accepted (the prefill counted as one, as eaglet counts it)."""
    done = engine.generate([ids], s.max_new_tokens, s.eos_ids, s.temperature, s.top_p, s.seed)
    generated = done.outputs[0]
    tokens, _ = truncate_at_eos(generated, set(s.eos_ids))
    per_position = done.accepted_per_position
    accepted = sum(per_position)
    forwards = max(1, len(generated) - accepted)
    if not done.drafts:
        return Run(tokens, done.seconds, forwards)
    stats = DecodeStats(
        new_tokens=len(tokens),
        target_forwards=forwards,
        verify_forwards=done.drafts,
        position_reached=[done.drafts, *per_position[:-1]],
        position_accepted=per_position,
        wall_s=done.seconds,
        accepted_from={method: accepted},
    )
    return Run(tokens, done.seconds, forwards, stats)


def engine_pass_costs(engine: VllmEngine, prompt: list[int], sizes: Sequence[int]) -> dict[str, Any]:
    """The plain engine's step over q new tokens after a cached prompt, for each q in `sizes`, and
    what a whole request of one token costs (`VllmEngine.pass_costs`)."""
    return engine.pass_costs(prompt, list(dict.fromkeys(prompt)) or [0], sizes)


@contextlib.contextmanager
def vllm_engines(
    methods: Sequence[str],
    drafter_path: str | Path,
    drafter: DraftModel | None,
    target: str,
    out: str | Path | None,
    s: DecodeSettings,
    options: EngineOptions,
    cost_prompt: list[int],
) -> Iterator[tuple[dict[str, Callable[[list[int], DecodeSettings], Run]], dict[str, Any]]]:
    """vLLM engines for vLLM's methods among `methods` (none: nothing starts), the drafter exported
    for them (OUT/vllm-drafter), each method's runner and the record of what ran (the engine's pass
    costs at 1 and at each speculative method's k + 1 tokens included)."""
    wanted = [m for m in methods if m in VLLM_METHODS]
    if not wanted:
        yield {}, {}
        return
    version = installed_version()  # a missing vLLM is said before anything is exported
    refuse_unfit(wanted, drafter, version)
    with tempfile.TemporaryDirectory(prefix="eaglet-eval-vllm-") as tmp:
        folder = formats.make_output(out, "eval") if out is not None else Path(tmp)
        export = None
        if any(m in VLLM_FAMILY_METHODS for m in wanted):
            export = folder / DRAFTER_FOLDER
            if export.exists():  # an earlier eval's: this run's drafter replaces it
                shutil.rmtree(export)
            write_engine_folder(read_drafter(drafter_path), export, formats.FORMAT_SPECULATORS, "fp32")
        specs = {m: speculative_config(m, s, export, drafter) for m in wanted}
        record: dict[str, Any] = {
            "version": version,
            "dtype": options.dtype,
            "threads": options.threads,
            "speculative_configs": specs,
            "drafter_folder": str(export) if export and out is not None else None,
        }
        log.info("vLLM %s: %s", version, ", ".join(wanted))
        with contextlib.ExitStack() as stack:
            engines = {
                m: stack.enter_context(
                    vllm_engine(target, replace(options, seed=s.seed), specs[m], log_dir=folder / VLLM_LOGS)
                )
                for m in wanted
            }
            record["start_seconds"] = {m: round(e.start_seconds, 1) for m, e in engines.items()}
            if VLLM_BASELINE in engines:
                sizes = [1] + [1 + (spec or {}).get("num_speculative_tokens", 0) for spec in specs.values() if spec]
                record["pass_costs"] = engine_pass_costs(engines[VLLM_BASELINE], cost_prompt, sizes)
            yield {m: partial(vllm_run, e, m) for m, e in engines.items()}, record
