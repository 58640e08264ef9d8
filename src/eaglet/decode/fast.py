"""The target near the machine: a Llama-family decoder's forward written out as a few packed matrix
products (`eaglet.packed`) over a preallocated KV cache, for decoding on a CPU.

Hugging Face's forward spends most of a one-token pass of a small model outside arithmetic: module
calls, cache bookkeeping, mask building, and a weight re-layout inside every bf16 matrix product
(SmolLM2-135M on 2 Xeon cores: ~40 ms a token where its weights take ~10 ms to read). `FastTarget`
runs the same computation as plain tensor operations: the embeddings, per layer one fused q/k/v
product, RoPE from the model's own rotary module, the new keys and values written into a KV cache
allocated once per model and grown by doubling, attention by `scaled_dot_product_attention` over
the filled part (the tree mask of a verification pass as given, causal otherwise), one fused
gate/up product, then the final norm and the LM head. In fp32 its logits equal Hugging Face's bit
for bit (tests/decode/test_fast_target.py).

It takes what the decoding core asks of `TargetRunner` (`forward`, `keep`, `cached`, the aux states
of the drafter's layers) and serves Llama, Mistral, Qwen2 and Qwen3 on one device; anything else
(other architectures, a device map, sliding windows, biases where the fused products have none)
runs through `TargetRunner`, and so does everything when EAGLET_FAST_TARGET=0.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from eaglet.options import env_switch
from eaglet.packed import PackedLinear
from eaglet.target import base_model, decoder_layers, max_positions

FAST_TARGET_ENV = "EAGLET_FAST_TARGET"  # "0": every target through Hugging Face's forward (TargetRunner)
FAST_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
INITIAL_CACHE = 1024  # positions the KV cache holds at first; it doubles when a pass needs more

# A transformers model, or one of its decoder layers: its submodules and config fields are reached by
# the architecture's names (model.config.rms_norm_eps, layer.self_attn.q_proj), which no static type states.
HFModel = Any


def fast_target_refused(model: HFModel) -> str | None:
    """Why `FastTarget` cannot run this model (None: it can)."""
    if env_switch(FAST_TARGET_ENV, "the fast target where it applies", "Hugging Face's forward always") is False:
        return f"{FAST_TARGET_ENV}=0"
    config = model.config
    if getattr(config, "model_type", None) not in FAST_MODEL_TYPES:
        return (
            f"model type {getattr(config, 'model_type', None)!r} (the fast target runs {', '.join(FAST_MODEL_TYPES)})"
        )
    if getattr(model, "hf_device_map", None) and len(set(model.hf_device_map.values())) > 1:
        return "the target is placed across devices"
    window = getattr(config, "sliding_window", None)
    if config.model_type == "qwen2" and not getattr(config, "use_sliding_window", False):
        window = None
    if window is not None and window < max_positions(model):
        return f"sliding-window attention ({window} positions)"
    layer = decoder_layers(model)[0]
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if not all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")) or not all(
        hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")
    ):
        return "a decoder layer without q/k/v/o and gate/up/down projections"
    assert attn is not None and mlp is not None  # they have the projections
    if getattr(config, "hidden_act", "silu") not in ("silu", "swish"):
        return f"activation {config.hidden_act!r} (the fast target runs SiLU)"
    if mlp.gate_proj.bias is not None or attn.o_proj.bias is not None:
        return "biases on the MLP or the output projection"
    return None


@dataclass
class FastLayer:
    """One decoder layer's weights, packed."""

    input_norm: torch.Tensor
    qkv: PackedLinear
    q_norm: torch.Tensor | None  # Qwen3: RMSNorm over each head's q and k
    k_norm: torch.Tensor | None
    o: PackedLinear
    post_norm: torch.Tensor
    gate_up: PackedLinear
    down: PackedLinear


def fused(*linears: nn.Linear) -> PackedLinear:
    """One packed product for several linears on the same input (their outputs concatenated)."""
    biases = [lin.bias for lin in linears]
    bias = (
        None
        if all(b is None for b in biases)
        else torch.cat(
            [b if b is not None else lin.weight.new_zeros(lin.weight.shape[0]) for b, lin in zip(biases, linears)]
        )
    )
    return PackedLinear(torch.cat([lin.weight for lin in linears]).contiguous(), bias)


