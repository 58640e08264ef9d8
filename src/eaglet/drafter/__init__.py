"""The EAGLE-3 draft model ("drafter"), its training-time-test (TTT) unroll and what it learns from.

The package, from the bottom up (a module imports only those listed before it):

    config      `DraftConfig` (one Llama layer shaped like the target's) and the draft
                vocabulary (`build_draft_vocab`)
    attention   RoPE, the step-0 masks and the TTT attention (`DiagonalTTTAttention`) with its
                two named kernels, "flash" (the CPU's) and "chunked" (any device)
    model       `Eagle3Draft`: its layer, the TTT unroll (`DraftOutput`)
    teacher     the target's final norm and LM head in fp32 (`TeacherHead`) and the teacher
                distribution they give over the draft vocabulary (`Teacher`)
    objectives  the per-position objectives, `ttt_loss` and its per-step statistics

Importers take these names from `eaglet.drafter`; the tests also reach into the modules.
"""

from eaglet.drafter.attention import DiagonalTTTAttention, allowed_keys, apply_rope, rope_cos_sin
from eaglet.drafter.config import DEFAULT_TTT_STEPS, DraftConfig, build_draft_vocab
from eaglet.drafter.model import DraftOutput, Eagle3Draft, load_embeddings_from, num_parameters
from eaglet.drafter.objectives import STAT_ROWS, acceptance_length, stats_summary, ttt_loss
from eaglet.drafter.teacher import (DraftFirstHead, Teacher, TeacherHead, make_teacher, make_teacher_head,
                                    target_top_k, teacher_from_top_k)

__all__ = [
    # config
    "DEFAULT_TTT_STEPS", "DraftConfig", "build_draft_vocab",
    # attention
    "DiagonalTTTAttention", "allowed_keys", "apply_rope", "rope_cos_sin",
    # model
    "DraftOutput", "Eagle3Draft", "load_embeddings_from", "num_parameters",
    # teacher
    "DraftFirstHead", "Teacher", "TeacherHead", "make_teacher", "make_teacher_head", "target_top_k",
    "teacher_from_top_k",
    # objectives
    "STAT_ROWS", "acceptance_length", "stats_summary", "ttt_loss",
]
