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

import gzip
import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from eaglet.formats.compact import (
    COMPACT_DIR,
    check_compact_hidden_size,
    compact_config_fields,
    compact_damage,
    compact_file_states,
    compact_relative_path,
    compact_stored_shapes,
    compact_tokens,
    compact_top_k,
    compact_training_sample,
    compact_version_problem,
    compact_version_warning,
    read_compact_file,
    write_compact_states,
)
from eaglet.formats.io import (
    read_safetensors,
    torch_load_safe,
    torch_load_safe_bytes,
    torch_load_safe_mmap,
    torch_save_atomic,
)
from eaglet.formats.listing import DatasetFiles, files_in, flat_layout_files, nested_layout_files, rows_layout_files
from eaglet.formats.samples import (
    HIDDEN_STATES_DIR,
    LAST_STATE_POST_NORM,
    LAST_STATE_PRE_NORM,
    ROWS_PER_FOLDER,
    V1_FOLDER_RE,
    WRONG_SHAPE,
    FileStates,
    Finding,
    StoredTeacher,
    TrainingSample,
    drop_batch_dim,
    eagle3_states,
    keys_findings,
    lacks_keys,
    rows_folder,
    sparse_tensors,
    stored_kind_findings,
)
from eaglet.formats.signatures import SIGNATURES_DIR, SignatureLog, state_signature, token_digest
from eaglet.formats.speculators_files import (
    ARROW_STATE_FILE,
    hs_file_states,
    hs_relative_path,
    HS_SAFETENSORS_FILE_RE,
    hs_stored_shapes,
    hs_tokens,
    hs_training_sample,
    read_table_sample,
    speculators_relative_path,
    speculators_table_files,
    speculators_table_rows,
    speculators_tokens,
    speculators_training_sample,
    start_speculators_table,
    table_file_states,
    write_speculators_states,
)
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
COMPACT_FILE_RE = re.compile(r"^data_(\d+)\.safetensors$")


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
    return [tuple(s.input_ids.shape), tuple(s.loss_mask.shape), *(tuple(h.shape[:1]) for h in s.hidden_states)], len(
        s.hidden_states
    )


def write_v1_states(
    out: str | os.PathLike,
    index: int,
    input_ids: torch.Tensor,
    states: list[torch.Tensor],
    loss_mask: torch.Tensor,
    teacher: StoredTeacher | None,
) -> Path:
    del teacher  # v1 keeps the last state itself
    return write_v1_sample(out, index, V1Sample(input_ids, states, loss_mask))


def v1_file_states(obj: Any, where: str) -> tuple[FileStates | None, list[Finding]]:
    found = keys_findings(obj, V1_KEYS)
    if found and lacks_keys(obj, V1_KEYS):
        return None, found
    hs = obj["hidden_states"]
    if not isinstance(hs, list) or not all(isinstance(h, torch.Tensor) for h in hs):
        return None, found or [
            Finding(WRONG_SHAPE, f"hidden_states is a {type(hs).__name__}: the layout stores a list of tensors")
        ]
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
    return (
        isinstance(aux, torch.Tensor)
        and isinstance(last, torch.Tensor)
        and aux.dim() == 2
        and last.dim() == 2
        and aux.shape[-1] == 3 * last.shape[-1]
    )


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


