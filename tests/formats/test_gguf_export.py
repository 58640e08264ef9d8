"""`eaglet export --format gguf`: the drafter as llama.cpp's eagle3 GGUF. The file is read here
with the `gguf` package alone and run through a re-implementation of llama.cpp's eagle3 decoder
graph (src/models/eagle3.cpp: ggml's adjacent-pair RoPE on the stored q/k rows, concat(attn_norm(
embedding), attn_norm_2(g)), residual g, output_norm, output, logits scattered to target ids by the
absolute d2t), which must give eaglet's own step-0 logits; plus the metadata, the tokenizer copy
and the refusals."""

from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from eaglet import formats
from eaglet.formats import gguf_drafter
from eaglet.cli import main as cli_main
from eaglet.export import export_drafter
from references import read_gguf_drafter  # tests/references.py
from helpers import TOKENS, random_drafter, target_gguf, tiny_config, write_checkpoint
from eaglet.options import ExportOptions


def raw_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a GGUF as stored, in PyTorch's [rows, cols] order, float32 (d2t int64)."""
    out = {}
    for t in gguf.GGUFReader(path).tensors:
        data = np.array(t.data)
        if t.tensor_type == gguf.GGMLQuantizationType.BF16:
            value = torch.from_numpy(data.view(np.int16).copy()).view(torch.bfloat16).float()
        elif t.tensor_type == gguf.GGMLQuantizationType.I64:
            value = torch.from_numpy(data.astype(np.int64))
        else:
            value = torch.from_numpy(data.astype(np.float32))
        out[t.name] = value.reshape(tuple(int(n) for n in reversed(t.shape)))
    return out


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def ggml_rope_norm(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """ggml_rope_ext with LLAMA_ROPE_TYPE_NORM: rotate adjacent pairs (2i, 2i + 1) of each head."""
    d = x.shape[-1]
    freq = theta ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)
    angle = pos[:, None].float() * freq  # [L, d/2]
    cos, sin = angle.cos()[:, None], angle.sin()[:, None]  # [L, 1, d/2] over heads
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).flatten(-2)


