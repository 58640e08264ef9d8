"""What every drafter family is built from: the RMSNorm and SwiGLU MLP of Llama's layers, and
`Drafter`, the frozen target embeddings, final norm, LM head over the draft vocabulary and d2t/t2d
maps that every family's model has around its own layers (`eaglet.drafter.eagle3`,
`eaglet.drafter.p_eagle`, `eaglet.drafter.dflash`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from eaglet.drafter.config import DraftConfig, build_draft_vocab


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 (as Llama does): bf16 variance loses too much.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class MLP(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Drafter(nn.Module):
    """What every drafter family has: the target's embeddings (frozen) first; last, a final norm, an
    LM head over the draft vocabulary and its d2t / t2d maps (`add_head`). A family's class adds
    its fc and layers between the two: modules are registered, and so initialised from the seed
    and written, in this order."""

    d2t: torch.Tensor  # buffers: draft id -> offset to its target id; target id -> in the draft vocabulary
    t2d: torch.Tensor

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.target_vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)  # copied from the target, frozen

    def add_head(self) -> None:
        cfg = self.config
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        d2t, t2d = build_draft_vocab({}, cfg.target_vocab_size, cfg.draft_vocab_size)
        self.register_buffer("d2t", d2t)
        self.register_buffer("t2d", t2d)

    def reset_parameters(self, std: float = 0.02) -> None:
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)
            elif isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)

    def set_draft_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def draft_to_target_ids(self) -> torch.Tensor:
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t


def load_embeddings_from(draft: Drafter, target_embeddings: torch.Tensor) -> None:
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(target_embeddings)  # casts as it copies: no temporary of vocab x H


def num_parameters(model: nn.Module, trainable_only: bool = True) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)
