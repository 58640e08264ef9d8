"""P-EAGLE: EAGLE-3's layer and K-1 parallel positions behind the last committed one, K drafts from
one pass (`model`: `PEagleDraft`, its training blocks, loss weights and decoding pass). Its family,
`eaglet.families.P_EAGLE`, names this package's model; its objective is
`eaglet.drafter.objectives.block_loss` with this model's position weights."""

from eaglet.drafter.p_eagle.model import PEagleDraft

__all__ = ["PEagleDraft"]
