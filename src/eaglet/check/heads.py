"""What the target's heads alone can prove about stored states (no layer is run): the stored last
state, put through the final norm and LM head as recorded (pre-norm: norm then head; post-norm: head
only), must predict the next token at least as well as it does read the other way. A last state
stored after the norm but recorded as before it (or the reverse) predicts clearly worse than the
other reading, wherever the norm's weight is not uniform. Train runs this on one file before any
step; `eaglet check --target HEAD_ONLY_FOLDER` on the sampled files.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from eaglet import formats
from eaglet.check.report import LAYER_IDENTITY, Problem
from eaglet.heads import TargetHeads

# Next-token predictions are scored at this many masked positions per file: at Kimi-K2.5's heads
# (163,840 x 7,168) each is a 2.3 GFLOP product per reading, and 64 tell a wrong norm convention.
HEAD_CHECK_POSITIONS = 64
# The recorded reading is wrong when the other predicts the next token on this much larger a share
# of positions: a random target predicts nothing either way, a real one 30-70 % the right way.
CONVENTION_MARGIN = 0.2
VOCAB_CHUNK = 16384  # rows of the LM head multiplied at a time (fp32), so no [T, vocab] tensor is made


@torch.inference_mode()
def head_argmax(h: torch.Tensor, lm_head: torch.nn.Linear) -> torch.Tensor:
    """argmax of lm_head(h) in fp32 [T], a slice of the vocabulary at a time."""
    w = lm_head.weight
    h = h.to(w.device, torch.float32)
    best = torch.full((h.shape[0],), float("-inf"), device=w.device)
    arg = torch.zeros(h.shape[0], dtype=torch.long, device=w.device)
    for v in range(0, w.shape[0], VOCAB_CHUNK):
        value, index = F.linear(h, w[v : v + VOCAB_CHUNK].float()).max(-1)
        better = value > best
        best, arg = torch.where(better, value, best), torch.where(better, index + v, arg)
    return arg.cpu()


def scored_positions(ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Positions whose next token is an assistant token (all when there is no mask), evenly thinned
    to HEAD_CHECK_POSITIONS."""
    keep = (mask[1:] == 1) if mask is not None else torch.ones(len(ids) - 1, dtype=torch.bool)
    pos = keep.nonzero().squeeze(-1)
    if len(pos) > HEAD_CHECK_POSITIONS:
        pos = pos[torch.linspace(0, len(pos) - 1, HEAD_CHECK_POSITIONS).round().long()]
    return pos


@torch.inference_mode()
def convention_hits(
    last: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor | None, heads: TargetHeads
) -> tuple[int, dict[str, int]]:
    """(positions scored, next-token hits per reading of the stored last state)."""
    pos = scored_positions(ids, mask)
    if not len(pos):
        return 0, {c: 0 for c in formats.LAST_STATE_CONVENTIONS}
    norm = heads.norm()
    h = last[pos].to(next(norm.parameters()).device)  # its weight's
    readings = {formats.LAST_STATE_PRE_NORM: norm(h.float()), formats.LAST_STATE_POST_NORM: h}
    nxt = ids[1:][pos]
    return len(pos), {c: int((head_argmax(x, heads.head()) == nxt).sum()) for c, x in readings.items()}


def convention_problem(positions: int, hits: dict[str, int], recorded: str, where: str) -> Problem | None:
    """A problem when the other reading of the last state predicts clearly better than the recorded one."""
    if not positions:
        return None
    other = next(c for c in formats.LAST_STATE_CONVENTIONS if c != recorded)
    ours, theirs = hits[recorded] / positions, hits[other] / positions
    if theirs < ours + CONVENTION_MARGIN:
        return None
    return Problem(
        LAYER_IDENTITY,
        where,
        f"the stored last state predicts the next token on {theirs:.0%} of "
        f"{positions} assistant positions read as {other}, {ours:.0%} read as "
        f"recorded ({recorded}): last_hidden_state is {other}",
    )
