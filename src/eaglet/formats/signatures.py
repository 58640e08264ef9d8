"""Per-file state signatures: what extraction wrote in each slot of each sample file, recorded
beside the files, so that `eaglet check` (and so `eaglet train`, which runs it) can tell in every
file a slot that holds other states than extraction wrote there: two slots swapped, a
neighbouring layer's states, another file's, rows shifted. Per-slot scales cannot tell
neighbouring layers apart, and the target's recomputation samples a few files only. A signature
sums over a slot's rows, so it tells whole-slot changes, not one edited row of a long file.

A slot's signature: the sum over its rows of the states projected on `PROBES` fixed +-1 vectors,
the same sum with each row's projections signed by a fixed +-1 per position (rows shifted or
reordered change it), then the sum of the projections' magnitudes (the scale the comparison's
tolerance is relative to). One read of the slot, recomputed the same on any machine up to float32
rounding. Each line also holds a digest of the file's token ids and loss mask (`token_digest`):
tokens shifted against their states, or another sample's, do not match it. The +-1 come from
integer hashing (murmur3's finaliser), not from a random generator whose stream a torch release
may change.

Writer and reader: extraction appends one JSON line per file (and syncs it) to its shard's log
under `signatures/`, before the file is renamed into place, so every file has its line; convert
keeps a log of its own. A file written again later gets a line again: a file matches when it
matches any line of its index. Each line names its scheme (`v`) and the extraction that wrote it
(`of`, the random key data_config.json's `signature_key` holds): a line of another scheme, or another
dataset's line copied in beside its file, vouches for nothing, and its file is one with no line.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import threading
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eaglet.formats.io import refuse_non_file

SIGNATURES_DIR = "signatures"
SCHEME = 2  # the `v` of each line: PROBES, the hashing, the numbers' order below, `of`
PROBES = 2
# float32 projections summed in float64 differ between machines by ~1e-7 of the magnitudes; a
# neighbouring layer's states by 0.048 at the least (SmolLM2's layer 14 for 15, 0.087 for layer 16;
# bench/state_signatures.py, docs/results/signatures.md)
TOLERANCE = 1e-4
MAX_LINE = 1 << 16  # bytes; a line holds 6 numbers per slot: a longer one is no line of ours
CHUNK_VALUES = 1 << 22  # values converted to float32 at once (16 MB): memory bounded by the chunk, not the file
PER_SLOT = 3 * PROBES

Signature = list[list[float]]  # per slot: PROBES sums of projections, PROBES position-signed sums, PROBES magnitudes
MASK32 = 0xFFFFFFFF


def mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for x, c < 2^32, in int64 without overflow: by 16-bit halves of x."""
    lo, hi = x & 0xFFFF, x >> 16
    return (lo * c + (((hi * c) & 0xFFFF) << 16)) & MASK32


def hashed_signs(n: int, salt: int) -> torch.Tensor:
    """n values of +-1: the top bit of murmur3's 32-bit finaliser of (index, salt)."""
    x = (torch.arange(n, dtype=torch.int64) + salt * 0x9E3779B9) & MASK32
    x = mul32(x ^ (x >> 16), 0x85EBCA6B)
    x = mul32(x ^ (x >> 13), 0xC2B2AE35)
    x = x ^ (x >> 16)
    return (1 - 2 * (x >> 31)).to(torch.float32)


@functools.cache
def probe_vectors(hidden_size: int) -> torch.Tensor:
    """[PROBES, hidden_size] of +-1."""
    return torch.stack([hashed_signs(hidden_size, p + 1) for p in range(PROBES)])


