"""DFlash: block diffusion over the target's fused states injected into every layer, B-1 drafts
from one pass (`model`: `DFlashDraft`, its training blocks, loss weights and decoding pass). Its
family, `eaglet.families.DFLASH`, names this package's model; its objective is
`eaglet.drafter.objectives.block_loss` with this model's position weights."""

from eaglet.drafter.dflash.model import DFlashDraft

__all__ = ["DFlashDraft"]
