"""Train an EAGLE-3 drafter (`eaglet train`).

One entry, `train(dataset_dir, out_dir, target=None, ...)`. Offline (the default) it reads stored
hidden states in any layout `eaglet check` accepts (eaglet's v1, speculators' flat v1 and
hs_*.safetensors, SpecForge .ckpt[.gz]); online (`online=True`) it reads an `eaglet prepare`
output and runs the target inside the loop, with extract.py's capture code, to make the same
hidden states on the fly. Either way the loop sees one `Source`. It checks that the data and the
target agree, builds the draft vocabulary from the data's token frequencies, and trains with
AdamW (fp32 master weights, optional bf16 autocast), warmup + cosine, grad clipping and
accumulation, over length-bucketed batches. Every `eval_every` steps it measures per-TTT-step
accuracy on a held-out split and keeps the checkpoint with the best simulated acceptance length.

Data order is a pure function of (seed, epoch), and a checkpoint records the position in it, so
`resume=True` continues exactly. Under `torchrun` each process takes every W-th micro-batch of
the same global order (DDP averages the gradients), so W processes with accumulation A match
one process with accumulation A*W.

Layout of `out_dir`: `metrics.jsonl`, `checkpoints/step_XXXXXXXX/{model.safetensors,
config.json, training_state.pt}`, `checkpoints/latest.json`, `checkpoints/best.json`.
"""

from __future__ import annotations

import contextlib
import copy
import fcntl
import gc
import hashlib
import json
import logging
import math
import os
import random
import shutil
import socket
import sys
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from eaglet import formats, ranges
from eaglet.draft_model import (DEFAULT_TTT_STEPS, STAT_ROWS, DraftConfig, Eagle3Draft, Teacher, build_draft_vocab,
                                load_embeddings_from, make_teacher, num_parameters, stats_summary, teacher_from_top_k,
                                ttt_loss)

log = logging.getLogger(__name__)

CHECKPOINTS_DIR = "checkpoints"
METRICS_FILE = "metrics.jsonl"
MODEL_FILE = formats.DRAFTER_WEIGHTS_FILE
STATE_FILE = "training_state.pt"
LATEST_FILE = "latest.json"
BEST_FILE = "best.json"
BUCKET_BATCHES = 64  # length-sorting window, in batches: near-uniform padding, still shuffled
DEFAULT_EVALS = 10  # held-out evaluations over a schedule when --eval-every is not given
BUDGET_WARMUP_STEPS = 25  # default warmup under --time-budget (the schedule's length is not known yet)
LOSS_ON = ("assistant", "all")
LM_HEAD_INITS = ("random", "target")
REQUIRED_DATA_FIELDS = ("hidden_size", "vocab_size", "layer_ids", "last_hidden_state", "target_revision")


@dataclass
class TrainConfig:
    epochs: float = 1.0  # length of the schedule when `total_steps` is not given
    total_steps: int | None = None  # optimizer steps of the schedule (overrides epochs)
    stop_after: int | None = None  # end this run at this step (the schedule is unchanged; resume later)
    lr: float = 2e-3  # batch 1; bench/train_efficiency.py "learning"
    min_lr_ratio: float = 0.0  # cosine decays to lr * min_lr_ratio
    warmup_steps: int | None = None  # default: 2% of the schedule, at least 1
    weight_decay: float = 0.0
    max_grad_norm: float = 0.5
    batch_size: int = 1  # samples per micro-batch, per process
    grad_accum: int = 1  # micro-batches per optimizer step, per process
    max_length: int | None = None  # truncate samples to this many tokens
    ttt_steps: int = DEFAULT_TTT_STEPS
    ttt_ramp: float = 0.0  # over this fraction of the schedule the unroll grows from 1 step to ttt_steps
    draft_vocab_size: int | None = None  # default min(8192, target vocab)
    teacher_top_k: int | None = 16  # keep the teacher's top-k draft ids, computed once per sample (0/None: dense)
    loss_on: str = "all"  # positions the loss uses: every real token, or assistant tokens only
    feature_loss_weight: float = 0.0  # EAGLE-1 regression of the target's next last-layer state
    lm_head_init: str = "random"  # or "target": the target's LM head rows and final norm
    freeze_lm_head: bool = False  # keep the LM head (and final norm) as initialised
    fc_norm: bool = False
    norm_output: bool = False
    norm_before_residual: bool = False  # speculators' default drafter layout (residual = hidden_norm(g))
    sliding_window: int | None = None  # the drafter attends to the last W positions (speculators' default 2048)
    bf16: bool | None = None  # autocast the drafter's forward to bf16 (None: where fast, see target.fast_bf16)
    time_budget: float | None = None  # seconds of training: the schedule is sized to fit, measured on the fly
    eval_fraction: float = 0.05
    eval_every: int | None = None  # default: `evals` evaluations over the schedule
    evals: int = DEFAULT_EVALS  # held-out evaluations over the schedule when eval_every is not given
    save_every: int | None = None  # default: with every evaluation
    log_every: int = 10
    keep_checkpoints: int = 2  # newest step checkpoints kept, besides the best one
    seed: int = 0
    device: str | None = None
    # Where the hidden states come from. Offline (default): a stored dataset in any layout `eaglet
    # check` accepts. Online: the target runs inside the loop on an `eaglet prepare` output.
    online: bool = False
    target_dtype: str = "auto"  # online: compute dtype of the target (its states are used in it as is)
    aux_layer_ids: list[int] | None = None  # online: layers to capture; offline: what a foreign dataset holds
    last_hidden_state: str | None = None  # a foreign dataset's last state, pre_norm or post_norm

    # Options that define the trajectory: a resumed run must use the same ones.
    TRAJECTORY = ("epochs", "total_steps", "lr", "min_lr_ratio", "warmup_steps", "weight_decay", "max_grad_norm",
                  "batch_size", "max_length", "ttt_steps", "ttt_ramp", "draft_vocab_size", "teacher_top_k", "loss_on",
                  "feature_loss_weight", "lm_head_init", "freeze_lm_head", "fc_norm", "norm_output",
                  "norm_before_residual", "sliding_window", "bf16",
                  "time_budget", "eval_fraction", "seed")

    # Numeric options and what they may be (None: the option's default applies).
    AT_LEAST_ONE = ("total_steps", "stop_after", "batch_size", "grad_accum", "max_length", "ttt_steps",
                    "draft_vocab_size", "sliding_window", "eval_every", "evals", "save_every", "log_every")
    AT_LEAST_ZERO = ("warmup_steps", "keep_checkpoints", "weight_decay", "feature_loss_weight")
    ABOVE_ZERO = ("epochs", "lr", "max_grad_norm")

    def __post_init__(self) -> None:
        ranges.at_least(1, **{k: getattr(self, k) for k in self.AT_LEAST_ONE})
        ranges.at_least(0, **{k: getattr(self, k) for k in self.AT_LEAST_ZERO})
        ranges.above(0, **{k: getattr(self, k) for k in self.ABOVE_ZERO}, time_budget=self.time_budget)
        ranges.within(0, 1, "the share of samples held out", high_open=True, eval_fraction=self.eval_fraction)
        ranges.within(0, 1, min_lr_ratio=self.min_lr_ratio)
        ranges.within(0, 1, "a fraction of the schedule", high_open=True, ttt_ramp=self.ttt_ramp)
        if self.loss_on not in LOSS_ON:
            raise ValueError(f"--loss-on {self.loss_on!r}: choose one of {list(LOSS_ON)}")
        if self.lm_head_init not in LM_HEAD_INITS:
            raise ValueError(f"--lm-head-init {self.lm_head_init!r}: choose one of {list(LM_HEAD_INITS)}")
        if self.freeze_lm_head and self.lm_head_init != "target":
            raise ValueError("--freeze-lm-head keeps the LM head as initialised: it needs --lm-head-init target")
        if self.teacher_top_k is not None and self.teacher_top_k < 0:
            raise ValueError(f"--teacher-top-k {self.teacher_top_k}: must be >= 1, or 0 for the dense teacher")
        if self.teacher_top_k == 0:
            self.teacher_top_k = None  # one spelling of "dense" in train_config.json
        if self.time_budget is not None and self.total_steps is not None:
            raise ValueError("--time-budget sizes the schedule itself: give it or --total-steps, not both")
        if self.max_length is not None and self.max_length < min_sample_tokens(self.ttt_steps):
            raise ValueError(f"--max-length {self.max_length}: TTT step k at position t predicts token t+k+2, so "
                             f"with --ttt-steps {self.ttt_steps} a sample needs at least "
                             f"{min_sample_tokens(self.ttt_steps)} tokens for every step to train on one position; "
                             f"use --max-length {min_sample_tokens(self.ttt_steps)} or more")

    def ttt_steps_at(self, step: int, total_steps: int) -> int:
        """The unroll length at this optimizer step: ttt_steps, or growing 1..ttt_steps over the ramp."""
        ramp = self.ttt_ramp * total_steps
        if ramp <= 0 or step >= ramp:
            return self.ttt_steps
        return min(self.ttt_steps, 1 + int(self.ttt_steps * step / ramp))

    def trajectory(self, world: int) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.TRAJECTORY}
        d["global_accum"] = self.grad_accum * world  # W processes x A equals 1 process x A*W
        return d


