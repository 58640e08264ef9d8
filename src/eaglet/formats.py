"""Every on-disk format eaglet reads or writes, each reader beside its writer.

Files on disk are the contract between pipeline stages, so their layout lives here and
nowhere else:

- the *prepared* dataset (`eaglet prepare`): `prepared.jsonl` (one tokenized chat per line),
  `prepare_config.json`, `token_freq.pt`;
- the speculators "v1" hidden-state dataset (`eaglet extract`):
  `hidden_states/rows_{a}-{b}/data_{i}.pt`, plus `data_config.json`, `sample_lengths.json`
  and `token_freq.pt` beside the `hidden_states/` folder.

All writes are atomic (temp file in the same folder, then `os.replace`), so a reader sees a
complete file or none, whatever moment a writer is killed at.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------
# Atomic writes
# ---------------------------------------------------------------------------------------------

TMP_MARK = ".tmp-"  # every temp file eaglet writes has this in its name


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, fsync: bool = True) -> Iterator[Path]:
    """Yield a temp path beside `path`; on success rename it onto `path`, else delete it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}{TMP_MARK}", dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        if fsync:
            with open(tmp_path, "rb+") as f:
                os.fsync(f.fileno())
        os.replace(tmp_path, path)
    finally:
        tmp_path.unlink(missing_ok=True)


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def read_json(path: str | os.PathLike) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def torch_save_atomic(obj: Any, path: str | os.PathLike, fsync: bool = True) -> None:
    with atomic_path(path, fsync=fsync) as tmp:
        torch.save(obj, tmp)


def torch_load_safe(path: str | os.PathLike) -> Any:
    """Load a `.pt` file without executing pickled code (the only way eaglet loads `.pt`)."""
    return torch.load(path, map_location="cpu", weights_only=True)


