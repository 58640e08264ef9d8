"""What the parallel drafters share: a whole block of draft tokens from one forward pass, through
Llama-style layers (`Layer`, with `Attention` whose keys/values may begin with an injected
context). Each family's package says what enters the layers and how a block is laid out:

    P-EAGLE   (`eaglet.drafter.p_eagle`) EAGLE-3's input at every committed position, and K-1
              parallel positions behind the last, fed a mask token and a learned stand-in for the
              aux states: K drafts a pass.
    DFlash    (`eaglet.drafter.dflash`) block diffusion: the fused aux states are a context every
              layer attends to through its own k/v projections; the block [anchor, mask x B-1]
              attends to it and to itself both ways: B-1 drafts a pass.

Training runs many blocks per sequence at once: anchors on a grid of the positions that count
(`anchor_grid`, its offset turning with the optimizer step so every position is an anchor in
turn), each block a group of queries with its own mask, all in one batched attention (the family's
`blocks`). Decoding runs one block after the committed positions (the family's `decode_pass`),
with the committed positions' keys and values kept by the proposer (`PassCache`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from eaglet import families
from eaglet.drafter.attention import apply_rope, rope_cos_sin
from eaglet.drafter.config import DraftConfig
from eaglet.drafter.layers import MLP, Drafter, RMSNorm


class Attention(nn.Module):
    """Llama attention whose keys/values may begin with an injected context (DFlash), with
    optional per-head q/k RMSNorm (Qwen3's, which DFlash's layers use)."""

    def __init__(self, cfg: DraftConfig, in_dim: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(in_dim, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(in_dim, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(in_dim, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        if families.family(cfg.family).qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def heads(self, proj: nn.Linear, x: torch.Tensor, n: int) -> torch.Tensor:
        return proj(x).view(*x.shape[:2], n, self.head_dim).transpose(1, 2)

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Roped keys and values [B, kv_heads, n, head_dim] of inputs x [B, n, in_dim]."""
        k = self.heads(self.k_proj, x, self.num_kv_heads)
        if hasattr(self, "k_norm"):
            k = self.k_norm(k)
        return apply_rope(k, cos, sin), self.heads(self.v_proj, x, self.num_kv_heads)

    def query(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q = self.heads(self.q_proj, x, self.num_heads)
        if hasattr(self, "q_norm"):
            q = self.q_norm(q)
        return apply_rope(q, cos, sin)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """o_proj(attention) for queries q over keys k / values v; `allowed` [B or 1, 1, q, k] bool."""
        out = F.scaled_dot_product_attention(
            q, k.to(q.dtype), v.to(q.dtype), attn_mask=allowed, enable_gqa=self.num_heads != self.num_kv_heads
        )
        return self.o_proj(out.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1))


class Layer(nn.Module):
    """A Llama decoder layer. P-EAGLE's first takes EAGLE-3's 2H input (with `hidden_norm`) and
    keeps the hidden as its residual; the others are plain pre-norm layers."""

    def __init__(self, cfg: DraftConfig, first_of_p_eagle: bool):
        super().__init__()
        H = cfg.hidden_size
        self.eagle_input = first_of_p_eagle
        if first_of_p_eagle:
            self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.input_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, 2 * H if first_of_p_eagle else H)
        self.post_attention_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def layer_input(self, hidden: torch.Tensor, embeds: torch.Tensor | None) -> torch.Tensor:
        if self.eagle_input:
            return torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        return self.input_layernorm(hidden)

    def finish(self, hidden: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        h = hidden + attended
        return h + self.mlp(self.post_attention_layernorm(h))


@dataclass
class BlockOutput:
    """What a training forward gives the loss: per predicted block position k, the final norm's
    output at each block [B, A, H] (A anchors per row) and the row position of the token it
    predicts [B, A] (-1 where the anchor is padding); P-EAGLE's depth-0 output at every position
    [B, L, H] besides (it trains everywhere, as EAGLE-3's step 0)."""

    hidden: list[torch.Tensor]
    predicts: list[torch.Tensor]
    anchors: torch.Tensor
    head: nn.Module
    everywhere: torch.Tensor | None = None


class PassCache(Protocol):
    """What a decoding pass keeps between passes (eaglet.decode's `ParallelProposer`): the committed
    sequence and, per layer, the committed positions' keys and values."""

    seq: list[int]
    last_out: torch.Tensor | None  # P-EAGLE: the normed output at the last committed position

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int) -> None: ...

    def cached(self, layer: int, n: int) -> tuple[torch.Tensor, torch.Tensor]: ...