def min_sample_tokens(ttt_steps: int) -> int:
    """The shortest sample that gives every TTT step a position: step k at t predicts t+k+2."""
    return ttt_steps + 2


# ---------------------------------------------------------------------------------------------
# Dataset: checks, split, batches
# ---------------------------------------------------------------------------------------------

@dataclass
class Dataset:
    """A hidden-state dataset on disk, in any layout `eaglet check` accepts, ready to train on."""

    root: Path
    config: dict[str, Any]  # data_config.json (empty for a foreign dataset without one) + the inferred hidden_size
    files: dict[int, Path]
    lengths: dict[int, int]
    token_freq: dict[int, int]
    layout: str = formats.FORMAT_V1
    aux_layer_ids: list[int] = field(default_factory=list)  # hidden_states ids of the three aux states
    last_hidden_state: str = formats.LAST_STATE_PRE_NORM  # whether the stored last state is before the final norm
    hidden_dtype: str = "bfloat16"  # dtype of the stored aux states
    stored_top_k: int | None = None  # a compact dataset's teacher: the target's top-K it stores


def data_config(root: Path) -> dict[str, Any]:
    path = root / formats.DATA_CONFIG_FILE
    return formats.read_json(path) if path.exists() else {}


def no_files_message(root: Path) -> str:
    hint = ("; this is an `eaglet prepare` output: train on it with --online, or run `eaglet extract` on it first"
            if (root / formats.PREPARE_CONFIG_FILE).exists() else "")
    return (f"{root}: no hidden-state files (hidden_states/rows_*/data_*.pt, data_*.pt, rows_*/data_*.ckpt[.gz] or "
            f"hs_*.safetensors) and no {formats.DATA_CONFIG_FILE}; not an `eaglet extract`, speculators or "
            f"SpecForge dataset{hint}")


def check_v1_config(root: Path, cfg: dict[str, Any]) -> None:
    """eaglet's own layout always has a complete data_config.json: refuse one that is missing or short."""
    if not cfg:
        raise FileNotFoundError(f"{root}: no {formats.DATA_CONFIG_FILE}; not an `eaglet extract` dataset "
                                "(or extraction has not started)")
    missing = [k for k in REQUIRED_DATA_FIELDS if k not in cfg]
    if missing:
        raise ValueError(f"{root / formats.DATA_CONFIG_FILE}: missing field(s) {missing}")


def resolve_aux_layer_ids(root: Path, cfg: dict[str, Any], given: list[int] | None) -> list[int]:
    """The aux ids from data_config.json's layer_ids, else from --aux-layer-ids. Never guessed:
    an off-by-one layer id trains a drafter that silently never gets accepted."""
    where = root / formats.DATA_CONFIG_FILE
    recorded = cfg.get("layer_ids")
    if recorded is not None:
        if len(recorded) != 4:
            raise ValueError(f"{where}: layer_ids {recorded}: EAGLE-3 needs 3 aux ids and the last layer id")
        if "num_hidden_layers" in cfg and recorded[-1] != cfg["num_hidden_layers"]:
            raise ValueError(f"{where}: last layer id {recorded[-1]} != num_hidden_layers "
                             f"{cfg['num_hidden_layers']}; the teacher needs the last layer's state")
        if given is not None and list(given) != recorded[:-1]:
            raise ValueError(f"--aux-layer-ids {list(given)}: {where} records aux ids {recorded[:-1]}")
        return list(recorded[:-1])
    if given is None:
        raise ValueError(f"{root}: no {formats.DATA_CONFIG_FILE} with layer_ids, so which target layers the three "
                         "stored aux states come from is not recorded; pass --aux-layer-ids (EAGLE-3's default for "
                         "an N-layer target is 2,N//2,N-3 in hidden_states ids, which SpecForge's hooks on layers "
                         "1,N//2-1,N-4 also produce; `eaglet check DIR --target T` names the layer of each slot)")
    if len(given) != 3:
        raise ValueError(f"--aux-layer-ids {list(given)}: EAGLE-3 fuses exactly 3 aux states")
    return list(given)


def resolve_last_state(root: Path, cfg: dict[str, Any], given: str | None, layout: str) -> str:
    """pre_norm or post_norm: recorded in data_config.json, else --last-hidden-state, else the
    layout's convention (the one `eaglet check` assumes: post-norm for SpecForge, else pre-norm)."""
    from eaglet.check import default_last_convention

    recorded = cfg.get("last_hidden_state")
    if recorded is not None and given is not None and recorded != given:
        raise ValueError(f"--last-hidden-state {given}: {root / formats.DATA_CONFIG_FILE} records {recorded!r}")
    value = recorded or given or default_last_convention(layout)
    if value not in formats.LAST_STATE_CONVENTIONS:
        raise ValueError(f"{root}: last_hidden_state is {value!r}; training knows "
                         f"{list(formats.LAST_STATE_CONVENTIONS)} (with {formats.LAST_STATE_PRE_NORM!r} it applies the target's final norm itself)")
    return value


def scan_tokens(root: Path, files: dict[int, Path], layout: str,
                show_progress: bool) -> tuple[dict[int, int], dict[int, int]]:
    """(lengths, masked-token frequencies) read from the files themselves, for a dataset that has
    no sample_lengths.json / token_freq.pt. Reads input_ids and loss_mask only."""
    from concurrent.futures import ThreadPoolExecutor

    from tqdm import tqdm

    def read(i: int) -> tuple[int, int, torch.Tensor, torch.Tensor]:
        """(index, length, masked token ids, their counts) of one file."""
        try:
            ids, mask = formats.read_sample_tokens(files[i], layout)
            return (i, len(ids), *ids[mask.bool()].unique(return_counts=True))
        except ValueError:
            raise  # the format readers' own messages already name the file and the field
        except Exception as e:  # a corrupt file: point at the full report rather than a bare traceback
            raise ValueError(f"{files[i]}: cannot read input_ids / loss_mask ({type(e).__name__}: {e}); "
                             f"`eaglet check {root}` reports every problem") from e

    lengths: dict[int, int] = {}
    freq: dict[int, int] = {}
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        for i, n, toks, counts in tqdm(pool.map(read, sorted(files)), total=len(files), desc="read token ids",
                                       unit="file", file=sys.stderr, dynamic_ncols=True, disable=not show_progress):
            lengths[i] = n
            for tok, c in zip(toks.tolist(), counts.tolist()):
                freq[tok] = freq.get(tok, 0) + c
    return lengths, freq


def side_data(root: Path, files: dict[int, Path], layout: str,
              show_progress: bool) -> tuple[dict[int, int], dict[int, int]]:
    """Sample lengths and token frequencies from sample_lengths.json / token_freq.pt. eaglet's own
    layout must have both; a foreign dataset may lack them, and then they are computed from its files."""
    lengths_path, freq_path = root / formats.SAMPLE_LENGTHS_FILE, root / formats.TOKEN_FREQ_FILE
    lengths = formats.read_sample_lengths(lengths_path) if lengths_path.exists() else None
    freq = formats.read_token_freq(freq_path) if freq_path.exists() else None
    own = layout in formats.EAGLET_LAYOUTS  # eaglet's layouts always have both
    if own and freq is None:
        raise FileNotFoundError(f"{root}: no {formats.TOKEN_FREQ_FILE}; the draft vocabulary is built from it")
    if own and lengths is None:
        lengths = {}  # reported below as lengths missing for every sample
    if lengths is None or freq is None:
        missing = [p.name for p, v in ((lengths_path, lengths), (freq_path, freq)) if v is None]
        log.info("%s has no %s: reading the token ids and loss masks of its %d files to compute them "
                 "(the draft vocabulary comes from masked-token frequencies, length bucketing from lengths)",
                 root, " / ".join(missing), len(files))
        scanned_lengths, scanned_freq = scan_tokens(root, files, layout, show_progress)
        lengths = scanned_lengths if lengths is None else lengths
        freq = scanned_freq if freq is None else freq
    if not set(files) <= set(lengths):
        raise ValueError(f"{lengths_path}: lengths missing for {len(set(files) - set(lengths))} sample(s)")
    return {i: lengths[i] for i in files}, freq


