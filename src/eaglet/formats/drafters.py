"""Drafter folders for the serving engines (`eaglet export` writes them, `eaglet import` reads
them): eaglet's own training checkpoints, the official EAGLE-3 / SGLang layout and speculators'
(vLLM), each a `config.json` plus weights, written as one folder atomically.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from eaglet import families, layers
from eaglet.formats.io import (
    atomic_dir,
    inside_folder,
    read_safetensors,
    read_weight_index,
    refuse_non_file,
    torch_load_safe,
)

log = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------
# eaglet's own tensor names (eaglet.drafter) already are the official EAGLE-3 / SGLang names, so
# the maps below only list what differs. Matched against:
#   vLLM  vllm/model_executor/models/llama_eagle3.py @ 00bd149 (Eagle3LlamaForCausalLM.load_weights:
#         `midlayer.` -> `layers.0.`, `d2t` -> draft_id_to_target_id, `t2d` skipped, `embed_tokens`
#         loaded when present (v1/spec_decode shares the target's when absent or identical), q/k/v and
#         gate/up stacked into qkv_proj / gate_up_proj); vllm/transformers_utils/configs/speculators/
#         base.py + algos.py @ cfb173a (update_eagle3: draft_vocab_size, target_hidden_size,
#         `norm_before_residual` defaulting to TRUE when absent, eagle_aux_hidden_state_layer_ids);
#         vllm/v1/worker/gpu_model_runner.py `_get_eagle3_aux_layers_from_config` (top-level
#         `eagle_aux_hidden_state_layer_ids` first, then `eagle_config[...]`, ids in HF
#         hidden_states indexing: the target captures *before* decoder layer id).
#   SGLang python/sglang/srt/models/llama_eagle3.py @ 03d5a77 (LlamaForCausalLMEagle3: names as
#         eaglet's, optional `model.` prefix, unknown names skipped silently, `d2t` -> hot_token_id,
#         lm_head tied to embed_tokens when `tie_word_embeddings`); models/llama.py @ 0023954
#         (set_eagle3_layers_to_capture adds 1 to `eagle_config.eagle_aux_hidden_state_layer_ids`:
#         SGLang ids name the *output* of decoder layer id, i.e. HF id - 1; sgl-project/sglang#25454
#         keeps the +1 only when the first id is 1); speculative/eagle_worker.py (`eagle_config`).
#   speculators src/speculators/models/eagle3/config.py @ 27ec382 (Eagle3SpeculatorConfig),
#         src/speculators/config.py (SpeculatorsConfig, VerifierConfig), proposals/greedy.py,
#         convert/eagle/eagle3_converter.py @ ef8d232 (`midlayer.` -> `layers.0.`, embeddings kept);
#         `norm_before_fc` is one RMSNorm over the 3H concat with weight `input_norm.weight`
#         (vllm-project/speculators#337, vllm-project/vllm#36545), which is eaglet's `fc_norm`.
# ---------------------------------------------------------------------------------------------

DRAFTER_CONFIG_FILE = "config.json"
DRAFTER_WEIGHTS_FILE = "model.safetensors"
FORMAT_EAGLET = "eaglet"  # a training checkpoint: config.json with an "eaglet" section
FORMAT_EAGLE = "eagle"  # official EAGLE-3 / SGLang `LlamaForCausalLMEagle3`
FORMAT_SPECULATORS = "speculators"  # vLLM / speculators `Eagle3Speculator`
FORMAT_GGUF = "gguf"  # one llama.cpp eagle3 GGUF file (formats/gguf_drafter.py)
EAGLE_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
SPECULATORS_ARCHITECTURE = families.EAGLE3.speculators_architecture
EAGLE3 = families.EAGLE3.name  # the chain family, whose layouts the functions below default to
# eaglet name prefix -> name prefix in the format. `fc_norm` is eaglet's single RMSNorm over the
# 3H concat; the engines call that `norm_before_fc` / `input_norm` (their `fc_norm` is per layer).
FORMAT_RENAMES: dict[str, tuple[tuple[str, str], ...]] = {
    FORMAT_EAGLET: (),
    FORMAT_EAGLE: (("fc_norm.", "input_norm."),),
    FORMAT_SPECULATORS: (("midlayer.", "layers.0."), ("fc_norm.", "input_norm.")),
}
# Buffers some older checkpoints carry that hold no learned state (RoPE is recomputed).
IGNORABLE_WEIGHT_SUFFIXES = ("rotary_emb.inv_freq",)
DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float16: "float16"}


def _rename(name: str, renames: tuple[tuple[str, str], ...]) -> str:
    for old, new in renames:
        if name.startswith(old):
            return new + name[len(old) :]
    return name


def renames(fmt: str, family: str) -> tuple[tuple[str, str], ...]:
    """The renames of `fmt` for a drafter family: EAGLE-3's chain drafter keeps the names of its
    first release (midlayer, fc_norm); the parallel drafters' names are the engines' already."""
    return () if families.family(family).parallel else FORMAT_RENAMES[fmt]


def format_name(name: str, fmt: str, family: str = EAGLE3) -> str:
    """An eaglet tensor name as `fmt` stores it."""
    return _rename(name, renames(fmt, family))


def to_format_names(tensors: dict[str, torch.Tensor], fmt: str, family: str = EAGLE3) -> dict[str, torch.Tensor]:
    return {format_name(k, fmt, family): v for k, v in tensors.items()}


def from_format_names(
    tensors: dict[str, torch.Tensor], fmt: str, where: str, family: str = EAGLE3
) -> dict[str, torch.Tensor]:
    """Names as stored in `fmt` -> eaglet names. SGLang also accepts each name with a `model.`
    prefix (its params live under `model.`), so an eagle folder may use either spelling."""
    back = tuple((new, old) for old, new in renames(fmt, family))
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        plain = name[len("model.") :] if fmt == FORMAT_EAGLE and name.startswith("model.") else name
        ours = _rename(plain, back)
        if ours in out:
            raise ValueError(f"{where}: two tensors map to {ours!r} (one is {name!r})")
        out[ours] = t
    return out


def _llama_block(cfg: Any, model_type: str = "llama") -> dict[str, Any]:
    """The Llama keys of the decoder layers, as a LlamaConfig dict (eagle: top level; speculators:
    `transformer_layer_config`; DFlash's Qwen3 layers: `model_type` qwen3, the same keys). `vocab_size`
    is the target's vocabulary."""
    return {
        "model_type": model_type,
        "num_hidden_layers": cfg.num_layers,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.target_vocab_size,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,  # SGLang would make lm_head the embedding matrix otherwise
        **(
            {"sliding_window": cfg.sliding_window, "layer_types": ["sliding_attention"]}
            if cfg.sliding_window is not None
            else {}
        ),
    }


@dataclass(frozen=True)
class Kind:
    """What a config.json field must hold: a test, and the words that say it in a refusal."""

    holds: Callable[[Any], bool]
    expected: str


def _integer(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)  # JSON `true` is a Python int, and no count


COUNT = Kind(lambda v: _integer(v) and v >= 1, "an integer >= 1")
INDEX = Kind(lambda v: _integer(v) and v >= 0, "an integer >= 0")
POSITIVE = Kind(lambda v: (_integer(v) or isinstance(v, float)) and math.isfinite(v) and v > 0, "a finite number > 0")
SWITCH = Kind(lambda v: isinstance(v, bool), "true or false")  # "false" would read as true
SECTION = Kind(lambda v: isinstance(v, dict), "an object")
LIST = Kind(lambda v: isinstance(v, list), "a list")
SECTIONS = Kind(
    lambda v: isinstance(v, list) and bool(v) and all(isinstance(m, dict) for m in v), "a non-empty list of objects"
)
LAYER_IDS = Kind(layers.is_id_list, "a list of integer layer ids")
NAMES = Kind(lambda v: isinstance(v, list) and all(isinstance(a, str) for a in v), "a list of class names")
REQUIRED: Any = object()  # read_field's default for a field the folder must have
PLAIN_ROPE = "eaglet's drafter uses plain RoPE"


def _refuse(where: str, field: str, value: Any, why: str) -> ValueError:
    return ValueError(f"{where}: field {field} = {value!r}: {why}")


def read_field(
    c: dict[str, Any], key: str, where: str, kind: Kind, default: Any = REQUIRED, prefix: str = "", why: str = ""
) -> Any:
    """`c[key]` checked against `kind`; absent or null: `default` (REQUIRED: refused as missing).
    Every config.json field the readers below use comes through here, so a wrong kind or a
    meaningless value is refused naming the file (`where`) and the field (`prefix` + key), never
    met later as a raw TypeError, or as a string Python happens to convert."""
    value = c.get(key)
    if value is None:
        if default is REQUIRED:
            raise ValueError(f"{where}: field {prefix}{key} missing: expected {kind.expected}{why}")
        return default
    if not kind.holds(value):
        raise _refuse(where, prefix + key, value, f"expected {kind.expected}{why}")
    return value


def _agreed(key: str, where: str, kind: Kind, places: list[tuple[str, dict[str, Any]]], default: Any) -> Any:
    """A field a layout may keep in several places, (prefix, section) each: every one present is
    checked, and they must agree. Engines differ on which they read (transformers takes
    rope_parameters' rope_theta over the top-level one), so a folder that says two things is refused."""
    found = [(prefix + key, read_field(section, key, where, kind, None, prefix)) for prefix, section in places]
    found = [(name, value) for name, value in found if value is not None]
    for name, value in found[1:]:
        if value != found[0][1]:
            raise ValueError(
                f"{where}: field {found[0][0]} = {found[0][1]!r} and field {name} = {value!r} disagree "
                "(the engines differ on which they read): make them one value"
            )
    if found:
        return found[0][1]
    if default is REQUIRED:
        raise ValueError(f"{where}: field {places[0][0]}{key} missing: expected {kind.expected}")
    return default


def _switch(key: str, where: str, places: list[tuple[str, dict[str, Any]]]) -> bool:
    return bool(_agreed(key, where, SWITCH, places, False))


def architectures(c: dict[str, Any], where: str) -> list[str]:
    return list(read_field(c, "architectures", where, NAMES, []))


def _sliding_window(block: dict[str, Any], where: str) -> int | None:
    """The one layer's window, read as speculators does: sliding only when `layer_types` says so
    (a `sliding_window` without `layer_types` is full attention there)."""
    layer_types = read_field(block, "layer_types", where, LIST, [])
    if not layer_types or layer_types[0] != "sliding_attention":
        return None
    return int(read_field(block, "sliding_window", where, COUNT, why=" (layer_types says sliding_attention)"))


def plain_rope_theta(block: dict[str, Any], where: str) -> float:
    """Plain RoPE's base. transformers (and vLLM) read RoPE from the top level, `rope_parameters`
    and `rope_scaling` together; any variant eaglet's drafter does not run (a scaled type, per
    layer type parameters, a rotary over part of each head) is refused rather than run as plain RoPE."""
    places = [("", block)] + [
        (f"{key}.", section)
        for key in ("rope_parameters", "rope_scaling")
        if (section := read_field(block, key, where, SECTION, None)) is not None
    ]
    for prefix, section in places[1:]:
        type_key = "rope_type" if "rope_type" in section else "type"
        if section.get(type_key, "default") != "default":
            raise _refuse(where, prefix + type_key, section[type_key], PLAIN_ROPE)
        nested = next((k for k, v in section.items() if isinstance(v, dict)), None)
        if nested is not None:
            raise _refuse(
                where, prefix + nested, section[nested], f"{PLAIN_ROPE}, one set of parameters (not one per layer type)"
            )
    for prefix, section in places:
        factor = read_field(section, "partial_rotary_factor", where, POSITIVE, 1.0, prefix)
        if factor != 1.0:
            raise _refuse(
                where,
                prefix + "partial_rotary_factor",
                factor,
                f"{PLAIN_ROPE} over the whole head "
                f"(transformers and vLLM would rotate only head_dim * {factor} of its dims)",
            )
    return float(_agreed("rope_theta", where, POSITIVE, places, 10000.0))


def _llama_fields(block: dict[str, Any], where: str, layers_of: str | None = None) -> dict[str, Any]:
    """DraftConfig fields from a Llama block; variants eaglet's drafter cannot run are refused.
    `layers_of`: the parallel family whose drafters have num_hidden_layers layers (EAGLE-3: one)."""
    hidden, heads, intermediate, vocab = (
        read_field(block, key, where, COUNT)
        for key in ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")
    )
    layer_count = read_field(block, "num_hidden_layers", where, COUNT, 1)
    if layers_of is None and layer_count != 1:
        raise _refuse(where, "num_hidden_layers", layer_count, "eaglet's EAGLE-3 drafters have one decoder layer")
    if block.get("hidden_act", "silu") != "silu":
        raise _refuse(where, "hidden_act", block["hidden_act"], "eaglet's MLP is SwiGLU (silu)")
    for key in ("attention_bias", "mlp_bias", "tie_word_embeddings"):
        if read_field(block, key, where, SWITCH, False):
            raise _refuse(where, key, block[key], "not supported by eaglet's drafter")
    return dict(
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=read_field(block, "num_key_value_heads", where, COUNT, heads),
        head_dim=read_field(block, "head_dim", where, COUNT, hidden // heads),
        intermediate_size=intermediate,
        rms_norm_eps=float(read_field(block, "rms_norm_eps", where, POSITIVE, 1e-6)),
        rope_theta=plain_rope_theta(block, where),
        max_position_embeddings=read_field(block, "max_position_embeddings", where, COUNT, layers.UNBOUNDED_POSITIONS),
        target_vocab_size=vocab,
        sliding_window=_sliding_window(block, where),
        **({"num_layers": layer_count, "family": layers_of} if layers_of else {}),
    )


def _vocab_fields(c: dict[str, Any], fields: dict[str, Any], where: str, draft_vocab_default: Any) -> dict[str, Any]:
    """The Llama block's fields with the drafter's vocabulary and the width of the states it reads."""
    why = " (engines disagree on the default)" if draft_vocab_default is REQUIRED else ""
    return {
        **fields,
        "draft_vocab_size": read_field(c, "draft_vocab_size", where, COUNT, draft_vocab_default, why=why),
        "target_hidden_size": read_field(c, "target_hidden_size", where, COUNT, fields["hidden_size"]),
    }


def _draft_fields(
    c: dict[str, Any],
    fields: dict[str, Any],
    where: str,
    norm_before_residual: bool,
    norm_before_fc: bool,
    per_layer_fc_norm: bool,
    norm_output: bool,
) -> dict[str, Any]:
    """The EAGLE-3 fields both formats share, on top of the Llama block's."""
    if per_layer_fc_norm:
        raise _refuse(
            where,
            "fc_norm",
            per_layer_fc_norm,
            "per-layer norms before fc are not eaglet's fc_norm (one RMSNorm over the concat, `norm_before_fc`)",
        )
    return {
        **_vocab_fields(c, fields, where, REQUIRED),
        "fc_norm": norm_before_fc,
        "norm_output": norm_output,
        "norm_before_residual": norm_before_residual,
    }


def _layer_ids(c: dict[str, Any], key: str, where: str, prefix: str = "") -> list[int] | None:
    """A list of layer ids, or None when the folder names none (engines then use their defaults)."""
    return list(read_field(c, key, where, LAYER_IDS, [], prefix)) or None


def _speculative_tokens(c: dict[str, Any], where: str, default: Any = None) -> Any:
    """The drafts per pass of a speculators config (its first proposal method's, as vLLM reads
    them), its verifier checked on the way: vLLM serves the folder with these, so they are checked
    even where eaglet itself does not need them."""
    spec = read_field(c, "speculators_config", where, SECTION, {})
    read_field(spec, "verifier", where, SECTION, None, "speculators_config.")
    methods = read_field(spec, "proposal_methods", where, SECTIONS, [{}], "speculators_config.")
    return read_field(
        methods[0], "speculative_tokens", where, COUNT, default, "speculators_config.proposal_methods[0]."
    )


def build_eagle_config(cfg: Any, torch_dtype: str, provenance: dict[str, Any] | None) -> dict[str, Any]:
    """config.json of an EAGLE-3 / SGLang folder (`LlamaForCausalLMEagle3`); `provenance`
    (eaglet version, source, target) is recorded under `eaglet_export` when given."""
    config = {
        "architectures": [EAGLE_ARCHITECTURES[0]],
        **_llama_block(cfg),
        "torch_dtype": torch_dtype,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        # vLLM reads the top-level ids first (HF indexing); SGLang reads only eagle_config's, as
        # output-of-layer ids (it adds 1), so the two lists differ by one on purpose.
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": layers.to_sglang(cfg.aux_layer_ids),
            "use_aux_hidden_state": True,
        },
        # SGLang >= 0.5.23 reads norm_before_fc (its input_norm, eaglet's fc_norm)
        "norm_before_residual": cfg.norm_before_residual,
        "norm_before_fc": cfg.fc_norm,
        "norm_output": cfg.norm_output,
    }
    return {**config, "eaglet_export": provenance} if provenance is not None else config


def parse_eagle_config(c: dict[str, Any], where: str) -> tuple[dict[str, Any], list[int] | None]:
    """(DraftConfig fields, aux ids in HF indexing or None when the folder names none)."""
    if not any(a in EAGLE_ARCHITECTURES for a in architectures(c, where)):
        raise _refuse(where, "architectures", c.get("architectures"), f"expected one of {list(EAGLE_ARCHITECTURES)}")
    eagle = read_field(c, "eagle_config", where, SECTION, {})
    if not read_field(eagle, "use_aux_hidden_state", where, SWITCH, True, "eagle_config."):
        raise _refuse(where, "eagle_config.use_aux_hidden_state", False, "not an EAGLE-3 drafter (no fused aux states)")
    places = [("", c), ("eagle_config.", eagle)]  # engines read the norm switches from either
    fields = _draft_fields(
        c,
        _llama_fields(c, where),
        where,
        *(_switch(key, where, places) for key in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")),
    )
    top = _layer_ids(c, "eagle_aux_hidden_state_layer_ids", where)
    nested = _layer_ids(eagle, "eagle_aux_hidden_state_layer_ids", where, "eagle_config.")
    if top:
        if nested and nested not in (top, layers.to_sglang(top)):
            raise ValueError(
                f"{where}: eagle_aux_hidden_state_layer_ids {top} and eagle_config."
                f"eagle_aux_hidden_state_layer_ids {nested} name different layers"
            )
        return fields, top
    if nested:
        if nested[0] != 1:
            log.warning(
                "%s: eagle_config.eagle_aux_hidden_state_layer_ids %s: read as capture-before-layer ids "
                "(as SGLang >= #25454 does; older SGLang adds 1)",
                where,
                nested,
            )
        return fields, layers.from_sglang(nested)
    return fields, None


def build_speculators_config(
    cfg: Any,
    torch_dtype: str,
    verifier_name: str,
    verifier_architectures: list[str],
    speculative_tokens: int,
    provenance: dict[str, Any],
) -> dict[str, Any]:
    """config.json of a speculators `Eagle3Speculator` folder (what vLLM's SpeculatorsConfig reads)."""
    return {
        "architectures": [SPECULATORS_ARCHITECTURE],
        "speculators_model_type": families.EAGLE3.speculators_type,
        "transformer_layer_config": _llama_block(cfg),
        "speculators_config": {
            "algorithm": families.EAGLE3.speculators_type,
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": speculative_tokens,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier_name, "architectures": list(verifier_architectures)},
        },
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
        # Written even when false: vLLM's update_eagle3 defaults a missing norm_before_residual to true.
        "norm_before_residual": cfg.norm_before_residual,
        "norm_before_fc": cfg.fc_norm,
        "fc_norm": False,
        "norm_output": cfg.norm_output,
        "torch_dtype": torch_dtype,
        "eaglet_export": provenance,
    }


def parse_speculators_config(c: dict[str, Any], where: str) -> tuple[dict[str, Any], list[int] | None]:
    """(DraftConfig fields, aux ids in HF indexing or None) of a speculators eagle3 config."""
    if c.get("speculators_model_type") != families.EAGLE3.speculators_type:
        raise _refuse(
            where,
            "speculators_model_type",
            c.get("speculators_model_type"),
            f"expected one of {sorted({f.speculators_type for f in families.FAMILIES.values()})}",
        )
    block = read_field(c, "transformer_layer_config", where, SECTION)
    _speculative_tokens(c, where)
    residual = read_field(c, "norm_before_residual", where, SWITCH, why=" (vLLM then assumes true, speculators false)")
    fields = _draft_fields(
        c,
        _llama_fields(block, f"{where} transformer_layer_config"),
        where,
        residual,
        *(read_field(c, key, where, SWITCH, False) for key in ("norm_before_fc", "fc_norm", "norm_output")),
    )
    return fields, _layer_ids(c, "eagle_aux_hidden_state_layer_ids", where)


# ---------------------------------------------------------------------------------------------
# The parallel drafters (eaglet.drafter.parallel). Matched against:
#   speculators 0.9 models/peagle/config.py (PEagleSpeculatorConfig: `peagle`, mask_token_id,
#         embed_requires_grad, EAGLE-3's fields; `mask_hidden` [1, 1, 3H]) and models/dflash
#         (DFlashSpeculatorConfig: block_size, aux_hidden_state_layer_ids, mask_token_id,
#         sliding_window_non_causal, sample_from_anchor; Qwen3 layers with q_norm / k_norm);
#   vLLM transformers_utils/configs/speculators/algos.py (update_peagle: method eagle3 with
#         parallel_drafting, pard_token = mask_token_id, PeagleLlamaForCausalLM served by
#         llama_eagle3.Eagle3LlamaForCausalLM, whose load_weights requires `mask_hidden`;
#         update_dflash: DFlashDraftModel, dflash_config {mask_token_id, target_layer_ids = aux - 1,
#         causal: not sliding_window_non_causal}) and models/qwen3_dflash.py (load_weights: `d2t` ->
#         draft_id_to_target_id, `t2d` skipped, embed_tokens / lm_head from the target when absent);
#   z-lab/dflash model.py and SGLang models/dflash.py (`DFlashDraftModel`: dflash_config
#         {mask_token_id, target_layer_ids: output-of-layer ids, block_size}; no embeddings or LM head
#         of its own: the target's are used, other names are skipped).
# ---------------------------------------------------------------------------------------------


def speculators_family(kind: Any) -> str | None:
    """The parallel family whose speculators export has speculators_model_type `kind` (the first
    registered, so a built-in family wins over a variant registered with its type), or None."""
    return next((f.name for f in families.FAMILIES.values() if f.parallel and f.speculators_type == kind), None)


DFLASH_ARCHITECTURE = "DFlashDraftModel"  # z-lab's layout, which SGLang (and vLLM) load


def build_parallel_speculators_config(
    cfg: Any, torch_dtype: str, verifier_name: str, verifier_architectures: list[str], provenance: dict[str, Any]
) -> dict[str, Any]:
    """config.json of a speculators P-EAGLE (`peagle`) or DFlash folder, what vLLM's SpeculatorsConfig reads."""
    family = families.family(cfg.family)
    kind = family.speculators_type
    config: dict[str, Any] = {
        "architectures": [family.speculators_architecture],
        "speculators_model_type": kind,
        "transformer_layer_config": _llama_block(cfg, family.layer_model_type),
        "speculators_config": {
            "algorithm": kind,
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": family.drafts_per_pass(cfg.block_size),
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier_name, "architectures": list(verifier_architectures)},
        },
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "mask_token_id": cfg.mask_token_id,
        "torch_dtype": torch_dtype,
    }
    if family.injects_context:  # DFlash's schema
        # vLLM turns sliding_window_non_causal into dflash_config.causal = not it, for every layer: an
        # explicit false would make the block causal there (its default, the key absent, is non-causal);
        # speculators' blocks are bidirectional without a sliding window whatever it says
        config.update(
            block_size=cfg.block_size,
            aux_hidden_state_layer_ids=list(cfg.aux_layer_ids),
            sliding_window_non_causal=True,
            sample_from_anchor=False,
        )
    else:  # EAGLE-3's fields, all off: eaglet's P-EAGLE has none of those norms
        config.update(
            eagle_aux_hidden_state_layer_ids=list(cfg.aux_layer_ids),
            norm_before_residual=False,
            norm_before_fc=False,
            fc_norm=False,
            norm_output=False,
            embed_requires_grad=False,
        )
    return {**config, "eaglet_export": provenance}


def _parallel_fields(
    c: dict[str, Any],
    block: dict[str, Any],
    where: str,
    block_where: str,
    family: str,
    block_size: int,
    mask_token_id: int,
) -> dict[str, Any]:
    """DraftConfig fields of a parallel drafter: its layers' (`block`, read at `block_where`),
    vocabulary (none: the whole vocabulary), block and mask token."""
    fields = _llama_fields(block, block_where, family)
    return {
        **_vocab_fields(c, fields, where, fields["target_vocab_size"]),
        "block_size": block_size,
        "mask_token_id": mask_token_id,
    }


def parse_parallel_speculators_config(c: dict[str, Any], where: str) -> tuple[dict[str, Any], list[int] | None]:
    """(DraftConfig fields, aux ids in HF indexing or None) of a speculators `peagle` / `dflash` config."""
    family = speculators_family(c["speculators_model_type"])
    assert family is not None, "parse_engine_config reads only the parallel families' types here"
    block = read_field(c, "transformer_layer_config", where, SECTION)
    dflash = families.family(family).injects_context
    drafts = _speculative_tokens(c, where, None if dflash else REQUIRED)  # P-EAGLE's block size
    if dflash:  # DFlash's schema
        if read_field(c, "sample_from_anchor", where, SWITCH, False):
            raise _refuse(
                where, "sample_from_anchor", True, "DSpark, not plain DFlash (eaglet's anchor predicts nothing)"
            )
        ids_key, block_size = "aux_hidden_state_layer_ids", read_field(c, "block_size", where, COUNT)
    else:
        for key in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"):
            if read_field(c, key, where, SWITCH, False):
                raise _refuse(where, key, c[key], "eaglet's P-EAGLE drafter has no such norm")
        ids_key, block_size = "eagle_aux_hidden_state_layer_ids", drafts
    fields = _parallel_fields(
        c,
        block,
        where,
        f"{where} transformer_layer_config",
        family,
        block_size,
        read_field(c, "mask_token_id", where, INDEX),
    )
    return fields, _layer_ids(c, ids_key, where)


def build_dflash_config(cfg: Any, torch_dtype: str, provenance: dict[str, Any]) -> dict[str, Any]:
    """config.json of z-lab's `DFlashDraftModel` layout (SGLang's DFLASH loads it): Qwen3 keys, and
    the target layers as output-of-layer ids (HF id - 1)."""
    return {
        "architectures": [DFLASH_ARCHITECTURE],
        **_llama_block(cfg, "qwen3"),
        "torch_dtype": torch_dtype,
        "block_size": cfg.block_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "dflash_config": {
            "mask_token_id": cfg.mask_token_id,
            "block_size": cfg.block_size,
            "target_layer_ids": [i - 1 for i in cfg.aux_layer_ids],
        },
        "eaglet_export": provenance,
    }


def parse_dflash_config(c: dict[str, Any], where: str) -> tuple[dict[str, Any], list[int] | None]:
    """(DraftConfig fields, aux ids in HF indexing or None) of a `DFlashDraftModel` config."""
    dflash = read_field(c, "dflash_config", where, SECTION, {})
    places = [("dflash_config.", dflash), ("", c)]
    block_size, mask = (
        _agreed(key, where, kind, places, REQUIRED) for key, kind in (("block_size", COUNT), ("mask_token_id", INDEX))
    )
    fields = _parallel_fields(c, c, where, where, families.DFLASH.name, block_size, mask)
    ids = _layer_ids(dflash, "target_layer_ids", where, "dflash_config.")
    return fields, ([i + 1 for i in ids] if ids else None)


def parse_engine_config(c: dict[str, Any], fmt: str, where: str) -> tuple[dict[str, Any], list[int] | None]:
    """(DraftConfig fields, aux ids or None) of an engine folder's config.json, any family."""
    if fmt == FORMAT_SPECULATORS:
        kind = c.get("speculators_model_type")
        return (
            parse_parallel_speculators_config if speculators_family(kind) is not None else parse_speculators_config
        )(c, where)
    if DFLASH_ARCHITECTURE in architectures(c, where):
        return parse_dflash_config(c, where)
    return parse_eagle_config(c, where)


def detect_drafter_format(c: dict[str, Any], where: str) -> str:
    if "eaglet" in c:
        return FORMAT_EAGLET
    if "speculators_model_type" in c:
        return FORMAT_SPECULATORS
    if any(a in (*EAGLE_ARCHITECTURES, DFLASH_ARCHITECTURE) for a in architectures(c, where)):
        return FORMAT_EAGLE
    raise ValueError(
        f"{where}: not a drafter config (no 'eaglet' section, no speculators_model_type, "
        f"architectures {c.get('architectures')} not in {[*EAGLE_ARCHITECTURES, DFLASH_ARCHITECTURE]})"
    )


def weight_files(folder: Path) -> list[Path]:
    """The weight files of a model folder: an index's shards, or model.safetensors, or pytorch_model.bin."""
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if (folder / index).exists():
            shards = sorted(set(read_weight_index(folder / index).values()))
            return [inside_folder(folder, f, str(folder / index)) for f in shards]
    for name in (DRAFTER_WEIGHTS_FILE, "pytorch_model.bin"):
        if (folder / name).exists():
            refuse_non_file(folder / name, "the drafter's weights")
            return [folder / name]
    raise FileNotFoundError(f"{folder}: no {DRAFTER_WEIGHTS_FILE}, pytorch_model.bin or weight index")


def read_weight_files(folder: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of a model folder; `.bin` files load with weights_only=True (no pickled code runs)."""
    out: dict[str, torch.Tensor] = {}
    for path in weight_files(Path(folder)):
        part = read_safetensors(path) if path.suffix == ".safetensors" else torch_load_safe(path)
        if not isinstance(part, dict) or not all(isinstance(v, torch.Tensor) for v in part.values()):
            raise ValueError(f"{path}: expected a flat dict of tensors")
        for name in part.keys() & out.keys():
            raise ValueError(f"{path}: tensor {name!r} appears in two weight files")
        out.update(part)
    return out


def write_drafter_files(folder: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    """config.json + model.safetensors into `folder` (a temp folder of `atomic_dir`)."""
    save_file(
        {k: v.detach().contiguous().cpu() for k, v in tensors.items()},
        str(folder / DRAFTER_WEIGHTS_FILE),
        metadata={"format": "pt"},
    )
    (folder / DRAFTER_CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def write_drafter_folder(out: str | os.PathLike, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Path:
    """config.json + model.safetensors, written as one atomic folder."""
    with atomic_dir(out) as tmp:
        write_drafter_files(tmp, config, tensors)
    return Path(out)
