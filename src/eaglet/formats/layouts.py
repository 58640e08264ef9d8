"""The hidden-state dataset layouts, each one `Layout` object in `LAYOUTS`: how it is detected
and listed, where sample i lives, how its files are read (for training, for their tokens, for
`eaglet check`) and, for the layouts eaglet writes, written. Code that handles datasets asks the
layout object, so adding a layout is adding one object here.

- speculators "v1" (eaglet's default): `hidden_states/rows_{a}-{b}/data_{i}.pt`, a dict of
  `input_ids`, `hidden_states` (a list of [T, H], layer ids in order) and `loss_mask`, with
  `data_config.json`, `sample_lengths.json` and `token_freq.pt` beside `hidden_states/`;
- speculators "flat" v1: `data_{i}.pt` directly in the folder, same dict as v1;
- SpecForge offline: `rows_{k}-{k+2000}/data_{i}.ckpt` (or `.ckpt.gz`, or flat), keys
  `input_ids`, `loss_mask`, `hidden_state` [T, H] (last) and `aux_hidden_state` [T, 3H];
- speculators >= 0.5: `hs_{row}.safetensors`, `token_ids` [T], `hidden_states` [T, S, H]
  (S = 4: 3 aux ids + last), optionally `loss_mask` [T];
- speculators >= 0.6 (`prepare_data`, then offline generation), which `speculators train` reads
  (speculators/train/data.py ArrowDataset): an Arrow table saved by `datasets.Dataset.save_to_disk`
  (data-*.arrow, dataset_info.json, state.json), one row per sample: `input_ids` and `loss_mask`
  (int64 lists) and `seq_len`, in the torch format; `hidden_states/hs_{row}.safetensors` with
  `token_ids` [T] and `hidden_states` [T, S, H]. The loss mask lives only in the table: row i pairs
  with file i, and speculators skips a row whose file's token_ids differ from its input_ids;
  `token_freq.pt` ({token id: count}), which `speculators train` builds d2t/t2d from;
- eaglet's compact layout (formats/compact.py).
"""

from __future__ import annotations

import functools
import gzip
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from safetensors import safe_open

from eaglet.formats.compact import (COMPACT_DIR, check_compact_hidden_size, compact_config_fields, compact_damage,
                                    compact_file_states, compact_relative_path, compact_stored_shapes, compact_tokens,
                                    compact_top_k, compact_training_sample, compact_version_problem,
                                    compact_version_warning, read_compact_file, write_compact_states)
from eaglet.formats.io import (TMP_MARK, failures_named, header_shapes, inside_folder, read_json, read_safetensors,
                               remove_stale_temp_files, torch_load_safe, torch_load_safe_bytes, torch_load_safe_mmap,
                               torch_save_atomic, write_safetensors_atomic)
from eaglet.formats.listing import DatasetFiles, files_in, flat_layout_files, nested_layout_files, rows_layout_files
from eaglet.formats.samples import (HIDDEN_STATES_DIR, LAST_STATE_POST_NORM, LAST_STATE_PRE_NORM, ROWS_PER_FOLDER,
                                    TABLE_ROW, V1_FOLDER_RE, WRONG_SHAPE, FileStates, Finding,
                                    StoredTeacher, TrainingSample, drop_batch_dim, eagle3_states, keys_findings,
                                    lacks_keys, rows_folder, sparse_tensors, stacked_states_finding,
                                    stored_kind_findings)
from eaglet.options import WRITTEN_LAYOUT_NAMES

# The layouts' names: data_config.json's "format", `eaglet check`'s report.
FORMAT_V1 = "speculators-v1"  # this project's layout: hidden_states/rows_{a}-{b}/data_{i}.pt
FORMAT_V1_FLAT = "speculators-v1-flat"  # data_{i}.pt directly in the dataset folder
FORMAT_SPECFORGE = "specforge"  # rows_{a}-{b}/data_{i}.ckpt[.gz]
FORMAT_HS_SAFETENSORS = "speculators-safetensors"  # hs_{row}.safetensors
FORMAT_SPECULATORS_ARROW = "speculators-arrow"  # Arrow table + hidden_states/hs_{row}.safetensors
FORMAT_COMPACT = "eaglet-compact"  # compact/rows_{a}-{b}/data_{i}.safetensors

