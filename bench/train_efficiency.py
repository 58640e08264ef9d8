"""Training efficiency: variants of `eaglet train` on one dataset, each for the same wall-clock
budget, compared on the same held-out samples.

    python bench/train_efficiency.py DATA --out runs/bench-train --budget 10m \\
        --variant "today: ttt_steps=5 draft_vocab_size=16384 lr=5e-4" \\
        --variant "top-k teacher: ttt_steps=5 draft_vocab_size=16384 lr=5e-4 teacher_top_k=16"
    python bench/train_efficiency.py DATA --out runs/bench-train --budget 5m --preset learning
    python bench/train_efficiency.py DATA --out runs/bench-train --throughput --preset throughput
    python bench/train_efficiency.py DATA --out runs/bench-scaling --budget 2.5m,5m,10m,20m --preset scaling

Each variant is one `eaglet train --time-budget` run in a fresh process, in OUT/<name>/; a
finished one is reused, so the bench can be stopped and rerun. All share --eval-fraction and
--seed, hence the held-out split. A variant may train on other data (`data=PATH`, e.g. the
original ShareGPT answers instead of regenerated ones); its final drafter is then measured on
DATA's held-out split too. Prints, side by side: training tokens/s, tokens and steps reached,
held-out acceptance per TTT step (acc@1..K) and simulated tau, and acc@1 at fixed fractions of
the budget; writes OUT/learning_curves.png (held-out acc@1 against training tokens, log x, and
against training seconds) and OUT/results.json.

`--throughput` times a fixed number of steps (no held-out evaluation inside the window) for
the code at --baseline-rev (checked out into a temporary folder with `git archive`) and for
this checkout, at the recipe's settings of that revision and at the variants given, all in
this run: the tokens/s ratios against the old code are measured, not recalled.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from eaglet.options import parse_duration
from eaglet.options import TrainOptions

REPO = Path(__file__).resolve().parent.parent
COMMON = dict(batch_size=1, log_every=10, seed=0, evals=5)  # every variant, unless it says otherwise (bf16: where fast)
TODAY = dict(ttt_steps=5, draft_vocab_size=16384, lr=5e-4)  # the recipe's settings before this bench
# today's code had only the dense teacher and the assistant-token loss (TODAY alone: what it understands)
DENSE = dict(TODAY, teacher_top_k=0, loss_on="assistant")
SPARSE = dict(TODAY, teacher_top_k=16, loss_on="assistant")
PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    # cost per token: the teacher, the unroll length, the draft vocabulary (coverage vs LM-head work)
    "structure": {
        "today (TTT 5, 16k, dense)": DENSE,
        "top-16 teacher": SPARSE,
        "top-16, TTT 3, 32k": {**SPARSE, "ttt_steps": 3, "draft_vocab_size": 32000},
        "top-16, TTT 3, 16k": {**SPARSE, "ttt_steps": 3},
        "top-16, TTT 3, 8k": {**SPARSE, "ttt_steps": 3, "draft_vocab_size": 8192},
        "top-16, TTT 3, 4k": {**SPARSE, "ttt_steps": 3, "draft_vocab_size": 4096},
        "top-16, TTT 2, 8k": {**SPARSE, "ttt_steps": 2, "draft_vocab_size": 8192},
    },
}
CHEAP = dict(SPARSE, ttt_steps=2, draft_vocab_size=8192)  # the cheapest step that keeps acceptance ("structure")
BEST = dict(CHEAP, lr=2e-3)
# what each optimizer step learns, on that step: the learning rate, then one change each
PRESETS["learning"] = {
    "TTT 2, 8k, lr 5e-4": CHEAP,
    "lr 2e-3": BEST,
    "lr 4e-3": {**CHEAP, "lr": 4e-3},
    "lr 2e-3, loss on all tokens": {**BEST, "loss_on": "all"},
    "lr 2e-3, feature loss 0.1": {**BEST, "feature_loss_weight": 0.1},
    "lr 2e-3, LM head from target": {**BEST, "lm_head_init": "target"},
    "lr 2e-3, all tokens, feature loss 0.1": {**BEST, "loss_on": "all", "feature_loss_weight": 0.1},
}
DEFAULTS = dict(BEST, loss_on="all")  # what `eaglet train` and the recipes now use
# tokens/s of this checkout at the old recipe's settings and at the new defaults (with --throughput)
PRESETS["throughput"] = {
    "today settings (TTT 5, 16k, dense)": DENSE,
    "today settings, top-16 teacher": SPARSE,
    "new defaults (TTT 2, 8k, top-16)": DEFAULTS,
}
# the defaults at several budgets (--budget 2.5m,5m,10m,20m): final acc@1 against training tokens
PRESETS["scaling"] = {"defaults": DEFAULTS}
# more levers on the same step: tokens per optimizer step (lr scaled by sqrt 2), the feature
# regression at full weight, an unroll that grows from 1 step over the first half
PRESETS["learning-extra"] = {
    "2 samples a step, lr 2.8e-3": {**BEST, "batch_size": 2, "lr": 2.8e-3},
    "feature loss 1": {**BEST, "feature_loss_weight": 1.0},
    "TTT ramp over half": {**BEST, "ttt_ramp": 0.5},
}
PRESETS["learning-more"] = {  # not measured yet
    "LM head from target, frozen": {**BEST, "lm_head_init": "target", "freeze_lm_head": True},
    "hard labels (top-1)": {**BEST, "teacher_top_k": 1},
}

# ---------------------------------------------------------------------------------------------
# Variants
# ---------------------------------------------------------------------------------------------


def parse_variant(spec: str) -> tuple[str, dict[str, Any]]:
    """'name: key=value key=value' -> (name, options), values read as TOML."""
    from eaglet.recipe import parse_value

    name, _, rest = spec.partition(":")
    options = {}
    for item in shlex.split(rest):
        key, eq, value = item.partition("=")
        if not eq:
            raise SystemExit(f"--variant {spec!r}: {item!r} is not key=value")
        options[key.strip()] = parse_value(value)
    if not name.strip():
        raise SystemExit(f"--variant {spec!r}: give it a name, 'name: key=value ...'")
    return name.strip(), options


def folder_name(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


# ---------------------------------------------------------------------------------------------
# Running one variant (in a fresh process)
# ---------------------------------------------------------------------------------------------


def worker(spec: dict[str, Any]) -> None:
    """Train one variant, then (for other training data) measure it on DATA's held-out split."""
    import logging

    from eaglet.training.heldout import evaluate_heldout
    from eaglet.training.loop import train

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    options = dict(spec["options"])
    data = options.pop("data", spec["data"])
    summary = train(TrainOptions(dataset_dir=data, out_dir=spec["out"], **options), show_progress=False)
    result = {
        "steps": summary.step,
        "train_tokens": summary.train_tokens,
        "train_seconds": summary.seconds,
        "eval": summary.last_eval,
        "best_step": summary.best_step,
    }
    if str(data) != str(spec["data"]):
        result["eval"] = evaluate_heldout(
            spec["out"],
            spec["data"],
            options.get("eval_fraction", 0.05),
            options.get("seed", 0),
            options.get("ttt_steps"),
            options.get("max_length"),
            bf16=options.get("bf16"),
        )
        result["eval_on"] = str(spec["data"])
    Path(spec["out"], "bench_result.json").write_text(json.dumps(result, indent=1))


