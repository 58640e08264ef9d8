"""Hand a drafter to the serving engines, and take drafters back from them.

Entry functions:

- `export_drafter(ckpt, out, fmt)`: an eaglet checkpoint -> a folder vLLM (`speculators`) or SGLang
  and the official EAGLE-3 code (`eagle`) load (`eaglet export`);
- `import_drafter(src, out)`: a folder in either format (or an eaglet checkpoint) -> an eaglet
  checkpoint folder that `training.checkpoints.load_checkpoint` loads (`eaglet import`);
- `load_drafter(path)`: any of those folders -> a ready `Eagle3Draft`.

Every path goes through `read_drafter`, which checks the drafter before anything is written or
used: tensor names and shapes against the config, `d2t`/`t2d` against each other and the draft
vocabulary, the aux layer ids. A drafter that would load in an engine but draft garbage (no `d2t`,
a vocabulary size that disagrees with `lm_head`) is refused with the file and field named. The
on-disk layouts themselves (config keys, weight names) are defined in `formats/drafters.py`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors import safe_open

from eaglet import __version__, formats, layers
from eaglet.draft_model import DraftConfig, Eagle3Draft
from eaglet.target import find_target_gguf, load_target, resolve_target, serving_name
from eaglet.training.checkpoints import BEST_FILE, CHECKPOINTS_DIR, LATEST_FILE, export_config

log = logging.getLogger(__name__)

EXPORT_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
DEFAULT_SPECULATIVE_TOKENS = 3
EMBEDDINGS = "embed_tokens.weight"
# Why a missing tensor matters, for the error message.
MISSING_WHY = {
    "d2t": " (without it the engines map draft id i to target id i: every draft would be wrong)",
    "t2d": " (the draft vocabulary's mask over the target vocabulary)",
    EMBEDDINGS: " (the folder relies on the target's embeddings: pass the target to copy them)",
}


@dataclass
class Drafter:
    """A drafter read from disk and checked: its config and its tensors under eaglet's names."""

    folder: Path
    format: str  # formats.FORMAT_*
    config: DraftConfig
    tensors: dict[str, torch.Tensor]
    source: dict[str, Any]  # the folder's config.json as read
    embeddings_from_target: bool = False  # the folder had none; the target's were copied in


# ---------------------------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------------------------

def expected_tensors(cfg: DraftConfig) -> dict[str, torch.Tensor]:
    """Names, shapes and dtypes of the drafter `cfg` describes, as meta tensors (nothing allocated),
    taken from the model itself so they cannot drift from draft_model.py."""
    with torch.device("meta"):
        return dict(Eagle3Draft(cfg).state_dict())


def layer_id_problems(cfg: DraftConfig) -> list[str]:
    ids = cfg.aux_layer_ids
    if not ids:
        return ["field aux_layer_ids is missing or empty: the engines would capture their default layers, "
                "not necessarily the ones the drafter was trained on"]
    problem = layers.aux_ids_problem(ids)
    # Engines concatenate the captured states in layer order, so the ids must increase.
    return [f"field aux_layer_ids {ids}: {problem}; fc takes the three states concatenated in that order"] if problem else []


def kind(t: torch.Tensor) -> str:
    return "bool" if t.dtype == torch.bool else "float" if t.is_floating_point() else "integer"


def vocab_problems(cfg: DraftConfig, d2t: torch.Tensor, t2d: torch.Tensor) -> list[str]:
    """`t2d` marks exactly draft_vocab_size target ids, and draft id i maps to the i-th of them."""
    marked = t2d.nonzero().flatten()
    if marked.numel() != cfg.draft_vocab_size:
        return [f"field t2d marks {marked.numel()} target ids, draft_vocab_size is {cfg.draft_vocab_size}"]
    targets = torch.arange(cfg.draft_vocab_size) + d2t.long()
    wrong = (targets != marked).nonzero().flatten()
    if wrong.numel():
        i = int(wrong[0])
        return [f"field d2t disagrees with t2d at {wrong.numel()} draft ids: draft id {i} + d2t[{i}] = "
                f"{int(targets[i])}, but the {i}-th target id marked in t2d is {int(marked[i])}"]
    return []


