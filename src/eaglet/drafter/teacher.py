"""What the drafter learns from: the frozen target's final norm and LM head (`TeacherHead`, in
fp32 by `make_teacher_head`) and the distribution they give, restricted to the draft vocabulary
(`Teacher`: dense, or the top-k draft ids). `make_teacher_head` is also what `eaglet extract
--layout compact` stores its top-K with (`target_top_k`), so a compact dataset holds exactly
the teacher training would compute (`teacher_from_top_k`)."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from eaglet import formats
from eaglet.heads import TargetHeads
from eaglet.target import heads_of_model

if TYPE_CHECKING:  # transformers' modelling code loads only with a model
    from transformers import PreTrainedModel


# ---------------------------------------------------------------------------------------------
# The teacher head
# ---------------------------------------------------------------------------------------------


class TeacherHead(nn.Module):
    """The frozen target's final norm and LM head; nothing else of the target is kept."""

    def __init__(self, final_norm: nn.Module, lm_head: nn.Linear | None):
        super().__init__()
        self.final_norm, self.lm_head = final_norm, lm_head
        self.requires_grad_(False)


ModuleT = TypeVar("ModuleT", bound=nn.Module)


def in_dtype(module: ModuleT, dtype: torch.dtype | None) -> ModuleT:
    """`module` itself when it is in `dtype` already, or `dtype` is None (no second copy of a large
    LM head), else a copy in `dtype`: the target running online in bf16 must stay bf16."""
    if dtype is None or all(p.dtype == dtype for p in module.parameters()):
        return module
    return copy.deepcopy(module).to(dtype)


def make_teacher_head(
    target: TargetHeads | PreTrainedModel, last_hidden_state: str, head_dtype: torch.dtype | None = torch.float32
) -> TeacherHead:
    """The teacher from the target's heads (read alone, or a loaded model's): the final norm in
    fp32, the LM head in `head_dtype` (None: as it is, for a user that makes its own copy in the
    dtype it computes in, as training's `DraftFirstHead` does); without the final norm when the
    stored last state is already normed (SpecForge stores it after the norm)."""
    heads = target if isinstance(target, TargetHeads) else heads_of_model(target)
    norm = heads.norm() if last_hidden_state == formats.LAST_STATE_PRE_NORM else nn.Identity()
    return TeacherHead(in_dtype(norm, torch.float32), in_dtype(heads.head(), head_dtype))


# ---------------------------------------------------------------------------------------------
# The teacher's distribution
# ---------------------------------------------------------------------------------------------


@dataclass
class Teacher:
    """The target's distribution at each position, restricted to the draft vocabulary.

    Dense (`ids` None): log-probabilities over the whole draft vocabulary. Sparse: only the
    teacher's `top_k` draft ids, their log-probabilities renormalised over those k, which is
    what a stored or cached teacher keeps (k = 1 is the hard label)."""

    log_probs: torch.Tensor  # [B, L, Vd] dense, or [B, L, k] sparse; fp32 (a cache may hold fp16)
    argmax: torch.Tensor  # [B, L] draft id of the target's argmax among draft ids
    in_draft: torch.Tensor  # [B, L] bool: the target's full-vocab argmax is in the draft vocab
    ids: torch.Tensor | None = None  # [B, L, k] draft ids of a sparse teacher
    features: torch.Tensor | None = None  # [B, L, H] final_norm(h_N): the feature-regression target

    @property
    def top_k(self) -> int | None:
        return None if self.ids is None else self.ids.shape[-1]


