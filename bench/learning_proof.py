"""Did the drafter learn? Its held-out per-step accuracy and simulated acceptance length beside
a drafter that always predicts the most frequent drafted token, on the same held-out samples
with the same counting rule (`ttt_loss`).

    python bench/learning_proof.py DATA RUN [--eval-fraction 0.05] [--seed 0] [--ttt-steps 7]

DATA is an `eaglet extract` folder, RUN an `eaglet train --out` folder trained on it with the
same --eval-fraction and --seed (they define the held-out split).
"""

from __future__ import annotations

import argparse

import torch

from eaglet.drafter import STAT_ROWS, DraftOutput, make_teacher, stats_summary, ttt_loss
from eaglet.target import heads_of_model
from eaglet.training.checkpoints import iter_metrics
from eaglet.dataset import open_dataset
from eaglet.training.data import bucketed_batches, load_batch, split_indices


def most_frequent_baseline(data: str, eval_fraction: float, seed: int, steps: int, draft_vocab_size: int) -> dict:
    from eaglet.drafter import build_draft_vocab
    from eaglet.target import load_target, resolve_target

    ds = open_dataset(data)
    _, eval_idx = split_indices(list(ds.files), eval_fraction, seed)
    model = load_target(resolve_target(ds.config.get("target_path")), torch.float32, torch.device("cpu"))
    head = heads_of_model(model)
    d2t, t2d = build_draft_vocab(ds.token_freq, model.config.vocab_size, draft_vocab_size)
    top_target_id = max(ds.token_freq, key=ds.token_freq.get)
    top_draft_id = int(((torch.arange(len(d2t)) + d2t) == top_target_id).nonzero()[0])
    sums = torch.zeros(STAT_ROWS, steps)
    for b in bucketed_batches(eval_idx, ds.lengths, 1, None):
        batch = load_batch(ds.files, b, None)
        teacher = make_teacher(batch.last_hidden, head.final_norm, head.lm_head, d2t, t2d)
        B, L = batch.input_ids.shape
        logits = torch.full((B, L, len(d2t)), -10.0)
        logits[..., top_draft_id] = 10.0  # always the most frequent token
        _, stats = ttt_loss(DraftOutput([logits] * steps, torch.nn.Identity()), teacher, batch.loss_mask)
        sums += stats.as_tensor()
    return stats_summary(sums)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("data")
    ap.add_argument("run")
    ap.add_argument("--eval-fraction", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ttt-steps", type=int, default=7)
    ap.add_argument("--draft-vocab-size", type=int, default=32000)
    args = ap.parse_args()

    evals = [m for m in iter_metrics(args.run) if m.get("split") == "eval"]
    if not evals:
        raise SystemExit(f"{args.run}: no held-out evaluation in metrics.jsonl")
    best = max(evals, key=lambda m: m["tau"])
    base = most_frequent_baseline(args.data, args.eval_fraction, args.seed, args.ttt_steps, args.draft_vocab_size)
    print(f"held-out positions per step: {[int(c) for c in best['positions']]}" if "positions" in best else "")
    print(f"{'TTT step':>10}" + "".join(f"{k:>8}" for k in range(args.ttt_steps)) + f"{'sim tau':>10}")
    print(
        f"{'drafter':>10}"
        + "".join(f"{a:>8.3f}" for a in best["acc"])
        + f"{best['tau']:>10.3f}"
        + f"   (step {best['step']})"
    )
    print(f"{'most-freq':>10}" + "".join(f"{a:>8.3f}" for a in base["acc"]) + f"{base['tau']:>10.3f}")
    print(f"ratio of simulated acceptance length: {best['tau'] / max(base['tau'], 1e-9):.1f}x")


if __name__ == "__main__":
    main()