V1_KEYS = ("input_ids", "hidden_states", "loss_mask")
V1_FILE_RE = re.compile(r"^data_(\d+)\.pt$")
SPECFORGE_KEYS = ("input_ids", "loss_mask", "hidden_state", "aux_hidden_state")
SPECFORGE_DIMS = {"input_ids": 1, "loss_mask": 1, "hidden_state": 2, "aux_hidden_state": 2}  # without a batch dim
SPECFORGE_TOKEN_DTYPES = (torch.int64, torch.int32)  # SpecForge's versions store ids and masks as either
SPECFORGE_FILE_RE = re.compile(r"^data_(\d+)\.ckpt(\.gz)?$")
HS_SAFETENSORS_KEYS = ("token_ids", "hidden_states")  # plus an optional "loss_mask"
HS_SAFETENSORS_FILE_RE = re.compile(r"^hs_(\d+)\.safetensors$")
COMPACT_FILE_RE = re.compile(r"^data_(\d+)\.safetensors$")
ARROW_STATE_FILE = "state.json"  # written last by save_to_disk: the table is complete once it exists
SPECULATORS_ROW_COLUMNS = ("input_ids", "loss_mask", "seq_len")


# ---------------------------------------------------------------------------------------------
# speculators "v1" (and its flat variant)
# ---------------------------------------------------------------------------------------------

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


def flat_v1_relative_path(index: int) -> str:
    return f"data_{index}.pt"


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


def v1_min_bytes_per_token(hidden_size: int, num_states: int = 4) -> int:
    """Lower bound of a v1 file per token: bf16 states plus int64 input_ids and loss_mask."""
    return num_states * hidden_size * 2 + 16


def v1_training_sample(path: str | os.PathLike) -> TrainingSample:
    s = read_v1_sample(path)
    aux, last = eagle3_states(path, s.hidden_states)
    return TrainingSample(s.input_ids.long(), aux, last, s.loss_mask.long())


def v1_tokens(path: str | os.PathLike) -> tuple[torch.Tensor, torch.Tensor]:
    s = read_v1_sample(path, mmap=True)  # the states are mapped and never touched
    return s.input_ids.long(), s.loss_mask.long()


def v1_stored_shapes(path: str | os.PathLike) -> tuple[list[tuple[int, ...]], int]:
    s = read_v1_sample(path, mmap=True)
    return [tuple(s.input_ids.shape), tuple(s.loss_mask.shape), *(tuple(h.shape[:1]) for h in s.hidden_states)], \
        len(s.hidden_states)


def write_v1_states(out: str | os.PathLike, index: int, input_ids: torch.Tensor, states: list[torch.Tensor],
                    loss_mask: torch.Tensor, teacher: StoredTeacher | None) -> Path:
    del teacher  # v1 keeps the last state itself
    return write_v1_sample(out, index, V1Sample(input_ids, states, loss_mask))


def v1_file_states(obj: Any, where: str) -> tuple[FileStates | None, list[Finding]]:
    found = keys_findings(obj, V1_KEYS)
    if found and lacks_keys(obj, V1_KEYS):
        return None, found
    hs = obj["hidden_states"]
    if not isinstance(hs, list) or not all(isinstance(h, torch.Tensor) for h in hs):
        return None, found or [Finding(WRONG_SHAPE, f"hidden_states is a {type(hs).__name__}: the layout stores a "
                                                    "list of tensors")]
    found += stored_kind_findings(obj, ("input_ids", "loss_mask"))
    if sparse_tensors(obj):  # named above; no value check can read them
        return None, found
    return FileStates(obj["input_ids"], obj["loss_mask"], list(hs)), found


# ---------------------------------------------------------------------------------------------
# SpecForge offline
# ---------------------------------------------------------------------------------------------

def specforge_relative_path(index: int, compressed: bool = False, rows_per_folder: int = ROWS_PER_FOLDER) -> str:
    return f"{rows_folder(index, rows_per_folder)}/data_{index}.ckpt" + (".gz" if compressed else "")


def read_specforge_sample(path: str | os.PathLike) -> Any:
    """The raw object of a SpecForge file (schema checks are the caller's); `.gz` is gunzipped in memory."""
    if str(path).endswith(".gz"):
        with gzip.open(path, "rb") as f:
            return torch_load_safe_bytes(f.read())
    return torch_load_safe(path)


def specforge_fields(obj: dict[str, Any]) -> dict[str, Any]:
    """The four fields, without the batch dimension some SpecForge versions add."""
    return {k: drop_batch_dim(obj[k], d) for k, d in SPECFORGE_DIMS.items()}


def specforge_shapes_fit(aux: Any, last: Any) -> bool:
    """aux_hidden_state [T, 3H] and hidden_state [T, H]."""
    return isinstance(aux, torch.Tensor) and isinstance(last, torch.Tensor) and aux.dim() == 2 and last.dim() == 2 \
        and aux.shape[-1] == 3 * last.shape[-1]


def specforge_shapes_message(aux: Any, last: Any) -> str:
    shapes = [tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__ for t in (last, aux)]
    return f"hidden_state {shapes[0]} and aux_hidden_state {shapes[1]}: expected [T, H] and [T, 3H]"


