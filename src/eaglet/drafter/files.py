"""Drafters on disk as models: read and check any drafter folder eaglet knows (an eaglet
checkpoint or train run folder, a speculators / EAGLE-3 / SGLang export), load it ready to run,
write a checkpoint's config, and write one as llama.cpp's GGUF. Export, import, eval and training's
held-out evaluation all read drafters through `read_drafter`; the on-disk layouts themselves
(config keys, weight names, the GGUF's) are defined in `eaglet.formats`.

`read_drafter` checks the drafter before anything is written or used: tensor names and shapes
against the config, `d2t`/`t2d` against each other and the draft vocabulary, the aux layer ids. A
drafter that would load in an engine but draft garbage (no `d2t`, a vocabulary size that disagrees
with `lm_head`) is refused with the file and field named.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch

from eaglet import __version__, formats, heads, layers, options
from eaglet.drafter.config import DraftConfig
from eaglet.drafter.parallel import DraftModel, build_model
from eaglet.formats.runs import MODEL_FILE, resolve_checkpoint
from eaglet.target import find_target_gguf, load_heads, resolve_target, text_config

log = logging.getLogger(__name__)

WEIGHT_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}  # an export's weights (options.EXPORT_DTYPE_NAMES)
EMBEDDINGS = "embed_tokens.weight"
LM_HEAD = "lm_head.weight"
# Why a missing tensor matters, for the error message.
MISSING_WHY = {
    "d2t": " (without it the engines map draft id i to target id i: every draft would be wrong)",
    "t2d": " (the draft vocabulary's mask over the target vocabulary)",
    EMBEDDINGS: " (the folder relies on the target's embeddings: pass the target to copy them)",
    LM_HEAD: " (a drafter over the whole vocabulary uses the target's LM head: pass the target to copy it)",
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


def expected_tensors(cfg: DraftConfig) -> dict[str, torch.Tensor]:
    """Names, shapes and dtypes of the drafter `cfg` describes, as meta tensors (nothing allocated),
    taken from the model itself so they cannot drift from eaglet.drafter."""
    with torch.device("meta"):
        return dict(build_model(cfg).state_dict())


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
    shown = {name: formats.format_name(name, fmt, cfg.family) for name in expected.keys() | tensors.keys()}
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


def eaglet_draft_config(c: dict[str, Any], where: Path) -> DraftConfig:
    try:
        return DraftConfig(**c["eaglet"]["draft_config"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{where}: field eaglet.draft_config unusable: {e}") from e


def target_embeddings(target: str) -> torch.Tensor:
    """The target's input embeddings in fp32, read alone from its safetensors (`heads.read_heads`:
    a folder with only the shard that holds them is enough), else from the loaded model."""
    return load_heads(resolve_target(target), torch.float32, roles=(heads.EMBEDDINGS,)).embeddings


def default_aux_layer_ids(target: str | None, where: Path) -> list[int]:
    """What the engines capture when a folder names no ids: [2, N//2, N-3] of an N-layer target."""
    if target is None:
        raise ValueError(f"{where}: no eagle_aux_hidden_state_layer_ids; the engines then capture [2, N//2, N-3] "
                         f"of an N-layer target: pass the target so eaglet can read N")
    return layers.default_aux_ids(text_config(resolve_target(target)).num_hidden_layers)


def whole_vocabulary_head(cfg: DraftConfig, target: str) -> dict[str, torch.Tensor]:
    """A parallel drafter that drafts over the target's whole vocabulary with the target's LM head
    (z-lab's DFlash checkpoints store none): that head, and the identity vocabulary map."""
    if cfg.draft_vocab_size != cfg.target_vocab_size:
        return {}  # a reduced vocabulary needs its own head: left missing, and named so
    head = load_heads(resolve_target(target), torch.float32, roles=(heads.LM_HEAD,)).lm_head.weight
    return {LM_HEAD: head.detach().clone(), "d2t": torch.zeros(cfg.draft_vocab_size, dtype=torch.long),
            "t2d": torch.ones(cfg.target_vocab_size, dtype=torch.bool)}


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
        fields, ids = formats.parse_engine_config(c, fmt, str(config_path))
        ids = ids if ids is not None else default_aux_layer_ids(target, config_path)
        try:
            cfg = DraftConfig(**fields, aux_layer_ids=ids)
        except ValueError as e:
            raise ValueError(f"{config_path}: {e}") from e
        tensors = formats.from_format_names(drop_ignorable(stored, weights_where), fmt, weights_where,
                                            cfg.family)
    from_target = EMBEDDINGS not in tensors and target is not None
    if from_target:
        tensors[EMBEDDINGS] = target_embeddings(target)
    if LM_HEAD not in tensors and cfg.family != options.EAGLE3 and target is not None:
        tensors.update(whole_vocabulary_head(cfg, target))
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


def export_config(cfg: DraftConfig, extra: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's config.json: the EAGLE-3 / SGLang `LlamaForCausalLMEagle3` config (the same as
    `eaglet export --format eagle` writes, so a checkpoint is also a valid eagle folder in fp32),
    plus eaglet's own record, which `load_checkpoint` reads."""
    engine = formats.build_eagle_config(cfg, "float32", None) if cfg.family == options.EAGLE3 else {}
    return {**engine, "eaglet": {"draft_config": cfg.to_dict(), **extra}}


def load_draft_weights(model: DraftModel, folder: Path) -> None:
    model.load_state_dict(formats.read_safetensors(folder / MODEL_FILE))


def load_checkpoint(folder: str | Path) -> DraftModel:
    """A trained drafter from a checkpoint folder (config.json + model.safetensors), in eval mode."""
    folder = Path(folder)
    config_path = folder / formats.DRAFTER_CONFIG_FILE
    config = formats.read_json(config_path)
    if "eaglet" not in config:
        raise ValueError(f"{config_path}: not an eaglet checkpoint (no 'eaglet' section)")
    draft = build_model(eaglet_draft_config(config, config_path))
    load_draft_weights(draft, folder)
    return draft.eval()


class LoadedDrafter(NamedTuple):
    model: DraftModel
    target: str | None  # the target to run it with: the one given, else the one recorded
    target_revision: str | None  # the revision of the target it was trained for, where recorded


def load_drafter_for_target(path: str | Path, target: str | None = None) -> LoadedDrafter:
    """A checked drafter in eval mode from an eaglet checkpoint (or train run folder) or a
    speculators / EAGLE-3 / SGLang folder, and its target: `target` if given, else the one the
    folder records. `target` supplies embeddings or layer ids a folder leaves to the target
    (see `read_drafter`)."""
    d = read_drafter(path, target)
    model = build_model(d.config)
    model.load_state_dict(d.tensors)  # copy_ converts bf16 weights to the model's fp32
    return LoadedDrafter(model.eval(), target or recorded_target(d), recorded_target_revision(d))


def load_drafter(path: str | Path, target: str | None = None) -> DraftModel:
    return load_drafter_for_target(path, target).model


def write_gguf(d: Drafter, out: Path, dtype: str, target_gguf: str | Path | None) -> tuple[Path, int, int]:
    """The drafter as one llama.cpp eagle3 GGUF (formats/gguf_drafter.py): q/k rows in ggml's RoPE
    order, d2t absolute, no t2d, no embeddings (llama.cpp uses the target's, which the drafter
    copied frozen). Returns (the target GGUF whose tokenizer it carries, tensors, bytes)."""
    problems = formats.gguf_unservable(d.config)
    if problems:
        raise ValueError(f"{d.folder}: cannot export as {formats.FORMAT_GGUF}: " + "; ".join(problems))
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
    size = formats.write_gguf_drafter(out, d.config, tensors, source, WEIGHT_DTYPES[dtype],
                                      name=f"eaglet drafter for {recorded or 'its target'}",
                                      provenance=json.dumps(provenance))
    return source, len(tensors), size


def export_gguf_file(path: str | Path, out: str | Path, target_gguf: str | Path | None,
                     dtype: str = "bf16") -> Path:
    """The drafter at `path` (checked) written as llama.cpp's GGUF at `out`; returns `out`."""
    write_gguf(read_drafter(path), Path(out), dtype, target_gguf)
    return Path(out)
