"""Kimi-K2.5's own job at toy width: a target built from Kimi-K2.5's real text config (scaled down in
width and depth, its structure kept: MLA with its ranks in proportion, one dense layer first, then
shared + routed experts, a vocabulary padded past the tokenizer with the specials at its top), taken
through prepare -> extract (v1, and the speculators layout vLLM's extraction writes) -> check (the
whole target, then the heads alone) -> train from a folder holding only the heads -> export -> the
engines' loaders. And the layer ids of the real 61-layer target, in both conventions a Kimi user meets."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import make_tiny_tokenizer, write_jsonl
from eaglet import heads, layers
from eaglet.check import check_dataset
from eaglet.drafter import DraftConfig
from eaglet.drafter.config import attention_shape
from eaglet.export import export_drafter
from eaglet.extract import extract
from eaglet.heads import text_config
from eaglet.prepare import prepare
from eaglet.training.loop import train
from helpers import FAST, chat_records, head_only_copy, random_drafter, write_checkpoint
from replays import config, sglang_load, vllm_load
from eaglet.options import CheckOptions, ExportOptions, ExtractOptions, PrepareOptions, TrainOptions

# moonshotai/Kimi-K2.5 config.json, its text_config (the DeepSeek-V3 backbone), as published
KIMI_K25_TEXT = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "attention_bias": False,
    "first_k_dense_replace": 1,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "max_position_embeddings": 262144,
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 1,
    "topk_group": 1,
    "n_routed_experts": 384,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_experts_per_tok": 8,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "num_hidden_layers": 61,
    "rms_norm_eps": 1e-05,
    "rope_theta": 50000.0,
    "routed_scaling_factor": 2.827,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "tie_word_embeddings": False,
    "vocab_size": 163840,
    "bos_token_id": 163584,
    "eos_token_id": 163585,
    "pad_token_id": 163839,
    "rope_scaling": {
        "type": "yarn",
        "factor": 64.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
}
WIDTH = 112  # 7168 -> 64
HEAD_WIDTH = 16  # 128-wide heads -> 8
LAYERS = 8


def scaled_kimi(vocab: int) -> dict:
    """Kimi-K2.5's text config at toy size: widths / WIDTH, head widths / HEAD_WIDTH (heads 64 -> 4),
    61 -> LAYERS layers, 384 -> 8 routed experts (8 -> 2 per token); the rest as published."""
    k = dict(KIMI_K25_TEXT)
    scaled = {
        key: max(8, round(k[key] / WIDTH / 8) * 8)
        for key in ("hidden_size", "intermediate_size", "moe_intermediate_size", "q_lora_rank", "kv_lora_rank")
    }
    scaled |= {
        key: k[key] // HEAD_WIDTH
        for key in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "num_attention_heads", "num_key_value_heads")
    }
    pad = vocab - 1  # the specials at the top of a padded vocabulary, as Kimi's
    return {
        **k,
        **scaled,
        "num_hidden_layers": LAYERS,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "vocab_size": vocab,
        "bos_token_id": pad - 2,
        "eos_token_id": pad - 1,
        "pad_token_id": pad,
        "max_position_embeddings": 1024,
        "rope_scaling": {**k["rope_scaling"], "original_max_position_embeddings": 64},
    }


@pytest.fixture(scope="module")
def kimi(tmp_path_factory) -> dict[str, Path]:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    work = tmp_path_factory.mktemp("kimi")
    full = work / "full"
    full.mkdir()
    tok = make_tiny_tokenizer(full)
    fields = scaled_kimi(vocab=len(tok) + 112)  # padded past the tokenizer, as Kimi's 163,840 is
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**{k: v for k, v in fields.items() if k != "architectures"}))
    with torch.no_grad():
        model.model.norm.weight.copy_(torch.rand(fields["hidden_size"]) + 0.5)
    model.save_pretrained(full, max_shard_size="200KB")
    prep = work / "prep"
    prepare(
        PrepareOptions(
            target=str(full), data=str(write_jsonl(work / "chats.jsonl", chat_records(16))), out=prep, max_length=512
        )
    )
    out = {"full": full, "heads": head_only_copy(full, work / "heads_only"), "prep": prep}
    for layout in ("v1", "speculators"):
        extract(ExtractOptions(prepared=prep, out=work / layout, target=str(full), layout=layout), show_progress=False)
        out[layout] = work / layout
    return out


def test_the_scaled_target_keeps_kimis_structure(kimi):
    c = text_config(kimi["full"])
    assert (c.model_type, c.first_k_dense_replace, c.n_shared_experts) == ("deepseek_v3", 1, 1)
    assert (c.q_lora_rank, c.kv_lora_rank, c.hidden_size) == (16, 8, 64)  # 1536 : 512 : 7168, rounded to 8
    assert (c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.num_attention_heads) == (8, 4, 8, 4)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(kimi["full"])
    mlps = [type(layer.mlp).__name__ for layer in model.model.layers]
    assert mlps[0] == "DeepseekV3MLP" and set(mlps[1:]) == {"DeepseekV3MoE"}  # one dense layer first
    location = heads.locate_heads(kimi["heads"])
    assert location.missing_shards and not location.tied


@pytest.mark.parametrize("layout", ["v1", "speculators"])
def test_kimi_path_from_extraction_to_the_engines(kimi, layout, tmp_path):
    data = kimi[layout]
    whole = check_dataset(CheckOptions(path=data, target=str(kimi["full"]), identity_samples=2))
    assert whole.clean, whole.problems
    assert [s.best for s in whole.identity] == [s.expected for s in whole.identity]  # every slot its layer
    alone = check_dataset(CheckOptions(path=data, target=str(kimi["heads"]), identity_samples=2))
    assert alone.clean and alone.next_token_accuracy["positions"] > 0
    run = tmp_path / "run"
    train(
        TrainOptions(dataset_dir=data, out_dir=run, target=str(kimi["heads"]), total_steps=4, **FAST),
        show_progress=False,
    )
    ckpt = json.loads((run / "checkpoints" / "step_00000004" / "config.json").read_text())
    # MLA: heads of the target's value width (attention_shape), not hidden / heads
    assert (ckpt["num_attention_heads"], ckpt["num_key_value_heads"], ckpt["head_dim"]) == (4, 4, 8)
    assert ckpt["eagle_aux_hidden_state_layer_ids"] == layers.default_aux_ids(LAYERS)
    export_drafter(ExportOptions(ckpt=run, out=tmp_path / "speculators", fmt="speculators", dtype="bf16"))
    hf, loaded = vllm_load(tmp_path / "speculators")
    assert hf["eagle_aux_hidden_state_layer_ids"] == layers.default_aux_ids(LAYERS)
    export_drafter(ExportOptions(ckpt=run, out=tmp_path / "eagle", fmt="eagle", dtype="bf16"))
    captured, _, _ = sglang_load(tmp_path / "eagle")
    assert captured == layers.default_aux_ids(LAYERS)  # SGLang captures the states the drafter trained on


def test_kimi_draft_shapes_at_real_size():
    """The drafter for the real Kimi-K2.5 and DeepSeek-V3 configs (docs/large-targets.md)."""
    from types import SimpleNamespace

    kimi = SimpleNamespace(**KIMI_K25_TEXT)
    assert attention_shape(kimi) == (64, 64, 128)  # SpecForge's and TorchSpec's Kimi drafters
    assert attention_shape(SimpleNamespace(**{**KIMI_K25_TEXT, "num_attention_heads": 128})) == (56, 8, 128)
    cfg = DraftConfig.from_target(kimi, [2, 30, 58], 32000)
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.target_vocab_size) == (7168, 18432, 163840)


@pytest.mark.parametrize(
    "stored,aux,sglang", [([2, 30, 58, 61], [2, 30, 58], [1, 29, 57]), ([3, 31, 59, 61], [3, 31, 59], [2, 30, 58])]
)
def test_the_real_61_layer_ids_map_to_their_layers(tmp_path, stored, aux, sglang):
    """Kimi-K2.5 has 61 decoder layers. eaglet's default stores hidden_states ids [2, 30, 58] and 61
    (the last layer's output), which vLLM reads as they are and SGLang's eagle_config as layer
    indices [1, 29, 57]. Data captured at the outputs of layers 2, 30 and 58 (SGLang's [2, 30, 58])
    is [3, 31, 59] and the final: exported so both engines feed those same states. A last id of 60 is
    hidden state 60, the output of layer 59, not the final one: refused, named."""
    assert layers.default_layer_ids(61) == [2, 30, 58, 61]
    assert layers.check_stored_ids(stored, 61) == stored
    with pytest.raises(ValueError, match="the last id must be 61"):
        layers.check_stored_ids([*stored[:3], 60], 61)
    ckpt = write_checkpoint(
        tmp_path,
        random_drafter(
            DraftConfig(
                hidden_size=64,
                num_heads=4,
                num_kv_heads=4,
                head_dim=16,
                intermediate_size=128,
                rms_norm_eps=1e-5,
                rope_theta=50000.0,
                max_position_embeddings=1024,
                target_vocab_size=400,
                draft_vocab_size=30,
                aux_layer_ids=aux,
            )
        ),
    )
    export_drafter(ExportOptions(ckpt=ckpt, out=tmp_path / "vllm", fmt="speculators", dtype="fp32"))
    assert config(tmp_path / "vllm")["eagle_aux_hidden_state_layer_ids"] == aux
    export_drafter(ExportOptions(ckpt=ckpt, out=tmp_path / "sglang", fmt="eagle", dtype="fp32"))
    assert config(tmp_path / "sglang")["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == sglang
    assert sglang_load(tmp_path / "sglang")[0] == aux


def test_a_kimi_head_only_download_is_the_full_targets_identity(kimi, tmp_path):
    from eaglet.target import resolve_target

    assert resolve_target(str(kimi["heads"])).revision == resolve_target(str(kimi["full"])).revision
    other = tmp_path / "other"
    shutil.copytree(kimi["heads"], other)
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "routed_scaling_factor": 2.5}))
    assert resolve_target(str(other)).revision != resolve_target(str(kimi["full"])).revision
