"""The token-level files: the prepared dataset (`eaglet prepare`), the token frequencies it and
every hidden-state dataset carry, and the regenerated chats (`eaglet regen`).

- `prepared.jsonl` (one tokenized chat per line), `prepare_config.json` (written last: its
  presence marks a finished dataset), `token_freq.pt`;
- the regen output: one conversation per JSON line, append-only, resumable. Records are
  `{"id", "messages": [{"role", "content"}...], "regen": {...}}`, which `eaglet prepare` reads as
  OpenAI-style chats; failures go to `OUT.errors.jsonl`.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from eaglet.formats.io import (
    atomic_path,
    failures_named,
    read_json,
    refuse_non_file,
    remove_stale_temp_files,
    torch_load_safe,
    torch_save_atomic,
    write_json_atomic,
)

log = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------
# Token frequencies (shared by the prepared and the hidden-state dataset)
# ---------------------------------------------------------------------------------------------

TOKEN_FREQ_FILE = "token_freq.pt"


def write_token_freq(path: str | os.PathLike, freq: dict[int, int]) -> None:
    """`{token_id: count}` over loss-masked (assistant) tokens, most frequent first."""
    ordered = dict(sorted(((int(k), int(v)) for k, v in freq.items()), key=lambda kv: (-kv[1], kv[0])))
    torch_save_atomic(ordered, path)


def read_token_freq(path: str | os.PathLike) -> dict[int, int]:
    freq = torch_load_safe(path)
    if not isinstance(freq, dict):
        raise ValueError(f"{path}: expected a dict {{token_id: count}}, got {type(freq).__name__}")
    try:
        return {int(k): int(v) for k, v in freq.items()}
    except (TypeError, ValueError, OverflowError) as e:  # a NaN, a string, a tensor of several values
        raise ValueError(
            f"{path}: expected a dict {{token_id: count}} of whole numbers ({e}); run prepare again"
        ) from e


# ---------------------------------------------------------------------------------------------
# Prepared dataset: tokens + assistant-only loss mask
# ---------------------------------------------------------------------------------------------

PREPARED_FILE = "prepared.jsonl"
PREPARE_CONFIG_FILE = "prepare_config.json"


@dataclass
class TokenizedSample:
    """One chat rendered with the target's template: its tokens and assistant-only loss mask."""

    sample_id: str
    input_ids: list[int]
    loss_mask: list[int]

    def to_json(self) -> str:
        return json.dumps({"id": self.sample_id, "input_ids": self.input_ids, "loss_mask": self.loss_mask})

    @classmethod
    def from_json(cls, line: str, where: str) -> TokenizedSample:
        try:
            rec = json.loads(line)
            sample = cls(str(rec["id"]), list(rec["input_ids"]), list(rec["loss_mask"]))
        except (ValueError, KeyError, TypeError, RecursionError) as e:
            # ValueError: bad JSON, or an integer of over 4,300 digits
            raise ValueError(f"{where}: not a prepared sample ({type(e).__name__}: {e})") from e
        if len(sample.input_ids) != len(sample.loss_mask):
            raise ValueError(
                f"{where}: field loss_mask has {len(sample.loss_mask)} entries, input_ids has {len(sample.input_ids)}"
            )
        if not sample.input_ids:
            raise ValueError(f"{where}: sample {sample.sample_id} has no tokens (prepare writes none such)")
        bad = next((m for m in sample.loss_mask if type(m) is not int or m not in (0, 1)), None)
        if bad is not None:
            raise ValueError(
                f"{where}: sample {sample.sample_id}: field loss_mask holds {bad!r}; a loss mask is 0 or "
                "1 per token (prepare the data again)"
            )
        return sample


