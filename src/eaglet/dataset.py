"""A hidden-state dataset opened for reading, in any layout `eaglet check` accepts (eaglet's v1
and compact, speculators' flat v1 and hs_*.safetensors, SpecForge .ckpt[.gz]): its files, what it
records about itself and its target, its lengths and token frequencies. `open_dataset` cross-checks
what the dataset records against its files and refuses one that is incomplete or inconsistent;
training, convert and the check read datasets through it.
"""

from __future__ import annotations

import logging
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from eaglet import formats, layers
from eaglet.formats.data_config import DataConfig, read_data_config
from eaglet.target import TargetRef, dtype_name

log = logging.getLogger(__name__)

REQUIRED_DATA_FIELDS = ("hidden_size", "vocab_size", "layer_ids", "last_hidden_state", "target_revision")


@dataclass
class Dataset:
    """A hidden-state dataset on disk, in any layout `eaglet check` accepts, ready to train on."""

    root: Path
    config: DataConfig  # data_config.json (empty for a foreign dataset without one) + the inferred hidden_size
    files: dict[int, Path]
    lengths: dict[int, int]
    token_freq: dict[int, int]
    layout: str = formats.FORMAT_V1
    aux_layer_ids: list[int] = field(default_factory=list)  # hidden_states ids of the three aux states
    last_hidden_state: str = formats.LAST_STATE_PRE_NORM  # whether the stored last state is before the final norm
    hidden_dtype: str | None = "bfloat16"  # dtype of the stored aux states (None: a compact dataset that records none)
    stored_top_k: int | None = None  # a compact dataset's teacher: the target's top-K it stores

    @property
    def hidden_size(self) -> int:
        """The target's hidden size (recorded, or inferred from the first file as it is loaded)."""
        assert self.config.hidden_size is not None
        return self.config.hidden_size


def no_files_message(root: Path) -> str:
    hint = (
        "; this is an `eaglet prepare` output: train on it with --online, or run `eaglet extract` on it first"
        if (root / formats.PREPARE_CONFIG_FILE).exists()
        else ""
    )
    return (
        f"{root}: no hidden-state files (hidden_states/rows_*/data_*.pt, data_*.pt, rows_*/data_*.ckpt[.gz] or "
        f"hs_*.safetensors) and no {formats.DATA_CONFIG_FILE}; not an `eaglet extract`, speculators or "
        f"SpecForge dataset{hint}"
    )


def check_v1_config(root: Path, cfg: DataConfig | None) -> None:
    """eaglet's own layout always has a complete data_config.json: refuse one that is missing or short."""
    if cfg is None:
        raise FileNotFoundError(
            f"{root}: no {formats.DATA_CONFIG_FILE}; not an `eaglet extract` dataset (or extraction has not started)"
        )
    missing = [k for k in REQUIRED_DATA_FIELDS if getattr(cfg, k) is None]
    if missing:
        raise ValueError(f"{root / formats.DATA_CONFIG_FILE}: missing field(s) {missing}")


def resolve_aux_layer_ids(root: Path, cfg: DataConfig, given: list[int] | None) -> list[int]:
    """The aux ids from data_config.json's layer_ids, else from --aux-layer-ids. Never guessed:
    an off-by-one layer id trains a drafter that silently never gets accepted."""
    where = root / formats.DATA_CONFIG_FILE
    recorded = cfg.layer_ids
    if recorded is not None:
        layers.check_stored_ids(recorded, cfg.num_hidden_layers, f"{where}: layer_ids")
        if given is not None and list(given) != recorded[:-1]:
            raise ValueError(f"--aux-layer-ids {list(given)}: {where} records aux ids {recorded[:-1]}")
        return list(recorded[:-1])
    if given is None:
        raise ValueError(
            f"{root}: no {formats.DATA_CONFIG_FILE} with layer_ids, so which target layers the three "
            "stored aux states come from is not recorded; pass --aux-layer-ids (EAGLE-3's default for "
            "an N-layer target is 2,N//2,N-3 in hidden_states ids, which SpecForge's hooks on layers "
            "1,N//2-1,N-4 also produce; `eaglet check DIR --target T` names the layer of each slot)"
        )
    return layers.check_aux_ids(given, where="--aux-layer-ids")


def resolve_last_state(root: Path, cfg: DataConfig, given: str | None, layout: str) -> str:
    """pre_norm or post_norm: recorded in data_config.json, else --last-hidden-state, else the
    layout's convention (the one `eaglet check` assumes: post-norm for SpecForge, else pre-norm)."""
    recorded = cfg.last_hidden_state
    if recorded is not None and given is not None and recorded != given:
        raise ValueError(f"--last-hidden-state {given}: {root / formats.DATA_CONFIG_FILE} records {recorded!r}")
    value = recorded or given or formats.layout(layout).last_state
    if value not in formats.LAST_STATE_CONVENTIONS:
        raise ValueError(
            f"{root}: last_hidden_state is {value!r}; training knows "
            f"{list(formats.LAST_STATE_CONVENTIONS)} (with {formats.LAST_STATE_PRE_NORM!r} it applies "
            "the target's final norm itself)"
        )
    return value


