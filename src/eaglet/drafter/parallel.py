"""The parallel drafters: a whole block of draft tokens from one forward pass.

Two families share the Llama-style layers below and differ in what enters them:

    P-EAGLE   EAGLE-3's input at every committed position t, concat(norm(embed(x_{t+1})),
              hidden_norm(g_t)) with g = fc(three aux states), through `num_layers` causal layers
              (the first takes the 2H concat, as EAGLE-3's layer does). Position t predicts
              x_{t+2} ("depth 0"). Behind the last committed position sit K-1 parallel positions
              fed the embedding of `mask_token_id` and fc(`mask_hidden`), a learned stand-in for the
              three aux states [1, 1, 3H] (speculators' and vLLM's name and shape), at RoPE positions
              t+1 .. t+K-1: depth k predicts x_{t+2+k}. They see every committed position and the
              parallel positions before them (causal), so K drafts come from one pass.
    DFlash    block diffusion: the target's aux states, fused and normalised (hidden_norm(fc(.))),
              are the context every layer attends to, through its own k/v projections ("KV
              injection"); they never pass through the layers. The block is [anchor, mask x B-1]:
              the anchor is the last committed token (the target's own choice, not yet fed to it)
              at RoPE position a, the masks at a+1 .. a+B-1, attending to each other both ways and
              to the context before a. Block position i predicts x_{a+i}: B-1 drafts per pass.

Training runs many blocks per sequence at once: anchors on a grid of the positions that count
(`anchor_grid`, its offset turning with the optimizer step so every position is an anchor in
turn), each block a group of queries with its own mask, all in one batched attention.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from eaglet import families
from eaglet.drafter.attention import apply_rope, rope_cos_sin
from eaglet.drafter.config import DraftConfig
from eaglet.drafter.model import MLP, Drafter, Eagle3Draft, RMSNorm

# The built-in parallel families, by name. The code below reads a family's traits (`families`),
# so a family registered with the traits of one of them runs here unchanged.
P_EAGLE, DFLASH = families.P_EAGLE.name, families.DFLASH.name
PARALLEL_FAMILIES = (P_EAGLE, DFLASH)


P_EAGLE_KEEP, P_EAGLE_KEEP_MIN = 0.7, 0.2  # P-EAGLE's sampling: depth d keeps max(0.7^d, 0.2) of the positions


def position_weights(family: str, block_size: int) -> list[float]:
    """The loss weight of each predicted block position. DFlash: exp(-(k-1)/gamma) over block
    positions k = 1..B-1, gamma 7 for blocks of 16 (5 for 10, 4 for 8; the paper's), since a
    later position counts only when every earlier one was accepted. P-EAGLE: its paper averages
    the loss over sampled elements alike, and samples depth d at max(0.7^d, 0.2) of the positions
    depth 0 trains at, so depth d weighs that much against depth 0 (eaglet trains every depth on
    the same anchor grid and weights them instead of sampling)."""
    if families.family(family).injects_context:
        gamma = {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, max(1.0, block_size / 2.3))
        return [math.exp(-k / gamma) for k in range(block_size - 1)]
    return [max(P_EAGLE_KEEP**d, P_EAGLE_KEEP_MIN) for d in range(block_size)]


def predicted_positions(cfg: DraftConfig) -> int:
    """Draft tokens one pass proposes: K for P-EAGLE, B-1 for DFlash."""
    return families.family(cfg.family).drafts_per_pass(cfg.block_size)


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


class ParallelDraft(Drafter):
    """A P-EAGLE or DFlash drafter (`cfg.family`); names are those eaglet stores and exports."""

    hidden_norm: RMSNorm  # DFlash's
    mask_hidden: nn.Parameter  # P-EAGLE's

    def __init__(self, cfg: DraftConfig):
        traits = families.family(cfg.family)
        if not traits.parallel:  # DraftConfig checked the rest
            raise ValueError(f"family {cfg.family!r}: not a parallel drafter")
        super().__init__(cfg)
        self.traits = traits
        H = cfg.hidden_size
        self.fc = nn.Linear(3 * cfg.aux_width, H, bias=False)
        if traits.injects_context:
            self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)  # of the injected context
        else:
            # the parallel positions' stand-in for the aux states, through fc like them
            self.mask_hidden = nn.Parameter(torch.zeros(1, 1, 3 * cfg.aux_width))
        # without injected context, the first layer takes EAGLE-3's input (P-EAGLE)
        self.layers = nn.ModuleList(Layer(cfg, not traits.injects_context and i == 0) for i in range(cfg.num_layers))
        self.add_head()
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        super().reset_parameters(std)
        if hasattr(self, "mask_hidden"):
            nn.init.normal_(self.mask_hidden)  # a unit-scale state, as speculators initialises it

    def decoder_layers(self) -> list[Layer]:
        """The layers, typed (an nn.ModuleList yields plain Modules)."""
        return [layer for layer in self.layers if isinstance(layer, Layer)]

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def fuse(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """The fused aux states: P-EAGLE's g (its layers' hidden input), DFlash's normalised context."""
        g = self.fc(aux_hidden.to(self.dtype))
        return self.hidden_norm(g) if self.traits.injects_context else g

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin broadcastable over heads for positions [B, n] or [n]."""
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta)
        return (cos[:, None], sin[:, None]) if cos.dim() == 3 else (cos, sin)

    def parallel_hidden(self) -> torch.Tensor:
        """P-EAGLE's hidden input at a parallel position, [1, 1, H]: fc(mask_hidden)."""
        return self.fc(self.mask_hidden.to(self.dtype))

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
        if self.traits.injects_context:
            return self.dflash_blocks(input_ids, aux_hidden, anchors, documents, positions)
        return self.p_eagle_blocks(input_ids, aux_hidden, anchors, documents, positions)

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

    def dflash_blocks(
        self,
        input_ids: torch.Tensor,
        aux_hidden: torch.Tensor,
        anchors: torch.Tensor,
        documents: torch.Tensor,
        positions: torch.Tensor,
    ) -> BlockOutput:
        B, L = input_ids.shape
        A, n = anchors.shape[1], self.config.block_size
        ctx = self.fuse(aux_hidden)  # [B, L, H]
        q_anchor, q_pos, q_doc, q_block = self.block_layout(anchors, documents, positions, 0, n)
        tokens = input_ids.gather(1, anchors.clamp(min=0))  # the anchor token of each block
        x = self.mask_embedding((B, A, n), input_ids.device)
        x[:, :, 0] = self.embed_tokens(tokens)
        x = x.reshape(B, A * n, -1).to(ctx.dtype)
        # a block query sees the context before its anchor, in its sample, and its whole block
        keys = torch.arange(L, device=input_ids.device)
        sees_ctx = (keys[None, None, :] < q_anchor[:, :, None]) & (documents[:, None, :] == q_doc[:, :, None])
        sees_block = (q_block[:, None] == q_block[None, :])[None] & (q_doc[:, :, None] >= -1)
        allowed = torch.cat([sees_ctx, sees_block.expand(B, -1, -1)], dim=2)[:, None]
        allowed = allowed | ~allowed.any(-1, keepdim=True)  # padding blocks: any row, never used
        cos_c, sin_c = self.rope(positions)
        cos_q, sin_q = self.rope(q_pos)
        for layer in self.decoder_layers():
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            k_ctx, v_ctx = attn.keys_values(ctx, cos_c, sin_c)
            k_blk, v_blk = attn.keys_values(h, cos_q, sin_q)
            out = attn.attend(
                attn.query(h, cos_q, sin_q), torch.cat([k_ctx, k_blk], 2), torch.cat([v_ctx, v_blk], 2), allowed
            )
            x = layer.finish(x, out)
        normed = self.norm(x).view(B, A, n, -1)
        return self.block_output(normed, anchors, range(1, n), 1)

    def p_eagle_blocks(
        self,
        input_ids: torch.Tensor,
        aux_hidden: torch.Tensor,
        anchors: torch.Tensor,
        documents: torch.Tensor,
        positions: torch.Tensor,
    ) -> BlockOutput:
        B, L = input_ids.shape
        A, K = anchors.shape[1], self.config.block_size
        device = input_ids.device
        g = self.fuse(aux_hidden)
        next_tokens = torch.cat([input_ids[:, 1:], input_ids.new_zeros(B, 1)], dim=1)
        embeds = self.embed_tokens(next_tokens).to(g.dtype)
        n = K - 1
        q_anchor, q_pos, q_doc, _ = self.block_layout(anchors, documents, positions, 1, n)
        par_embeds = self.mask_embedding((B, A * n), device).to(g.dtype)
        par_hidden = self.parallel_hidden().expand(B, A * n, -1)
        # one stream: the L committed positions, then the parallel ones; real positions are
        # causal within their sample, parallel (anchor a, depth d) sees real positions <= a of
        # its sample and the same anchor's depths <= d
        keys = torch.arange(L, device=device)
        real = (keys[None, :] <= keys[:, None])[None] & (documents[:, :, None] == documents[:, None, :])
        par_real = (keys[None, None, :] <= q_anchor[:, :, None]) & (documents[:, None, :] == q_doc[:, :, None])
        depth = torch.arange(n, device=device).repeat(A)
        block = torch.arange(A, device=device).repeat_interleave(n)
        par_par = ((block[:, None] == block[None, :]) & (depth[None, :] <= depth[:, None]))[None].expand(B, -1, -1)
        allowed = torch.cat([torch.cat([real, real.new_zeros(B, L, A * n)], 2), torch.cat([par_real, par_par], 2)], 1)[
            :, None
        ]
        allowed = allowed | ~allowed.any(-1, keepdim=True)
        hidden = torch.cat([g, par_hidden], 1)
        cos, sin = self.rope(torch.cat([positions, q_pos], 1))
        x = torch.cat([embeds, par_embeds], 1)
        for i, layer in enumerate(self.decoder_layers()):
            inp = layer.layer_input(hidden, x if i == 0 else None)
            attn = layer.self_attn
            k, v = attn.keys_values(inp, cos, sin)
            hidden = layer.finish(hidden, attn.attend(attn.query(inp, cos, sin), k, v, allowed))
        normed = self.norm(hidden)
        depth0 = normed[:, :L]
        parallel = normed[:, L:].view(B, A, n, -1)
        at_anchor = depth0.gather(1, anchors.clamp(min=0)[:, :, None].expand(-1, -1, depth0.shape[-1]))[:, :, None]
        out = self.block_output(torch.cat([at_anchor, parallel], 2), anchors, range(K), 2)
        out.everywhere = depth0
        return out

    def block_output(self, normed: torch.Tensor, anchors: torch.Tensor, columns: range, shift: int) -> BlockOutput:
        """Per predicted position k (column c of the block), the outputs [B, A, H] and the row
        position they predict: anchor + shift + k."""
        hidden = [normed[:, :, c] for c in columns]
        predicts = [torch.where(anchors >= 0, anchors + shift + k, -1) for k in range(len(columns))]
        return BlockOutput(hidden, predicts, anchors, self.lm_head)


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


DraftModel = Eagle3Draft | ParallelDraft  # a drafter of any family


def build_model(cfg: DraftConfig) -> DraftModel:
    """The drafter `cfg` describes, of its family."""
    return ParallelDraft(cfg) if families.family(cfg.family).parallel else Eagle3Draft(cfg)