def state_signature(states: list[torch.Tensor]) -> Signature:
    """Each [T, H] slot's signature, as stored (a file's states read back give the same)."""
    out = []
    weights_of: dict[int, torch.Tensor] = {}  # [rows, 2]: a file's slots share their rows
    for h in states:
        rows, width = (int(n) for n in h.shape)
        if rows == 0:
            out.append([0.0] * PER_SLOT)
            continue
        probes = probe_vectors(width)
        if rows not in weights_of:
            weights_of[rows] = torch.stack([torch.ones(rows), hashed_signs(rows, 0)], dim=1).double()
        weights = weights_of[rows]
        chunk = max(1, CHUNK_VALUES // max(width, 1))
        # [PROBES, rows]: a product this way round runs ~8x faster than [rows, PROBES] on CPU
        proj = torch.cat([probes @ h[a : a + chunk].to(torch.float32).T for a in range(0, rows, chunk)], dim=1)
        sums = proj.double() @ weights  # [PROBES, 2]: plain and position-signed sums
        magnitudes = proj.abs().sum(1, dtype=torch.float64)
        out.append(sums[:, 0].tolist() + sums[:, 1].tolist() + magnitudes.tolist())
    return out


def token_digest(input_ids: torch.Tensor, loss_mask: torch.Tensor | None) -> str:
    """A digest of a file's token ids and loss mask (as int64): states recorded beside other
    tokens (ids and mask shifted against them, another sample's) do not match it."""
    h = hashlib.blake2b(digest_size=8)
    for t in (input_ids, loss_mask):
        if t is not None:
            h.update(t.detach().to("cpu", torch.int64).contiguous().numpy().tobytes())
        h.update(b"|")
    return h.hexdigest()


@dataclass(frozen=True)
class Recorded:
    """One line of a log: a file's slots' signatures, flattened, and its tokens' digest."""

    slots: array
    tokens: str


def slot_distance(computed: list[float], recorded: list[float]) -> float:
    """How far a slot's signature is from a recorded one, relative to the recorded magnitudes
    (0: the same states; above `TOLERANCE`: other states)."""
    if len(computed) != len(recorded):
        return math.inf
    scale = max(recorded[2 * PROBES :], default=0.0)
    diff = max((abs(a - b) for a, b in zip(computed, recorded)), default=0.0)
    return diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf)


@dataclass(frozen=True)
class SlotMismatch:
    slot: int
    distance: float  # from what extraction recorded for this slot
    holds: int | None  # the recorded slot whose states it holds, where it holds one


def recorded_slots(flat: array) -> Signature:
    return [list(flat[i : i + PER_SLOT]) for i in range(0, len(flat), PER_SLOT)]


def signature_mismatches(computed: Signature, recorded: list[Recorded]) -> list[SlotMismatch]:
    """The slots whose states differ from what extraction recorded (none: the file matches one of
    its index's records), judged against the last record read. A slot of non-finite values is
    not compared: the value checks name it, whatever extraction wrote."""
    compared = [j for j, c in enumerate(computed) if all(map(math.isfinite, c))]
    records = [recorded_slots(r.slots) for r in recorded]

    def matches(record: Signature) -> bool:
        return len(record) == len(computed) and all(
            slot_distance(computed[j], record[j]) <= TOLERANCE for j in compared
        )

    if any(matches(r) for r in records):
        return []
    latest = records[-1]
    out = []
    for j in compared:
        distance = slot_distance(computed[j], latest[j]) if j < len(latest) else math.inf
        if distance <= TOLERANCE:
            continue
        holds = next((k for k, s in enumerate(latest) if k != j and slot_distance(computed[j], s) <= TOLERANCE), None)
        out.append(SlotMismatch(j, distance, holds))
    return out


class SignatureLog:
    """One writer's log of its files' signatures, `signatures/NAME.jsonl` (each extraction shard
    and convert write their own: no two processes append to one file), made at its first line.
    Thread-safe: extraction's writers record from a pool."""

    def __init__(self, root: str | os.PathLike, name: str, of: str):
        self.path = Path(root) / SIGNATURES_DIR / f"{name}.jsonl"
        self.of = of  # the extraction's key: its data_config.json's signature_key
        self.lock = threading.Lock()
        self.opened = False

    def record(self, index: int, signature: Signature, tokens: str) -> None:
        """Appended and synced before the file it describes is renamed into place."""
        line = json.dumps({"v": SCHEME, "of": self.of, "index": index, "tokens": tokens, "slots": signature}) + "\n"
        with self.lock:
            if not self.opened:
                self.path.parent.mkdir(exist_ok=True)
                drop_partial_line(self.path)
                self.opened = True
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(line)
                f.flush()
                os.fsync(f.fileno())


def drop_partial_line(path: Path) -> None:
    """A run killed mid-append leaves a line without its newline: cut it, so the next line
    starts on its own (its file was never renamed into place, and is written again)."""
    if not path.is_file():
        return
    with open(path, "r+b") as f:
        size = f.seek(0, os.SEEK_END)
        if size == 0:
            return
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return
        start = max(0, size - (1 << 20))
        f.seek(start)
        tail = f.read()
        cut = tail.rfind(b"\n")
        if cut < 0 and start > 0:  # a line longer than a MiB: no line of ours
            raise ValueError(f"{path}: its last line is longer than any signature line: not a signature log")
        f.truncate(start + cut + 1)