class ParallelDraft(Drafter):
    """What a parallel drafter of any family has (`cfg.family`); names are those eaglet stores and
    exports. A family's class adds what enters the layers (`add_inputs`), says whether the first
    layer takes EAGLE-3's input (`EAGLE_INPUT`), and lays out its blocks (`blocks`, training;
    `decode_pass`, decoding) and their loss weights (`position_weights`)."""

    EAGLE_INPUT = False  # the first layer takes concat(norm(embedding), hidden_norm(hidden)), as EAGLE-3's

    def __init__(self, cfg: DraftConfig):
        if not families.family(cfg.family).parallel:  # DraftConfig checked the rest
            raise ValueError(f"family {cfg.family!r}: not a parallel drafter")
        super().__init__(cfg)
        self.fc = nn.Linear(3 * cfg.aux_width, cfg.hidden_size, bias=False)
        self.add_inputs(cfg)
        self.layers = nn.ModuleList(Layer(cfg, self.EAGLE_INPUT and i == 0) for i in range(cfg.num_layers))
        self.add_head()
        self.reset_parameters()

    def add_inputs(self, cfg: DraftConfig) -> None:
        """The family's own modules between fc and the layers (registered, so initialised and
        written, in this order)."""

    @staticmethod
    def position_weights(block_size: int) -> list[float]:
        """The loss weight of each predicted block position."""
        raise NotImplementedError

    def decoder_layers(self) -> list[Layer]:
        """The layers, typed (an nn.ModuleList yields plain Modules)."""
        return [layer for layer in self.layers if isinstance(layer, Layer)]

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def fuse(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """The fused aux states fc(concat aux)."""
        return self.fc(aux_hidden.to(self.dtype))

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin broadcastable over heads for positions [B, n] or [n]."""
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta)
        return (cos[:, None], sin[:, None]) if cos.dim() == 3 else (cos, sin)

    def mask_embedding(self, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        ids = torch.full(shape, self.config.mask_token, dtype=torch.long, device=device)
        return self.embed_tokens(ids)

    # -- training ---------------------------------------------------------------------------------

    def forward(
        self,
        input_ids: torch.Tensor,
        aux_hidden: torch.Tensor,
        anchors: torch.Tensor,
        documents: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> BlockOutput:
        """Blocks at `anchors` [B, A] (row positions, -1 = none) of rows input_ids [B, L] with their
        aux states [B, L, 3H]; packed rows number their samples in `documents` and restart RoPE
        positions at each (`positions`), and a block sees only its own sample."""
        B, L = input_ids.shape
        device = input_ids.device
        if positions is None:
            positions = torch.arange(L, device=device).expand(B, L)
        if documents is None:
            documents = torch.zeros(B, L, dtype=torch.long, device=device)
        return self.blocks(input_ids, aux_hidden, anchors, documents, positions)

    def blocks(
        self,
        input_ids: torch.Tensor,
        aux_hidden: torch.Tensor,
        anchors: torch.Tensor,
        documents: torch.Tensor,
        positions: torch.Tensor,
    ) -> BlockOutput:
        """The family's training forward: `forward`'s blocks, documents and positions given."""
        raise NotImplementedError

    @staticmethod
    def block_layout(
        anchors: torch.Tensor, documents: torch.Tensor, positions: torch.Tensor, first: int, n: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """For A anchors x n block positions (RoPE offsets first .. first+n-1 from the anchor's):
        the anchor of each block query [B, A*n] (clamped), its RoPE position, its document (-2
        where the anchor is padding) and its block number [A*n]."""
        B, A = anchors.shape
        a = anchors.clamp(min=0)
        offsets = torch.arange(first, first + n, device=anchors.device)
        query_anchor = a[:, :, None].expand(B, A, n).reshape(B, A * n)
        rope_pos = (positions.gather(1, a)[:, :, None] + offsets).reshape(B, A * n)
        doc = documents.gather(1, a).masked_fill(anchors < 0, -2)[:, :, None].expand(B, A, n).reshape(B, A * n)
        block = torch.arange(A, device=anchors.device)[:, None].expand(A, n).reshape(A * n)
        return query_anchor, rope_pos, doc, block

    def block_output(self, normed: torch.Tensor, anchors: torch.Tensor, columns: range, shift: int) -> BlockOutput:
        """Per predicted position k (column c of the block), the outputs [B, A, H] and the row
        position they predict: anchor + shift + k."""
        hidden = [normed[:, :, c] for c in columns]
        predicts = [torch.where(anchors >= 0, anchors + shift + k, -1) for k in range(len(columns))]
        return BlockOutput(hidden, predicts, anchors, self.lm_head)

    # -- decoding -------------------------------------------------------------------------------

    def decode_pass(self, cache: PassCache, new: torch.Tensor | None, start: int, m: int) -> torch.Tensor:
        """One block after the committed positions: the normed outputs [n, H] of its predicting
        positions, taking in `new` aux states [m, 3H] of committed positions start .. start+m-1."""
        raise NotImplementedError


def anchor_grid(
    counted: torch.Tensor, documents: torch.Tensor | None, stride: int, offset: int, first_shift: int
) -> torch.Tensor:
    """Anchors [B, A] (-1 padded): every `stride`-th of the row positions a whose first predicted
    token (a + first_shift: 1 for DFlash, 2 for P-EAGLE) counts (`counted` [B, L]) and lies in
    a's sample, starting at the `offset % stride`-th. Training turns `offset` with the optimizer
    step, so over `stride` steps every such position is an anchor once; held-out uses 0. The width
    is ceil(L / stride) whatever the row holds, so packed rows give every step the same shapes."""
    B, L = counted.shape
    valid = torch.zeros_like(counted, dtype=torch.bool)
    if L > first_shift:
        ok = counted[:, first_shift:].bool()
        if documents is not None:
            ok = ok & (documents[:, first_shift:] == documents[:, : L - first_shift])
        valid[:, : L - first_shift] = ok
    rows = []
    for b in range(B):
        where = valid[b].nonzero().flatten()
        rows.append(where[offset % stride :: stride])
    width = max(1, -(-L // stride))  # the most a row can hold: one shape per row length (one compiled graph)
    out = torch.full((B, width), -1, dtype=torch.long, device=counted.device)
    for b, r in enumerate(rows):
        out[b, : len(r)] = r
    return out