def open_dataset(root: str | Path, aux_layer_ids: list[int] | None = None, last_hidden_state: str | None = None,
                 show_progress: bool = False) -> Dataset:
    """Open a hidden-state dataset in any layout `eaglet check` accepts, cross-check what it records
    against its files, and refuse one that is incomplete or inconsistent. eaglet's v1 layout must
    have all its side files; a foreign one (flat v1, SpecForge, hs_*.safetensors) may lack them."""
    root = Path(root)
    cfg = data_config(root)
    listing = formats.list_dataset_files(root, int(cfg.get("rows_per_folder", formats.ROWS_PER_FOLDER)))
    layout = listing.format
    if layout is None and not cfg:
        raise FileNotFoundError(no_files_message(root))
    if layout in (None, formats.FORMAT_V1):
        layout = formats.FORMAT_V1
        check_v1_config(root, cfg)
        files = formats.list_v1_files(root)
        if not files:
            raise FileNotFoundError(f"{root}: no {formats.HIDDEN_STATES_DIR}/rows_*/data_*.pt files")
    else:
        if layout == formats.FORMAT_COMPACT:
            check_v1_config(root, cfg)
        files = dict(listing.files)
        if len(files) != len(listing.files):
            raise ValueError(f"{root}: {len(listing.files) - len(files)} duplicate sample indices; "
                             f"`eaglet check {root}` lists them")
    version_problem = formats.compact_version_problem(cfg) if layout == formats.FORMAT_COMPACT else None
    if version_problem:
        raise ValueError(f"{root / formats.DATA_CONFIG_FILE}: {version_problem}")
    if layout == formats.FORMAT_SPECULATORS_ARROW:  # a file per row of its table, and no other
        rows = len(formats.read_speculators_rows(root))
        unpaired = [f"no file for row(s) {gaps[:10]}" for gaps in [sorted(set(range(rows)) - set(files))] if gaps]
        unpaired += [f"file(s) {extra[:10]} beyond them" for extra in [sorted(set(files) - set(range(rows)))] if extra]
        if unpaired:
            raise ValueError(f"{root}: its Arrow table has {rows} rows; {', '.join(unpaired)}: finish `eaglet "
                             f"extract`, or `eaglet check {root}` for the full report")
    expected = cfg.get("num_samples")
    if expected is not None and len(files) != expected:
        raise ValueError(f"{root}: {len(files)} sample files, {formats.DATA_CONFIG_FILE} says {expected}; "
                         "finish (or rerun) `eaglet extract` first")
    aux_ids = resolve_aux_layer_ids(root, cfg, aux_layer_ids)
    last_state = resolve_last_state(root, cfg, last_hidden_state, layout)
    lengths, freq = side_data(root, files, layout, show_progress)
    first_path = files[min(files)]
    first = formats.read_training_sample(first_path, layout)
    hidden = cfg.get("hidden_size", first.aux_hidden.shape[-1] // 3)
    last = first.last_hidden if first.last_hidden is not None else first.teacher.ids  # the teacher's rows: [T, K]
    shapes = (tuple(first.aux_hidden.shape), tuple(last.shape))
    want = ((lengths[min(files)], 3 * hidden), (lengths[min(files)], hidden if first.teacher is None else last.shape[1]))
    if shapes != want:
        raise ValueError(f"{first_path}: hidden_states shapes aux {shapes[0]}, last {shapes[1]}; "
                         f"{formats.DATA_CONFIG_FILE} / sample lengths imply {want[0]}, {want[1]}")
    from eaglet.target import dtype_name

    dtype = cfg.get("hidden_states_dtype") if layout == formats.FORMAT_COMPACT else dtype_name(first.aux_hidden.dtype)
    return Dataset(root, {**cfg, "hidden_size": hidden}, files, lengths, freq, layout, aux_ids, last_state, dtype,
                   first.teacher.ids.shape[1] if first.teacher is not None else None)


def check_stored_teacher(ds: Dataset, cfg: TrainConfig) -> None:
    """A compact dataset keeps the target's top-K instead of the last state: what needs the last
    state, or more of the teacher than K, cannot train on it."""
    if ds.stored_top_k is None:
        return
    if cfg.teacher_top_k is None or cfg.teacher_top_k > ds.stored_top_k:
        raise ValueError(f"--teacher-top-k {cfg.teacher_top_k or 0}: {ds.root} stores the target's top "
                         f"{ds.stored_top_k} only (compact layout); use --teacher-top-k 1..{ds.stored_top_k}, or "
                         "train on a v1 copy for the dense teacher")
    if cfg.feature_loss_weight:
        raise ValueError(f"--feature-loss-weight: {ds.root} is compact and keeps no last-layer state to regress")


def refuse_unclean_dataset(root: str | Path) -> None:
    """Run `eaglet check` on every file (no target: schema, values, side files) and refuse to
    spend training time on a dataset it rejects, with the check's own messages."""
    from eaglet.check import check_dataset, problem_lines

    report = check_dataset(root, use_target=False)
    if not report.clean:
        raise ValueError(f"{root}: `eaglet check` rejects this dataset:\n" + "\n".join(problem_lines(report.errors, 5)))


def check_target_matches(data_cfg: dict[str, Any], target_cfg: Any, revision: str, name: str) -> None:
    """Refuse a target unlike the one the data came from (only what the dataset records is compared)."""
    for key, theirs in (("hidden_size", target_cfg.hidden_size), ("vocab_size", target_cfg.vocab_size),
                        ("target_revision", revision)):
        if key in data_cfg and data_cfg[key] != theirs:
            raise ValueError(f"target {name} has {key}={theirs!r}, the dataset was extracted with "
                             f"{data_cfg[key]!r} ({data_cfg.get('target', '?')}); pass the same --target")


def dataset_target(ds: Dataset, target: str | None) -> str | None:
    """--target, else the recorded target_path. eaglet's own layout falls back to the embedded default
    as every stage does; a foreign dataset that records no target must be told which one it is."""
    if target is not None or "target_path" in ds.config or ds.layout == formats.FORMAT_V1:
        return target if target is not None else ds.config.get("target_path")
    raise ValueError(f"{ds.root}: no {formats.DATA_CONFIG_FILE} with target_path records which model these hidden "
                     "states came from; pass --target (the model folder or hub id)")


def check_aux_layer_ids(aux: list[int], num_layers: int) -> None:
    """Three increasing ids of decoder-layer outputs, below the last layer (which feeds the teacher)."""
    if len(aux) != 3 or any(b <= a for a, b in zip(aux, aux[1:])) or aux[0] < 1 or aux[-1] >= num_layers:
        raise ValueError(f"aux layer ids {aux}: need 3 strictly increasing ids in 1..{num_layers - 1} for this "
                         f"{num_layers}-layer target (id k = output of decoder layer k-1)")


def split_indices(indices: list[int], eval_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Deterministic (train, held-out) split: a seeded shuffle of the sorted indices."""
    order = sorted(indices)
    random.Random(seed).shuffle(order)
    n_eval = min(max(1, round(eval_fraction * len(order))), len(order) - 1) if eval_fraction > 0 and len(order) > 1 else 0
    return sorted(order[n_eval:]), sorted(order[:n_eval])


def bucketed_batches(indices: list[int], lengths: dict[int, int], batch_size: int,
                     rng: random.Random | None) -> list[list[int]]:
    """Batches of similar length: shuffle, sort within windows of BUCKET_BATCHES batches, shuffle
    the batches. The number of batches depends only on len(indices), never on the shuffle."""
    order = list(indices)
    if rng is not None:
        rng.shuffle(order)
    window = batch_size * BUCKET_BATCHES
    batches = []
    for w in range(0, len(order), window):
        chunk = sorted(order[w:w + window], key=lambda i: (-lengths[i], i))
        batches += [chunk[b:b + batch_size] for b in range(0, len(chunk), batch_size)]
    if rng is not None:
        rng.shuffle(batches)
    return batches


class BatchStream:
    """The global sequence of micro-batches across epochs; micro-batch m is a pure function of m."""

    def __init__(self, indices: list[int], lengths: dict[int, int], batch_size: int, seed: int):
        self.indices, self.lengths, self.batch_size, self.seed = indices, lengths, batch_size, seed
        self.per_epoch = len(bucketed_batches(indices, lengths, batch_size, None))
        self._cache: tuple[int, list[list[int]]] | None = None

    def epoch(self, e: int) -> list[list[int]]:
        if self._cache is None or self._cache[0] != e:
            self._cache = (e, bucketed_batches(self.indices, self.lengths, self.batch_size,
                                               random.Random(self.seed * 1_000_003 + e)))
        return self._cache[1]

    def __getitem__(self, m: int) -> list[int]:
        return self.epoch(m // self.per_epoch)[m % self.per_epoch]


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, L] int64, right padded with 0
    aux_hidden: torch.Tensor  # [B, L, 3H]
    last_hidden: torch.Tensor | None  # [B, L, H] pre-norm (None: a compact dataset's stored teacher instead)
    loss_mask: torch.Tensor  # [B, L], 0 on padding
    lengths: list[int]  # real tokens per row
    indices: list[int] = field(default_factory=list)  # sample index per row
    teacher_ids: torch.Tensor | None = None  # [B, L, K] a compact dataset's stored top-K target ids
    teacher_log_probs: torch.Tensor | None = None  # [B, L, K] their log-probabilities

    @property
    def tokens(self) -> int:
        return sum(self.lengths)

    def real(self) -> torch.Tensor:
        """[B, L] bool: True on real tokens, False on padding."""
        L = self.input_ids.shape[1]
        return torch.arange(L, device=self.input_ids.device)[None, :] < torch.tensor(self.lengths,
                                                                                     device=self.input_ids.device)[:, None]

    def to(self, device: torch.device) -> Batch:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        return Batch(self.input_ids.to(device), self.aux_hidden.to(device), move(self.last_hidden),
                     self.loss_mask.to(device), self.lengths, self.indices, move(self.teacher_ids),
                     move(self.teacher_log_probs))


class Prefetcher:
    """Loads micro-batches in a background thread, one ahead, so disk reads overlap compute.
    With `background=False` it loads on the caller's thread: an online batch runs the target on
    the training device, where loading ahead would only hold one more batch of activations."""

    def __init__(self, load: Any, background: bool = True):
        from concurrent.futures import ThreadPoolExecutor

        self.load, self.pending = load, {}
        self.pool = ThreadPoolExecutor(max_workers=1) if background else None

    def get(self, key: int, next_key: int | None) -> Any:
        if self.pool is None:
            return self.load(key)
        fut = self.pending.pop(key, None) or self.pool.submit(self.load, key)
        if next_key is not None and next_key not in self.pending:
            self.pending[next_key] = self.pool.submit(self.load, next_key)
        return fut.result()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)


def collate(samples: list[formats.TrainingSample], max_length: int | None, indices: list[int] | None = None) -> Batch:
    """Right-padded batch, zeros past each sample's end, on the samples' device. Under causal
    attention a real token never sees padding on its right."""
    lens = [min(len(s.input_ids), max_length or len(s.input_ids)) for s in samples]
    first = samples[0]
    B, L, dev = len(samples), max(lens), first.aux_hidden.device

    def padded(get: Callable[[formats.TrainingSample], torch.Tensor | None]) -> torch.Tensor | None:
        """[B, L, ...] of one field, zeros past each sample's end (None when the samples lack it)."""
        if get(first) is None:
            return None
        out = torch.zeros(B, L, *get(first).shape[1:], dtype=get(first).dtype, device=dev)
        for row, (s, n) in enumerate(zip(samples, lens)):
            out[row, :n] = get(s)[:n]
        return out

    return Batch(padded(lambda s: s.input_ids).long(), padded(lambda s: s.aux_hidden),
                 padded(lambda s: s.last_hidden), padded(lambda s: s.loss_mask).long(), lens, list(indices or []),
                 padded(lambda s: s.teacher and s.teacher.ids), padded(lambda s: s.teacher and s.teacher.log_probs))


def load_batch(files: dict[int, Path], indices: list[int], max_length: int | None,
               layout: str = formats.FORMAT_V1) -> Batch:
    """The micro-batch of these samples, read from files of a dataset in `layout`."""
    return collate([formats.read_training_sample(files[i], layout) for i in indices], max_length, indices)


# ---------------------------------------------------------------------------------------------
# Sources of micro-batches: stored hidden states (offline) or the target run in the loop (online)
# ---------------------------------------------------------------------------------------------

@dataclass
class Source:
    """What the training loop needs from its data, wherever the hidden states come from."""

    path: Path
    lengths: dict[int, int]  # sample index -> tokens (for the split and length bucketing)
    token_freq: dict[int, int]  # masked-token counts (for the draft vocabulary)
    aux_layer_ids: list[int]
    last_hidden_state: str
    hidden_dtype: str
    load: Callable[[list[int]], Batch]  # the right-padded micro-batch of these sample indices
    background: bool  # whether loads may run in a background thread (disk reads: yes; the target: no)
    stored_top_k: int | None = None  # a compact dataset: the teacher is its stored top-K, the aux states 6-bit
    layout: str = formats.FORMAT_V1  # the dataset's layout; "prepared" online

    def identity(self) -> dict[str, Any]:
        """What the batches hold; a resumed run must get the same (offline or online alike)."""
        return {"aux_layer_ids": self.aux_layer_ids, "last_hidden_state": self.last_hidden_state,
                "hidden_dtype": self.hidden_dtype, "stored_top_k": self.stored_top_k}

    def fingerprint(self) -> dict[str, Any]:
        """Which data this is: its layout, sample count and a digest of every sample's length and
        of the masked-token counts. The path is kept for messages only: a moved copy of the same
        samples is the same data, a compact copy of them is not (other stored values)."""
        h = hashlib.sha256(json.dumps([sorted(self.lengths.items()), sorted(self.token_freq.items())]).encode())
        return {"path": str(self.path.resolve()), "layout": self.layout, "samples": len(self.lengths),
                "digest": h.hexdigest()[:16]}


PREPARED_LAYOUT = "prepared"  # an online source: an `eaglet prepare` output, the target run in the loop


def offline_source(ds: Dataset, max_length: int | None) -> Source:
    return Source(ds.root, ds.lengths, ds.token_freq, ds.aux_layer_ids, ds.last_hidden_state, ds.hidden_dtype,
                  lambda indices: load_batch(ds.files, indices, max_length, ds.layout), background=True,
                  stored_top_k=ds.stored_top_k, layout=ds.layout)


def open_prepared(root: str | Path) -> tuple[list[formats.TokenizedSample], dict[str, Any], dict[int, int]]:
    """(samples, prepare config, token frequencies) of an `eaglet prepare` output, for --online."""
    root = Path(root)
    if not (root / formats.PREPARE_CONFIG_FILE).exists():
        stored = (root / formats.DATA_CONFIG_FILE).exists() or formats.list_dataset_files(root).format is not None
        hint = "; it holds stored hidden states: train on it without --online" if stored else ""
        raise FileNotFoundError(f"{root}: no {formats.PREPARE_CONFIG_FILE}; --online trains on a finished "
                                f"`eaglet prepare` output{hint}")
    samples, pconfig = formats.read_prepared(root)
    freq_path = root / formats.TOKEN_FREQ_FILE
    if not freq_path.exists():
        raise FileNotFoundError(f"{root}: no {formats.TOKEN_FREQ_FILE} (the draft vocabulary is built from it); "
                                "rerun `eaglet prepare`, which writes it")
    return samples, pconfig, formats.read_token_freq(freq_path)


def truncate(sample: formats.TokenizedSample, max_length: int | None) -> formats.TokenizedSample:
    if max_length is None or len(sample.input_ids) <= max_length:
        return sample
    return formats.TokenizedSample(sample.sample_id, sample.input_ids[:max_length], sample.loss_mask[:max_length])


def online_source(root: Path, samples: list[formats.TokenizedSample], token_freq: dict[int, int],
                  model: nn.Module, layer_ids: list[int], device: torch.device, max_length: int | None) -> Source:
    """Batches whose hidden states the target computes on the fly, with extract.py's own capture
    code (hooks, padding, per-sample cut), so they hold what `eaglet extract` would have stored
    with this compute dtype; only the copy to disk and back is skipped."""
    from eaglet.extract import LayerCapture, run_batch
    from eaglet.target import decoder_layers, dtype_name

    capture = LayerCapture(decoder_layers(model), layer_ids)
    dtype = next(model.parameters()).dtype

    def load(indices: list[int]) -> Batch:
        batch = [truncate(samples[i], max_length) for i in indices]
        states = run_batch(model, capture, batch, device, dtype, out_device=device)
        return collate([formats.TrainingSample(torch.tensor(s.input_ids), torch.cat(h[:-1], dim=-1), h[-1],
                                               torch.tensor(s.loss_mask)) for s, h in zip(batch, states)], None,
                       indices)

    return Source(root, {i: len(s.input_ids) for i, s in enumerate(samples)}, token_freq, layer_ids[:-1],
                  formats.LAST_STATE_PRE_NORM, dtype_name(dtype), load, background=False, layout=PREPARED_LAYOUT)


# ---------------------------------------------------------------------------------------------
# Target pieces: embeddings (copied into the drafter), final norm + lm_head (the teacher)
# ---------------------------------------------------------------------------------------------

class TeacherHead(nn.Module):
    """The frozen target's final norm and LM head; nothing else of the target is kept."""

    def __init__(self, final_norm: nn.Module, lm_head: nn.Module):
        super().__init__()
        self.final_norm, self.lm_head = final_norm, lm_head
        self.requires_grad_(False)


def target_pieces(model: nn.Module) -> tuple[torch.Tensor, TeacherHead]:
    """(input embeddings, teacher head) of a Hugging Face causal LM."""
    from eaglet.target import base_model

    inner = base_model(model)
    norm = next((getattr(inner, n) for n in ("norm", "final_layernorm", "ln_f") if hasattr(inner, n)), None)
    if norm is None:
        raise ValueError(f"cannot find the final norm of {type(model).__name__}")
    return model.get_input_embeddings().weight.detach(), TeacherHead(norm, model.get_output_embeddings())


def fp32(module: nn.Module) -> nn.Module:
    """`module` itself when it is fp32 already (no second copy of a large LM head), else an fp32
    copy: the target running online in bf16 must stay bf16."""
    if all(p.dtype == torch.float32 for p in module.parameters()):
        return module
    return copy.deepcopy(module).float()


def make_teacher_head(model: nn.Module, last_hidden_state: str) -> TeacherHead:
    """The teacher in fp32 whatever the target's dtype; without the final norm when the stored
    last state is already normed (SpecForge stores it after the norm)."""
    _, head = target_pieces(model)
    norm = head.final_norm if last_hidden_state == formats.LAST_STATE_PRE_NORM else nn.Identity()
    return TeacherHead(fp32(norm), fp32(head.lm_head))


TEACHER_CACHE_MAX_BYTES = 4 << 30  # past this, sparse teachers are recomputed instead of kept


class TeacherSource:
    """The teacher of each micro-batch. Dense (top_k None): recomputed from the last state every
    time, as EAGLE-3 trains. Sparse: the target's top-k draft ids and their renormalised
    log-probabilities, computed once per sample (in fp32, one sample at a time, so a value never
    depends on what it was batched with and a resumed run sees the same numbers) and kept in
    memory: (4 + 4) * k + 1 bytes per token, where every later epoch would otherwise redo the
    target's full-vocabulary head (vocab x H multiply-adds per token)."""

    def __init__(self, head: TeacherHead, d2t: torch.Tensor, t2d: torch.Tensor, top_k: int | None,
                 features: bool, bf16: bool):
        self.head, self.d2t, self.t2d, self.top_k, self.features, self.bf16 = head, d2t, t2d, top_k, features, bf16
        self.cache: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.cached_bytes = 0

    def __call__(self, batch: Batch) -> Teacher:
        device = batch.input_ids.device
        if batch.teacher_ids is not None:  # a compact dataset stores the target's top-K: nothing to compute
            return teacher_from_top_k(batch.teacher_ids, batch.teacher_log_probs, self.d2t, self.t2d,
                                      self.top_k or batch.teacher_ids.shape[-1])
        if self.top_k is None:
            with autocast(device, self.bf16):  # the dense teacher runs in the drafter's compute dtype
                return make_teacher(batch.last_hidden, self.head.final_norm, self.head.lm_head, self.d2t, self.t2d,
                                    features=self.features)
        B, L = batch.input_ids.shape
        log_probs = torch.zeros(B, L, self.top_k, device=device)
        ids = torch.zeros(B, L, self.top_k, dtype=torch.long, device=device)
        in_draft = torch.zeros(B, L, dtype=torch.bool, device=device)
        for row, n in enumerate(batch.lengths):
            lp, top_ids, drafted = self.sample(batch, row)
            log_probs[row, :n], ids[row, :n], in_draft[row, :n] = lp, top_ids, drafted
        feats = self.head.final_norm(batch.last_hidden.float()) if self.features else None
        return Teacher(log_probs, ids[..., 0], in_draft, ids, feats)

    def sample(self, batch: Batch, row: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        index, n = (batch.indices[row] if batch.indices else None), batch.lengths[row]
        hit = self.cache.get(index) if index is not None else None
        if hit is not None and hit[0].shape[0] == n:
            return hit
        t = make_teacher(batch.last_hidden[row:row + 1, :n].float(), self.head.final_norm, self.head.lm_head,
                         self.d2t, self.t2d, top_k=self.top_k)
        hit = (t.log_probs[0], t.ids[0].to(torch.int32), t.in_draft[0])
        size = sum(x.numel() * x.element_size() for x in hit)
        if index is not None and self.cached_bytes + size <= TEACHER_CACHE_MAX_BYTES:
            self.cache[index] = hit
            self.cached_bytes += size
        return hit


def init_lm_head_from_target(draft: Eagle3Draft, head: TeacherHead, freeze: bool) -> None:
    """The target's LM head rows of the draft ids and its final norm (optionally frozen), so the
    drafter starts out speaking the target's output space."""
    norm_weight = getattr(head.final_norm, "weight", None)
    if norm_weight is None or tuple(norm_weight.shape) != tuple(draft.norm.weight.shape):
        raise ValueError(f"--lm-head-init target: the target's final norm ({type(head.final_norm).__name__}) has no "
                         f"weight of shape {tuple(draft.norm.weight.shape)} to copy")
    with torch.no_grad():
        draft.lm_head.weight.copy_(head.lm_head.weight[draft.draft_to_target_ids()].to(draft.lm_head.weight.dtype))
        draft.norm.weight.copy_(norm_weight.to(draft.norm.weight.dtype))
    if freeze:
        draft.lm_head.weight.requires_grad_(False)
        draft.norm.weight.requires_grad_(False)


def build_drafter(target_model: nn.Module, aux_layer_ids: list[int], token_freq: dict[int, int],
                  cfg: TrainConfig) -> Eagle3Draft:
    """A drafter shaped like the target's layers, with its embeddings (frozen), a draft vocab from
    the data and, with --lm-head-init target, the target's LM head rows and final norm."""
    torch.manual_seed(cfg.seed)
    dcfg = DraftConfig.from_target(target_model.config, aux_layer_ids, cfg.draft_vocab_size,
                                   fc_norm=cfg.fc_norm, norm_output=cfg.norm_output,
                                   norm_before_residual=cfg.norm_before_residual, sliding_window=cfg.sliding_window)
    draft = Eagle3Draft(dcfg)
    load_embeddings_from(draft, target_model.get_input_embeddings().weight)
    draft.set_draft_vocab(*build_draft_vocab(token_freq, dcfg.target_vocab_size, dcfg.draft_vocab_size))
    if cfg.lm_head_init == "target":
        init_lm_head_from_target(draft, target_pieces(target_model)[1], cfg.freeze_lm_head)
    return draft


# ---------------------------------------------------------------------------------------------
# Schedule, distributed helpers
# ---------------------------------------------------------------------------------------------

def lr_lambda(warmup: int, total: int, min_ratio: float):
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return f


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0

    def all_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            t = t.clone()
            dist.all_reduce(t)
        return t

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def from_main(self, value: int) -> int:
        """Rank 0's value on every rank (decisions made from timings must agree)."""
        if self.world == 1:
            return value
        t = torch.tensor([value if self.main else 0], dtype=torch.long, device=self.device_for_collectives())
        dist.broadcast(t, 0)
        return int(t.item())

    def device_for_collectives(self) -> torch.device:
        backend = dist.get_backend()
        return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def init_distributed(device: torch.device) -> Dist:
    """Join the process group when started by torchrun (WORLD_SIZE > 1)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Dist()
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return Dist(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")))


# ---------------------------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------------------------

def export_config(cfg: DraftConfig, extra: dict[str, Any]) -> dict[str, Any]:
    """The EAGLE-3 / SGLang `LlamaForCausalLMEagle3` config (the same as `eaglet export
    --format eagle` writes, so a checkpoint is also a valid eagle folder in fp32), plus
    eaglet's own record, which `load_checkpoint` reads."""
    return {**formats.build_eagle_config(cfg, "float32", None), "eaglet": {"draft_config": cfg.to_dict(), **extra}}


def checkpoint_name(step: int) -> str:
    """The folder of the checkpoint at `step`, under checkpoints/."""
    return f"step_{step:08d}"


def save_checkpoint(ckpt_root: Path, step: int, model: Eagle3Draft, config_json: dict[str, Any],
                    state: dict[str, Any]) -> Path:
    """Write a checkpoint folder under a temp name, then rename: a folder that exists is complete."""
    final = ckpt_root / checkpoint_name(step)
    if final.exists():  # the same step saved twice (an eval right at the end): replace it
        shutil.rmtree(final)
    with formats.atomic_dir(final) as tmp:
        formats.write_drafter_files(tmp, config_json, model.state_dict())
        torch.save(state, tmp / STATE_FILE)
    return final


def prune_checkpoints(ckpt_root: Path, keep: int, protect: set[str]) -> None:
    steps = sorted(p for p in ckpt_root.glob("step_*") if p.is_dir())
    for p in steps[:-keep] if keep > 0 else steps:
        if p.name not in protect:
            shutil.rmtree(p, ignore_errors=True)


def read_pointer(ckpt_root: Path, name: str) -> dict[str, Any] | None:
    path = ckpt_root / name
    return formats.read_json(path) if path.exists() else None


def load_draft_weights(model: Eagle3Draft, folder: Path) -> None:
    model.load_state_dict(formats.read_safetensors(folder / MODEL_FILE))


def load_checkpoint(folder: str | Path) -> Eagle3Draft:
    """A trained drafter from a checkpoint folder (config.json + model.safetensors), in eval mode."""
    folder = Path(folder)
    config = formats.read_json(folder / "config.json")
    if "eaglet" not in config:
        raise ValueError(f"{folder}/config.json: not an eaglet checkpoint (no 'eaglet' section)")
    draft = Eagle3Draft(DraftConfig(**config["eaglet"]["draft_config"]))
    load_draft_weights(draft, folder)
    return draft.eval()


def other_data_message(folder: Path, then: dict[str, Any] | None, now: dict[str, Any]) -> str | None:
    """Why a resume on `now` would continue on other data than the run's, or None when it is the
    same (a checkpoint from before fingerprints were recorded has nothing to compare)."""
    if then is None or all(then.get(k) == now[k] for k in ("layout", "samples", "digest")):
        return None
    return (f"--resume: {folder} was trained on {then['path']} ({then['layout']} layout, {then['samples']} samples); "
            f"{now['path']} is other data ({now['layout']} layout, {now['samples']} samples"
            f"{', other samples' if then['layout'] == now['layout'] else ''}), and the run's held-out split and best "
            "step would mix both: resume on the run's own dataset, or train into another --out")


def restore(folder: Path, draft: Eagle3Draft, opt: torch.optim.Optimizer, sched: Any,
            trajectory: dict[str, Any], data: dict[str, Any]) -> tuple[int, dict[str, Any], dict[str, Any]]:
    """Load weights, optimizer, scheduler and RNG from a checkpoint; (step, best, the saved
    training state) to continue from. Refuses other data (`data`: Source.fingerprint) or settings."""
    if not (folder / STATE_FILE).exists():
        raise FileNotFoundError(f"{folder.parent / LATEST_FILE}: names {folder.name}, which has no {STATE_FILE}; the "
                                "run folder was changed by hand: restore the checkpoint, or train into another --out")
    state = formats.torch_load_safe(folder / STATE_FILE)
    other = other_data_message(folder, state.get("data"), data)
    if other:
        raise ValueError(other)
    then = state["trajectory"]
    # A key an older checkpoint lacks was not recorded then: nothing to compare it with.
    diff = {k: (then[k], v) for k, v in trajectory.items() if k in then and then[k] != v}
    if diff:
        raise ValueError(f"--resume: {folder} was trained with other settings {{option: (then, now)}}: {diff}; "
                         "leave these options out (a resume takes the run's own) or train into another --out")
    load_draft_weights(draft, folder)
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])
    log.info("resumed from %s (step %d)", folder, state["step"])
    return state["step"], state["best"], state


# Options that belong to one invocation, not to the run: a resume does not take them from it.
PER_INVOCATION = ("stop_after", "device")


def resumed_options(out: Path) -> dict[str, Any]:
    """The TrainConfig options the run in `out` was started with ({} when it has no checkpoint yet).

    train_config.json holds every option (its total_steps and warmup_steps as the schedule sized them);
    the checkpoint's trajectory holds the trajectory options exactly as given."""
    ckpt_root = out / CHECKPOINTS_DIR
    latest = read_pointer(ckpt_root, LATEST_FILE)
    if latest is None or not (out / "train_config.json").exists():
        return {}
    names = {f.name for f in fields(TrainConfig)} - set(PER_INVOCATION)
    saved = formats.read_json(out / "train_config.json")
    trajectory = formats.torch_load_safe(ckpt_root / latest["path"] / STATE_FILE)["trajectory"]
    return {k: v for k, v in {**saved, **trajectory}.items() if k in names}


def truncate_metrics(path: Path, step: int) -> None:
    """Drop metric lines a killed run wrote after the checkpoint we resume from."""
    if not path.exists():
        return
    keep = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step]
    formats.write_text_atomic(path, "".join(line + "\n" for line in keep))


