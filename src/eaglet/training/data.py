"""Opening any hidden-state dataset for training, and the micro-batches the loop trains on.

`open_dataset` reads a dataset in any layout `eaglet check` accepts (eaglet's v1 and compact,
speculators' flat v1 and hs_*.safetensors, SpecForge .ckpt[.gz]) and refuses one that is
incomplete or inconsistent; `open_prepared` reads an `eaglet prepare` output for --online.
Either becomes one `Source`. The split and the order of micro-batches are pure functions of the
seed (and the epoch), so a resumed run continues on the same batches. The `refuse_*` checks run
before any training step, so a run never spends time on data it cannot train on.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import random
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from eaglet import formats
from eaglet.options import CheckOptions
from eaglet.check import check_dataset, convention_hits, convention_problem, layer_identity_problems, problem_lines
from eaglet.dataset import Dataset, open_dataset
from eaglet.heads import TargetHeads
from eaglet.layers import config_positions
from eaglet.target import LayerCapture, decoder_layers, dtype_name, run_batch
from eaglet.training.config import TrainConfig, min_sample_tokens

if TYPE_CHECKING:  # transformers' modelling code loads only with a model
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)

BUCKET_BATCHES = 64  # length-sorting window, in batches: near-uniform padding, still shuffled
PACK_WINDOW = 256  # samples sorted and packed together: little padding, still shuffled


# ---------------------------------------------------------------------------------------------
# What training refuses before its first step
# ---------------------------------------------------------------------------------------------


def check_stored_teacher(ds: Dataset, cfg: TrainConfig) -> None:
    """A compact dataset keeps the target's top-K instead of the last state: what needs the last
    state, or more of the teacher than K, cannot train on it."""
    if ds.stored_top_k is None:
        return
    if cfg.teacher_top_k is None or cfg.teacher_top_k > ds.stored_top_k:
        raise ValueError(
            f"--teacher-top-k {cfg.teacher_top_k or 0}: {ds.root} stores the target's top "
            f"{ds.stored_top_k} only (compact layout); use --teacher-top-k 1..{ds.stored_top_k}, or "
            "train on a v1 copy for the dense teacher"
        )
    if cfg.feature_loss_weight:
        raise ValueError(f"--feature-loss-weight: {ds.root} is compact and keeps no last-layer state to regress")


def refuse_unclean_dataset(root: str | Path) -> None:
    """Run `eaglet check` on every file (no target: schema, values, side files) and refuse to
    spend training time on a dataset it rejects, with the check's own messages."""
    report = check_dataset(CheckOptions(path=root, use_target=False))
    if not report.clean:
        raise ValueError(f"{root}: `eaglet check` rejects this dataset:\n" + "\n".join(problem_lines(report.errors, 5)))


# ---------------------------------------------------------------------------------------------
# The split and the micro-batches
# ---------------------------------------------------------------------------------------------


