"""llama.cpp's methods in `eaglet eval`: llama-server on the target's GGUF, beside eaglet's own;
and the first-draft check every outside engine's drafter method gets (llama.cpp's, vLLM's).

    llama.cpp         plain greedy: the baseline of llama.cpp's speculative methods
    llama.cpp-eagle3  the drafter exported to GGUF (`--spec-type draft-eagle3`)
    llama.cpp-ngram   llama.cpp's own n-gram lookup

One server per method, all running for the whole evaluation, so they rotate with the other
methods per prompt. Their figures come from the engine's own timings and counters. The engine's
first-draft acceptance is set beside eaglet's chain for the same drafter and prompts: a gap beyond
FIRST_DRAFT_GAP on an unquantized target without a probability floor means the engine does not
run the drafter the way eaglet trained it (layer ids, d2t, norms); elsewhere it is a hint
(`gap_verdict`).
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
from pathlib import Path
from typing import Any, Iterator, Sequence

from eaglet import formats, llama_cpp
from eaglet.decode import DecodeStats, truncate_at_eos
from eaglet.drafter.files import export_gguf_file
from eaglet.evaluate.methods import Run
from eaglet.evaluate.settings import DecodeSettings
from eaglet.options import LLAMA_CPP_BASELINE, LLAMA_CPP_METHODS
from eaglet.target import f32_target_gguf, find_target_gguf

log = logging.getLogger(__name__)

DRAFTER_GGUF = "drafter.gguf"  # in --out: the export llama.cpp-eagle3 ran
# llama.cpp's server for each of its methods (the drafter is exported for draft-eagle3)
LLAMA_CPP_SPECS = {
    LLAMA_CPP_BASELINE: None,
    "llama.cpp-eagle3": llama_cpp.SPEC_EAGLE3,
    "llama.cpp-ngram": llama_cpp.SPEC_NGRAM,
}
assert set(LLAMA_CPP_SPECS) == set(LLAMA_CPP_METHODS)
# First-draft acceptance in llama.cpp vs eaglet's chain, same drafter and prompts: beyond this
# the two do not run the same drafter. Measured on a drafter that memorised 6 HumanEval answers:
# +0.000 with the engine on the f32 target GGUF (one model on both sides), -0.264 on the Q4_1
# one, whose quantized kernels move the states the drafter reads. A --min-draft-prob floor moves
# it too (llama.cpp applies it to a top-10 renormalised probability). So a gap is a verdict only
# on an f32 target without a floor, elsewhere a hint.
FIRST_DRAFT_GAP = 0.05


def engine_run(server: llama_cpp.LlamaServer, method: str, ids: list[int], s: DecodeSettings) -> Run:
    """One answer from llama-server, in eval's terms, from the engine's own timings and counters:
    a step that accepted m drafted tokens is one target pass for m + 1 tokens, so the target's
    passes are the tokens it generated less the drafted ones it accepted (the prefill counted as
    one, as eaglet counts it)."""
    done, counts = server.counted_completion(
        ids, s.max_new_tokens, temperature=s.temperature, top_p=s.top_p, seed=s.seed
    )
    tokens, _ = truncate_at_eos(done.tokens, set(s.eos_ids))
    forwards = max(1, done.generated - counts.accepted)
    if not counts.drafts:
        return Run(tokens, done.seconds, forwards)
    stats = DecodeStats(
        new_tokens=len(tokens),
        target_forwards=forwards,
        verify_forwards=counts.drafts,
        position_reached=counts.reached_per_position,
        position_accepted=list(counts.accepted_per_position),
        wall_s=done.seconds,
        accepted_from={method: counts.accepted},
    )
    return Run(tokens, done.seconds, forwards, stats)


@contextlib.contextmanager
def engine_servers(
    methods: Sequence[str],
    drafter_path: str | Path,
    target_name: str,
    target_gguf: str | Path | None,
    out: str | Path | None,
    s: DecodeSettings,
    threads: int,
    ctx_size: int,
    engine_f32: bool = False,
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
        folder = formats.make_output(out, "eval") if out is not None else Path(tmp)
        draft = None
        if "llama.cpp-eagle3" in wanted:
            draft = folder / DRAFTER_GGUF
            draft.unlink(missing_ok=True)  # an earlier eval's: this run's drafter replaces it
            export_gguf_file(drafter_path, draft, target_gguf=model)
        # eaglet's own settings where llama.cpp has the same knob: its chain length and floor for
        # the drafter, its n-gram and lookup length for n-gram lookup
        ngram = llama_cpp.ngram_flags(s.max_ngram, s.lookup_tokens)
        specs = {
            m: llama_cpp.ServerSpec(
                draft if LLAMA_CPP_SPECS[m] == llama_cpp.SPEC_EAGLE3 else None,
                LLAMA_CPP_SPECS[m],
                ngram if LLAMA_CPP_SPECS[m] == llama_cpp.SPEC_NGRAM else (),
            )
            for m in wanted
        }
        options = {
            "threads": threads,
            "ctx_size": ctx_size,
            "draft_max": s.chain_depth,
            "draft_p_min": s.min_draft_prob,
        }
        record = {
            "server": llama_cpp.server_version(binary),
            "target_gguf": str(model),
            "target_weights": formats.weight_type(model),
            "drafter_gguf": str(draft) if draft and out is not None else None,
            "spec_types": {m: LLAMA_CPP_SPECS[m] for m in wanted},
            "ngram_flags": list(ngram),
            **options,
        }
        log.info("llama.cpp (%s): %s on %s", record["server"], ", ".join(wanted), model.name)
        with llama_cpp.llama_servers(model, specs, log_dir=folder / "llama-server-logs", **options) as servers:
            yield servers, record


# ---------------------------------------------------------------------------------------------
# The first-draft check: llama.cpp's acceptance beside eaglet's chain
# ---------------------------------------------------------------------------------------------


def first_draft_check(
    summary: dict[str, dict[str, Any]],
    weights: str | None = None,
    p_min: float = 0.0,
    engine: str = "llama.cpp-eagle3",
    own: str = "chain",
) -> dict[str, Any] | None:
    """The engine's first-draft acceptance beside eaglet's own for the same drafter and prompts,
    the ggml type of the engine's target weights (llama.cpp) and the drafts' probability floor,
    written into the engine's row; None when either acceptance is missing."""
    try:
        theirs = summary[engine]["acceptance_rates"][0]
        ours = summary[own]["acceptance_rates"][0]
    except (KeyError, IndexError):
        return None
    if theirs is None or ours is None:
        return None
    check = {
        "eaglet_first_acceptance": ours,
        "first_acceptance_gap": round(theirs - ours, 4),
        "engine_target_weights": weights,
        "min_draft_prob": p_min,
        "compared_with": own,
    }
    summary[engine].update(check)
    return check


