"""EAGLE-3 vs P-EAGLE vs DFlash, side by side, each at its fastest configuration on this machine.

    python bench/parallel_families.py --runs eagle3=RUN p-eagle=RUN dflash=RUN [--prompts mtbench,humaneval]
        [--num-prompts 40] [--max-new-tokens 128] [--out docs/results/parallel] [--dtypes auto] [--threads auto]

For drafters trained on the same data (the runs' train_config.json and metrics.jsonl say how many
tokens each saw), in ONE run of `eaglet eval`'s own loop (`evaluate.evaluate_set`, every prompt
decoded by every variant in a rotating order):
  - each drafter's held-out acceptance per position at its best checkpoint (from its metrics.jsonl),
    and the simulated acceptance length;
  - the drafter's cost per pass, timed on a 256-token context (EAGLE-3: one pass per chained draft);
  - tok/s, tau and speedup over plain greedy of each drafter alone (EAGLE-3 as a chain of
    --chain-depth, a parallel drafter's whole block) and in the hybrid with prompt lookup, beside
    eaglet's lookup and Hugging Face prompt lookup; every variant, plain greedy included, at the
    dtype and thread count where a pass of its size is fastest (`evaluate.tuning`, as `eaglet eval
    --dtype auto --threads auto` does);
  - a plot of acceptance per position (held-out and measured) for the three families, and the
    table as markdown, into --out.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import torch

from eaglet.chat import stop_token_ids
from eaglet.decode import measure_drafter_pass, measure_pass_costs
from eaglet.drafter.files import load_drafter_for_target
from eaglet.evaluate import DecodeSettings, evaluate_set, format_table, load_prompt_set, summarize, torch_threads
from eaglet.evaluate import Lane, tuning, warm_up
from eaglet.options import BASELINE
from eaglet.target import cpu_description, load_target, load_tokenizer, parse_dtype, resolve_target
from eaglet.training.checkpoints import iter_metrics

CONTEXT = 256  # tokens the timed drafter passes see


def heldout_at_best(run: Path) -> dict:
    """The held-out record of the run's best checkpoint (highest simulated tau) and its tokens seen."""
    evals = [r for r in iter_metrics(run) if r["split"] == "eval"]
    best = max(evals, key=lambda r: r["tau"])
    config = json.loads((run / "train_config.json").read_text())
    return {
        "step": best["step"],
        "acc": best["acc"],
        "tau": best["tau"],
        "family": config.get("drafter", "eagle3"),
        "train_tokens_at_best": best.get("train_tokens"),
        "train_tokens": evals[-1].get("train_tokens"),
        "epochs": config.get("epochs"),
        "total_steps": config.get("total_steps"),
    }


def drafter_pass_ms(drafter: torch.nn.Module, chain_depth: int, threads: int | None) -> float:
    """Median ms of one proposal (a parallel block; EAGLE-3's chain of chain_depth) after one new position."""
    with torch_threads(threads):
        return 1000 * measure_drafter_pass(drafter, CONTEXT, chain_depth)


