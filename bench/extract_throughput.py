"""Extraction throughput vs a plain forward of the same batches, in one run.

    python bench/extract_throughput.py [--target DIR] [--num-samples 48] [--max-length 512]

Prints tokens/s of (a) a plain bf16 forward of the decoder stack over the same length-sorted
padded batches, with no capture and no writing, and (b) `eaglet extract` (hooks, copies,
atomic writes with fsync), their ratio (goal >= 0.9), and bytes on disk per token vs the
v1 minimum 4*H*2 + 16. The plain forward runs before and after extraction; their mean is the
reference, so drift of the machine shows up as a gap between the two plain figures.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from eaglet import formats
from eaglet.prepare import prepare
from eaglet.extract import extract, length_batches
from eaglet.target import pad_right
from eaglet.target import base_model, load_target, parse_dtype, pick_device, resolve_target
from eaglet.options import ExtractOptions, PrepareOptions


@torch.inference_mode()
def plain_forward_seconds(model, samples, batches, device) -> float:
    t0 = time.perf_counter()
    for batch in batches:
        ids, attn = pad_right([samples[i] for i in batch])  # the same padding extraction uses
        base_model(model)(input_ids=ids.to(device), attention_mask=attn.to(device), use_cache=False)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=None)
    ap.add_argument("--data", default="sharegpt")
    ap.add_argument("--num-samples", type=int, default=48)
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--batch-tokens", type=int, default=8192)
    ap.add_argument("--dtype", default="bf16")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="eaglet-bench-extract-"))
    prepare(
        PrepareOptions(
            target=args.target,
            data=args.data,
            out=work / "prep",
            max_length=args.max_length,
            num_samples=args.num_samples,
        )
    )
    samples, _ = formats.read_prepared(work / "prep")
    tokens = sum(len(s.input_ids) for s in samples)
    device = pick_device()
    model = load_target(resolve_target(args.target), parse_dtype(args.dtype), device)
    batches = length_batches(list(range(len(samples))), [len(s.input_ids) for s in samples], args.batch_tokens, 64)
    plain_forward_seconds(model, samples, batches[-1:], device)  # warm-up

    plain_before = plain_forward_seconds(model, samples, batches, device)
    summary = extract(
        ExtractOptions(
            prepared=work / "prep",
            out=work / "data",
            target=args.target,
            dtype=args.dtype,
            batch_tokens=args.batch_tokens,
        ),
        show_progress=False,
    )
    plain_after = plain_forward_seconds(model, samples, batches, device)
    plain = (plain_before + plain_after) / 2

    hidden = model.config.hidden_size
    floor = formats.v1_min_bytes_per_token(hidden)
    print(
        f"samples {len(samples)}, tokens {tokens}, batches {len(batches)}, dtype {args.dtype}, "
        f"threads {torch.get_num_threads()}, device {device}"
    )
    print(f"{'':28}{'tok/s':>10}{'seconds':>10}")
    print(f"{'plain forward (before)':28}{tokens / plain_before:>10,.0f}{plain_before:>10.2f}")
    print(f"{'plain forward (after)':28}{tokens / plain_after:>10,.0f}{plain_after:>10.2f}")
    print(f"{'eaglet extract (+writes)':28}{tokens / summary.seconds:>10,.0f}{summary.seconds:>10.2f}")
    print(f"extract / plain throughput: {plain / summary.seconds:.3f} (goal >= 0.9)")
    print(
        f"bytes on disk per token: {summary.bytes_on_disk / summary.tokens_on_disk:,.1f} "
        f"(v1 minimum 4*{hidden}*2+16 = {floor}; overhead "
        f"{summary.bytes_on_disk / summary.tokens_on_disk / floor - 1:.2%})"
    )
    print(f"files in {work}")


if __name__ == "__main__":
    main()