def scan_tokens(
    root: Path, files: dict[int, Path], layout: str, show_progress: bool
) -> tuple[dict[int, int], dict[int, int]]:
    """(lengths, masked-token frequencies) read from the files themselves, for a dataset that has
    no sample_lengths.json / token_freq.pt. Reads input_ids and loss_mask only."""

    def read(i: int) -> tuple[int, int, torch.Tensor, torch.Tensor]:
        """(index, length, masked token ids, their counts) of one file."""
        try:
            ids, mask = formats.read_sample_tokens(files[i], layout)
            return (i, len(ids), *ids[mask.bool()].unique(return_counts=True))
        except ValueError:
            raise  # the format readers' own messages already name the file and the field
        except Exception as e:  # a corrupt file: point at the full report rather than a bare traceback
            raise ValueError(
                f"{files[i]}: cannot read input_ids / loss_mask ({type(e).__name__}: {e}); "
                f"`eaglet check {root}` reports every problem"
            ) from e

    lengths: dict[int, int] = {}
    freq: dict[int, int] = {}
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        for i, n, toks, counts in tqdm(
            pool.map(read, sorted(files)),
            total=len(files),
            desc="read token ids",
            unit="file",
            file=sys.stderr,
            dynamic_ncols=True,
            disable=not show_progress,
        ):
            lengths[i] = n
            for tok, c in zip(toks.tolist(), counts.tolist()):
                freq[tok] = freq.get(tok, 0) + c
    return lengths, freq


def side_data(
    root: Path, files: dict[int, Path], layout: str, show_progress: bool
) -> tuple[dict[int, int], dict[int, int]]:
    """Sample lengths and token frequencies from sample_lengths.json / token_freq.pt. eaglet's own
    layout must have both; a foreign dataset may lack them, and then they are computed from its files."""
    lengths_path, freq_path = root / formats.SAMPLE_LENGTHS_FILE, root / formats.TOKEN_FREQ_FILE
    lengths = formats.read_sample_lengths(lengths_path) if lengths_path.exists() else None
    freq = formats.read_token_freq(freq_path) if freq_path.exists() else None
    own = formats.layout(layout).side_files  # eaglet's layouts always have both
    if own and freq is None:
        raise FileNotFoundError(f"{root}: no {formats.TOKEN_FREQ_FILE}; the draft vocabulary is built from it")
    if own and lengths is None:
        lengths = {}  # reported below as lengths missing for every sample
    if lengths is None or freq is None:
        missing = [p.name for p, v in ((lengths_path, lengths), (freq_path, freq)) if v is None]
        log.info(
            "%s has no %s: reading the token ids and loss masks of its %d files to compute them "
            "(the draft vocabulary comes from masked-token frequencies, length bucketing from lengths)",
            root,
            " / ".join(missing),
            len(files),
        )
        scanned_lengths, scanned_freq = scan_tokens(root, files, layout, show_progress)
        lengths = scanned_lengths if lengths is None else lengths
        freq = scanned_freq if freq is None else freq
    if not set(files) <= set(lengths):
        raise ValueError(f"{lengths_path}: lengths missing for {len(set(files) - set(lengths))} sample(s)")
    return {i: lengths[i] for i in files}, freq


