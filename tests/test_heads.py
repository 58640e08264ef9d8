"""The target's heads read alone (`eaglet.heads`): equal to the loaded model's, from a sharded or a
head-only folder, Kimi-K2.5's names, FP8 heads dequantized and other quantized ones refused; the
identity that a head-only download shares with the full folder; and the stages that use nothing
else (offline train, convert --layout compact, check, export's embeddings) run from such a folder,
with the results of the whole target."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import write_jsonl
from eaglet import formats, heads
from eaglet.check import check_dataset
from eaglet.check.heads import convention_hits, convention_problem
from eaglet.convert import convert
from eaglet.extract import extract
from eaglet.prepare import prepare
from eaglet.target import heads_of_model, load_target, resolve_target
from eaglet.training.loop import train
from helpers import FAST, chat_records, head_only_copy
from eaglet.options import CheckOptions, ConvertOptions, ExtractOptions, PrepareOptions, TrainOptions


def make_sharded_llama(folder: Path, seed: int = 0) -> None:
    """A tiny untied Llama in many small shards, with a norm weight that is not all ones (so the
    pre- and post-norm readings of a state differ), and the session's tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from conftest import make_tiny_tokenizer

    tok = make_tiny_tokenizer(folder)
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.model.norm.weight.copy_(torch.rand(64) * 2 + 0.1)
    model.save_pretrained(folder, max_shard_size="60KB")


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(full folder, head-only folder, its v1 dataset)."""
    work = tmp_path_factory.mktemp("heads")
    full = work / "full"
    full.mkdir()
    make_sharded_llama(full)
    prepare(
        PrepareOptions(
            target=str(full),
            data=str(write_jsonl(work / "chats.jsonl", chat_records())),
            out=work / "prep",
            max_length=512,
        )
    )
    extract(ExtractOptions(prepared=work / "prep", out=work / "data", target=str(full)), show_progress=False)
    return full, head_only_copy(full, work / "heads_only"), work / "data"


def test_heads_read_alone_equal_the_loaded_models(sharded, tiny_target):
    full, head_only, _ = sharded
    location = heads.locate_heads(head_only)
    assert len(location.shards) > 3 and location.missing_shards and not location.tied
    for folder in (full, tiny_target):  # untied in many shards; tied in one file
        model = load_target(resolve_target(str(folder)), torch.float32, torch.device("cpu"))
        ref = heads_of_model(model)
        read = heads.read_heads(folder if folder != full else head_only, torch.float32)
        assert torch.equal(read.embeddings, ref.embeddings)
        assert torch.equal(read.lm_head.weight, ref.lm_head.weight)
        x = torch.randn(5, 64)
        assert torch.equal(read.final_norm(x), ref.final_norm(x))
        assert read.config.num_hidden_layers == model.config.num_hidden_layers
    tied = heads.read_heads(tiny_target, torch.bfloat16)
    assert tied.lm_head.weight.data_ptr() == tied.embeddings.data_ptr() and tied.embeddings.dtype == torch.bfloat16
    only = heads.read_heads(head_only, None, roles=(heads.EMBEDDINGS,))
    assert only.lm_head is None and only.final_norm is None and only.embeddings.dtype == torch.float32


def test_identity_is_the_heads_config_and_tokenizer(sharded, tmp_path):
    full, head_only, _ = sharded
    assert resolve_target(str(full)).revision == resolve_target(str(head_only)).revision
    other = tmp_path / "other"
    other.mkdir()
    make_sharded_llama(other, seed=1)
    assert resolve_target(str(other)).revision != resolve_target(str(full)).revision
    edited = head_only_copy(full, tmp_path / "edited")
    cfg = json.loads((edited / "config.json").read_text())
    (edited / "config.json").write_text(json.dumps({**cfg, "rms_norm_eps": 1e-5}))
    assert resolve_target(str(edited)).revision != resolve_target(str(full)).revision
    shard = heads.locate_heads(full).tensors[heads.LM_HEAD].file.name
    (edited / shard).unlink()
    with pytest.raises(FileNotFoundError, match=f"{shard}: missing; it holds lm_head.weight"):
        resolve_target(str(edited))


def write_checkpoint(folder: Path, config: dict, tensors: dict[str, torch.Tensor], shard_of: dict[str, str]) -> None:
    """A checkpoint folder by hand: config.json, the index, and only the shards listed for the tensors given."""
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    (folder / heads.INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": shard_of}))
    for shard in sorted(set(shard_of.values())):
        part = {k: v.contiguous() for k, v in tensors.items() if shard_of[k] == shard}
        if part:
            save_file(part, str(folder / shard))


KIMI_TEXT = {
    "model_type": "deepseek_v3",
    "architectures": ["DeepseekV3ForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
    "q_lora_rank": 24,
    "kv_lora_rank": 8,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "vocab_size": 320,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "max_position_embeddings": 1024,
}


def test_kimi_k25_names_and_nested_config(tmp_path):
    """Kimi-K2.5: `language_model.`-prefixed heads, the text model nested under `text_config` of a
    model type only its own code knows; a layer shard absent."""
    emb, head, norm = (
        torch.randn(320, 64, dtype=torch.bfloat16),
        torch.randn(320, 64, dtype=torch.bfloat16),
        torch.rand(64, dtype=torch.bfloat16),
    )
    layer = torch.zeros(4, dtype=torch.bfloat16)
    names = {
        "language_model.model.embed_tokens.weight": "model-1.safetensors",
        "language_model.model.layers.0.self_attn.o_proj.weight": "model-2.safetensors",
        "language_model.model.norm.weight": "model-3.safetensors",
        "language_model.lm_head.weight": "model-3.safetensors",
    }
    tensors = dict(zip(names, [emb, layer, norm, head]))
    del tensors["language_model.model.layers.0.self_attn.o_proj.weight"]  # its shard is not downloaded
    write_checkpoint(
        tmp_path / "k25",
        {"model_type": "kimi_k25", "architectures": ["KimiK25ForConditionalGeneration"], "text_config": KIMI_TEXT},
        tensors,
        names,
    )
    read = heads.read_heads(tmp_path / "k25")
    assert read.config.model_type == "deepseek_v3" and read.config.kv_lora_rank == 8
    assert torch.equal(read.embeddings, emb) and torch.equal(read.lm_head.weight, head)
    assert torch.equal(read.final_norm.weight, norm) and read.embeddings.dtype == torch.bfloat16
    assert "1 of 3 shards absent" in read.source


def test_fp8_head_is_dequantized_and_other_quantized_heads_are_refused(tmp_path):
    torch.manual_seed(0)
    head = torch.randn(300, 200)
    scale = torch.rand(3, 2) + 0.5  # blocks of 128 x 128, the last ones partial
    full_scale = scale.repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :200]
    stored = (head / full_scale).to(torch.float8_e4m3fn)
    emb, norm = torch.randn(300, 200, dtype=torch.bfloat16), torch.ones(200, dtype=torch.bfloat16)
    config = {
        "model_type": "llama",
        "hidden_size": 200,
        "vocab_size": 300,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "rms_norm_eps": 1e-6,
        "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]},
    }
    names = {
        "model.embed_tokens.weight": "a.safetensors",
        "model.norm.weight": "a.safetensors",
        "lm_head.weight": "b.safetensors",
        "lm_head.weight_scale_inv": "b.safetensors",
    }
    write_checkpoint(
        tmp_path / "fp8",
        config,
        {
            "model.embed_tokens.weight": emb,
            "model.norm.weight": norm,
            "lm_head.weight": stored,
            "lm_head.weight_scale_inv": scale,
        },
        names,
    )
    read = heads.read_heads(tmp_path / "fp8", torch.float32)
    assert torch.equal(read.lm_head.weight, stored.float() * full_scale)
    packed = {
        "model.embed_tokens.weight": "a.safetensors",
        "model.norm.weight": "a.safetensors",
        "lm_head.weight_packed": "b.safetensors",
        "lm_head.weight": "b.safetensors",
    }
    write_checkpoint(
        tmp_path / "int4",
        config,
        {
            "model.embed_tokens.weight": emb,
            "model.norm.weight": norm,
            "lm_head.weight": torch.zeros(300, 200, dtype=torch.int8),
            "lm_head.weight_packed": torch.zeros(300, 25, dtype=torch.int32),
        },
        packed,
    )
    with pytest.raises(
        ValueError,
        match=r"b.safetensors: the target's lm head lm_head.weight is stored quantized "
        r"\(compressed-tensors packed integers\).*dequantize",
    ):
        heads.read_heads(tmp_path / "int4")


def test_the_last_state_read_the_wrong_way_is_told_by_the_heads(sharded):
    """A post-norm last state recorded as pre-norm predicts clearly worse through norm + head."""
    full, _, _ = sharded
    h = heads.read_heads(full, torch.float32)
    torch.manual_seed(0)
    h.final_norm.weight.data = torch.exp(torch.randn(64) * 2)  # a norm far from uniform, as trained ones are
    ids = torch.randint(0, h.lm_head.weight.shape[0], (80,))
    post = h.lm_head.weight[ids[1:]] * 3  # a state whose head output is the next token
    post = torch.cat([post, post[:1]])
    n, hits = convention_hits(post, ids, None, h)
    assert n == 64 and hits[formats.LAST_STATE_POST_NORM] >= 60 > hits[formats.LAST_STATE_PRE_NORM] + 12
    problem = convention_problem(n, hits, formats.LAST_STATE_PRE_NORM, "x.pt")
    assert problem and "last_hidden_state is post_norm" in problem.message
    assert convention_problem(n, hits, formats.LAST_STATE_POST_NORM, "x.pt") is None


def test_train_from_a_head_only_folder_equals_the_whole_targets_run(sharded, tmp_path, monkeypatch, caplog):
    """Same seed, fp32: the checkpoint trained from the head-only folder equals one trained with the
    heads of the loaded model (the path every run took before), and the full folder's; another
    model is refused."""
    full, head_only, data = sharded
    opts = dict(total_steps=4, bf16=False, **FAST)
    with caplog.at_level(logging.INFO):
        train(TrainOptions(dataset_dir=data, out_dir=tmp_path / "heads_only", target=str(head_only), **opts))
    assert "layer identity not checked by train (the folder holds only the heads" in caplog.text
    assert "host memory RSS" in caplog.text
    train(TrainOptions(dataset_dir=data, out_dir=tmp_path / "full", target=str(full), **opts))

    def loaded_heads(ref, dtype, device, roles=heads.HEAD_ROLES):
        return heads_of_model(load_target(ref, torch.float32, torch.device("cpu")))

    monkeypatch.setattr("eaglet.training.loop.load_heads", loaded_heads)
    train(TrainOptions(dataset_dir=data, out_dir=tmp_path / "model", target=str(full), **opts))
    step = "checkpoints/step_00000004/model.safetensors"
    ref = load_file(str(tmp_path / "model" / step))
    for run in ("heads_only", "full"):
        got = load_file(str(tmp_path / run / step))
        assert set(got) == set(ref)
        for k in ref:
            assert torch.allclose(got[k].float(), ref[k].float(), atol=1e-6, rtol=0), (run, k)
    other = tmp_path / "other"
    other.mkdir()
    make_sharded_llama(other, seed=1)
    with pytest.raises(ValueError, match="another config, tokenizer or heads"):
        train(TrainOptions(dataset_dir=data, out_dir=tmp_path / "other_run", target=str(other), **opts))


def test_convert_check_and_export_from_a_head_only_folder(sharded, tmp_path):
    full, head_only, data = sharded
    convert(ConvertOptions(src=data, out=tmp_path / "c_full", layout="compact", target=str(full)), show_progress=False)
    convert(
        ConvertOptions(src=data, out=tmp_path / "c_heads", layout="compact", target=str(head_only)), show_progress=False
    )
    a, b = formats.list_v1_files(tmp_path / "c_full"), formats.list_v1_files(tmp_path / "c_heads")
    assert a.keys() == b.keys()
    for i in a:
        assert a[i].read_bytes() == b[i].read_bytes()
    report = check_dataset(CheckOptions(path=data, target=str(head_only), identity_samples=2))
    assert report.clean, report.problems
    assert report.next_token_accuracy["positions"] > 0
    assert any(
        "layer identity not checked" in p.message and "--target FULL_TARGET" in p.message for p in report.problems
    )
    from eaglet.drafter.files import target_embeddings

    assert torch.equal(target_embeddings(str(head_only)), heads.read_heads(full, torch.float32).embeddings)