def remove_stale_temp_files(folder: str | os.PathLike, owned: set[str] | None = None) -> int:
    """Delete temp files a killed writer left behind; `owned` limits it to these final names."""
    removed = 0
    for root, _, files in os.walk(folder):
        for name in files:
            if TMP_MARK not in name or not name.startswith("."):
                continue
            final_name = name[1:].split(TMP_MARK, 1)[0]
            if owned is not None and final_name not in owned:
                continue
            Path(root, name).unlink(missing_ok=True)
            removed += 1
    return removed


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
    return {int(k): int(v) for k, v in freq.items()}


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
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{where}: not a prepared sample ({type(e).__name__}: {e})") from e
        if len(sample.input_ids) != len(sample.loss_mask):
            raise ValueError(
                f"{where}: field loss_mask has {len(sample.loss_mask)} entries, input_ids has {len(sample.input_ids)}"
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
        # An older config would vouch for the new, unfinished data: drop it until `finish`.
        (self.folder / PREPARE_CONFIG_FILE).unlink(missing_ok=True)
        self._atomic = atomic_path(self.folder / PREPARED_FILE)
        self._file = open(self._atomic.__enter__(), "w", encoding="utf-8")
        return self

    def __exit__(self, *exc: Any) -> bool | None:
        self._file.close()
        return self._atomic.__exit__(*exc)  # renames on success, deletes the temp file on error

    def add(self, sample: TokenizedSample) -> None:
        self._file.write(sample.to_json() + "\n")
        for tok, m in zip(sample.input_ids, sample.loss_mask):
            if m:
                self.freq[tok] = self.freq.get(tok, 0) + 1
        self.samples += 1
        self.tokens += len(sample.input_ids)
        self.masked_tokens += sum(sample.loss_mask)

    def finish(self, config: dict[str, Any]) -> None:
        write_token_freq(self.folder / TOKEN_FREQ_FILE, self.freq)
        write_json_atomic(self.folder / PREPARE_CONFIG_FILE, config)  # last: its presence marks completion


def read_prepared(folder: str | os.PathLike) -> tuple[list[TokenizedSample], dict[str, Any]]:
    folder = Path(folder)
    config_path = folder / PREPARE_CONFIG_FILE
    if not config_path.exists():
        raise FileNotFoundError(f"{folder}: no {PREPARE_CONFIG_FILE}; not a finished `eaglet prepare` output")
    path = folder / PREPARED_FILE
    with open(path, encoding="utf-8") as f:
        samples = [TokenizedSample.from_json(line, f"{path}:{n + 1}") for n, line in enumerate(f)]
    return samples, read_json(config_path)


# ---------------------------------------------------------------------------------------------
# speculators "v1" hidden-state dataset
# ---------------------------------------------------------------------------------------------

HIDDEN_STATES_DIR = "hidden_states"
DATA_CONFIG_FILE = "data_config.json"
SAMPLE_LENGTHS_FILE = "sample_lengths.json"
ROWS_PER_FOLDER = 2000
V1_KEYS = ("input_ids", "hidden_states", "loss_mask")
V1_FILE_RE = re.compile(r"^data_(\d+)\.pt$")
V1_FOLDER_RE = re.compile(r"^rows_(\d+)-(\d+)$")

# How layer ids index the target: id 0 = embeddings, id k = output of decoder layer k-1
# (Hugging Face `output_hidden_states`, vLLM and SGLang all count this way).
LAYER_ID_CONVENTION = "hf_hidden_states: 0 = embeddings, k = output of decoder layer k-1"
# The last state (id N) is stored before the target's final norm, as vLLM/speculators do;
# the teacher distribution is lm_head(final_norm(h_N)).
LAST_STATE_PRE_NORM = "pre_norm"


def v1_relative_path(index: int, rows_per_folder: int = ROWS_PER_FOLDER) -> str:
    start = (index // rows_per_folder) * rows_per_folder
    return f"{HIDDEN_STATES_DIR}/rows_{start}-{start + rows_per_folder}/data_{index}.pt"


@dataclass
class V1Sample:
    input_ids: torch.Tensor  # int64 [T]
    hidden_states: list[torch.Tensor]  # each bf16 (or recorded dtype) [T, H], layer ids in order
    loss_mask: torch.Tensor  # int64 [T]

    def to_dict(self) -> dict[str, Any]:
        return {"input_ids": self.input_ids, "hidden_states": self.hidden_states, "loss_mask": self.loss_mask}


def write_v1_sample(out_dir: str | os.PathLike, index: int, sample: V1Sample, fsync: bool = True) -> Path:
    """Write one sample; tensors must own their storage (torch.save writes whole storages)."""
    path = Path(out_dir) / v1_relative_path(index)
    torch_save_atomic(sample.to_dict(), path, fsync=fsync)
    return path


def read_v1_sample(path: str | os.PathLike) -> V1Sample:
    """Load and schema-check one v1 file; errors name the file and the field."""
    obj = torch_load_safe(path)
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: expected a dict, got {type(obj).__name__}")
    if set(obj) != set(V1_KEYS):
        raise ValueError(f"{path}: keys {sorted(obj)} != expected {list(V1_KEYS)}")
    hs = obj["hidden_states"]
    if not isinstance(hs, (list, tuple)) or not all(isinstance(h, torch.Tensor) for h in hs):
        raise ValueError(f"{path}: field hidden_states must be a list of tensors")
    return V1Sample(obj["input_ids"], list(hs), obj["loss_mask"])


def v1_sample_exists(out_dir: str | os.PathLike, index: int) -> bool:
    # Existence means complete: files only appear by atomic rename.
    return (Path(out_dir) / v1_relative_path(index)).exists()


def list_v1_files(out_dir: str | os.PathLike) -> dict[int, Path]:
    """Map sample index -> path for every `rows_*/data_*.pt` under `out_dir/hidden_states`."""
    found: dict[int, Path] = {}
    root = Path(out_dir) / HIDDEN_STATES_DIR
    if not root.is_dir():
        return found
    for folder in sorted(root.iterdir()):
        if not folder.is_dir() or not V1_FOLDER_RE.match(folder.name):
            continue
        for f in folder.iterdir():
            m = V1_FILE_RE.match(f.name)
            if m:
                found[int(m.group(1))] = f
    return found


def write_sample_lengths(path: str | os.PathLike, lengths: dict[int, int]) -> None:
    write_json_atomic(path, {str(i): int(n) for i, n in sorted(lengths.items())})


def read_sample_lengths(path: str | os.PathLike) -> dict[int, int]:
    return {int(k): int(v) for k, v in read_json(path).items()}


def v1_min_bytes_per_token(hidden_size: int, num_states: int = 4) -> int:
    """Lower bound of a v1 file per token: bf16 states plus int64 input_ids and loss_mask."""
    return num_states * hidden_size * 2 + 16


# ---------------------------------------------------------------------------------------------
# Foreign hidden-state layouts (read by `eaglet check`; the writers exist so tests can make them)
#
# - speculators "flat" v1: `data_{i}.pt` directly in the folder, same dict as v1;
# - SpecForge offline: `rows_{k}-{k+2000}/data_{i}.ckpt` (or `.ckpt.gz`, or flat), keys
#   `input_ids`, `loss_mask`, `hidden_state` [T, H] (last) and `aux_hidden_state` [T, 3H];
# - speculators >= 0.5: `hs_{row}.safetensors`, `token_ids` [T], `hidden_states` [T, S, H]
#   (S = 4: 3 aux ids + last), optionally `loss_mask` [T].
# ---------------------------------------------------------------------------------------------

FORMAT_V1 = "speculators-v1"  # this project's layout: hidden_states/rows_{a}-{b}/data_{i}.pt
FORMAT_V1_FLAT = "speculators-v1-flat"  # data_{i}.pt directly in the dataset folder
FORMAT_SPECFORGE = "specforge"  # rows_{a}-{b}/data_{i}.ckpt[.gz]
FORMAT_HS_SAFETENSORS = "speculators-safetensors"  # hs_{row}.safetensors

SPECFORGE_KEYS = ("input_ids", "loss_mask", "hidden_state", "aux_hidden_state")
SPECFORGE_FILE_RE = re.compile(r"^data_(\d+)\.ckpt(\.gz)?$")
HS_SAFETENSORS_KEYS = ("token_ids", "hidden_states")  # plus an optional "loss_mask"
HS_SAFETENSORS_FILE_RE = re.compile(r"^hs_(\d+)\.safetensors$")


def torch_load_safe_bytes(data: bytes) -> Any:
    """`torch_load_safe` for an in-memory file (a decompressed `.ckpt.gz`); never runs pickled code."""
    import io

    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def write_flat_v1_sample(folder: str | os.PathLike, index: int, sample: V1Sample) -> Path:
    path = Path(folder) / f"data_{index}.pt"
    torch_save_atomic(sample.to_dict(), path)
    return path


def specforge_relative_path(index: int, compressed: bool = False, rows_per_folder: int = ROWS_PER_FOLDER) -> str:
    start = (index // rows_per_folder) * rows_per_folder
    return f"rows_{start}-{start + rows_per_folder}/data_{index}.ckpt" + (".gz" if compressed else "")


def write_specforge_sample(folder: str | os.PathLike, index: int, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                           hidden_state: torch.Tensor, aux_hidden_state: torch.Tensor,
                           compressed: bool = False) -> Path:
    """One SpecForge offline file; `aux_hidden_state` is the three aux states concatenated, [T, 3H]."""
    import gzip
    import io

    obj = {"input_ids": input_ids, "loss_mask": loss_mask, "hidden_state": hidden_state,
           "aux_hidden_state": aux_hidden_state}
    path = Path(folder) / specforge_relative_path(index, compressed)
    with atomic_path(path) as tmp:
        if compressed:
            buf = io.BytesIO()
            torch.save(obj, buf)
            tmp.write_bytes(gzip.compress(buf.getvalue(), compresslevel=1))
        else:
            torch.save(obj, tmp)
    return path


def read_specforge_sample(path: str | os.PathLike) -> Any:
    """The raw object of a SpecForge file (schema checks are the caller's); `.gz` is gunzipped in memory."""
    import gzip

    if str(path).endswith(".gz"):
        with gzip.open(path, "rb") as f:
            return torch_load_safe_bytes(f.read())
    return torch_load_safe(path)


def write_hs_safetensors_sample(folder: str | os.PathLike, row: int, token_ids: torch.Tensor,
                                hidden_states: torch.Tensor, loss_mask: torch.Tensor | None = None) -> Path:
    """One speculators >= 0.5 file: `token_ids` [T], `hidden_states` [T, S, H] (S states in id order)."""
    from safetensors.torch import save_file

    tensors = {"token_ids": token_ids.contiguous(), "hidden_states": hidden_states.contiguous()}
    if loss_mask is not None:
        tensors["loss_mask"] = loss_mask.contiguous()
    path = Path(folder) / f"hs_{row}.safetensors"
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp))
    return path


def read_hs_safetensors_sample(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """safetensors holds only raw tensors, so reading one can never run code."""
    from safetensors.torch import load_file

    return load_file(str(path), device="cpu")


@dataclass
class DatasetFiles:
    """The hidden-state files of a dataset folder, listed without trusting their names."""

    format: str | None  # one of FORMAT_*, None when no known layout was found
    files: list[tuple[int, Path]]  # (sample index, path); an index may repeat (a duplicate)
    misplaced: list[tuple[int, Path, str]]  # (index, path, why): a name or folder that breaks the layout
    stray: list[Path]  # files that belong to no layout (temp files of a killed writer, ...)


def _rows_folder_problem(index: int, folder: str, rows_per_folder: int) -> str | None:
    m = V1_FOLDER_RE.match(folder)
    if not m:
        return f"folder {folder!r} is not named rows_{{a}}-{{b}}"
    a, b = int(m.group(1)), int(m.group(2))
    if not a <= index < b:
        return f"index {index} lies outside its folder {folder}"
    if b - a != rows_per_folder or a % rows_per_folder:
        return f"folder {folder} does not follow rows_{{k}}-{{k+{rows_per_folder}}} with k a multiple of {rows_per_folder}"
    return None


def _scan_rows_layout(root: Path, name_re: re.Pattern, rows_per_folder: int, out: DatasetFiles) -> None:
    """Files `rows_*/NAME` under `root` (and NAME directly in `root`, for flat layouts)."""
    for entry in sorted(root.iterdir()):
        if entry.is_dir():
            for f in sorted(entry.rglob("*")):
                if not f.is_file():
                    continue
                m = name_re.match(f.name)
                if not m:
                    out.stray.append(f)
                    continue
                index = int(m.group(1))
                why = (_rows_folder_problem(index, entry.name, rows_per_folder) if f.parent == entry
                       else f"nested below {entry.name}")
                if why:
                    out.misplaced.append((index, f, why))
                out.files.append((index, f))


def list_dataset_files(folder: str | os.PathLike, rows_per_folder: int = ROWS_PER_FOLDER) -> DatasetFiles:
    """Detect which layout `folder` holds and list its files (the first layout found wins)."""
    root = Path(folder)
    hs = root / HIDDEN_STATES_DIR
    if hs.is_dir():
        out = DatasetFiles(FORMAT_V1, [], [], [])
        _scan_rows_layout(hs, V1_FILE_RE, rows_per_folder, out)
        for f in sorted(p for p in hs.iterdir() if p.is_file()):
            m = V1_FILE_RE.match(f.name)
            if m:
                out.files.append((int(m.group(1)), f))
                out.misplaced.append((int(m.group(1)), f, "not inside a rows_{a}-{b} folder"))
            else:
                out.stray.append(f)
        return out
    top = [p for p in sorted(root.iterdir()) if p.is_file()] if root.is_dir() else []
    if any(V1_FILE_RE.match(p.name) for p in top):
        return DatasetFiles(FORMAT_V1_FLAT, [(int(V1_FILE_RE.match(p.name).group(1)), p)
                                             for p in top if V1_FILE_RE.match(p.name)], [], [])
    if any(HS_SAFETENSORS_FILE_RE.match(p.name) for p in top):
        return DatasetFiles(FORMAT_HS_SAFETENSORS, [(int(HS_SAFETENSORS_FILE_RE.match(p.name).group(1)), p)
                                                    for p in top if HS_SAFETENSORS_FILE_RE.match(p.name)], [], [])
    specforge = [p for p in root.rglob("*.ckpt*") if SPECFORGE_FILE_RE.match(p.name)] if root.is_dir() else []
    if specforge:
        out = DatasetFiles(FORMAT_SPECFORGE, [], [], [])
        for p in sorted(specforge):
            index = int(SPECFORGE_FILE_RE.match(p.name).group(1))
            out.files.append((index, p))
            if p.parent != root:  # flat SpecForge folders exist too; rows folders must be right
                rel = p.parent.relative_to(root)
                why = (_rows_folder_problem(index, p.parent.name, rows_per_folder) if len(rel.parts) == 1
                       else f"nested below {rel.parts[0]}")
                if why:
                    out.misplaced.append((index, p, why))
        return out
    return DatasetFiles(None, [], [], [])


def torch_load_safe_mmap(path: str | os.PathLike) -> Any:
    """`torch_load_safe`, with tensors memory-mapped from the file instead of copied: a reader
    that looks at every byte once (eaglet check) skips an allocation and a copy per tensor.
    Still weights_only. Files in torch's legacy (non-zip) format cannot be mapped: plain load."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError as e:
        if "mmap" not in str(e) and "zipfile" not in str(e):
            raise
        return torch_load_safe(path)


# ---------------------------------------------------------------------------------------------
# Regenerated chats (`eaglet regen`): one conversation per JSON line, append-only, resumable.
# Records are `{"id", "messages": [{"role", "content"}...], "regen": {...}}`, which
# `eaglet prepare` reads as OpenAI-style chats.
# ---------------------------------------------------------------------------------------------

def errors_path(out: str | os.PathLike) -> Path:
    out = Path(out)
    stem = out.name[:-len(".jsonl")] if out.name.endswith(".jsonl") else out.name
    return out.with_name(stem + ".errors.jsonl")


def scan_output(path: str | os.PathLike) -> tuple[set[str], int, bool]:
    """Ids of the complete lines of a regen output, the byte length they span, and whether a
    partial last line follows them. A line counts only once its newline is written: each line
    goes out in one write, so a kill mid-write leaves a last line without one."""
    done: set[str] = set()
    good = 0
    with open(path, "rb") as f:  # streamed: an output of a million chats need not fit in memory
        for n, line in enumerate(f, 1):
            if not line.endswith(b"\n"):
                break  # a kill's partial last line: dropped on resume
            if line.strip():
                try:
                    done.add(str(json.loads(line)["id"]))
                except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as e:
                    raise ValueError(f"{path}:{n}: not a regen record ({type(e).__name__}); the file was not "
                                     f"written by `eaglet regen` alone, refusing to append to it") from e
            good += len(line)
        size = f.seek(0, os.SEEK_END)
    return done, good, good < size


class RegenWriter:
    """Appends one JSON line per conversation, flushed and fsynced, so every line a run
    reports as written survives a kill or power loss."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "ab")

    def write(self, record: dict[str, Any]) -> None:
        # One write call per line: a kill leaves at worst one partial line, without newline.
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
        return set()
    if not resume:
        raise ValueError(f"--out {out} exists; pass --resume to continue it, or choose another file "
                              f"(eaglet never overwrites regenerated data)")
    done, good, partial = scan_output(out)
    if partial:
        log.warning("%s: dropping a partial last line (a killed run was writing it)", out)
        with open(out, "rb+") as f:
            f.truncate(good)
            os.fsync(f.fileno())
    return done
