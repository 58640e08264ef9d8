"""The EAGLE-3 draft model ("drafter") in plain PyTorch, and its training-time-test (TTT) unroll.

Architecture (module names are the EAGLE / SGLang checkpoint keys, so export is a copy):

    g      = fc(concat(aux_low, aux_mid, aux_high))          # 3H -> H, fused target features
    x      = concat(input_layernorm(embed(token)), hidden_norm(g))   # 2H, input of q/k/v
    h      = g + o_proj(attention(q, k, v))                  # residual is g, not x (norm_before_residual:
                                                             # hidden_norm(g), speculators' default)
    h      = h + mlp(post_attention_layernorm(h))            # SwiGLU
    logits = lm_head(norm(h))                                # H -> draft vocab

TTT (`Eagle3Draft.forward`): step 0 sees the target's fused features; step k feeds the
drafter's own output `h` of step k-1 at the same position, with the input token shifted one
further (teacher forced). Its attention is `eaglet.drafter.attention`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from eaglet.drafter.attention import DiagonalTTTAttention, TTTAttentionCore, apply_rope, rope_cos_sin
from eaglet.drafter.config import DEFAULT_TTT_STEPS, DraftConfig
from eaglet.drafter.layers import MLP, Drafter, RMSNorm


class Attention(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        in_dim = 2 * cfg.hidden_size  # concat(embedding, hidden)
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(in_dim, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(in_dim, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(in_dim, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, core: TTTAttentionCore) -> torch.Tensor:
        B, L, _ = x.shape
        q = self.q_proj(x).view(B, L, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, L, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, L, self.num_kv_heads, self.head_dim).transpose(1, 2)
        out = core(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v)
        return self.o_proj(out.transpose(1, 2).reshape(B, L, -1))


class MidLayer(nn.Module):
    """The one decoder layer: attention over concat(norm(embedding), norm(hidden)), residual = hidden."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.norm_before_residual = cfg.norm_before_residual
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self, hidden: torch.Tensor, embeds: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, core: TTTAttentionCore
    ) -> torch.Tensor:
        normed = self.hidden_norm(hidden)
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        h = self.residual(hidden, normed) + self.self_attn(x, cos, sin, core)
        return h + self.mlp(self.post_attention_layernorm(h))

    def residual(self, hidden: torch.Tensor, normed: torch.Tensor) -> torch.Tensor:
        return normed if self.norm_before_residual else hidden


def shift_left(x: torch.Tensor, n: int, fill: float | int | bool = 0) -> torch.Tensor:
    """x[:, t + n] at position t along dim 1, `fill` past the end (teacher forcing n tokens ahead)."""
    if n == 0:
        return x
    pad = x.new_full((x.shape[0], min(n, x.shape[1]), *x.shape[2:]), fill)
    return torch.cat([x[:, n:], pad], dim=1)


@dataclass
class DraftOutput:
    """Per TTT step k, the final norm's output [B, L, H]: position t predicts token t + k + 2.

    The LM head is applied where it is needed: training's loss applies it only at the
    positions that count (the head and the softmax over the draft vocabulary are most of a
    step's work), `logits` everywhere."""

    hidden: list[torch.Tensor]
    head: Callable[[torch.Tensor], torch.Tensor]

    @property
    def logits(self) -> list[torch.Tensor]:
        return [self.head(h) for h in self.hidden]


class Eagle3Draft(Drafter):
    def __init__(self, cfg: DraftConfig):
        super().__init__(cfg)
        if cfg.fc_norm:
            self.fc_norm = RMSNorm(3 * cfg.aux_width, cfg.rms_norm_eps)
        self.fc = nn.Linear(3 * cfg.aux_width, cfg.hidden_size, bias=False)
        self.midlayer = MidLayer(cfg)
        self.add_head()
        self.reset_parameters()

    def fuse(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """g = fc(concat aux), the step-0 hidden input."""
        if self.config.fc_norm:
            aux_hidden = self.fc_norm(aux_hidden)
        return self.fc(aux_hidden.to(self.fc.weight.dtype))

    def forward(
        self,
        input_ids: torch.Tensor,
        aux_hidden: torch.Tensor,
        steps: int = DEFAULT_TTT_STEPS,
        attention: Callable[[], TTTAttentionCore] = DiagonalTTTAttention,
        documents: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> DraftOutput:
        """Unroll `steps` TTT steps over right-padded sequences, or over packed rows.

        input_ids [B, L] are the sample's tokens; aux_hidden [B, L, 3H] the target's aux states at
        the same positions. At step k, position t gets token t+1+k and RoPE position t+k, and
        predicts token t+k+2. Packed rows hold several samples one after another: `documents`
        [B, L] numbers each position's sample (attention stays within it) and `positions` [B, L]
        counts from 0 at each sample's start (its RoPE positions, as if it were alone). Positions
        whose shifted token comes from the next sample are garbage that no counted position sees
        (they are the last of their sample, whose targets lie past its end: the loss skips them).
        `attention` makes the unroll's attention core (the device's default TTT kernel unless a
        caller passes, e.g., `lambda: DiagonalTTTAttention("chunked")`).
        """
        L = input_ids.shape[1]
        core = attention()
        core.window, core.documents = self.config.sliding_window, documents
        if positions is None:
            positions = torch.arange(L, device=input_ids.device)
        hidden = self.fuse(aux_hidden)
        outputs = []
        for k in range(steps):
            embeds = self.embed_tokens(shift_left(input_ids, 1 + k))
            cos, sin = rope_cos_sin(positions + k, self.config.head_dim, self.config.rope_theta)
            if cos.dim() == 3:  # per-row positions [B, L, d]: broadcast over heads
                cos, sin = cos[:, None], sin[:, None]
            out = self.midlayer(hidden, embeds.to(hidden.dtype), cos, sin, core)
            normed = self.norm(out)
            outputs.append(normed)
            hidden = normed if self.config.norm_output else out
        return DraftOutput(outputs, self.lm_head)
