"""Held-out acc@1 against training tokens for `eaglet train` runs, beside a log-linear scaling fit.

    python bench/heldout_curves.py RUN[=LABEL] ... --out PLOT.png [--fit A,B] [--goal 0.5]

Reads each run's metrics.jsonl (its held-out evaluations: acc per TTT step at train_tokens) and
plots acc@1 by training tokens on a log axis, with the fit acc@1 = A + B ln(tokens) (default: the
one docs/results/training.md measured on original ShareGPT answers) extended to the goal, so a
run's distance from the fit, and the tokens the fit asks for the goal, are read off one picture.
Prints each run's final point and where the fit puts the goal.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

FIT = (-0.580, 0.067)  # docs/results/training.md "What more training buys"


def heldout_points(run: Path) -> list[tuple[int, float]]:
    """(training tokens, held-out acc@1) of every held-out evaluation in the run's metrics.jsonl."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [(int(r["train_tokens"]), float(r["acc"][0])) for r in rows if r.get("split") == "eval" and r.get("acc")]


def tokens_for(acc: float, fit: tuple[float, float]) -> float:
    return math.exp((acc - fit[0]) / fit[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="train run folders, each optionally =LABEL")
    ap.add_argument("--out", type=Path, required=True, help="the plot (.png)")
    ap.add_argument("--fit", default=",".join(map(str, FIT)), help="A,B of acc@1 = A + B ln(tokens)")
    ap.add_argument("--goal", type=float, default=0.5)
    args = ap.parse_args()
    fit = tuple(float(x) for x in args.fit.split(","))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    print(f"{'run':<40} {'tokens':>11} {'acc@1':>6} {'fit there':>9}")
    for spec in args.runs:
        path, _, label = spec.partition("=")
        points = heldout_points(Path(path))
        if not points:
            raise SystemExit(f"{path}: no held-out evaluation in metrics.jsonl")
        tokens, acc = zip(*points)
        ax.plot(tokens, acc, marker="o", markersize=3, label=label or path)
        fitted = fit[0] + fit[1] * math.log(tokens[-1])
        print(f"{(label or path)[:40]:<40} {tokens[-1]:>11,} {acc[-1]:6.3f} {fitted:9.3f}")
    goal_tokens = tokens_for(args.goal, fit)
    lo = min(t for spec in args.runs for t, _ in heldout_points(Path(spec.partition("=")[0])))
    xs = [lo * (goal_tokens * 1.5 / lo) ** (i / 60) for i in range(61)]
    ax.plot(
        xs,
        [fit[0] + fit[1] * math.log(x) for x in xs],
        "k--",
        linewidth=1,
        label=f"fit {fit[0]:.3f} + {fit[1]:.3f} ln(tokens) (+{fit[1] * math.log(2):.3f} per doubling)",
    )
    ax.axhline(args.goal, color="grey", linewidth=0.8)
    ax.annotate(
        f"goal {args.goal}: ~{goal_tokens / 1e6:.0f}M tokens by the fit",
        (goal_tokens, args.goal),
        textcoords="offset points",
        xytext=(-150, 8),
        fontsize=8,
    )
    ax.set_xscale("log")
    ax.set_xlabel("training tokens (log)")
    ax.set_ylabel("held-out acc@1 (first draft accepted)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"the fit reaches {args.goal} at ~{goal_tokens / 1e6:,.1f}M training tokens; plot: {args.out}")


if __name__ == "__main__":
    main()