def llama_cpp_eagle3_step0(
    path: Path, embeddings: torch.Tensor, tokens: torch.Tensor, features: torch.Tensor
) -> torch.Tensor:
    """llama.cpp's eagle3 encoder + decoder on one sequence: features [L, 3H_t] of target
    positions 0..L-1, `tokens` [L] the token after each; target-vocabulary logits [L, V] (-inf
    outside the draft vocabulary)."""
    reader = gguf.GGUFReader(path)
    meta = {k: f.contents() for k, f in reader.fields.items()}
    t = raw_tensors(path)
    eps, theta = meta["eagle3.attention.layer_norm_rms_epsilon"], meta["eagle3.rope.freq_base"]
    n_head, n_kv = meta["eagle3.attention.head_count"], meta["eagle3.attention.head_count_kv"]
    if meta.get("eagle3.norm_before_fc"):
        features = rms(features, t["enc.output_norm.weight"], eps)
    g = features @ t["fc.weight"].T  # the encoder
    e = embeddings[tokens]  # the target's token_embd (the drafter has none of its own)
    g_norm = rms(g, t["blk.0.attn_norm_2.weight"], eps)
    x = torch.cat([rms(e, t["blk.0.attn_norm.weight"], eps), g_norm], dim=-1)
    L = x.shape[0]
    q = (x @ t["blk.0.attn_q.weight"].T).view(L, n_head, -1)
    k = (x @ t["blk.0.attn_k.weight"].T).view(L, n_kv, -1)
    v = (x @ t["blk.0.attn_v.weight"].T).view(L, n_kv, -1)
    pos = torch.arange(L)
    q, k = ggml_rope_norm(q, pos, theta), ggml_rope_norm(k, pos, theta)
    k, v = k.repeat_interleave(n_head // n_kv, 1), v.repeat_interleave(n_head // n_kv, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(L, -1) @ t["blk.0.attn_output.weight"].T
    h = attn + (g_norm if meta.get("eagle3.norm_before_residual") else g)
    h_norm = rms(h, t["blk.0.ffn_norm.weight"], eps)
    ffn = (torch.nn.functional.silu(h_norm @ t["blk.0.ffn_gate.weight"].T) * (h_norm @ t["blk.0.ffn_up.weight"].T)) @ t[
        "blk.0.ffn_down.weight"
    ].T
    out = rms(h + ffn, t["output_norm.weight"], eps) @ t["output.weight"].T  # [L, draft vocab]
    logits = torch.full((L, len(meta["tokenizer.ggml.tokens"])), float("-inf"))
    logits[:, t["d2t"]] = out  # ggml_set_rows at the absolute target ids
    return logits


def eaglet_step0(draft, tokens: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
    """eaglet's own step 0 for the same inputs, as target-vocabulary logits."""
    ids = torch.cat([tokens.new_zeros(1), tokens])[None]  # eaglet gives position t the token at t + 1
    padded = torch.cat([features, features.new_zeros(1, features.shape[1])])[None]  # causal: the extra row is unseen
    with torch.no_grad():
        draft_logits = draft(ids, padded, steps=1).logits[0][0, :-1]
    logits = torch.full((tokens.numel(), draft.config.target_vocab_size), float("-inf"))
    logits[:, draft.draft_to_target_ids()] = draft_logits
    return logits


@pytest.mark.parametrize(
    "variant", [{}, {"fc_norm": True}, {"norm_before_residual": True}, {"num_kv_heads": 4}, {"target_hidden_size": 24}]
)
def test_llama_cpp_graph_on_the_gguf_gives_eaglets_logits(tmp_path, variant):
    draft = random_drafter(tiny_config(**variant))
    ckpt = write_checkpoint(tmp_path, draft)
    out = tmp_path / "drafter.gguf"
    export_drafter(
        ExportOptions(ckpt=ckpt, out=out, fmt="gguf", dtype="fp32", target_gguf=target_gguf(tmp_path / "target.gguf"))
    )
    torch.manual_seed(3)
    L = 11
    tokens = torch.randint(0, draft.config.target_vocab_size, (L,))
    features = torch.randn(L, 3 * draft.config.target_hidden_size)
    ours = eaglet_step0(draft, tokens, features)
    theirs = llama_cpp_eagle3_step0(out, draft.embed_tokens.weight.detach(), tokens, features)
    assert torch.equal(ours.isinf(), theirs.isinf())
    torch.testing.assert_close(ours[~ours.isinf()], theirs[~theirs.isinf()], rtol=1e-4, atol=1e-4)
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


@pytest.mark.parametrize("broken", ["rope", "norms"])
def test_a_wrong_rope_order_or_swapped_norms_change_the_logits(tmp_path, monkeypatch, broken):
    """The reference can fail: q/k left in Hugging Face's RoPE order, or the two input norms
    swapped, give other logits (random norms make every weight count)."""
    draft = random_drafter(tiny_config())
    ckpt = write_checkpoint(tmp_path, draft)
    source = target_gguf(tmp_path / "target.gguf")
    torch.manual_seed(3)
    tokens, features = torch.randint(0, 50, (9,)), torch.randn(9, 3 * 32)
    embeddings = draft.embed_tokens.weight.detach()
    export_drafter(ExportOptions(ckpt=ckpt, out=tmp_path / "good.gguf", fmt="gguf", dtype="fp32", target_gguf=source))
    good = llama_cpp_eagle3_step0(tmp_path / "good.gguf", embeddings, tokens, features)
    if broken == "rope":
        monkeypatch.setattr(gguf_drafter, "to_ggml_rope_rows", lambda w, heads: w)
    else:
        monkeypatch.setitem(gguf_drafter.GGUF_NAMES, "midlayer.input_layernorm.weight", "blk.0.attn_norm_2.weight")
        monkeypatch.setitem(gguf_drafter.GGUF_NAMES, "midlayer.hidden_norm.weight", "blk.0.attn_norm.weight")
    export_drafter(ExportOptions(ckpt=ckpt, out=tmp_path / "bad.gguf", fmt="gguf", dtype="fp32", target_gguf=source))
    bad = llama_cpp_eagle3_step0(tmp_path / "bad.gguf", embeddings, tokens, features)
    assert not torch.allclose(bad[~bad.isinf()], good[~good.isinf()], atol=1e-3)


def test_gguf_metadata_tokenizer_and_round_trip(tmp_path):
    draft = random_drafter(tiny_config())
    ckpt = write_checkpoint(tmp_path, draft)
    out = tmp_path / "drafter.gguf"
    summary = export_drafter(
        ExportOptions(ckpt=ckpt, out=out, fmt="gguf", target_gguf=target_gguf(tmp_path / "target.gguf"))
    )
    reader = gguf.GGUFReader(out)
    meta = {k: f.contents() for k, f in reader.fields.items()}
    assert meta["general.architecture"] == "eagle3" and meta["eagle3.block_count"] == 1
    assert meta["eagle3.target_layers"] == [2, 4, 5] and meta["eagle3.target_hidden_size"] == 32
    assert meta["tokenizer.ggml.tokens"] == TOKENS and meta["tokenizer.ggml.eos_token_id"] == 2
    assert json.loads(meta["eaglet.export"])["step"] == 5
    stored = {t.name: t for t in reader.tensors}
    assert "token_embd.weight" not in stored and "t2d" not in stored  # the target lends its embeddings
    assert stored["blk.0.attn_q.weight"].tensor_type == gguf.GGMLQuantizationType.BF16
    assert stored["blk.0.attn_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    back = read_gguf_drafter(out)
    for name, value in draft.state_dict().items():
        if name in ("embed_tokens.weight", "t2d"):
            continue
        want = value if name == "d2t" else value.bfloat16().float() if value.dim() > 1 else value
        assert torch.equal(back.tensors[name], want), name
    assert summary.lines()[-1].startswith(f"  llama.cpp: llama-server -m {tmp_path / 'target.gguf'} -md {out}")


def test_cli_exports_gguf(tmp_path, capsys):
    ckpt = write_checkpoint(tmp_path, random_drafter(tiny_config()))
    out = tmp_path / "d.gguf"
    assert (
        cli_main(
            ["export", str(ckpt), str(out), "--format", "gguf", "--target-gguf", str(target_gguf(tmp_path / "t.gguf"))]
        )
        == 0
    )
    assert "--spec-type draft-eagle3" in capsys.readouterr().out and out.is_file()


@pytest.mark.parametrize(
    "variant, options, message",
    [
        ({"norm_output": True}, {}, r"cannot export as gguf: norm_output \(EAGLE-3.1's post-norm state"),
        ({"sliding_window": 8}, {}, "sliding_window 8: llama.cpp's eagle3 attention has no window"),
        ({}, {"tokens": 49}, "its tokenizer has 49 tokens, the drafter was trained for a target vocabulary of 50"),
        # another model with the same tokenizer (SmolLM2-135M for a tiny target) once exported
        ({}, {"width": 576}, "a target of hidden size 576, the drafter reads states of 32"),
        ({}, {"out": "drafter"}, "give a path ending .gguf"),
        ({}, {"target_gguf": None}, "the target is org/tiny-target, not the embedded one; pass --target-gguf"),
    ],
)
def test_gguf_export_refusals(tmp_path, variant, options, message):
    ckpt = write_checkpoint(tmp_path, random_drafter(tiny_config(**variant)))
    source = target_gguf(tmp_path / "t.gguf", options.get("tokens", len(TOKENS)), options.get("width"))
    out = tmp_path / options.get("out", "d.gguf")
    with pytest.raises(ValueError, match=message):
        export_drafter(ExportOptions(ckpt=ckpt, out=out, fmt="gguf", target_gguf=options.get("target_gguf", source)))
    assert not out.exists()


def test_gguf_export_compares_the_targets_tokens_with_the_gguf_s(tmp_path, monkeypatch):
    """A target GGUF of another model whose vocabulary has the same size was taken, and its tokenizer
    copied into the drafter."""
    import eaglet.drafter.files as files

    ckpt = write_checkpoint(tmp_path, random_drafter(tiny_config()))
    source = target_gguf(tmp_path / "t.gguf")
    other = [f"word{i}" for i in range(len(TOKENS))]
    monkeypatch.setattr(files, "target_vocabulary", lambda target: other)
    with pytest.raises(
        ValueError,
        match=r"t.gguf: its tokenizer is not the drafter's target's \(50 of 50 tokens differ; "
        r"token 0 is 'tok0' there, 'word0' in the target's tokenizer\)",
    ):
        export_drafter(ExportOptions(ckpt=ckpt, out=tmp_path / "d.gguf", fmt="gguf", target_gguf=source))
    assert not (tmp_path / "d.gguf").exists()
    # the target's own tokens (past its tokenizer: none, as for a padded vocabulary) pass
    monkeypatch.setattr(files, "target_vocabulary", lambda target: [*TOKENS[:40], *[None] * 10])
    export_drafter(ExportOptions(ckpt=ckpt, out=tmp_path / "d.gguf", fmt="gguf", target_gguf=source))


def test_gguf_export_never_overwrites(tmp_path):
    ckpt = write_checkpoint(tmp_path, random_drafter(tiny_config()))
    out = tmp_path / "d.gguf"
    out.write_bytes(b"keep")
    with pytest.raises(FileExistsError, match="already exists"):
        export_drafter(ExportOptions(ckpt=ckpt, out=out, fmt="gguf", target_gguf=target_gguf(tmp_path / "t.gguf")))
    assert out.read_bytes() == b"keep"


def test_the_targets_f32_copy_keeps_its_metadata_and_dequantizes_every_tensor(tmp_path):
    """formats.write_gguf_as(..., "F32") (what `eval --engine-f32` runs llama.cpp on): every key but the file
    type unchanged, every tensor f32, a Q8_0 matrix within its quantization step of the values
    it was made from (ggml's Q8_0: blocks of 32, one f16 scale each: |error| <= scale / 2,
    plus 127 times the scale's own f16 rounding)."""
    torch.manual_seed(0)
    matrix, norm = torch.randn(4, 64), torch.rand(64)
    src, dst = tmp_path / "target.gguf", tmp_path / "target.f32.gguf"
    w = gguf.GGUFWriter(src, "llama")
    w.add_uint32("general.file_type", int(gguf.LlamaFileType.MOSTLY_Q8_0))
    w.add_token_list(TOKENS)
    w.add_chat_template("{{ messages }}")
    q8 = gguf.quants.quantize(matrix.numpy(), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("blk.0.attn_q.weight", q8, raw_shape=q8.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("output_norm.weight", norm.numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert formats.weight_type(src) == "Q8_0" and formats.is_quantized(src)
    formats.write_gguf_as(src, dst, "F32")
    assert formats.weight_type(dst) == "F32" and not formats.is_quantized(dst)
    before, after = gguf.GGUFReader(src), gguf.GGUFReader(dst)
    assert after.fields["general.file_type"].contents() == int(gguf.LlamaFileType.ALL_F32)
    for key in ("tokenizer.ggml.tokens", "tokenizer.chat_template", "general.architecture"):
        assert after.fields[key].contents() == before.fields[key].contents(), key
    tensors = {t.name: torch.from_numpy(np.array(t.data)) for t in after.tensors}
    assert torch.equal(tensors["output_norm.weight"], norm)
    scale = matrix.reshape(4, 2, 32).abs().amax(-1, keepdim=True) / 127
    error = (tensors["blk.0.attn_q.weight"].reshape(4, 2, 32) - matrix.reshape(4, 2, 32)).abs()
    assert tensors["blk.0.attn_q.weight"].shape == (4, 64) and bool((error <= scale * (0.5 + 127 * 2**-11)).all())
    assert not list(tmp_path.glob(".*"))  # written atomically: no temp file left
    formats.write_gguf_as(dst, tmp_path / "target.q8_0.gguf", "Q8_0")  # and back: the very blocks it came from
    again = {t.name: t for t in gguf.GGUFReader(tmp_path / "target.q8_0.gguf").tensors}
    assert formats.weight_type(tmp_path / "target.q8_0.gguf") == "Q8_0"
    assert np.array_equal(np.array(again["blk.0.attn_q.weight"].data), q8)
    assert again["output_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    with pytest.raises(ValueError, match="rewritten as one of F32, Q8_0, not Q4_K"):
        formats.write_gguf_as(src, tmp_path / "x.gguf", "Q4_K")
