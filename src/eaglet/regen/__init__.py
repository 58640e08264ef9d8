"""Regenerate the assistant turns of chat data with the target (`eaglet regen`).

A drafter learns to predict the target, so it should train on the target's own answers, not
on whatever model wrote the chat originally. Every assistant turn is regenerated turn by
turn: turn k is generated from the chat so far *with the regenerated answers* of turns < k,
exactly what the target would have seen serving that conversation.

Four backends (`Backend`, in `backend`), one module each: `local` (the target with Hugging Face
`generate`), `openai` (any OpenAI-compatible endpoint: vLLM, SGLang), `llama_server`
(llama-server on the target's GGUF, run by eaglet) and `vllm_backend` (vLLM's offline engine, run
by eaglet). `conversations` holds the pure part (turns,
conversations, the input's chats), `run` a run's bookkeeping that every backend reports into.

Output: one JSONL line per finished conversation, `{"id", "messages", "regen"}` (OpenAI-style
`messages`, which `eaglet prepare` reads), appended, flushed and fsynced line by line, so a
kill loses at most the conversations in flight. `--resume` skips ids already written and cuts
off a partial last line a kill left. Conversations that fail go to `OUT.errors.jsonl` (id +
reason), which each run rewrites; `--resume` retries them. An empty answer is such a failure, and
a run in which every chat fails (and OUT holds none from earlier runs) ends with an error.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tqdm import tqdm

from eaglet import formats
from eaglet.formats import RegenWriter, errors_path, open_output
from eaglet.options import REGEN_BACKENDS, RegenOptions
from eaglet.placement import placement_from_options
from eaglet.regen.backend import Backend, Settings
from eaglet.regen.conversations import AllChatsFailed, RegenError, iter_conversations
from eaglet.regen.llama_server import LlamaCppBackend
from eaglet.regen.local import LocalBackend
from eaglet.regen.openai import OpenAIBackend
from eaglet.regen.run import RegenSummary, Run
from eaglet.regen.vllm_backend import VllmBackend
from eaglet.vllm_engine import engine_options_from

# options.REGEN_BACKENDS names them; this is what each name makes
BACKENDS: dict[str, Callable[[Settings], Backend]] = {
    "local": LocalBackend.open,
    "openai": OpenAIBackend.open,
    "llama.cpp": LlamaCppBackend.open,
    "vllm": VllmBackend.open,
}
assert tuple(BACKENDS) == REGEN_BACKENDS, "a backend declared in eaglet.options without an implementation here"


def check_options(s: Settings) -> None:
    """Every option in range and meant for this backend, before anything is read or loaded."""
    o = s.options
    if o.backend not in BACKENDS:
        raise ValueError(f"--backend {o.backend!r}: choose one of {', '.join(BACKENDS)}")
    if s.placed is not None and o.backend != "local":
        raise ValueError(
            f"--device-map {o.device_map}: places the target of --backend local; the {o.backend} "
            "endpoint's server places its own"
        )
    o.check_numbers()
    if o.backend != "llama.cpp" and (o.target_gguf is not None or o.threads is not None or o.engine_f32):
        raise ValueError(
            f"--target-gguf, --threads and --engine-f32 are the llama.cpp backend's (this is --backend {o.backend})"
        )


def record_meta(o: RegenOptions, own: dict[str, Any]) -> dict[str, Any]:
    """What every output line records about how its answers were made: the target first, then
    the sampling, then the backend's own (the key order lines have always had)."""
    target: dict[str, Any] = {key: own[key] for key in ("target", "target_revision") if key in own}
    return {
        **target,
        "backend": o.backend,
        "temperature": o.temperature,
        "top_p": o.top_p,
        "max_new_tokens": o.max_new_tokens,
        **own,
    }


def progress_bar_for(num_samples: int | None, done: set[str], enabled: bool) -> tqdm:
    """The chats-written bar; its total is known only when --num-samples bounds the run."""
    total = (num_samples - len(done)) if num_samples is not None and len(done) <= num_samples else None
    return tqdm(total=total, desc="regen", unit="chat", file=sys.stderr, dynamic_ncols=True, disable=not enabled)


def refuse_all_failed(summary: RegenSummary, done: set[str]) -> None:
    """A run in which every chat failed, with none written now or before, leaves prepare nothing."""
    if summary.failed and not summary.written and not done:
        raise AllChatsFailed(
            f"{summary.errors_file}: all {summary.failed} chats failed and none was written to "
            f"{summary.out} (first: {summary.first_failure}); fix the cause, then rerun with "
            "--resume to retry them"
        )


def regenerate(options: RegenOptions, backoff: float = 1.0, progress_bar: bool = True) -> RegenSummary:
    """Regenerate every assistant turn of the chats in `data` with the target; write `out` (JSONL).
    With `time_budget` (seconds) no new chat starts after that long. The local backend places the
    target with `device_map` (`eaglet.placement`) or on `device`; the llama.cpp backend runs
    llama-server on `target_gguf` with `concurrency` slots and `threads` threads; the vllm backend
    vLLM's offline engine with the vLLM options, `batch_size` prompts a call."""
    o = options
    out = Path(o.out)
    placed = placement_from_options(o.device_map, o.max_memory, o.offload_folder, o.device)
    settings = Settings(o, out, placed, engine_options_from(o) if o.backend == "vllm" else None, backoff)
    check_options(settings)
    with formats.output_lock(out, "regen"):  # one writer per output: two resumes would write each chat twice
        formats.claim_errors_report(out)
        done = open_output(out, o.resume)
        answerer = BACKENDS[o.backend](settings)
        meta = record_meta(o, answerer.meta)
        if done:
            formats.refuse_mixed_regen(out, meta)
        summary = RegenSummary(out, errors_path(out))
        selected = iter_conversations(o.data, summary.stats, o.num_samples, o.skip, o.max_turns)
        bar = progress_bar_for(o.num_samples, done, progress_bar)
        errors_file = open(summary.errors_file, "w", encoding="utf-8")  # a report of this run; resume retries them
        run = None
        try:
            with contextlib.ExitStack() as resources, RegenWriter(out) as writer:
                run = Run(summary, writer, errors_file, meta, bar, o.time_budget)
                answerer.run(run.todo(selected, done), run, resources)
        finally:
            errors_file.close()
            bar.close()
            summary.seconds = time.time() - run.t0 if run else 0.0
            if not summary.failed:
                summary.errors_file.unlink(missing_ok=True)  # no empty errors file to wonder about
        refuse_all_failed(summary, done)
        return summary


__all__ = ["regenerate", "RegenSummary", "RegenError", "AllChatsFailed", "BACKENDS"]
