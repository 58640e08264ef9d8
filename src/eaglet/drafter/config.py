"""The drafter's shape (`DraftConfig`, one Llama layer shaped like the target's) and its draft
vocabulary (`build_draft_vocab`: the most frequent trained-on target tokens)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from eaglet import families, layers, options

DEFAULT_DRAFT_VOCAB = 8192  # bench/train_efficiency.py: 8k beat 16k and 32k at equal time on a CPU
DEFAULT_TTT_STEPS: int = options.TrainSettings.ttt_steps  # the train option's, declared once


# An MLA target's drafter attention may be this much wider than the hidden size (heads x head_dim).
MLA_MAX_WIDTH = 1.25
MLA_NARROW_KV_HEADS = 8  # SpecForge's DeepSeek-V3 drafter: 56 heads of 128 over 8 KV heads


def attention_shape(c: Any) -> tuple[int, int, int]:
    """(heads, KV heads, head_dim) of the drafter's Llama attention for a target config.

    A plain target's own. An MLA target (DeepSeek-V3, Kimi-K2/K2.5: `kv_lora_rank` set) has no
    plain head size (192-wide query/key heads through low-rank projections, 128-wide values), and
    hidden / heads (56 for DeepSeek-V3, 112 for Kimi) matches no published drafter. The published
    Llama-layer drafters use heads of the target's value width, 128: Kimi-K2/K2.5's (SpecForge's
    and TorchSpec's configs) keep the target's 64 heads, all KV (64 x 128 = 8192, 1.14 x hidden);
    DeepSeek-V3's 128 heads would make 16384, so SpecForge's has hidden / 128 = 56 heads over 8 KV
    heads. One rule gives both: the target's heads at its value width while that stays within
    MLA_MAX_WIDTH x hidden, else hidden / value width heads over MLA_NARROW_KV_HEADS."""
    heads = c.num_attention_heads
    if getattr(c, "kv_lora_rank", None) is None:
        return (
            heads,
            getattr(c, "num_key_value_heads", None) or heads,
            getattr(c, "head_dim", None) or c.hidden_size // heads,
        )
    head_dim = c.v_head_dim
    if heads * head_dim <= MLA_MAX_WIDTH * c.hidden_size:
        return heads, heads, head_dim
    narrow = c.hidden_size // head_dim
    return narrow, MLA_NARROW_KV_HEADS if narrow % MLA_NARROW_KV_HEADS == 0 else narrow, head_dim


@dataclass
class DraftConfig:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    target_vocab_size: int
    draft_vocab_size: int
    aux_layer_ids: list[int] = field(default_factory=list)
    fc_norm: bool = False  # EAGLE-3.1: RMSNorm over the 3H concat before fc
    norm_output: bool = False  # EAGLE-3.1: feed the post-norm output to the next TTT step
    norm_before_residual: bool = False  # residual = hidden_norm(g) instead of g (speculators' default)
    sliding_window: int | None = None  # step-0 keys a query sees: the last W positions (None: all)
    target_hidden_size: int | None = None  # width of the aux states (defaults to hidden_size)
    family: str = families.EAGLE3.name  # a registered family (eaglet.families): EAGLE-3, or a parallel drafter
    num_layers: int = 1  # decoder layers (EAGLE-3: its one midlayer)
    block_size: int = 0  # parallel drafters: P-EAGLE's K drafts a pass, DFlash's block (anchor + B-1 drafts)
    mask_token_id: int | None = None  # parallel drafters: the token whose embedding fills the unknown positions

    def __post_init__(self) -> None:
        if not families.is_family(self.family):
            raise ValueError(f"family {self.family!r}: one of {list(families.FAMILIES)}")
        parallel = families.family(self.family).parallel
        if not parallel and (self.num_layers != 1 or self.block_size or self.mask_token_id is not None):
            raise ValueError("an EAGLE-3 drafter has one layer and no block_size or mask_token_id")
        if parallel:
            if self.num_layers < 1 or self.block_size < 2:
                raise ValueError(
                    f"a {self.family} drafter needs num_layers >= 1 (got {self.num_layers}) and "
                    f"block_size >= 2 (got {self.block_size})"
                )
            if self.mask_token_id is None or not 0 <= self.mask_token_id < self.target_vocab_size:
                raise ValueError(
                    f"mask_token_id {self.mask_token_id}: a {self.family} drafter needs a target token "
                    f"id in [0, {self.target_vocab_size})"
                )
        if not (self.rope_theta > 0 and math.isfinite(self.rope_theta)):  # RoPE's base: a frequency of theta^(-i/d)
            raise ValueError(f"rope_theta {self.rope_theta}: must be > 0 and finite")
        if not (self.rms_norm_eps > 0 and math.isfinite(self.rms_norm_eps)):  # below 0 a zero row's norm is NaN
            raise ValueError(f"rms_norm_eps {self.rms_norm_eps}: must be > 0 and finite")
        sizes = {
            "hidden_size": self.hidden_size,
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "max_position_embeddings": self.max_position_embeddings,
            "target_vocab_size": self.target_vocab_size,
        }
        bad = [f"{name} {value}" for name, value in sizes.items() if not (isinstance(value, int) and value >= 1)]
        if bad:
            raise ValueError(f"{', '.join(bad)}: must be whole numbers >= 1")
        switches = {
            "fc_norm": self.fc_norm,
            "norm_output": self.norm_output,
            "norm_before_residual": self.norm_before_residual,
        }
        not_bool = [f"{name} {value!r}" for name, value in switches.items() if not isinstance(value, bool)]
        if not_bool:  # "yes" would be exported as it is, and read as on by one engine, off by another
            raise ValueError(f"{', '.join(not_bool)}: must be true or false")
        if self.target_hidden_size is None:
            self.target_hidden_size = self.hidden_size
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if not 0 < self.draft_vocab_size <= self.target_vocab_size:
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} must be in [1, {self.target_vocab_size}]")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window {self.sliding_window} must be >= 1 (or None for full attention)")

    @classmethod
    def from_target(
        cls, target_config: Any, aux_layer_ids: list[int], draft_vocab_size: int | None = None, **overrides: Any
    ) -> DraftConfig:
        """One Llama layer shaped like the target's layers (the EAGLE-3 default; `attention_shape`
        for an MLA target)."""
        c = target_config
        rope = getattr(c, "rope_parameters", None) or {}
        vocab = c.vocab_size
        heads, kv_heads, head_dim = attention_shape(c)
        values = dict(
            hidden_size=c.hidden_size,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=c.intermediate_size,
            rms_norm_eps=getattr(c, "rms_norm_eps", 1e-6),
            rope_theta=getattr(c, "rope_theta", None) or rope.get("rope_theta", 10000.0),
            max_position_embeddings=layers.config_positions(c),
            target_vocab_size=vocab,
            draft_vocab_size=draft_vocab_size or min(DEFAULT_DRAFT_VOCAB, vocab),
            aux_layer_ids=list(aux_layer_ids),
            target_hidden_size=c.hidden_size,
        )
        values.update(overrides)
        return cls(**values)

    @property
    def aux_width(self) -> int:
        """The width of one aux state: the target's hidden size (`__post_init__` fills it in)."""
        assert self.target_hidden_size is not None
        return self.target_hidden_size

    @property
    def mask_token(self) -> int:
        """A parallel drafter's mask token (`__post_init__` refuses one without it)."""
        assert self.mask_token_id is not None, f"a {self.family} drafter has no mask token"
        return self.mask_token_id

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def build_draft_vocab(
    token_freq: dict[int, int], target_vocab_size: int, draft_vocab_size: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) for the `draft_vocab_size` most frequent loss-masked tokens.

    Draft ids are the chosen target ids in ascending order (as EAGLE does), so
    `target_id = i + d2t[i]`. When the data has fewer distinct tokens than the draft vocab, the
    lowest unused target ids fill it: a short vocab crashes engines that assume the size.
    """
    size = draft_vocab_size or min(DEFAULT_DRAFT_VOCAB, target_vocab_size)
    if not 0 < size <= target_vocab_size:
        raise ValueError(f"draft vocab size {size} must be in [1, target vocab {target_vocab_size}]")
    ranked = sorted(
        ((c, t) for t, c in token_freq.items() if 0 <= t < target_vocab_size and c > 0), key=lambda ct: (-ct[0], ct[1])
    )
    chosen = {t for _, t in ranked[:size]}
    filler = (t for t in range(target_vocab_size) if t not in chosen)
    while len(chosen) < size:
        chosen.add(next(filler))
    draft_ids = torch.tensor(sorted(chosen), dtype=torch.long)
    d2t = draft_ids - torch.arange(size, dtype=torch.long)
    t2d = torch.zeros(target_vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    return d2t, t2d