def run_variant(
    name: str,
    options: dict[str, Any],
    data: Path,
    out: Path,
    budget: float | None,
    extra: dict[str, Any],
    report_only: bool = False,
) -> dict[str, Any] | None:
    folder = out / folder_name(name)
    opts = {**COMMON, **extra, **options}
    if budget is not None and "total_steps" not in opts:
        opts["time_budget"] = budget
    spec = {"name": name, "options": opts, "data": str(data), "out": str(folder)}
    done = folder / "bench_result.json"
    if report_only:
        if not done.exists():
            return None
    elif done.exists() and json.loads((folder / "bench_spec.json").read_text()) == spec:
        print(f"[{name}] reused {folder}", flush=True)
    else:
        if folder.exists():
            import shutil

            shutil.rmtree(folder)
        folder.mkdir(parents=True)
        (folder / "bench_spec.json").write_text(json.dumps(spec, indent=1))
        print(f"[{name}] training: {json.dumps(opts)}", flush=True)
        with open(folder / "log.txt", "w") as log:
            rc = subprocess.run(
                [sys.executable, __file__, "--worker", json.dumps(spec)], stdout=log, stderr=subprocess.STDOUT
            ).returncode
        if rc != 0:
            print(f"[{name}] FAILED (exit {rc}); see {folder / 'log.txt'}", flush=True)
            return None
    ran = json.loads((folder / "bench_spec.json").read_text())["options"]
    return {"name": name, "options": ran, **json.loads(done.read_text()), "curve": eval_curve(folder)}


