"""vLLM beside eaglet, on this machine: extraction throughput of both engines on the same samples,
and a drafter served by vLLM beside eaglet's own decoding of it, with both engines' pass costs.

    python bench/vllm_engines.py extract [--prepared DIR | --samples 64] [--dtype fp32] [--out DIR]
    python bench/vllm_engines.py serve RUN [RUN ...] [--prompts mtbench,humaneval] [--num-prompts 40]
        [--max-new-tokens 128] [--dtype auto] [--threads auto] [--out DIR]
    python bench/vllm_engines.py costs [--max-q 16] [--dtype fp32] [--threads 2]

extract: `eaglet extract` with --engine hf and --engine vllm on the same prepared samples, one after
  the other (the dataset of each removed after), tok/s with vLLM's start-up left out and said apart.
serve: per drafter run, ONE `eaglet eval` run (every prompt decoded by every method in a rotating
  order): eaglet's plain, its decoding of the drafter alone and in the hybrid, vLLM plain, vLLM's
  n-gram and vLLM serving the drafter; speedups of vLLM's methods are over vLLM plain, eaglet's over
  eaglet's plain. Prints each set's table and writes eval.json / eval.png into OUT/<run name>/.
costs: the pass-cost curves of both engines over 1..max-q new tokens after a 300-token cached
  prompt: eaglet's target (`decode.measure_pass_costs`) and vLLM's plain engine
  (`VllmEngine.pass_costs`: a step without a request's fixed costs), and what a one-token request
  costs vLLM whole.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch

from eaglet.decode import measure_pass_costs
from eaglet.evaluate import evaluate
from eaglet.extract import extract
from eaglet.prepare import prepare
from eaglet.target import cpu_description, dtype_name, load_target, parse_dtype, resolve_target
from eaglet.vllm_engine import EngineOptions, installed_version, vllm_engine
from eaglet.options import EvalOptions, ExtractOptions, PrepareOptions


def bench_extract(args: argparse.Namespace) -> None:
    work = Path(tempfile.mkdtemp(prefix="bench-vllm-extract-"))
    prepared = Path(args.prepared) if args.prepared else work / "prepared"
    if not args.prepared:
        prepare(
            PrepareOptions(
                target=None, data="sharegpt", out=prepared, num_samples=args.samples, max_length=args.max_length
            )
        )
    rows = []
    for engine in ("hf", "vllm"):
        out = work / f"data-{engine}"
        t0 = time.time()
        s = extract(ExtractOptions(prepared=prepared, out=out, dtype=args.dtype, engine=engine), show_progress=False)
        rows.append((engine, s.tokens, time.time() - t0, s.engine_start_s, s.tokens_per_s))
        shutil.rmtree(out)
    print(f"# extraction, {cpu_description()}, dtype {args.dtype}, vLLM {installed_version()}")
    print("| engine | tokens | wall s | engine start s | tok/s (start-up left out) |")
    print("| --- | --- | --- | --- | --- |")
    for engine, tokens, wall, start, rate in rows:
        print(f"| {engine} | {tokens:,} | {wall:.1f} | {start:.1f} | {rate:,.0f} |")
    print(f"vLLM / eaglet: {rows[1][4] / rows[0][4]:.2f}x")
    shutil.rmtree(work, ignore_errors=True)


def bench_serve(args: argparse.Namespace) -> None:
    for run in map(Path, args.runs):
        family = json.loads((run / "train_config.json").read_text()).get("drafter", "eagle3")
        own = {"eagle3": "chain", "p-eagle": "p-eagle", "dflash": "dflash"}[family]
        methods = [own, "hybrid", "vllm", "vllm-ngram", f"vllm-{family}"]
        out = Path(args.out) / run.name
        result = evaluate(
            EvalOptions(
                drafter_path=run,
                prompt_sets=args.prompts.split(","),
                num_prompts=args.num_prompts,
                methods=methods,
                max_new_tokens=args.max_new_tokens,
                dtype=args.dtype,
                threads=args.threads,
                out=out,
            )
        )
        print(f"# {run} ({family}), {cpu_description()}, vLLM {installed_version()}")
        print(result.table())
        costs = result.config.get("vllm", {}).get("pass_costs", {})
        if costs:
            steps = " ".join(
                f"q={q}: {1000 * v:.1f}" for q, v in sorted(costs["step_s"].items(), key=lambda x: int(x[0]))
            )
            print(
                f"vLLM plain engine, ms a step: {steps}; a one-token request whole: {1000 * costs['request_s'][1]:.1f}"
            )
        print(f"eaglet pass costs (ms, 1.. tokens): {[round(1000 * c, 1) for c in result.config['pass_costs_s']]}")


def bench_costs(args: argparse.Namespace) -> None:
    sizes = list(range(1, args.max_q + 1))
    dtype = parse_dtype(args.dtype, "cpu")
    torch.set_num_threads(args.threads)
    ref = resolve_target(None)
    model = load_target(ref, dtype, torch.device("cpu"))
    ours = measure_pass_costs(model, max_q=args.max_q)
    prompt = torch.randint(100, 40000, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    options = EngineOptions(dtype=dtype_name(dtype), max_model_len=2048, threads=args.threads, cpu_kv_cache_gib=1)
    with vllm_engine(ref.path, options) as engine:
        theirs = engine.pass_costs(prompt, prompt, sizes)
    print(
        f"# pass costs after a 300-token cached prompt, {cpu_description()}, {args.dtype}, {args.threads} threads, "
        f"vLLM {installed_version()}"
    )
    print("| new tokens | eaglet ms | eaglet / its 1 | vLLM step ms | vLLM / its 1 | vLLM request ms |")
    print("| --- | --- | --- | --- | --- | --- |")
    for q in sizes:
        step, request = theirs["step_s"][q], theirs["request_s"][q]
        print(
            f"| {q} | {1000 * ours[q - 1]:.1f} | {ours[q - 1] / ours[0]:.2f} | {1000 * step:.1f} | "
            f"{step / theirs['step_s'][1]:.2f} | {1000 * request:.1f} |"
        )
    print(f"vLLM decode step: {1000 * theirs['decode_step_s']:.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    e = sub.add_parser("extract")
    e.add_argument("--prepared")
    e.add_argument("--samples", type=int, default=64)
    e.add_argument("--max-length", type=int, default=1024)
    e.add_argument("--dtype", default="fp32")
    s = sub.add_parser("serve")
    s.add_argument("runs", nargs="+")
    s.add_argument("--prompts", default="mtbench,humaneval")
    s.add_argument("--num-prompts", type=int, default=40)
    s.add_argument("--max-new-tokens", type=int, default=128)
    s.add_argument("--dtype", default="auto")
    s.add_argument("--threads", default="auto", type=lambda t: t if t == "auto" else int(t))
    s.add_argument("--out", default="runs/bench-vllm")
    c = sub.add_parser("costs")
    c.add_argument("--max-q", type=int, default=16)
    c.add_argument("--dtype", default="fp32")
    c.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    {"extract": bench_extract, "serve": bench_serve, "costs": bench_costs}[args.what](args)


if __name__ == "__main__":
    main()
