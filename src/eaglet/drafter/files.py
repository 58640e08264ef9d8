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

from eaglet import __version__, families, formats, heads, layers, vllm_engine
from eaglet.drafter.config import DraftConfig
from eaglet.drafter.build import DraftModel, build_model
from eaglet.formats.drafters import SECTION, plain_rope_theta, read_field
from eaglet.formats.runs import MODEL_FILE, resolve_checkpoint
from eaglet.target import find_target_gguf, load_heads, resolve_target, serving_name, target_vocabulary, text_config

log = logging.getLogger(__name__)

WEIGHT_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}  # an export's weights (options.EXPORT_DTYPE_NAMES)
# The float dtypes a drafter's weights may be read in: plain floats, which convert to the model's
# fp32 as they are. A float8 (or other quantized) tensor means nothing without its scales.
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
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
        return [
            "field aux_layer_ids is missing or empty: the engines would capture their default layers, "
            "not necessarily the ones the drafter was trained on"
        ]
    problem = layers.aux_ids_problem(ids)
    # Engines concatenate the captured states in layer order, so the ids must increase.
    return (
        [f"field aux_layer_ids {ids}: {problem}; fc takes the three states concatenated in that order"]
        if problem
        else []
    )


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
        return [
            f"field d2t disagrees with t2d at {wrong.numel()} draft ids: draft id {i} + d2t[{i}] = "
            f"{int(targets[i])}, but the {i}-th target id marked in t2d is {int(marked[i])}"
        ]
    return []


def weight_problems(cfg: DraftConfig, tensors: dict[str, torch.Tensor], fmt: str = formats.FORMAT_EAGLET) -> list[str]:
    """Problems of `tensors` (eaglet names) against `cfg`; messages use the names `fmt` stores."""
    expected = expected_tensors(cfg)
    shown = {name: formats.format_name(name, fmt, cfg.family) for name in expected.keys() | tensors.keys()}
    problems = [f"field {shown[n]} missing{MISSING_WHY.get(n, '')}" for n in sorted(expected.keys() - tensors.keys())]
    problems += [
        f"unknown tensor {shown[n]} {list(tensors[n].shape)} (eaglet's drafter has no such weight)"
        for n in sorted(tensors.keys() - expected.keys())
    ]
    sound = set()
    for name in sorted(expected.keys() & tensors.keys()):
        want, got = expected[name], tensors[name]
        if tuple(got.shape) != tuple(want.shape):
            problems.append(f"field {shown[name]} has shape {list(got.shape)}, config.json implies {list(want.shape)}")
        elif kind(got) != kind(want):
            problems.append(f"field {shown[name]} is {got.dtype}, expected a {kind(want)} tensor")
        elif got.is_floating_point() and got.dtype not in FLOAT_DTYPES:
            problems.append(
                f"field {shown[name]} is {got.dtype}, expected one of "
                f"{', '.join(str(d) for d in FLOAT_DTYPES)} (quantized weights are not read: "
                "dequantize them first)"
            )
        elif got.is_floating_point() and not torch.isfinite(got).all():
            problems.append(f"field {shown[name]} holds NaN or Inf")
        else:
            sound.add(name)
    if {"d2t", "t2d"} <= sound:
        problems += vocab_problems(cfg, tensors["d2t"], tensors["t2d"])
    return problems


def check_drafter(
    cfg: DraftConfig,
    tensors: dict[str, torch.Tensor],
    config_where: Path | str,
    weights_where: Path | str,
    fmt: str = formats.FORMAT_EAGLET,
) -> None:
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
    return load_heads(resolve_target(target), torch.float32, roles=(heads.EMBEDDINGS,)).embedding_table()


def default_aux_layer_ids(target: str | None, where: Path) -> list[int]:
    """What the engines capture when a folder names no ids: [2, N//2, N-3] of an N-layer target."""
    if target is None:
        raise ValueError(
            f"{where}: no eagle_aux_hidden_state_layer_ids; the engines then capture [2, N//2, N-3] "
            f"of an N-layer target: pass the target so eaglet can read N"
        )
    return layers.default_aux_ids(text_config(resolve_target(target)).num_hidden_layers)


def whole_vocabulary_head(cfg: DraftConfig, target: str) -> dict[str, torch.Tensor]:
    """A parallel drafter that drafts over the target's whole vocabulary with the target's LM head
    (z-lab's DFlash checkpoints store none): that head, and the identity vocabulary map."""
    if cfg.draft_vocab_size != cfg.target_vocab_size:
        return {}  # a reduced vocabulary needs its own head: left missing, and named so
    head = load_heads(resolve_target(target), torch.float32, roles=(heads.LM_HEAD,)).head().weight
    return {
        LM_HEAD: head.detach().clone(),
        "d2t": torch.zeros(cfg.draft_vocab_size, dtype=torch.long),
        "t2d": torch.ones(cfg.target_vocab_size, dtype=torch.bool),
    }


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


