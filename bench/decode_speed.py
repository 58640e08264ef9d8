"""Speculative decoding speed: plain greedy vs `speculative_generate`, same target, same settings.

    python bench/decode_speed.py [--target tiny|smollm2|PATH] [--new 128] [--threads 1] [--device cpu]

Drafters: an "oracle" that proposes the target's own greedy continuation (upper bound: every
draft accepted; measures the engine's overhead and the tree/verification cost) and a
random-init EAGLE-3 drafter (lower bound: nothing accepted; measures the drafting overhead).
A trained drafter falls in between. Prints tokens/s, tau (prefill counted), tau per
verification, and the speedup over plain decoding; checks every output equals plain greedy.
`tiny` is the random 8-layer test Llama (built in a temp folder); `smollm2` is the embedded
target (set EAGLET_HOME to reuse its cache).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

from eaglet.decode import DraftTree, plain_generate, speculative_generate
from eaglet.drafter import DraftConfig, Eagle3Draft
from eaglet.layers import default_layer_ids

PROMPT = [5, 17, 99, 3, 42, 7, 11, 250, 31, 8]


class Oracle:
    aux_layer_ids: list[int] = []

    def __init__(self, full: list[int]):
        self.full = full

    def observe(self, seq, aux) -> None:
        self.seq = seq

    def propose(self, max_depth: int, top_k: int, total_tokens: int) -> DraftTree:
        n = len(self.seq)
        if self.full[:n] != self.seq:
            return DraftTree.empty()
        return DraftTree.chain(self.full[n : n + min(max_depth, total_tokens)])


def load(name: str, device: torch.device):
    from transformers import AutoModelForCausalLM

    if name == "tiny":
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from conftest import make_tiny_llama, make_tiny_tokenizer

        folder = Path(tempfile.mkdtemp(prefix="eaglet-bench-"))
        make_tiny_llama(folder, len(make_tiny_tokenizer(folder)))
    elif name == "smollm2":
        from eaglet.target import resolve_target

        folder = Path(resolve_target(None).path)
    else:
        folder = Path(name)
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device).eval()


def timed(fn, repeats: int):
    best, result = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - t0)
    return best, result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="tiny")
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    model = load(args.target, device)
    n_layers = model.config.num_hidden_layers
    cfg = DraftConfig.from_target(
        model.config, default_layer_ids(n_layers)[:-1], draft_vocab_size=min(32000, model.config.vocab_size)
    )
    torch.manual_seed(0)
    drafter = Eagle3Draft(cfg).to(device).eval()
    with torch.no_grad():
        drafter.embed_tokens.weight.copy_(model.get_input_embeddings().weight)

    plain_s, ref = timed(lambda: plain_generate(model, PROMPT, args.new)[0], args.repeats)
    print(
        f"target {args.target} ({n_layers} layers, H={model.config.hidden_size}), {args.new} new tokens, "
        f"{args.threads} thread(s), {device}"
    )
    print(f"{'plain greedy':34s} {len(ref) / plain_s:8.1f} tok/s  tau 1.00")
    oracle = Oracle(PROMPT + ref)
    runs = [
        ("oracle chain depth 7", oracle, dict(mode="chain", depth=7)),
        ("oracle chain depth 4", oracle, dict(mode="chain", depth=4)),
        ("random drafter chain 7", drafter, dict(mode="chain", depth=7)),
        ("random drafter tree 7/10/60", drafter, dict(mode="tree", depth=7, top_k=10, total_tokens=60)),
        ("random drafter tree 5/8/32", drafter, dict(mode="tree", depth=5, top_k=8, total_tokens=32)),
    ]
    for label, proposer, kw in runs:
        secs, (out, stats) = timed(lambda: speculative_generate(model, proposer, PROMPT, args.new, **kw), args.repeats)
        assert out == ref, f"{label}: output differs from plain greedy"
        print(
            f"{label:34s} {len(out) / secs:8.1f} tok/s  tau {stats.tau:.2f}  tau/verify {stats.tau_verify:.2f}  "
            f"speedup {plain_s / secs:.2f}x  (target {stats.target_s:.2f} s, draft {stats.draft_s:.2f} s)"
        )


if __name__ == "__main__":
    main()
