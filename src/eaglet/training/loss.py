"""The loss step: one micro-batch through the drafter, its loss and per-TTT-step stats. The train
loop backpropagates the loss; held-out evaluation sums the stats."""

from __future__ import annotations

import torch
from torch import nn

from eaglet.drafter import STAT_ROWS, ttt_loss
from eaglet.training.config import TrainConfig
from eaglet.training.data import Batch
from eaglet.training.teacher import TeacherSource, autocast


def forward_stats(model: nn.Module, teachers: TeacherSource, batch: Batch, cfg: TrainConfig, device: torch.device,
                  steps: int, loss_on: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Loss and per-step sums [STAT_ROWS, cfg.ttt_steps] of one micro-batch (model may be the DDP
    wrapper of the drafter); steps past `steps` (a TTT ramp) count nothing."""
    teacher = teachers(batch)
    positions = batch.loss_mask if loss_on == "assistant" else batch.real()
    with autocast(device, cfg.bf16):
        out = model(batch.input_ids, batch.aux_hidden.float(), steps=steps, documents=batch.documents,
                    positions=batch.positions)
        loss, stats = ttt_loss(out, teacher, positions, feature_weight=cfg.feature_loss_weight,
                               documents=batch.documents, objective=cfg.objective)
    sums = torch.zeros(STAT_ROWS, cfg.ttt_steps, device=device)
    sums[:, :steps] = stats.as_tensor()
    return loss, sums


def refuse_non_finite(loss: torch.Tensor, step: int, batch: Batch) -> None:
    """A NaN or infinite loss would poison the weights and every checkpoint after it: stop at once."""
    if not torch.isfinite(loss.detach()).all():
        raise FloatingPointError(f"step {step}: the loss is {loss.item()} on samples {batch.indices}; the weights "
                                 "before this step are in the last checkpoint: lower --lr or --max-grad-norm, and "
                                 "`eaglet check` the dataset for NaN/Inf states")

