"""How `eaglet eval` decodes: the decode options every method runs with (`DecodeSettings`).

The fields and their defaults are declared once, in eaglet.options (`DecodeOptions`); the draft
shapes and the probability floor left unset are the device preset's (presets.toml). `evaluate`
builds one from its options, so the command line, a recipe's [eval] and Python callers split
them the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from eaglet import ranges
from eaglet.options import ADMISSIONS, HYBRID_DRAFTS, PRESETS, DecodeOptions


@dataclass(frozen=True, kw_only=True)
class DecodeSettings(DecodeOptions):
    """The decode options checked, the preset's values filled in where left None."""

    eos_ids: tuple[int, ...] = ()  # the target's stop tokens (filled in by evaluate)
    pass_costs: tuple[float, ...] = ()  # seconds of a target pass over 1, 2, ... tokens (methods.with_pass_costs)

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise ValueError(f"--preset {self.preset!r}: choose one of {', '.join(PRESETS)} (presets.toml)")
        for key, value in PRESETS[self.preset]["eval"].items():
            if getattr(self, key) is None:
                object.__setattr__(self, key, value)  # frozen: filled once, while it is made
        ranges.at_least(
            1,
            max_new_tokens=self.max_new_tokens,
            depth=self.depth,
            top_k=self.top_k,
            total_tokens=self.total_tokens,
            chain_depth=self.chain_depth,
            lookup_tokens=self.lookup_tokens,
            max_ngram=self.max_ngram,
            hybrid_chain_depth=self.hybrid_chain_depth,
        )
        ranges.within(1, ranges.MAX_NEW_TOKENS, "more than any model's positions", max_new_tokens=self.max_new_tokens)
        ranges.within(
            1,
            ranges.MAX_CYCLE_TOKENS,
            "more than any pass verifies",
            depth=self.depth,
            top_k=self.top_k,
            total_tokens=self.total_tokens,
            chain_depth=self.chain_depth,
            lookup_tokens=self.lookup_tokens,
            max_ngram=self.max_ngram,
            hybrid_chain_depth=self.hybrid_chain_depth,
        )
        if self.hybrid_draft not in HYBRID_DRAFTS:
            raise ValueError(f"--hybrid-draft {self.hybrid_draft!r}: choose one of {', '.join(HYBRID_DRAFTS)}")
        if self.admission not in ADMISSIONS:
            raise ValueError(f"--admission {self.admission!r}: choose one of {', '.join(ADMISSIONS)}")
        if self.drop_rivals and self.admission != "all":
            raise ValueError("--drop-rivals applies to --admission all (cost admission weighs rivals itself)")
        ranges.within(0, 1, min_draft_prob=self.min_draft_prob)
        ranges.at_least(0, temperature=self.temperature)
        ranges.within(0, 1, low_open=True, top_p=self.top_p)
        ranges.seeds(seed=self.seed)

    # The preset's settings, filled in by __post_init__ where given as None, as what they are once
    # made: deciding comes first
    @property
    def tree(self) -> tuple[int, int, int]:
        """The tree's depth, branching per node and draft tokens verified per pass."""
        assert self.depth is not None and self.top_k is not None and self.total_tokens is not None
        return self.depth, self.top_k, self.total_tokens

    @property
    def chain(self) -> int:
        """Draft tokens per pass in chain mode."""
        assert self.chain_depth is not None
        return self.chain_depth

    @property
    def floor(self) -> float:
        """The least path probability of a proposed draft token."""
        assert self.min_draft_prob is not None
        return self.min_draft_prob

    def record(self) -> dict[str, Any]:
        """What eval.json says of how the methods decoded (the preset's values filled in)."""
        return {
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "tree": {"depth": self.depth, "top_k": self.top_k, "total_tokens": self.total_tokens},
            "chain_depth": self.chain_depth,
            "min_draft_prob": self.min_draft_prob,
            "seed": self.seed,
            "hybrid": {
                "draft": self.hybrid_draft,
                "chain_depth": self.hybrid_chain_depth,
                "drop_rivals": self.drop_rivals,
                "lookup_tokens": self.lookup_tokens,
                "max_ngram": self.max_ngram,
                "admission": self.admission,
            },
        }
