"""Naive TTT attention: the reference every kernel of `eaglet.drafter.attention` is tested against.

At step k it concatenates the keys/values of steps 0..k (L * (k+1) keys), builds the full
boolean mask (causal over step 0, the own position only for steps 1..k) and runs plain SDPA.
Memory grows as (L x L*K): exactly what `DiagonalTTTAttention` avoids. Used by
tests/test_draft_model.py and bench/train_throughput.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def ttt_mask(L: int, step: int, device: torch.device | None = None, window: int | None = None) -> torch.Tensor:
    """Bool [L, L*(step+1)]: True where query t (at `step`) may attend key s of step j."""
    causal = torch.ones(L, L, dtype=torch.bool, device=device).tril()
    if window is not None:  # step-0 keys within the last `window` positions only
        causal &= ~torch.ones(L, L, dtype=torch.bool, device=device).tril(-window)
    diagonal = torch.eye(L, dtype=torch.bool, device=device)
    return torch.cat([causal] + [diagonal] * step, dim=1)


class NaiveTTTAttention:
    """Drop-in for `DiagonalTTTAttention`: same call, full concatenated keys and mask."""

    def __init__(self) -> None:
        self.window: int | None = None
        self.documents: torch.Tensor | None = None  # [B, L] packed rows: step-0 keys of the own document only
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.keys.append(k)
        self.values.append(v)
        step = len(self.keys) - 1
        mask = ttt_mask(q.shape[2], step, q.device, self.window)
        if self.documents is not None:
            L = q.shape[2]
            same = self.documents[:, :, None] == self.documents[:, None, :]
            mask = torch.cat([mask[None, :, :L] & same, mask[None, :, L:].expand(len(same), -1, -1)], dim=2)[:, None]
        return F.scaled_dot_product_attention(
            q,
            torch.cat(self.keys, dim=2),
            torch.cat(self.values, dim=2),
            attn_mask=mask,
            enable_gqa=q.shape[1] != k.shape[1],
        )