def split_indices(indices: list[int], eval_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Deterministic (train, held-out) split: a seeded shuffle of the sorted indices."""
    order = sorted(indices)
    random.Random(seed).shuffle(order)
    n_eval = (
        min(max(1, round(eval_fraction * len(order))), len(order) - 1) if eval_fraction > 0 and len(order) > 1 else 0
    )
    return sorted(order[n_eval:]), sorted(order[:n_eval])


def bucketed_batches(
    indices: list[int], lengths: dict[int, int], batch_size: int, rng: random.Random | None
) -> list[list[int]]:
    """Batches of similar length: shuffle, sort within windows of BUCKET_BATCHES batches, shuffle
    the batches. The number of batches depends only on len(indices), never on the shuffle."""
    order = list(indices)
    if rng is not None:
        rng.shuffle(order)
    window = batch_size * BUCKET_BATCHES
    batches = []
    for w in range(0, len(order), window):
        chunk = sorted(order[w : w + window], key=lambda i: (-lengths[i], i))
        batches += [chunk[b : b + batch_size] for b in range(0, len(chunk), batch_size)]
    if rng is not None:
        rng.shuffle(batches)
    return batches


def packed_batches(
    indices: list[int], lengths: dict[int, int], budget: int, rng: random.Random | None
) -> list[list[int]]:
    """Packs of samples whose tokens (each cut to `budget`) add up to at most `budget`: shuffle,
    then first-fit decreasing within windows of PACK_WINDOW samples (a few percent of padding),
    then shuffle the packs. Unlike `bucketed_batches`, how many packs an epoch makes depends on
    its shuffle (`BatchStream` counts them per epoch)."""
    order = list(indices)
    if rng is not None:
        rng.shuffle(order)
    packs: list[list[int]] = []
    for w in range(0, len(order), PACK_WINDOW):
        room: list[int] = []
        window_packs: list[list[int]] = []
        for i in sorted(order[w : w + PACK_WINDOW], key=lambda i: (-lengths[i], i)):
            n = min(lengths[i], budget)
            slot = next((j for j, r in enumerate(room) if r >= n), None)
            if slot is None:
                window_packs.append([])
                room.append(budget)
                slot = len(room) - 1
            window_packs[slot].append(i)
            room[slot] -= n
        packs += window_packs
    if rng is not None:
        rng.shuffle(packs)
    return packs


class BatchStream:
    """The global sequence of micro-batches across epochs; micro-batch m is a pure function of m.
    With `pack_tokens`, a micro-batch is `batch_size` packs of samples (`packed_batches`; a list
    of rows of sample indices), else a bucket of `batch_size` samples of similar length."""

    def __init__(
        self, indices: list[int], lengths: dict[int, int], batch_size: int, seed: int, pack_tokens: int | None = None
    ):
        self.indices, self.lengths, self.batch_size, self.seed = indices, lengths, batch_size, seed
        self.pack_tokens = pack_tokens
        self._cache: tuple[int, list[Any]] | None = None
        self.starts = [0]  # micro-batch number where each epoch starts, as far as counted
        self.per_epoch = len(self.epoch(0))  # the first epoch's micro-batches (the schedule's unit)

    def make(self, rng: random.Random | None) -> list[Any]:
        if self.pack_tokens is not None:
            packs = packed_batches(self.indices, self.lengths, self.pack_tokens, rng)
            return [packs[b : b + self.batch_size] for b in range(0, len(packs), self.batch_size)]
        return bucketed_batches(self.indices, self.lengths, self.batch_size, rng)

    def epoch(self, e: int) -> list[Any]:
        if self._cache is None or self._cache[0] != e:
            self._cache = (e, self.make(random.Random(self.seed * 1_000_003 + e)))
        return self._cache[1]

    def __getitem__(self, m: int) -> Any:
        while self.starts[-1] <= m:  # count epochs up to the one holding m (packs vary per epoch)
            self.starts.append(self.starts[-1] + len(self.epoch(len(self.starts) - 1)))
        e = bisect.bisect_right(self.starts, m) - 1
        return self.epoch(e)[m - self.starts[e]]


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
    # Packed rows (`pack`): several samples one after another in each row.
    docs: list[list[int]] | None = None  # tokens of each sample of each row (None: one sample per row)
    documents: torch.Tensor | None = None  # [B, L] the sample's number within its row, -1 on padding
    positions: torch.Tensor | None = None  # [B, L] position within its sample (its RoPE position)

    @property
    def tokens(self) -> int:
        return sum(self.lengths)

    def segments(self) -> list[tuple[int, int, int, int | None]]:
        """(row, start, tokens, sample index) of every sample in the batch, in row order."""
        docs = self.docs if self.docs is not None else [[n] for n in self.lengths]
        out, k = [], 0
        for row, row_docs in enumerate(docs):
            start = 0
            for n in row_docs:
                out.append((row, start, n, self.indices[k] if self.indices else None))
                start, k = start + n, k + 1
        return out

    def real(self) -> torch.Tensor:
        """[B, L] bool: True on real tokens, False on padding."""
        L = self.input_ids.shape[1]
        return (
            torch.arange(L, device=self.input_ids.device)[None, :]
            < torch.tensor(self.lengths, device=self.input_ids.device)[:, None]
        )

    def to(self, device: torch.device) -> Batch:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        return Batch(
            self.input_ids.to(device),
            self.aux_hidden.to(device),
            move(self.last_hidden),
            self.loss_mask.to(device),
            self.lengths,
            self.indices,
            move(self.teacher_ids),
            move(self.teacher_log_probs),
            self.docs,
            move(self.documents),
            move(self.positions),
        )


class Prefetcher:
    """Loads micro-batches in a background thread, one ahead, so disk reads overlap compute.
    With `background=False` it loads on the caller's thread: an online batch runs the target on
    the training device, where loading ahead would only hold one more batch of activations."""

    def __init__(self, load: Any, background: bool = True):
        self.load = load
        self.pending: dict[int, Future] = {}
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


def assemble(
    samples: list[formats.TrainingSample],
    spans: list[tuple[int, int, int]],
    shape: tuple[int, int],
    indices: list[int] | None,
) -> Batch:
    """A [rows, length] batch with sample j's first n tokens at (row, start) for its span
    (row, start, n), zeros elsewhere, on the samples' device."""
    first = samples[0]
    rows, length = shape

    def placed(get: Callable[[formats.TrainingSample], torch.Tensor | None]) -> torch.Tensor | None:
        """[rows, length, ...] of one field (None when the samples lack it)."""
        kind = get(first)
        if kind is None:
            return None
        out = torch.zeros(rows, length, *kind.shape[1:], dtype=kind.dtype, device=first.aux_hidden.device)
        for s, (row, start, n) in zip(samples, spans):
            value = get(s)
            assert value is not None  # the samples of a batch hold the same fields
            out[row, start : start + n] = value[:n]
        return out

    def required(get: Callable[[formats.TrainingSample], torch.Tensor]) -> torch.Tensor:
        out = placed(get)
        assert out is not None
        return out

    lengths = [0] * rows
    for row, start, n in spans:
        lengths[row] = max(lengths[row], start + n)
    return Batch(
        required(lambda s: s.input_ids).long(),
        required(lambda s: s.aux_hidden),
        placed(lambda s: s.last_hidden),
        required(lambda s: s.loss_mask).long(),
        lengths,
        list(indices or []),
        placed(lambda s: s.teacher.ids if s.teacher is not None else None),
        placed(lambda s: s.teacher.log_probs if s.teacher is not None else None),
    )


def collate(samples: list[formats.TrainingSample], max_length: int | None, indices: list[int] | None = None) -> Batch:
    """Right-padded batch, one sample per row, zeros past each sample's end. Under causal
    attention a real token never sees padding on its right."""
    lens = [min(len(s.input_ids), max_length or len(s.input_ids)) for s in samples]
    return assemble(samples, [(row, 0, n) for row, n in enumerate(lens)], (len(samples), max(lens)), indices)


def pack(
    rows: list[list[formats.TrainingSample]],
    budget: int,
    indices: list[int] | None = None,
    max_length: int | None = None,
) -> Batch:
    """Rows of exactly `budget` tokens (one shape for every step, which a compiled step needs):
    each row's samples, each cut to `max_length` and `budget`, one after another, zeros after the
    last. `documents` and `positions` keep each sample apart in attention, RoPE and the loss.
    `indices` are the samples' indices, row after row."""
    docs = [[min(len(s.input_ids), max_length or budget, budget) for s in row] for row in rows]
    over = [r for r, d in enumerate(docs) if sum(d) > budget]
    if over:
        raise ValueError(f"samples {indices}: row {over[0]} holds {sum(docs[over[0]])} tokens, more than {budget}")
    spans = [(r, sum(d[:j]), n) for r, d in enumerate(docs) for j, n in enumerate(d)]
    batch = assemble([s for row in rows for s in row], spans, (len(rows), budget), indices)
    batch.docs = docs
    batch.documents = torch.full((len(rows), budget), -1, dtype=torch.long)
    batch.positions = torch.zeros(len(rows), budget, dtype=torch.long)
    number = [j for d in docs for j in range(len(d))]
    for (r, a, n), j in zip(spans, number):
        batch.documents[r, a : a + n] = j
        batch.positions[r, a : a + n] = torch.arange(n)
    return batch


def read_samples(
    files: dict[int, Path], indices: list[int], layout: str = formats.FORMAT_V1
) -> list[formats.TrainingSample]:
    """These samples, read from files of a dataset in `layout`."""
    return [formats.read_training_sample(files[i], layout) for i in indices]


def load_batch(
    files: dict[int, Path], indices: list[int], max_length: int | None, layout: str = formats.FORMAT_V1
) -> Batch:
    """The micro-batch of these samples, read from files of a dataset in `layout`."""
    return collate(read_samples(files, indices, layout), max_length, indices)


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
    hidden_dtype: str | None  # (None: a compact dataset that records none)
    read: Callable[[list[int]], list[formats.TrainingSample]]  # these samples, with their hidden states
    background: bool  # whether loads may run in a background thread (disk reads: yes; the target: no)
    max_length: int | None = None  # samples are cut to this many tokens
    stored_top_k: int | None = None  # a compact dataset: the teacher is its stored top-K, the aux states 6-bit
    layout: str = formats.FORMAT_V1  # the dataset's layout; "prepared" online

    def load(self, indices: list[int]) -> Batch:
        """The right-padded micro-batch of these samples, one per row."""
        return collate(self.read(indices), self.max_length, indices)

    def load_pack(self, rows: list[list[int]], budget: int) -> Batch:
        """These packs of samples, a row of `budget` tokens each (`pack`)."""
        flat = [i for row in rows for i in row]
        samples = iter(self.read(flat))
        return pack([[next(samples) for _ in row] for row in rows], budget, flat, self.max_length)

    def cut_lengths(self) -> dict[int, int]:
        """Tokens of each sample once cut to max_length."""
        return {i: min(n, self.max_length or n) for i, n in self.lengths.items()}

    def identity(self) -> dict[str, Any]:
        """What the batches hold; a resumed run must get the same (offline or online alike)."""
        return {
            "aux_layer_ids": self.aux_layer_ids,
            "last_hidden_state": self.last_hidden_state,
            "hidden_dtype": self.hidden_dtype,
            "stored_top_k": self.stored_top_k,
        }

    def fingerprint(self) -> dict[str, Any]:
        """Which data this is: its layout, sample count and a digest of every sample's length and
        of the masked-token counts. The path is kept for messages only: a moved copy of the same
        samples is the same data, a compact copy of them is not (other stored values)."""
        h = hashlib.sha256(json.dumps([sorted(self.lengths.items()), sorted(self.token_freq.items())]).encode())
        return {
            "path": str(self.path.resolve()),
            "layout": self.layout,
            "samples": len(self.lengths),
            "digest": h.hexdigest()[:16],
        }


PREPARED_LAYOUT = "prepared"  # an online source: an `eaglet prepare` output, the target run in the loop


def offline_source(ds: Dataset, max_length: int | None) -> Source:
    return Source(
        ds.root,
        ds.lengths,
        ds.token_freq,
        ds.aux_layer_ids,
        ds.last_hidden_state,
        ds.hidden_dtype,
        lambda indices: read_samples(ds.files, indices, ds.layout),
        background=True,
        max_length=max_length,
        stored_top_k=ds.stored_top_k,
        layout=ds.layout,
    )


@dataclass
class Prepared:
    """An `eaglet prepare` output, for --online: the target runs on its samples inside the loop."""

    root: Path
    samples: list[formats.TokenizedSample]
    config: dict[str, Any]  # prepare_config.json
    token_freq: dict[int, int]  # masked-token counts (for the draft vocabulary)


def open_prepared(root: str | Path) -> Prepared:
    """The samples, prepare config and token frequencies of an `eaglet prepare` output, for --online."""
    root = Path(root)
    if not (root / formats.PREPARE_CONFIG_FILE).exists():
        stored = (root / formats.DATA_CONFIG_FILE).exists() or formats.list_dataset_files(root).format is not None
        hint = "; it holds stored hidden states: train on it without --online" if stored else ""
        raise FileNotFoundError(
            f"{root}: no {formats.PREPARE_CONFIG_FILE}; --online trains on a finished `eaglet prepare` output{hint}"
        )
    samples, pconfig = formats.read_prepared(root)
    freq_path = root / formats.TOKEN_FREQ_FILE
    if not freq_path.exists():
        raise FileNotFoundError(
            f"{root}: no {formats.TOKEN_FREQ_FILE} (the draft vocabulary is built from it); "
            "rerun `eaglet prepare`, which writes it"
        )
    freq = formats.read_token_freq(freq_path)
    problem = formats.prepared_problem(samples, freq)
    if problem:  # what check finds in an extracted dataset, found here for --online
        raise ValueError(f"{root}: {problem}; prepare the data again (the prepared files were changed since)")
    return Prepared(root, samples, pconfig, freq)


def open_training_data(root: str | Path, cfg: TrainConfig, show_progress: bool) -> Dataset | Prepared:
    """What `eaglet train` reads, checked before any target is loaded: with --online an `eaglet
    prepare` output, else a stored dataset that `eaglet check` passes and whose teacher fits the options."""
    if cfg.online:
        if cfg.last_hidden_state not in (None, formats.LAST_STATE_PRE_NORM):
            raise ValueError("--last-hidden-state: online, the last state is captured before the final norm (pre_norm)")
        return open_prepared(root)
    ds = open_dataset(root, cfg.aux_layer_ids, cfg.last_hidden_state, show_progress)
    refuse_unclean_dataset(root)
    check_stored_teacher(ds, cfg)
    return ds


def truncate(sample: formats.TokenizedSample, max_length: int | None) -> formats.TokenizedSample:
    if max_length is None or len(sample.input_ids) <= max_length:
        return sample
    return formats.TokenizedSample(sample.sample_id, sample.input_ids[:max_length], sample.loss_mask[:max_length])


def online_source(
    prepared: Prepared, model: PreTrainedModel, layer_ids: list[int], device: torch.device, max_length: int | None
) -> Source:
    """Batches whose hidden states the target computes on the fly, with extract.py's own capture
    code (hooks, padding, per-sample cut), so they hold what `eaglet extract` would have stored
    with this compute dtype; only the copy to disk and back is skipped."""
    capture = LayerCapture(decoder_layers(model), layer_ids)
    dtype = next(model.parameters()).dtype
    samples = prepared.samples

    def read(indices: list[int]) -> list[formats.TrainingSample]:
        batch = [truncate(samples[i], max_length) for i in indices]
        states = run_batch(model, capture, batch, device, dtype, out_device=device)
        return [
            formats.TrainingSample(
                torch.tensor(s.input_ids, device=device),
                torch.cat(h[:-1], dim=-1),
                h[-1],
                torch.tensor(s.loss_mask, device=device),
            )
            for s, h in zip(batch, states)
        ]

    return Source(
        prepared.root,
        {i: len(s.input_ids) for i, s in enumerate(samples)},
        prepared.token_freq,
        layer_ids[:-1],
        formats.LAST_STATE_PRE_NORM,
        dtype_name(dtype),
        read,
        background=False,
        max_length=max_length,
        layout=PREPARED_LAYOUT,
    )


# ---------------------------------------------------------------------------------------------
# Refusals before the first step
# ---------------------------------------------------------------------------------------------


def refuse_too_short(lengths: dict[int, int], train_idx: list[int], cfg: TrainConfig) -> None:
    """Training samples that give no TTT step a position would train on nothing and log NaN."""
    need = min_sample_tokens(1)
    if not any(min(lengths[i], cfg.max_length or lengths[i]) >= need for i in train_idx):
        raise ValueError(
            f"no training sample has {need} tokens or more (after --max-length "
            f"{cfg.max_length}): step 0 predicts token t+2 from position t, so there is no position to "
            "train on; use longer samples or a larger --max-length"
        )


def refuse_beyond_positions(source: Source, max_length: int | None, target_config: Any) -> None:
    """A sample longer than the target's positions holds states the target never makes in use
    (RoPE beyond its range): refuse it, naming the longest, rather than train on it."""
    limit = config_positions(target_config)
    longest = max(source.lengths, key=lambda i: source.lengths[i])
    n = min(source.lengths[longest], max_length or source.lengths[longest])
    if n > limit:
        over = sum(min(v, max_length or v) > limit for v in source.lengths.values())
        raise ValueError(
            f"{source.path}: sample {longest} has {n} tokens and {over} sample(s) in all are longer than the "
            f"target's {limit} positions (max_position_embeddings); pass --max-length {limit} or less, "
            "or prepare the data again with such a --max-length"
        )


def refuse_wrong_layer_ids(ds: Dataset, model: PreTrainedModel) -> None:
    """The check `eaglet check --target` makes of layer identity, on the dataset's first file:
    recorded layer ids that the stored states do not match are refused before any training."""
    n = model.config.num_hidden_layers
    first = ds.files[min(ds.files)]
    problems = layer_identity_problems(ds.root, ds.layout, first, model, [*ds.aux_layer_ids, n], ds.last_hidden_state)
    if problems:
        raise ValueError(
            f"{ds.root / formats.DATA_CONFIG_FILE}: layer_ids {[*ds.aux_layer_ids, n]} do not match "
            f"the stored states ({'; '.join(p.message for p in problems[:3])}); an edited or wrong "
            f"layer_ids trains a drafter that engines feed other layers: `eaglet check {ds.root} "
            "--target T` for the full report, then re-extract or restore data_config.json"
        )


def refuse_wrong_last_state(ds: Dataset, target_heads: TargetHeads) -> None:
    """The check the heads alone can make, on the dataset's first file: the stored last state read as
    recorded (pre- or post-norm) must predict the next token at least as well as read the other way."""
    first = ds.files[min(ds.files)]
    sample = formats.read_training_sample(first, ds.layout)
    if sample.last_hidden is None:  # a compact file stores the teacher, not the state
        return
    positions, hits = convention_hits(sample.last_hidden, sample.input_ids, sample.loss_mask, target_heads)
    problem = convention_problem(positions, hits, ds.last_hidden_state, str(first))
    if problem:
        raise ValueError(
            f"{problem.path}: {problem.message} ({ds.root / formats.DATA_CONFIG_FILE}, or "
            "--last-hidden-state for a dataset without one); `eaglet check` for the full report"
        )
    log.info(
        "%s: the stored last state read %s predicts %d of %d assistant next tokens through the target's head "
        "(%d read the other way)",
        first,
        ds.last_hidden_state,
        hits[ds.last_hidden_state],
        positions,
        sum(hits.values()) - hits[ds.last_hidden_state],
    )
