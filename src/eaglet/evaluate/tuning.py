"""Each method at its fastest configuration on this machine: dtype and CPU threads from measured
pass costs (`eaglet eval --dtype auto --threads auto`, the defaults).

Which configuration is fastest depends on the machine and on how many tokens a method verifies
per pass: on an AVX2-only CPU, bf16 is emulated, and a second thread barely helps a one-token pass
but pays for a pass over several tokens (bench/verify_cost.py: a bf16 pass over 3 tokens costs
1.88 one-token passes on 1 thread, 1.31 on 2). So every candidate (dtype x threads) is timed over
q = 1 .. the largest pass any method verifies, and each method runs at the candidate where a pass
of its own size (`verify_tokens`) is cheapest: plain greedy at q = 1, a chain of d drafts at
q = 1 + d, a parallel drafter's block at 1 + its drafts. Plain greedy, the reference of every
speedup, thus runs at its own fastest configuration, not at the drafter's.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Sequence

from eaglet.drafter import DraftModel, ParallelDraft, predicted_positions
from eaglet.evaluate.settings import DecodeSettings
from eaglet.options import BASELINE, HF_METHODS, OUTSIDE_METHODS, PARALLEL_METHODS

AUTO = "auto"
CPU_DTYPES = ("bf16", "fp32")


@dataclass(frozen=True)
class Config:
    """How a method runs: the target's and drafter's dtype, and the CPU threads (None: torch's)."""

    dtype: str
    threads: int | None

    @property
    def label(self) -> str:
        return f"{self.dtype}/{self.threads if self.threads else 'default'} threads"


def candidates(dtype: str, threads: int | str | None, device_type: str) -> list[Config]:
    """The configurations to time: the dtype and threads given, or with "auto" bf16 and fp32 (on a
    CPU; an accelerator runs bf16) and 1 and every core (on a CPU)."""
    dtypes = [dtype] if dtype != AUTO else list(CPU_DTYPES) if device_type == "cpu" else ["bf16"]
    cores = os.cpu_count() or 1
    counts: list[int | None]
    if threads == AUTO:
        counts = [*sorted({1, cores})] if device_type == "cpu" else [None]
    else:
        assert not isinstance(threads, str), f"--threads {threads!r}: a count or auto"  # parse_threads
        counts = [threads]
    return [Config(d, t) for d in dtypes for t in counts]


def verify_tokens(method: str, s: DecodeSettings, drafter: DraftModel | None) -> int:
    """Tokens of the pass a method verifies at most (its root included): what it is tuned for."""
    if method == BASELINE or method == "hf-greedy":
        return 1
    if method == "chain":
        return 1 + s.chain
    if method == "tree":
        return 1 + s.tree[2]
    if method in PARALLEL_METHODS and isinstance(drafter, ParallelDraft):
        return 1 + predicted_positions(drafter.config)
    if method == "ngram":
        return 1 + s.lookup_tokens
    if method == "hybrid":
        drafted = (
            predicted_positions(drafter.config)
            if isinstance(drafter, ParallelDraft)
            else s.hybrid_chain_depth
            if s.hybrid_draft == "chain"
            else s.tree[2]
        )
        return 1 + s.lookup_tokens + drafted
    if method in HF_METHODS:  # Hugging Face prompt lookup verifies its 10 candidates
        return 11
    return 1


def pick(costs: Mapping[Config, Sequence[float]], q: int) -> Config:
    """The configuration whose pass over q tokens is cheapest (q past the measured: the largest)."""
    return min(costs, key=lambda c: costs[c][min(q, len(costs[c])) - 1])


def choose(
    methods: dict[str, tuple[str, DecodeSettings]], costs: Mapping[Config, Sequence[float]], drafter: DraftModel | None
) -> dict[str, Config]:
    """label -> the configuration each variant runs at (outside engines' methods: their engines' own)."""
    return {
        label: pick(costs, verify_tokens(method, s, drafter))
        for label, (method, s) in methods.items()
        if method not in OUTSIDE_METHODS
    }
