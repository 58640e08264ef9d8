"""Target hidden states -> a hidden-state dataset (`eaglet extract`).

Runs the target over the prepared samples, capturing only the decoder-layer outputs that
EAGLE-3 needs (forward hooks on those layers; no `output_hidden_states` copy of all N), and
writes one file per sample: speculators v1 `data_{i}.pt` (default), or with `--layout
speculators` the layout speculators >= 0.6 trains from (its Arrow table of tokens and masks,
then `hs_{i}.safetensors`). Samples are batched by similar length with right padding:
under a causal mask a real token never attends to padding on its right, and each sample's
states are cut to its own length, so padding never reaches the stored tensors.

Every file appears by atomic rename, so a rerun skips existing files and redoes the rest:
a run killed at any moment resumes with nothing lost and nothing corrupt.
`--num-shards K --shard-id i` takes samples with `index % K == i`, so several processes or
machines can fill one output folder.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable

import torch
from tqdm import tqdm

from eaglet import __version__, formats, layers, ranges
from eaglet.chat import template_hash
from eaglet.drafter.teacher import StoredTeacherMaker
from eaglet.formats import DataConfig, TokenizedSample
from eaglet.options import HF_ENGINE, VLLM_ENGINE, ExtractOptions
from eaglet.placement import placement_from_options
from eaglet.target import (
    LayerCapture,
    TargetRef,
    config_positions,
    config_where,
    decoder_layers,
    dtype_name,
    load_heads,
    load_target,
    load_tokenizer,
    parse_dtype,
    pick_device,
    prepared_target,
    run_batch,
    text_config,
)
from eaglet.vllm_engine import EngineOptions, engine_options_from, engine_record, vllm_engine

if TYPE_CHECKING:  # transformers' modelling code loads only with a model
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)


def validate_layer_ids(layer_ids: list[int], num_layers: int) -> None:
    layers.check_stored_ids(layer_ids, num_layers, "--layer-ids")


def chosen_layer_ids(given: list[int] | None, num_layers: int) -> list[int]:
    """--layer-ids, checked, or the default [2, N//2, N-3, N]."""
    ids = list(given) if given else layers.default_layer_ids(num_layers)
    validate_layer_ids(ids, num_layers)
    return ids


def length_batches(indices: list[int], lengths: list[int], batch_tokens: int, max_batch_size: int) -> list[list[int]]:
    """Group samples of similar length; a batch's padded size stays within `batch_tokens`
    (a sample longer than that goes alone). Longest first, so a too-large batch fails early."""
    order = sorted(indices, key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        longest = lengths[current[0]] if current else lengths[i]
        if current and ((len(current) + 1) * longest > batch_tokens or len(current) >= max_batch_size):
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


@dataclass
class SampleFiles:
    """Where and how this run writes each sample's file."""

    out: Path
    layout: formats.Layout
    teacher: StoredTeacherMaker | None  # the compact layout's stored teacher, from the last state
    signatures: formats.SignatureLog  # each file's signature, recorded before the file appears

    def write(self, index: int, sample: TokenizedSample, states: list[torch.Tensor]) -> Path:
        return formats.write_sample(
            self.out,
            self.layout,
            index,
            torch.tensor(sample.input_ids, dtype=torch.long),
            states,
            torch.tensor(sample.loss_mask, dtype=torch.long),
            self.teacher(states[-1]) if self.teacher else None,
            self.signatures,
        )


def prepared_sha256(samples: list[TokenizedSample]) -> str:
    h = hashlib.sha256()
    for s in samples:
        h.update(s.to_json().encode())
    return h.hexdigest()[:16]


def build_data_config(
    out: Path,
    ref,
    cfg: Any,
    tokenizer_template_sha: str,
    pconfig: dict,
    samples: list[TokenizedSample],
    layer_ids: list[int],
    compute_dtype: torch.dtype,
    store_dtype: torch.dtype,
    command: str,
    layout: formats.Layout = formats.V1_LAYOUT,
    stored_top_k: int = 0,
    engine: str = HF_ENGINE,
) -> DataConfig:
    """data_config.json of this extraction; `cfg` the target's (text) config, `engine` what
    computed the states ("hf", or "vllm <version>")."""
    return formats.data_config_from(
        {
            "format": layout.name,
            **layout.config_fields(min(stored_top_k, cfg.vocab_size)),
            "eaglet_version": __version__,
            "command": command,
            "target": ref.name,
            "target_path": ref.path,
            "target_revision": ref.revision,
            "architecture": (cfg.architectures or [type(cfg).__name__.removesuffix("Config")])[0],
            "model_type": cfg.model_type,
            "num_hidden_layers": cfg.num_hidden_layers,
            "hidden_size": cfg.hidden_size,
            "vocab_size": cfg.vocab_size,
            "layer_ids": layer_ids,
            "aux_layer_ids": layer_ids[:-1],
            "layer_id_convention": formats.LAYER_ID_CONVENTION,
            "last_hidden_state": formats.LAST_STATE_PRE_NORM,
            "compute_dtype": dtype_name(compute_dtype),
            "engine": engine,
            "hidden_states_dtype": dtype_name(store_dtype),
            "chat_template_sha256": tokenizer_template_sha,
            "max_length": pconfig["max_length"],
            "seq_length": max(len(s.input_ids) for s in samples),
            "num_samples": len(samples),
            "num_tokens": sum(len(s.input_ids) for s in samples),
            "num_masked_tokens": sum(sum(s.loss_mask) for s in samples),
            "rows_per_folder": formats.ROWS_PER_FOLDER,
            "prepared_data": pconfig.get("data"),
            "prepared_sha256": prepared_sha256(samples),
        },
        out / formats.DATA_CONFIG_FILE,
    )


def refuse_unrunnable_samples(prepared: str | Path, samples: list[TokenizedSample], ref: TargetRef) -> None:
    """Before the target loads and anything is written: refuse a sample the target cannot take, a
    token id outside its vocabulary or more tokens than its positions (the forward would fail, or
    compute states past the positions the target was trained for, without naming the sample)."""
    target_config = text_config(ref)
    formats.check_prepared_token_ids(prepared, samples, target_config.vocab_size)
    limit = config_positions(target_config)
    longer = [n for n, s in enumerate(samples) if len(s.input_ids) > limit]
    if longer:
        n = longer[0]
        raise ValueError(
            f"{Path(prepared) / formats.PREPARED_FILE}:{n + 1}: sample {samples[n].sample_id} has "
            f"{len(samples[n].input_ids)} tokens, more than the {limit} positions the target holds "
            f"(max_position_embeddings in {config_where(ref)}); {len(longer)} of {len(samples)} "
            f"samples are that long: run `eaglet prepare` again with --max-length {limit} or less"
        )


@dataclass
class ExtractSummary:
    out: Path
    written: int
    already_done: int
    shard_samples: int
    tokens: int
    seconds: float
    bytes_on_disk: int
    tokens_on_disk: int
    hidden_size: int
    num_states: int
    engine_start_s: float = 0.0  # --engine vllm: the engine's start-up, part of `seconds`

    @property
    def tokens_per_s(self) -> float:
        """Extraction throughput, the engine's start-up left out."""
        busy = self.seconds - self.engine_start_s
        return self.tokens / busy if busy > 0 else 0.0

    def lines(self) -> list[str]:
        per_tok = self.bytes_on_disk / max(self.tokens_on_disk, 1)
        floor = formats.v1_min_bytes_per_token(self.hidden_size, self.num_states)
        started = f", after vLLM's start-up of {self.engine_start_s:.0f} s" if self.engine_start_s else ""
        return [
            f"extracted {self.written} samples ({self.tokens} tokens, {self.tokens_per_s:,.0f} tok/s{started}); "
            f"{self.already_done} of this shard's {self.shard_samples} were already done",
            f"hidden states in {self.out}: {self.bytes_on_disk / 2**20:,.1f} MiB, "
            f"{per_tok:,.0f} bytes/token ({per_tok / floor:.2f}x the v1 minimum, {floor})",
        ]


def dataset_disk_usage(out: Path, lengths: dict[int, int]) -> tuple[int, int]:
    """Bytes of all sample files under `out` and the tokens they hold."""
    files = dict(formats.list_dataset_files(out).files)
    return sum(p.stat().st_size for p in files.values()), sum(lengths.get(i, 0) for i in files)


@dataclass
class Shard:
    """This shard's samples: which it owns and which of them are still to be written."""

    mine: list[int]
    todo: list[int]


def check_shard(num_shards: int, shard_id: int) -> None:
    if not 0 <= shard_id < num_shards:
        raise ValueError(f"--shard-id {shard_id} must be in [0, --num-shards {num_shards})")


def write_side_files(
    out: Path, prepared: str | Path, written: formats.Layout, samples: list[TokenizedSample], lengths: dict[int, int]
) -> None:
    """The dataset's table (speculators' layout), sample_lengths.json and token_freq.pt, once."""
    formats.start_dataset(out, written, [(s.input_ids, s.loss_mask) for s in samples])
    if not (out / formats.SAMPLE_LENGTHS_FILE).exists():
        formats.write_sample_lengths(out / formats.SAMPLE_LENGTHS_FILE, lengths)
    if not (out / formats.TOKEN_FREQ_FILE).exists():
        formats.write_token_freq(
            out / formats.TOKEN_FREQ_FILE, formats.read_token_freq(Path(prepared) / formats.TOKEN_FREQ_FILE)
        )


def plan_shard(
    out: Path,
    written: formats.Layout,
    count: int,
    num_shards: int,
    shard_id: int,
    lengths: dict[int, int],
    num_states: int,
) -> Shard:
    """This shard's samples and those of them still to write: a file that exists is complete (files
    appear only by rename), unless something else wrote it, and then it is redone."""
    mine = [i for i in range(count) if i % num_shards == shard_id]
    paths = {i: formats.sample_path(out, written, i) for i in mine}
    stale = formats.remove_stale_temp_files(formats.files_dir(out, written), {p.name for p in paths.values()})
    if stale:
        log.info("removed %d partial files left by an earlier run", stale)
    todo = [i for i in mine if not paths[i].exists()]
    missing = set(todo)
    redo = [
        (i, why)
        for i in mine
        if i not in missing
        for why in [formats.sample_file_problem(paths[i], written, lengths[i], num_states)]
        if why
    ]
    formats.refuse_other_samples([(paths[i], why) for i, why in redo])
    if redo:
        log.warning(
            "%d existing file(s) are not complete safe samples and will be redone (first: %s: %s)",
            len(redo),
            paths[redo[0][0]].relative_to(out),
            redo[0][1],
        )
        todo = sorted(todo + [i for i, _ in redo])
    return Shard(mine, todo)


class WriteQueue:
    """A pool of writer threads fed sample by sample; at most `4 x threads` writes wait, so memory
    stays flat when the disk is slower than the engine."""

    def __init__(self, threads: int):
        self.threads = threads
        self.pool = ThreadPoolExecutor(max_workers=threads)
        self.pending: list[Future] = []

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        while len(self.pending) > 4 * self.threads:
            self.pending.pop(0).result()
        self.pending.append(self.pool.submit(fn, *args))

    def __enter__(self) -> WriteQueue:
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            if exc[0] is None:
                for f in self.pending:
                    f.result()
        finally:
            self.pool.shutdown(wait=True, cancel_futures=exc[0] is not None)


def run_and_write(
    model: PreTrainedModel,
    samples: list[TokenizedSample],
    batches: list[list[int]],
    layer_ids: list[int],
    dev: torch.device,
    save_dtype: torch.dtype,
    files: SampleFiles,
    config: DataConfig,
    write_threads: int,
    bar: tqdm,
) -> None:
    """The target over every batch, each sample's states written by a pool of writers."""
    capture = LayerCapture(decoder_layers(model), layer_ids)
    try:
        with WriteQueue(write_threads) as writes:
            for batch in batches:
                batch_samples = [samples[i] for i in batch]
                per_sample = run_batch(model, capture, batch_samples, dev, save_dtype)
                # Another run may have replaced a config that had no sample file yet (see
                # formats.ensure_data_config): then this run's files would join another dataset.
                formats.refuse_other_dataset(files.out, config)
                for i, s, states in zip(batch, batch_samples, per_sample):
                    # The compact layout's teacher (the target's LM head) is computed by the writer,
                    # overlapping the next batch's forward.
                    writes.submit(files.write, i, s, states)
                bar.update(sum(len(s.input_ids) for s in batch_samples))
    finally:
        bar.close()
        capture.remove()


# ---------------------------------------------------------------------------------------------
# --engine vllm: vLLM computes the states, eaglet writes them
# ---------------------------------------------------------------------------------------------


def engine_scratch(out: Path, shard_id: int, num_shards: int) -> Path:
    """Where vLLM writes this shard's per-request files before eaglet consumes them: inside the
    output (one filesystem, so disk never holds a sample twice for long), emptied of an earlier
    run's leftovers, removed when the shard is done."""
    scratch = out / f".vllm-states-shard-{shard_id}-of-{num_shards}"
    if scratch.exists():
        shutil.rmtree(scratch)
    scratch.mkdir(parents=True)
    return scratch


def refuse_beyond_engine_context(
    prepared: str | Path, samples: list[TokenizedSample], todo: Iterable[int], options: EngineOptions | None
) -> None:
    """Before anything is written: a sample of this shard longer than the engine's context (an
    explicit --max-model-len) would be refused by vLLM mid-run; name the first and say what fits."""
    if options is None or not options.max_model_len:
        return
    max_model_len = options.max_model_len
    longer = [i for i in todo if len(samples[i].input_ids) + 1 > max_model_len]
    if longer:
        i = longer[0]
        raise ValueError(
            f"{Path(prepared) / formats.PREPARED_FILE}:{i + 1}: sample {samples[i].sample_id} has "
            f"{len(samples[i].input_ids)} tokens; vLLM's --max-model-len {max_model_len} holds "
            f"{max_model_len - 1} (one position goes to the token it generates); {len(longer)} samples "
            "are that long: raise --max-model-len, or prepare with a smaller --max-length"
        )


def extract_with_vllm(
    ref: TargetRef,
    prepared: str | Path,
    samples: list[TokenizedSample],
    batches: list[list[int]],
    layer_ids: list[int],
    options: EngineOptions,
    save_dtype: torch.dtype,
    files: SampleFiles,
    config: DataConfig,
    write_threads: int,
    shard: tuple[int, int],
    bar: tqdm,
) -> float:
    """vLLM's extraction over every batch: each request's file read back, checked against its
    sample (tokens, layers, width), written as `files` writes them, and deleted. Returns the
    engine's start-up seconds."""
    out = files.out
    scratch = engine_scratch(out, *shard)
    hidden = config.hidden_size or 0
    try:
        with (
            vllm_engine(ref.path, options, extract={"layer_ids": layer_ids, "folder": str(scratch)}) as engine,
            WriteQueue(write_threads) as writes,
        ):
            log.info("vLLM %s started in %.0f s", engine.version, engine.start_seconds)
            started = engine.start_seconds
            for batch in batches:
                paths, _ = engine.extract([samples[i].input_ids for i in batch])
                formats.refuse_other_dataset(out, config)
                for i, path in zip(batch, paths):
                    where = f"{Path(prepared) / formats.PREPARED_FILE}:{i + 1}, sample {samples[i].sample_id}"
                    states = [
                        x.to(save_dtype)
                        for x in formats.read_vllm_states(path, samples[i].input_ids, len(layer_ids), hidden, where)
                    ]
                    path.unlink()
                    writes.submit(files.write, i, samples[i], states)
                bar.update(sum(len(samples[i].input_ids) for i in batch))
    finally:
        bar.close()
        shutil.rmtree(scratch, ignore_errors=True)
    return started


def refuse_before_writing(
    out: Path,
    prepared: str | Path,
    samples: list[TokenizedSample],
    ref: TargetRef,
    shard: tuple[int, int],
    options: EngineOptions | None,
) -> None:
    """What must be refused before anything is written: a run of another --num-shards writing the
    folder now, samples the target cannot take, samples beyond vLLM's context."""
    shard_id, num_shards = shard
    formats.refuse_other_sharding(out, num_shards)
    refuse_unrunnable_samples(prepared, samples, ref)
    refuse_beyond_engine_context(prepared, samples, range(shard_id, len(samples), num_shards), options)


def engine_choice(options: ExtractOptions) -> EngineOptions | None:
    """The vLLM engine's options (None: the hf engine), each checked before anything is read."""
    if options.engine not in (HF_ENGINE, VLLM_ENGINE):
        raise ValueError(f"--engine {options.engine!r}: choose {HF_ENGINE} or {VLLM_ENGINE}")
    if options.engine == HF_ENGINE:
        return None
    if options.device_map is not None:
        raise ValueError(
            f"--device-map {options.device_map}: places the target of --engine {HF_ENGINE}; vLLM places "
            "its own (--tensor-parallel-size, --pipeline-parallel-size)"
        )
    return engine_options_from(options)


def vllm_options(
    options: EngineOptions, compute_dtype: torch.dtype, samples: list[TokenizedSample], todo: list[int]
) -> EngineOptions:
    """The engine's options for this shard: the compute dtype, and a context of the longest sample
    to extract (plus the one token vLLM generates) unless one is given."""
    longest = max((len(samples[i].input_ids) for i in todo), default=1)
    return replace(options, dtype=dtype_name(compute_dtype), max_model_len=options.max_model_len or longest + 1)


def load_engine_side(
    engine: EngineOptions | None,
    ref: TargetRef,
    compute_dtype: torch.dtype,
    dev: torch.device,
    placed,
    written: formats.Layout,
    stored_top_k: int,
) -> tuple[PreTrainedModel | None, Any, StoredTeacherMaker | None]:
    """What this process loads: with the hf engine (`engine` None) the whole target (its config, and its head for
    the compact layout's teacher); with vLLM only the config, and the head alone when the layout
    stores a teacher."""
    if engine is None:
        model = load_target(ref, compute_dtype, dev, placed)
        return model, model.config, StoredTeacherMaker(model, stored_top_k) if written.stores_teacher else None
    heads = load_heads(ref, torch.float32) if written.stores_teacher else None
    return None, text_config(ref), StoredTeacherMaker(heads, stored_top_k) if heads is not None else None


def extract(
    options: ExtractOptions, command: str = "", write_threads: int = 2, show_progress: bool = True
) -> ExtractSummary:
    """Extract the hidden states of every prepared sample of this shard into `out`, in `layout`
    (a `formats.WRITTEN_LAYOUTS` name); the compact layout stores the target's `stored_top_k`
    most likely next tokens in place of the last state. `engine` "hf" runs the target here (with
    `device_map` across devices, `eaglet.placement`); "vllm" has vLLM compute the same states
    (`eaglet.vllm_engine`, with its parallelism and memory options) and writes them the same way."""
    prepared, target, layer_ids, stored_top_k = (
        options.prepared,
        options.target,
        options.layer_ids,
        options.stored_top_k,
    )
    num_shards, shard_id, batch_tokens, max_batch_size = (
        options.num_shards,
        options.shard_id,
        options.batch_tokens,
        options.max_batch_size,
    )
    options.check_numbers()
    ranges.at_least(1, write_threads=write_threads)
    check_shard(num_shards, shard_id)
    written = formats.written_layout(options.layout)
    engine = engine_choice(options)
    placed = placement_from_options(options.device_map, options.max_memory, options.offload_folder, options.device)
    out = Path(options.out)
    formats.refuse_overlap(out, "extract", {"--prepared": prepared, "--target": options.target})
    # one writer per shard of the output; the shards of one run (--shard-id) write side by side
    with formats.output_lock(out, "extract", lock=formats.lock_path(out, f"shard-{shard_id}-of-{num_shards}")):
        samples, pconfig = formats.read_prepared(prepared)
        ref = prepared_target(prepared, pconfig, target)
        refuse_before_writing(out, prepared, samples, ref, (shard_id, num_shards), engine)
        template_sha = template_hash(load_tokenizer(ref))
        dev = pick_device(options.device)
        compute_dtype, save_dtype = parse_dtype(options.dtype, dev), parse_dtype(options.store_dtype, dev)
        model, target_config, teacher = load_engine_side(engine, ref, compute_dtype, dev, placed, written, stored_top_k)
        written.check_hidden_size(target_config.hidden_size, ref.name)
        layer_ids = chosen_layer_ids(layer_ids, target_config.num_hidden_layers)
        config = build_data_config(
            out,
            ref,
            target_config,
            template_sha,
            pconfig,
            samples,
            layer_ids,
            compute_dtype,
            save_dtype,
            command,
            written,
            stored_top_k,
            HF_ENGINE if engine is None else engine_record(),
        )
        out.mkdir(parents=True, exist_ok=True)
        formats.ensure_data_config(out, config)
        lengths = {i: len(s.input_ids) for i, s in enumerate(samples)}
        write_side_files(out, prepared, written, samples, lengths)
        shard = plan_shard(out, written, len(samples), num_shards, shard_id, lengths, len(layer_ids))
        batches = length_batches(shard.todo, [len(s.input_ids) for s in samples], batch_tokens, max_batch_size)
        total_tokens = sum(lengths[i] for i in shard.todo)
        t0, started = time.time(), 0.0
        bar = tqdm(
            total=total_tokens,
            unit="tok",
            unit_scale=True,
            desc=f"extract shard {shard_id}/{num_shards}",
            file=sys.stderr,
            dynamic_ncols=True,
            disable=not show_progress,
        )
        files = SampleFiles(out, written, teacher, formats.signature_log(out, f"shard_{shard_id}_of_{num_shards}"))
        if model is not None:
            run_and_write(model, samples, batches, layer_ids, dev, save_dtype, files, config, write_threads, bar)
        elif engine is not None and shard.todo:
            started = extract_with_vllm(
                ref,
                prepared,
                samples,
                batches,
                layer_ids,
                vllm_options(engine, compute_dtype, samples, shard.todo),
                save_dtype,
                files,
                config,
                write_threads,
                (shard_id, num_shards),
                bar,
            )
        bar.close()
        disk_bytes, disk_tokens = dataset_disk_usage(out, lengths)
        return ExtractSummary(
            out,
            len(shard.todo),
            len(shard.mine) - len(shard.todo),
            len(shard.mine),
            total_tokens,
            time.time() - t0,
            disk_bytes,
            disk_tokens,
            target_config.hidden_size,
            len(layer_ids),
            started,
        )
