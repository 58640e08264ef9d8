"""What training minimises and what it reports: the per-position objectives (soft cross-entropy,
the LK losses), the TTT loss over an unroll (`ttt_loss`) and its per-step statistics."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from eaglet.drafter.eagle3 import DraftOutput
from eaglet.drafter.parallel import BlockOutput
from eaglet.drafter.teacher import Teacher

STEP_WEIGHT_DECAY = 0.8
LK_HYBRID_ETA = 3.0  # the LK paper's best hybrid setting: the blend leaves KL for TV as the overlap grows
OVERLAP_FLOOR = 1e-5  # -log(overlap) stays finite where the drafter and the target do not overlap
STAT_ROWS = 4


@dataclass
class StepStats:
    """Sums over counted positions, so micro-batches and processes add up exactly. Accuracy
    counts every position the loss looks at, a miss where the target's choice is not drafted
    (so it is the acceptance rate, whatever the draft vocabulary's size); the loss averages
    only where it is drafted."""

    loss_sum: torch.Tensor  # [K] soft cross-entropy summed over drafted positions
    correct: torch.Tensor  # [K] top-1 matches of the target's argmax
    count: torch.Tensor  # [K] counted positions
    loss_count: torch.Tensor  # [K] of them, those where the target's argmax is drafted

    def as_tensor(self) -> torch.Tensor:
        return torch.stack([self.loss_sum, self.correct, self.count, self.loss_count])


def acceptance_length(acc: list[float]) -> float:
    """Simulated acceptance length sum_k prod_{i<=k} acc_i (tokens accepted per draft chain)."""
    total, run = 0.0, 1.0
    for a in acc:
        run *= a
        total += run
    return total


def soft_cross_entropy(logits: torch.Tensor, log_probs: torch.Tensor, ids: torch.Tensor | None) -> torch.Tensor:
    """-sum_i p_i log q_i per row, as logsumexp(z) - <p, z> (sum p = 1): no log-softmax copy of
    the logits is kept. `ids` picks the logits a sparse teacher's probabilities belong to."""
    z = logits.float()
    picked = z if ids is None else z.gather(-1, ids.long())
    return torch.logsumexp(z, dim=-1) - (log_probs.float().exp() * picked).sum(-1)


def objective_loss(
    logits: torch.Tensor, log_probs: torch.Tensor, ids: torch.Tensor | None, objective: str
) -> torch.Tensor:
    """Per-row loss of draft logits [N, Vd] against the teacher's log-probabilities (dense [N, Vd],
    or sparse [N, k] over draft ids `ids`):
    - "ce": soft cross-entropy -sum p log q (KL(p || q) plus the teacher's entropy);
    - "lk": -log alpha, alpha = sum_v min(p_v, q_v) the acceptance rate of sampled speculative
      decoding (LK losses, Samarin et al. 2026: its gradient is TV's, scaled by 1 / alpha, so it
      learns from a cold start);
    - "lk-hybrid": lambda KL(p || q) + (1 - lambda) (1 - alpha), lambda = exp(-3 sg(alpha)).
    A sparse teacher puts no mass outside its k ids, so alpha and KL are sums over those k."""
    if objective == "ce":
        return soft_cross_entropy(logits, log_probs, ids)
    z = logits.float()
    log_q = (z if ids is None else z.gather(-1, ids.long())) - torch.logsumexp(z, dim=-1, keepdim=True)
    p = log_probs.float().exp()
    overlap = torch.minimum(p, log_q.exp()).sum(-1)
    if objective == "lk":
        return -torch.log(overlap.clamp_min(OVERLAP_FLOOR))
    kl = torch.where(p > 0, p * (log_probs.float() - log_q), 0.0).sum(-1)
    weight = torch.exp(-LK_HYBRID_ETA * overlap.detach())
    return weight * kl + (1 - weight) * (1 - overlap)


def ttt_loss(
    out: DraftOutput,
    teacher: Teacher,
    positions: torch.Tensor,
    decay: float = STEP_WEIGHT_DECAY,
    feature_weight: float = 0.0,
    documents: torch.Tensor | None = None,
    objective: str = "ce",
) -> tuple[torch.Tensor, StepStats]:
    """Sum over steps of decay^k * mean soft cross-entropy vs the target, and per-step sums.

    Step k at position t predicts token t+k+2 from the target's distribution at position t+k+1.
    It counts when `positions` [B, L] marks that token (the loss mask: assistant tokens; or every
    real token); the loss uses it when the target's argmax is drafted. The LM head runs on
    counted positions only. `feature_weight` adds EAGLE-1's regression of the target's next
    last-layer state: smooth L1 between the drafter's normed output and final_norm(h_N) at t+k+1.
    In packed rows (`documents` [B, L]) a position counts only when t+k+2 is in its own sample.
    `objective` is what each position minimises (`objective_loss`); accuracy is counted alike.
    """
    total = positions.new_zeros((), dtype=torch.float32)
    loss_sum, correct, count, loss_count = [], [], [], []
    L = positions.shape[1]
    for k, hidden in enumerate(out.hidden):
        n_pos = max(0, L - k - 2)  # positions whose predicted token (t+k+2) is inside the sequence
        sel = positions[:, k + 2 :].bool()  # [B, n_pos]
        if documents is not None:  # the predicted token must be of the same sample
            sel = sel & (documents[:, k + 2 :] == documents[:, :n_pos])
        h = hidden[:, :n_pos][sel]  # [N, H] the counted positions only

        def teacher_at(x: torch.Tensor) -> torch.Tensor:  # the teacher's rows for them (t+k+1)
            return x[:, k + 1 : k + 1 + n_pos][sel]

        drafted = teacher_at(teacher.in_draft)
        logits = out.head(h)
        ce = objective_loss(
            logits, teacher_at(teacher.log_probs), None if teacher.ids is None else teacher_at(teacher.ids), objective
        )
        n = drafted.sum()
        step_sum = (ce * drafted).sum()
        step_loss = step_sum / n.clamp(min=1)
        if feature_weight and teacher.features is not None:
            target = teacher_at(teacher.features).float()
            step_loss = (
                step_loss + feature_weight * F.smooth_l1_loss(h.float(), target, reduction="none").mean(-1).mean()
            )
        total = total + (decay**k) * step_loss
        with torch.no_grad():
            hit = (logits.argmax(-1) == teacher_at(teacher.argmax)) & drafted
        loss_sum.append(step_sum.detach())
        correct.append(hit.sum().float())
        count.append(torch.tensor(float(h.shape[0]), device=positions.device))
        loss_count.append(n.float())
    return total, StepStats(*(torch.stack(x) for x in (loss_sum, correct, count, loss_count)))


def stats_summary(sums: torch.Tensor) -> dict[str, Any]:
    """Per-step loss/acc and tau from a [4, K] tensor of (loss_sum, correct, count, loss_count)."""
    loss_sum, correct, count, loss_count = (sums[i].tolist() for i in range(STAT_ROWS))
    loss = [ls / c if c else None for ls, c in zip(loss_sum, loss_count)]  # None: no position to average (JSON null)
    acc = [cr / c if c else 0.0 for cr, c in zip(correct, count)]
    drafted = [lc / c if c else 0.0 for lc, c in zip(loss_count, count)]
    return {"loss": loss, "acc": acc, "tau": acceptance_length(acc), "positions": count, "drafted": drafted}


def block_loss(
    out: BlockOutput,
    teacher: Teacher,
    counted: torch.Tensor,
    weights: list[float],
    documents: torch.Tensor | None = None,
    objective: str = "ce",
) -> tuple[torch.Tensor, StepStats]:
    """A parallel drafter's loss over its blocks, and its per-position statistics.

    Block position k predicts the token at row position `out.predicts[k]` from the target's
    distribution one position before; it trains when that token counts (`counted` [B, L]: the
    loss mask, or every real token) and lies in the anchor's sample, weighted `weights[k]`.
    P-EAGLE's depth 0 trains at every counted position instead (EAGLE-3's step 0, free in its
    forward). The statistics are what chain verification of the block accepts: position k's
    accuracy is counted over the blocks whose positions before k were all right, so the product
    of the first k accuracies is the share of blocks accepted that deep and `acceptance_length`
    of them is the mean number of drafts accepted per block (exact for a drafter whose block
    does not depend on its own drafts)."""
    B, L = counted.shape
    rows = torch.arange(B, device=counted.device)[:, None]
    anchor_doc = None if documents is None else documents.gather(1, out.anchors.clamp(min=0))
    total = counted.new_zeros((), dtype=torch.float32)
    if out.everywhere is not None:
        depth0, _ = ttt_loss(
            DraftOutput([out.everywhere], out.head), teacher, counted, documents=documents, objective=objective
        )
        total = total + weights[0] * depth0
    reached = out.anchors >= 0  # [B, A] blocks whose positions so far were all right
    loss_sum, correct, count, loss_count = [], [], [], []
    for k, (hidden, predicts) in enumerate(zip(out.hidden, out.predicts)):
        p = predicts.clamp(0, L - 1)
        ok = (predicts >= 0) & (predicts < L) & counted.gather(1, p).bool()
        if anchor_doc is not None and documents is not None:  # (one is None when the other is)
            ok &= documents.gather(1, p) == anchor_doc
        before = p - 1  # the target's distribution there predicts the token at p

        def teacher_at(x: torch.Tensor) -> torch.Tensor:
            return x[rows, before][ok]

        drafted = teacher_at(teacher.in_draft)
        logits = out.head(hidden[ok])
        ce = objective_loss(
            logits, teacher_at(teacher.log_probs), None if teacher.ids is None else teacher_at(teacher.ids), objective
        )
        n = drafted.sum()
        step_sum = (ce * drafted).sum()
        if out.everywhere is None or k > 0:
            total = total + weights[k] * step_sum / n.clamp(min=1)
        with torch.no_grad():
            hit = torch.zeros_like(ok)
            hit[ok] = (logits.argmax(-1) == teacher_at(teacher.argmax)) & drafted
            reached = reached & ok
            count.append(reached.sum().float())
            reached = reached & hit
            correct.append(reached.sum().float())
        loss_sum.append(step_sum.detach())
        loss_count.append(n.float())
    return total, StepStats(*(torch.stack(x) for x in (loss_sum, correct, count, loss_count)))
