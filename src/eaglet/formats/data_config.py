"""`data_config.json`: what a hidden-state dataset records about itself and its target, typed,
read and written here only. `eaglet extract` and `eaglet convert` write it (`ensure_data_config`);
`eaglet check`, training, convert and the compact reader read it (`read_data_config`, or
`parse_data_config` where a bad field is a problem to report rather than an error).

A foreign dataset (speculators, SpecForge) may have none, or one with fewer fields: every field
but the layout's name may be missing (None). Keys this eaglet does not know are kept as they are.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable

from eaglet.formats.io import read_json, write_json_atomic
from eaglet.formats.layouts import find_layout, list_dataset_files
from eaglet.formats.prepared import TOKEN_FREQ_FILE
from eaglet.formats.signatures import SIGNATURES_DIR, SignatureLog
from eaglet.formats.samples import DATA_CONFIG_FILE, HIDDEN_STATES_DIR, ROWS_PER_FOLDER, SAMPLE_LENGTHS_FILE

log = logging.getLogger(__name__)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_count(v: Any) -> bool:
    return _is_int(v) and v >= 0


def _is_ids(v: Any) -> bool:
    return isinstance(v, list) and all(_is_count(x) for x in v)


# sizes (a dimension, a length, rows per folder) are positive: 0 or -1 would pass for an int and
# divide by zero, or cut every sample to nothing, far from this file
_STR, _SIZE, _COUNT, _IDS, _DICT = (
    (lambda v: isinstance(v, str), "a string"),
    (lambda v: _is_int(v) and v > 0, "a positive int"),
    (_is_count, "an int >= 0"),
    (_is_ids, "a list of ints >= 0"),
    (lambda v: isinstance(v, dict), "an object"),
)


@dataclass(frozen=True)
class DataConfig:
    format: str | None = None  # the layout's name (formats.LAYOUTS)
    target: str | None = None  # the target's name, its folder or hub id, and the revision its states came from
    target_path: str | None = None
    target_revision: str | None = None
    architecture: str | None = None
    model_type: str | None = None
    num_hidden_layers: int | None = None
    hidden_size: int | None = None
    vocab_size: int | None = None
    layer_ids: list[int] | None = None  # hidden_states ids of the stored states: three aux, then the last layer N
    aux_layer_ids: list[int] | None = None
    layer_id_convention: str | None = None
    last_hidden_state: str | None = None  # pre_norm or post_norm
    compute_dtype: str | None = None
    engine: str | None = None  # what computed the states: "hf" (eaglet's own forwards) or "vllm <version>"
    hidden_states_dtype: str | None = None
    chat_template_sha256: str | None = None
    max_length: int | None = None
    seq_length: int | None = None
    num_samples: int | None = None
    num_tokens: int | None = None
    num_masked_tokens: int | None = None
    rows_per_folder: int | None = None
    prepared_data: str | None = None
    prepared_sha256: str | None = None
    eaglet_version: str | None = None
    state_signatures: str | None = None  # where extraction recorded each file's signatures (formats.signatures)
    signature_key: str | None = None  # the key each of this extraction's signature lines carries
    command: str | None = None
    converted_from: dict[str, Any] | None = None  # convert: {"path", "format"} of the source
    compact: dict[str, Any] | None = None  # the compact layout's scheme (formats.compact_config)
    extra: dict[str, Any] = field(default_factory=dict)  # keys this eaglet does not know, kept as they are

    @property
    def rows(self) -> int:
        """Samples per rows_{a}-{b} folder."""
        return self.rows_per_folder or ROWS_PER_FOLDER

    def to_json(self) -> dict[str, Any]:
        known = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"}
        return {**{k: v for k, v in known.items() if v is not None}, **self.extra}


# What each recorded field must be; a field of another kind is a problem named with its value.
FIELD_KINDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    **{
        name: _STR
        for name in (
            "format",
            "target",
            "target_path",
            "target_revision",
            "architecture",
            "model_type",
            "layer_id_convention",
            "last_hidden_state",
            "compute_dtype",
            "engine",
            "hidden_states_dtype",
            "chat_template_sha256",
            "prepared_data",
            "prepared_sha256",
            "eaglet_version",
            "state_signatures",
            "signature_key",
            "command",
        )
    },
    **{
        name: _SIZE
        for name in ("num_hidden_layers", "hidden_size", "vocab_size", "max_length", "seq_length", "rows_per_folder")
    },
    **{name: _COUNT for name in ("num_samples", "num_tokens", "num_masked_tokens")},
    "layer_ids": _IDS,
    "aux_layer_ids": _IDS,
    "converted_from": _DICT,
    "compact": _DICT,
}
# Fields that must agree before two runs may write into one folder.
# The states' compute dtype and engine too: a resume at another --dtype or --engine wrote files of
# mixed rounding under one record.
IDENTITY_FIELDS = (
    "format",
    "compact",
    "target_revision",
    "layer_ids",
    "hidden_size",
    "hidden_states_dtype",
    "last_hidden_state",
    "chat_template_sha256",
    "max_length",
    "num_samples",
    "num_tokens",
    "prepared_sha256",
    "compute_dtype",
    "engine",
)


def parse_data_config(raw: Any) -> tuple[DataConfig, list[str]]:
    """A data_config.json's object as a DataConfig, and what is wrong in it ("field X: ..."): a
    field of the wrong kind is left out (None), the others are kept."""
    if not isinstance(raw, dict):
        return DataConfig(), [f"a JSON {type(raw).__name__}, not an object"]
    known, problems = {}, []
    for key, value in raw.items():
        if key not in FIELD_KINDS:
            continue
        ok, kind = FIELD_KINDS[key]
        if value is None or ok(value):
            known[key] = value
        else:
            problems.append(f"{key} {value!r}: expected {kind}")
    return DataConfig(**known, extra={k: v for k, v in raw.items() if k not in FIELD_KINDS}), problems


def data_config_from(raw: Any, where: str | Path) -> DataConfig:
    """`parse_data_config` for a config that must be right: a field of the wrong kind is an error
    naming `where` (the file read, or the one about to be written) and the field."""
    cfg, problems = parse_data_config(raw)
    if problems:
        raise ValueError(f"{where}: {'; '.join(problems)}")
    return cfg


def read_data_config(root: str | Path) -> DataConfig | None:
    """A dataset's data_config.json (None when it has none); a field of the wrong kind is an error
    naming the file and the field."""
    path = Path(root) / DATA_CONFIG_FILE
    return data_config_from(read_json(path), path) if path.exists() else None


def write_data_config(root: str | Path, cfg: DataConfig) -> None:
    write_json_atomic(Path(root) / DATA_CONFIG_FILE, cfg.to_json())


def signature_log(out: Path, name: str) -> SignatureLog:
    """The log a writer of the dataset at `out` records its files' signatures in, its lines
    keyed by the data_config.json written there (by this run, or by the first shard)."""
    config = read_data_config(out)
    if config is None:
        raise FileNotFoundError(f"{out / DATA_CONFIG_FILE}: missing; a dataset's config is written before its files")
    return SignatureLog(out, name, config.signature_key or "")


def first_difference(old: DataConfig, new: DataConfig) -> str | None:
    """The first identity field two configs disagree on (None: the same dataset)."""
    return next((k for k in IDENTITY_FIELDS if getattr(old, k) != getattr(new, k)), None)


def refuse_other_dataset(out: Path, config: DataConfig) -> None:
    """Refuse to write into a folder whose data_config.json describes another dataset."""
    old = read_data_config(out)
    key = None if old is None else first_difference(old, config)
    if key is not None:
        raise ValueError(
            f"{out / DATA_CONFIG_FILE}: this folder holds a dataset made with {key}="
            f"{getattr(old, key)!r}, this run has {getattr(config, key)!r}; use another --out, or "
            "delete the folder to start over"
        )


def discard_side_files(out: Path, old: DataConfig) -> None:
    """The side files of a run that wrote no sample file: written again from this run's data."""
    for name in (DATA_CONFIG_FILE, SAMPLE_LENGTHS_FILE, TOKEN_FREQ_FILE):
        (out / name).unlink(missing_ok=True)
    if (out / SIGNATURES_DIR).is_dir() and not (out / SIGNATURES_DIR).is_symlink():
        # lines of files never renamed into place, keyed to the config replaced here
        shutil.rmtree(out / SIGNATURES_DIR)
    old_layout = find_layout(old.format)
    if old_layout is not None and old_layout.table is not None:  # its table of the old samples' tokens
        for p in old_layout.table.files(out):
            p.unlink(missing_ok=True)


def ensure_data_config(out: Path, config: DataConfig) -> None:
    """Write data_config.json, or check that the one already there describes the same dataset.

    One left by a run that wrote no sample file (it failed before its first) guards nothing: it
    is replaced, with the side files of that run, so a fixed input reruns in place."""
    old = read_data_config(out)
    if old is None and list_dataset_files(out).files:
        # a run writes its config before its first sample file: these are another dataset's,
        # reached through a linked hidden_states/ (say), and a write here would overwrite them
        raise FileExistsError(
            f"{out}: holds sample files that no {DATA_CONFIG_FILE} describes (another dataset's, "
            f"e.g. behind a linked {HIDDEN_STATES_DIR}/): nothing was written; choose another "
            "--out, or move those files away"
        )
    if old is not None:
        if first_difference(old, config) is None:
            return
        if list_dataset_files(out).files:
            refuse_other_dataset(out, config)
        log.warning("%s: replacing the config of an earlier run that wrote no sample file", out / DATA_CONFIG_FILE)
        discard_side_files(out, old)
    write_data_config(out, config)
