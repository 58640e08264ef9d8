"""A hidden-state dataset in one layout -> another (`eaglet convert`).

Reads any dataset `eaglet check` and `eaglet train` read (eaglet's v1, speculators' Arrow table +
`hs_{i}.safetensors`, flat v1, `hs_*.safetensors` with masks, SpecForge) and writes eaglet's v1,
speculators' layout, or the compact one (6-bit aux states, the target's top-K in place of the
last state, computed with the target's head). v1 and speculators' get the states bit for bit; the side
files the output needs (data_config.json, sample_lengths.json, token_freq.pt) are written beside
them. Like extraction, every file lands by rename and a rerun skips the complete ones, so a
conversion killed at any moment resumes.

Entry point: `convert(src, out, layout) -> ConvertSummary`.
"""

from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from eaglet import formats, heads, ranges
from eaglet.drafter.teacher import StoredTeacherMaker
from eaglet.options import ConvertOptions
from eaglet.target import load_heads, resolve_target, target_source, text_config
from eaglet.dataset import Dataset, check_target_matches, dataset_target, open_dataset, recorded_target_where


@dataclass
class ConvertSummary:
    out: Path
    layout: str
    source_layout: str
    written: int
    already_done: int
    tokens: int
    seconds: float
    bytes_in: int
    bytes_out: int

    def lines(self) -> list[str]:
        rate = self.tokens / self.seconds if self.seconds > 0 else 0.0
        return [
            f"converted {self.written} samples ({self.tokens} tokens, {rate:,.0f} tok/s) from {self.source_layout} "
            f"to {self.layout} in {self.out}; {self.already_done} were already done",
            f"hidden-state files: {self.bytes_in / 2**20:,.1f} MiB in, {self.bytes_out / 2**20:,.1f} MiB out",
        ]


def target_fields(target: str, hidden_size: int, aux_layer_ids: list[int]) -> dict[str, Any]:
    """What data_config.json records about the target, for a source that records none."""
    ref = resolve_target(target)
    tc = text_config(ref)
    if tc.hidden_size != hidden_size:
        raise ValueError(f"--target {target}: hidden size {tc.hidden_size}, the dataset's states have {hidden_size}")
    n = tc.num_hidden_layers
    return {
        "target": ref.name,
        "target_path": ref.path,
        "target_revision": ref.revision,
        "model_type": tc.model_type,
        "num_hidden_layers": n,
        "vocab_size": tc.vocab_size,
        "layer_ids": [*aux_layer_ids, n],
        "aux_layer_ids": list(aux_layer_ids),
        "layer_id_convention": formats.LAYER_ID_CONVENTION,
    }


def converted_config(
    ds: Dataset, layout: formats.Layout, target: str | None, command: str, stored_top_k: int
) -> formats.DataConfig:
    """The output's data_config.json: the source's (or, for a source without one, --target's
    fields), with the output layout and the totals of the samples."""
    cfg = {
        k: v
        for k, v in ds.config.to_json().items()
        if k not in ("format", "command", "converted_from", "compact", "state_signatures", "signature_key")
    }
    if ds.config.target_revision is None or ds.config.layer_ids is None:
        if target is None:
            raise ValueError(
                f"{ds.root}: no {formats.DATA_CONFIG_FILE} records which target these states come "
                "from; pass --target (the model that produced them) so the converted dataset records "
                "it, as every v1 dataset must"
            )
        cfg.update(target_fields(target, ds.hidden_size, ds.aux_layer_ids))
    lengths = [ds.lengths[i] for i in sorted(ds.files)]
    cfg.update(layout.config_fields(min(stored_top_k, cfg.get("vocab_size") or stored_top_k)))
    cfg.update(
        {
            "format": layout.name,
            "command": command,
            "converted_from": {"path": str(ds.root), "format": ds.layout},
            "last_hidden_state": ds.last_hidden_state,
            "hidden_states_dtype": ds.hidden_dtype,
            "rows_per_folder": formats.ROWS_PER_FOLDER,
            "num_samples": len(lengths),
            "num_tokens": sum(lengths),
            "num_masked_tokens": sum(ds.token_freq.values()),
            "seq_length": max(lengths),
        }
    )
    return formats.data_config_from(cfg, ds.root / formats.DATA_CONFIG_FILE)


def read_rows(ds: Dataset, show_progress: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(input_ids, loss_mask) of every sample in index order: speculators' table needs them all first."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        return list(
            tqdm(
                pool.map(lambda i: formats.read_sample_tokens(ds.files[i], ds.layout), sorted(ds.files)),
                total=len(ds.files),
                desc="read token ids",
                unit="file",
                file=sys.stderr,
                dynamic_ncols=True,
                disable=not show_progress,
            )
        )


def copy_sample(
    ds: Dataset,
    out: Path,
    layout: formats.Layout,
    index: int,
    teacher: StoredTeacherMaker | None,
    signatures: formats.SignatureLog,
) -> int:
    """Read one sample from the source and write it in `layout` (the compact one with the stored
    teacher `teacher` makes from the last state; the others with its signature recorded in
    `signatures`); returns its token count."""
    s = formats.read_training_sample(ds.files[index], ds.layout)
    if s.last_hidden is None:  # a compact file: convert refuses compact sources before reading any
        raise ValueError(f"{ds.files[index]}: no last state to convert (a compact file stores the target's top-K)")
    # Each state its own storage: torch.save writes whole storages, a chunk view would drag the
    # other two aux states into every v1 file.
    states = [h.contiguous().clone() for h in s.aux_hidden.chunk(3, dim=-1)] + [s.last_hidden.contiguous()]
    formats.write_sample(
        out, layout, index, s.input_ids, states, s.loss_mask, teacher(s.last_hidden) if teacher else None, signatures
    )
    return int(s.input_ids.shape[0])