def weight_problems(cfg: DraftConfig, tensors: dict[str, torch.Tensor], fmt: str = formats.FORMAT_EAGLET) -> list[str]:
    """Problems of `tensors` (eaglet names) against `cfg`; messages use the names `fmt` stores."""
    expected = expected_tensors(cfg)
    shown = {name: formats.format_name(name, fmt) for name in expected.keys() | tensors.keys()}
    problems = [f"field {shown[n]} missing{MISSING_WHY.get(n, '')}" for n in sorted(expected.keys() - tensors.keys())]
    problems += [f"unknown tensor {shown[n]} {list(tensors[n].shape)} (eaglet's drafter has no such weight)"
                 for n in sorted(tensors.keys() - expected.keys())]
    sound = set()
    for name in sorted(expected.keys() & tensors.keys()):
        want, got = expected[name], tensors[name]
        if tuple(got.shape) != tuple(want.shape):
            problems.append(f"field {shown[name]} has shape {list(got.shape)}, config.json implies {list(want.shape)}")
        elif kind(got) != kind(want):
            problems.append(f"field {shown[name]} is {got.dtype}, expected a {kind(want)} tensor")
        elif got.is_floating_point() and not torch.isfinite(got).all():
            problems.append(f"field {shown[name]} holds NaN or Inf")
        else:
            sound.add(name)
    if {"d2t", "t2d"} <= sound:
        problems += vocab_problems(cfg, tensors["d2t"], tensors["t2d"])
    return problems


def check_drafter(cfg: DraftConfig, tensors: dict[str, torch.Tensor], config_where: Path | str,
                  weights_where: Path | str, fmt: str = formats.FORMAT_EAGLET) -> None:
    """Raise one ValueError listing every problem, each with the file and field it is about."""
    problems = [f"{config_where}: {p}" for p in layer_id_problems(cfg)]
    problems += [f"{weights_where}: {p}" for p in weight_problems(cfg, tensors, fmt)]
    if problems:
        raise ValueError("drafter refused:\n  " + "\n  ".join(problems))


# ---------------------------------------------------------------------------------------------
# Reading any drafter folder
# ---------------------------------------------------------------------------------------------

def resolve_checkpoint(path: str | Path) -> Path:
    """A folder with config.json as is; a train run folder (or its checkpoints/) -> its best,
    else latest, checkpoint."""
    p = Path(path)
    if (p / formats.DRAFTER_CONFIG_FILE).exists():
        return p
    for root in (p / CHECKPOINTS_DIR, p):
        for pointer in (BEST_FILE, LATEST_FILE):
            if (root / pointer).exists():
                folder = root / formats.read_json(root / pointer)["path"]
                if not (folder / formats.DRAFTER_CONFIG_FILE).exists():
                    raise FileNotFoundError(f"{root / pointer}: names {folder.name}, which is not a complete "
                                            "checkpoint (deleted or changed by hand); `eaglet train DATA --out "
                                            f"{p} --resume` rewrites the pointers, or name a checkpoint folder")
                return folder
    raise FileNotFoundError(f"{p}: no {formats.DRAFTER_CONFIG_FILE}, and no {CHECKPOINTS_DIR}/{BEST_FILE} pointing at one")


