"""Hand a drafter to the serving engines, and take drafters back from them.

- `export_drafter(ckpt, out, fmt)`: an eaglet checkpoint -> a folder vLLM (`speculators`) or SGLang
  and the official EAGLE-3 code (`eagle`) load, or one llama.cpp GGUF file (`eaglet export`);
- `import_drafter(src, out)`: a folder in either format (or an eaglet checkpoint) -> an eaglet
  checkpoint folder (`eaglet import`).

Both read the drafter through `eaglet.drafter.files.read_drafter`, which checks it before anything
is written; the on-disk layouts themselves are defined in `eaglet.formats`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from eaglet import __version__, formats
from eaglet.drafter import DraftConfig
from eaglet.drafter.files import (WEIGHT_DTYPES, Drafter, expected_tensors, export_config, read_drafter,
                                  recorded_target, recorded_target_revision, write_gguf)
from eaglet.heads import LM_HEAD
from eaglet.options import (DECLARED, EAGLE3, EXPORT_DTYPE_NAMES, EXPORT_FORMAT_NAMES, declared_default,
                            takes_options)
from eaglet.target import load_heads, resolve_target, serving_name

log = logging.getLogger(__name__)

def unservable(cfg: DraftConfig, fmt: str) -> list[str]:
    """Variants a format's engine would load and then run wrongly, or cannot load at all."""
    if cfg.family != EAGLE3 and fmt == formats.FORMAT_GGUF:
        return [f"llama.cpp serves EAGLE-3 drafters only, not {cfg.family}; use --format speculators (vLLM)"]
    if cfg.family == "p-eagle" and fmt == formats.FORMAT_EAGLE:
        return ["SGLang serves no P-EAGLE drafter (its parallel drafting is vLLM's); use --format speculators"]
    if fmt == formats.FORMAT_GGUF:
        return formats.gguf_unservable(cfg)
    if fmt == formats.FORMAT_EAGLE and cfg.fc_norm:
        return ["fc_norm (one RMSNorm before fc): SGLang's LlamaForCausalLMEagle3 has no such norm and would skip "
                "input_norm.weight without a word; use --format speculators (vLLM reads norm_before_fc)"]
    return []


def format_warnings(cfg: DraftConfig, fmt: str) -> list[str]:
    """Things that depend on the engine's version; said, not refused."""
    notes = []
    if fmt == formats.FORMAT_EAGLE and cfg.norm_output:
        notes.append("norm_output: engines without EAGLE-3.1 support ignore it and feed back the pre-norm state")
    if cfg.sliding_window is not None:
        notes.append(f"sliding window {cfg.sliding_window} (layer_types sliding_attention): an engine that ignores it "
                     "runs the drafter with full attention, which differs once a context is longer than the window")
    if fmt == formats.FORMAT_EAGLE and cfg.norm_before_residual:
        notes.append("norm_before_residual: engines that do not read it keep the un-normalised residual; vLLM and "
                     "speculators read it (--format speculators is the safe choice)")
    if fmt == formats.FORMAT_SPECULATORS and cfg.target_hidden_size != cfg.hidden_size:
        notes.append(f"target_hidden_size {cfg.target_hidden_size} != hidden_size {cfg.hidden_size}: vLLM reads it, "
                     "but the speculators library (0.9) sizes fc by hidden_size and cannot load this folder itself")
    if fmt == formats.FORMAT_EAGLE and cfg.aux_layer_ids[0] != 2:
        notes.append(f"aux layer ids {cfg.aux_layer_ids} do not start at 2: SGLang releases with sgl-project/sglang"
                     f"#25454 read eagle_config ids whose first is not 1 without the +1, one layer off")
    return notes


def verifier_architectures(name: str) -> list[str]:
    """The verifier's `architectures`, when it is a local model folder (a hub id stays unread)."""
    config = Path(name) / "config.json"
    return list(formats.read_json(config).get("architectures") or []) if config.is_file() else []


