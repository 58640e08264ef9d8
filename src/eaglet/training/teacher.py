"""The target's part in training: the teacher of each micro-batch (dense, or its top-k cached per
sample) from the teacher head (`eaglet.drafter.make_teacher_head`), and the drafter built from
the target (its embeddings, a draft vocabulary from the data, optionally its LM head rows).
"""

from __future__ import annotations

import torch

from eaglet import families
from eaglet.drafter import (
    DraftConfig,
    DraftFirstHead,
    DraftModel,
    Teacher,
    TeacherHead,
    build_draft_vocab,
    build_model,
    load_embeddings_from,
    make_teacher,
    teacher_from_top_k,
)
from eaglet.heads import TargetHeads
from eaglet.training.config import TrainConfig
from eaglet.training.data import Batch

TEACHER_CACHE_MAX_BYTES = 4 << 30  # past this, sparse teachers are recomputed instead of kept


def autocast(device: torch.device, enabled: bool) -> torch.autocast:
    """The drafter's compute dtype: bf16 autocast over fp32 master weights, or none. Here, with
    the teacher, because the dense teacher computes in it too."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled)


class TeacherSource:
    """The teacher of each micro-batch. Dense (top_k None): recomputed from the last state every
    time, as EAGLE-3 trains. Sparse: the target's top-k draft ids and their renormalised
    log-probabilities, computed once per sample (one sample at a time, so a value never
    depends on what it was batched with and a resumed run sees the same numbers) and kept in
    memory: (4 + 4) * k + 1 bytes per token, where every later epoch would otherwise redo the
    target's full-vocabulary head (vocab x H multiply-adds per token). Both run in the drafter's
    compute dtype (bf16 autocast where it is fast), the softmax in fp32."""

    def __init__(
        self, head: TeacherHead, d2t: torch.Tensor, t2d: torch.Tensor, top_k: int | None, features: bool, bf16: bool
    ):
        self.head, self.d2t, self.t2d, self.top_k, self.features, self.bf16 = head, d2t, t2d, top_k, features, bf16
        self._lm_head: DraftFirstHead | None = None
        self.cache: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.cached_bytes = 0

    @property
    def lm_head(self) -> DraftFirstHead:
        """The head's rows reordered once (on first use: a resumed run has restored the draft
        vocabulary by then), in the compute dtype: autocast would cast the frozen weights again at
        every call (it caches casts of trainable weights only). At Kimi-K2.5's 163,840 x 7,168 this
        copy is 2.35 GB in bf16, so the head it was made from (as the target stores it) is let go."""
        if self._lm_head is None:
            assert self.head.lm_head is not None  # let go only once the reordered copy is made
            self._lm_head = DraftFirstHead(
                self.head.lm_head, self.d2t, self.t2d, torch.bfloat16 if self.bf16 else torch.float32
            )
            self.head = TeacherHead(self.head.final_norm, None)  # the reordered copy is all that is used now
        return self._lm_head

    def __call__(self, batch: Batch) -> Teacher:
        device = batch.input_ids.device
        if batch.teacher_ids is not None:  # a compact dataset stores the target's top-K: nothing to compute
            assert batch.teacher_log_probs is not None  # stored with the ids
            return teacher_from_top_k(
                batch.teacher_ids,
                batch.teacher_log_probs,
                self.d2t,
                self.t2d,
                self.top_k or batch.teacher_ids.shape[-1],
            )
        last = batch.last_hidden
        assert last is not None  # a batch carries its stored teacher or its last states
        if self.top_k is None:
            with autocast(device, self.bf16):  # the dense teacher runs in the drafter's compute dtype
                return make_teacher(
                    last, self.head.final_norm, self.lm_head, self.d2t, self.t2d, features=self.features
                )
        B, L = batch.input_ids.shape
        log_probs = torch.zeros(B, L, self.top_k, device=device)
        ids = torch.zeros(B, L, self.top_k, dtype=torch.long, device=device)
        in_draft = torch.zeros(B, L, dtype=torch.bool, device=device)
        # in the drafter's compute dtype: the target's full-vocabulary head is vocab x H multiply-adds
        # a token, the largest part of a first-epoch step beside the drafter's own (docs/design.md)
        with autocast(device, self.bf16):
            for row, start, n, index in batch.segments():  # one sample at a time, packed or not
                lp, top_ids, drafted = self.sample(last[row : row + 1, start : start + n], index)
                log_probs[row, start : start + n], ids[row, start : start + n], in_draft[row, start : start + n] = (
                    lp,
                    top_ids,
                    drafted,
                )
        feats = self.head.final_norm(last.float()) if self.features else None
        return Teacher(log_probs, ids[..., 0], in_draft, ids, feats)

    def sample(self, last_hidden: torch.Tensor, index: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The cached teacher of sample `index` ([1, n, H] its last states), computed on a miss."""
        n = last_hidden.shape[1]
        hit = self.cache.get(index) if index is not None else None
        if hit is not None and hit[0].shape[0] == n:
            return hit
        t = make_teacher(last_hidden, self.head.final_norm, self.lm_head, self.d2t, self.t2d, top_k=self.top_k)
        assert t.ids is not None  # a sparse teacher has its ids
        hit = (t.log_probs[0], t.ids[0].to(torch.int32), t.in_draft[0])
        size = sum(x.numel() * x.element_size() for x in hit)
        if index is not None and self.cached_bytes + size <= TEACHER_CACHE_MAX_BYTES:
            self.cache[index] = hit
            self.cached_bytes += size
        return hit


