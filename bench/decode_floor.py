"""What a target pass costs eaglet on this machine, beside llama.cpp on the same weights and beside
what the machine's memory and arithmetic allow.

    python bench/decode_floor.py [--threads 1] [--dtypes fp32,bf16] [--context 256] [--drafter RUN]
                                 [--no-llama-cpp]

For the embedded SmolLM2-135M-Instruct, after --context cached tokens, q = 1..8 new tokens:
  - floors: the weights' bytes over the bandwidth a streaming read gets here (one pass reads every
    weight once), and the pass's FLOPs (2 x parameters x q) over the rate a large matrix product
    gets here, per dtype and thread count;
  - eaglet's fast target (`decode.FastTarget`) and Hugging Face's forward (`decode.TargetRunner`,
    EAGLET_FAST_TARGET=0), each a median over rounds (`decode.measure_pass_costs`);
  - llama.cpp's llama-server on the f32 GGUF of the same weights (the engine's own prompt timing of
    q new tokens after a cached prompt);
  - with --drafter, the drafter's pass: one EAGLE-3 draft step (or one parallel block) after a
    --context-token context, as eval's chain runs it.
Run it with nothing else on the machine.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from eaglet import embedded, llama_cpp
from eaglet.decode import FAST_TARGET_ENV, measure_drafter_pass, measure_pass_costs
from eaglet.drafter.files import load_drafter
from eaglet.target import cpu_description, f32_target_gguf, load_target, parse_dtype, resolve_target

MAX_Q = 8


def median_seconds(fn, repeats: int = 9) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[repeats // 2]


def read_bandwidth(gib: float = 1.0) -> float:
    """Bytes a second a streaming read of `gib` GiB gets (a sum over a fresh buffer, beyond the caches)."""
    x = torch.ones(int(gib * 2**30) // 4)
    return x.numel() * 4 / median_seconds(lambda: x.sum(), 5)


def matmul_flops(dtype: torch.dtype, n: int = 2048) -> float:
    """FLOP a second of a large square matrix product in `dtype`."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    return 2 * n**3 / median_seconds(lambda: a @ b, 5)


def eaglet_costs(model: torch.nn.Module, context: int, fast: bool) -> list[float]:
    before = os.environ.get(FAST_TARGET_ENV)
    os.environ[FAST_TARGET_ENV] = "1" if fast else "0"
    try:
        return measure_pass_costs(model, context, MAX_Q, repeats=9)
    finally:
        os.environ.pop(FAST_TARGET_ENV) if before is None else os.environ.__setitem__(FAST_TARGET_ENV, before)


def drafter_pass(path: str, dtype: torch.dtype, context: int) -> float:
    """Seconds of the drafter's cycle after one new position (`decode.measure_drafter_pass`)."""
    return measure_drafter_pass(load_drafter(path).to(dtype).eval(), context)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--drafter")
    ap.add_argument("--no-llama-cpp", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ref = resolve_target(None)
    bandwidth = read_bandwidth()
    print(
        f"# {cpu_description()}, {args.threads} thread(s), {args.context} cached tokens; streaming read "
        f"{bandwidth / 1e9:.1f} GB/s"
    )
    print("| dtype | engine | " + " | ".join(f"q={q} ms" for q in range(1, MAX_Q + 1)) + " | q=4 / q=1 |")
    print("| --- | --- | " + " | ".join("---" for _ in range(MAX_Q)) + " | --- |")
    for name in args.dtypes.split(","):
        dtype = parse_dtype(name)
        model = load_target(ref, dtype, torch.device("cpu"))
        params = sum(p.numel() for p in model.parameters())
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        flops = matmul_flops(dtype)
        floor = [max(weight_bytes / bandwidth, 2 * params * q / flops) for q in range(1, MAX_Q + 1)]
        rows = {
            "floor (weights read, FLOPs)": floor,
            "eaglet fast": eaglet_costs(model, args.context, True),
            "eaglet HF forward": eaglet_costs(model, args.context, False),
        }
        if args.drafter:
            rows["drafter pass"] = [drafter_pass(args.drafter, dtype, args.context)]
        for label, costs in rows.items():
            cells = [f"{1000 * c:.1f}" for c in costs] + ["" for _ in range(MAX_Q - len(costs))]
            ratio = f"{costs[3] / costs[0]:.2f}" if len(costs) > 3 else ""
            print(f"| {name} | {label} | " + " | ".join(cells) + f" | {ratio} |", flush=True)
        print(
            f"| {name} | (weights {weight_bytes / 2**20:.0f} MiB, matmul {flops / 1e9:.0f} GFLOP/s) | "
            + " | ".join("" for _ in range(MAX_Q))
            + " | |"
        )
        del model
    if not args.no_llama_cpp:
        gguf = f32_target_gguf(embedded.smollm2_gguf())
        prompt = torch.randint(100, 40000, (args.context,), generator=torch.Generator().manual_seed(0)).tolist()
        with llama_cpp.llama_server(gguf, threads=args.threads) as server:
            costs = server.pass_costs(prompt, prompt[::-1], range(1, MAX_Q + 1))
        print(
            f"| f32 | llama.cpp ({llama_cpp.server_version()}) | "
            + " | ".join(f"{c:.1f}" for c in costs)
            + f" | {costs[3] / costs[0]:.2f} |"
        )


if __name__ == "__main__":
    main()