def eaglet_draft_config(c: dict[str, Any], where: Path) -> DraftConfig:
    try:
        return DraftConfig(**c["eaglet"]["draft_config"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{where}: field eaglet.draft_config unusable: {e}") from e


def target_num_layers(target: str) -> int:
    from transformers import AutoConfig  # seconds to import: only where a target is read

    c = AutoConfig.from_pretrained(resolve_target(target).path)
    return (getattr(c, "text_config", None) or c).num_hidden_layers


def target_embeddings(target: str) -> torch.Tensor:
    """The target's input embeddings: read straight from its safetensors when a tensor named
    `*embed_tokens.weight` is there (no model load), else from the loaded model."""
    ref = resolve_target(target)
    folder = Path(ref.path)
    files = formats.weight_files(folder) if folder.is_dir() else []
    for f in (f for f in files if f.suffix == ".safetensors"):
        with safe_open(str(f), framework="pt") as h:
            names = [k for k in h.keys() if k.endswith(EMBEDDINGS)]
            if names:
                return h.get_tensor(min(names, key=len))
    log.info("loading target %s to read its input embeddings", ref.name)
    return load_target(ref, torch.float32, torch.device("cpu")).get_input_embeddings().weight.detach().clone()


def default_aux_layer_ids(target: str | None, where: Path) -> list[int]:
    """What the engines capture when a folder names no ids: [2, N//2, N-3] of an N-layer target."""
    if target is None:
        raise ValueError(f"{where}: no eagle_aux_hidden_state_layer_ids; the engines then capture [2, N//2, N-3] "
                         f"of an N-layer target: pass the target so eaglet can read N")
    return layers.default_aux_ids(target_num_layers(target))


def drop_ignorable(tensors: dict[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
    dropped = sorted(k for k in tensors if k.endswith(formats.IGNORABLE_WEIGHT_SUFFIXES))
    if dropped:
        log.warning("%s: ignoring %s (recomputed at run time, not learned)", where, dropped)
    return {k: v for k, v in tensors.items() if k not in dropped}


def bool_mask(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Some checkpoints store t2d as 0/1 integers; eaglet and the engines mean a bool mask."""
    t2d = tensors.get("t2d")
    if t2d is not None and kind(t2d) == "integer" and bool(((t2d == 0) | (t2d == 1)).all()):
        return {**tensors, "t2d": t2d.bool()}
    return tensors


def read_drafter(path: str | Path, target: str | None = None) -> Drafter:
    """Read and check a drafter in any format eaglet knows. `target` (a model folder or hub id)
    fills in what a folder may leave to the target: its input embeddings, the default layer ids."""
    folder = resolve_checkpoint(path)
    config_path = folder / formats.DRAFTER_CONFIG_FILE
    c = formats.read_json(config_path)
    fmt = formats.detect_drafter_format(c, str(config_path))
    weights_where = ", ".join(str(f) for f in formats.weight_files(folder))
    stored = formats.read_weight_files(folder)
    if fmt == formats.FORMAT_EAGLET:
        cfg, tensors = eaglet_draft_config(c, config_path), stored
    else:
        parse = formats.parse_eagle_config if fmt == formats.FORMAT_EAGLE else formats.parse_speculators_config
        fields, ids = parse(c, str(config_path))
        ids = ids if ids is not None else default_aux_layer_ids(target, config_path)
        try:
            cfg = DraftConfig(**fields, aux_layer_ids=ids)
        except ValueError as e:
            raise ValueError(f"{config_path}: {e}") from e
        tensors = formats.from_format_names(drop_ignorable(stored, weights_where), fmt, weights_where)
    from_target = EMBEDDINGS not in tensors and target is not None
    if from_target:
        tensors[EMBEDDINGS] = target_embeddings(target)
    tensors = bool_mask(tensors)
    check_drafter(cfg, tensors, config_path, weights_where, fmt)
    return Drafter(folder, fmt, cfg, tensors, c, from_target)


def recorded_target_revision(d: Drafter) -> str | None:
    """The revision (content hash) of the target the drafter was trained for: an eaglet checkpoint
    and eaglet's exports record it; folders from other tools do not."""
    if d.format == formats.FORMAT_EAGLET:
        return d.source["eaglet"].get("target_revision")
    return (d.source.get("eaglet_export") or {}).get("target_revision")


def recorded_target(d: Drafter) -> str | None:
    """The target the drafter was made for, as the folder records it."""
    if d.format == formats.FORMAT_EAGLET:
        return d.source["eaglet"].get("target")
    if d.format == formats.FORMAT_SPECULATORS:
        return (d.source.get("speculators_config") or {}).get("verifier", {}).get("name_or_path")
    return (d.source.get("eaglet_export") or {}).get("target")


# ---------------------------------------------------------------------------------------------
# Export
# ---------------------------------------------------------------------------------------------

def unservable(cfg: DraftConfig, fmt: str) -> list[str]:
    """Variants a format's engine would load and then run wrongly."""
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
                          f"--spec-draft-n-max {DEFAULT_SPECULATIVE_TOKENS}"]
        out += [f"  vLLM:   vllm serve {target} --speculative-config '{{\"method\": \"eagle3\", \"model\": "
               f"\"{self.out}\", \"num_speculative_tokens\": {DEFAULT_SPECULATIVE_TOKENS}}}'"]
        if self.format == formats.FORMAT_EAGLE:
            out.append(f"  SGLang: python -m sglang.launch_server --model-path {target} --speculative-algorithm EAGLE3 "
                       f"--speculative-draft-model-path {self.out} --speculative-num-steps 3 "
                       f"--speculative-eagle-topk 1 --speculative-num-draft-tokens 4")
        return out + [f"  note: {n}" for n in self.notes]


def export_drafter(ckpt: str | Path, out: str | Path, fmt: str, dtype: str = "bf16", verifier: str | None = None,
                   speculative_tokens: int = DEFAULT_SPECULATIVE_TOKENS,
                   target_gguf: str | Path | None = None) -> ExportSummary:
    """Write `out` (config.json + model.safetensors, atomically; for gguf one file) in `fmt` from
    a checked drafter. `ckpt`: a checkpoint folder or a train run folder (its best checkpoint)."""
    if fmt not in formats.EXPORT_FORMATS:
        raise ValueError(f"--format {fmt!r}: expected one of {list(formats.EXPORT_FORMATS)}")
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"--dtype {dtype!r}: expected one of {list(EXPORT_DTYPES)}")
    if target_gguf is not None and fmt != formats.FORMAT_GGUF:
        raise ValueError(f"--target-gguf: only --format gguf carries the target's tokenizer (this is --format {fmt})")
    d = read_drafter(ckpt)
    problems = unservable(d.config, fmt)
    if problems:
        raise ValueError(f"{d.folder}: cannot export as {fmt}: " + "; ".join(problems))
    if fmt == formats.FORMAT_GGUF:
        return export_gguf(d, Path(out), dtype, target_gguf)
    tensors = cast_floats(formats.to_format_names(d.tensors, fmt), EXPORT_DTYPES[dtype])
    torch_dtype = formats.DTYPE_NAMES[EXPORT_DTYPES[dtype]]
    recorded = recorded_target(d)
    target = verifier or (serving_name(recorded) if recorded else None)
    provenance = {"eaglet_version": __version__, "source_format": d.format, "target": target,
                  "target_revision": recorded_target_revision(d), "step": (d.source.get("eaglet") or {}).get("step")}
    if fmt == formats.FORMAT_EAGLE:
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
    return ExportSummary(Path(out), fmt, dtype, d.config, len(tensors),
                         sum(t.numel() * t.element_size() for t in tensors.values()), target, notes)


def export_gguf(d: Drafter, out: Path, dtype: str, target_gguf: str | Path | None) -> ExportSummary:
    """The drafter as one llama.cpp eagle3 GGUF (formats/gguf_drafter.py): q/k rows in ggml's RoPE
    order, d2t absolute, no t2d, no embeddings (llama.cpp uses the target's, which the drafter
    copied frozen)."""
    if out.suffix != formats.GGUF_SUFFIX:
        raise ValueError(f"--out {out}: --format gguf writes one file; give a path ending {formats.GGUF_SUFFIX}")
    if out.exists():
        raise FileExistsError(f"--out {out} already exists; remove it or choose another path")
    source = find_target_gguf(target_gguf, recorded_target(d),
                              "the drafter must carry that tokenizer, llama-server checks it")
    tensors = {k: v for k, v in d.tensors.items() if k not in (EMBEDDINGS, "t2d")}
    recorded = recorded_target(d)
    provenance = {"eaglet_version": __version__, "source_format": d.format, "target": recorded,
                  "target_revision": recorded_target_revision(d), "tokenizer_from": source.name,
                  "step": (d.source.get("eaglet") or {}).get("step")}
    size = formats.write_gguf_drafter(out, d.config, tensors, source, EXPORT_DTYPES[dtype],
                                      name=f"eaglet drafter for {recorded or 'its target'}",
                                      provenance=json.dumps(provenance))
    return ExportSummary(out, formats.FORMAT_GGUF, dtype, d.config, len(tensors), size,
                         str(source), [])


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


def import_drafter(src: str | Path, out: str | Path, target: str | None = None) -> ImportSummary:
    """Read a drafter in any format and write it as an eaglet checkpoint folder (the layout of
    `training.checkpoints.save_checkpoint`, without training state): fp32 weights, int64 d2t, bool t2d."""
    d = read_drafter(src, target)
    expected = expected_tensors(d.config)
    tensors = {k: v.to(expected[k].dtype) for k, v in d.tensors.items()}
    extra = {"imported_from": str(src), "source_format": d.format, "target": target or recorded_target(d)}
    formats.write_drafter_folder(out, export_config(d.config, extra), tensors)
    return ImportSummary(Path(out), d.format, d.config, d.embeddings_from_target)


class LoadedDrafter(NamedTuple):
    model: Eagle3Draft
    target: str | None  # the target to run it with: the one given, else the one recorded
    target_revision: str | None  # the revision of the target it was trained for, where recorded


def load_drafter_for_target(path: str | Path, target: str | None = None) -> LoadedDrafter:
    """A checked drafter in eval mode from an eaglet checkpoint (or train run folder) or a
    speculators / EAGLE-3 / SGLang folder, and its target: `target` if given, else the one the
    folder records. `target` supplies embeddings or layer ids a folder leaves to the target
    (see `read_drafter`)."""
    d = read_drafter(path, target)
    model = Eagle3Draft(d.config)
    model.load_state_dict(d.tensors)  # copy_ converts bf16 weights to the model's fp32
    return LoadedDrafter(model.eval(), target or recorded_target(d), recorded_target_revision(d))


def load_drafter(path: str | Path, target: str | None = None) -> Eagle3Draft:
    return load_drafter_for_target(path, target).model


__all__ = ["export_drafter", "import_drafter", "load_drafter", "load_drafter_for_target", "read_drafter", "check_drafter", "Drafter",
           "ExportSummary", "ImportSummary"]