TOKEN_DIGEST_CHARS = 16


def parse_line(raw: bytes) -> tuple[int, Recorded, str, Any]:
    """(index, what it records, the extraction it names, its scheme) of one line; only the
    scheme is read from a line of another scheme."""
    entry = json.loads(raw)
    if not isinstance(entry, dict):
        raise ValueError("a JSON object expected")
    if entry.get("v") != SCHEME:
        return -1, Recorded(array("d"), ""), "", entry.get("v")
    slots, tokens, of = entry["slots"], entry["tokens"], entry["of"]
    if (
        not isinstance(slots, list)
        or not slots
        or not all(isinstance(s, list) and len(s) == PER_SLOT for s in slots)
        or not isinstance(tokens, str)
        or len(tokens) != TOKEN_DIGEST_CHARS
        or not isinstance(of, str)
    ):
        raise ValueError(f"slots of {PER_SLOT} numbers each, a tokens digest and an extraction key expected")
    index = entry["index"]
    if not isinstance(index, int) or isinstance(index, bool):
        raise ValueError(f"index {index!r} is not a sample index")
    return index, Recorded(array("d", (float(v) for s in slots for v in s)), tokens), of, SCHEME


def read_lines(path: Path) -> Iterator[tuple[int, bytes | None]]:
    """(line number, line) of a log; None for a line longer than `MAX_LINE` (skipped, not read
    whole); a last line without its newline is a killed append, whose file never appeared."""
    refuse_non_file(path, "a signature log")  # a pipe would block the read forever
    with open(path, "rb") as f:
        n = 0
        while raw := f.readline(MAX_LINE + 1):
            n += 1
            if len(raw) > MAX_LINE and not raw.endswith(b"\n"):
                while (more := f.readline(MAX_LINE + 1)) and not more.endswith(b"\n"):
                    pass
                yield n, None
                continue
            if not raw.endswith(b"\n"):
                return
            yield n, raw


def read_signatures(
    root: str | os.PathLike, of: str | None = None
) -> tuple[dict[int, list[Recorded]] | None, list[tuple[str, str]]]:
    """Every recorded signature by sample index, each slot's numbers in one flat array (None: the
    dataset records none, as other tools' datasets and older eaglet's do), and each log or line
    that cannot be read or vouches for nothing: (where, why). With `of` (the dataset's
    signature_key), a line another extraction wrote is named, per log, and not kept. Read line by
    line: memory by the records, not the logs."""
    folder = Path(root) / SIGNATURES_DIR
    if not folder.is_dir():
        return None, []
    found: dict[int, list[Recorded]] = {}
    problems = []
    for path in sorted(folder.glob("*.jsonl")):
        rel = f"{SIGNATURES_DIR}/{path.name}"
        foreign: list[int] = []  # line numbers of another extraction's lines
        schemes: dict[Any, int] = {}  # other schemes' line counts
        try:
            for n, raw in read_lines(path):
                try:
                    if raw is None:
                        raise ValueError(f"longer than {MAX_LINE} bytes: no signature line")
                    index, recorded, line_of, scheme = parse_line(raw)
                except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
                    problems.append((f"{rel}:{n}", f"unreadable line ({type(e).__name__}: {str(e)[:200]})"))
                    continue
                if scheme != SCHEME:
                    schemes[scheme] = schemes.get(scheme, 0) + 1
                elif of is not None and line_of != of:
                    foreign.append(n)
                else:
                    found.setdefault(index, []).append(recorded)
        except OSError as e:  # a folder, a dangling link, no permission
            problems.append((rel, f"cannot be read ({e.strerror or e})"))
        except ValueError:  # refuse_non_file: a pipe or device
            problems.append((rel, "a pipe or device, not a log: remove it, and restore the log or extract again"))
        for scheme, count in schemes.items():
            problems.append(
                (
                    rel,
                    f"{count} line(s) of signature scheme v={scheme!r}, this eaglet writes and reads v={SCHEME}: "
                    "made by another eaglet version, or edited; their files are not vouched for: extract again",
                )
            )
        if foreign:
            problems.append(
                (
                    rel,
                    f"{len(foreign)} line(s) (line {', '.join(map(str, foreign[:5]))}{' ...' if len(foreign) > 5 else ''}) "
                    "were written by another extraction (their key is not data_config.json's): copied in from another "
                    "dataset; the files they describe are not vouched for: extract those again",
                )
            )
    return found, problems
