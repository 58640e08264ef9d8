"""Training tokens/s of `eaglet train` at this tree's defaults against an older commit's, same data, one run.

    python bench/train_speedup.py DATA [--baseline f6fc1fe] [--tokens 100000] [--rounds 1]
        [--config NAME=ARGS ...]

Each configuration is `eaglet train DATA` in its own process (this tree's code, or the baseline
commit's checked out into a temporary git worktree and run with this same environment), trained
for about `--tokens` tokens; configurations alternate over `--rounds`, so a machine whose speed
drifts affects them alike. For each it prints tokens/s over the whole run (compilation and the
first epoch's teacher included) and at the steady state (from the second metrics line on), and
the steady rate as FLOP/s (the step's matmul and attention FLOPs per token, counted on the
drafter's shapes by bench/train_step_profile.py) against the machine's measured GEMM peak.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_step_profile import count_flops, gemm_gflops, machine, make_step  # noqa: E402

from eaglet.target import fast_bf16  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DEFAULT_CONFIGS = (
    "baseline=",  # the baseline commit at its defaults
    "unpacked=--pack-tokens 0 --no-compile",  # this tree, one sample per step as before
    "packed eager=--no-compile",  # this tree's defaults without torch.compile
    "defaults=",  # this tree's defaults
)


def run_train(src: Path, data: Path, out: Path, args: list[str], steps: int) -> dict[str, float]:
    """One `eaglet train` of `steps` steps with the code in `src`; its tokens and seconds, all and steady."""
    env = {**os.environ, "PYTHONPATH": str(src / "src")}
    cmd = [
        sys.executable,
        "-m",
        "eaglet.cli",
        "train",
        str(data),
        "--out",
        str(out),
        "--total-steps",
        str(steps),
        "--evals",
        "1",
        "--log-every",
        str(max(1, steps // 10)),
        *args,
    ]
    subprocess.run(cmd, check=True, env=env, cwd=src, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["split"] == "train"]
    first, last = rows[0], rows[-1]
    return {
        "tokens": last["train_tokens"],
        "seconds": last["train_seconds"],
        "steady_tokens": last["train_tokens"] - first["train_tokens"],
        "steady_seconds": last["train_seconds"] - first["train_seconds"],
    }


def tokens_per_step(src: Path, data: Path, out: Path, args: list[str]) -> float:
    """Average tokens of an optimizer step of this configuration (from a 3-step run's metrics)."""
    r = run_train(src, data, out, args, 3)
    return r["tokens"] / 3


def flops_per_token(bf16: bool, tokens: int) -> float:
    """Matmul and attention FLOPs per token of a training step (forward and backward) at SmolLM2's shapes."""
    step, n = make_step(tokens, 1, 2, 8192, bf16)
    return count_flops(step) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("data", type=Path, help="an `eaglet extract` dataset of the embedded target")
    ap.add_argument("--baseline", default="f6fc1fe", help="commit whose defaults are the baseline")
    ap.add_argument("--tokens", type=int, default=100_000, help="training tokens per configuration and round")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument(
        "--config",
        action="append",
        help="NAME=ARGS: `eaglet train` arguments; 'baseline' runs the "
        "baseline commit (default: baseline, unpacked, packed eager, "
        "defaults)",
    )
    args = ap.parse_args()
    configs = [c.split("=", 1) for c in (args.config or DEFAULT_CONFIGS)]
    bf16 = fast_bf16("cpu")
    peak = gemm_gflops(2048, 2048, 2048, torch.bfloat16 if bf16 else torch.float32)
    per_token = flops_per_token(bf16, 1024)
    print(
        f"machine: {machine()}; GEMM peak {peak:,.0f} GFLOP/s ({'bf16' if bf16 else 'fp32'}, 2048^3); "
        f"{per_token / 1e6:.0f} MFLOP per training token (matmul + attention, forward + backward)",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "baseline"
        subprocess.run(
            ["git", "-C", str(REPO), "worktree", "add", "--detach", str(base), args.baseline],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            srcs = {name: base if name == "baseline" else REPO for name, _ in configs}
            steps = {
                name: max(
                    10,
                    round(
                        args.tokens / tokens_per_step(srcs[name], args.data, Path(tmp) / f"probe_{n}", extra.split())
                    ),
                )
                for n, (name, extra) in enumerate(configs)
            }
            totals = {
                name: {"tokens": 0.0, "seconds": 0.0, "steady_tokens": 0.0, "steady_seconds": 0.0}
                for name, _ in configs
            }
            for r in range(args.rounds):
                for name, extra in configs:
                    out = Path(tmp) / f"run_{r}_{name.replace(' ', '_')}"
                    for k, v in run_train(srcs[name], args.data, out, extra.split(), steps[name]).items():
                        totals[name][k] += v
                    print(f"  round {r + 1}: {name} done", file=sys.stderr, flush=True)
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(base)], check=False)
    base_rate = None
    print(
        f"{'configuration':<16} {'args':<34} {'steps':>5} {'tok/s all':>9} {'steady':>7} {'x base':>6} "
        f"{'GFLOP/s':>7} {'% peak':>6}"
    )
    for name, extra in configs:
        t = totals[name]
        rate, steady = t["tokens"] / t["seconds"], t["steady_tokens"] / max(t["steady_seconds"], 1e-9)
        base_rate = base_rate or rate
        print(
            f"{name:<16} {extra or '(defaults)':<34} {steps[name]:>5} {rate:>9,.0f} {steady:>7,.0f} "
            f"{rate / base_rate:>5.2f}x {steady * per_token / 1e9:>7,.0f} {steady * per_token / 1e9 / peak:>6.1%}"
        )
    print(
        "tok/s all: training tokens / training seconds (held-out evaluation and saves excluded), compilation and "
        "the first epoch's teacher included; steady: after the first metrics line; x base: 'all' against the "
        "first configuration"
    )


if __name__ == "__main__":
    main()
