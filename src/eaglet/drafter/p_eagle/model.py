"""P-EAGLE's drafter: EAGLE-3's input at every committed position t, concat(norm(embed(x_{t+1})),
hidden_norm(g_t)) with g = fc(three aux states), through `num_layers` causal layers (the first takes
the 2H concat, as EAGLE-3's layer does). Position t predicts x_{t+2} ("depth 0"). Behind the last
committed position sit K-1 parallel positions fed the embedding of `mask_token_id` and
fc(`mask_hidden`), a learned stand-in for the three aux states [1, 1, 3H] (speculators' and vLLM's
name and shape), at RoPE positions t+1 .. t+K-1: depth k predicts x_{t+2+k}. They see every
committed position and the parallel positions before them (causal), so K drafts come from one pass.
"""

from __future__ import annotations

import torch
from torch import nn

from eaglet.drafter.config import DraftConfig
from eaglet.drafter.parallel import BlockOutput, ParallelDraft, PassCache

KEEP, KEEP_MIN = 0.7, 0.2  # P-EAGLE's sampling: depth d keeps max(0.7^d, 0.2) of the positions


class PEagleDraft(ParallelDraft):
    EAGLE_INPUT = True
    mask_hidden: nn.Parameter

    def add_inputs(self, cfg: DraftConfig) -> None:
        # the parallel positions' stand-in for the aux states, through fc like them
        self.mask_hidden = nn.Parameter(torch.zeros(1, 1, 3 * cfg.aux_width))

    def reset_parameters(self, std: float = 0.02) -> None:
        super().reset_parameters(std)
        if hasattr(self, "mask_hidden"):
            nn.init.normal_(self.mask_hidden)  # a unit-scale state, as speculators initialises it

    @staticmethod
    def position_weights(block_size: int) -> list[float]:
        """Its paper averages the loss over sampled elements alike, and samples depth d at
        max(0.7^d, 0.2) of the positions depth 0 trains at, so depth d weighs that much against
        depth 0 (eaglet trains every depth on the same anchor grid and weights them instead of
        sampling)."""
        return [max(KEEP**d, KEEP_MIN) for d in range(block_size)]

    def parallel_hidden(self) -> torch.Tensor:
        """The hidden input at a parallel position, [1, 1, H]: fc(mask_hidden)."""
        return self.fc(self.mask_hidden.to(self.dtype))

    def blocks(
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

    def decode_pass(self, cache: PassCache, new: torch.Tensor | None, start: int, m: int) -> torch.Tensor:
        K = self.config.block_size
        device = self.fc.weight.device
        last = start + m - 1  # the last committed position with aux states: depth 0 predicts 2 ahead of it
        real_tokens = torch.tensor(cache.seq[start + 1 : start + m + 1], dtype=torch.long, device=device)
        g = self.fuse(new.to(device)) if new is not None else self.fc.weight.new_zeros(0, self.config.hidden_size)
        hidden = torch.cat([g, self.parallel_hidden()[0].expand(K - 1, -1)])[None]
        x = torch.cat([self.embed_tokens(real_tokens), self.mask_embedding((K - 1,), device)]).to(self.dtype)[None]
        q_pos = torch.cat(
            [torch.arange(start, start + m, device=device), torch.arange(last + 1, last + K, device=device)]
        )
        cos, sin = self.rope(q_pos)
        q = m + K - 1
        # queries see every kept position, the new real ones causally, the parallel ones causally after all real
        keys = torch.arange(start + q, device=device)
        queries = torch.arange(start, start + q, device=device)
        allowed = (keys[None, :] <= queries[:, None])[None, None]
        for i, layer in enumerate(self.decoder_layers()):
            attn = layer.self_attn
            inp = layer.layer_input(hidden, x if i == 0 else None)
            k, v = attn.keys_values(inp, cos, sin)
            if m:
                cache.store(i, k[:, :, :m], v[:, :, :m], start)
            k_old, v_old = cache.cached(i, start)
            hidden = layer.finish(
                hidden,
                attn.attend(attn.query(inp, cos, sin), torch.cat([k_old, k], 2), torch.cat([v_old, v], 2), allowed),
            )
        normed = self.norm(hidden)[0]
        if m:
            cache.last_out = normed[m - 1]
        if cache.last_out is None:
            raise ValueError("P-EAGLE proposes after the target's aux states of at least one position")
        return torch.cat([cache.last_out[None], normed[m:]])