def checked_specforge_fields(obj: Any, path: str | os.PathLike) -> dict[str, torch.Tensor]:
    if lacks_keys(obj, SPECFORGE_KEYS):
        got = sorted(map(str, obj)) if isinstance(obj, dict) else type(obj).__name__
        raise ValueError(f"{path}: expected a dict with keys {list(SPECFORGE_KEYS)}, got {got}")
    return specforge_fields(obj)


def specforge_training_sample(path: str | os.PathLike) -> TrainingSample:
    f = checked_specforge_fields(read_specforge_sample(path), path)
    aux, last = f["aux_hidden_state"], f["hidden_state"]
    if not specforge_shapes_fit(aux, last):
        raise ValueError(f"{path}: {specforge_shapes_message(aux, last)}")
    return TrainingSample(f["input_ids"].long(), aux, last, f["loss_mask"].long())


def specforge_tokens(path: str | os.PathLike) -> tuple[torch.Tensor, torch.Tensor]:
    """Only a `.ckpt.gz` must be decompressed whole; a `.ckpt`'s states are mapped, never touched."""
    obj = read_specforge_sample(path) if str(path).endswith(".gz") else torch_load_safe_mmap(path)
    f = checked_specforge_fields(obj, path)
    return f["input_ids"].long(), f["loss_mask"].long()


def specforge_file_states(obj: Any, where: str) -> tuple[FileStates | None, list[Finding]]:
    found = keys_findings(obj, SPECFORGE_KEYS)
    if found and lacks_keys(obj, SPECFORGE_KEYS):
        return None, found
    found += stored_kind_findings(obj, ("input_ids", "loss_mask"), SPECFORGE_TOKEN_DTYPES)
    f = specforge_fields(obj)
    aux, last = f["aux_hidden_state"], f["hidden_state"]
    if not specforge_shapes_fit(aux, last):
        return None, found + [Finding(WRONG_SHAPE, specforge_shapes_message(aux, last))]
    if sparse_tensors(obj):  # named above; no value check can read them
        return None, found
    # aux_hidden_state is the three aux states concatenated low, mid, high; the last comes after.
    return FileStates(f["input_ids"], f["loss_mask"], [*aux.chunk(3, dim=-1), last]), found


# ---------------------------------------------------------------------------------------------
# speculators >= 0.5: hs_{row}.safetensors with their own loss masks
# ---------------------------------------------------------------------------------------------

def hs_relative_path(row: int) -> str:
    return f"hs_{row}.safetensors"


def write_hs_safetensors_sample(folder: str | os.PathLike, row: int, token_ids: torch.Tensor,
                                hidden_states: torch.Tensor, loss_mask: torch.Tensor | None = None) -> Path:
    """One speculators >= 0.5 file: `token_ids` [T], `hidden_states` [T, S, H] (S states in id order)."""
    tensors = {"token_ids": token_ids.contiguous(), "hidden_states": hidden_states.contiguous()}
    if loss_mask is not None:
        tensors["loss_mask"] = loss_mask.contiguous()
    return write_safetensors_atomic(Path(folder) / hs_relative_path(row), tensors)