def cast_floats(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Weights to `dtype`; d2t and t2d keep their integer and bool dtypes."""
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}


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
        out = [f"exported {self.format} drafter -> {self.out} ({self.num_tensors} tensors, "
               f"{self.num_bytes / 2**20:.1f} MiB, {self.dtype})",
               f"  aux layer ids {c.aux_layer_ids} (HF hidden_states indexing), draft vocab {c.draft_vocab_size} "
               f"of {c.target_vocab_size}"]
        if self.format == formats.FORMAT_GGUF:  # `target` is the GGUF whose tokenizer it carries
            return out + [f"  llama.cpp: llama-server -m {target} -md {self.out} --spec-type draft-eagle3 "
                          f"--spec-draft-n-max {declared_default('export', 'speculative_tokens')}"]
        if c.family != EAGLE3:
            return out + parallel_commands(c, target, self.out, self.format) + [f"  note: {n}" for n in self.notes]
        out += [f"  vLLM:   vllm serve {target} --speculative-config '{{\"method\": \"eagle3\", \"model\": "
               f"\"{self.out}\", \"num_speculative_tokens\": {declared_default('export', 'speculative_tokens')}}}'"]
        if self.format == formats.FORMAT_EAGLE:
            out.append(f"  SGLang: python -m sglang.launch_server --model-path {target} --speculative-algorithm EAGLE3 "
                       f"--speculative-draft-model-path {self.out} --speculative-num-steps 3 "
                       f"--speculative-eagle-topk 1 --speculative-num-draft-tokens 4")
        return out + [f"  note: {n}" for n in self.notes]


def parallel_commands(c: DraftConfig, target: str, out: Path, fmt: str) -> list[str]:
    """How the engines serve a parallel drafter: vLLM's parallel drafting (P-EAGLE) or dflash, SGLang's DFLASH."""
    drafts = formats.parallel_drafts(c)
    if c.family == "p-eagle":
        spec = (f'{{"method": "eagle3", "model": "{out}", "num_speculative_tokens": {drafts}, '
                f'"parallel_drafting": true}}')
    else:
        spec = f'{{"method": "dflash", "model": "{out}", "num_speculative_tokens": {drafts}}}'
    lines = [f"  vLLM:   vllm serve {target} --speculative-config '{spec}'"]
    if fmt == formats.FORMAT_EAGLE:
        lines.append(f"  SGLang: python -m sglang.launch_server --model-path {target} --speculative-algorithm DFLASH "
                     f"--speculative-draft-model-path {out} --speculative-num-draft-tokens {c.block_size}")
    return lines


def refuse_own_head_for_sglang(d: Drafter, target: str | None) -> None:
    """SGLang's DFlash drafts with the target's LM head, whatever the folder holds: a drafter whose
    head is not the target's rows (trained, not frozen at --lm-head-init target) would draft
    garbage there, silently. Checked against the target's head."""
    if not target:
        raise ValueError(f"{d.folder}: no target recorded; pass --verifier so the DFlash drafter's LM head can be "
                         "checked against the target's (SGLang drafts with the target's own)")
    head = load_heads(resolve_target(target), torch.float32, roles=(LM_HEAD,)).lm_head.weight
    rows = head[torch.arange(d.config.draft_vocab_size) + d.tensors["d2t"]]
    if not torch.allclose(rows, d.tensors["lm_head.weight"].float(), rtol=1e-3, atol=1e-5):
        raise ValueError(f"{d.folder}: the drafter's LM head is its own, but SGLang's DFLASH drafts with the "
                         f"target's: train with --lm-head-init target --freeze-lm-head for SGLang, or use "
                         f"--format speculators (vLLM loads the drafter's own head)")


@takes_options("export")
def export_drafter(ckpt: str | Path = DECLARED, out: str | Path = DECLARED, fmt: str = DECLARED,
                   dtype: str = DECLARED, verifier: str | None = DECLARED, speculative_tokens: int = DECLARED,
                   target_gguf: str | Path | None = DECLARED) -> ExportSummary:
    """Write `out` (config.json + model.safetensors, atomically; for gguf one file) in `fmt` from
    a checked drafter. `ckpt`: a checkpoint folder or a train run folder (its best checkpoint)."""
    if fmt not in EXPORT_FORMAT_NAMES:
        raise ValueError(f"--format {fmt!r}: expected one of {list(EXPORT_FORMAT_NAMES)}")
    if dtype not in EXPORT_DTYPE_NAMES:
        raise ValueError(f"--dtype {dtype!r}: expected one of {list(EXPORT_DTYPE_NAMES)}")
    if target_gguf is not None and fmt != formats.FORMAT_GGUF:
        raise ValueError(f"--target-gguf: only --format gguf carries the target's tokenizer (this is --format {fmt})")
    with formats.output_lock(out, "export"):  # one writer per output: a second is refused, naming the first
        return export_locked(read_drafter(ckpt), Path(out), fmt, dtype, verifier, speculative_tokens, target_gguf)


def export_locked(d: Drafter, out: Path, fmt: str, dtype: str, verifier: str | None, speculative_tokens: int,
                  target_gguf: str | Path | None) -> ExportSummary:
    """`export_drafter`'s work, its output locked."""
    problems = unservable(d.config, fmt)
    if problems:
        raise ValueError(f"{d.folder}: cannot export as {fmt}: " + "; ".join(problems))
    if fmt == formats.FORMAT_GGUF:
        source, count, size = write_gguf(d, out, dtype, target_gguf)
        return ExportSummary(out, fmt, dtype, d.config, count, size, str(source), [])
    tensors = cast_floats(formats.to_format_names(d.tensors, fmt, d.config.family), WEIGHT_DTYPES[dtype])
    torch_dtype = formats.DTYPE_NAMES[WEIGHT_DTYPES[dtype]]
    recorded = recorded_target(d)
    target = verifier or (serving_name(recorded) if recorded else None)
    provenance = {"eaglet_version": __version__, "source_format": d.format, "target": target,
                  "target_revision": recorded_target_revision(d), "step": (d.source.get("eaglet") or {}).get("step")}
    if d.config.family == "dflash" and fmt == formats.FORMAT_EAGLE:
        refuse_own_head_for_sglang(d, verifier or recorded)
        config = formats.build_dflash_config(d.config, torch_dtype, provenance)
    elif d.config.family != EAGLE3:
        if not target:
            raise ValueError(f"{d.folder}: no target recorded; pass --verifier (vLLM's speculators_config.verifier."
                             f"name_or_path is required)")
        config = formats.build_parallel_speculators_config(d.config, torch_dtype, target,
                                                           verifier_architectures(target), provenance)
    elif fmt == formats.FORMAT_EAGLE:
        config = formats.build_eagle_config(d.config, torch_dtype, provenance)
    else:
        if not target:
            raise ValueError(f"{d.folder}: no target recorded; pass --verifier (vLLM's speculators_config.verifier."
                             f"name_or_path is required)")
        config = formats.build_speculators_config(d.config, torch_dtype, target, verifier_architectures(target),
                                                  speculative_tokens, provenance)
    notes = format_warnings(d.config, fmt)
    for n in notes:
        log.warning("%s: %s", out, n)
    formats.write_drafter_folder(out, config, tensors)
    return ExportSummary(out, fmt, dtype, d.config, len(tensors),
                         sum(t.numel() * t.element_size() for t in tensors.values()), target, notes)


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
        return [f"imported {self.source_format} drafter -> {self.out} (eaglet checkpoint: model.safetensors + config.json)",
                f"  hidden {c.hidden_size}, aux layer ids {c.aux_layer_ids}, draft vocab {c.draft_vocab_size} of "
                f"{c.target_vocab_size}, fc_norm {c.fc_norm}, norm_output {c.norm_output}, "
                f"norm_before_residual {c.norm_before_residual}"
                + (", embeddings copied from the target" if self.embeddings_from_target else "")]


@takes_options("import")
def import_drafter(src: str | Path = DECLARED, out: str | Path = DECLARED,
                  target: str | None = DECLARED) -> ImportSummary:
    """Read a drafter in any format and write it as an eaglet checkpoint folder (the layout of
    `training.checkpoints.save_checkpoint`, without training state): fp32 weights, int64 d2t, bool t2d."""
    d = read_drafter(src, target)
    expected = expected_tensors(d.config)
    tensors = {k: v.to(expected[k].dtype) for k, v in d.tensors.items()}
    extra = {"imported_from": str(src), "source_format": d.format, "target": target or recorded_target(d)}
    with formats.output_lock(out, "import"):  # one writer per output: a second is refused, naming the first
        formats.write_drafter_folder(out, export_config(d.config, extra), tensors)
    return ImportSummary(Path(out), d.format, d.config, d.embeddings_from_target)