class PreparedWriter:
    """Streams tokenized samples into `prepared.jsonl` and counts masked-token frequencies on
    the way, so memory does not grow with the dataset. Use as a context manager: the JSONL
    file appears (atomically) when the block succeeds; then `finish` writes the side files."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        self.freq: dict[int, int] = {}
        self.samples = self.tokens = self.masked_tokens = 0

    def __enter__(self) -> PreparedWriter:
        if self.folder.is_dir():  # temp files of a killed earlier run
            remove_stale_temp_files(self.folder, {PREPARED_FILE, TOKEN_FREQ_FILE, PREPARE_CONFIG_FILE})
        self._atomic = atomic_path(self.folder / PREPARED_FILE)
        self._file = open(self._atomic.__enter__(), "w", encoding="utf-8")
        return self

    def __exit__(self, *exc: Any) -> bool | None:
        try:
            self._file.close()  # flushes: a full disk may show only here
        except OSError as e:
            exc = exc if exc[0] is not None else (type(e), e, e.__traceback__)
        if exc[0] is None:
            # An older config would vouch for the new data: drop it just before the new file takes
            # the old one's place, until `finish`. A run that fails earlier (no usable chat, a
            # missing --data, a kill) leaves the earlier output whole.
            (self.folder / PREPARE_CONFIG_FILE).unlink(missing_ok=True)
        return self._atomic.__exit__(*exc)  # renames on success, deletes the temp file on error

    def add(self, sample: TokenizedSample) -> None:
        self._file.write(sample.to_json() + "\n")
        count_masked(self.freq, sample)
        self.samples += 1
        self.tokens += len(sample.input_ids)
        self.masked_tokens += sum(sample.loss_mask)

    def finish(self, config: dict[str, Any]) -> None:
        write_token_freq(self.folder / TOKEN_FREQ_FILE, self.freq)
        write_json_atomic(self.folder / PREPARE_CONFIG_FILE, config)  # last: its presence marks completion


def count_masked(freq: dict[int, int], sample: TokenizedSample) -> None:
    """Add the sample's masked tokens to `freq` (token_freq.pt's counts)."""
    for tok, m in zip(sample.input_ids, sample.loss_mask):
        if m:
            freq[tok] = freq.get(tok, 0) + 1


def prepared_problem(samples: list[TokenizedSample], freq: dict[int, int]) -> str | None:
    """What a prepared dataset's side files say that its samples do not (None: they agree): the
    draft vocabulary is built from token_freq.pt, so a damaged one trains a drafter that cannot
    draft the tokens the data holds."""
    counted: dict[int, int] = {}
    for s in samples:
        count_masked(counted, s)
    if counted != {t: c for t, c in freq.items() if c}:
        token = next(t for t in sorted(set(counted) | set(freq)) if counted.get(t, 0) != freq.get(t, 0))
        return (
            f"{TOKEN_FREQ_FILE} counts token {token} {freq.get(token, 0)} times, the samples' masks "
            f"{counted.get(token, 0)}"
        )
    return None


def read_prepared(folder: str | os.PathLike) -> tuple[list[TokenizedSample], dict[str, Any]]:
    folder = Path(folder)
    config_path = folder / PREPARE_CONFIG_FILE
    if not config_path.exists():
        raise FileNotFoundError(f"{folder}: no {PREPARE_CONFIG_FILE}; not a finished `eaglet prepare` output")
    config = read_json(config_path)
    max_length = config.get("max_length") if isinstance(config, dict) else None
    if not isinstance(config, dict) or not (type(max_length) is int and max_length >= 1):
        raise ValueError(
            f"{config_path}: field max_length {max_length!r}: expected a whole number >= 1 (prepare "
            "writes it); prepare the data again, or restore the file"
        )
    path = folder / PREPARED_FILE
    refuse_non_file(path, "the prepared samples")
    with open(path, encoding="utf-8") as f:
        samples = [TokenizedSample.from_json(line, f"{path}:{n + 1}") for n, line in enumerate(f)]
    longest = max(range(len(samples)), key=lambda n: len(samples[n].input_ids), default=None)
    if longest is not None and len(samples[longest].input_ids) > max_length:
        # every stage after prepare trusts the recorded bound (extract records it as the dataset's)
        raise ValueError(
            f"{path}:{longest + 1}: a sample of {len(samples[longest].input_ids)} tokens, beyond "
            f"{PREPARE_CONFIG_FILE}'s max_length {max_length}; the files were changed since prepare: "
            "prepare the data again"
        )
    return samples, config


def check_prepared_token_ids(folder: str | os.PathLike, samples: list[TokenizedSample], vocab_size: int) -> None:
    """Refuse a sample of `read_prepared(folder)` with a token id the target has no embedding for
    (not an integer, negative, or >= `vocab_size`): run, the target would fail deep inside with
    "index out of range in self", naming neither file nor sample."""
    path = Path(folder) / PREPARED_FILE
    for n, s in enumerate(samples):
        # type(...) is int: a JSON float or bool would be cast by torch.tensor, not refused
        k = next((k for k, t in enumerate(s.input_ids) if type(t) is not int or not 0 <= t < vocab_size), None)
        if k is not None:
            raise ValueError(
                f"{path}:{n + 1}: sample {s.sample_id}: token id {s.input_ids[k]!r} (token {k}) is not "
                f"in the target's vocabulary of {vocab_size} (ids 0 to {vocab_size - 1}); prepare the "
                "data again with this target's tokenizer"
            )


# ---------------------------------------------------------------------------------------------
# Regenerated chats (`eaglet regen`)
# ---------------------------------------------------------------------------------------------


def errors_path(out: str | os.PathLike) -> Path:
    out = Path(out)
    stem = out.name[: -len(".jsonl")] if out.name.endswith(".jsonl") else out.name
    return out.with_name(stem + ".errors.jsonl")


ERROR_RECORD_KEYS = {"id", "reason"}  # a line of regen's errors report


def is_errors_report(path: Path) -> bool:
    """Whether every line of `path` is a record of regen's errors report (an empty file is one)."""
    with open(path, "rb") as f:
        for line in f:
            try:
                record = json.loads(line)
            except (ValueError, RecursionError):
                return False
            if not isinstance(record, dict) or set(record) != ERROR_RECORD_KEYS:
                return False
    return True


