"""Every on-disk format eaglet reads or writes, each reader beside its writer.

Files on disk are the contract between pipeline stages, so their layout lives here and
nowhere else:

- the *prepared* dataset (`eaglet prepare`): `prepared.jsonl` (one tokenized chat per line),
  `prepare_config.json`, `token_freq.pt`;
- the speculators "v1" hidden-state dataset (`eaglet extract`):
  `hidden_states/rows_{a}-{b}/data_{i}.pt`, plus `data_config.json`, `sample_lengths.json`
  and `token_freq.pt` beside the `hidden_states/` folder;
- speculators' current dataset layout (`eaglet extract --layout speculators`, `eaglet convert`):
  an Arrow table of tokens and loss masks plus `hidden_states/hs_{row}.safetensors`;
- eaglet's compact dataset (`--layout compact`): 6-bit aux states and the target's top-K in
  place of the last state, `compact/rows_{a}-{b}/data_{i}.safetensors`;
- the foreign layouts `eaglet check` and `eaglet train` read (flat v1, SpecForge);
- drafter folders for the serving engines (`eaglet export` / `eaglet import`): the speculators
  (vLLM) and EAGLE-3 / SGLang `config.json` layouts and their weight names.

All writes are atomic (temp file in the same folder, then `os.replace`), so a reader sees a
complete file or none, whatever moment a writer is killed at.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import json
import logging
import os
import pickle
import re
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------
# Atomic writes
# ---------------------------------------------------------------------------------------------

TMP_MARK = ".tmp-"  # every temp file eaglet writes has this in its name


class WriteFailed(OSError):
    """A write that failed, said in one line that names the file, why, and what to do."""

    def __str__(self) -> str:
        return self.strerror or super().__str__()


# Below this much free space a failed write is taken to be a full disk: torch.save reports one as
# "[enforce fail at inline_container.cc] unexpected pos", with neither errno nor file name.
LOW_SPACE_BYTES = 64 << 20
WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO,
                errno.ENOTDIR, errno.EEXIST}


def free_bytes(folder: Path) -> int | None:
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None


def disk_nearly_full(folder: Path) -> bool:
    free = free_bytes(folder)
    return free is not None and free < LOW_SPACE_BYTES


def os_error_reason(error: BaseException, path: Path) -> str:
    """Why a file operation on `path` failed, with the recovery step for the kinds a user can fix."""
    folder = path.parent if path.parent.exists() else Path.cwd()  # where free space is measured
    code = getattr(error, "errno", None)
    if code == errno.ENOSPC or disk_nearly_full(folder):
        return (f"no space left on the device ({(free_bytes(folder) or 0) >> 20} MiB free); free some space and "
                "run the same command again: finished files are kept and the stage resumes where it stopped")
    if code in (errno.EROFS, errno.EACCES, errno.EPERM):
        return f"{os.strerror(code).lower()}; use another folder (--out) or fix its permissions"
    return getattr(error, "strerror", None) or str(error)


def write_failure(path: Path, error: BaseException) -> WriteFailed:
    """A failed write of `path` as one line: the file, why, what to do (every eaglet stage resumes)."""
    code = getattr(error, "errno", None) or errno.EIO
    return WriteFailed(code, f"could not write {path}: {os_error_reason(error, path)}")


@contextlib.contextmanager
def failures_named(path: Path) -> Iterator[None]:
    """Turn a failed write inside the block into a WriteFailed naming `path` (other errors pass)."""
    try:
        yield
    except WriteFailed:
        raise
    except (OSError, RuntimeError) as e:
        # Only what a write can fail with: the block may also read (prepare streams its input
        # inside one), and a missing input file is not a failed write.
        if getattr(e, "errno", None) in WRITE_ERRNOS or disk_nearly_full(path.parent):
            raise write_failure(path, e) from e
        raise


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, fsync: bool = True) -> Iterator[Path]:
    """Yield a temp path beside `path`; on success rename it onto `path`, else delete it.

    A failed write (full disk, read-only folder) is a WriteFailed naming `path`."""
    path = Path(path)
    with failures_named(path):
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
    """The parsed file; a malformed one is a ValueError that names it (and line/column)."""
    with open(path, encoding="utf-8") as f:
        try:
            return json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: not valid JSON ({e}); the file is damaged or cut off") from e


def torch_save_atomic(obj: Any, path: str | os.PathLike, fsync: bool = True) -> None:
    with atomic_path(path, fsync=fsync) as tmp:
        torch.save(obj, tmp)


# What torch's weights-only unpickler says when a file asks for an object outside its allow-list
# (a class, a function to call); garbage bytes fail the same loader with "Unsupported operand".
PICKLED_CODE_MARKERS = ("Unsupported global", "unsupported GLOBAL", "Can only create new object",
                        "Can only build Tensor")


class TorchFileRefused(pickle.UnpicklingError, ValueError):
    """A `.pt` / `.bin` file the weights-only loader refused, said in one line that names the file.

    Still an UnpicklingError, so callers that classify torch's own error keep working; a
    ValueError, so the command line prints it as the one line it is."""


def weights_only_detail(message: str) -> str:
    """The weights-only unpickler's own diagnosis in torch's message, without the advice around it
    (torch suggests weights_only=False or allow-listing the class: running the file's code)."""
    if "WeightsUnpickler error:" not in message:
        return "refused by the weights-only loader"
    detail = message.split("WeightsUnpickler error:", 1)[1].strip().splitlines() or [""]
    return detail[0].split(". Please", 1)[0].strip().rstrip(".")


def torch_load_safe(path: str | os.PathLike) -> Any:
    """Load a `.pt` / `.bin` file without executing pickled code (the only way eaglet loads them).

    A file that needs more than tensors and plain containers is refused with what to do instead."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        text = str(e)
        if "Weights only load failed" not in text:
            raise
        detail = weights_only_detail(text)
        if any(m in text for m in PICKLED_CODE_MARKERS):
            raise TorchFileRefused(
                f"{path}: holds Python objects beyond tensors ({detail}), which eaglet will not execute (it loads "
                ".pt/.bin files with weights_only=True); in an environment you trust, load it and re-save its "
                "tensors as safetensors, or torch.save them as a plain dict of tensors") from e
        raise TorchFileRefused(f"{path}: not a readable torch file ({detail}); it is damaged or was not written "
                               "by torch.save: restore it or write it again") from e


def remove_stale_temp_files(folder: str | os.PathLike, owned: set[str] | None = None) -> int:
    """Delete temp files and folders (atomic_dir's) a killed writer left behind; `owned` limits it to
    these final names. A folder that does not exist (yet) has none."""
    def stale(name: str) -> bool:
        return name.startswith(".") and TMP_MARK in name and (owned is None or name[1:].split(TMP_MARK, 1)[0] in owned)

    removed = 0
    for root, dirs, files in os.walk(folder):
        for name in [d for d in dirs if stale(d)]:
            shutil.rmtree(Path(root, name), ignore_errors=True)
            dirs.remove(name)
            removed += 1
        for name in filter(stale, files):
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


def check_prepared_token_ids(folder: str | os.PathLike, samples: list[TokenizedSample], vocab_size: int) -> None:
    """Refuse a sample of `read_prepared(folder)` with a token id the target has no embedding for
    (not an integer, negative, or >= `vocab_size`): run, the target would fail deep inside with
    "index out of range in self", naming neither file nor sample."""
    path = Path(folder) / PREPARED_FILE
    for n, s in enumerate(samples):
        # type(...) is int: a JSON float or bool would be cast by torch.tensor, not refused
        k = next((k for k, t in enumerate(s.input_ids) if type(t) is not int or not 0 <= t < vocab_size), None)
        if k is not None:
            raise ValueError(f"{path}:{n + 1}: sample {s.sample_id}: token id {s.input_ids[k]!r} (token {k}) is not "
                             f"in the target's vocabulary of {vocab_size} (ids 0 to {vocab_size - 1}); prepare the "
                             "data again with this target's tokenizer")


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


def rows_folder(index: int, rows_per_folder: int = ROWS_PER_FOLDER) -> str:
    """`rows_{a}-{b}`, the folder of sample `index` in the layouts that group files by rows."""
    start = (index // rows_per_folder) * rows_per_folder
    return f"rows_{start}-{start + rows_per_folder}"


def v1_relative_path(index: int, rows_per_folder: int = ROWS_PER_FOLDER) -> str:
    return f"{HIDDEN_STATES_DIR}/{rows_folder(index, rows_per_folder)}/data_{index}.pt"


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


def read_v1_sample(path: str | os.PathLike, mmap: bool = False) -> V1Sample:
    """Load and schema-check one v1 file; errors name the file and the field. `mmap` maps the
    tensors instead of reading them, for a caller that only looks at some of them."""
    obj = torch_load_safe_mmap(path) if mmap else torch_load_safe(path)
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: expected a dict, got {type(obj).__name__}")
    if set(obj) != set(V1_KEYS):
        raise ValueError(f"{path}: keys {sorted(obj)} != expected {list(V1_KEYS)}")
    hs = obj["hidden_states"]
    if not isinstance(hs, (list, tuple)) or not all(isinstance(h, torch.Tensor) for h in hs):
        raise ValueError(f"{path}: field hidden_states must be a list of tensors")
    return V1Sample(obj["input_ids"], list(hs), obj["loss_mask"])


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
    return f"{rows_folder(index, rows_per_folder)}/data_{index}.ckpt" + (".gz" if compressed else "")


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


def read_safetensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file (raw tensors only: reading one never runs code); a
    truncated or damaged file is a ValueError that names it."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path), device="cpu")
    except SafetensorError as e:
        raise ValueError(f"{path}: not a readable safetensors file, truncated or damaged ({e})") from e


def read_hs_safetensors_sample(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    return read_safetensors(path)


# ---------------------------------------------------------------------------------------------
# speculators' dataset layout (speculators >= 0.6: `prepare_data`, then offline generation), which
# `speculators train` reads (speculators/train/data.py ArrowDataset):
# - an Arrow table saved by `datasets.Dataset.save_to_disk` (data-*.arrow, dataset_info.json,
#   state.json) in the folder, one row per sample: `input_ids` and `loss_mask` (int64 lists) and
#   `seq_len`, in the torch format;
# - `hidden_states/hs_{row}.safetensors`: `token_ids` [T] and `hidden_states` [T, S, H] (S = the
#   three aux states and the last, in id order). The loss mask lives only in the table: row i
#   pairs with file i, and speculators skips a row whose file's token_ids differ from its input_ids;
# - `token_freq.pt` ({token id: count}), which `speculators train` builds d2t/t2d from.
# ---------------------------------------------------------------------------------------------

FORMAT_SPECULATORS_ARROW = "speculators-arrow"
ARROW_STATE_FILE = "state.json"  # written last by save_to_disk: the table is complete once it exists
SPECULATORS_ROW_COLUMNS = ("input_ids", "loss_mask", "seq_len")


def _datasets_module() -> Any:
    try:
        import datasets
    except ImportError as e:
        raise ImportError("speculators' dataset layout is an Arrow table read and written with the `datasets` "
                          "library: pip install 'eaglet[speculators]'") from e
    return datasets


def speculators_hs_path(folder: str | os.PathLike, row: int) -> Path:
    return Path(folder) / HIDDEN_STATES_DIR / f"hs_{row}.safetensors"


def write_speculators_sample(folder: str | os.PathLike, row: int, token_ids: torch.Tensor,
                             states: list[torch.Tensor]) -> Path:
    """`hidden_states/hs_{row}.safetensors`: the states stacked [T, S, H] in id order, no loss mask."""
    return write_hs_safetensors_sample(Path(folder) / HIDDEN_STATES_DIR, row, token_ids, torch.stack(states, dim=1))


def write_speculators_rows(folder: str | os.PathLike, rows: list[tuple[Any, Any]]) -> None:
    """The Arrow table of (input_ids, loss_mask) rows, saved as speculators' prepare_data saves it.
    save_to_disk writes into a temp folder beside; its files are renamed in with state.json last."""
    ds = _datasets_module()
    features = ds.Features({"input_ids": ds.List(ds.Value("int64")), "loss_mask": ds.List(ds.Value("int64")),
                            "seq_len": ds.Value("int64")})
    import numpy as np

    table = ds.Dataset.from_dict({"input_ids": [np.asarray(ids, dtype=np.int64) for ids, _ in rows],
                                  "loss_mask": [np.asarray(mask, dtype=np.int64) for _, mask in rows],
                                  "seq_len": [len(ids) for ids, _ in rows]}, features=features)
    table.set_format("torch")
    folder = Path(folder)
    with failures_named(folder / ARROW_STATE_FILE):
        folder.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".table{TMP_MARK}", dir=folder))
        bars_were_on = not ds.are_progress_bars_disabled()
        try:
            ds.disable_progress_bars()  # a table of token lists saves in a blink; eaglet shows its own progress
            table.save_to_disk(str(tmp))
            names = sorted((p.name for p in tmp.iterdir()), key=lambda n: n == ARROW_STATE_FILE)
            for old in folder.glob("data-*.arrow"):  # shards of an earlier table this one does not have
                if old.name not in names:
                    old.unlink()
            for name in names:
                os.replace(tmp / name, folder / name)
        finally:
            if bars_were_on:
                ds.enable_progress_bars()
            shutil.rmtree(tmp, ignore_errors=True)


@functools.lru_cache(maxsize=8)
def _load_rows(folder: str, stamp: int) -> Any:
    del stamp  # part of the cache key only: a rewritten table is read again
    try:
        table = _datasets_module().load_from_disk(folder)
    except ImportError:
        raise
    except Exception as e:
        raise ValueError(f"{folder}: its Arrow table (state.json, data-*.arrow) is not readable: "
                         f"{type(e).__name__}: {e}") from e
    if not hasattr(table, "column_names"):
        raise ValueError(f"{folder}: holds a DatasetDict; speculators trains from a single Dataset")
    missing = [c for c in SPECULATORS_ROW_COLUMNS if c not in table.column_names]
    if missing:
        raise ValueError(f"{folder}: its Arrow table has columns {table.column_names}, missing {missing}")
    return table.with_format(None)


def read_speculators_rows(folder: str | os.PathLike) -> Any:
    """The folder's Arrow table (a `datasets.Dataset`, memory-mapped, plain Python rows), cached
    while its state.json is unchanged; a ValueError naming the folder when it is unreadable."""
    state = Path(folder) / ARROW_STATE_FILE
    return _load_rows(str(Path(folder).resolve()), state.stat().st_mtime_ns)


def speculators_row(folder: str | os.PathLike, row: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(input_ids, loss_mask, seq_len) of one row of the table."""
    table = read_speculators_rows(folder)
    if not 0 <= row < len(table):
        raise ValueError(f"{speculators_hs_path(folder, row)}: no row {row} in the Arrow table of {folder} "
                         f"({len(table)} rows)")
    r = table[row]
    return (torch.tensor(r["input_ids"], dtype=torch.long), torch.tensor(r["loss_mask"], dtype=torch.long),
            int(r["seq_len"]))


def speculators_row_of(path: str | os.PathLike) -> tuple[Path, int]:
    """(dataset folder, row) of a `hidden_states/hs_{row}.safetensors` file."""
    path = Path(path)
    m = HS_SAFETENSORS_FILE_RE.match(path.name)
    if not m:
        raise ValueError(f"{path}: not named hs_{{row}}.safetensors")
    return path.parent.parent, int(m.group(1))


# ---------------------------------------------------------------------------------------------
# eaglet's compact layout (`eaglet extract --layout compact`, `eaglet convert --layout compact`):
# `compact/rows_{a}-{b}/data_{i}.safetensors`, one per sample, with
# - `input_ids` int32 [T], `loss_mask` uint8 [T];
# - `aux_codes` uint8 [T, 3, 3H/4] and `aux_scales` fp16 [T, 3, H/32]: the three aux states in
#   6-bit floating point (E3M2, the element type of the OCP MXFP6 format) with an fp16 scale per
#   32 values, four codes packed in three bytes;
# - `teacher_ids` int32 [T, K] and `teacher_log_probs` fp16 [T, K]: in place of the last state,
#   the target's K most likely next tokens (full vocabulary, most likely first, so the first is
#   the argmax) with their log-probabilities, log_softmax(lm_head(final_norm(h_N))).
# data_config.json records "format": "eaglet-compact" and a "compact" section (version, scheme, K).
# Since version 2 each file's header metadata holds a checksum of every tensor (see below).
# Measured on SmolLM2 states: E3M2 with 32-value groups has 1.4 % relative RMS error (fp8 E4M3
# with a scale per row: 1.0 %, at 8.06 bits instead of 6.5: the fp8 aux alone would be 0.375x of
# v1's bytes, above the 0.35x this layout is for); see bench/compact.py for the training effect.
# ---------------------------------------------------------------------------------------------

FORMAT_COMPACT = "eaglet-compact"
COMPACT_DIR = "compact"
COMPACT_VERSION = 2  # 2: every file carries a checksum of each of its tensors; 1: none
# Version-1 data is still read, with a warning (`eaglet check`: on data_config.json; training: once per
# dataset). Its files hold the same tensors in the same encoding, so they train exactly as before;
# refusing them would cost a re-extraction (GPU hours, when the source states were deleted for the
# space this layout saves) and leave the data no more correct. What it lacks is only the means to find
# damage, and the warning says how to get it. Writers always write the current version, and never
# into a version-1 folder (data_config.json's "compact" section must match to resume).
COMPACT_READ_VERSIONS = (1, COMPACT_VERSION)
COMPACT_UNCHECKED_VERSION = 1
# What recovers a damaged file (extract and convert resume: they write only the missing samples),
# and a dataset of files without checksums.
COMPACT_REWRITE_FILE = ("delete the file and re-run the `eaglet extract --layout compact` (or `eaglet convert --layout "
                        "compact`) that made the dataset, into the same folder: it writes only the missing samples")
COMPACT_REWRITE_DATASET = ("to get files that can be checked, run `eaglet convert --layout compact` from the dataset "
                           "it was made from (or `eaglet extract --layout compact`) into a new folder")
COMPACT_FILE_RE = re.compile(r"^data_(\d+)\.safetensors$")
COMPACT_KEYS = ("input_ids", "loss_mask", "aux_codes", "aux_scales", "teacher_ids", "teacher_log_probs")
FP6_GROUP = 32  # values sharing one scale


def _fp6_e3m2_magnitudes() -> torch.Tensor:
    """The 32 non-negative E3M2 values (3 exponent bits, bias 3, 2 mantissa bits, subnormals), ascending."""
    mags = [(m / 4) * 2.0 ** -2 for m in range(4)]  # exponent field 0: subnormals 0, 0.0625, 0.125, 0.1875
    mags += [(1 + m / 4) * 2.0 ** (e - 3) for e in range(1, 8) for m in range(4)]
    return torch.tensor(mags)


FP6_MAGNITUDES = _fp6_e3m2_magnitudes()  # code & 31 indexes this; code & 32 is the sign
FP6_MAX = float(FP6_MAGNITUDES[-1])  # 28
FP6_VALUES = torch.cat([FP6_MAGNITUDES, -FP6_MAGNITUDES])  # decode table, indexed by the 6-bit code
_FP6_MIDPOINTS = (FP6_MAGNITUDES[1:] + FP6_MAGNITUDES[:-1]) / 2


def pack_6bit(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes < 64, last dim a multiple of 4 -> 3 bytes per 4 codes (little end first)."""
    c = codes.reshape(*codes.shape[:-1], -1, 4).to(torch.int32)
    word = c[..., 0] | (c[..., 1] << 6) | (c[..., 2] << 12) | (c[..., 3] << 18)
    out = torch.stack([word & 0xFF, (word >> 8) & 0xFF, (word >> 16) & 0xFF], dim=-1)
    return out.reshape(*codes.shape[:-1], -1).to(torch.uint8)


def unpack_6bit(packed: torch.Tensor) -> torch.Tensor:
    b = packed.reshape(*packed.shape[:-1], -1, 3).to(torch.int32)
    word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)
    out = torch.stack([word & 63, (word >> 6) & 63, (word >> 12) & 63, (word >> 18) & 63], dim=-1)
    return out.reshape(*packed.shape[:-1], -1).to(torch.uint8)


def quantize_fp6(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., H] (H a multiple of 32) -> (packed codes uint8 [..., 3H/4], scales fp16 [..., H/32]):
    each group of 32 scaled so its largest magnitude is E3M2's largest, rounded to the nearest value."""
    check_compact_hidden_size(x.shape[-1], "compact layout")
    g = x.float().reshape(*x.shape[:-1], -1, FP6_GROUP)
    if not torch.isfinite(g).all():
        raise ValueError("hidden states hold NaN/Inf (`eaglet check` on a v1 copy names the rows)")
    scale = (g.abs().amax(-1, keepdim=True) / FP6_MAX).to(torch.float16)
    if not torch.isfinite(scale).all():
        raise ValueError(f"hidden state values up to {float(g.abs().max()):.3g} overflow the fp16 scale")
    s = scale.float()
    mag = torch.bucketize((g / torch.where(s > 0, s, 1.0)).abs(), _FP6_MIDPOINTS)
    codes = (mag | ((g < 0).to(mag.dtype) << 5)).to(torch.uint8)
    return pack_6bit(codes.reshape(x.shape)), scale.squeeze(-1)


def dequantize_fp6(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    values = FP6_VALUES[unpack_6bit(packed).long()]
    g = values.reshape(*scales.shape, FP6_GROUP) * scales.float().unsqueeze(-1)
    return g.reshape(*scales.shape[:-1], -1).to(dtype)


def impossible_fp6_groups(packed: torch.Tensor, scales: torch.Tensor,
                          values: torch.Tensor | None = None) -> torch.Tensor:
    """[..., H/32] bool: the groups whose codes and scale `quantize_fp6` cannot have written
    (`values`: their `dequantize_fp6`, fp32, when the caller has it; else computed).

    The packing itself has no spare bits (four codes fill three bytes, and every one of the 64
    codes is written, 32 being -0), so no byte value, not even a row of 0xFF, is impossible on its
    own: the checksum finds those. What the encoder does guarantee: each group is scaled so that its
    largest magnitude becomes E3M2's largest (code 31 or 63, the value +-28 x the scale) - the fp16
    rounding of a normal scale moves it by < 0.1 %, the rounding boundary is 7 % lower; a zero scale
    (an all-zero group, or one below fp16's range) leaves only codes 0 and 32; and a scale is never
    negative. A subnormal scale rounds coarsely enough to miss code 31, so such groups are not judged."""
    s = scales.float()
    if values is None:
        values = dequantize_fp6(packed, scales)
    top = values.abs().reshape(*scales.shape, FP6_GROUP).amax(-1)  # exactly 28 x s where a code is 31 or 63
    bad = ((s >= torch.finfo(torch.float16).tiny) & (top != FP6_MAX * s)) | torch.signbit(s)
    zero = s == 0
    if zero.any():  # every value of such a group is 0 whatever its codes: look at the codes (few groups)
        codes = unpack_6bit(packed.reshape(*scales.shape, FP6_GROUP * 3 // 4)[zero])
        bad[zero] |= (codes & 31).amax(-1) != 0
    return bad


def compact_config(top_k: int) -> dict[str, Any]:
    """data_config.json's "compact" section: what a reader needs to know the files' scheme."""
    return {"version": COMPACT_VERSION, "aux": f"fp6_e3m2, fp16 scale per {FP6_GROUP}", "teacher_top_k": top_k}


def _compact_version(cfg: dict[str, Any]) -> Any:
    return (cfg.get("compact") or {}).get("version")


def compact_version_problem(cfg: dict[str, Any]) -> str | None:
    """Why data_config.json's compact section is not one this eaglet reads (None: it is)."""
    version = _compact_version(cfg)
    if version in COMPACT_READ_VERSIONS:
        return None
    return (f"compact version {version!r}: this eaglet reads versions {', '.join(map(str, COMPACT_READ_VERSIONS))}; "
            "use the eaglet that wrote it, or write the dataset again with `eaglet convert --layout compact` "
            "(or `eaglet extract --layout compact`) into a new folder")


def compact_version_warning(cfg: dict[str, Any]) -> str | None:
    """What a readable compact version lacks (None: nothing): version 1's files carry no checksum."""
    if _compact_version(cfg) != COMPACT_UNCHECKED_VERSION:
        return None
    return (f"compact version {COMPACT_UNCHECKED_VERSION}, written before files carried checksums: a flipped bit or an "
            f"overwritten row in them cannot be found; {COMPACT_REWRITE_DATASET}")


def check_compact_hidden_size(hidden_size: int, where: str) -> None:
    """Refuse, before any work, a hidden size the compact layout's groups do not divide."""
    if hidden_size % FP6_GROUP:
        raise ValueError(f"{where}: hidden size {hidden_size} is not a multiple of {FP6_GROUP}, the compact layout's "
                         "scale group; use --layout v1")


def compact_relative_path(index: int, rows_per_folder: int = ROWS_PER_FOLDER) -> str:
    return f"{COMPACT_DIR}/{rows_folder(index, rows_per_folder)}/data_{index}.safetensors"


@dataclass
class StoredTeacher:
    """The target's top-K next tokens at each position (full vocabulary ids, most likely first)."""

    ids: torch.Tensor  # int32 [T, K]
    log_probs: torch.Tensor  # fp16 [T, K], log_softmax over the full vocabulary


# The checksum: a compact file's header metadata (read without its tensors) holds one entry,
# "sha256": a JSON object of each tensor's name and the hex sha256 of its bytes as stored. One entry,
# because safetensors writes several in no fixed order, and a sample written again must be the same
# bytes. So a flipped bit or an overwritten row in any tensor is found, and the tensor named, by
# `eaglet check` and by training's reader. sha256 rather than blake2b: with the SHA instructions of
# current x86 CPUs it hashes ~1.2 GB/s to blake2b's ~0.7. Measured on a 20 MB file (T 2048, H 4096):
# 17 ms, 2-3 % of training's reader, whose dequantization of the aux states takes ~35 ms per MB.
COMPACT_CHECKSUM = "sha256"


@dataclass
class CompactFile:
    """A compact file's tensors and its header metadata (the checksums)."""

    tensors: dict[str, torch.Tensor]
    metadata: dict[str, str]


def tensor_digest(t: torch.Tensor) -> str:
    """sha256 of a tensor's bytes as safetensors stores them (C order, little-endian), without a copy."""
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy()).hexdigest()


def compact_checksums(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """The header metadata a compact file is written with: the digest of each of its tensors."""
    return {COMPACT_CHECKSUM: json.dumps({k: tensor_digest(t) for k, t in tensors.items()}, sort_keys=True)}


def has_compact_checksums(metadata: dict[str, str]) -> bool:
    return COMPACT_CHECKSUM in metadata


def compact_checksum_problems(f: CompactFile) -> list[str]:
    """Each tensor of `f` whose bytes do not match the checksum written with the file, in a phrase
    that names it ([]: all match)."""
    if not has_compact_checksums(f.metadata):
        return [f"no {COMPACT_CHECKSUM} checksums in its header (written before compact version {COMPACT_VERSION}, "
                "by another tool, or rewritten since)"]
    try:
        digests = json.loads(f.metadata[COMPACT_CHECKSUM])
        if not isinstance(digests, dict):
            raise ValueError(f"a JSON {type(digests).__name__}")
    except ValueError as e:  # a flipped bit in the header's checksum text itself
        return [f"the {COMPACT_CHECKSUM} checksums in its header are not a JSON object of digests ({e})"]
    out = []
    for k, t in f.tensors.items():
        if k not in digests:
            out.append(f"{k} has no {COMPACT_CHECKSUM} in the header")
        elif tensor_digest(t) != digests[k]:
            out.append(f"{k}: its bytes do not match the {COMPACT_CHECKSUM} written with them, so they changed since "
                       "(disk, copy or edit)")
    return out


def read_compact_file(path: str | os.PathLike) -> CompactFile:
    from safetensors import safe_open

    tensors = read_safetensors(path)  # names a truncated or damaged file
    with safe_open(str(path), framework="pt") as h:  # the header again, without the tensors
        return CompactFile(tensors, h.metadata() or {})


def write_compact_sample(out_dir: str | os.PathLike, index: int, input_ids: torch.Tensor,
                         aux_states: list[torch.Tensor], loss_mask: torch.Tensor, teacher: StoredTeacher) -> Path:
    from safetensors.torch import save_file

    path = Path(out_dir) / compact_relative_path(index)
    if len(aux_states) != EAGLE3_NUM_STATES - 1:
        raise ValueError(f"{path}: {len(aux_states)} aux states, expected {EAGLE3_NUM_STATES - 1}")
    try:
        codes, scales = quantize_fp6(torch.stack(aux_states, dim=1))
    except ValueError as e:
        raise ValueError(f"{path} (sample {index}): {e}") from e
    tensors = {"input_ids": input_ids.to(torch.int32), "loss_mask": loss_mask.to(torch.uint8),
               "aux_codes": codes, "aux_scales": scales,
               "teacher_ids": teacher.ids.to(torch.int32), "teacher_log_probs": teacher.log_probs.to(torch.float16)}
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata=compact_checksums(tensors))
    return path


def compact_fields(obj: dict[str, torch.Tensor], path: str | os.PathLike) -> None:
    """Refuse a compact file whose keys or shapes are not the layout's, naming the field."""
    missing = [k for k in COMPACT_KEYS if k not in obj]
    if missing:
        raise ValueError(f"{path}: keys {sorted(obj)}: missing {missing}")
    T = obj["input_ids"].shape[0]
    codes, scales, tids, tlp = (obj[k] for k in ("aux_codes", "aux_scales", "teacher_ids", "teacher_log_probs"))
    if codes.dim() != 3 or scales.dim() != 3 or codes.shape[:2] != (T, 3) or scales.shape[:2] != (T, 3) \
            or codes.shape[2] * 4 != scales.shape[2] * FP6_GROUP * 3:
        raise ValueError(f"{path}: aux_codes {tuple(codes.shape)} and aux_scales {tuple(scales.shape)}: expected "
                         f"[T, 3, 3H/4] and [T, 3, H/{FP6_GROUP}] with T = {T}")
    if tids.dim() != 2 or tids.shape != tlp.shape or tids.shape[0] != T or obj["loss_mask"].shape != (T,):
        raise ValueError(f"{path}: teacher_ids {tuple(tids.shape)}, teacher_log_probs {tuple(tlp.shape)}, loss_mask "
                         f"{tuple(obj['loss_mask'].shape)}: expected [T, K], [T, K] and [T] with T = {T}")


@functools.lru_cache(maxsize=None)
def _warn_unchecked(root: str) -> None:
    log.warning("%s: %s", root, compact_version_warning({"compact": {"version": COMPACT_UNCHECKED_VERSION}}))


def _in_unchecked_dataset(path: str | os.PathLike) -> bool:
    """Whether a compact file is in a version-1 dataset, whose files carry no checksum (warned once
    per dataset). Read only for a file without checksums: every current file has them."""
    root = Path(path).parent.parent.parent  # root/compact/rows_{a}-{b}/data_{i}.safetensors
    try:
        cfg = read_json(root / DATA_CONFIG_FILE)
    except (OSError, ValueError):
        return False
    if not isinstance(cfg, dict) or _compact_version(cfg) != COMPACT_UNCHECKED_VERSION:
        return False
    _warn_unchecked(str(root))
    return True


def verify_compact_file(f: CompactFile, path: str | os.PathLike) -> None:
    """Refuse a compact file whose tensors do not match their checksums, naming them."""
    if not has_compact_checksums(f.metadata) and _in_unchecked_dataset(path):
        return
    damage = compact_checksum_problems(f)
    if damage:
        raise ValueError(f"{path}: {'; '.join(damage)}; {COMPACT_REWRITE_FILE}")


def _compact_training_sample(path: str | os.PathLike) -> TrainingSample:
    f = read_compact_file(path)
    obj = f.tensors
    compact_fields(obj, path)
    verify_compact_file(f, path)  # ~0.8 ms per MB: 2-3 % of this reader (see COMPACT_CHECKSUM)
    aux = dequantize_fp6(obj["aux_codes"], obj["aux_scales"])  # [T, 3, H]
    return TrainingSample(obj["input_ids"].long(), aux.reshape(aux.shape[0], -1), None, obj["loss_mask"].long(),
                          StoredTeacher(obj["teacher_ids"], obj["teacher_log_probs"]))


# ---------------------------------------------------------------------------------------------
# The hidden-state layouts eaglet writes (`eaglet extract --layout`, `eaglet convert --layout`):
# one sample file per index; speculators' layout also needs its table of rows first.
# ---------------------------------------------------------------------------------------------

WRITTEN_LAYOUTS = {"v1": FORMAT_V1, "speculators": FORMAT_SPECULATORS_ARROW, "compact": FORMAT_COMPACT}
# eaglet's own layouts: a folder in them always has data_config.json, sample_lengths.json and token_freq.pt
# (speculators' may have been written by speculators itself, without them).
EAGLET_LAYOUTS = (FORMAT_V1, FORMAT_COMPACT)


def written_layout(name: str) -> str:
    """The FORMAT_* of a `--layout` name."""
    if name not in WRITTEN_LAYOUTS:
        raise ValueError(f"--layout {name!r}: eaglet writes {list(WRITTEN_LAYOUTS)}")
    return WRITTEN_LAYOUTS[name]


def files_dir(out: str | os.PathLike, layout: str) -> Path:
    """The folder under which a layout's sample files live."""
    return Path(out) / (COMPACT_DIR if layout == FORMAT_COMPACT else HIDDEN_STATES_DIR)


def sample_path(out: str | os.PathLike, layout: str, index: int) -> Path:
    if layout == FORMAT_COMPACT:
        return Path(out) / compact_relative_path(index)
    return Path(out) / v1_relative_path(index) if layout == FORMAT_V1 else speculators_hs_path(out, index)


def write_sample(out: str | os.PathLike, layout: str, index: int, input_ids: torch.Tensor,
                 states: list[torch.Tensor], loss_mask: torch.Tensor, teacher: StoredTeacher | None = None) -> Path:
    """One sample's file in `layout` (speculators' keeps the loss mask in its table, not here; the
    compact layout keeps the aux states and, in place of the last state, `teacher`)."""
    if layout == FORMAT_V1:
        return write_v1_sample(out, index, V1Sample(input_ids, states, loss_mask))
    if layout == FORMAT_COMPACT:
        if teacher is None:
            raise ValueError(f"compact sample {index}: the layout stores the target's top-K in place of the last state")
        return write_compact_sample(out, index, input_ids, states[:EAGLE3_NUM_STATES - 1], loss_mask, teacher)
    return write_speculators_sample(out, index, input_ids, states)


def start_dataset(out: str | os.PathLike, layout: str, rows: list[tuple[Any, Any]]) -> None:
    """What a layout needs before its sample files: speculators' table of (input_ids, loss_mask)."""
    if layout == FORMAT_SPECULATORS_ARROW and not (Path(out) / ARROW_STATE_FILE).exists():
        remove_stale_temp_files(out, {"table"})  # a save killed before its state.json landed
        write_speculators_rows(out, rows)


def sample_file_problem(path: str | os.PathLike, layout: str, num_tokens: int, num_states: int) -> str | None:
    """Why a file an earlier run left is not a complete, safe sample of `num_tokens` tokens (None:
    it is). Cheap: v1's pickle is read weights-only with the tensors mapped, safetensors' header only."""
    path = Path(path)
    if path.is_symlink() or not path.is_file():
        return "not a regular file"
    try:
        if layout == FORMAT_V1:
            s = read_v1_sample(path, mmap=True)
            lengths = [s.input_ids.shape, s.loss_mask.shape, *(h.shape[:1] for h in s.hidden_states)]
            states = len(s.hidden_states)
        else:
            from safetensors import safe_open

            keys = COMPACT_KEYS if layout == FORMAT_COMPACT else HS_SAFETENSORS_KEYS
            with safe_open(str(path), framework="pt") as h:
                shapes = {k: h.get_slice(k).get_shape() for k in keys}
            ids_key, stacked = (("input_ids", shapes["aux_codes"]) if layout == FORMAT_COMPACT
                                else ("token_ids", shapes["hidden_states"]))
            lengths = [tuple(shapes[ids_key]), *(tuple(shape[:1]) for shape in shapes.values())]
            # compact: the aux states plus the stored teacher in place of the last one
            states = (stacked[1] + (layout == FORMAT_COMPACT)) if len(stacked) == 3 else -1
    except Exception as e:  # unsafe pickle, truncated file, wrong schema: all mean "write it again"
        return f"{type(e).__name__}: {e}"
    ok = all(tuple(n) == (num_tokens,) for n in lengths) and states == num_states
    return None if ok else "shapes differ from the prepared sample"


@dataclass
class DatasetFiles:
    """The hidden-state files of a dataset folder, listed without trusting their names."""

    format: str | None  # one of FORMAT_*, None when no known layout was found
    files: list[tuple[int, Path]] = field(default_factory=list)  # (index, path); an index may repeat
    misplaced: list[tuple[int, Path, str]] = field(default_factory=list)  # (index, path, why): breaks the layout
    stray: list[Path] = field(default_factory=list)  # files of no layout (temp files of a killed writer, ...)
    broken_links: list[tuple[Path, str]] = field(default_factory=list)  # (path, why): links that lead nowhere
    unfollowed_links: list[tuple[Path, str]] = field(default_factory=list)  # (path, why): links to folders


def broken_link_problem(path: Path) -> str | None:
    """Why `path` is a symbolic link that leads nowhere (missing target, or a loop), else None."""
    if not path.is_symlink():
        return None
    try:
        path.resolve(strict=True)
    except FileNotFoundError:
        return f"symbolic link to {os.readlink(path)!r}, which does not exist"
    except (RuntimeError, OSError):  # RuntimeError up to Python 3.12, OSError(ELOOP) after
        return f"symbolic link that loops ({os.readlink(path)!r})"
    return None


def _files_in(folder: Path, out: DatasetFiles, recursive: bool) -> list[Path]:
    """Regular files (and links to files) in `folder`, recording the links it cannot take in `out`.

    rglob does not descend into linked folders, so below the top such a link is reported, not silently skipped."""
    found = []
    for p in sorted(folder.rglob("*") if recursive else folder.iterdir()):
        why = broken_link_problem(p)
        if why:
            out.broken_links.append((p, why))
        elif p.is_file():
            found.append(p)
        elif recursive and p.is_symlink():
            out.unfollowed_links.append((p, f"symbolic link to the folder {os.readlink(p)!r}, not followed "
                                            "(it could loop or count files twice)"))
    return found


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
        if entry.is_dir():  # a rows folder may be a link to one elsewhere (broken links are not dirs)
            for f in _files_in(entry, out, recursive=True):
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


def _indexed(files: list[Path], name_re: re.Pattern) -> list[tuple[int, Path]]:
    return [(int(m.group(1)), p) for p in files if (m := name_re.match(p.name))]


def _rows_layout(folder: Path, fmt: str, name_re: re.Pattern, rows_per_folder: int) -> DatasetFiles:
    """The files of a `rows_{a}-{b}/NAME` layout under `folder` (v1, compact)."""
    out = DatasetFiles(fmt)
    _scan_rows_layout(folder, name_re, rows_per_folder, out)
    for f in _files_in(folder, out, recursive=False):
        m = name_re.match(f.name)
        if m:
            out.files.append((int(m.group(1)), f))
            out.misplaced.append((int(m.group(1)), f, "not inside a rows_{a}-{b} folder"))
        else:
            out.stray.append(f)
    return out


def list_dataset_files(folder: str | os.PathLike, rows_per_folder: int = ROWS_PER_FOLDER) -> DatasetFiles:
    """Detect which layout `folder` holds and list its files (the first layout found wins)."""
    root = Path(folder)
    hs = root / HIDDEN_STATES_DIR
    if (root / COMPACT_DIR).is_dir():
        return _rows_layout(root / COMPACT_DIR, FORMAT_COMPACT, COMPACT_FILE_RE, rows_per_folder)
    if (root / ARROW_STATE_FILE).is_file():  # speculators' layout: its table, hs_{row} files below
        out = DatasetFiles(FORMAT_SPECULATORS_ARROW)
        if hs.is_dir():
            for f in _files_in(hs, out, recursive=False):
                m = HS_SAFETENSORS_FILE_RE.match(f.name)
                (out.files.append((int(m.group(1)), f)) if m else out.stray.append(f))
        return out
    if hs.is_dir():
        return _rows_layout(hs, FORMAT_V1, V1_FILE_RE, rows_per_folder)
    if not root.is_dir():
        return DatasetFiles(None)
    top_links = DatasetFiles(None)
    top = _files_in(root, top_links, recursive=False)
    for layout, name_re in ((FORMAT_V1_FLAT, V1_FILE_RE), (FORMAT_HS_SAFETENSORS, HS_SAFETENSORS_FILE_RE)):
        if any(name_re.match(p.name) for p, _ in top_links.broken_links) or any(name_re.match(p.name) for p in top):
            return DatasetFiles(layout, _indexed(top, name_re), broken_links=top_links.broken_links)
    out = DatasetFiles(FORMAT_SPECFORGE)
    for p in _files_in(root, out, recursive=True):
        m = SPECFORGE_FILE_RE.match(p.name)
        if not m:
            continue
        index = int(m.group(1))
        out.files.append((index, p))
        if p.parent != root:  # flat SpecForge folders exist too; rows folders must be right
            rel = p.parent.relative_to(root)
            why = (_rows_folder_problem(index, p.parent.name, rows_per_folder) if len(rel.parts) == 1
                   else f"nested below {rel.parts[0]}")
            if why:
                out.misplaced.append((index, p, why))
    return out if out.files else DatasetFiles(None)


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
# The training view of every hidden-state layout: one reader per layout, each returning the same
# (input_ids, aux [T, 3H], last [T, H], loss_mask), so `eaglet train` reads any dataset that
# `eaglet check` accepts. Whether `last` is before or after the target's final norm is a property
# of the dataset (data_config.json, or the layout's convention), not of a file.
# ---------------------------------------------------------------------------------------------

LAST_STATE_POST_NORM = "post_norm"  # the last state after the target's final norm (SpecForge's `hidden_state`)
LAST_STATE_CONVENTIONS = (LAST_STATE_PRE_NORM, LAST_STATE_POST_NORM)
EAGLE3_NUM_STATES = 4  # three aux states (low, mid, high), then the last layer's


@dataclass
class TrainingSample:
    input_ids: torch.Tensor  # int64 [T]
    aux_hidden: torch.Tensor  # [T, 3H]: the three aux states concatenated in layer-id order
    last_hidden: torch.Tensor | None  # [T, H]: the last layer's state (None: the compact layout stores the teacher)
    loss_mask: torch.Tensor  # int64 [T]
    teacher: StoredTeacher | None = None  # the compact layout's stored teacher


def _drop_batch_dim(t: Any, dims: int) -> Any:
    """SpecForge versions differ on a leading batch dimension of 1; accept both."""
    if isinstance(t, torch.Tensor) and t.dim() == dims + 1 and t.shape[0] == 1:
        return t[0]
    return t


def _eagle3_states(path: str | os.PathLike, states: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(aux [T, 3H], last [T, H]) from the states in layer-id order."""
    if len(states) != EAGLE3_NUM_STATES:
        raise ValueError(f"{path}: {len(states)} hidden states; EAGLE-3 training needs {EAGLE3_NUM_STATES} "
                         "(three aux layers, then the last layer)")
    return torch.cat(states[:-1], dim=-1), states[-1]


def _specforge_fields(obj: Any, path: str | os.PathLike) -> dict[str, torch.Tensor]:
    if not isinstance(obj, dict) or any(k not in obj for k in SPECFORGE_KEYS):
        got = sorted(map(str, obj)) if isinstance(obj, dict) else type(obj).__name__
        raise ValueError(f"{path}: expected a dict with keys {list(SPECFORGE_KEYS)}, got {got}")
    dims = {"input_ids": 1, "loss_mask": 1, "hidden_state": 2, "aux_hidden_state": 2}
    return {k: _drop_batch_dim(obj[k], d) for k, d in dims.items()}


def _hs_loss_mask(path: str | os.PathLike, names: Any) -> None:
    # Without a mask every user and system token would be trained on, silently: refuse instead.
    if "loss_mask" not in names:
        raise ValueError(f"{path}: no loss_mask tensor, so the assistant tokens (the only ones trained on) are "
                         "unknown; write the files with a loss_mask [T] (1 = assistant token), or run `eaglet "
                         "prepare` + `eaglet extract` (or `eaglet train --online`) on the chats")


def _v1_training_sample(path: str | os.PathLike) -> TrainingSample:
    s = read_v1_sample(path)
    aux, last = _eagle3_states(path, s.hidden_states)
    return TrainingSample(s.input_ids.long(), aux, last, s.loss_mask.long())


def _specforge_training_sample(path: str | os.PathLike) -> TrainingSample:
    f = _specforge_fields(read_specforge_sample(path), path)
    aux, last = f["aux_hidden_state"], f["hidden_state"]
    if aux.dim() != 2 or last.dim() != 2 or aux.shape[-1] != 3 * last.shape[-1]:
        raise ValueError(f"{path}: hidden_state {tuple(last.shape)} and aux_hidden_state {tuple(aux.shape)}: "
                         "expected [T, H] and [T, 3H]")
    return TrainingSample(f["input_ids"].long(), aux, last, f["loss_mask"].long())


def _hs_safetensors_training_sample(path: str | os.PathLike) -> TrainingSample:
    obj = read_hs_safetensors_sample(path)
    _hs_loss_mask(path, obj)
    hs = obj["hidden_states"]
    if hs.dim() != 3:
        raise ValueError(f"{path}: hidden_states {tuple(hs.shape)}: expected [T, S, H]")
    aux, last = _eagle3_states(path, list(hs.unbind(1)))
    return TrainingSample(obj["token_ids"].long(), aux, last, obj["loss_mask"].long())


def _speculators_training_sample(path: str | os.PathLike) -> TrainingSample:
    folder, row = speculators_row_of(path)
    input_ids, loss_mask, _ = speculators_row(folder, row)
    obj = read_safetensors(path)
    token_ids, hs = obj.get("token_ids"), obj.get("hidden_states")
    if token_ids is None or hs is None or hs.dim() != 3:
        raise ValueError(f"{path}: expected token_ids [T] and hidden_states [T, S, H], got "
                         f"{ {k: tuple(v.shape) for k, v in obj.items()} }")
    if not torch.equal(token_ids.long(), input_ids):
        raise ValueError(f"{path}: token_ids differ from row {row}'s input_ids in the Arrow table of {folder} "
                         "(speculators skips such a row; rerun the extraction of this sample)")
    aux, last = _eagle3_states(path, list(hs.unbind(1)))
    return TrainingSample(input_ids, aux, last, loss_mask)


TRAINING_READERS = {
    FORMAT_V1: _v1_training_sample,
    FORMAT_V1_FLAT: _v1_training_sample,
    FORMAT_SPECFORGE: _specforge_training_sample,
    FORMAT_HS_SAFETENSORS: _hs_safetensors_training_sample,
    FORMAT_SPECULATORS_ARROW: _speculators_training_sample,
    FORMAT_COMPACT: _compact_training_sample,
}


def read_training_sample(path: str | os.PathLike, layout: str) -> TrainingSample:
    """One sample of a dataset in `layout` (a FORMAT_* of `list_dataset_files`), as training takes it."""
    if layout not in TRAINING_READERS:
        raise ValueError(f"{path}: no training reader for layout {layout!r}")
    return TRAINING_READERS[layout](path)


def read_sample_tokens(path: str | os.PathLike, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, loss_mask) of one file, reading as little else as the layout allows: the hidden
    states of `.pt` / `.ckpt` files are memory-mapped and never touched, safetensors tensors are
    read by name; only a `.ckpt.gz` must be decompressed whole."""
    if layout in (FORMAT_V1, FORMAT_V1_FLAT):
        s = read_v1_sample(path, mmap=True)
        return s.input_ids.long(), s.loss_mask.long()
    if layout == FORMAT_SPECFORGE:
        obj = read_specforge_sample(path) if str(path).endswith(".gz") else torch_load_safe_mmap(path)
        f = _specforge_fields(obj, path)
        return f["input_ids"].long(), f["loss_mask"].long()
    if layout == FORMAT_SPECULATORS_ARROW:
        input_ids, loss_mask, _ = speculators_row(*speculators_row_of(path))
        return input_ids, loss_mask
    if layout == FORMAT_COMPACT:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as h:
            return h.get_tensor("input_ids").long(), h.get_tensor("loss_mask").long()
    if layout == FORMAT_HS_SAFETENSORS:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as h:
            _hs_loss_mask(path, set(h.keys()))
            return h.get_tensor("token_ids").long(), h.get_tensor("loss_mask").long()
    raise ValueError(f"{path}: no reader for layout {layout!r}")


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
        raise ValueError(f"--out {out} exists; pass --resume to continue it, or choose another file "
                              f"(eaglet never overwrites regenerated data)")
    done, good, partial = scan_output(out)
    if partial:
        log.warning("%s: dropping a partial last line (a killed run was writing it)", out)
        with open(out, "rb+") as f:
            f.truncate(good)
            os.fsync(f.fileno())
    return done


# ---------------------------------------------------------------------------------------------
# Drafter folders for the serving engines (`eaglet export` writes them, `eaglet import` reads them)
#
# Both are a `config.json` plus weights. eaglet's own tensor names (draft_model.py) already are the
# official EAGLE-3 / SGLang names, so the maps below only list what differs. Matched against:
#   vLLM  vllm/model_executor/models/llama_eagle3.py @ 00bd149 (Eagle3LlamaForCausalLM.load_weights:
#         `midlayer.` -> `layers.0.`, `d2t` -> draft_id_to_target_id, `t2d` skipped, `embed_tokens`
#         loaded when present (v1/spec_decode shares the target's when absent or identical), q/k/v and
#         gate/up stacked into qkv_proj / gate_up_proj); vllm/transformers_utils/configs/speculators/
#         base.py + algos.py @ cfb173a (update_eagle3: draft_vocab_size, target_hidden_size,
#         `norm_before_residual` defaulting to TRUE when absent, eagle_aux_hidden_state_layer_ids);
#         vllm/v1/worker/gpu_model_runner.py `_get_eagle3_aux_layers_from_config` (top-level
#         `eagle_aux_hidden_state_layer_ids` first, then `eagle_config[...]`, ids in HF
#         hidden_states indexing: the target captures *before* decoder layer id).
#   SGLang python/sglang/srt/models/llama_eagle3.py @ 03d5a77 (LlamaForCausalLMEagle3: names as
#         eaglet's, optional `model.` prefix, unknown names skipped silently, `d2t` -> hot_token_id,
#         lm_head tied to embed_tokens when `tie_word_embeddings`); models/llama.py @ 0023954
#         (set_eagle3_layers_to_capture adds 1 to `eagle_config.eagle_aux_hidden_state_layer_ids`:
#         SGLang ids name the *output* of decoder layer id, i.e. HF id - 1; sgl-project/sglang#25454
#         keeps the +1 only when the first id is 1); speculative/eagle_worker.py (`eagle_config`).
#   speculators src/speculators/models/eagle3/config.py @ 27ec382 (Eagle3SpeculatorConfig),
#         src/speculators/config.py (SpeculatorsConfig, VerifierConfig), proposals/greedy.py,
#         convert/eagle/eagle3_converter.py @ ef8d232 (`midlayer.` -> `layers.0.`, embeddings kept);
#         `norm_before_fc` is one RMSNorm over the 3H concat with weight `input_norm.weight`
#         (vllm-project/speculators#337, vllm-project/vllm#36545), which is eaglet's `fc_norm`.
# ---------------------------------------------------------------------------------------------

DRAFTER_CONFIG_FILE = "config.json"
DRAFTER_WEIGHTS_FILE = "model.safetensors"
FORMAT_EAGLET = "eaglet"  # a training checkpoint: config.json with an "eaglet" section
FORMAT_EAGLE = "eagle"  # official EAGLE-3 / SGLang `LlamaForCausalLMEagle3`
FORMAT_SPECULATORS = "speculators"  # vLLM / speculators `Eagle3Speculator`
EXPORT_FORMATS = (FORMAT_SPECULATORS, FORMAT_EAGLE)
EAGLE_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
SPECULATORS_ARCHITECTURE = "Eagle3Speculator"
# eaglet name prefix -> name prefix in the format. `fc_norm` is eaglet's single RMSNorm over the
# 3H concat; the engines call that `norm_before_fc` / `input_norm` (their `fc_norm` is per layer).
FORMAT_RENAMES: dict[str, tuple[tuple[str, str], ...]] = {
    FORMAT_EAGLET: (),
    FORMAT_EAGLE: (("fc_norm.", "input_norm."),),
    FORMAT_SPECULATORS: (("midlayer.", "layers.0."), ("fc_norm.", "input_norm.")),
}
# Buffers some older checkpoints carry that hold no learned state (RoPE is recomputed).
IGNORABLE_WEIGHT_SUFFIXES = ("rotary_emb.inv_freq",)
DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float16: "float16"}


def _rename(name: str, renames: tuple[tuple[str, str], ...]) -> str:
    for old, new in renames:
        if name.startswith(old):
            return new + name[len(old):]
    return name


def format_name(name: str, fmt: str) -> str:
    """An eaglet tensor name as `fmt` stores it."""
    return _rename(name, FORMAT_RENAMES[fmt])


def to_format_names(tensors: dict[str, torch.Tensor], fmt: str) -> dict[str, torch.Tensor]:
    return {format_name(k, fmt): v for k, v in tensors.items()}


def from_format_names(tensors: dict[str, torch.Tensor], fmt: str, where: str) -> dict[str, torch.Tensor]:
    """Names as stored in `fmt` -> eaglet names. SGLang also accepts each name with a `model.`
    prefix (its params live under `model.`), so an eagle folder may use either spelling."""
    back = tuple((new, old) for old, new in FORMAT_RENAMES[fmt])
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        plain = name[len("model."):] if fmt == FORMAT_EAGLE and name.startswith("model.") else name
        ours = _rename(plain, back)
        if ours in out:
            raise ValueError(f"{where}: two tensors map to {ours!r} (one is {name!r})")
        out[ours] = t
    return out


def hf_to_sglang_layer_ids(ids: list[int]) -> list[int]:
    """HF hidden_states ids -> SGLang's `eagle_config` ids (output of decoder layer id)."""
    return [i - 1 for i in ids]


def sglang_to_hf_layer_ids(ids: list[int]) -> list[int]:
    """SGLang's reading of `eagle_config` ids (sgl-project/sglang#25454): a first id of 1 means
    "output of layer id" (+1); any other first id is already a capture-before-layer index."""
    return [i + 1 for i in ids] if ids and ids[0] == 1 else list(ids)


def _llama_block(cfg: Any) -> dict[str, Any]:
    """The Llama keys of the one decoder layer, as a LlamaConfig dict (eagle: top level;
    speculators: `transformer_layer_config`). `vocab_size` is the target's vocabulary."""
    return {
        "model_type": "llama", "num_hidden_layers": 1, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings, "vocab_size": cfg.target_vocab_size,
        "attention_bias": False, "mlp_bias": False,
        "tie_word_embeddings": False,  # SGLang would make lm_head the embedding matrix otherwise
        **({"sliding_window": cfg.sliding_window, "layer_types": ["sliding_attention"]}
           if cfg.sliding_window is not None else {}),
    }


def _sliding_window(block: dict[str, Any], where: str) -> int | None:
    """The one layer's window, read as speculators does: sliding only when `layer_types` says so
    (a `sliding_window` without `layer_types` is full attention there)."""
    layer_types = block.get("layer_types") or []
    if not layer_types or layer_types[0] != "sliding_attention":
        return None
    window = block.get("sliding_window")
    if not isinstance(window, int) or window < 1:
        raise ValueError(f"{where}: layer_types says sliding_attention but sliding_window is {window!r}")
    return window


def _refuse(where: str, field: str, value: Any, why: str) -> ValueError:
    return ValueError(f"{where}: field {field} = {value!r}: {why}")


def _llama_fields(block: dict[str, Any], where: str) -> dict[str, Any]:
    """DraftConfig fields from a Llama block; variants eaglet's drafter cannot run are refused."""
    for key in ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size"):
        if not isinstance(block.get(key), int):
            raise ValueError(f"{where}: field {key} missing or not an integer")
    if block.get("num_hidden_layers", 1) != 1:
        raise _refuse(where, "num_hidden_layers", block["num_hidden_layers"], "eaglet drafters have one decoder layer")
    if block.get("hidden_act", "silu") != "silu":
        raise _refuse(where, "hidden_act", block["hidden_act"], "eaglet's MLP is SwiGLU (silu)")
    for key in ("attention_bias", "mlp_bias", "tie_word_embeddings"):
        if block.get(key):
            raise _refuse(where, key, block[key], "not supported by eaglet's drafter")
    rope = block.get("rope_parameters") or block.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise _refuse(where, "rope_parameters.rope_type", rope_type, "eaglet's drafter uses plain RoPE")
    heads, hidden = block["num_attention_heads"], block["hidden_size"]
    return dict(hidden_size=hidden, num_heads=heads, num_kv_heads=int(block.get("num_key_value_heads") or heads),
                head_dim=int(block.get("head_dim") or hidden // heads), intermediate_size=block["intermediate_size"],
                rms_norm_eps=float(block.get("rms_norm_eps", 1e-6)),
                rope_theta=float(block.get("rope_theta", rope.get("rope_theta", 10000.0))),
                max_position_embeddings=int(block.get("max_position_embeddings", 2048)),
                target_vocab_size=block["vocab_size"], sliding_window=_sliding_window(block, where))


def _draft_fields(c: dict[str, Any], fields: dict[str, Any], where: str, norm_before_residual: Any,
                  norm_before_fc: Any, per_layer_fc_norm: Any, norm_output: Any) -> dict[str, Any]:
    """The EAGLE-3 fields both formats share, on top of the Llama block's."""
    if per_layer_fc_norm:
        raise _refuse(where, "fc_norm", per_layer_fc_norm, "per-layer norms before fc are not eaglet's "
                      "fc_norm (one RMSNorm over the concat, `norm_before_fc`)")
    draft_vocab = c.get("draft_vocab_size")
    if not isinstance(draft_vocab, int):
        raise ValueError(f"{where}: field draft_vocab_size missing or not an integer (engines disagree on the default)")
    return {**fields, "draft_vocab_size": draft_vocab,
            "target_hidden_size": int(c.get("target_hidden_size") or fields["hidden_size"]),
            "fc_norm": bool(norm_before_fc), "norm_output": bool(norm_output),
            "norm_before_residual": bool(norm_before_residual)}


def build_eagle_config(cfg: Any, torch_dtype: str, provenance: dict[str, Any] | None) -> dict[str, Any]:
    """config.json of an EAGLE-3 / SGLang folder (`LlamaForCausalLMEagle3`); `provenance`
    (eaglet version, source, target) is recorded under `eaglet_export` when given."""
    config = {
        "architectures": [EAGLE_ARCHITECTURES[0]], **_llama_block(cfg), "torch_dtype": torch_dtype,
        "draft_vocab_size": cfg.draft_vocab_size, "target_hidden_size": cfg.target_hidden_size,
        # vLLM reads the top-level ids first (HF indexing); SGLang reads only eagle_config's, as
        # output-of-layer ids (it adds 1), so the two lists differ by one on purpose.
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": hf_to_sglang_layer_ids(cfg.aux_layer_ids),
                         "use_aux_hidden_state": True},
        "norm_before_residual": cfg.norm_before_residual, "norm_output": cfg.norm_output,
    }
    return {**config, "eaglet_export": provenance} if provenance is not None else config


def parse_eagle_config(c: dict[str, Any], where: str) -> tuple[dict[str, Any], list[int] | None]:
    """(DraftConfig fields, aux ids in HF indexing or None when the folder names none)."""
    if not any(a in EAGLE_ARCHITECTURES for a in c.get("architectures") or []):
        raise _refuse(where, "architectures", c.get("architectures"), f"expected one of {list(EAGLE_ARCHITECTURES)}")
    eagle = c.get("eagle_config") or {}
    if eagle.get("use_aux_hidden_state") is False:
        raise _refuse(where, "eagle_config.use_aux_hidden_state", False, "not an EAGLE-3 drafter (no fused aux states)")
    fields = _draft_fields(c, _llama_fields(c, where), where, c.get("norm_before_residual"),
                           eagle.get("norm_before_fc", c.get("norm_before_fc")), c.get("fc_norm") or eagle.get("fc_norm"),
                           c.get("norm_output", eagle.get("norm_output")))
    top, nested = c.get("eagle_aux_hidden_state_layer_ids"), eagle.get("eagle_aux_hidden_state_layer_ids")
    if top:
        if nested and list(nested) not in (list(top), hf_to_sglang_layer_ids(list(top))):
            raise ValueError(f"{where}: eagle_aux_hidden_state_layer_ids {top} and eagle_config."
                             f"eagle_aux_hidden_state_layer_ids {nested} name different layers")
        return fields, list(top)
    if nested:
        if nested[0] != 1:
            log.warning("%s: eagle_config.eagle_aux_hidden_state_layer_ids %s: read as capture-before-layer ids "
                        "(as SGLang >= #25454 does; older SGLang adds 1)", where, nested)
        return fields, sglang_to_hf_layer_ids(list(nested))
    return fields, None


def build_speculators_config(cfg: Any, torch_dtype: str, verifier_name: str, verifier_architectures: list[str],
                             speculative_tokens: int, provenance: dict[str, Any]) -> dict[str, Any]:
    """config.json of a speculators `Eagle3Speculator` folder (what vLLM's SpeculatorsConfig reads)."""
    return {
        "architectures": [SPECULATORS_ARCHITECTURE], "speculators_model_type": "eagle3",
        "transformer_layer_config": _llama_block(cfg),
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier_name, "architectures": list(verifier_architectures)},
        },
        "draft_vocab_size": cfg.draft_vocab_size, "target_hidden_size": cfg.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
        # Written even when false: vLLM's update_eagle3 defaults a missing norm_before_residual to true.
        "norm_before_residual": cfg.norm_before_residual, "norm_before_fc": cfg.fc_norm, "fc_norm": False,
        "norm_output": cfg.norm_output, "torch_dtype": torch_dtype,
        "eaglet_export": provenance,
    }


def parse_speculators_config(c: dict[str, Any], where: str) -> tuple[dict[str, Any], list[int] | None]:
    """(DraftConfig fields, aux ids in HF indexing or None) of a speculators eagle3 config."""
    if c.get("speculators_model_type") != "eagle3":
        raise _refuse(where, "speculators_model_type", c.get("speculators_model_type"), "expected 'eagle3'")
    block = c.get("transformer_layer_config")
    if not isinstance(block, dict):
        raise ValueError(f"{where}: field transformer_layer_config missing or not a dict")
    if "norm_before_residual" not in c:
        raise ValueError(f"{where}: field norm_before_residual missing (vLLM then assumes true, speculators false)")
    fields = _draft_fields(c, _llama_fields(block, f"{where} transformer_layer_config"), where,
                           c["norm_before_residual"], c.get("norm_before_fc"), c.get("fc_norm"), c.get("norm_output"))
    ids = c.get("eagle_aux_hidden_state_layer_ids")
    return fields, (list(ids) if ids else None)


def detect_drafter_format(c: dict[str, Any], where: str) -> str:
    if "eaglet" in c:
        return FORMAT_EAGLET
    if "speculators_model_type" in c:
        return FORMAT_SPECULATORS
    if any(a in EAGLE_ARCHITECTURES for a in c.get("architectures") or []):
        return FORMAT_EAGLE
    raise ValueError(f"{where}: not a drafter config (no 'eaglet' section, no speculators_model_type, "
                     f"architectures {c.get('architectures')} not in {list(EAGLE_ARCHITECTURES)})")


def weight_files(folder: Path) -> list[Path]:
    """The weight files of a model folder: an index's shards, or model.safetensors, or pytorch_model.bin."""
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if (folder / index).exists():
            return [folder / f for f in sorted(set(read_json(folder / index)["weight_map"].values()))]
    for name in (DRAFTER_WEIGHTS_FILE, "pytorch_model.bin"):
        if (folder / name).exists():
            return [folder / name]
    raise FileNotFoundError(f"{folder}: no {DRAFTER_WEIGHTS_FILE}, pytorch_model.bin or weight index")


def read_weight_files(folder: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of a model folder; `.bin` files load with weights_only=True (no pickled code runs)."""
    out: dict[str, torch.Tensor] = {}
    for path in weight_files(Path(folder)):
        part = read_safetensors(path) if path.suffix == ".safetensors" else torch_load_safe(path)
        if not isinstance(part, dict) or not all(isinstance(v, torch.Tensor) for v in part.values()):
            raise ValueError(f"{path}: expected a flat dict of tensors")
        for name in part.keys() & out.keys():
            raise ValueError(f"{path}: tensor {name!r} appears in two weight files")
        out.update(part)
    return out


@contextlib.contextmanager
def atomic_dir(final: str | os.PathLike) -> Iterator[Path]:
    """Yield a temp folder beside `final`; on success fsync its files and rename it onto `final`
    (which may not exist yet, or be empty), else delete it: a folder that exists is complete."""
    final = Path(final)
    if final.exists() and (not final.is_dir() or any(final.iterdir())):
        raise ValueError(f"{final} exists and is not empty; remove it or choose another folder")
    with failures_named(final):
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}{TMP_MARK}", dir=final.parent))
        try:
            yield tmp
            for f in tmp.iterdir():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
            if final.exists():
                final.rmdir()
            os.rename(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def write_drafter_files(folder: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    """config.json + model.safetensors into `folder` (a temp folder of `atomic_dir`)."""
    from safetensors.torch import save_file

    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(folder / DRAFTER_WEIGHTS_FILE),
              metadata={"format": "pt"})
    (folder / DRAFTER_CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def write_drafter_folder(out: str | os.PathLike, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Path:
    """config.json + model.safetensors, written as one atomic folder."""
    with atomic_dir(out) as tmp:
        write_drafter_files(tmp, config, tensors)
    return Path(out)
