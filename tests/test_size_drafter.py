"""scripts/size_drafter.py: the drafter's parameters, optimizer and activation bytes per GPU and
the dataset's bytes per token for DeepSeek-V3 and Kimi-K2 (their hub config.json values), and
docs/large-targets.md shows exactly what the script computes."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import torch

from eaglet.drafter import DraftConfig, Eagle3Draft, num_parameters
from eaglet.formats import v1_min_bytes_per_token

ROOT = Path(__file__).resolve().parents[1]
# config.json fields of deepseek-ai/DeepSeek-V3 and moonshotai/Kimi-K2-Instruct on the hub (sizes only)
MLA_MOE = {
    "model_type": "deepseek_v3",
    "architectures": ["DeepseekV3ForCausalLM"],
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "tie_word_embeddings": False,
}
DEEPSEEK_V3 = {
    **MLA_MOE,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "vocab_size": 129280,
    "n_routed_experts": 256,
    "first_k_dense_replace": 3,
    "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000,
}
KIMI_K2 = {
    **MLA_MOE,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "vocab_size": 163840,
    "n_routed_experts": 384,
    "first_k_dense_replace": 1,
    "max_position_embeddings": 131072,
}


def load_script():
    spec = importlib.util.spec_from_file_location("size_drafter", ROOT / "scripts" / "size_drafter.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def test_the_page_shows_what_the_script_computes():
    sd = load_script()
    page = (ROOT / "docs" / "large-targets.md").read_text()
    for name, config in (("DeepSeek-V3", DEEPSEEK_V3), ("Kimi-K2", KIMI_K2)):
        assert sd.report(name, config, [4096, 16384], 7) in page, f"{name}: rerun scripts/size_drafter.py"


def test_sizes_are_the_real_modules_and_the_formats_bytes(tmp_path):
    sd = load_script()
    H, inter, V = 7168, 18432, 8192

    def by_hand(q: int, kv: int) -> int:  # q = heads x head_dim, kv = KV heads x head_dim
        # fc 3H -> H; q/k/v from the 2H concat of embedding and hidden; o q -> H; SwiGLU; LM head;
        # hidden_norm, input_layernorm, post_attention_layernorm, norm
        return 3 * H * H + 2 * H * (q + 2 * kv) + q * H + 3 * H * inter + H * V + 4 * H

    # MLA targets: heads of the value width, 128. DeepSeek-V3's 128 heads would be 16384 wide
    # (> 1.25 H), so hidden / 128 = 56 heads over 8 KV heads; Kimi-K2 keeps its 64 heads, all KV.
    s = sd.size(DEEPSEEK_V3)
    assert (s.cfg.num_heads, s.cfg.head_dim, s.cfg.num_kv_heads) == (56, 128, 8)
    assert s.trainable == by_hand(56 * 128, 8 * 128) == 792_752_128
    kimi = sd.size(KIMI_K2)
    assert (kimi.cfg.num_heads, kimi.cfg.head_dim, kimi.cfg.num_kv_heads) == (64, 128, 64)
    assert kimi.trainable == by_hand(64 * 128, 64 * 128) == 1_020_293_120
    with torch.device("meta"):
        assert s.trainable == num_parameters(
            Eagle3Draft(DraftConfig.from_target(sd.text_config(DEEPSEEK_V3), [2, 30, 58]))
        )
    assert s.optimizer_bytes == 16 * s.trainable
    # the header names the target's heads, then the drafter's
    assert "(hidden 7168, 128 heads, 61 layers" in sd.report("DeepSeek-V3", DEEPSEEK_V3, [4096], 7)
    assert sd.compact_bytes_per_token(H, 16) == 17_573 and v1_min_bytes_per_token(H) == 57_360
    # a multimodal config (Kimi-K2.5) is sized by its text model, from the command line too
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "kimi_k25", "text_config": KIMI_K2}))
    assert sd.main([str(path), "--name", "Kimi-K2", "--context", "4096,16384"]) == 0
    assert sd.size({"text_config": KIMI_K2}).trainable == sd.size(KIMI_K2).trainable