def refuse_edited_engine_fields(c: dict[str, Any], cfg: DraftConfig, where: Path) -> None:
    """A checkpoint's top-level fields (what SGLang reads of the folder as it is) must be those its
    eaglet.draft_config implies: an edit to one side alone would serve one drafter and export another."""
    implied = export_config(cfg, {})
    edited = [k for k in implied if k != "eaglet" and k in c and c[k] != implied[k]]
    if edited:
        k = edited[0]
        raise ValueError(
            f"{where}: field {k} {c[k]!r} is not what eaglet.draft_config implies ({implied[k]!r}); the "
            "file was edited: restore it (or export from another checkpoint)"
        )
    if not families.family(cfg.family).parallel:  # RoPE keys eaglet never writes, but SGLang would read as set
        plain_rope_theta(c, str(where))


def read_drafter(path: str | Path, target: str | None = None) -> Drafter:
    """Read and check a drafter in any format eaglet knows. `target` (a model folder or hub id)
    fills in what a folder may leave to the target: its input embeddings, the default layer ids."""
    folder = resolve_checkpoint(path)
    config_path = folder / formats.DRAFTER_CONFIG_FILE
    c = formats.read_json(config_path)
    if not isinstance(c, dict):
        raise ValueError(f"{config_path}: holds {type(c).__name__}, expected a JSON object (a drafter's config)")
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
        tensors = formats.from_format_names(drop_ignorable(stored, weights_where), fmt, weights_where, cfg.family)
    from_target = False
    if EMBEDDINGS not in tensors and target is not None:
        tensors[EMBEDDINGS], from_target = target_embeddings(target), True
    if LM_HEAD not in tensors and families.family(cfg.family).parallel and target is not None:
        tensors.update(whole_vocabulary_head(cfg, target))
    tensors = bool_mask(tensors)
    check_drafter(cfg, tensors, config_path, weights_where, fmt)
    if fmt == formats.FORMAT_EAGLET:
        refuse_edited_engine_fields(c, cfg, config_path)
    return Drafter(folder, fmt, cfg, tensors, c, from_target)


def export_record(d: Drafter) -> dict[str, Any]:
    """What eaglet's export recorded in an engine folder (`eaglet_export`); {} in other tools' folders."""
    return read_field(d.source, "eaglet_export", str(d.folder / formats.DRAFTER_CONFIG_FILE), SECTION, {})


def recorded_target_revision(d: Drafter) -> str | None:
    """The revision (content hash) of the target the drafter was trained for: an eaglet checkpoint
    and eaglet's exports record it; folders from other tools do not."""
    if d.format == formats.FORMAT_EAGLET:
        field, value = "eaglet.target_revision", d.source["eaglet"].get("target_revision")
    else:
        field, value = "eaglet_export.target_revision", export_record(d).get("target_revision")
    if value is not None and not (isinstance(value, str) and value):
        raise ValueError(
            f"{d.folder / formats.DRAFTER_CONFIG_FILE}: field {field} {value!r} is not a revision (a "
            "content hash eaglet records); restore the file"
        )
    return value


def recorded_target(d: Drafter) -> str | None:
    """The target the drafter was made for, as the folder records it."""
    if d.format == formats.FORMAT_EAGLET:
        field, value = "eaglet.target", d.source["eaglet"].get("target")
    elif d.format == formats.FORMAT_SPECULATORS:
        verifier = (d.source.get("speculators_config") or {}).get("verifier")
        name = verifier.get("name_or_path") if isinstance(verifier, dict) else None
        field, value = "speculators_config.verifier.name_or_path", name
    else:
        field, value = "eaglet_export.target", export_record(d).get("target")
    if value is not None and not (isinstance(value, str) and value):
        raise ValueError(
            f"{d.folder / formats.DRAFTER_CONFIG_FILE}: field {field} {value!r} is not a model folder "
            "or hub id; write the target's folder or id there, or pass --target"
        )
    return value


def export_config(cfg: DraftConfig, extra: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's config.json: the EAGLE-3 / SGLang `LlamaForCausalLMEagle3` config (the same as
    `eaglet export --format eagle` writes, so a checkpoint is also a valid eagle folder in fp32),
    plus eaglet's own record, which `load_checkpoint` reads."""
    engine = {} if families.family(cfg.family).parallel else formats.build_eagle_config(cfg, "float32", None)
    return {**engine, "eaglet": {"draft_config": cfg.to_dict(), **extra}}


