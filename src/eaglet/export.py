"""Hand a drafter to the serving engines, and take drafters back from them.

- `export_drafter(ckpt, out, fmt)`: an eaglet checkpoint -> a folder vLLM (`speculators`) or SGLang
  and the official EAGLE-3 code (`eagle`) load, or one llama.cpp GGUF file (`eaglet export`);
- `import_drafter(src, out)`: a folder in either format (or an eaglet checkpoint) -> an eaglet
  checkpoint folder (`eaglet import`).

Both read the drafter through `eaglet.drafter.files.read_drafter`, which checks it before anything
is written; the on-disk layouts themselves are defined in `eaglet.formats`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from eaglet import families, formats
from eaglet.drafter import DraftConfig
from eaglet.target import resolve_target, text_config
from eaglet.drafter.files import (
    EMBEDDINGS,
    Drafter,
    expected_tensors,
    export_config,
    read_drafter,
    recorded_target,
    target_embeddings,
    unservable,
    write_engine_folder,
    write_gguf,
)
from eaglet.heads import same_embeddings
from eaglet.formats.runs import refuse_inside_checkpoints
from eaglet.options import EXPORT_DTYPE_NAMES, EXPORT_FORMAT_NAMES, ExportOptions, ImportOptions

log = logging.getLogger(__name__)


@dataclass
class ExportSummary:
    out: Path
    format: str
    dtype: str
    config: DraftConfig
    num_tensors: int
    num_bytes: int
    target: str | None
    notes: list[str]

    def lines(self) -> list[str]:
        c, target = self.config, self.target or "TARGET"
        out = [
            f"exported {self.format} drafter -> {self.out} ({self.num_tensors} tensors, "
            f"{self.num_bytes / 2**20:.1f} MiB, {self.dtype})",
            f"  aux layer ids {c.aux_layer_ids} (HF hidden_states indexing), draft vocab {c.draft_vocab_size} "
            f"of {c.target_vocab_size}",
        ]
        if self.format == formats.FORMAT_GGUF:  # `target` is the GGUF whose tokenizer it carries
            return out + [
                f"  llama.cpp: llama-server -m {target} -md {self.out} --spec-type draft-eagle3 "
                f"--spec-draft-n-max {ExportOptions.speculative_tokens}"
            ]
        return out + serving_commands(c, target, self.out, self.format) + [f"  note: {n}" for n in self.notes]


def serving_commands(c: DraftConfig, target: str, out: Path, fmt: str) -> list[str]:
    """How vLLM (and SGLang, for the eagle format) serve the exported drafter, from its family's traits."""
    family = families.family(c.family)
    drafts = family.drafts_per_pass(c.block_size) if family.parallel else ExportOptions.speculative_tokens
    spec = json.dumps(family.vllm_speculative_config(str(out), drafts))
    lines = [f"  vLLM:   vllm serve {target} --speculative-config '{spec}'"]
    if fmt == formats.FORMAT_EAGLE and family.sglang_algorithm:
        shape = (
            f"--speculative-num-draft-tokens {c.block_size}"
            if family.parallel
            else "--speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4"
        )
        lines.append(
            f"  SGLang: python -m sglang.launch_server --model-path {target} --speculative-algorithm "
            f"{family.sglang_algorithm} --speculative-draft-model-path {out} {shape}"
        )
    return lines


def export_drafter(options: ExportOptions) -> ExportSummary:
    """Write `out` (config.json + model.safetensors, atomically; for gguf one file) in `fmt` from
    a checked drafter. `ckpt`: a checkpoint folder or a train run folder (its best checkpoint)."""
    ckpt, out, fmt, dtype, target_gguf = options.ckpt, options.out, options.fmt, options.dtype, options.target_gguf
    if fmt not in EXPORT_FORMAT_NAMES:
        raise ValueError(f"--format {fmt!r}: expected one of {list(EXPORT_FORMAT_NAMES)}")
    if dtype not in EXPORT_DTYPE_NAMES:
        raise ValueError(f"--dtype {dtype!r}: expected one of {list(EXPORT_DTYPE_NAMES)}")
    if target_gguf is not None and fmt != formats.FORMAT_GGUF:
        raise ValueError(f"--target-gguf: only --format gguf carries the target's tokenizer (this is --format {fmt})")
    formats.refuse_overlap(out, "export", {"the checkpoint": ckpt}, inside_ok=True)
    refuse_inside_checkpoints(out, "export")
    with formats.output_lock(out, "export"):  # one writer per output: a second is refused, naming the first
        return export_locked(
            read_drafter(ckpt), Path(out), fmt, dtype, options.verifier, options.speculative_tokens, target_gguf
        )