def init_lm_head_from_target(draft: DraftModel, head: TargetHeads | TeacherHead, freeze: bool) -> None:
    """The target's LM head rows of the draft ids and its final norm (optionally frozen), so the
    drafter starts out speaking the target's output space."""
    norm_weight = getattr(head.final_norm, "weight", None)
    if norm_weight is None or tuple(norm_weight.shape) != tuple(draft.norm.weight.shape):
        raise ValueError(
            f"--lm-head-init target: the target's final norm ({type(head.final_norm).__name__}) has no "
            f"weight of shape {tuple(draft.norm.weight.shape)} to copy"
        )
    lm_head = head.head() if isinstance(head, TargetHeads) else head.lm_head
    assert lm_head is not None  # a teacher head is made with one
    with torch.no_grad():
        draft.lm_head.weight.copy_(lm_head.weight[draft.draft_to_target_ids()].to(draft.lm_head.weight.dtype))
        draft.norm.weight.copy_(norm_weight.to(draft.norm.weight.dtype))
    if freeze:
        draft.lm_head.weight.requires_grad_(False)
        draft.norm.weight.requires_grad_(False)


def mask_token(token_freq: dict[int, int], vocab_size: int) -> int:
    """The token a parallel drafter's unknown positions are fed: the highest target id the data's
    answers never use (the last id when they use every one). Its embedding is the target's, frozen,
    so the engines, which embed it with the target's table, feed the same vector."""
    used = {t for t, c in token_freq.items() if c > 0}
    return next((t for t in range(vocab_size - 1, -1, -1) if t not in used), vocab_size - 1)


def build_drafter(
    heads: TargetHeads,
    aux_layer_ids: list[int],
    token_freq: dict[int, int],
    cfg: TrainConfig,
    device: torch.device | str = "cpu",
) -> DraftModel:
    """A drafter shaped like the target's layers, with its embeddings (frozen), a draft vocab from
    the data and, with --lm-head-init target, the target's LM head rows and final norm. Built on
    `device` (a real target's vocabulary makes its embeddings gigabytes: not a second host copy)."""
    torch.manual_seed(cfg.seed)
    family = (
        {}
        if not families.family(cfg.drafter).parallel
        else dict(
            family=cfg.drafter,
            num_layers=cfg.draft_layers,
            block_size=cfg.block_size,
            mask_token_id=mask_token(token_freq, heads.config.vocab_size),
        )
    )
    dcfg = DraftConfig.from_target(
        heads.config,
        aux_layer_ids,
        cfg.draft_vocab_size,
        fc_norm=cfg.fc_norm,
        norm_output=cfg.norm_output,
        norm_before_residual=cfg.norm_before_residual,
        sliding_window=cfg.sliding_window,
        **family,
    )
    with torch.device(device):
        draft = build_model(dcfg)
    load_embeddings_from(draft, heads.embedding_table())
    draft.set_draft_vocab(*build_draft_vocab(token_freq, dcfg.target_vocab_size, dcfg.draft_vocab_size))
    if cfg.lm_head_init == "target":
        init_lm_head_from_target(draft, heads, cfg.freeze_lm_head)
    return draft