def load_draft_weights(model: DraftModel, folder: Path, keep_frozen: bool = False) -> None:
    """A checkpoint's weights into `model`, checked as `read_drafter` checks them (shapes, finite
    values, d2t against t2d): a damaged checkpoint is never resumed from and carried on. With
    `keep_frozen` (a resume, the model built from the target) its frozen weights, the target's
    embeddings among them, must be the model's as built, bit for bit."""
    tensors = bool_mask(formats.read_safetensors(folder / MODEL_FILE))
    check_drafter(model.config, tensors, folder / formats.DRAFTER_CONFIG_FILE, folder / MODEL_FILE)
    if keep_frozen:
        changed = [
            n
            for n, p in model.named_parameters()
            if not p.requires_grad and not torch.equal(tensors[n].to(p.device, p.dtype), p.detach())
        ]
        if changed:
            raise ValueError(
                f"{folder / MODEL_FILE}: field {changed[0]} is not the target's (it is frozen in "
                "training, so the checkpoint was changed since): resume from an earlier checkpoint "
                "(point latest.json at it) or train into another --out"
            )
    model.load_state_dict(tensors)


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
    source = find_target_gguf(
        target_gguf, recorded_target(d), "the drafter must carry that tokenizer, llama-server checks it"
    )
    tensors = {k: v for k, v in d.tensors.items() if k not in (EMBEDDINGS, "t2d")}
    recorded = recorded_target(d)
    provenance = {
        "eaglet_version": __version__,
        "source_format": d.format,
        "target": recorded,
        "target_revision": recorded_target_revision(d),
        "tokenizer_from": source.name,
        "step": (d.source.get("eaglet") or {}).get("step"),
    }
    size = formats.write_gguf_drafter(
        out,
        d.config,
        tensors,
        source,
        WEIGHT_DTYPES[dtype],
        name=f"eaglet drafter for {recorded or 'its target'}",
        provenance=json.dumps(provenance),
        expected_tokens=target_vocabulary(recorded),
    )
    return source, len(tensors), size


def export_gguf_file(path: str | Path, out: str | Path, target_gguf: str | Path | None, dtype: str = "bf16") -> Path:
    """The drafter at `path` (checked) written as llama.cpp's GGUF at `out`; returns `out`."""
    write_gguf(read_drafter(path), Path(out), dtype, target_gguf)
    return Path(out)


# ---------------------------------------------------------------------------------------------
# Folders the serving engines load (export's speculators and eagle formats; eval's vLLM methods)
# ---------------------------------------------------------------------------------------------


def unservable(cfg: DraftConfig, fmt: str) -> list[str]:
    """Variants a format's engine would load and then run wrongly, or cannot load at all."""
    family = families.family(cfg.family)
    if not family.llama_cpp and fmt == formats.FORMAT_GGUF:
        return [f"llama.cpp serves no {family.title} drafter; use --format speculators (vLLM)"]
    if not family.sglang_algorithm and fmt == formats.FORMAT_EAGLE:
        return [f"SGLang serves no {family.title} drafter; use --format speculators (vLLM)"]
    if fmt == formats.FORMAT_GGUF:
        return formats.gguf_unservable(cfg)
    return []


def format_warnings(cfg: DraftConfig, fmt: str) -> list[str]:
    """Things that depend on the engine's version; said, not refused."""
    notes = []
    if fmt == formats.FORMAT_EAGLE and cfg.norm_output:
        notes.append("norm_output: engines without EAGLE-3.1 support ignore it and feed back the pre-norm state")
    if cfg.sliding_window is not None:
        notes.append(
            f"sliding window {cfg.sliding_window} (layer_types sliding_attention): an engine that ignores it "
            "runs the drafter with full attention, which differs once a context is longer than the window"
        )
    if fmt == formats.FORMAT_EAGLE and cfg.norm_before_residual:
        notes.append(
            "norm_before_residual: engines that do not read it keep the un-normalised residual; vLLM and "
            "speculators read it (--format speculators is the safe choice)"
        )
    if fmt == formats.FORMAT_SPECULATORS and cfg.target_hidden_size != cfg.hidden_size:
        notes.append(
            f"target_hidden_size {cfg.target_hidden_size} != hidden_size {cfg.hidden_size}: vLLM reads it, "
            "but the speculators library (0.9) sizes fc by hidden_size and cannot load this folder itself"
        )
    if fmt == formats.FORMAT_EAGLE and cfg.fc_norm:
        notes.append(
            "fc_norm (norm_before_fc: one RMSNorm before fc, input_norm.weight): SGLang reads it from 0.5.23 "
            "on (llama_eagle3.py); older SGLang skips input_norm.weight without a word and drafts wrongly"
        )
    family = families.family(cfg.family)
    if fmt == formats.FORMAT_SPECULATORS and family.vllm_served[1] is not None:
        notes.append(
            f"{family.title} is served by {vllm_engine.serving_versions(cfg.family)} only; newer vLLM refuse it"
        )
    if fmt == formats.FORMAT_EAGLE and cfg.aux_layer_ids[0] != 2:
        notes.append(
            f"aux layer ids {cfg.aux_layer_ids} do not start at 2: SGLang releases with sgl-project/sglang"
            f"#25454 read eagle_config ids whose first is not 1 without the +1, one layer off"
        )
    return notes