def gap_verdict(check: dict[str, Any], engine: str = "llama.cpp") -> str:
    """What a first-draft gap means: within the bound; beyond it on a quantized engine target,
    where quantization alone moves it, or with a probability floor, which the engines apply
    differently from eaglet; or beyond it on the same weights without a floor, a convention
    mismatch."""
    weights, p_min = check.get("engine_target_weights"), check.get("min_draft_prob") or 0.0
    if abs(check["first_acceptance_gap"]) <= FIRST_DRAFT_GAP:
        return f"within {FIRST_DRAFT_GAP}"
    if weights and weights not in formats.UNQUANTIZED:
        return (
            f"beyond {FIRST_DRAFT_GAP}, but the engine's target is {weights}, whose kernels move the states the "
            f"drafter reads; --engine-f32 runs eaglet's own weights and tells that from a convention mismatch"
        )
    if p_min > 0:
        how = (
            "llama.cpp gates a draft on its top token's probability among the drafter's 10 best, renormalised, "
            "eaglet among all of them, so llama.cpp drafts tokens eaglet would not"
            if engine == "llama.cpp"
            else f"{engine} drafts every token, eaglet only those above the floor"
        )
        return (
            f"beyond {FIRST_DRAFT_GAP}, but with --min-draft-prob {p_min:g}: {how}; --min-draft-prob 0 compares "
            "the conventions alone"
        )
    return (
        f"MISMATCH: beyond {FIRST_DRAFT_GAP} on the same weights, the engine does not run the drafter as eaglet "
        f"does; check the export's conventions (aux layer ids, d2t, norms) before trusting either figure"
    )


def engine_name(method: str) -> str:
    """The engine a method runs on: "llama.cpp-eagle3" -> "llama.cpp", "vllm-p-eagle" -> "vLLM"."""
    return "vLLM" if method.startswith("vllm") else "llama.cpp"


def warn_on_gap(set_name: str, check: dict[str, Any] | None, method: str = "llama.cpp-eagle3") -> None:
    if check is not None and abs(check["first_acceptance_gap"]) > FIRST_DRAFT_GAP:
        log.warning(
            "%s: %s's first-draft acceptance is %+.3f from eaglet's %s (%.3f): %s",
            set_name,
            method,
            check["first_acceptance_gap"],
            check.get("compared_with", "chain"),
            check["eaglet_first_acceptance"],
            gap_verdict(check, engine_name(method)),
        )


def first_draft_line(set_name: str, method: str, r: dict[str, Any]) -> str:
    """The table's line under a set for a method with a first-draft check."""
    return (
        f"{set_name}: {method} first-draft acceptance {r['acceptance_rates'][0]:.3f} vs eaglet's "
        f"{r.get('compared_with', 'chain')} {r['eaglet_first_acceptance']:.3f} (gap {r['first_acceptance_gap']:+.3f}, "
        f"{gap_verdict(r, engine_name(method))})"
    )