def eval_curve(folder: Path) -> list[dict[str, Any]]:
    from eaglet.training.checkpoints import iter_metrics

    return [m for m in iter_metrics(folder) if m["split"] == "eval"]


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


def chain_tau(acc: list[float], depth: int = 2) -> float:
    """Expected tokens per verification of a chain of `depth` drafts (the bonus token included)."""
    from eaglet.drafter import acceptance_length

    return 1.0 + acceptance_length(acc[:depth])


def acc_at_fraction(curve: list[dict[str, Any]], total_seconds: float, fraction: float) -> float | None:
    """Held-out acc@1 of the last evaluation at or before `fraction` of the training seconds."""
    seen = [m for m in curve if m.get("train_seconds", 0) <= fraction * total_seconds * 1.02]
    return seen[-1]["acc"][0] if seen else None


GOAL_ACC1 = 0.45  # the held-out acc@1 a drafter needs to beat prompt lookup on the embedded default


def log_fit(points: list[tuple[float, float]]) -> tuple[float, float] | None:
    """Least squares of y = a + b ln(x): (a, b), or None under 2 distinct x."""
    import math

    xs, ys = [math.log(x) for x, _ in points], [y for _, y in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    if len(points) < 2 or var == 0:
        return None
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var
    return my - b * mx, b


def scaling_report(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For each variant run at several budgets (each a full schedule of its own): final held-out
    acc@1 against training tokens, the log-linear fit through those finals, and the tokens and
    hours (at the measured tokens/s) at which the fit reaches GOAL_ACC1: an extrapolation."""
    import math

    rows = []
    for base in dict.fromkeys(r["variant"] for r in results if "eval_on" not in r):
        runs = sorted(
            (r for r in results if r["variant"] == base and "eval_on" not in r), key=lambda r: r["train_tokens"]
        )
        if len(runs) < 2:
            continue
        fit = log_fit([(r["train_tokens"], r["eval"]["acc"][0]) for r in runs])
        rate = sum(r["train_tokens"] for r in runs) / sum(r["train_seconds"] for r in runs)
        reach = math.exp((GOAL_ACC1 - fit[0]) / fit[1]) if fit and fit[1] > 0 else None
        rows.append(
            {
                "variant": base,
                "points": [(r["train_tokens"], r["eval"]["acc"][0]) for r in runs],
                "fit": fit,
                "tokens_per_s": rate,
                "tokens_to_goal": reach,
            }
        )
    for row in rows:
        pts = ", ".join(f"{t / 1e3:,.0f}k: {a:.3f}" for t, a in row["points"])
        a, b = row["fit"]
        print(f"\nscaling of {row['variant']!r}: final held-out acc@1 by training tokens ({pts})")
        print(f"  fit acc@1 = {a:.3f} + {b:.4f} ln(tokens): +{b * math.log(2):.3f} per doubling of tokens")
        if row["tokens_to_goal"]:
            t = row["tokens_to_goal"]
            print(
                f"  reaches {GOAL_ACC1} at ~{t / 1e6:,.1f}M tokens = ~{t / row['tokens_per_s'] / 3600:,.1f} h at "
                f"{row['tokens_per_s']:.0f} tok/s (an extrapolation of the fit, not a measurement)"
            )
    return rows


def report(results: list[dict[str, Any]], out: Path) -> None:
    fractions = (0.25, 0.5, 1.0)
    k_max = max(len(r["eval"]["acc"]) for r in results)
    head = (
        f"{'variant':<28} {'tok/s':>6} {'tokens':>9} {'steps':>6} | "
        + " ".join(f"acc@{k + 1:<2}" for k in range(k_max))
        + f" | {'sim tau':>7} {'chain2':>6} | "
        + " ".join(f"@{int(f * 100)}%".rjust(6) for f in fractions)
    )
    print("\n" + head)
    print("-" * len(head))
    for r in results:
        ev, secs = r["eval"], r["train_seconds"]
        accs = " ".join(f"{a:6.3f}" for a in ev["acc"]) + "       " * (k_max - len(ev["acc"]))
        at = (
            " ".join(fmt_opt(acc_at_fraction(r["curve"], secs, f)) for f in fractions)
            if "eval_on" not in r
            else "(held out of DATA: final only)"
        )
        print(
            f"{r['name'][:28]:<28} {r['train_tokens'] / max(secs, 1e-9):6.0f} {r['train_tokens']:9,d} {r['steps']:6d} | "
            f"{accs} | {ev['tau']:7.3f} {chain_tau(ev['acc']):6.3f} | {at}"
        )
    print(
        "acc@k: held-out acceptance of TTT step k (the drafter's top-1 equals the target's choice, over all "
        "assistant tokens); chain2: 1 + acc@1 + acc@1*acc@2, tokens per target pass of a 2-token chain if "
        "acceptance were independent of context; @x%: held-out acc@1 after x% of the training seconds"
    )
    scaling = scaling_report(results)
    (out / "results.md").write_text(markdown_table(results, k_max))
    (out / "results.json").write_text(json.dumps({"runs": results, "scaling": scaling}, indent=1))
    plot(results, out / "learning_curves.png")
    print(f"results: {out / 'results.json'}\nplot: {out / 'learning_curves.png'}")


def markdown_table(results: list[dict[str, Any]], k_max: int) -> str:
    """The same figures as the printed table, as Markdown (for a README)."""
    lines = [
        "| variant | tok/s | tokens | "
        + " | ".join(f"acc@{k + 1}" for k in range(k_max))
        + " | chain-2 tau (sim.) | acc@1 at 50% of the time |",
        "| --- " * (k_max + 5) + "|",
    ]
    for r in results:
        acc, secs = r["eval"]["acc"], r["train_seconds"]
        cells = [f"{a:.3f}" for a in acc] + [""] * (k_max - len(acc))
        half = acc_at_fraction(r["curve"], secs, 0.5) if "eval_on" not in r else None
        lines.append(
            f"| {r['name']} | {r['train_tokens'] / max(secs, 1e-9):.0f} | {r['train_tokens']:,} | "
            + " | ".join(cells)
            + f" | {chain_tau(acc):.2f} | {'' if half is None else f'{half:.3f}'} |"
        )
    return "\n".join(lines) + "\n"


def fmt_opt(x: float | None) -> str:
    return "     -" if x is None else f"{x:6.3f}"


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_tokens, by_seconds) = plt.subplots(1, 2, figsize=(13, 5))
    for r in results:
        pts = [(m["train_tokens"], m["train_seconds"], m["acc"][0]) for m in r["curve"] if m.get("train_tokens")]
        if "eval_on" in r:  # trained on other data: only its final drafter was measured on DATA's held-out split
            pts = [(r["train_tokens"], r["train_seconds"], r["eval"]["acc"][0])]
        if not pts:
            continue
        tokens, seconds, acc = zip(*pts)
        style = dict(marker="o", markersize=3, label=r["name"])
        by_tokens.plot(tokens, acc, **style)
        by_seconds.plot([s / 60 for s in seconds], acc, **style)
    by_tokens.set_xscale("log")
    by_tokens.set_xlabel("training tokens (log)")
    by_seconds.set_xlabel("training minutes (2 CPU cores)" if not _has_cuda() else "training minutes")
    for ax in (by_tokens, by_seconds):
        ax.set_ylabel("held-out acc@1 (first draft accepted)")
        ax.grid(True, alpha=0.3)
    by_tokens.legend(fontsize=7, loc="lower right")
    fig.suptitle("eaglet train: held-out acceptance of the first draft token")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


# ---------------------------------------------------------------------------------------------
# Throughput against an older revision
# ---------------------------------------------------------------------------------------------


def checkout(rev: str, into: Path) -> Path:
    """`src/` of `rev` in a temporary folder (nothing of this checkout is touched)."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "src"], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into / "src"


def timed_rate(folder: Path) -> tuple[float, int]:
    """Tokens/s between the first and last train log lines (startup and the final evaluation
    excluded), from metrics.jsonl, which every revision writes the same way."""
    from eaglet.training.checkpoints import iter_metrics

    lines = [m for m in iter_metrics(folder) if m["split"] == "train"]
    if len(lines) < 2:
        raise SystemExit(f"{folder}: fewer than 2 train log lines; raise --throughput-steps")
    tokens = sum(m["tokens"] for m in lines[1:])
    return tokens / (lines[-1]["elapsed"] - lines[0]["elapsed"]), tokens


def train_command(data: Path, out: Path, options: dict[str, Any]) -> list[str]:
    cmd = [sys.executable, "-m", "eaglet.cli", "train", str(data), "--out", str(out)]
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            cmd.append(flag)
        elif value is False:
            cmd.append("--no-" + key.replace("_", "-"))
        elif value is not None:
            cmd += [flag, str(value)]
    return cmd


def throughput(
    data: Path, out: Path, rev: str, steps: int, variants: list[tuple[str, dict[str, Any]]], extra: dict[str, Any]
) -> None:
    common = {k: v for k, v in COMMON.items() if k != "evals"}  # options the old code knows too
    fixed = {
        **common,
        **extra,
        "total_steps": steps,
        "eval_every": steps,
        "save_every": steps,
        "log_every": max(1, steps // 6),
    }
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        old_src = checkout(rev, Path(tmp))
        # the old code knew only --bf16 (off by default), as the recipes set it, and fp32
        runs = [
            (f"{rev}, bf16", {**fixed, **TODAY, "bf16": True}, str(old_src)),
            (f"{rev}, fp32", {**fixed, **TODAY}, str(old_src)),
        ]
        runs += [(f"now: {name}", {**fixed, **opts}, str(REPO / "src")) for name, opts in variants]
        from eaglet.target import fast_bf16

        for i, (label, opts, src) in enumerate(runs):
            if opts.get("bf16") and not fast_bf16("cpu") and not _has_cuda():  # emulated bf16: minutes a step
                opts = {**opts, "total_steps": max(4, steps // 5), "log_every": 1}
            folder = out / "throughput" / f"{i}_{folder_name(label)}"
            if folder.exists():
                import shutil

                shutil.rmtree(folder)
            env = {**os.environ, "PYTHONPATH": src}
            print(f"[{label}] {opts['total_steps']} steps ...", flush=True)
            res = subprocess.run(train_command(data, folder, opts), env=env, capture_output=True, text=True)
            if res.returncode != 0:
                raise SystemExit(f"{label}: exit {res.returncode}\n{res.stderr[-2000:]}")
            rate, tokens = timed_rate(folder)
            rows.append((label, opts, rate, tokens))
    print(f"\n{'code and settings':<40} {'tok/s':>7} {'x bf16':>7} {'x fp32':>7}  options")
    for label, opts, rate, tokens in rows:
        shown = {k: v for k, v in opts.items() if k not in fixed}
        print(f"{label[:40]:<40} {rate:7.0f} {rate / rows[0][2]:7.2f} {rate / rows[1][2]:7.2f}  {json.dumps(shown)}")
    print(f"this CPU computes bf16 {'fast' if fast_bf16('cpu') else 'slowly (no AMX / AVX512-BF16): auto is fp32'}")
    print(
        f"same data, same {steps} steps (tokens/s between the first and last log lines: no startup, no held-out eval)"
    )


# ---------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("data", nargs="?", help="an extracted dataset (eaglet extract)")
    ap.add_argument("--out", default="runs/bench-train", help="one folder per variant, results, plot")
    ap.add_argument(
        "--budget",
        default="10m",
        help="training time per variant (default 10m); a list (2m,5m,16m) runs each variant at each "
        "budget, a full schedule each, and fits final acc@1 against tokens (scaling)",
    )
    ap.add_argument("--variant", action="append", default=[], help="'name: key=value ...' (TrainConfig fields)")
    ap.add_argument("--preset", choices=sorted(PRESETS), action="append", default=[], help="a built-in set of variants")
    ap.add_argument("--eval-fraction", type=float, default=0.02, help="held-out fraction, the same for all (0.02)")
    ap.add_argument("--max-length", type=int, default=None, help="truncate samples (all variants)")
    ap.add_argument("--throughput", action="store_true", help="time fixed steps against --baseline-rev instead")
    ap.add_argument("--baseline-rev", default="2db66ca", help="git revision of the code to compare with (2db66ca)")
    ap.add_argument("--throughput-steps", type=int, default=30, help="steps timed per setting (default 30)")
    ap.add_argument("--report-only", action="store_true", help="print the table of finished variants only")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return
    if not args.data:
        ap.error("DATA is required")
    variants = [(n, o) for p in args.preset for n, o in PRESETS[p].items()] + [parse_variant(v) for v in args.variant]
    if not variants:
        ap.error("give --variant or --preset")
    data, out = Path(args.data), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    extra = {"eval_fraction": args.eval_fraction, "max_length": args.max_length}
    if args.throughput:
        throughput(data, out, args.baseline_rev, args.throughput_steps, variants, extra)
        return
    budgets = [(b, parse_duration(b)) for b in args.budget.split(",")]
    results = []
    for variant, options in variants:
        for label, seconds in budgets:
            name = variant if len(budgets) == 1 else f"{variant} @ {label}"
            r = run_variant(name, options, data, out, seconds, extra, args.report_only)
            if r is not None:
                results.append({**r, "variant": variant, "budget": seconds})
    if results:
        report(results, out)


if __name__ == "__main__":
    main()