def verifier_architectures(name: str) -> list[str]:
    """The verifier's `architectures`, when it is a local model folder (a hub id stays unread)."""
    config = Path(name) / "config.json"
    return list(formats.read_json(config).get("architectures") or []) if config.is_file() else []


def cast_floats(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Weights to `dtype`; d2t and t2d keep their integer and bool dtypes."""
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}


def refuse_own_head_for_sglang(d: Drafter, target: str | None) -> None:
    """SGLang's DFlash drafts with the target's LM head, whatever the folder holds: a drafter whose
    head is not the target's rows (trained, not frozen at --lm-head-init target) would draft
    garbage there, silently. Checked against the target's head."""
    if not target:
        raise ValueError(
            f"{d.folder}: no target recorded; pass --verifier so the DFlash drafter's LM head can be "
            "checked against the target's (SGLang drafts with the target's own)"
        )
    head = load_heads(resolve_target(target), torch.float32, roles=(heads.LM_HEAD,)).head().weight
    rows = head[torch.arange(d.config.draft_vocab_size) + d.tensors["d2t"]]
    if not torch.allclose(rows, d.tensors["lm_head.weight"].float(), rtol=1e-3, atol=1e-5):
        raise ValueError(
            f"{d.folder}: the drafter's LM head is its own, but SGLang's DFLASH drafts with the "
            f"target's: train with --lm-head-init target --freeze-lm-head for SGLang, or use "
            f"--format speculators (vLLM loads the drafter's own head)"
        )


@dataclass
class EngineFolder:
    """What `write_engine_folder` wrote: tensors, bytes, the verifier recorded, the notes said."""

    num_tensors: int
    num_bytes: int
    target: str | None
    notes: list[str]


def write_engine_folder(
    d: Drafter, out: Path, fmt: str, dtype: str = "bf16", verifier: str | None = None, speculative_tokens: int = 3
) -> EngineFolder:
    """The drafter as a folder an engine loads (config.json + model.safetensors, atomically): `fmt`
    speculators (vLLM) or eagle (SGLang, the official EAGLE-3 code); refused where the engine would
    load it and then run it wrongly (`unservable`), with what depends on the engine's version said."""
    problems = unservable(d.config, fmt)
    if problems:
        raise ValueError(f"{d.folder}: cannot export as {fmt}: " + "; ".join(problems))
    tensors = cast_floats(formats.to_format_names(d.tensors, fmt, d.config.family), WEIGHT_DTYPES[dtype])
    torch_dtype = formats.DTYPE_NAMES[WEIGHT_DTYPES[dtype]]
    recorded = recorded_target(d)
    target = verifier or (serving_name(recorded) if recorded else None)
    provenance = {
        "eaglet_version": __version__,
        "source_format": d.format,
        "target": target,
        "target_revision": recorded_target_revision(d),
        "step": (d.source.get("eaglet") or {}).get("step"),
    }
    traits = families.family(d.config.family)
    if traits.injects_context and fmt == formats.FORMAT_EAGLE:  # z-lab's layout, SGLang's DFLASH
        refuse_own_head_for_sglang(d, verifier or recorded)
        config = formats.build_dflash_config(d.config, torch_dtype, provenance)
    elif traits.parallel:
        if not target:
            raise ValueError(
                f"{d.folder}: no target recorded; pass --verifier (vLLM's speculators_config.verifier."
                f"name_or_path is required)"
            )
        config = formats.build_parallel_speculators_config(
            d.config, torch_dtype, target, verifier_architectures(target), provenance
        )
    elif fmt == formats.FORMAT_EAGLE:
        config = formats.build_eagle_config(d.config, torch_dtype, provenance)
    else:
        if not target:
            raise ValueError(
                f"{d.folder}: no target recorded; pass --verifier (vLLM's speculators_config.verifier."
                f"name_or_path is required)"
            )
        config = formats.build_speculators_config(
            d.config, torch_dtype, target, verifier_architectures(target), speculative_tokens, provenance
        )
    notes = format_warnings(d.config, fmt)
    for n in notes:
        log.warning("%s: %s", out, n)
    formats.write_drafter_folder(out, config, tensors)
    return EngineFolder(len(tensors), sum(t.numel() * t.element_size() for t in tensors.values()), target, notes)
