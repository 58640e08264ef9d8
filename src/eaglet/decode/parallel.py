"""The parallel drafters as proposers: a P-EAGLE or DFlash drafter's block of drafts, one pass.

`ParallelProposer` keeps, per layer, the keys/values of the committed positions (P-EAGLE: its
layers' own at every committed position; DFlash: the injected context, the target's fused
states) and runs ONE drafter pass per cycle: the positions committed since the last pass (their
keys/values are kept) together with the block, whose keys/values are scratch. The block is
proposed as a chain, cut where the product of the drafts' probabilities under the drafter falls
below `min_prob`. The pass itself is the family's (`decode_pass` of `eaglet.drafter.p_eagle` and
`eaglet.drafter.dflash`); its training forward is the reference these incremental passes are
tested against.
"""

from __future__ import annotations

import math

import torch

from eaglet.decode.core import DraftTree
from eaglet.drafter import ParallelDraft, predicted_positions


class ParallelProposer:
    """Proposes the block of a `ParallelDraft` as a chain (top_k is ignored: one pass, one guess
    per position). `observe` only queues the new positions; `propose` runs the pass."""

    def __init__(self, drafter: ParallelDraft, min_prob: float = 0.0):
        if not 0.0 <= min_prob <= 1.0:
            raise ValueError(f"min_prob {min_prob}: a probability in [0, 1]")
        self.drafter, self.cfg = drafter, drafter.config
        self.layers = drafter.decoder_layers()
        self.name = self.cfg.family
        self.min_log_prob = math.log(min_prob) if min_prob > 0 else -math.inf
        self.aux_layer_ids = list(self.cfg.aux_layer_ids)
        self.draft_to_target = drafter.draft_to_target_ids()
        self.reset()

    def reset(self) -> None:
        self.keys: list[torch.Tensor | None] = [None] * self.cfg.num_layers  # [1, kv_heads, capacity, head_dim]
        self.values: list[torch.Tensor | None] = [None] * self.cfg.num_layers
        self.context_len = 0  # committed positions whose keys/values are kept
        self.pending: list[torch.Tensor] = []  # aux states [m, 3H] not yet through the drafter
        self.seq: list[int] = []
        self.last_out: torch.Tensor | None = None  # P-EAGLE: the normed output at the last committed position
        self.draft_forwards = 0
        self.path_log_probs: list[float] = []

    def observe(self, seq: list[int], aux: torch.Tensor | None) -> None:
        if aux is None:
            raise ValueError(f"a {self.name} drafter needs the target's aux states")
        queued = sum(a.shape[0] for a in self.pending)
        if self.context_len + queued + aux.shape[0] != len(seq) - 1:
            raise ValueError(
                f"drafter context {self.context_len + queued} + {aux.shape[0]} new positions != "
                f"committed {len(seq) - 1}"
            )
        if aux.shape[0]:
            self.pending.append(aux)
        self.seq = seq

    # -- the pass ---------------------------------------------------------------------------------

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        """Keep keys/values [1, kv, m, d] of committed positions start .. start+m-1."""
        end = start + k.shape[2]
        keys, values = self.keys[layer], self.values[layer]  # stored together: both or neither
        if keys is None or values is None or keys.shape[2] < end:
            cap = max(end, 256, 0 if keys is None else 2 * keys.shape[2])
            grown_k, grown_v = k.new_zeros(1, k.shape[1], cap, k.shape[3]), v.new_zeros(1, v.shape[1], cap, v.shape[3])
            if keys is not None and values is not None:
                grown_k[:, :, :start], grown_v[:, :, :start] = keys[:, :, :start], values[:, :, :start]
            self.keys[layer], self.values[layer] = grown_k, grown_v
            keys, values = grown_k, grown_v
        keys[:, :, start:end] = k
        values[:, :, start:end] = v

    def cached(self, layer: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.keys[layer], self.values[layer]
        if keys is None or values is None:  # stored together: both or neither
            d = self.layers[layer].self_attn
            empty = self.drafter.fc.weight.new_zeros(1, d.num_kv_heads, 0, d.head_dim)
            return empty, empty
        return keys[:, :, :n], values[:, :, :n]

    @torch.no_grad()
    def block_outputs(self) -> torch.Tensor:
        """The normed outputs [n, H] of the block's predicting positions, after taking in the queue."""
        new = torch.cat(self.pending) if self.pending else None
        self.pending = []
        start = self.context_len
        m = 0 if new is None else new.shape[0]
        out = self.drafter.decode_pass(self, new, start, m)
        self.context_len = start + m
        self.draft_forwards += 1
        return out

    # -- Proposer interface --------------------------------------------------------------------

    def propose(self, max_depth: int, top_k: int, total_tokens: int) -> DraftTree:
        self.path_log_probs = []
        limit = min(max_depth, total_tokens, predicted_positions(self.cfg))
        if limit < 1 or not self.seq:
            return DraftTree.empty()
        out = self.block_outputs()[:limit]
        log_probs = torch.log_softmax(self.drafter.lm_head(out).float(), dim=-1)
        best, ids = log_probs.max(-1)
        path = best.cumsum(0).tolist()
        keep = next((i for i, lp in enumerate(path) if lp < self.min_log_prob), len(path))
        self.path_log_probs = path[:keep]
        return DraftTree.chain(self.draft_to_target[ids[:keep]].tolist())
