"""Which draft shapes pay off on this machine: chain depths, tree sizes, prompt lookup and
hybrids of the drafter's chain with prompt lookup, side by side.

    python bench/decode_sweep.py DRAFTER [DRAFTER ...] [--target T] [--prompts mtbench] [--num-prompts 8]
        [--skip-prompts N] [--max-new-tokens 96] [--threads 1] [--dtype bf16] [--only LABELS]
        [--min-draft-probs 0,0.3,0.5]

Runs `eaglet eval`'s own loop (`evaluate.evaluate_set`) with one variant per shape: for every
prompt, plain greedy and every configuration decode the same prompt in a rotating order (machine
drift spreads evenly); prints tau, acceptance per draft position, tokens/s, speedup over plain
greedy and its ceiling, all measured in this one run. The cpu preset of `eaglet eval`
(src/eaglet/presets.toml: tree and chain shapes, the draft-probability floor) and
eval's --lookup-tokens default were chosen with it. With several drafters (for one target), every
shape that uses one runs once per drafter, labelled "[1]", "[2]", ..., in the same run.
`--min-draft-probs` crosses every shape with each draft-probability floor
(`eaglet eval --min-draft-prob`): drafts the drafter itself finds unlikely are not verified.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import torch

from eaglet.evaluate import (
    DecodeSettings,
    evaluate_set,
    format_table,
    load_prompt_set,
    summarize,
    torch_threads,
    warm_up,
    with_pass_costs,
)
from eaglet.options import BASELINE, DRAFTER_METHODS, ENGINE_METHODS
from eaglet.drafter.files import load_drafter_for_target
from eaglet.chat import stop_token_ids
from eaglet.target import load_target, load_tokenizer, parse_dtype, resolve_target

# (label, method, settings that differ from eaglet eval's defaults)
CONFIGS = [
    *((f"chain {d}", "chain", dict(chain_depth=d)) for d in range(1, 7)),
    ("chain 2 p>=0.35", "chain", dict(chain_depth=2, min_draft_prob=0.35)),  # the demo recipe's eval
    ("tree 4/2/6 p>=0.35", "tree", dict(depth=4, top_k=2, total_tokens=6, min_draft_prob=0.35)),
    *(
        (f"tree {d}/{k}/{n}", "tree", dict(depth=d, top_k=k, total_tokens=n))
        for d, k, n in ((2, 2, 3), (3, 2, 4), (4, 2, 6), (5, 4, 12), (5, 4, 20), (6, 8, 30), (7, 10, 60))
    ),
    ("prompt-lookup", "prompt-lookup", {}),  # Hugging Face's, 10 tokens
    *((f"ngram {n}", "ngram", dict(lookup_tokens=n)) for n in (2, 4, 6, 10)),
    *(
        (f"hybrid chain {d} + {n}", "hybrid", dict(hybrid_chain_depth=d, lookup_tokens=n))
        for d, n in ((1, 2), (1, 4), (2, 2), (2, 4), (2, 6), (3, 4))
    ),
    ("hybrid chain 1 + 4 p>=0.6", "hybrid", dict(hybrid_chain_depth=1, lookup_tokens=4, min_draft_prob=0.6)),
    (
        "hybrid chain 1 + 4 drop rivals",
        "hybrid",
        dict(hybrid_chain_depth=1, lookup_tokens=4, drop_rivals=True, admission="all", min_draft_prob=0.35),
    ),
    ("hybrid tree 4/2/6 + 4", "hybrid", dict(hybrid_draft="tree", depth=4, top_k=2, total_tokens=6, lookup_tokens=4)),
    # the same shapes verifying every proposed token (--admission all) instead of what pays
    *(
        (f"{label} all", method, dict(admission="all", min_draft_prob=0.35))
        for label, method in (("ngram 4", "ngram"), ("hybrid chain 1 + 4", "hybrid"))
    ),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("drafters", nargs="+", metavar="drafter")
    ap.add_argument("--target", default=None)
    ap.add_argument("--prompts", default="mtbench")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--skip-prompts", type=int, default=0, help="start after the first N prompts of the set")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument(
        "--only",
        default=None,
        help='comma-separated labels to run (default: all); "LABEL [i]" runs a shape with drafter i only',
    )
    ap.add_argument("--min-draft-probs", default="0", help="comma-separated draft-probability floors (default 0)")
    args = ap.parse_args()

    dtype = parse_dtype(args.dtype)
    loaded = [load_drafter_for_target(path, args.target) for path in args.drafters]
    ref = resolve_target(loaded[0].target)
    tokenizer = load_tokenizer(ref)
    model = load_target(ref, dtype, torch.device("cpu"))
    drafters = [d.model.to(dtype=dtype).eval() for d in loaded]
    drafter_of: dict[str, torch.nn.Module] = {}
    base = DecodeSettings(max_new_tokens=args.max_new_tokens, eos_ids=tuple(sorted(stop_token_ids(model, tokenizer))))
    variants = {BASELINE: (BASELINE, base)}
    floors = [float(x) for x in args.min_draft_probs.split(",")]
    only = None if args.only is None else set(args.only.split(","))
    for label, method, changes in CONFIGS:
        for floor in floors if method in ENGINE_METHODS and "min_draft_prob" not in changes else [0.0]:
            name = label if floor == 0 else f"{label} p>={floor:g}"
            uses_drafter = method in DRAFTER_METHODS and len(drafters) > 1
            for i, drafter in enumerate(drafters if uses_drafter else drafters[:1], start=1):
                named = f"{name} [{i}]" if uses_drafter else name
                if only is None or {label, name, named} & only:
                    variants[named] = (method, replace(base, **{"min_draft_prob": floor, **changes}))
                    drafter_of[named] = drafter
    prompts = load_prompt_set(args.prompts, args.skip_prompts + args.num_prompts)[args.skip_prompts :]

    def progress(totals) -> None:
        print(f"prompt {totals[BASELINE].turns}/{len(prompts)} done", flush=True)

    with torch_threads(args.threads), torch.inference_mode():
        variants = with_pass_costs(variants, model)
        warm_up(variants, model, drafters[0], tokenizer, prompts[0], drafter_of)
        totals = evaluate_set(
            prompts, variants, model, drafters[0], tokenizer, progress, records=[], drafters=drafter_of
        )
    print(
        f"\n{len(prompts)} {args.prompts} prompts, {args.max_new_tokens} new tokens, {args.dtype}, "
        f"{args.threads} thread(s); " + ", ".join(f"drafter [{i}] {p}" for i, p in enumerate(args.drafters, 1))
    )
    print(format_table({args.prompts: summarize(totals, compared=True)}))


if __name__ == "__main__":
    main()
