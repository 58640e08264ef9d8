"""The EAGLE-3 draft model ("drafter"), its training-time-test (TTT) unroll and what it learns from.

The package, from the bottom up (a module imports only those listed before it):

    config      `DraftConfig` (one Llama layer shaped like the target's) and the draft
                vocabulary (`build_draft_vocab`)
    attention   RoPE, the step-0 masks and the TTT attention (`DiagonalTTTAttention`) with its
                two named kernels, "flash" (the CPU's) and "chunked" (any device)
    model       `Eagle3Draft`: its layer, the TTT unroll (`DraftOutput`)
    parallel    `ParallelDraft`: the P-EAGLE and DFlash drafters, a block of drafts a pass
                (`BlockOutput`), the training anchors (`anchor_grid`); `build_model` of any family
    teacher     the target's final norm and LM head in fp32 (`TeacherHead`) and the teacher
                distribution they give over the draft vocabulary (`Teacher`)
    objectives  the per-position objectives, `ttt_loss` / `block_loss` and their per-position statistics

Importers take these names from `eaglet.drafter`; the tests also reach into the modules.
"""

from eaglet.drafter.attention import DiagonalTTTAttention, allowed_keys, apply_rope, rope_cos_sin
from eaglet.drafter.config import DEFAULT_TTT_STEPS, DraftConfig, build_draft_vocab
from eaglet.drafter.model import DraftOutput, Eagle3Draft, load_embeddings_from, num_parameters
from eaglet.drafter.parallel import (
    DFLASH,
    P_EAGLE,
    PARALLEL_FAMILIES,
    BlockOutput,
    DraftModel,
    ParallelDraft,
    anchor_grid,
    build_model,
    position_weights,
    predicted_positions,
)
from eaglet.drafter.objectives import STAT_ROWS, acceptance_length, block_loss, stats_summary, ttt_loss
from eaglet.drafter.teacher import (
    DraftFirstHead,
    Teacher,
    TeacherHead,
    make_teacher,
    make_teacher_head,
    target_top_k,
    teacher_from_top_k,
)

__all__ = [
    # config
    "DEFAULT_TTT_STEPS",
    "DraftConfig",
    "build_draft_vocab",
    # attention
    "DiagonalTTTAttention",
    "allowed_keys",
    "apply_rope",
    "rope_cos_sin",
    # model
    "DraftOutput",
    "Eagle3Draft",
    "load_embeddings_from",
    "num_parameters",
    # parallel
    "DFLASH",
    "P_EAGLE",
    "PARALLEL_FAMILIES",
    "BlockOutput",
    "DraftModel",
    "ParallelDraft",
    "anchor_grid",
    "build_model",
    "position_weights",
    "predicted_positions",
    # teacher
    "DraftFirstHead",
    "Teacher",
    "TeacherHead",
    "make_teacher",
    "make_teacher_head",
    "target_top_k",
    "teacher_from_top_k",
    # objectives
    "STAT_ROWS",
    "acceptance_length",
    "block_loss",
    "stats_summary",
    "ttt_loss",
]