def refuse_other_target(d: Drafter, target: str) -> None:
    """The drafter is the target's: the layers it reads exist, and the embeddings it carries (the
    target's, frozen in training) are the target's."""
    layers = text_config(resolve_target(target)).num_hidden_layers
    if not all(0 <= i <= layers for i in d.config.aux_layer_ids):
        raise ValueError(
            f"{d.folder}: aux layer ids {list(d.config.aux_layer_ids)} are not all in 0..{layers}, the "
            f"layers of the target {target}; a drafter for another target, or a damaged config.json"
        )
    copy = d.tensors.get(EMBEDDINGS)
    if copy is not None and not d.embeddings_from_target and not same_embeddings(copy, target_embeddings(target)):
        raise ValueError(
            f"{d.folder / formats.DRAFTER_WEIGHTS_FILE}: field {EMBEDDINGS} is not the embeddings of the "
            f"target {target} (a drafter keeps its target's, frozen in training): a drafter of another "
            "target, or its weights were changed since; give the target it was trained for (--target), "
            "or use a checkpoint as training wrote it"
        )


def export_locked(
    d: Drafter,
    out: Path,
    fmt: str,
    dtype: str,
    verifier: str | None,
    speculative_tokens: int,
    target_gguf: str | Path | None,
) -> ExportSummary:
    """`export_drafter`'s work, its output locked."""
    recorded = recorded_target(d)
    if recorded and Path(recorded).is_dir():  # a target here (a hub id is the serving machine's to check)
        refuse_other_target(d, recorded)
    problems = unservable(d.config, fmt)
    if problems:
        raise ValueError(f"{d.folder}: cannot export as {fmt}: " + "; ".join(problems))
    if fmt == formats.FORMAT_GGUF:
        source, count, size = write_gguf(d, out, dtype, target_gguf)
        return ExportSummary(out, fmt, dtype, d.config, count, size, str(source), [])
    written = write_engine_folder(d, out, fmt, dtype, verifier, speculative_tokens)
    return ExportSummary(
        out, fmt, dtype, d.config, written.num_tensors, written.num_bytes, written.target, written.notes
    )


# ---------------------------------------------------------------------------------------------
# Import and load
# ---------------------------------------------------------------------------------------------


@dataclass
class ImportSummary:
    out: Path
    source_format: str
    config: DraftConfig
    embeddings_from_target: bool

    def lines(self) -> list[str]:
        c = self.config
        return [
            f"imported {self.source_format} drafter -> {self.out} (eaglet checkpoint: model.safetensors + config.json)",
            f"  hidden {c.hidden_size}, aux layer ids {c.aux_layer_ids}, draft vocab {c.draft_vocab_size} of "
            f"{c.target_vocab_size}, fc_norm {c.fc_norm}, norm_output {c.norm_output}, "
            f"norm_before_residual {c.norm_before_residual}"
            + (", embeddings copied from the target" if self.embeddings_from_target else ""),
        ]


def import_drafter(options: ImportOptions) -> ImportSummary:
    """Read a drafter in any format and write it as an eaglet checkpoint folder (the layout of
    `training.checkpoints.save_checkpoint`, without training state): fp32 weights, int64 d2t, bool t2d."""
    src, out, target = options.src, options.out, options.target
    formats.refuse_overlap(out, "import", {"the drafter folder": src}, inside_ok=True)
    refuse_inside_checkpoints(out, "import")
    d = read_drafter(src, target)
    if target is not None:
        refuse_other_target(d, target)
    expected = expected_tensors(d.config)
    tensors = {k: v.to(expected[k].dtype) for k, v in d.tensors.items()}
    extra = {"imported_from": str(src), "source_format": d.format, "target": target or recorded_target(d)}
    with formats.output_lock(out, "import"):  # one writer per output: a second is refused, naming the first
        formats.write_drafter_folder(out, export_config(d.config, extra), tensors)
    return ImportSummary(Path(out), d.format, d.config, d.embeddings_from_target)