def claim_errors_report(out: str | os.PathLike) -> Path:
    """Where this run's errors report goes (OUT.errors.jsonl), which replaces the last run's report
    there and nothing else: a link, a folder or a file of other records (the chats given as
    --data, say) is refused before anything is written."""
    path = errors_path(out)
    if path.is_symlink() or (path.exists() and not path.is_file()):
        kind = "a symbolic link" if path.is_symlink() else "not a regular file"
        raise FileExistsError(
            f"{path}: regen writes its errors report here, and this is {kind}; move it away, or choose another --out"
        )
    if path.exists() and not is_errors_report(path):
        raise FileExistsError(
            f"{path}: regen writes its errors report here, and this file holds other records; "
            "move or rename it, or choose another --out (eaglet never overwrites data)"
        )
    return path


def scan_output(path: str | os.PathLike) -> tuple[set[str], int, bool]:
    """Ids of the complete lines of a regen output, the byte length they span, and whether a
    partial last line follows them. A line counts only once its newline is written: each line
    goes out in one write, so a kill mid-write leaves a last line without one."""
    done: set[str] = set()
    good = 0
    with open(path, "rb") as f:  # streamed: an output of a million chats need not fit in memory
        for n, line in enumerate(f, 1):
            if not line.endswith(b"\n"):
                if parses(line):  # a whole record without its newline: no write of regen's leaves that
                    refuse_foreign(path, n, "a whole record without a newline")
                break  # a kill's partial last line: dropped on resume
            if line.strip():
                try:
                    record = json.loads(line)
                except (ValueError, RecursionError) as e:
                    refuse_foreign(path, n, f"{type(e).__name__}: {e}")
                if not is_regen_record(record):
                    refuse_foreign(path, n, "no id, messages and regen fields")
                done.add(str(record["id"]))
            good += len(line)
        size = f.seek(0, os.SEEK_END)
    return done, good, good < size


# What makes two regen runs one: answers of another target or sampling are another dataset
REGEN_IDENTITY = ("target_revision", "temperature", "top_p", "max_new_tokens")


def refuse_mixed_regen(path: str | os.PathLike, meta: dict[str, Any]) -> None:
    """On --resume: every line already there was made as this run makes its own (REGEN_IDENTITY)."""
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if not line.endswith(b"\n") or not line.strip():
                continue
            made = json.loads(line)["regen"]
            key = next((k for k in REGEN_IDENTITY if made.get(k) != meta.get(k)), None)
            if key is not None:
                raise ValueError(
                    f"{path}:{n}: made with {key} {made.get(key)!r}, this run has {meta.get(key)!r}; a "
                    "resumed regen continues the same run: give the same options, or another --out"
                )


def is_regen_record(record: Any) -> bool:
    """A line regen writes: its id, the chat's messages and how they were made (`regen`)."""
    return (
        isinstance(record, dict)
        and "id" in record
        and isinstance(record.get("messages"), list)
        and isinstance(record.get("regen"), dict)
    )


def parses(line: bytes) -> bool:
    try:
        json.loads(line)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return False
    return True


def refuse_foreign(path: str | os.PathLike, line: int, why: str) -> NoReturn:
    raise ValueError(
        f"{path}:{line}: not a regen record ({why}); the file was not written by `eaglet regen` alone, "
        "refusing to append to it (nothing was changed)"
    )


class RegenWriter:
    """Appends one JSON line per conversation, flushed and fsynced, so every line a run
    reports as written survives a kill or power loss."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        with failures_named(self.path):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "ab")

    def write(self, record: dict[str, Any]) -> None:
        # One write call per line: a kill leaves at worst one partial line, without newline,
        # which the resume drops (see scan_output).
        with failures_named(self.path):
            self._file.write((json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8"))
            self._file.flush()
            os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> RegenWriter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def open_output(out: Path, resume: bool) -> set[str]:
    """Check `out` may be written; on resume, drop a partial last line and return the done ids."""
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        return set()
    if not resume:
        raise ValueError(
            f"--out {out} exists; pass --resume to continue it, or choose another file "
            f"(eaglet never overwrites regenerated data)"
        )
    done, good, partial = scan_output(out)
    if partial:
        log.warning("%s: dropping a partial last line (a killed run was writing it)", out)
        with open(out, "rb+") as f:
            f.truncate(good)
            os.fsync(f.fileno())
    return done