class FastWeights:
    """A model's weights as `FastTarget` uses them, made once per model (`fast_weights`), with a KV
    cache that every generation with this model reuses."""

    def __init__(self, model: HFModel):
        config = model.config
        base: HFModel = base_model(model)  # its parts are reached by Llama's names
        self.model = model
        self.num_heads: int = config.num_attention_heads
        self.num_kv_heads: int = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim: int = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.eps: float = config.rms_norm_eps
        self.embed: nn.Module = base.embed_tokens
        self.rotary: nn.Module = base.rotary_emb
        self.norm: torch.Tensor = base.norm.weight
        self.lm_head = PackedLinear(model.get_output_embeddings().weight)
        self.layers = [self.layer(layer) for layer in decoder_layers(model)]
        self.dtype, self.device = self.norm.dtype, self.norm.device
        self.keys = self.values = torch.empty(0)

    @staticmethod
    def layer(layer: HFModel) -> FastLayer:
        a, m = layer.self_attn, layer.mlp
        q_norm, k_norm = getattr(a, "q_norm", None), getattr(a, "k_norm", None)
        return FastLayer(
            layer.input_layernorm.weight,
            fused(a.q_proj, a.k_proj, a.v_proj),
            None if q_norm is None else q_norm.weight,
            None if k_norm is None else k_norm.weight,
            PackedLinear(a.o_proj.weight),
            layer.post_attention_layernorm.weight,
            fused(m.gate_proj, m.up_proj),
            PackedLinear(m.down_proj.weight),
        )

    def cache(self, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The KV cache [layers, kv heads, >= positions, head dim] (grown by doubling; the first
        `positions` entries of an earlier generation are kept, which only a grown cache needs)."""
        have = self.keys.shape[2] if self.keys.dim() == 4 else 0
        if positions > have:
            size = min(max(INITIAL_CACHE, 2 * have, positions), max(positions, max_positions(self.model)))
            shape = (len(self.layers), self.num_kv_heads, size, self.head_dim)
            keys = torch.zeros(shape, dtype=self.dtype, device=self.device)
            values = torch.zeros(shape, dtype=self.dtype, device=self.device)
            if have:
                keys[:, :, :have], values[:, :, :have] = self.keys, self.values
            self.keys, self.values = keys, values
        return self.keys, self.values


_WEIGHTS: weakref.WeakKeyDictionary[nn.Module, FastWeights] = weakref.WeakKeyDictionary()


def fast_weights(model: nn.Module) -> FastWeights:
    """The model's `FastWeights`, made on first use (packing takes a moment; every later generation
    with the same model reuses them)."""
    if model not in _WEIGHTS:
        _WEIGHTS[model] = FastWeights(model)
    return _WEIGHTS[model]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's LlamaRMSNorm: the mean square in fp32, the weight applied in x's dtype."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE as Hugging Face applies it (rotate_half)."""
    half = t.shape[-1] // 2
    return t * cos + torch.cat([-t[..., half:], t[..., :half]], dim=-1) * sin