def _signed(top_k: int) -> dict[str, Any]:
    """data_config.json's record that each file's signature is kept (formats.signatures), and the
    key this extraction's lines carry: random, kept by every shard and resume (the first run's
    data_config.json stays), so a line copied in from another dataset vouches for nothing."""
    return {"state_signatures": SIGNATURES_DIR, "signature_key": secrets.token_hex(8)}


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
    FORMAT_V1,
    "speculators v1 (hidden_states/rows_{a}-{b}/data_{i}.pt)",
    HIDDEN_STATES_DIR,
    list_files=rows_lister(HIDDEN_STATES_DIR, V1_FILE_RE),
    relative_path=v1_relative_path,
    read_training=v1_training_sample,
    read_tokens=v1_tokens,
    read_raw=torch_load_safe_mmap,
    file_states=v1_file_states,
    option="v1",
    write=write_v1_states,
    stored_shapes=v1_stored_shapes,
    side_files=True,
    config_fields=_signed,
)
V1_FLAT_LAYOUT = Layout(
    FORMAT_V1_FLAT,
    "speculators v1, flat (data_{i}.pt)",
    "",
    list_files=list_flat_v1_files,
    relative_path=flat_v1_relative_path,
    read_training=v1_training_sample,
    read_tokens=v1_tokens,
    read_raw=torch_load_safe_mmap,
    file_states=v1_file_states,
)
SPECFORGE_LAYOUT = Layout(
    FORMAT_SPECFORGE,
    "SpecForge offline (rows_{a}-{b}/data_{i}.ckpt[.gz])",
    "",
    list_files=list_specforge_files,
    relative_path=specforge_relative_path,
    read_training=specforge_training_sample,
    read_tokens=specforge_tokens,
    read_raw=read_specforge_sample,
    file_states=specforge_file_states,
    # SpecForge's offline `hidden_state` is what its target head (lm_head only, no norm) consumes
    last_state=LAST_STATE_POST_NORM,
)
HS_SAFETENSORS_LAYOUT = Layout(
    FORMAT_HS_SAFETENSORS,
    "speculators hs_{row}.safetensors, flat (loss_mask in each file, no table)",
    "",
    list_files=list_hs_files,
    relative_path=hs_relative_path,
    read_training=hs_training_sample,
    read_tokens=hs_tokens,
    read_raw=read_safetensors,
    file_states=hs_file_states,
)
SPECULATORS_LAYOUT = Layout(
    FORMAT_SPECULATORS_ARROW,
    "speculators >= 0.6 (Arrow table + hidden_states/hs_{row}.safetensors)",
    HIDDEN_STATES_DIR,
    list_files=list_speculators_files,
    relative_path=speculators_relative_path,
    read_training=speculators_training_sample,
    read_tokens=speculators_tokens,
    read_raw=read_table_sample,
    file_states=table_file_states,
    option="speculators",
    write=write_speculators_states,
    stored_shapes=hs_stored_shapes,
    config_fields=_signed,
    fixed_last_state=True,  # speculators applies the target's final norm to the stored last state itself
    table=RowsTable(ARROW_STATE_FILE, speculators_table_rows, start_speculators_table, speculators_table_files),
)
COMPACT_LAYOUT = Layout(
    FORMAT_COMPACT,
    "eaglet compact (compact/rows_{a}-{b}/data_{i}.safetensors: 6-bit aux, stored teacher)",
    COMPACT_DIR,
    list_files=rows_lister(COMPACT_DIR, COMPACT_FILE_RE),
    relative_path=compact_relative_path,
    read_training=compact_training_sample,
    read_tokens=compact_tokens,
    read_raw=read_compact_file,
    file_states=compact_file_states,
    option="compact",
    write=write_compact_states,
    stored_shapes=compact_stored_shapes,
    side_files=True,
    stores_teacher=True,
    dequantized=True,
    config_fields=compact_config_fields,
    config_problem=compact_version_problem,
    config_warning=compact_version_warning,
    stored_top_k=compact_top_k,
    damage=compact_damage,
    check_hidden_size=check_compact_hidden_size,
)

# Every layout eaglet reads, in the order detection tries them: the first whose lister finds its
# mark in a folder wins (speculators' table folder also has hidden_states/, so it comes before v1;
# SpecForge's files may lie anywhere below, so it comes last).
LAYOUTS = (COMPACT_LAYOUT, SPECULATORS_LAYOUT, V1_LAYOUT, V1_FLAT_LAYOUT, HS_SAFETENSORS_LAYOUT, SPECFORGE_LAYOUT)
LAYOUTS_BY_NAME = {lay.name: lay for lay in LAYOUTS}


def _written_layouts() -> dict[str, Layout]:
    """The layouts eaglet writes, by their `--layout` name: the command line offers WRITTEN_LAYOUT_NAMES
    (eaglet.options, which imports no torch), each the option of one layout here (else a KeyError, on import)."""
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


def write_sample(
    out: str | os.PathLike,
    fmt: str | Layout,
    index: int,
    input_ids: torch.Tensor,
    states: list[torch.Tensor],
    loss_mask: torch.Tensor,
    teacher: StoredTeacher | None = None,
    signatures: SignatureLog | None = None,
) -> Path:
    """One sample's file in layout `fmt` (speculators' keeps the loss mask in its table, not here; the
    compact layout keeps the aux states and, in place of the last state, `teacher`), its states'
    signature first recorded in `signatures` where the layout stores them as given (the compact
    layout's quantized states have their checksums in the file instead)."""
    lay = writable_layout(fmt)
    assert lay.write is not None  # writable_layout refuses a layout without one
    if signatures is not None and not lay.dequantized:
        signatures.record(index, state_signature(states), token_digest(input_ids, loss_mask))
    return lay.write(Path(out), index, input_ids, states, loss_mask, teacher)


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
        raise FileExistsError(
            f"{path}: {why}: another dataset's file ({len(other)} such, e.g. behind a linked "
            "folder), which this run would overwrite; no sample file was written: move them away, "
            "or choose another --out"
        )
