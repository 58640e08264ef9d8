"""A drafter of any family, built from its config: the family (`eaglet.families`) names the class
of its package that models it (`Family.model`), imported when first built, so a family registered
from a package of its own is built like the three that come with eaglet."""

from __future__ import annotations

import importlib

from eaglet import families
from eaglet.drafter.config import DraftConfig
from eaglet.drafter.eagle3 import Eagle3Draft
from eaglet.drafter.parallel import ParallelDraft

# The built-in parallel families, by name (tests and benches go over them)
P_EAGLE, DFLASH = families.P_EAGLE.name, families.DFLASH.name
PARALLEL_FAMILIES = (P_EAGLE, DFLASH)

DraftModel = Eagle3Draft | ParallelDraft  # a drafter of any family


def model_class(family: str) -> type[DraftModel]:
    """The class that models `family`: "module:Class" of its registration, imported."""
    module, _, name = families.family(family).model.partition(":")
    cls = getattr(importlib.import_module(module), name)
    if not (isinstance(cls, type) and issubclass(cls, (Eagle3Draft, ParallelDraft))):
        raise TypeError(f"drafter family {family!r}: its model {module}:{name} is not a drafter class")
    return cls


def build_model(cfg: DraftConfig) -> DraftModel:
    """The drafter `cfg` describes, of its family."""
    return model_class(cfg.family)(cfg)


def position_weights(family: str, block_size: int) -> list[float]:
    """The loss weight of each position a parallel family's block predicts (its model's own)."""
    cls = model_class(family)
    if not issubclass(cls, ParallelDraft):
        raise ValueError(f"drafter family {family!r}: not a parallel drafter")
    return cls.position_weights(block_size)


def predicted_positions(cfg: DraftConfig) -> int:
    """Draft tokens one pass proposes: K for P-EAGLE, B-1 for DFlash."""
    return families.family(cfg.family).drafts_per_pass(cfg.block_size)