# ---------------------------------------------------------------------------------------------
# Metrics
# ---------------------------------------------------------------------------------------------

class MetricsLog:
    """metrics.jsonl (always) and TensorBoard (only when the `tensorboard` package is present)."""

    def __init__(self, out: Path, enabled: bool):
        self.path, self.enabled, self.tb = out / METRICS_FILE, enabled, None
        if not enabled:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter  # needs the `tensorboard` package

            self.tb = SummaryWriter(str(out / "tensorboard"))
        except ImportError:
            log.info("tensorboard is not installed; metrics go to %s only", self.path)

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        if self.tb is not None:
            split, step = record["split"], record["step"]
            for k, (loss, acc) in enumerate(zip(record["loss"], record["acc"])):
                if loss is not None:
                    self.tb.add_scalar(f"{split}/loss_{k}", loss, step)
                self.tb.add_scalar(f"{split}/acc_{k}", acc, step)
            self.tb.add_scalar(f"{split}/tau", record["tau"], step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


# ---------------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------------

@dataclass
class TrainSummary:
    out: Path
    step: int
    total_steps: int
    best_step: int | None
    best_tau: float | None
    last_eval: dict[str, Any] | None
    train_tokens: int
    seconds: float
    trainable_parameters: int
    extra: dict[str, Any] = field(default_factory=dict)

    def lines(self) -> list[str]:
        rate = self.train_tokens / self.seconds if self.seconds > 0 else 0.0
        out = [f"trained {self.step}/{self.total_steps} steps ({self.trainable_parameters:,} trainable parameters), "
               f"{self.train_tokens:,} tokens in {self.seconds:.1f} s ({rate:,.0f} tok/s)"]
        if self.last_eval:
            acc = " ".join(f"{a:.3f}" for a in self.last_eval["acc"])
            out.append(f"held-out: acc per TTT step [{acc}], simulated acceptance length {self.last_eval['tau']:.3f}")
        if self.best_step is not None:
            out.append(f"best checkpoint: step {self.best_step} (tau {self.best_tau:.3f}) in "
                       f"{self.out / CHECKPOINTS_DIR / checkpoint_name(self.best_step)}")
        return out


def autocast(device: torch.device, enabled: bool):
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled)