def teacher_maker(ds: Dataset, target: str | None, stored_top_k: int) -> StoredTeacherMaker:
    """The compact layout's teacher from each sample's last state: the target's final norm (unless
    the stored state is post-norm) and LM head."""
    ref = resolve_target(dataset_target(ds, target), target_source(target, recorded_target_where(ds)))
    target_heads = load_heads(ref, torch.float32, roles=(heads.FINAL_NORM, heads.LM_HEAD))
    check_target_matches(ds.config, target_heads.config, ref)
    return StoredTeacherMaker(target_heads, stored_top_k, ds.last_hidden_state)


def convert(options: ConvertOptions, command: str = "", workers: int = 2, show_progress: bool = True) -> ConvertSummary:
    """Write the hidden-state dataset at `src` into `out` in `layout` (a `formats.WRITTEN_LAYOUTS`
    name). `aux_layer_ids` / `last_hidden_state` / `target` describe a source whose
    data_config.json does not (as for `eaglet train`)."""
    target, layout, stored_top_k = options.target, options.layout, options.stored_top_k
    ranges.at_least(1, workers=workers, stored_top_k=stored_top_k)
    written = formats.written_layout(layout)
    src, out = Path(options.src), Path(options.out)
    formats.refuse_overlap(out, "convert", {"the source": src})
    ds = open_dataset(src, options.aux_layer_ids, options.last_hidden_state, show_progress)
    if formats.layout(ds.layout).stores_teacher:
        raise ValueError(
            f"{src} is compact: it keeps no last-layer state and its aux states are rounded to 6 bits, "
            "so no other layout can be made from it; convert the dataset it was made from"
        )
    indices = sorted(ds.files)
    if indices != list(range(len(indices))):
        gaps = sorted(set(range(indices[-1] + 1)) - set(indices))
        raise ValueError(
            f"{src}: sample indices are not 0..{len(indices) - 1} (no file for {gaps[:10]}); every "
            f"layout pairs sample i with file i, so fill the gaps first (`eaglet check {src}`)"
        )
    if written.fixed_last_state and ds.last_hidden_state != written.last_state:
        raise ValueError(
            f"{src}: its last state is {ds.last_hidden_state} (after the target's final norm); "
            "speculators applies that norm itself, and it cannot be undone: extract the states again "
            "(`eaglet extract --layout speculators`), or convert to v1, which records the convention"
        )
    written.check_hidden_size(ds.hidden_size, str(src))
    with formats.output_lock(out, "convert"):  # one writer per output: a second is refused, naming the first
        config = converted_config(ds, written, target, command, stored_top_k)
        teacher = teacher_maker(ds, target, stored_top_k) if written.stores_teacher else None
        formats.remove_stale_temp_files(out)  # what a killed convert left half-written; this one is the only writer
        out.mkdir(parents=True, exist_ok=True)
        formats.ensure_data_config(out, config)
        if not (out / formats.SAMPLE_LENGTHS_FILE).exists():
            formats.write_sample_lengths(out / formats.SAMPLE_LENGTHS_FILE, ds.lengths)
        if not (out / formats.TOKEN_FREQ_FILE).exists():
            formats.write_token_freq(out / formats.TOKEN_FREQ_FILE, ds.token_freq)
        if written.table is not None and not written.table.exists(out):
            formats.start_dataset(
                out, written, [(ids.numpy(), mask.numpy()) for ids, mask in read_rows(ds, show_progress)]
            )
        num_states = formats.EAGLE3_NUM_STATES
        found = [
            (i, why)
            for i in indices
            for why in [
                formats.sample_file_problem(formats.sample_path(out, written, i), written, ds.lengths[i], num_states)
            ]
            if why
        ]
        formats.refuse_other_samples([(formats.sample_path(out, written, i), why) for i, why in found])
        todo = [i for i, _ in found]
        # made at its first line: never, for the compact layout
        signatures = formats.signature_log(out, "convert")
        t0 = time.time()
        tokens = 0
        with (
            ThreadPoolExecutor(max_workers=workers) as pool,
            tqdm(
                total=sum(ds.lengths[i] for i in todo),
                unit="tok",
                unit_scale=True,
                desc=f"convert to {layout}",
                file=sys.stderr,
                dynamic_ncols=True,
                disable=not show_progress,
            ) as bar,
        ):
            for n in pool.map(lambda i: copy_sample(ds, out, written, i, teacher, signatures), todo):
                tokens += n
                bar.update(n)
        bytes_in = sum(p.stat().st_size for p in ds.files.values())
        bytes_out = sum(formats.sample_path(out, written, i).stat().st_size for i in indices)
        return ConvertSummary(
            out, layout, ds.layout, len(todo), len(indices) - len(todo), tokens, time.time() - t0, bytes_in, bytes_out
        )
