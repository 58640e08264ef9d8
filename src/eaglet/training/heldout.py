"""Held-out acceptance: per-TTT-step accuracy of the drafter on the held-out split, on assistant
tokens, and the simulated acceptance length (tau) that picks the best checkpoint. Also for any
drafter on the held-out split `eaglet train` makes of a dataset (`evaluate_heldout`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch

from eaglet import families
from eaglet.drafter import DEFAULT_TTT_STEPS, STAT_ROWS, DraftModel, make_teacher_head, stats_summary
from eaglet.drafter.files import load_drafter
from eaglet.heads import FINAL_NORM, LM_HEAD
from eaglet.target import fast_bf16, load_heads, pick_device, resolve_target, target_source
from eaglet.training.config import TrainConfig
from eaglet.dataset import dataset_target, open_dataset, recorded_target_where
from eaglet.training.data import Batch, bucketed_batches, offline_source, split_indices
from eaglet.training.distributed import Dist
from eaglet.training.loss import forward_stats
from eaglet.training.teacher import TeacherSource


@torch.no_grad()
def evaluate(
    draft: DraftModel,
    teachers: TeacherSource,
    load: Callable[[list[int]], Batch],
    batches: list[list[int]],
    cfg: TrainConfig,
    device: torch.device,
    dist: Dist,
) -> dict[str, Any] | None:
    """Held-out per-step acceptance on assistant tokens, whatever positions the loss trains on."""
    if not batches:
        return None
    draft.eval()
    sums = torch.zeros(STAT_ROWS, cfg.stat_positions, device=device)
    for b in batches[dist.rank :: dist.world]:
        sums += forward_stats(draft, teachers, load(b).to(device), cfg, device, cfg.ttt_steps, "assistant")[1]
    draft.train()
    return stats_summary(dist.all_sum(sums).cpu())


def evaluate_heldout(
    drafter: str | Path,
    dataset_dir: str | Path,
    eval_fraction: float = 0.05,
    seed: int = 0,
    ttt_steps: int | None = None,
    max_length: int | None = None,
    target: str | None = None,
    bf16: bool | None = None,
    batch_size: int = 1,
    device: str | None = None,
) -> dict[str, Any]:
    """Per-step held-out acceptance of any drafter (a run folder, checkpoint or exported folder)
    on the held-out split that `eaglet train` makes of `dataset_dir` with this eval_fraction and
    seed: so drafters trained on other data are measured on the same samples."""
    dev = pick_device(device)
    bf16 = fast_bf16(dev) if bf16 is None else bf16
    ds = open_dataset(dataset_dir)
    draft = load_drafter(drafter).to(dev)
    ref = resolve_target(dataset_target(ds, target), target_source(target, recorded_target_where(ds)))
    head = make_teacher_head(load_heads(ref, None, dev, (FINAL_NORM, LM_HEAD)), ds.last_hidden_state, None).to(dev)
    c = draft.config
    family: dict[str, Any] = (
        dict(drafter=c.family, draft_layers=c.num_layers, block_size=c.block_size)
        if families.family(c.family).parallel
        else {}
    )
    cfg = TrainConfig(
        ttt_steps=ttt_steps or DEFAULT_TTT_STEPS,
        bf16=bf16,
        batch_size=batch_size,
        max_length=max_length,
        eval_fraction=eval_fraction,
        seed=seed,
        **family,
    )
    _, eval_idx = split_indices(list(ds.lengths), eval_fraction, seed)
    if not eval_idx:
        raise ValueError(f"{dataset_dir}: --eval-fraction {eval_fraction} holds out no sample")
    source = offline_source(ds, max_length)
    teachers = TeacherSource(head, draft.d2t, draft.t2d, None, False, bf16)
    batches = bucketed_batches(eval_idx, source.lengths, batch_size, None)
    result = evaluate(draft, teachers, source.load, batches, cfg, dev, Dist())
    assert result is not None  # eval_idx holds a sample, and one process is the main one
    return result
