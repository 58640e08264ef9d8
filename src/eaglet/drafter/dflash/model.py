"""DFlash's drafter, block diffusion: the target's aux states, fused and normalised
(hidden_norm(fc(.))), are the context every layer attends to, through its own k/v projections ("KV
injection"); they never pass through the layers. The block is [anchor, mask x B-1]: the anchor is
the last committed token (the target's own choice, not yet fed to it) at RoPE position a, the masks
at a+1 .. a+B-1, attending to each other both ways and to the context before a. Block position i
predicts x_{a+i}: B-1 drafts per pass.
"""

from __future__ import annotations

import math

import torch

from eaglet.drafter.config import DraftConfig
from eaglet.drafter.layers import RMSNorm
from eaglet.drafter.parallel import BlockOutput, ParallelDraft, PassCache


class DFlashDraft(ParallelDraft):
    hidden_norm: RMSNorm

    def add_inputs(self, cfg: DraftConfig) -> None:
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # of the injected context

    @staticmethod
    def position_weights(block_size: int) -> list[float]:
        """exp(-(k-1)/gamma) over block positions k = 1..B-1, gamma 7 for blocks of 16 (5 for 10,
        4 for 8; the paper's), since a later position counts only when every earlier one was
        accepted."""
        gamma = {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, max(1.0, block_size / 2.3))
        return [math.exp(-k / gamma) for k in range(block_size - 1)]

    def fuse(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """The normalised context hidden_norm(fc(concat aux))."""
        return self.hidden_norm(super().fuse(aux_hidden))

    def blocks(
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

    def decode_pass(self, cache: PassCache, new: torch.Tensor | None, start: int, m: int) -> torch.Tensor:
        B = self.config.block_size
        device = self.fc.weight.device
        n = start + m  # the block's anchor position: the root, committed but not yet fed to the target
        block_pos = torch.arange(n, n + B, device=device)
        cos_q, sin_q = self.rope(block_pos)
        if m:
            assert new is not None  # m counts its rows
            ctx = self.fuse(new.to(device)[None])
            cos_c, sin_c = self.rope(torch.arange(start, n, device=device))
        assert self.config.mask_token_id is not None  # DraftConfig requires one of a parallel drafter
        tokens = torch.full((1, B), self.config.mask_token_id, device=device)
        tokens[0, 0] = cache.seq[-1]
        x = self.embed_tokens(tokens).to(self.dtype)
        for i, layer in enumerate(self.decoder_layers()):
            attn = layer.self_attn
            if m:
                cache.store(i, *attn.keys_values(ctx, cos_c, sin_c), start)
            k_ctx, v_ctx = cache.cached(i, n)
            h = layer.input_layernorm(x)
            k_blk, v_blk = attn.keys_values(h, cos_q, sin_q)
            allowed = torch.ones(1, 1, B, n + B, dtype=torch.bool, device=device)
            x = layer.finish(
                x,
                attn.attend(
                    attn.query(h, cos_q, sin_q), torch.cat([k_ctx, k_blk], 2), torch.cat([v_ctx, v_blk], 2), allowed
                ),
            )
        return self.norm(x)[0, 1:]
