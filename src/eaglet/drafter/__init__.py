"""The draft models ("drafters") of every family, and what they learn from.

The package, from the bottom up (a module imports only those listed before it):

    config      `DraftConfig` (Llama layers shaped like the target's) and the draft
                vocabulary (`build_draft_vocab`)
    attention   RoPE, the step-0 masks and the TTT attention (`DiagonalTTTAttention`) with its
                two named kernels, "flash" (the CPU's) and "chunked" (any device)
    layers      what every family is built from: RMSNorm, MLP, `Drafter` (embeddings, final norm,
                LM head, d2t/t2d)
    eagle3      the EAGLE-3 family: `Eagle3Draft`, its layer and TTT unroll (`DraftOutput`)
    parallel    what the parallel families share: `ParallelDraft`, its layers, a block's layout
                and output (`BlockOutput`), the training anchors (`anchor_grid`)
    p_eagle     the P-EAGLE family: `PEagleDraft`, its blocks, weights and decoding pass
    dflash      the DFlash family: `DFlashDraft`, likewise
    build       `build_model` of any family, by the model its registration names
    teacher     the target's final norm and LM head in fp32 (`TeacherHead`) and the teacher
                distribution they give over the draft vocabulary (`Teacher`)
    objectives  the per-position objectives, `ttt_loss` / `block_loss` and their per-position statistics

Importers take these names from `eaglet.drafter`; the tests also reach into the modules.
"""

from eaglet.drafter.attention import DiagonalTTTAttention, allowed_keys, apply_rope, rope_cos_sin
from eaglet.drafter.config import DEFAULT_TTT_STEPS, DraftConfig, build_draft_vocab
from eaglet.drafter.layers import load_embeddings_from, num_parameters
from eaglet.drafter.eagle3 import DraftOutput, Eagle3Draft
from eaglet.drafter.parallel import BlockOutput, ParallelDraft, anchor_grid
from eaglet.drafter.build import (
    DFLASH,
    P_EAGLE,
    PARALLEL_FAMILIES,
    DraftModel,
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
    # layers
    "load_embeddings_from",
    "num_parameters",
    # eagle3
    "DraftOutput",
    "Eagle3Draft",
    # parallel
    "BlockOutput",
    "ParallelDraft",
    "anchor_grid",
    # build
    "DFLASH",
    "P_EAGLE",
    "PARALLEL_FAMILIES",
    "DraftModel",
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
