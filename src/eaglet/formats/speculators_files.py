"""speculators' own hidden-state layouts, read and written here (formats/layouts.py makes each a
`Layout`):

- speculators >= 0.5: `hs_{row}.safetensors`, `token_ids` [T], `hidden_states` [T, S, H]
  (S = 4: 3 aux ids + last), optionally `loss_mask` [T];
- speculators >= 0.6: an Arrow table saved by `datasets.Dataset.save_to_disk` (data-*.arrow,
  dataset_info.json, state.json), one row per sample (`input_ids`, `loss_mask`, `seq_len`), and
  `hidden_states/hs_{row}.safetensors`; the loss mask lives only in the table.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open

from eaglet.formats.io import (
    TMP_MARK,
    failures_named,
    header_shapes,
    inside_folder,
    read_json,
    read_safetensors,
    remove_stale_temp_files,
    write_safetensors_atomic,
)
from eaglet.formats.samples import (
    HIDDEN_STATES_DIR,
    TABLE_ROW,
    FileStates,
    Finding,
    StoredTeacher,
    TrainingSample,
    eagle3_states,
    keys_findings,
    lacks_keys,
    stacked_states_finding,
    stored_kind_findings,
)

HS_SAFETENSORS_KEYS = ("token_ids", "hidden_states")  # plus an optional "loss_mask"
HS_SAFETENSORS_FILE_RE = re.compile(r"^hs_(\d+)\.safetensors$")
ARROW_STATE_FILE = "state.json"  # written last by save_to_disk: the table is complete once it exists
SPECULATORS_ROW_COLUMNS = ("input_ids", "loss_mask", "seq_len")


# ---------------------------------------------------------------------------------------------
# speculators >= 0.5: hs_{row}.safetensors with their own loss masks
# ---------------------------------------------------------------------------------------------


def hs_relative_path(row: int) -> str:
    return f"hs_{row}.safetensors"


def write_hs_safetensors_sample(
    folder: str | os.PathLike,
    row: int,
    token_ids: torch.Tensor,
    hidden_states: torch.Tensor,
    loss_mask: torch.Tensor | None = None,
) -> Path:
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
        raise ValueError(
            f"{path}: no loss_mask tensor, so the assistant tokens (the only ones trained on) are "
            "unknown; write the files with a loss_mask [T] (1 = assistant token), or run `eaglet "
            "prepare` + `eaglet extract` (or `eaglet train --online`) on the chats"
        )


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
        raise ImportError(
            "speculators' dataset layout is an Arrow table read and written with the `datasets` "
            "library: pip install 'eaglet[speculators]'"
        ) from e
    return datasets


def speculators_relative_path(row: int) -> str:
    return f"{HIDDEN_STATES_DIR}/{hs_relative_path(row)}"


def speculators_hs_path(folder: str | os.PathLike, row: int) -> Path:
    return Path(folder) / speculators_relative_path(row)


def write_speculators_sample(
    folder: str | os.PathLike, row: int, token_ids: torch.Tensor, states: list[torch.Tensor]
) -> Path:
    """`hidden_states/hs_{row}.safetensors`: the states stacked [T, S, H] in id order, no loss mask."""
    return write_hs_safetensors_sample(Path(folder) / HIDDEN_STATES_DIR, row, token_ids, torch.stack(states, dim=1))


def write_speculators_states(
    out: str | os.PathLike,
    index: int,
    input_ids: torch.Tensor,
    states: list[torch.Tensor],
    loss_mask: torch.Tensor,
    teacher: StoredTeacher | None,
) -> Path:
    del loss_mask, teacher  # the loss mask lives in the table; the last state is stored itself
    return write_speculators_sample(out, index, input_ids, states)


def write_speculators_rows(folder: str | os.PathLike, rows: list[tuple[Any, Any]]) -> None:
    """The Arrow table of (input_ids, loss_mask) rows, saved as speculators' prepare_data saves it.
    save_to_disk writes into a temp folder beside; its files are renamed in with state.json last."""
    ds = datasets_module()
    features = ds.Features(
        {"input_ids": ds.List(ds.Value("int64")), "loss_mask": ds.List(ds.Value("int64")), "seq_len": ds.Value("int64")}
    )
    table = ds.Dataset.from_dict(
        {
            "input_ids": [np.asarray(ids, dtype=np.int64) for ids, _ in rows],
            "loss_mask": [np.asarray(mask, dtype=np.int64) for _, mask in rows],
            "seq_len": [len(ids) for ids, _ in rows],
        },
        features=features,
    )
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
        raise ValueError(
            f"{folder}: its Arrow table (state.json, dataset_info.json, data-*.arrow) is not readable: "
            f"{type(e).__name__}: {e}"
        ) from e
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
        raise ValueError(
            f"{speculators_hs_path(folder, row)}: no row {row} in the Arrow table of {folder} ({len(table)} rows)"
        )
    r = table[row]
    return (
        torch.tensor(r["input_ids"], dtype=torch.long),
        torch.tensor(r["loss_mask"], dtype=torch.long),
        int(r["seq_len"]),
    )


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
        raise ValueError(
            f"{path}: expected token_ids [T] and hidden_states [T, S, H], got "
            f"{ {k: tuple(v.shape) for k, v in obj.items()} }"
        )
    if not torch.equal(token_ids.long(), input_ids):
        raise ValueError(
            f"{path}: token_ids differ from row {row}'s input_ids in the Arrow table of {folder} "
            "(speculators skips such a row; rerun the extraction of this sample)"
        )
    aux, last = eagle3_states(path, list(hs.unbind(1)))
    return TrainingSample(input_ids, aux, last, loss_mask)


def speculators_tokens(path: str | os.PathLike) -> tuple[torch.Tensor, torch.Tensor]:
    input_ids, loss_mask, _ = speculators_row(*speculators_row_of(path))
    return input_ids, loss_mask


def hs_stored_shapes(path: str | os.PathLike) -> tuple[list[tuple[int, ...]], int]:
    """(the lengths of its per-token tensors, its states), from the header."""
    shapes = header_shapes(path, HS_SAFETENSORS_KEYS)
    stacked = shapes["hidden_states"]
    return [tuple(shapes["token_ids"]), *(tuple(shape[:1]) for shape in shapes.values())], stacked[1] if len(
        stacked
    ) == 3 else -1


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
        return None, found + [
            Finding(
                TABLE_ROW,
                f"no row {t.row} in the Arrow table ({t.table_rows} rows): a file "
                "of another dataset, or a table written short",
            )
        ]
    ids, mask, seq_len = t.fields
    hs, token_ids = obj["hidden_states"], obj["token_ids"]
    wrong = stacked_states_finding(hs)
    if wrong:
        return None, found + [wrong]
    found += stored_kind_findings(obj, ("token_ids", "loss_mask"))
    if token_ids.shape != ids.shape or not torch.equal(token_ids.long(), ids):
        differ = (
            f"{token_ids.shape[0]} token ids, the row has {ids.shape[0]}"
            if token_ids.shape != ids.shape
            else f"first difference at position {int((token_ids.long() != ids).nonzero()[0])}"
        )
        found.append(
            Finding(
                TABLE_ROW, f"token_ids differ from row {t.row}'s input_ids ({differ}): speculators skips this sample"
            )
        )
    if seq_len != ids.shape[0]:
        found.append(Finding(TABLE_ROW, f"row {t.row}: seq_len {seq_len}, its input_ids hold {ids.shape[0]}"))
    own = obj.get("loss_mask")  # speculators' own files carry none; one that does must say what the table says
    if own is not None and (own.shape != mask.shape or not torch.equal(own.long(), mask)):
        differ = (
            f"{own.shape[0] if own.dim() else 0} values, the row has {mask.shape[0]}"
            if own.shape != mask.shape
            else f"first difference at position {int((own.long() != mask).nonzero()[0])}"
        )
        found.append(
            Finding(
                TABLE_ROW,
                f"loss_mask differs from row {t.row}'s loss_mask ({differ}): speculators "
                "trains on the table's, so one of the two is wrong; extract the sample again",
            )
        )
    return FileStates(ids, mask, list(hs.unbind(1))), found