class DraftFirstHead(nn.Module):
    """The target's LM head with its rows reordered, the draft ids first: one product gives the
    draft-vocabulary logits as a contiguous block and the rest's maximum, which says whether the
    target's argmax is drafted, without gathering draft columns out of a [T, vocab] tensor or an
    argmax over all of it (on a CPU those took more time than the product). Build it once."""

    weight: torch.Tensor  # a buffer: the head's rows, the draft ids first

    def __init__(self, lm_head: nn.Linear, d2t: torch.Tensor, t2d: torch.Tensor, dtype: torch.dtype | None = None):
        super().__init__()
        weight = lm_head.weight.detach()
        draft_ids = torch.arange(d2t.shape[0], device=d2t.device) + d2t
        rest = (~t2d).nonzero().squeeze(-1)
        self.register_buffer("weight", torch.cat([weight[draft_ids], weight[rest]]).to(dtype or weight.dtype))
        self.draft_size = d2t.shape[0]

    def forward(self, normed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(draft logits fp32 [..., Vd], max logit over the other ids [...] (-inf when none))."""
        logits = F.linear(normed.to(self.weight.dtype), self.weight)
        draft = logits[..., : self.draft_size].float()
        if logits.shape[-1] == self.draft_size:
            return draft, torch.full(draft.shape[:-1], float("-inf"), device=draft.device)
        return draft, logits[..., self.draft_size :].amax(-1).float()


@torch.no_grad()
def make_teacher(
    last_hidden: torch.Tensor,
    final_norm: nn.Module,
    lm_head: nn.Linear | DraftFirstHead,
    d2t: torch.Tensor,
    t2d: torch.Tensor,
    top_k: int | None = None,
    features: bool = False,
) -> Teacher:
    """`lm_head(final_norm(h_N))` of the frozen target from the stored pre-norm last state;
    dense, or sparse with the `top_k` most likely draft ids. `lm_head` is the target's head, or
    its `DraftFirstHead` made once (the same numbers, faster). The target's argmax counts as
    drafted when the best draft logit is at least every other one (an exact tie, vanishingly
    rare, counts as drafted)."""
    head = lm_head if isinstance(lm_head, DraftFirstHead) else DraftFirstHead(lm_head, d2t, t2d)
    normed = final_norm(last_hidden.to(head.weight.dtype))
    draft, rest_max = head(normed)
    in_draft = draft.amax(-1) >= rest_max
    log_probs = torch.log_softmax(draft, dim=-1)
    del draft
    feats = normed if features else None
    if top_k is None or top_k >= d2t.shape[0]:
        return Teacher(log_probs, log_probs.argmax(-1), in_draft, features=feats)
    top, ids = log_probs.topk(top_k, dim=-1)
    return Teacher(top - torch.logsumexp(top, dim=-1, keepdim=True), ids[..., 0], in_draft, ids, feats)


@torch.no_grad()
def target_top_k(
    last_hidden: torch.Tensor, final_norm: nn.Module, lm_head: nn.Module, k: int, chunk: int = 256
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids int32 [T, k], log-probabilities fp16 [T, k]) of the target's k most likely next tokens
    over its whole vocabulary, most likely first: the teacher a compact dataset stores. Computed
    as `make_teacher` computes it, a chunk of positions at a time (no [T, vocab] tensor)."""
    ids, log_probs = [], []
    dtype = lm_head.weight.dtype
    for part in last_hidden.split(chunk):
        logits = lm_head(final_norm(part.to(dtype))).float()
        top, idx = logits.topk(k, dim=-1)  # log_softmax of the k only: no second [chunk, vocab] tensor
        ids.append(idx.to(torch.int32))
        log_probs.append((top - torch.logsumexp(logits, dim=-1, keepdim=True)).to(torch.float16))
    return torch.cat(ids), torch.cat(log_probs)


def teacher_from_top_k(
    ids: torch.Tensor, log_probs: torch.Tensor, d2t: torch.Tensor, t2d: torch.Tensor, top_k: int
) -> Teacher:
    """The sparse teacher `make_teacher(top_k=...)` gives, from a stored full-vocabulary top-K
    (`ids` [B, L, K] target ids, most likely first): the first `top_k` of them that are draft ids,
    renormalised over those. Equal to the teacher computed from the last state whenever the
    stored K hold the `top_k` most likely draft ids (renormalising cancels the two softmaxes'
    different denominators); the argmax and whether it is drafted are always exact."""
    draft_index = torch.full((t2d.shape[0],), -1, dtype=torch.long, device=ids.device)
    draft_index[torch.arange(d2t.shape[0], device=ids.device) + d2t] = torch.arange(d2t.shape[0], device=ids.device)
    dids = draft_index[ids.long()]  # [B, L, K], -1 where the token is not drafted
    keep = dids >= 0
    rank = keep.long().cumsum(-1) - 1
    keep &= rank < top_k
    out_ids = torch.zeros(*ids.shape[:-1], top_k, dtype=torch.long, device=ids.device)
    out_lp = torch.full(out_ids.shape, float("-inf"), device=ids.device)
    b, t, j = keep.nonzero(as_tuple=True)  # each kept entry goes to its rank among the kept
    out_ids[b, t, rank[b, t, j]] = dids[b, t, j]
    out_lp[b, t, rank[b, t, j]] = log_probs[b, t, j].float()
    none = ~keep.any(-1)  # no drafted token among the stored K: the target's argmax is not drafted either
    out_lp[..., 0] = torch.where(none, 0.0, out_lp[..., 0])
    out_lp = out_lp - torch.logsumexp(out_lp, dim=-1, keepdim=True)
    return Teacher(out_lp, out_ids[..., 0], t2d[ids[..., 0].long()], out_ids)


class StoredTeacherMaker:
    """The compact layout's teacher of one sample from its stored last state: the target's top-K
    over its full vocabulary, computed exactly as training computes the teacher from a v1 file
    (the stored-dtype state, the final norm and LM head in fp32)."""

    def __init__(
        self, target: TargetHeads | PreTrainedModel, top_k: int, last_hidden_state: str = formats.LAST_STATE_PRE_NORM
    ):
        head = make_teacher_head(target, last_hidden_state)
        assert head.lm_head is not None  # made with one
        self.final_norm, self.lm_head = head.final_norm, head.lm_head
        self.top_k = min(top_k, self.lm_head.weight.shape[0])

    def __call__(self, last: torch.Tensor) -> formats.StoredTeacher:
        dev = self.lm_head.weight.device
        ids, log_probs = target_top_k(last.to(dev).float(), self.final_norm, self.lm_head, self.top_k)
        return formats.StoredTeacher(ids.cpu(), log_probs.cpu())