def read_hs_safetensors_sample(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    return read_safetensors(path)


def require_hs_loss_mask(path: str | os.PathLike, names: Any) -> None:
    # Without a mask every user and system token would be trained on, silently: refuse instead.
    if "loss_mask" not in names:
        raise ValueError(f"{path}: no loss_mask tensor, so the assistant tokens (the only ones trained on) are "
                         "unknown; write the files with a loss_mask [T] (1 = assistant token), or run `eaglet "
                         "prepare` + `eaglet extract` (or `eaglet train --online`) on the chats")


def hs_training_sample(path: str | os.PathLike) -> TrainingSample:
    obj = read_hs_safetensors_sample(path)
    require_hs_loss_mask(path, obj)
    hs = obj["hidden_states"]
    if hs.dim() != 3:
        raise ValueError(f"{path}: hidden_states {tuple(hs.shape)}: expected [T, S, H]")
    aux, last = eagle3_states(path, list(hs.unbind(1)))
    return TrainingSample(obj["token_ids"].long(), aux, last, obj["loss_mask"].long())


def hs_tokens(path: str | os.PathLike) -> tuple[torch.Tensor, torch.Tensor]:
    with safe_open(str(path), framework="pt") as h:
        require_hs_loss_mask(path, set(h.keys()))
        return h.get_tensor("token_ids").long(), h.get_tensor("loss_mask").long()


def hs_file_states(obj: Any, where: str) -> tuple[FileStates | None, list[Finding]]:
    found = keys_findings(obj, HS_SAFETENSORS_KEYS, ("loss_mask",))
    if found and lacks_keys(obj, HS_SAFETENSORS_KEYS):
        return None, found
    wrong = stacked_states_finding(obj["hidden_states"])
    if wrong:
        return None, found + [wrong]
    found += stored_kind_findings(obj, ("token_ids", "loss_mask"))
    return FileStates(obj["token_ids"], obj.get("loss_mask"), list(obj["hidden_states"].unbind(1))), found


# ---------------------------------------------------------------------------------------------
# speculators >= 0.6: an Arrow table of rows + hidden_states/hs_{row}.safetensors
# ---------------------------------------------------------------------------------------------

def datasets_module() -> Any:
    try:
        import datasets  # optional (eaglet[speculators]), and slow to import: only this layout needs it
    except ImportError as e:
        raise ImportError("speculators' dataset layout is an Arrow table read and written with the `datasets` "
                          "library: pip install 'eaglet[speculators]'") from e
    return datasets


def speculators_relative_path(row: int) -> str:
    return f"{HIDDEN_STATES_DIR}/{hs_relative_path(row)}"


def speculators_hs_path(folder: str | os.PathLike, row: int) -> Path:
    return Path(folder) / speculators_relative_path(row)


def write_speculators_sample(folder: str | os.PathLike, row: int, token_ids: torch.Tensor,
                             states: list[torch.Tensor]) -> Path:
    """`hidden_states/hs_{row}.safetensors`: the states stacked [T, S, H] in id order, no loss mask."""
    return write_hs_safetensors_sample(Path(folder) / HIDDEN_STATES_DIR, row, token_ids, torch.stack(states, dim=1))


def write_speculators_states(out: str | os.PathLike, index: int, input_ids: torch.Tensor, states: list[torch.Tensor],
                             loss_mask: torch.Tensor, teacher: StoredTeacher | None) -> Path:
    del loss_mask, teacher  # the loss mask lives in the table; the last state is stored itself
    return write_speculators_sample(out, index, input_ids, states)


def write_speculators_rows(folder: str | os.PathLike, rows: list[tuple[Any, Any]]) -> None:
    """The Arrow table of (input_ids, loss_mask) rows, saved as speculators' prepare_data saves it.
    save_to_disk writes into a temp folder beside; its files are renamed in with state.json last."""
    ds = datasets_module()
    features = ds.Features({"input_ids": ds.List(ds.Value("int64")), "loss_mask": ds.List(ds.Value("int64")),
                            "seq_len": ds.Value("int64")})
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


def start_speculators_table(folder: str | os.PathLike, rows: list[tuple[Any, Any]]) -> None:
    remove_stale_temp_files(folder, {"table"})  # a save killed before its state.json landed
    write_speculators_rows(folder, rows)


def speculators_table_files(folder: str | os.PathLike) -> list[Path]:
    folder = Path(folder)
    return [folder / ARROW_STATE_FILE, folder / "dataset_info.json", *folder.glob("data-*.arrow")]


def refuse_files_elsewhere(folder: Path) -> None:
    """state.json names the table's data files, and `datasets` opens whatever it names: each must
    be a file of the folder itself (an edited one could train on rows from anywhere)."""
    state_path = folder / ARROW_STATE_FILE
    state = read_json(state_path) if state_path.exists() else {}
    files = state.get("_data_files") if isinstance(state, dict) else None
    for entry in files if isinstance(files, list) else []:
        name = entry.get("filename") if isinstance(entry, dict) else None
        if not isinstance(name, str):
            raise ValueError(f"{state_path} _data_files: {entry!r} names no file")
        path = inside_folder(folder, name, f"{state_path} _data_files")
        if path.parent.resolve() != folder.resolve():
            raise ValueError(f"{state_path} _data_files: {name!r} is not a file of {folder} itself")


@functools.lru_cache(maxsize=8)
def _load_rows(folder: str, stamp: int) -> Any:
    del stamp  # part of the cache key only: a rewritten table is read again
    try:
        refuse_files_elsewhere(Path(folder))
        table = datasets_module().load_from_disk(folder)
    except ImportError:
        raise
    except Exception as e:
        raise ValueError(f"{folder}: its Arrow table (state.json, dataset_info.json, data-*.arrow) is not readable: "
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


def speculators_table_rows(folder: str | os.PathLike) -> int:
    return len(read_speculators_rows(folder))


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


def speculators_training_sample(path: str | os.PathLike) -> TrainingSample:
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
    aux, last = eagle3_states(path, list(hs.unbind(1)))
    return TrainingSample(input_ids, aux, last, loss_mask)


def speculators_tokens(path: str | os.PathLike) -> tuple[torch.Tensor, torch.Tensor]:
    input_ids, loss_mask, _ = speculators_row(*speculators_row_of(path))
    return input_ids, loss_mask


def hs_stored_shapes(path: str | os.PathLike) -> tuple[list[tuple[int, ...]], int]:
    """(the lengths of its per-token tensors, its states), from the header."""
    shapes = header_shapes(path, HS_SAFETENSORS_KEYS)
    stacked = shapes["hidden_states"]
    return [tuple(shapes["token_ids"]), *(tuple(shape[:1]) for shape in shapes.values())], \
        stacked[1] if len(stacked) == 3 else -1


@dataclass
class TableSample:
    """A speculators-layout file with its row of the Arrow table (None when the table has no such row)."""

    tensors: dict[str, torch.Tensor]
    row: int
    table_rows: int
    fields: tuple[torch.Tensor, torch.Tensor, int] | None  # (input_ids, loss_mask, seq_len)


def read_table_sample(path: str | os.PathLike) -> TableSample:
    folder, row = speculators_row_of(path)
    tensors, rows = read_safetensors(path), speculators_table_rows(folder)
    return TableSample(tensors, row, rows, speculators_row(folder, row) if row < rows else None)


def table_file_states(t: TableSample, where: str) -> tuple[FileStates | None, list[Finding]]:
    """The file's states with its table row's tokens and mask; the row must describe the file,
    or speculators skips the sample (token ids) or trains on a wrong mask (length)."""
    obj = t.tensors
    found = keys_findings(obj, HS_SAFETENSORS_KEYS, ("loss_mask",))
    if found and lacks_keys(obj, HS_SAFETENSORS_KEYS):
        return None, found
    if t.fields is None:
        return None, found + [Finding(TABLE_ROW, f"no row {t.row} in the Arrow table ({t.table_rows} rows): a file "
                                                 "of another dataset, or a table written short")]
    ids, mask, seq_len = t.fields
    hs, token_ids = obj["hidden_states"], obj["token_ids"]
    wrong = stacked_states_finding(hs)
    if wrong:
        return None, found + [wrong]
    found += stored_kind_findings(obj, ("token_ids", "loss_mask"))
    if token_ids.shape != ids.shape or not torch.equal(token_ids.long(), ids):
        differ = (f"{token_ids.shape[0]} token ids, the row has {ids.shape[0]}" if token_ids.shape != ids.shape else
                  f"first difference at position {int((token_ids.long() != ids).nonzero()[0])}")
        found.append(Finding(TABLE_ROW, f"token_ids differ from row {t.row}'s input_ids ({differ}): speculators "
                                        "skips this sample"))
    if seq_len != ids.shape[0]:
        found.append(Finding(TABLE_ROW, f"row {t.row}: seq_len {seq_len}, its input_ids hold {ids.shape[0]}"))
    own = obj.get("loss_mask")  # speculators' own files carry none; one that does must say what the table says
    if own is not None and (own.shape != mask.shape or not torch.equal(own.long(), mask)):
        differ = (f"{own.shape[0] if own.dim() else 0} values, the row has {mask.shape[0]}" if own.shape != mask.shape
                  else f"first difference at position {int((own.long() != mask).nonzero()[0])}")
        found.append(Finding(TABLE_ROW, f"loss_mask differs from row {t.row}'s loss_mask ({differ}): speculators "
                                        "trains on the table's, so one of the two is wrong; extract the sample again"))
    return FileStates(ids, mask, list(hs.unbind(1))), found


# ---------------------------------------------------------------------------------------------
# Listing each layout's files (None: the folder is not in that layout)
# ---------------------------------------------------------------------------------------------

def rows_lister(subdir: str, name_re: re.Pattern) -> Callable[[Path, int], DatasetFiles | None]:
    """The lister of a layout whose files are `subdir/rows_{a}-{b}/NAME` (v1, compact): the
    folder `subdir` makes a dataset folder this layout."""
    def lister(root: Path, rows_per_folder: int) -> DatasetFiles | None:
        folder = root / subdir
        return rows_layout_files(folder, name_re, rows_per_folder) if folder.is_dir() else None
    return lister


def list_speculators_files(root: Path, rows_per_folder: int) -> DatasetFiles | None:
    """The hs_{row} files below a folder whose Arrow table (its state.json) makes it this layout."""
    del rows_per_folder  # one flat folder of files
    if not (root / ARROW_STATE_FILE).is_file():
        return None
    out = DatasetFiles()
    hs = root / HIDDEN_STATES_DIR
    if hs.is_dir():
        for f in files_in(hs, out, recursive=False):
            m = HS_SAFETENSORS_FILE_RE.match(f.name)
            (out.files.append((int(m.group(1)), f)) if m else out.stray.append(f))
    return out


def list_flat_v1_files(root: Path, rows_per_folder: int) -> DatasetFiles | None:
    del rows_per_folder  # flat
    return flat_layout_files(root, V1_FILE_RE)


def list_hs_files(root: Path, rows_per_folder: int) -> DatasetFiles | None:
    del rows_per_folder  # flat
    return flat_layout_files(root, HS_SAFETENSORS_FILE_RE)


def list_specforge_files(root: Path, rows_per_folder: int) -> DatasetFiles | None:
    return nested_layout_files(root, SPECFORGE_FILE_RE, rows_per_folder)


# ---------------------------------------------------------------------------------------------
# The registry
# ---------------------------------------------------------------------------------------------

# (out, index, input_ids, the states in layer-id order, loss_mask, the stored teacher where the layout keeps one)
SampleWriter = Callable[[Path, int, torch.Tensor, list[torch.Tensor], torch.Tensor, "StoredTeacher | None"], Path]


def _nothing(_: Any) -> None:
    return None


def _no_fields(top_k: int) -> dict[str, Any]:
    del top_k  # only a layout that stores a teacher records its K
    return {}


def _no_damage(raw: Any, cfg: dict[str, Any] | None) -> list[str]:
    del raw, cfg  # a layout without checksums cannot tell
    return []


def _any_hidden_size(hidden_size: int, where: str) -> None:
    del hidden_size, where  # a layout that stores states as they are takes any size


@dataclass(frozen=True)
class RowsTable:
    """A table of rows a layout keeps beside its sample files (speculators': each sample's
    input_ids, loss_mask and seq_len), written before them."""

    state_file: str  # written last: the table is complete once it exists
    count: Callable[[Path], int]  # its rows (a ValueError naming the folder when unreadable)
    start: Callable[[Path, list[tuple[Any, Any]]], None]  # write it from (input_ids, loss_mask) rows
    files: Callable[[Path], list[Path]]  # its files, to discard a table no sample file was written for

    def exists(self, root: str | os.PathLike) -> bool:
        return (Path(root) / self.state_file).exists()


@dataclass(frozen=True)
class Layout:
    """One hidden-state dataset layout: all eaglet needs to know of it, in one object."""

    name: str  # a FORMAT_*: data_config.json's "format", `eaglet check`'s report
    description: str  # what `eaglet check` says a folder in this layout holds
    files_dir: str  # the folder its sample files live under, relative to the dataset folder ("": the folder)
    list_files: Callable[[Path, int], DatasetFiles | None]  # (folder, rows per folder) -> files; None: not this layout
    relative_path: Callable[[int], str]  # sample i's file, relative to the dataset folder
    read_training: Callable[[Path], TrainingSample]  # one file, as training takes it
    read_tokens: Callable[[Path], tuple[torch.Tensor, torch.Tensor]]  # (input_ids, loss_mask), reading little else
    read_raw: Callable[[Path], Any]  # check: the file as stored (never running pickled code)
    file_states: Callable[[Any, str], tuple[FileStates | None, list[Finding]]]  # check: (raw, path) -> states, findings
    option: str | None = None  # the `--layout` name of a layout eaglet writes
    write: SampleWriter | None = None  # eaglet writes it: one sample's file
    # A written file's per-token tensors' lengths and its number of states, read cheaply: whether
    # a file an earlier run left is a complete sample.
    stored_shapes: Callable[[Path], tuple[list[tuple[int, ...]], int]] | None = None
    side_files: bool = False  # eaglet's own: data_config.json, sample_lengths.json and token_freq.pt always exist
    last_state: str = LAST_STATE_PRE_NORM  # the last state's convention where data_config.json records none
    fixed_last_state: bool = False  # its own readers assume `last_state`, whatever data_config.json records
    stores_teacher: bool = False  # the target's top-K in place of the last state: its files hold no last state
    dequantized: bool = False  # its aux states read back dequantized (fp32), not in the dtype they were recorded in
    table: RowsTable | None = None  # a table of rows beside the files
    config_fields: Callable[[int], dict[str, Any]] = _no_fields  # data_config.json's record of its scheme (given K)
    config_problem: Callable[[dict[str, Any]], str | None] = _nothing  # why this eaglet cannot read the recorded scheme
    config_warning: Callable[[dict[str, Any]], str | None] = _nothing  # what a readable recorded scheme lacks
    stored_top_k: Callable[[dict[str, Any]], Any] = _nothing  # the stored teacher's K, as data_config.json records it
    # check: (raw file, data_config.json) -> each tensor whose bytes changed since it was written, by its checksum
    damage: Callable[[Any, dict[str, Any] | None], list[str]] = _no_damage
    check_hidden_size: Callable[[int, str], None] = _any_hidden_size  # refuse, up front, a size it cannot store

    def path(self, root: str | os.PathLike, index: int) -> Path:
        return Path(root) / self.relative_path(index)

    def folder(self, root: str | os.PathLike) -> Path:
        """The folder under which the sample files live."""
        return Path(root) / self.files_dir


V1_LAYOUT = Layout(
    FORMAT_V1, "speculators v1 (hidden_states/rows_{a}-{b}/data_{i}.pt)", HIDDEN_STATES_DIR,
    list_files=rows_lister(HIDDEN_STATES_DIR, V1_FILE_RE), relative_path=v1_relative_path,
    read_training=v1_training_sample, read_tokens=v1_tokens, read_raw=torch_load_safe_mmap, file_states=v1_file_states,
    option="v1", write=write_v1_states, stored_shapes=v1_stored_shapes, side_files=True)
V1_FLAT_LAYOUT = Layout(
    FORMAT_V1_FLAT, "speculators v1, flat (data_{i}.pt)", "",
    list_files=list_flat_v1_files, relative_path=flat_v1_relative_path,
    read_training=v1_training_sample, read_tokens=v1_tokens, read_raw=torch_load_safe_mmap, file_states=v1_file_states)
SPECFORGE_LAYOUT = Layout(
    FORMAT_SPECFORGE, "SpecForge offline (rows_{a}-{b}/data_{i}.ckpt[.gz])", "",
    list_files=list_specforge_files, relative_path=specforge_relative_path,
    read_training=specforge_training_sample, read_tokens=specforge_tokens, read_raw=read_specforge_sample,
    file_states=specforge_file_states,
    # SpecForge's offline `hidden_state` is what its target head (lm_head only, no norm) consumes
    last_state=LAST_STATE_POST_NORM)
HS_SAFETENSORS_LAYOUT = Layout(
    FORMAT_HS_SAFETENSORS, "speculators hs_{row}.safetensors, flat (loss_mask in each file, no table)", "",
    list_files=list_hs_files, relative_path=hs_relative_path,
    read_training=hs_training_sample, read_tokens=hs_tokens, read_raw=read_safetensors, file_states=hs_file_states)
SPECULATORS_LAYOUT = Layout(
    FORMAT_SPECULATORS_ARROW, "speculators >= 0.6 (Arrow table + hidden_states/hs_{row}.safetensors)",
    HIDDEN_STATES_DIR, list_files=list_speculators_files, relative_path=speculators_relative_path,
    read_training=speculators_training_sample, read_tokens=speculators_tokens, read_raw=read_table_sample,
    file_states=table_file_states, option="speculators", write=write_speculators_states, stored_shapes=hs_stored_shapes,
    fixed_last_state=True,  # speculators applies the target's final norm to the stored last state itself
    table=RowsTable(ARROW_STATE_FILE, speculators_table_rows, start_speculators_table, speculators_table_files))
COMPACT_LAYOUT = Layout(
    FORMAT_COMPACT, "eaglet compact (compact/rows_{a}-{b}/data_{i}.safetensors: 6-bit aux, stored teacher)",
    COMPACT_DIR, list_files=rows_lister(COMPACT_DIR, COMPACT_FILE_RE), relative_path=compact_relative_path,
    read_training=compact_training_sample, read_tokens=compact_tokens, read_raw=read_compact_file,
    file_states=compact_file_states, option="compact", write=write_compact_states, stored_shapes=compact_stored_shapes,
    side_files=True, stores_teacher=True, dequantized=True, config_fields=compact_config_fields,
    config_problem=compact_version_problem, config_warning=compact_version_warning, stored_top_k=compact_top_k,
    damage=compact_damage, check_hidden_size=check_compact_hidden_size)

# Every layout eaglet reads, in the order detection tries them: the first whose lister finds its
# mark in a folder wins (speculators' table folder also has hidden_states/, so it comes before v1;
# SpecForge's files may lie anywhere below, so it comes last).
LAYOUTS = (COMPACT_LAYOUT, SPECULATORS_LAYOUT, V1_LAYOUT, V1_FLAT_LAYOUT, HS_SAFETENSORS_LAYOUT, SPECFORGE_LAYOUT)
LAYOUTS_BY_NAME = {lay.name: lay for lay in LAYOUTS}


def _written_layouts() -> dict[str, Layout]:
    """The layouts eaglet writes, by their `--layout` name: the command line offers WRITTEN_LAYOUT_NAMES
    (options.py, which imports no torch), each the option of one layout here (else a KeyError, on import)."""
    by_option = {lay.option: lay for lay in LAYOUTS if lay.option is not None}
    return {name: by_option[name] for name in WRITTEN_LAYOUT_NAMES}


WRITTEN_LAYOUTS = _written_layouts()


def find_layout(name: str | Layout | None) -> Layout | None:
    """The layout of a FORMAT_* name (data_config.json's "format"); a Layout is its own; None for another name."""
    return name if isinstance(name, Layout) or name is None else LAYOUTS_BY_NAME.get(name)


def layout(name: str | Layout) -> Layout:
    """The layout of a FORMAT_* name (data_config.json's "format"), refusing a name of none; a Layout is its own."""
    found = find_layout(name)
    if found is None:
        raise ValueError(f"no hidden-state layout {name!r}: eaglet reads {list(LAYOUTS_BY_NAME)}")
    return found


def written_layout(name: str) -> Layout:
    """The layout of a `--layout` name."""
    if name not in WRITTEN_LAYOUTS:
        raise ValueError(f"--layout {name!r}: eaglet writes {list(WRITTEN_LAYOUTS)}")
    return WRITTEN_LAYOUTS[name]


def list_dataset_files(folder: str | os.PathLike, rows_per_folder: int = ROWS_PER_FOLDER) -> DatasetFiles:
    """Detect which layout `folder` holds and list its files (the first layout of LAYOUTS found wins)."""
    root = Path(folder)
    if not root.is_dir():
        return DatasetFiles()
    for candidate in LAYOUTS:
        listing = candidate.list_files(root, rows_per_folder)
        if listing is not None:
            listing.layout = candidate
            return listing
    return DatasetFiles()


# ---------------------------------------------------------------------------------------------
# What stages do with a layout, given it or its name
# ---------------------------------------------------------------------------------------------

def read_training_sample(path: str | os.PathLike, fmt: str | Layout) -> TrainingSample:
    """One sample of a dataset in layout `fmt` (as `list_dataset_files` finds it), as training takes it."""
    return layout(fmt).read_training(Path(path))


def read_sample_tokens(path: str | os.PathLike, fmt: str | Layout) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, loss_mask) of one file, reading as little else as the layout allows: the hidden
    states of `.pt` / `.ckpt` files are memory-mapped and never touched, safetensors tensors are
    read by name; only a `.ckpt.gz` must be decompressed whole."""
    return layout(fmt).read_tokens(Path(path))


def files_dir(out: str | os.PathLike, fmt: str | Layout) -> Path:
    """The folder under which a layout's sample files live."""
    return layout(fmt).folder(out)


def sample_path(out: str | os.PathLike, fmt: str | Layout, index: int) -> Path:
    return layout(fmt).path(out, index)


def writable_layout(fmt: str | Layout) -> Layout:
    """The layout `fmt`, refusing one eaglet does not write."""
    lay = layout(fmt)
    if lay.write is None or lay.stored_shapes is None:
        raise ValueError(f"eaglet does not write the {lay.name} layout; it writes {list(WRITTEN_LAYOUTS)}")
    return lay


def write_sample(out: str | os.PathLike, fmt: str | Layout, index: int, input_ids: torch.Tensor,
                 states: list[torch.Tensor], loss_mask: torch.Tensor, teacher: StoredTeacher | None = None) -> Path:
    """One sample's file in layout `fmt` (speculators' keeps the loss mask in its table, not here; the
    compact layout keeps the aux states and, in place of the last state, `teacher`)."""
    write = writable_layout(fmt).write
    assert write is not None  # writable_layout refuses a layout without one
    return write(Path(out), index, input_ids, states, loss_mask, teacher)


def start_dataset(out: str | os.PathLike, fmt: str | Layout, rows: list[tuple[Any, Any]]) -> None:
    """What a layout needs before its sample files: speculators' table of (input_ids, loss_mask)."""
    table = layout(fmt).table
    if table is not None and not table.exists(out):
        table.start(Path(out), rows)


def sample_file_problem(path: str | os.PathLike, fmt: str | Layout, num_tokens: int, num_states: int) -> str | None:
    """Why a file an earlier run left is not a complete, safe sample of `num_tokens` tokens (None:
    it is). Cheap: v1's pickle is read weights-only with the tensors mapped, safetensors' header only."""
    stored_shapes = writable_layout(fmt).stored_shapes
    assert stored_shapes is not None  # writable_layout refuses a layout without them
    path = Path(path)
    if path.is_symlink() or not path.is_file():
        return "not a regular file"
    try:
        lengths, states = stored_shapes(path)
    except Exception as e:  # unsafe pickle, truncated file, wrong schema: all mean "write it again"
        return f"{type(e).__name__}: {e}"
    ok = all(tuple(n) == (num_tokens,) for n in lengths) and states == num_states
    return None if ok else f"{WHOLE_BUT_OTHER} ({states} states, shapes {[tuple(n) for n in lengths]})"


# A file that reads as a whole sample, but not of the shapes this dataset's sample has there: no
# run of this dataset wrote it (a run's files have its samples' shapes) -- another dataset's, reached
# through a linked folder, say -- so it is never overwritten
WHOLE_BUT_OTHER = "a whole sample of other shapes"


def refuse_other_samples(found: list[tuple[Path, str]]) -> None:
    """Refuse, before any is overwritten, files `sample_file_problem` found to be other samples."""
    other = [(path, why) for path, why in found if why.startswith(WHOLE_BUT_OTHER)]
    if other:
        path, why = other[0]
        raise FileExistsError(f"{path}: {why}: another dataset's file ({len(other)} such, e.g. behind a linked "
                              "folder), which this run would overwrite; no sample file was written: move them away, "
                              "or choose another --out")
