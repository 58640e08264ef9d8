"""`eaglet regen` through each backend on the same chats, in one run: tokens/s side by side.

    python bench/regen_backends.py [--chats 64] [--max-new-tokens 192] [--max-prompt-tokens 768]
                                   [--dtype auto,fp32] [--concurrency 4,8,16] [--weights q4_1,f32]
                                   [--threads 2] [--out DIR]

The embedded target (SmolLM2-135M-Instruct) answers the same --chats ShareGPT chats (the first
ones, first turn only, greedy; the demo recipe's prompt and answer limits and batch size) through each backend,
all of them, so every run does the same work: the local backend (Hugging Face generate, batched)
in each --dtype, and llama.cpp's llama-server with each --concurrency (parallel slots, continuous
batching) and --threads, on the embedded GGUF as it ships (q4_1) and on its f32 copy (f32: the
local backend's own weights, so the same answers). The server's start-up is outside the clock
(eaglet's regen resets it once the server is healthy); so is the local model's load. Run it with
nothing else on the machine: both backends use every core.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from eaglet import embedded
from eaglet.regen import regenerate
from eaglet.target import cpu_description, f32_target_gguf
from eaglet.options import RegenOptions


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chats", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=192)
    p.add_argument("--max-prompt-tokens", type=int, default=768, help="longer prompts are skipped, as in the demo")
    p.add_argument("--dtype", default="auto", help="local backend dtypes, one run each")
    p.add_argument("--batch-size", type=int, default=32, help="local backend prompts per generate call")
    p.add_argument("--concurrency", default="4,8,16", help="llama.cpp parallel slots, one run each")
    p.add_argument("--weights", default="q4_1", help="llama.cpp target weights, one run each: q4_1, f32")
    p.add_argument("--threads", type=int, default=None, help="llama.cpp threads (default: all cores)")
    p.add_argument("--out", type=Path, default=None, help="keep the answers here (default: a temporary folder)")
    args = p.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="eaglet-regen-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    common = dict(
        num_samples=args.chats,
        max_turns=1,
        max_new_tokens=args.max_new_tokens,
        max_prompt_tokens=args.max_prompt_tokens,
    )
    runs: dict[str, dict] = {
        f"local {d}": dict(backend="local", dtype=d, batch_size=args.batch_size) for d in args.dtype.split(",")
    }
    for w in args.weights.split(","):
        gguf = embedded.smollm2_gguf() if w == "q4_1" else f32_target_gguf(embedded.smollm2_gguf())
        for c in map(int, args.concurrency.split(",")):
            runs[f"llama.cpp {w} x{c}"] = dict(
                backend="llama.cpp", target_gguf=gguf, concurrency=c, threads=args.threads
            )
    results = {}
    for label, options in runs.items():
        s = regenerate(
            RegenOptions(data="sharegpt", out=out / f"{label.replace(' ', '_')}.jsonl", **options, **common),
            progress_bar=False,
        )
        results[label] = {
            "chats": s.written,
            "failed": s.failed,
            "tokens": s.tokens,
            "seconds": round(s.seconds, 1),
            "tokens_per_s": round(s.tokens_per_s, 1),
        }
        print(f"{label}: {results[label]}", flush=True)
    base = next(iter(results.values()))["tokens_per_s"]
    print(
        f"\nregen of the first {args.chats} ShareGPT chats' first turns, greedy, {args.max_new_tokens} new tokens at "
        f"most; {cpu_description()}, {os.cpu_count()} cores"
    )
    print(f"{'backend':<22}{'chats':>7}{'tokens':>9}{'tok/s':>9}{'vs ' + next(iter(results)):>16}")
    for label, r in results.items():
        ratio = r["tokens_per_s"] / base if base else float("nan")
        print(f"{label:<22}{r['chats']:>7}{r['tokens']:>9,}{r['tokens_per_s']:>9.1f}{ratio:>15.2f}x")
    (out / "results.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