def forward_stats(model: nn.Module, teachers: TeacherSource, batch: Batch, cfg: TrainConfig, device: torch.device,
                  steps: int, loss_on: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Loss and per-step sums [STAT_ROWS, cfg.ttt_steps] of one micro-batch (model may be the DDP
    wrapper of the drafter); steps past `steps` (a TTT ramp) count nothing."""
    teacher = teachers(batch)
    positions = batch.loss_mask if loss_on == "assistant" else batch.real()
    with autocast(device, cfg.bf16):
        out = model(batch.input_ids, batch.aux_hidden.float(), steps=steps)
        loss, stats = ttt_loss(out, teacher, positions, feature_weight=cfg.feature_loss_weight)
    sums = torch.zeros(STAT_ROWS, cfg.ttt_steps, device=device)
    sums[:, :steps] = stats.as_tensor()
    return loss, sums


@torch.no_grad()
def evaluate(draft: Eagle3Draft, teachers: TeacherSource, load: Callable[[list[int]], Batch],
             batches: list[list[int]], cfg: TrainConfig, device: torch.device, d: Dist) -> dict[str, Any] | None:
    """Held-out per-step acceptance on assistant tokens, whatever positions the loss trains on."""
    if not batches:
        return None
    draft.eval()
    sums = torch.zeros(STAT_ROWS, cfg.ttt_steps, device=device)
    for b in batches[d.rank::d.world]:
        sums += forward_stats(draft, teachers, load(b).to(device), cfg, device, cfg.ttt_steps, "assistant")[1]
    draft.train()
    return stats_summary(d.all_sum(sums).cpu())


@dataclass
class Plan:
    """The schedule's length and cadence. Fixed from the options, or under --time-budget sized
    after the first steps from the measured tokens/s (recorded in checkpoints, so a resumed
    run keeps it)."""

    total_steps: int
    warmup: int
    eval_every: int
    save_every: int
    calibrated: bool = True

    @classmethod
    def make(cls, cfg: TrainConfig, total_steps: int, calibrated: bool) -> Plan:
        warmup = cfg.warmup_steps if cfg.warmup_steps is not None else (
            max(1, total_steps // 50) if cfg.time_budget is None else BUDGET_WARMUP_STEPS)
        eval_every = cfg.eval_every or max(1, total_steps // max(1, cfg.evals))
        return cls(total_steps, warmup, eval_every, cfg.save_every or eval_every, calibrated)


CALIBRATION_STEPS = 20  # under --time-budget, steps timed before the schedule is sized (fewer if the budget is short)
CALIBRATION_SKIP = 2  # first steps left out of the timing (one-time allocations and kernel setup)
UNSIZED_STEPS = 1 << 40  # the schedule's length before --time-budget has sized it


def budget_steps(budget: float, step: int, seconds_done: float, rate: float, tokens_per_step: float) -> int:
    """Total optimizer steps that fit `budget` seconds of training, `seconds_done` of them spent
    reaching `step`, at `rate` tokens/s."""
    left = max(0.0, budget - seconds_done)
    return step + max(1, int(left * rate / max(tokens_per_step, 1.0)))


LOCK_FILE = ".lock"


class RunFolderBusy(RuntimeError):
    """Another process holds the run folder's lock."""


@contextlib.contextmanager
def run_lock(out: Path, enabled: bool = True) -> Iterator[None]:
    """One writer per run folder: an exclusive lock on OUT/.lock for the whole run. The kernel
    drops it when the process ends, however it ends, so a killed run never leaves it stuck (a
    lock file that merely exists would). Only rank 0 writes, so only rank 0 takes it."""
    if not enabled:
        yield
        return
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    try:
        with locked_file(out / LOCK_FILE):
            yield
    finally:
        if created and [p.name for p in out.iterdir()] == [LOCK_FILE]:  # a run refused before writing anything
            shutil.rmtree(out, ignore_errors=True)


@contextlib.contextmanager
def locked_file(path: Path) -> Iterator[None]:
    """Hold an exclusive flock on `path`, which records the holder for the message of the next one."""
    out = path.parent
    with open(path, "a+", encoding="utf-8") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            raise RunFolderBusy(f"{out}: another `eaglet train` ({holder}) is writing this run folder; wait for it "
                                "to end, or train into another --out") from None
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        f.flush()
        yield  # closing the file at the end releases the lock


def train(dataset_dir: str | Path, out_dir: str | Path, target: str | None = None, resume: bool = False,
          show_progress: bool = True, command: str = "", **options: Any) -> TrainSummary:
    """Train a drafter on `dataset_dir` into `out_dir`; `options` are TrainConfig fields.
    `dataset_dir` holds stored hidden states, or with `online=True` an `eaglet prepare` output.
    The run folder has one writer at a time (`run_lock`)."""
    unknown = set(options) - {f.name for f in fields(TrainConfig)}
    if unknown:
        raise TypeError(f"unknown training option(s): {sorted(unknown)}")
    with run_lock(Path(out_dir), int(os.environ.get("RANK", "0")) == 0):
        return train_locked(dataset_dir, out_dir, target, resume, show_progress, command, **options)


def train_locked(dataset_dir: str | Path, out_dir: str | Path, target: str | None, resume: bool,
                 show_progress: bool, command: str, **options: Any) -> TrainSummary:
    """`train` with the run folder's lock held."""
    from tqdm import tqdm

    from eaglet.target import default_layer_ids, load_target, parse_dtype, pick_device, resolve_target

    out = Path(out_dir)
    ckpt_root = out / CHECKPOINTS_DIR
    if resume:  # the run's own settings, then the options given now (a differing trajectory one is refused below)
        options = {**resumed_options(out), **options}
    cfg = TrainConfig(**options)
    if int(os.environ.get("RANK", "0")) == 0:
        formats.remove_stale_temp_files(ckpt_root)  # checkpoint folders a kill left half-written
    if cfg.online:
        if cfg.last_hidden_state not in (None, formats.LAST_STATE_PRE_NORM):
            raise ValueError("--last-hidden-state: online, the last state is captured before the final norm (pre_norm)")
        samples, pconfig, token_freq = open_prepared(dataset_dir)
    else:
        ds = open_dataset(dataset_dir, cfg.aux_layer_ids, cfg.last_hidden_state,
                          show_progress and int(os.environ.get("RANK", "0")) == 0)
        refuse_unclean_dataset(dataset_dir)
        check_stored_teacher(ds, cfg)

    # Device and processes: under torchrun, one device per process.
    device = pick_device(cfg.device)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if device.type == "cuda" and world > 1:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    d = init_distributed(device)
    if cfg.bf16 is None:  # resolved here, so train_config.json and a resume see what ran
        from eaglet.target import fast_bf16

        cfg = replace(cfg, bf16=fast_bf16(device))

    if cfg.online:  # under torchrun every process runs its own copy of the target on its own device
        from eaglet.extract import prepared_target

        ref = prepared_target(dataset_dir, pconfig, target)
        tmodel = load_target(ref, parse_dtype(cfg.target_dtype, device), device)
        formats.check_prepared_token_ids(dataset_dir, samples, tmodel.config.vocab_size)  # else an IndexError at step N
        n = tmodel.config.num_hidden_layers
        aux_ids = cfg.aux_layer_ids or default_layer_ids(n)[:-1]
        check_aux_layer_ids(aux_ids, n)
        src = online_source(Path(dataset_dir), samples, token_freq, tmodel, [*aux_ids, n], device, cfg.max_length)
    else:
        ref = resolve_target(dataset_target(ds, target))
        tmodel = load_target(ref, torch.float32, torch.device("cpu"))
        check_target_matches(ds.config, tmodel.config, ref.revision, ref.name)
        check_aux_layer_ids(ds.aux_layer_ids, tmodel.config.num_hidden_layers)
        refuse_wrong_layer_ids(ds, tmodel)
        src = offline_source(ds, cfg.max_length)
    refuse_beyond_positions(src, cfg.max_length, tmodel)
    draft = build_drafter(tmodel, src.aux_layer_ids, src.token_freq, cfg).to(device)
    teacher_head = make_teacher_head(tmodel, src.last_hidden_state).to(device)
    dcfg = draft.config
    del tmodel  # offline nothing else of the target is kept; online the source holds it

    teachers = TeacherSource(teacher_head, draft.d2t, draft.t2d, cfg.teacher_top_k, cfg.feature_loss_weight > 0,
                             cfg.bf16)
    train_idx, eval_idx = split_indices(list(src.lengths), cfg.eval_fraction, cfg.seed)
    stream = BatchStream(train_idx, src.lengths, cfg.batch_size, cfg.seed)
    eval_batches = bucketed_batches(eval_idx, src.lengths, cfg.batch_size, None)
    micro_per_step = cfg.grad_accum * d.world
    epoch_steps = max(1, int(cfg.epochs * stream.per_epoch) // micro_per_step)
    # tokens of an average optimizer step, to turn a measured tokens/s into steps under --time-budget
    tokens_per_step = micro_per_step * cfg.batch_size * sum(
        min(src.lengths[i], cfg.max_length or src.lengths[i]) for i in train_idx) / max(1, len(train_idx))
    if cfg.time_budget is None:
        plan = Plan.make(cfg, cfg.total_steps or epoch_steps, calibrated=True)
    else:  # open-ended until the first steps are timed
        plan = Plan.make(cfg, UNSIZED_STEPS, calibrated=False)

    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_lambda(plan.warmup, plan.total_steps, cfg.min_lr_ratio)(s))
    step, best = 0, {"step": None, "tau": None}
    done = {"tokens": 0, "seconds": 0.0}  # training tokens and seconds so far (held-out evals and saves excluded)
    trajectory = {**cfg.trajectory(d.world), **src.identity()}
    data_fingerprint = src.fingerprint()
    refuse_too_short(src.lengths, train_idx, cfg)

    latest = read_pointer(ckpt_root, LATEST_FILE)
    if resume and latest:
        step, best, saved = restore(ckpt_root / latest["path"], draft, opt, sched, trajectory, data_fingerprint)
        if "plan" in saved:
            plan = Plan(**saved["plan"])
        done = saved.get("done", done)
    elif resume:
        log.info("--resume: no checkpoint in %s; starting from scratch", ckpt_root)
    elif latest and not resume:
        raise ValueError(f"{out} already holds a training run (checkpoint {latest['path']}); pass --resume to "
                         "continue it, or use another --out")
    if d.main:  # drop lines a killed run wrote after the checkpoint we start from (all, when from scratch)
        truncate_metrics(out / METRICS_FILE, step)
    d.barrier()

    model: nn.Module = draft
    if d.world > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(draft, device_ids=[device.index] if device.type == "cuda" else None, broadcast_buffers=False)

    if d.main:
        out.mkdir(parents=True, exist_ok=True)
        formats.write_json_atomic(out / "train_config.json", {
            **asdict(cfg), "world_size": d.world, "total_steps": plan.total_steps, "warmup_steps": plan.warmup,
            "dataset": str(src.path.resolve()), "target": ref.name, "target_revision": ref.revision,
            "train_samples": len(train_idx), "eval_samples": len(eval_idx), "command": command})
    metrics = MetricsLog(out, d.main)
    log.info("drafter: %s trainable parameters; %d train / %d held-out samples; %s (%d micro-batches of %d "
             "per step)", f"{num_parameters(draft):,}", len(train_idx), len(eval_idx),
             f"{plan.total_steps} steps" if plan.calibrated else f"steps sized to a {cfg.time_budget:.0f} s budget",
             micro_per_step, cfg.batch_size)

    def checkpoint(last_eval: dict[str, Any] | None) -> None:
        if not d.main:
            return
        rng = {"torch": torch.get_rng_state(), "python": random.getstate()}
        state = {"step": step, "micro_position": step * micro_per_step, "optimizer": opt.state_dict(),
                 "scheduler": sched.state_dict(), "rng": rng, "best": best, "trajectory": trajectory,
                 "plan": asdict(plan), "done": dict(done), "data": data_fingerprint}
        extra = {"step": step, "dataset": str(src.path.resolve()), "online": cfg.online, "target": ref.name,
                 "target_revision": ref.revision, "eval": last_eval}
        folder = save_checkpoint(ckpt_root, step, draft, export_config(dcfg, extra), state)
        # the pointers only after the folder they name is complete: a kill in between leaves the old ones
        formats.write_json_atomic(ckpt_root / LATEST_FILE, {"step": step, "path": folder.name})
        if best["step"] == step:
            formats.write_json_atomic(ckpt_root / BEST_FILE, {**best, "path": folder.name})
        protect = {folder.name} | ({checkpoint_name(best["step"])} if best["step"] is not None else set())
        prune_checkpoints(ckpt_root, cfg.keep_checkpoints, protect)

    def eval_and_track() -> dict[str, Any] | None:
        nonlocal best
        result = evaluate(draft, teachers, src.load, eval_batches, cfg, device, d)
        if result is None:
            return None
        metrics.write({"step": step, "split": "eval", "train_tokens": done["tokens"],
                       "train_seconds": round(done["seconds"], 3), **result})
        # an evaluation over no position measures nothing: it can never be the best
        improved = result["positions"][0] > 0 and (best["tau"] is None or result["tau"] > best["tau"])
        if improved:
            best = {"step": step, "tau": result["tau"]}  # best.json follows once its checkpoint is saved
        return result

    window = torch.zeros(STAT_ROWS, cfg.ttt_steps, device=device)
    window_tokens, last_eval = 0, None
    t0 = time.time()
    calib_from = {"step": step + CALIBRATION_SKIP, "tokens": 0, "seconds": 0.0}  # --time-budget: timing starts here

    def stop() -> int:
        return min(plan.total_steps, cfg.stop_after) if cfg.stop_after is not None else plan.total_steps

    bar = tqdm(total=stop() if plan.calibrated else None, initial=step, desc="train", unit="step", file=sys.stderr,
               dynamic_ncols=True, disable=not (show_progress and d.main))
    prefetch = Prefetcher(lambda m: src.load(stream[m]), background=src.background)
    draft.train()
    try:
        while step < stop():
            t_step = time.perf_counter()
            # the full unroll while --time-budget times the first steps: they set the schedule's length
            steps = cfg.ttt_steps_at(step, plan.total_steps) if plan.calibrated else cfg.ttt_steps
            step_sums = torch.zeros(STAT_ROWS, cfg.ttt_steps, device=device)
            step_tokens = 0
            for a in range(cfg.grad_accum):
                m = step * micro_per_step + a * d.world + d.rank  # every W-th micro-batch of the global order
                last_micro = step + 1 == stop() and a == cfg.grad_accum - 1
                batch = prefetch.get(m, None if last_micro else m + d.world).to(device)
                sync = a == cfg.grad_accum - 1 or d.world == 1
                with (contextlib.nullcontext() if sync else model.no_sync()):
                    loss, sums = forward_stats(model, teachers, batch, cfg, device, steps, cfg.loss_on)
                    refuse_non_finite(loss, step + 1, batch)
                    (loss / cfg.grad_accum).backward()
                step_sums += sums
                step_tokens += batch.tokens
            grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            bar.update(1)
            window += step_sums
            window_tokens += step_tokens
            done["tokens"] += int(d.all_sum(torch.tensor([step_tokens], device=device)).item())
            done["seconds"] += time.perf_counter() - t_step
            if step == calib_from["step"]:
                calib_from.update(tokens=done["tokens"], seconds=done["seconds"])
            timed = (step - calib_from["step"], done["tokens"] - calib_from["tokens"],
                     done["seconds"] - calib_from["seconds"])
            if not plan.calibrated and timed[0] > 0 and (timed[0] >= CALIBRATION_STEPS
                                                         or timed[2] >= 0.05 * cfg.time_budget):
                rate = timed[1] / max(timed[2], 1e-9)
                total = d.from_main(budget_steps(cfg.time_budget, step, done["seconds"], rate, tokens_per_step))
                plan = Plan.make(cfg, total, calibrated=True)  # the same schedule on every rank
                if cfg.warmup_steps is None:  # a short budget: warm up over at most 5% of it, never undoing steps done
                    plan.warmup = max(step, min(BUDGET_WARMUP_STEPS, total // 20))
                bar.reset(total=stop())
                bar.update(step)
                log.info("--time-budget %.0f s: %.0f tok/s over %d steps -> %d steps in all", cfg.time_budget, rate,
                         timed[0], plan.total_steps)
            if step % cfg.log_every == 0 or step == stop():
                tokens = int(d.all_sum(torch.tensor([window_tokens], device=device)).item())
                summary = stats_summary(d.all_sum(window).cpu())
                metrics.write({"step": step, "split": "train", "lr": sched.get_last_lr()[0],
                               "grad_norm": float(grad_norm), "tokens": tokens, "elapsed": time.time() - t0,
                               "train_tokens": done["tokens"], "train_seconds": round(done["seconds"], 3),
                               "ttt_steps": steps, **summary})
                bar.set_postfix(loss=f"{summary['loss'][0] or 0:.3f}", acc=f"{summary['acc'][0]:.3f}",
                                tau=f"{summary['tau']:.2f}", tok_s=f"{done['tokens'] / max(done['seconds'], 1e-9):.0f}")
                window.zero_()
                window_tokens = 0
            new_best = False
            if plan.calibrated and (step % plan.eval_every == 0 or step == stop()):
                prev_best = best["step"]
                last_eval = eval_and_track() or last_eval
                new_best = best["step"] != prev_best
            if plan.calibrated and (step % plan.save_every == 0 or step == stop() or new_best):
                checkpoint(last_eval)
                d.barrier()
    finally:
        prefetch.close()
        bar.close()
        metrics.close()
    if last_eval is None and eval_batches:
        last_eval = evaluate(draft, teachers, src.load, eval_batches, cfg, device, d)
    summary = TrainSummary(out, step, plan.total_steps, best["step"], best["tau"], last_eval, done["tokens"],
                           done["seconds"], num_parameters(draft))
    if d.world > 1:
        # DDP's reducer holds the gloo/NCCL group and its work objects in reference cycles; free them
        # while the interpreter is alive: freed at exit, a gloo thread can abort the process (SIGABRT)
        del model
        gc.collect()
        dist.destroy_process_group()
    return summary


def refuse_too_short(lengths: dict[int, int], train_idx: list[int], cfg: TrainConfig) -> None:
    """Training samples that give no TTT step a position would train on nothing and log NaN."""
    need = min_sample_tokens(1)
    if not any(min(lengths[i], cfg.max_length or lengths[i]) >= need for i in train_idx):
        raise ValueError(f"no training sample has {need} tokens or more (after --max-length "
                         f"{cfg.max_length}): step 0 predicts token t+2 from position t, so there is no position to "
                         "train on; use longer samples or a larger --max-length")


def refuse_beyond_positions(src: Source, max_length: int | None, model: nn.Module) -> None:
    """A sample longer than the target's positions holds states the target never makes in use
    (RoPE beyond its range): refuse it, naming the longest, rather than train on it."""
    from eaglet.decode import max_positions

    limit = max_positions(model)
    longest = max(src.lengths, key=lambda i: src.lengths[i])
    n = min(src.lengths[longest], max_length or src.lengths[longest])
    if n > limit:
        over = sum(min(v, max_length or v) > limit for v in src.lengths.values())
        raise ValueError(f"{src.path}: sample {longest} has {n} tokens and {over} sample(s) in all are longer than the "
                         f"target's {limit} positions (max_position_embeddings); pass --max-length {limit} or less, "
                         "or prepare the data again with such a --max-length")


def refuse_non_finite(loss: torch.Tensor, step: int, batch: Batch) -> None:
    """A NaN or infinite loss would poison the weights and every checkpoint after it: stop at once."""
    if not torch.isfinite(loss.detach()).all():
        raise FloatingPointError(f"step {step}: the loss is {loss.item()} on samples {batch.indices}; the weights "
                                 "before this step are in the last checkpoint: lower --lr or --max-grad-norm, and "
                                 "`eaglet check` the dataset for NaN/Inf states")


def refuse_wrong_layer_ids(ds: Dataset, model: nn.Module) -> None:
    """The check `eaglet check --target` makes of layer identity, on the dataset's first file:
    recorded layer ids that the stored states do not match are refused before any training."""
    from eaglet.check import layer_identity_problems

    n = model.config.num_hidden_layers
    first = ds.files[min(ds.files)]
    problems = layer_identity_problems(ds.root, ds.layout, first, model, [*ds.aux_layer_ids, n],
                                       ds.last_hidden_state)
    if problems:
        raise ValueError(f"{ds.root / formats.DATA_CONFIG_FILE}: layer_ids {[*ds.aux_layer_ids, n]} do not match "
                         f"the stored states ({'; '.join(p.message for p in problems[:3])}); an edited or wrong "
                         f"layer_ids trains a drafter that engines feed other layers: `eaglet check {ds.root} "
                         "--target T` for the full report, then re-extract or restore data_config.json")


def evaluate_heldout(drafter: str | Path, dataset_dir: str | Path, eval_fraction: float = 0.05, seed: int = 0,
                     ttt_steps: int | None = None, max_length: int | None = None, target: str | None = None,
                     bf16: bool | None = None, batch_size: int = 1, device: str | None = None) -> dict[str, Any]:
    """Per-step held-out acceptance of any drafter (a run folder, checkpoint or exported folder)
    on the held-out split that `eaglet train` makes of `dataset_dir` with this eval_fraction and
    seed: so drafters trained on other data are measured on the same samples."""
    from eaglet.export import load_drafter
    from eaglet.target import fast_bf16, load_target, pick_device, resolve_target

    dev = pick_device(device)
    bf16 = fast_bf16(dev) if bf16 is None else bf16
    ds = open_dataset(dataset_dir)
    draft = load_drafter(drafter).to(dev)
    ref = resolve_target(dataset_target(ds, target))
    head = make_teacher_head(load_target(ref, torch.float32, torch.device("cpu")), ds.last_hidden_state).to(dev)
    cfg = TrainConfig(ttt_steps=ttt_steps or DEFAULT_TTT_STEPS, bf16=bf16, batch_size=batch_size,
                      max_length=max_length, eval_fraction=eval_fraction, seed=seed)
    _, eval_idx = split_indices(list(ds.lengths), eval_fraction, seed)
    if not eval_idx:
        raise ValueError(f"{dataset_dir}: --eval-fraction {eval_fraction} holds out no sample")
    src = offline_source(ds, max_length)
    teachers = TeacherSource(head, draft.d2t, draft.t2d, None, False, bf16)
    batches = bucketed_batches(eval_idx, src.lengths, batch_size, None)
    return evaluate(draft, teachers, src.load, batches, cfg, dev, Dist())


def iter_metrics(out_dir: str | Path) -> Iterator[dict[str, Any]]:
    path = Path(out_dir) / METRICS_FILE
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)
