"""What a verification pass costs on this machine, and the acceptance a drafter needs to pay for it.

    python bench/verify_cost.py [--target PATH] [--dtypes bf16,fp32] [--context 300] [--threads 1]

Speculative decoding replaces one-token target passes by passes over 1 + d tokens. On a GPU a
pass over a few tokens costs about what a one-token pass costs; on a CPU it may not, and then the
drafter must be accepted often just to break even. For each dtype this times the target's pass
over q = 1..8 new tokens on a KV cache of --context tokens, through the decoder's own
`TargetRunner` (median of --repeats rounds, each over every q), and prints each cost relative to q = 1 with the acceptance
rate p (the same at every draft position) at which a chain of q - 1 drafted tokens breaks even,
1 + p + ... + p^(q-1) = cost(q) / cost(1), the drafter's own time not counted.
"""

from __future__ import annotations

import argparse

import torch

from eaglet.decode import measure_pass_costs
from eaglet.drafter import acceptance_length
from eaglet.target import load_target, parse_dtype, resolve_target

MAX_Q = 8


def expected_tokens(p: float, drafted: int) -> float:
    """Tokens a cycle yields when each of `drafted` chained drafts is accepted with probability p
    (the target's own token included)."""
    return 1.0 + acceptance_length([p] * drafted)


def break_even_acceptance(cost_ratio: float, drafted: int) -> float | None:
    """The p at which a chain of `drafted` tokens yields cost_ratio tokens per pass (bisection);
    None when even p = 1 does not pay."""
    if expected_tokens(1.0, drafted) < cost_ratio:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens(mid, drafted) < cost_ratio else (lo, mid)
    return hi


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=None, help="model folder or hub id (default: the embedded SmolLM2)")
    ap.add_argument("--dtypes", default="bf16,fp32")
    ap.add_argument("--context", type=int, default=300, help="tokens already in the KV cache (default 300)")
    ap.add_argument("--threads", type=int, default=1, help="as `eaglet eval --threads` (default 1)")
    ap.add_argument("--repeats", type=int, default=15, help="rounds over q = 1..8 (default 15)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ref = resolve_target(args.target)
    print(
        f"target {ref.name}, {args.context} cached tokens, {args.threads} thread(s); break-even p: acceptance "
        f"at every draft position for a chain of q-1 drafts to pay for its pass (drafter time not counted)"
    )
    print(f"{'dtype':<6} {'q':>2} {'ms':>8} {'x q=1':>6} {'break-even p':>13}")
    for name in args.dtypes.split(","):
        model = load_target(ref, parse_dtype(name), torch.device("cpu"))
        costs = measure_pass_costs(model, args.context, MAX_Q, args.repeats)
        for q, cost in enumerate(costs, start=1):
            ratio = cost / costs[0]
            p = break_even_acceptance(ratio, q - 1) if q > 1 else None
            shown = "-" if q == 1 else ("never" if p is None else f"{p:.2f}")
            print(f"{name:<6} {q:>2} {1000 * cost:8.1f} {ratio:6.2f} {shown:>13}", flush=True)
        del model


if __name__ == "__main__":
    main()
