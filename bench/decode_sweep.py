"""Which draft shapes pay off on this machine: chain depths and tree sizes, side by side.

    python bench/decode_sweep.py DRAFTER [--target T] [--prompts mtbench] [--num-prompts 8]
        [--max-new-tokens 96] [--threads 1] [--dtype bf16]

For every prompt, plain greedy and every configuration decode the same prompt in a rotating
order (machine drift spreads evenly); prints new tokens per target forward (tau), acceptance per
draft position, tokens/s and speedup over plain greedy, all measured in this one run. The
defaults of `eaglet eval` (`evaluate.CPU_TREE`, `evaluate.CPU_CHAIN_DEPTH`) were chosen with it.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import torch

from eaglet.data import chat_prompt_ids
from eaglet.evaluate import BASELINE, DecodeSettings, MethodTotals, load_prompt_set, rotated, run_method
from eaglet.export import load_drafter_for_target
from eaglet.regen import stop_token_ids
from eaglet.target import load_target, load_tokenizer, parse_dtype, resolve_target

# (label, method, depth, top_k, total_tokens)
CONFIGS = [
    ("chain 2", "chain", 2, 1, 2), ("chain 3", "chain", 3, 1, 3), ("chain 4", "chain", 4, 1, 4),
    ("chain 5", "chain", 5, 1, 5), ("chain 6", "chain", 6, 1, 6),
    ("tree 4/2/6", "tree", 4, 2, 6), ("tree 5/4/12", "tree", 5, 4, 12), ("tree 5/4/20", "tree", 5, 4, 20),
    ("tree 6/8/30", "tree", 6, 8, 30), ("tree 7/10/60", "tree", 7, 10, 60),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("drafter")
    ap.add_argument("--target", default=None)
    ap.add_argument("--prompts", default="mtbench")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--skip-prompts", type=int, default=0, help="start after the first N prompts of the set")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--only", default=None, help="comma-separated labels to run (default: all)")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    dtype = parse_dtype(args.dtype)
    drafter, target_spec = load_drafter_for_target(args.drafter, args.target)
    ref = resolve_target(target_spec)
    tokenizer = load_tokenizer(ref)
    model = load_target(ref, dtype, torch.device("cpu"))
    drafter = drafter.to(dtype=dtype).eval()
    base = DecodeSettings(max_new_tokens=args.max_new_tokens, eos_ids=tuple(sorted(stop_token_ids(model, tokenizer))))
    configs = [c for c in CONFIGS if args.only is None or c[0] in args.only.split(",")]
    settings = {label: (method, replace(base, depth=d, chain_depth=d, top_k=k, total_tokens=n))
                for label, method, d, k, n in configs}
    labels = [BASELINE, *settings]
    totals = {label: MethodTotals() for label in labels}
    prompts = load_prompt_set(args.prompts, args.skip_prompts + args.num_prompts)[args.skip_prompts:]
    with torch.inference_mode():
        warm = chat_prompt_ids(tokenizer, [{"role": "user", "content": prompts[0].turns[0]}])
        for label in labels:
            method, s = settings.get(label, (BASELINE, base))
            run_method(method, model, drafter, warm, replace(s, max_new_tokens=8))
        for i, p in enumerate(prompts):
            ids = chat_prompt_ids(tokenizer, [*p.context, {"role": "user", "content": p.turns[0]}])
            runs = {}
            for label in rotated(labels, i):
                method, s = settings.get(label, (BASELINE, base))
                runs[label] = run_method(method, model, drafter, ids, s)
            for label in labels:
                totals[label].add(runs[label], runs[BASELINE].tokens if label != BASELINE else None)
            print(f"prompt {i + 1}/{len(prompts)} done", flush=True)

    plain = totals[BASELINE]
    print(f"\n{len(prompts)} {args.prompts} prompts, {args.max_new_tokens} new tokens, {args.dtype}, "
          f"{args.threads} thread(s); drafter {args.drafter}")
    print(f"{'config':<14} {'tok/s':>7} {'speedup':>8} {'tau':>6} {'ceiling':>8} {'identical':>9}  acceptance per position")
    for label in labels:
        r = totals[label].summary(plain if label != BASELINE else None, label != BASELINE)
        acc = " ".join("-" if a is None else f"{a:.2f}" for a in r.get("acceptance_rates", []))
        speed = f"{r['speedup']:.2f}x" if "speedup" in r else "-"
        ceiling = f"{r['ceiling_speedup']:.2f}x" if r.get("ceiling_speedup") else "-"
        ident = f"{r['identical_share']:.0%}" if r.get("identical_share") is not None else "-"
        print(f"{label:<14} {r['tokens_per_s']:>7.2f} {speed:>8} {r['tau']:>6.2f} {ceiling:>8} {ident:>9}  {acc}")


if __name__ == "__main__":
    main()