def plot(heldout: dict, measured: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_h, ax_m) = plt.subplots(1, 2, figsize=(12, 4.5))
    for family, h in heldout.items():
        acc, run = [], 1.0
        for a in h["acc"]:
            run *= a
            acc.append(run)
        ax_h.plot(range(1, len(acc) + 1), acc, marker="o", label=f"{family} (tau {h['tau']:.2f})")
    ax_h.set(
        xlabel="draft position",
        ylabel="share of drafts accepted this deep",
        ylim=(0, 1),
        title="held-out: P(positions 1..k all accepted)",
    )
    for label, rates in measured.items():
        if rates:
            ax_m.plot(
                range(1, len(rates) + 1), [r if r is not None else float("nan") for r in rates], marker="o", label=label
            )
    ax_m.set(
        xlabel="draft position",
        ylabel="acceptance rate (given the position was reached)",
        ylim=(0, 1),
        title="decoding: acceptance per position",
    )
    for ax in (ax_h, ax_m):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", nargs="+", required=True, metavar="FAMILY=RUN")
    ap.add_argument("--prompts", default="mtbench,humaneval")
    ap.add_argument("--num-prompts", type=int, default=40)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--chain-depth", type=int, default=2, help="EAGLE-3's chain alone (the cpu preset's)")
    ap.add_argument(
        "--min-draft-prob",
        type=float,
        default=0.35,
        help="drafts verified only down to this path probability (the demo recipe's)",
    )
    ap.add_argument("--no-ngram", action="store_true", help="leave eaglet's lookup out (saves a variant)")
    ap.add_argument("--dtypes", default="auto")
    ap.add_argument("--threads", default="auto")
    ap.add_argument("--out", type=Path, default=Path("docs/results/parallel"))
    args = ap.parse_args()

    runs = dict(r.split("=", 1) for r in args.runs)
    heldout = {family: heldout_at_best(Path(run)) for family, run in runs.items()}
    loaded = {family: load_drafter_for_target(run) for family, run in runs.items()}
    ref = resolve_target(next(iter(loaded.values())).target)
    tokenizer = load_tokenizer(ref)
    threads = args.threads if args.threads == "auto" else int(args.threads)
    configs = tuning.candidates(args.dtypes, threads, "cpu")
    targets = {d: load_target(ref, parse_dtype(d), torch.device("cpu")) for d in {c.dtype for c in configs}}
    drafters = {(f, d): x.model.to(dtype=parse_dtype(d)).eval() for f, x in loaded.items() for d in targets}
    base = DecodeSettings(
        max_new_tokens=args.max_new_tokens,
        chain_depth=args.chain_depth,
        min_draft_prob=args.min_draft_prob,
        eos_ids=tuple(sorted(stop_token_ids(next(iter(targets.values())), tokenizer))),
    )

    variants, owner = {BASELINE: (BASELINE, base), "prompt-lookup": ("prompt-lookup", base)}, {}
    if not args.no_ngram:
        variants["ngram"] = ("ngram", base)
    for family in runs:
        own = "chain" if family == "eagle3" else family
        variants[f"{family}"] = (own, base)
        variants[f"hybrid {family}"] = ("hybrid", base)
        owner[family] = owner[f"hybrid {family}"] = family
    max_q = max(
        tuning.verify_tokens(m, s, drafters[(owner.get(label, next(iter(runs))), configs[0].dtype)])
        for label, (m, s) in variants.items()
    )
    costs = {}
    for c in configs:
        with torch_threads(c.threads):
            costs[c] = measure_pass_costs(targets[c.dtype], max_q=max(2, max_q))
    lanes, chosen = {}, {}
    for label, (method, s) in variants.items():
        family = owner.get(label)
        drafter = drafters[(family, configs[0].dtype)] if family else None
        c = tuning.pick(costs, tuning.verify_tokens(method, s, drafter))
        chosen[label] = c
        if method in ("hybrid", "ngram"):
            variants[label] = (method, replace(s, pass_costs=tuple(costs[c])))
        lanes[label] = Lane(targets[c.dtype], drafters[(family, c.dtype)] if family else None, c.threads, c)
    pass_ms = {
        family: drafter_pass_ms(drafters[(family, chosen[family].dtype)], args.chain_depth, chosen[family].threads)
        for family in runs
    }

    results = {}
    with torch.inference_mode():
        first = load_prompt_set(args.prompts.split(",")[0], 1)[0]
        warm_up(variants, lanes[BASELINE].target, None, tokenizer, first, lanes=lanes)
        for spec in args.prompts.split(","):
            prompts = load_prompt_set(spec, args.num_prompts)
            totals = evaluate_set(
                prompts,
                variants,
                lanes[BASELINE].target,
                None,
                tokenizer,
                lambda t: print(f"{spec}: {t[BASELINE].turns}/{len(prompts)}", flush=True),
                [],
                lanes=lanes,
            )
            results[prompts[0].set_name] = summarize(totals, True)
            for label in variants:
                results[prompts[0].set_name][label]["config"] = chosen[label].label

    args.out.mkdir(parents=True, exist_ok=True)
    record = {
        "cpu": cpu_description(),
        "torch": torch.__version__,
        "runs": runs,
        "heldout": heldout,
        "drafter_pass_ms": pass_ms,
        "pass_costs_ms": {c.label: [1000 * x for x in v] for c, v in costs.items()},
        "configs": {label: c.label for label, c in chosen.items()},
        "sets": results,
        "max_new_tokens": args.max_new_tokens,
        "num_prompts": args.num_prompts,
    }
    (args.out / "parallel_families.json").write_text(json.dumps(record, indent=2))
    measured = {
        f"{set_name} {label}": r.get("acceptance_rates")
        for set_name, methods in results.items()
        for label, r in methods.items()
        if label in runs
    }
    plot(heldout, measured, args.out / "parallel_families.png")
    print(f"\n{record['cpu']}; torch {torch.__version__}")
    for family, h in heldout.items():
        acc = " ".join(f"{a:.3f}" for a in h["acc"])
        print(
            f"{family:<8} held-out at step {h['step']}: tau {h['tau']:.3f}, acc per position [{acc}]; "
            f"drafter pass {pass_ms[family]:.1f} ms ({chosen[family].label})"
        )
    print(
        "target pass ms (q = 1, 2, 4, 8, 16): "
        + "; ".join(
            f"{c.label}: " + " ".join(f"{1000 * v[q - 1]:.1f}" for q in (1, 2, 4, 8, 16) if q <= len(v))
            for c, v in costs.items()
        )
    )
    print(format_table(results))
    print("configurations: " + ", ".join(f"{label} {c.label}" for label, c in chosen.items()))


if __name__ == "__main__":
    main()
