"""`eaglet train`: an EAGLE-3 drafter trained on a target's hidden states.

- config.py: TrainConfig (the options, checked), the Plan (schedule length and cadence), the
  learning-rate schedule and the --time-budget calibration; no torch.
- data.py: opening any hidden-state dataset or an `eaglet prepare` output as one Source, the
  split, the length-bucketed micro-batches, and the refusals before the first step.
- teacher.py: the target's final norm and LM head as the teacher, its top-k cache, and the
  drafter built from the target.
- loss.py: one micro-batch through the drafter: its loss and per-TTT-step stats.
- heldout.py: held-out per-step acceptance, in the loop and of any drafter (`evaluate_heldout`).
- checkpoints.py: the run folder: checkpoints, pointers, resume, metrics.jsonl and its lock.
- distributed.py: torchrun processes, the DDP wrapper and the teardown.
- loop.py: `train`, the entry, and its loop.

Nothing is imported here, so a stage that needs one module (extract: the teacher) loads only it.
"""
