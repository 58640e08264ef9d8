"""Per-file state signatures: what extraction wrote in each slot of each sample file, recorded
beside the files, so that `eaglet check` (and so `eaglet train`, which runs it) can tell in every
file a slot that holds other states than extraction wrote there: two slots swapped, a
neighbouring layer's states, a file copied in from another dataset. Per-slot scales cannot tell
neighbouring layers apart, and the target's recomputation samples a few files only.

A slot's signature: the sum over its rows of the states projected on `PROBES` fixed +-1 vectors,
the same sum with each row's projections signed by a fixed +-1 per position (rows shifted or
reordered change it), then the sum of the projections' magnitudes (the scale the comparison's
tolerance is relative to). One read of the slot, recomputed the same on any machine up to float32
rounding.

Writer and reader: extraction appends one JSON line per file (and syncs it) to its shard's log
under `signatures/`, before the file is renamed into place, so every file has its line. A file
written again later gets a line again: a file matches when it matches any line of its index.
"""

from __future__ import annotations

import functools
import json
import math
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

SIGNATURES_DIR = "signatures"
PROBES = 2
# float32 projections summed in float64 differ between machines by ~1e-7 of the magnitudes; a
# neighbouring layer's states by 0.028 at the least (SmolLM2's layer 14 for 15, 0.15 for layer 16;
# bench/state_signatures.py, docs/results/signatures.md)
TOLERANCE = 1e-4
CHUNK_VALUES = 1 << 22  # values converted to float32 at once (16 MB): memory bounded by the chunk, not the file

Signature = list[list[float]]  # per slot: PROBES sums of projections, PROBES position-signed sums, PROBES magnitudes


def hashed_signs(n: int, salt: int) -> torch.Tensor:
    """n values of +-1 from integer hashing (no random generator, whose stream a torch release may
    change): the same on every machine and version."""
    j = torch.arange(n, dtype=torch.int64)
    return (1 - 2 * ((((j * 2654435761 + salt * 2246822519) % 2**32) >> 13) & 1)).to(torch.float32)


@functools.cache
def probe_vectors(hidden_size: int) -> torch.Tensor:
    """[PROBES, hidden_size] of +-1."""
    return torch.stack([hashed_signs(hidden_size, p + 1) for p in range(PROBES)])


def state_signature(states: list[torch.Tensor]) -> Signature:
    """Each [T, H] slot's signature, as stored (a file's states read back give the same)."""
    out = []
    for h in states:
        rows, width = (int(n) for n in h.shape)
        probes = probe_vectors(width)
        weights = torch.stack([torch.ones(rows), hashed_signs(rows, 0)], dim=1).double()  # [rows, 2]
        chunk = max(1, CHUNK_VALUES // max(width, 1))
        # [PROBES, rows]: a product this way round runs ~8x faster than [rows, PROBES] on CPU
        proj = torch.cat([probes @ h[a : a + chunk].to(torch.float32).T for a in range(0, rows, chunk)], dim=1)
        sums = proj.double() @ weights  # [PROBES, 2]: plain and position-signed sums
        magnitudes = proj.abs().sum(1, dtype=torch.float64)
        out.append(sums[:, 0].tolist() + sums[:, 1].tolist() + magnitudes.tolist())
    return out


def slot_distance(computed: list[float], recorded: list[float]) -> float:
    """How far a slot's signature is from a recorded one, relative to the recorded magnitudes
    (0: the same states; above `TOLERANCE`: other states)."""
    if len(computed) != len(recorded) or not all(map(math.isfinite, computed)):
        return math.inf
    scale = max(recorded[2 * PROBES :], default=0.0)
    diff = max((abs(a - b) for a, b in zip(computed, recorded)), default=0.0)
    return diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf)


@dataclass(frozen=True)
class SlotMismatch:
    slot: int
    distance: float  # from what extraction recorded for this slot
    holds: int | None  # the recorded slot whose states it holds, where it holds one


def signature_mismatches(computed: Signature, recorded: list[Signature]) -> list[SlotMismatch]:
    """The slots whose states differ from what extraction recorded (none: the file matches one
    of its index's records), judged against the latest record."""
    if any(
        len(r) == len(computed) and all(slot_distance(c, s) <= TOLERANCE for c, s in zip(computed, r)) for r in recorded
    ):
        return []
    latest = recorded[-1]
    out = []
    for j, c in enumerate(computed):
        distance = slot_distance(c, latest[j]) if j < len(latest) else math.inf
        if distance <= TOLERANCE:
            continue
        holds = next((k for k, s in enumerate(latest) if k != j and slot_distance(c, s) <= TOLERANCE), None)
        out.append(SlotMismatch(j, distance, holds))
    return out


class SignatureLog:
    """One extraction shard's log of its files' signatures (shards write their own: no two
    processes append to one file). Thread-safe: extraction's writers record from a pool."""

    def __init__(self, root: str | os.PathLike, shard_id: int = 0, num_shards: int = 1):
        folder = Path(root) / SIGNATURES_DIR
        folder.mkdir(exist_ok=True)
        self.path = folder / f"shard_{shard_id}_of_{num_shards}.jsonl"
        self.lock = threading.Lock()
        drop_partial_line(self.path)

    def record(self, index: int, signature: Signature) -> None:
        """Appended and synced before the file it describes is renamed into place."""
        line = json.dumps({"index": index, "slots": signature}) + "\n"
        with self.lock, open(self.path, "a", encoding="utf-8") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())


def drop_partial_line(path: Path) -> None:
    """A run killed mid-append leaves a line without its newline: cut it, so the next line
    starts on its own (its file was never renamed into place, and is written again)."""
    if not path.exists():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        with open(path, "r+b") as f:
            f.truncate(data.rfind(b"\n") + 1)


def read_signatures(root: str | os.PathLike) -> tuple[dict[int, list[Signature]] | None, list[tuple[str, str]]]:
    """Every recorded signature by sample index (None: the dataset records none, as other tools'
    datasets and older eaglet's do), and each line that cannot be read: (where, why)."""
    folder = Path(root) / SIGNATURES_DIR
    if not folder.is_dir():
        return None, []
    found: dict[int, list[Signature]] = {}
    problems = []
    for path in sorted(folder.glob("*.jsonl")):
        text = path.read_text(encoding="utf-8", errors="replace")
        lines = text.split("\n")
        for n, line in enumerate(lines[:-1], 1):  # a last line without its newline: a killed append
            try:
                entry = json.loads(line)
                index, slots = int(entry["index"]), [[float(v) for v in slot] for slot in entry["slots"]]
            except (ValueError, KeyError, TypeError) as e:
                problems.append((f"{SIGNATURES_DIR}/{path.name}:{n}", f"unreadable line ({type(e).__name__}: {e})"))
                continue
            found.setdefault(index, []).append(slots)
    return found, problems