class FastTarget:
    """A generation's target: `TargetRunner`'s interface over `FastWeights` and their KV cache."""

    def __init__(self, model: HFModel, aux_layer_ids: list[int] | None = None):
        self.w = fast_weights(model)
        self.model = model
        self.device, self.dtype, self.max_positions = self.w.device, self.w.dtype, max_positions(model)
        self.aux_layer_ids = list(aux_layer_ids or [])
        self.length = 0
        self.forwards = 0
        self.seconds = 0.0

    def close(self) -> None:
        pass

    @property
    def cached(self) -> int:
        return self.length

    def forward(
        self,
        token_ids: list[int],
        positions: list[int] | None = None,
        mask: torch.Tensor | None = None,
        last_only: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [q or 1, V] (fp32) and the aux states [q, sum H] of the fed tokens, as
        `TargetRunner.forward` returns them."""
        t0 = time.perf_counter()
        with torch.inference_mode():
            logits, aux = self.run(token_ids, positions, mask, last_only)
        self.forwards += 1
        self.seconds += time.perf_counter() - t0
        return logits, aux

    def run(
        self, token_ids: list[int], positions: list[int] | None, mask: torch.Tensor | None, last_only: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        w, q, start = self.w, len(token_ids), self.length
        end = start + q
        keys, values = w.cache(end)
        pos = (
            torch.arange(start, end, device=self.device)
            if positions is None
            else torch.tensor(positions, device=self.device)
        )
        x = w.embed(torch.tensor(token_ids, device=self.device))
        cos, sin = w.rotary(x[None], pos[None])
        cos, sin = cos[0][:, None], sin[0][:, None]  # [q, 1, head dim]: broadcast over heads
        masking = self.masking(mask, q, start)
        captured = {0: x} if 0 in self.aux_layer_ids else {}
        for i, layer in enumerate(w.layers):
            x = self.layer(i, layer, x, cos, sin, keys, values, start, end, masking)
            if i + 1 in self.aux_layer_ids:
                captured[i + 1] = x
        self.length = end
        x = rms_norm(x[-1:] if last_only else x, w.norm, w.eps)
        aux = torch.cat([captured[k] for k in self.aux_layer_ids], dim=-1) if self.aux_layer_ids else None
        return w.lm_head(x).float(), aux

    @staticmethod
    def masking(mask: torch.Tensor | None, q: int, start: int) -> dict:
        """The attention's masking arguments: the verification pass's additive tree mask
        [1, q, start + q] as given; causal over the new tokens otherwise (SDPA's own causal kernel
        for a prefill, as Hugging Face runs it); none for one token, which sees the whole cache."""
        if mask is not None:
            return {"attn_mask": mask[0]}
        if q == 1:
            return {}
        if start == 0:
            return {"is_causal": True}
        return {"attn_mask": torch.ones(q, start + q, dtype=torch.bool).tril(start)}

    def layer(
        self,
        i: int,
        layer: FastLayer,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        start: int,
        end: int,
        masking: dict,
    ) -> torch.Tensor:
        w, q = self.w, x.shape[0]
        h = rms_norm(x, layer.input_norm, w.eps)
        qs, ks, vs = layer.qkv(h).split(
            [w.num_heads * w.head_dim, w.num_kv_heads * w.head_dim, w.num_kv_heads * w.head_dim], dim=-1
        )
        qs, ks, vs = (
            qs.view(q, w.num_heads, w.head_dim),
            ks.view(q, w.num_kv_heads, w.head_dim),
            vs.view(q, w.num_kv_heads, w.head_dim),
        )
        if layer.q_norm is not None:
            assert layer.k_norm is not None  # Qwen3 norms both q and k
            qs, ks = rms_norm(qs, layer.q_norm, w.eps), rms_norm(ks, layer.k_norm, w.eps)
        qs, ks = rotate(qs, cos, sin), rotate(ks, cos, sin)
        keys[i, :, start:end] = ks.transpose(0, 1)
        values[i, :, start:end] = vs.transpose(0, 1)
        att = F.scaled_dot_product_attention(
            qs.transpose(0, 1)[None],
            keys[i, :, :end][None],
            values[i, :, :end][None],
            enable_gqa=w.num_kv_heads != w.num_heads,
            **masking,
        )
        x = x + layer.o(att[0].transpose(0, 1).reshape(q, w.num_heads * w.head_dim))
        h = rms_norm(x, layer.post_norm, w.eps)
        gate, up = layer.gate_up(h).chunk(2, dim=-1)
        return x + layer.down(F.silu(gate) * up)

    def keep(self, start: int, rel: list[int]) -> None:
        """Keep cache entries [0, start) + start + rel (rel sorted), as `keep_cache_entries` does."""
        if rel != list(range(len(rel))):
            idx = torch.tensor([start + r for r in rel], device=self.device)
            for cache in (self.w.keys, self.w.values):
                cache[:, :, start : start + len(rel)] = cache.index_select(2, idx)
        self.length = start + len(rel)
