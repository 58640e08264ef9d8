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
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tqdm import tqdm

from eaglet import formats, ranges
from eaglet.formats import RegenWriter, errors_path, open_output
from eaglet.options import DECLARED, REGEN_BACKENDS, takes_options
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
    "local": LocalBackend.open, "openai": OpenAIBackend.open, "llama.cpp": LlamaCppBackend.open,
    "vllm": VllmBackend.open}
assert tuple(BACKENDS) == REGEN_BACKENDS, "a backend declared in eaglet.options without an implementation here"


def check_options(backend: str, s: Settings, skip: int, num_samples: int | None, max_turns: int | None,
                  time_budget: float | None, device_map: str | None) -> None:
    """Every option in range and meant for this backend, before anything is read or loaded."""
    if backend not in BACKENDS:
        raise ValueError(f"--backend {backend!r}: choose one of {', '.join(BACKENDS)}")
    if s.placed is not None and backend != "local":
        raise ValueError(f"--device-map {device_map}: places the target of --backend local; the {backend} "
                         "endpoint's server places its own")
    ranges.at_least(0, temperature=s.temperature, skip=skip, max_retries=s.max_retries)
    ranges.within(0, 1, low_open=True, top_p=s.top_p)
    ranges.seeds(seed=s.seed)
    ranges.at_least(1, max_new_tokens=s.max_new_tokens, batch_size=s.batch_size, concurrency=s.concurrency,
                    num_samples=num_samples, max_prompt_tokens=s.max_prompt_tokens, max_turns=max_turns,
                    threads=s.threads)
    ranges.within(1, ranges.MAX_NEW_TOKENS, "more than any model's positions", max_new_tokens=s.max_new_tokens)
    if backend != "llama.cpp" and (s.target_gguf is not None or s.threads is not None or s.engine_f32):
        raise ValueError(f"--target-gguf, --threads and --engine-f32 are the llama.cpp backend's (this is --backend "
                         f"{backend})")
    ranges.above(0, timeout=s.timeout)
    ranges.seconds(time_budget=time_budget)


def record_meta(backend: str, s: Settings, own: dict[str, Any]) -> dict[str, Any]:
    """What every output line records about how its answers were made: the target first, then
    the sampling, then the backend's own (the key order lines have always had)."""
    target: dict[str, Any] = {key: own[key] for key in ("target", "target_revision") if key in own}
    return {**target, "backend": backend, "temperature": s.temperature, "top_p": s.top_p,
            "max_new_tokens": s.max_new_tokens, **own}


def progress_bar_for(num_samples: int | None, done: set[str], enabled: bool) -> tqdm:
    """The chats-written bar; its total is known only when --num-samples bounds the run."""
    total = (num_samples - len(done)) if num_samples is not None and len(done) <= num_samples else None
    return tqdm(total=total, desc="regen", unit="chat", file=sys.stderr, dynamic_ncols=True, disable=not enabled)


def refuse_all_failed(summary: RegenSummary, done: set[str]) -> None:
    """A run in which every chat failed, with none written now or before, leaves prepare nothing."""
    if summary.failed and not summary.written and not done:
        raise AllChatsFailed(f"{summary.errors_file}: all {summary.failed} chats failed and none was written to "
                             f"{summary.out} (first: {summary.first_failure}); fix the cause, then rerun with "
                             "--resume to retry them")


@takes_options("regen")
def regenerate(data: str = DECLARED, out: str | os.PathLike = DECLARED, target: str | None = DECLARED,
               backend: str = DECLARED, *, base_url: str | None = DECLARED, model: str | None = DECLARED,
               api_key: str | None = DECLARED, temperature: float = DECLARED, top_p: float = DECLARED,
               max_new_tokens: int = DECLARED, batch_size: int = DECLARED, concurrency: int = DECLARED,
               max_retries: int = DECLARED, timeout: float = DECLARED, backoff: float = 1.0,
               resume: bool = DECLARED, num_samples: int | None = DECLARED, skip: int = DECLARED,
               dtype: str = DECLARED, device: str | None = DECLARED, seed: int = DECLARED,
               max_prompt_tokens: int | None = DECLARED, max_turns: int | None = DECLARED,
               time_budget: float | None = DECLARED, device_map: str | None = DECLARED,
               max_memory: str | None = DECLARED, offload_folder: str | None = DECLARED,
               target_gguf: str | os.PathLike | None = DECLARED, threads: int | None = DECLARED,
               engine_f32: bool = DECLARED, tensor_parallel_size: int = DECLARED,
               pipeline_parallel_size: int = DECLARED, max_model_len: int | None = DECLARED,
               gpu_memory_utilization: float | None = DECLARED, vllm_kv_cache_gib: float = DECLARED,
               vllm_args: str | None = DECLARED, progress_bar: bool = True) -> RegenSummary:
    """Regenerate every assistant turn of the chats in `data` with the target; write `out` (JSONL).
    With `time_budget` (seconds) no new chat starts after that long. The local backend places the
    target with `device_map` (`eaglet.placement`) or on `device`; the llama.cpp backend runs
    llama-server on `target_gguf` with `concurrency` slots and `threads` threads; the vllm backend
    vLLM's offline engine with the vLLM options, `batch_size` prompts a call."""
    out = Path(out)
    placed = placement_from_options(device_map, max_memory, offload_folder, device)
    settings = Settings(out, target, temperature, top_p, max_new_tokens, max_prompt_tokens, seed, concurrency,
                        batch_size, dtype, device, placed, base_url, model, api_key, max_retries, timeout, backoff,
                        None if target_gguf is None else str(target_gguf), threads, engine_f32,
                        engine_options_from(tensor_parallel_size, pipeline_parallel_size, max_model_len,
                                            gpu_memory_utilization, vllm_kv_cache_gib, vllm_args)
                        if backend == "vllm" else None)
    check_options(backend, settings, skip, num_samples, max_turns, time_budget, device_map)
    with formats.output_lock(out, "regen"):  # one writer per output: two resumes would write each chat twice
        formats.claim_errors_report(out)
        done = open_output(out, resume)
        answerer = BACKENDS[backend](settings)
        meta = record_meta(backend, settings, answerer.meta)
        if done:
            formats.refuse_mixed_regen(out, meta)
        summary = RegenSummary(out, errors_path(out))
        selected = iter_conversations(data, summary.stats, num_samples, skip, max_turns)
        bar = progress_bar_for(num_samples, done, progress_bar)
        errors_file = open(summary.errors_file, "w", encoding="utf-8")  # a report of this run; resume retries them
        run = None
        try:
            with contextlib.ExitStack() as resources, RegenWriter(out) as writer:
                run = Run(summary, writer, errors_file, meta, bar, time_budget)
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