def open_dataset(
    root: str | Path,
    aux_layer_ids: list[int] | None = None,
    last_hidden_state: str | None = None,
    show_progress: bool = False,
) -> Dataset:
    """Open a hidden-state dataset in any layout `eaglet check` accepts, cross-check what it records
    against its files, and refuse one that is incomplete or inconsistent. eaglet's v1 layout must
    have all its side files; a foreign one (flat v1, SpecForge, hs_*.safetensors) may lack them."""
    root = Path(root)
    recorded = read_data_config(root)
    cfg = recorded or DataConfig()
    listing = formats.list_dataset_files(root, cfg.rows)
    if listing.layout is None and recorded is None:
        raise FileNotFoundError(no_files_message(root))
    lay = listing.layout or formats.V1_LAYOUT  # a config and no file yet: eaglet's own, not started
    layout = lay.name
    if lay.side_files:
        check_v1_config(root, recorded)
    if lay is formats.V1_LAYOUT:  # v1 lists by its rows_* folders, which name where each file belongs
        files = formats.list_v1_files(root)
        if not files:
            raise FileNotFoundError(f"{root}: no {formats.HIDDEN_STATES_DIR}/rows_*/data_*.pt files")
    else:
        files = dict(listing.files)
        if len(files) != len(listing.files):
            raise ValueError(
                f"{root}: {len(listing.files) - len(files)} duplicate sample indices; `eaglet check {root}` lists them"
            )
    version_problem = lay.config_problem(cfg.to_json())
    if version_problem:
        raise ValueError(f"{root / formats.DATA_CONFIG_FILE}: {version_problem}")
    if lay.table:  # a file per row of its table, and no other
        rows = lay.table.count(root)
        unpaired = [f"no file for row(s) {gaps[:10]}" for gaps in [sorted(set(range(rows)) - set(files))] if gaps]
        unpaired += [f"file(s) {extra[:10]} beyond them" for extra in [sorted(set(files) - set(range(rows)))] if extra]
        if unpaired:
            raise ValueError(
                f"{root}: its Arrow table has {rows} rows; {', '.join(unpaired)}: finish `eaglet "
                f"extract`, or `eaglet check {root}` for the full report"
            )
    odd = sorted(str(p) for p in files.values() if not p.is_file() and p.exists())  # one stat for a file
    if odd:  # a pipe would block the read: named, as `eaglet check` names it
        raise ValueError(
            f"{odd[0]}: a pipe, socket or device where a sample file should be"
            + (f" ({len(odd)} such entries)" if len(odd) > 1 else "")
            + f"; remove it (`eaglet check {root}` lists every one)"
        )
    expected = cfg.num_samples
    if expected is not None and len(files) != expected:
        raise ValueError(
            f"{root}: {len(files)} sample files, {formats.DATA_CONFIG_FILE} says {expected}; "
            "finish (or rerun) `eaglet extract` first"
        )
    aux_ids = resolve_aux_layer_ids(root, cfg, aux_layer_ids)
    last_state = resolve_last_state(root, cfg, last_hidden_state, layout)
    lengths, freq = side_data(root, files, layout, show_progress)
    first_path = files[min(files)]
    first = formats.read_training_sample(first_path, layout)
    hidden = cfg.hidden_size or first.aux_hidden.shape[-1] // 3
    stored = first.last_hidden if first.last_hidden is not None else first.teacher
    assert stored is not None  # a file holds its last state or its stored teacher
    last = stored if isinstance(stored, torch.Tensor) else stored.ids  # the teacher's rows: [T, K]
    shapes = (tuple(first.aux_hidden.shape), tuple(last.shape))
    want = (
        (lengths[min(files)], 3 * hidden),
        (lengths[min(files)], hidden if first.teacher is None else last.shape[1]),
    )
    if shapes != want:
        raise ValueError(
            f"{first_path}: hidden_states shapes aux {shapes[0]}, last {shapes[1]}; "
            f"{formats.DATA_CONFIG_FILE} / sample lengths imply {want[0]}, {want[1]}"
        )
    dtype = cfg.hidden_states_dtype if lay.dequantized else dtype_name(first.aux_hidden.dtype)
    return Dataset(
        root,
        replace(cfg, hidden_size=hidden),
        files,
        lengths,
        freq,
        layout,
        aux_ids,
        last_state,
        dtype,
        first.teacher.ids.shape[1] if first.teacher is not None else None,
    )


def check_target_matches(data_cfg: DataConfig, target_cfg: Any, ref: TargetRef) -> None:
    """Refuse a target unlike the one the data came from (only what the dataset records is compared;
    the revision is the target's identity: config, tokenizer and heads, `heads.heads_identity`)."""
    for key, theirs in (("hidden_size", target_cfg.hidden_size), ("vocab_size", target_cfg.vocab_size)):
        ours = getattr(data_cfg, key)
        if ours is not None and ours != theirs:
            raise ValueError(
                f"target {ref.name} has {key}={theirs!r}, the dataset was extracted with "
                f"{ours!r} ({data_cfg.target or '?'}); pass the same --target"
            )
    if data_cfg.target_revision is not None and not ref.is_revision(data_cfg.target_revision):
        raise ValueError(
            f"target {ref.name} has target_revision={ref.revision!r}, the dataset was extracted with "
            f"{data_cfg.target_revision!r} ({data_cfg.target or '?'}): another config, tokenizer or "
            "heads (embeddings, final norm, LM head); pass the same --target"
        )


def recorded_target_where(ds: Dataset) -> str:
    """Where a dataset records its target, for messages."""
    return f"{ds.root / formats.DATA_CONFIG_FILE} target_path"


def dataset_target(ds: Dataset, target: str | None) -> str | None:
    """--target, else the recorded target_path. eaglet's own layout falls back to the embedded default
    as every stage does; a foreign dataset that records no target must be told which one it is."""
    if target is not None or ds.config.target_path is not None or formats.layout(ds.layout).side_files:
        return target if target is not None else ds.config.target_path
    raise ValueError(
        f"{ds.root}: no {formats.DATA_CONFIG_FILE} with target_path records which model these hidden "
        "states came from; pass --target (the model folder or hub id)"
    )
