"""One regen run's bookkeeping, shared by every backend: the output writer and the errors file,
the summary, the progress bar and the time budget. A backend reports each conversation through
`Run.emit` (finished, or cut short) and `Run.fail`, and each turn through `Run.progress`;
`run_parallel` drives the backends that answer many conversations at once (a server's slots)."""

from __future__ import annotations

import json
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from tqdm import tqdm

from eaglet.chat import ReadStats
from eaglet.formats import RegenWriter
from eaglet.regen.conversations import Conversation, RegenError, reason_kind, regen_record


@dataclass
class RegenSummary:
    out: Path
    errors_file: Path
    written: int = 0
    already_done: int = 0
    failed: int = 0
    cut_short: int = 0
    out_of_time: bool = False  # stopped at --time-budget
    turns: int = 0
    tokens: int = 0
    seconds: float = 0.0
    finish_reasons: Counter = field(default_factory=Counter)
    errors: Counter = field(default_factory=Counter)  # reason head -> conversations
    first_failure: str | None = None  # "id: reason" of the first failed conversation
    stats: ReadStats = field(default_factory=ReadStats)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def lines(self) -> list[str]:
        out = [
            f"regenerated {self.written} conversations ({self.turns} turns, {self.tokens} tokens, "
            f"{self.tokens_per_s:.1f} tokens/s) -> {self.out}",
            f"read {self.stats.records} records; {self.already_done} already done (resume)",
        ]
        if self.finish_reasons:
            out.append("  finish reasons: " + ", ".join(f"{k} {v}" for k, v in self.finish_reasons.most_common()))
        if self.out_of_time:
            out.append("  stopped at --time-budget: a rerun with --resume (and more time) continues")
        if self.cut_short:
            out.append(
                f"  cut short (a later prompt was too long, or time ran out; earlier turns kept): {self.cut_short}"
            )
        for reason, n in self.stats.skipped.most_common():
            out.append(f"  skipped: {reason}: {n}")
        if self.failed:
            out.append(f"  failed: {self.failed} conversations, reasons in {self.errors_file} (--resume retries them)")
            for reason, n in self.errors.most_common(5):
                out.append(f"    {reason}: {n}")
        return out


class Run:
    """The state one run's backends report into; `emit` and `fail` are called from the driving
    thread only, `progress` from any worker thread."""

    def __init__(
        self,
        summary: RegenSummary,
        writer: RegenWriter,
        errors_file: IO[str],
        meta: dict[str, Any],
        bar: tqdm,
        time_budget: float | None,
    ) -> None:
        self.summary, self.writer, self.errors_file, self.meta, self.bar = summary, writer, errors_file, meta, bar
        self.time_budget, self.started = time_budget, time.time()
        self.t0 = self.started  # when regeneration began (a server's start-up is not counted)
        self.lock = threading.Lock()

    def restart_clock(self) -> None:
        self.t0 = time.time()

    def out_of_time(self) -> bool:
        spent = time.time() - self.started
        self.summary.out_of_time = self.summary.out_of_time or (
            self.time_budget is not None and spent >= self.time_budget
        )
        return self.summary.out_of_time

    def todo(self, selected: Iterator[Conversation], done: set[str]) -> Iterator[Conversation]:
        """The chats still to regenerate: none once out of time, none already in the output."""
        for conv in selected:
            if self.out_of_time():
                return
            if conv.id in done:
                self.summary.already_done += 1
                continue
            yield conv

    def progress(self, tokens: int) -> None:
        with self.lock:
            self.summary.tokens += tokens
            self.summary.turns += 1

    def tick(self) -> None:
        self.bar.set_postfix_str(f"{self.summary.tokens / max(time.time() - self.t0, 1e-9):.1f} tok/s")

    def emit(self, conv: Conversation) -> None:
        """Write a conversation: finished, or cut after the turns regenerated so far."""
        if conv.done < conv.turns:
            self.summary.cut_short += 1
            conv.cut()
        self.writer.write(regen_record(conv, self.meta))
        self.summary.written += 1
        self.summary.finish_reasons.update(conv.finish_reasons)
        self.tick()
        self.bar.update(1)

    def fail(self, conv: Conversation, reason: str) -> None:
        """A conversation that cannot be regenerated: its reason, fsynced, for `--resume` to retry."""
        self.errors_file.write(json.dumps({"id": conv.id, "reason": reason}, ensure_ascii=False) + "\n")
        self.errors_file.flush()
        os.fsync(self.errors_file.fileno())
        self.summary.failed += 1
        self.summary.errors[reason_kind(reason)] += 1
        self.summary.first_failure = self.summary.first_failure or f"{conv.id}: {' '.join(reason.split())}"


def run_parallel(
    convs: Iterator[Conversation],
    regen_one: Callable[[Conversation], Conversation],
    concurrency: int,
    emit: Callable[[Conversation], None],
    fail: Callable[[Conversation, str], None],
    tick: Callable[[], None],
) -> None:
    """`regen_one` over conversations in parallel threads (a server's requests in flight); only
    this thread writes, so no file lock is needed. At most 2x `concurrency` conversations are
    read ahead, so memory stays flat. A RegenError fails its conversation; any other error
    (the server died) stops the run, as a kill would."""
    with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="regen") as pool:
        running: dict[Future, Conversation] = {}
        exhausted = False
        try:
            while True:
                while not exhausted and len(running) < 2 * concurrency:
                    conv = next(convs, None)
                    if conv is None:
                        exhausted = True
                        break
                    running[pool.submit(regen_one, conv)] = conv
                if not running:
                    return
                finished, _ = wait(running, timeout=0.5, return_when=FIRST_COMPLETED)
                tick()
                for fut in finished:
                    conv = running.pop(fut)
                    try:
                        emit(fut.result())
                    except RegenError as e:
                        fail(conv, f"turn {conv.done}: {e}")
        except BaseException:
            for fut in running:
                fut.cancel()  # queued conversations do not start; in-flight ones are lost, by design
            raise
