"""The loss step: one micro-batch through the drafter, its loss and per-TTT-step stats. The train
loop backpropagates the loss; held-out evaluation sums the stats."""

from __future__ import annotations

import torch
from torch import nn

from eaglet import families
from eaglet.drafter import STAT_ROWS, anchor_grid, block_loss, position_weights, ttt_loss
from eaglet.training.config import TrainConfig
from eaglet.training.data import Batch
from eaglet.drafter import Teacher
from eaglet.training.teacher import TeacherSource, autocast


def forward_stats(
    model: nn.Module,
    teachers: TeacherSource,
    batch: Batch,
    cfg: TrainConfig,
    device: torch.device,
    steps: int,
    loss_on: str,
    step: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Loss and per-position sums [STAT_ROWS, cfg.stat_positions] of one micro-batch (model may be
    the DDP wrapper of the drafter); TTT steps past `steps` (a TTT ramp) count nothing. A parallel
    drafter's anchor grid turns with the optimizer `step` (held-out: 0)."""
    teacher = teachers(batch)
    positions = batch.loss_mask if loss_on == "assistant" else batch.real()
    if families.family(cfg.drafter).parallel:
        return block_stats(model, teacher, batch, cfg, device, positions, step)
    with autocast(device, cfg.computes_bf16):
        out = model(
            batch.input_ids, batch.aux_hidden.float(), steps=steps, documents=batch.documents, positions=batch.positions
        )
        loss, stats = ttt_loss(
            out,
            teacher,
            positions,
            feature_weight=cfg.feature_loss_weight,
            documents=batch.documents,
            objective=cfg.objective,
        )
    sums = torch.zeros(STAT_ROWS, cfg.ttt_steps, device=device)
    sums[:, :steps] = stats.as_tensor()
    return loss, sums


def block_stats(
    model: nn.Module,
    teacher: Teacher,
    batch: Batch,
    cfg: TrainConfig,
    device: torch.device,
    counted: torch.Tensor,
    step: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`forward_stats` of a parallel drafter: blocks on the anchor grid of the counted positions."""
    anchors = anchor_grid(counted, batch.documents, cfg.stride, step, families.family(cfg.drafter).first_prediction)
    with autocast(device, cfg.computes_bf16):
        out = model(
            batch.input_ids, batch.aux_hidden.float(), anchors, documents=batch.documents, positions=batch.positions
        )
        loss, stats = block_loss(
            out,
            teacher,
            counted,
            position_weights(cfg.drafter, cfg.block),
            documents=batch.documents,
            objective=cfg.objective,
        )
    return loss, stats.as_tensor()


def refuse_non_finite(loss: torch.Tensor, step: int, batch: Batch) -> None:
    """A NaN or infinite loss would poison the weights and every checkpoint after it: stop at once."""
    if not torch.isfinite(loss.detach()).all():
        raise FloatingPointError(
            f"step {step}: the loss is {loss.item()} on samples {batch.indices}; the weights "
            "before this step are in the last checkpoint: lower --lr or --max-grad-norm, and "
            "`eaglet check` the dataset for NaN/Inf states"
        )
