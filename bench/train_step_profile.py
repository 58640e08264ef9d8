"""Where a drafter training step spends its time, and how near it runs to the machine's limit.

    python bench/train_step_profile.py [--tokens 400 1600] [--batch 1] [--ttt 2] [--draft-vocab 8192]
        [--dtype auto|bf16|fp32] [--iters 5] [--threads N]

One training step exactly as `eaglet train` runs it (`training.loss.forward_stats` with its
teacher, backward, gradient clipping, AdamW) on random data of SmolLM2-135M's shapes (hidden
576, 9 / 3 heads, MLP 1536, target vocabulary 49152) at `eaglet train`'s defaults (draft
vocabulary 8192, TTT 2, teacher top-16 cached as training caches it, loss on every token). Prints,
side by side and measured in this one run:
- the machine's GEMM peak for the step's dtype (a large square matmul) and at the step's own
  shapes ([tokens, 576] x [576, 1536]-like products);
- tokens/s of the step, its FLOPs (counted by torch.utils.flop_counter: matmuls and attention,
  forward and backward) and the achieved GFLOP/s as a fraction of both peaks;
- the step's time by kind of work (torch.profiler, CPU self time): matrix products, TTT attention,
  elementwise / norms / activations, loss (softmax, cross-entropy), optimizer (AdamW, clipping),
  copies and the rest — where the time is, so the next change is aimed there.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils.flop_counter import FlopCounterMode

from eaglet.drafter import DraftConfig, Eagle3Draft, TeacherHead
from eaglet.target import cpu_description, fast_bf16
from eaglet.training.config import TrainConfig
from eaglet.training.data import Batch
from eaglet.training.config import Plan
from eaglet.training.loop import RunState, compiled, setup_optimizer
from eaglet.training.loss import forward_stats
from eaglet.training.teacher import TeacherSource

SMOLLM2 = dict(
    hidden_size=576,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    intermediate_size=1536,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    max_position_embeddings=8192,
    target_vocab_size=49152,
    aux_layer_ids=[2, 15, 27],
)
# Kinds of work, by the profiler's op names (first match wins).
KINDS = (
    ("matmul", ("mm", "addmm", "bmm", "matmul", "linear", "baddbmm", "dot")),
    ("attention", ("attention", "sdpa", "softmax_backward_data")),
    ("optimizer", ("adam", "_foreach", "clip_grad", "addcmul", "addcdiv", "lerp", "sqrt")),
    ("loss", ("log_softmax", "softmax", "cross_entropy", "nll", "logsumexp", "topk", "gather", "scatter")),
    ("copies", ("copy_", "to", "_to_copy", "cat", "clone", "contiguous", "index", "masked", "zero_", "fill_")),
    (
        "elementwise",
        (
            "mul",
            "add",
            "sub",
            "div",
            "pow",
            "rsqrt",
            "mean",
            "sum",
            "silu",
            "neg",
            "exp",
            "where",
            "rms_norm",
            "sigmoid",
            "native_layer_norm",
            "_fused_rms_norm",
        ),
    ),
)


def machine() -> str:
    """CPU model and its matrix ISA (what `--dtype auto` and every figure here depend on)."""
    return f"{cpu_description()}, {torch.get_num_threads()} threads"


def gemm_gflops(m: int, k: int, n: int, dtype: torch.dtype, seconds: float = 2.0) -> float:
    """Measured GFLOP/s of [m, k] @ [k, n] in `dtype`, best of repeated timed runs."""
    a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
    for _ in range(3):
        a @ b
    best, t_end = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * m * k * n / best / 1e9


def make_step(
    tokens: int, batch: int, ttt: int, draft_vocab: int, bf16: bool, compiled_step: bool = False, docs: int = 1
):
    """A closure running one training step of `eaglet train` on random data, and the batch's tokens.
    `docs` > 1: each row is a pack of that many samples of equal length (`eaglet train --pack-tokens`)."""
    torch.manual_seed(0)
    cfg = TrainConfig(ttt_steps=ttt, draft_vocab_size=draft_vocab, bf16=bf16, batch_size=batch)
    dcfg = DraftConfig(**SMOLLM2, draft_vocab_size=draft_vocab)
    draft = Eagle3Draft(dcfg).train()
    model = compiled(draft, compiled_step)  # as `eaglet train` runs its steps
    H, V = dcfg.hidden_size, dcfg.target_vocab_size
    head = TeacherHead(torch.nn.RMSNorm(H), torch.nn.Linear(H, V, bias=False))
    teachers = TeacherSource(head, draft.d2t, draft.t2d, cfg.teacher_top_k, False, bf16)
    b = Batch(
        torch.randint(0, V, (batch, tokens)),
        torch.randn(batch, tokens, 3 * H, dtype=torch.bfloat16),
        torch.randn(batch, tokens, H, dtype=torch.bfloat16),
        torch.ones(batch, tokens, dtype=torch.long),
        [tokens] * batch,
        list(range(batch)),
    )
    if docs > 1:
        part = tokens // docs
        b.docs = [[part] * (docs - 1) + [tokens - part * (docs - 1)]] * batch
        b.documents = (torch.arange(tokens) // part).clamp(max=docs - 1).expand(batch, -1).contiguous()
        b.positions = torch.arange(tokens) - b.documents * part
        b.indices = list(range(batch * docs))
    teachers(b)  # cached once per sample, as training caches it across epochs
    params, opt, _ = setup_optimizer(draft, cfg, RunState(Plan.first(cfg, 1000), None))  # eaglet train's own

    def step() -> dict[str, float]:
        """One step; wall seconds of its phases (the CPU runs them in order, so these add up)."""
        t0 = time.perf_counter()
        loss, _ = forward_stats(model, teachers, b, cfg, torch.device("cpu"), ttt, cfg.loss_on)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return {"forward": t1 - t0, "backward": t2 - t1, "optimizer": time.perf_counter() - t2}

    return step, batch * tokens


def count_flops(step) -> int:
    """Matmul and attention FLOPs of one step, forward and backward (the same compiled or not)."""
    step()
    with FlopCounterMode(display=False) as counter:
        step()
    return counter.get_total_flops()


def kind_of(name: str) -> str:
    op = name.removeprefix("aten::").lower()
    for kind, words in KINDS:
        if any(op == w or op.startswith(w) or w in op for w in words):
            return kind
    return "other"


def profile_kinds(step, iters: int) -> dict[str, float]:
    """Seconds per step by kind of work (CPU self time of aten ops)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(iters):
            step()
    kinds: dict[str, float] = defaultdict(float)
    for e in prof.key_averages():
        if e.key.startswith("aten::"):
            kinds[kind_of(e.key)] += e.self_cpu_time_total / 1e6 / iters
    return dict(kinds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[400, 1600], help="tokens per sample")
    ap.add_argument("--batch", type=int, default=1, help="samples per micro-batch (eaglet train's default 1)")
    ap.add_argument("--ttt", type=int, default=2)
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--dtype", default="auto", choices=("auto", "bf16", "fp32"))
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the drafter's forward (the warm-up steps compile; one shape throughout)",
    )
    ap.add_argument("--docs", type=int, default=1, help="samples packed in each row (eaglet train --pack-tokens)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    bf16 = fast_bf16("cpu") if args.dtype == "auto" else args.dtype == "bf16"
    dtype = torch.bfloat16 if bf16 else torch.float32
    print(f"machine: {machine()}; step dtype {'bf16 autocast' if bf16 else 'fp32'} (--dtype {args.dtype})")
    peak = gemm_gflops(2048, 2048, 2048, dtype)
    print(f"GEMM peak ({dtype}, 2048^3): {peak:,.0f} GFLOP/s")
    header = (
        f"{'tokens':>7} {'tok/s':>8} {'GFLOP/step':>10} {'GFLOP/s':>8} {'% peak':>6} {'shape GEMM':>10} "
        f"{'% shape':>7} | wall seconds per step by phase; then by kind of op"
    )
    print(header)
    for tokens in args.tokens:
        step, n = make_step(tokens, args.batch, args.ttt, args.draft_vocab, bf16, args.compile, args.docs)
        step()  # warm-up: optimizer state, kernel choice (and compiling)
        step()
        flops = count_flops(
            make_step(tokens, args.batch, args.ttt, args.draft_vocab, bf16, docs=args.docs)[0]
        )  # eager: countable
        phases: dict[str, float] = defaultdict(float)
        for _ in range(args.iters):
            for k, v in step().items():
                phases[k] += v / args.iters
        seconds = sum(phases.values())
        shape_peak = gemm_gflops(n, 576, 1536, dtype, seconds=0.5)
        kinds = profile_kinds(step, max(2, args.iters // 2))
        total = sum(kinds.values())
        split = "  ".join(f"{k} {v:.3f}s ({v / total:.0%})" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1]))
        rate = flops / seconds / 1e9
        print(
            f"{n:>7} {n / seconds:>8,.0f} {flops / 1e9:>10.1f} {rate:>8,.0f} {rate / peak:>6.1%} "
            f"{shape_peak:>10,.0f} {rate / shape_peak:>7.1%} | "
            + "  ".join(f"{k} {v:.3f}s" for k, v in phases.items()),
            flush=True,
        )
        print(f"{'':>60} | ops: {split}", flush=True)
    print(
        "GFLOP/step: matmul and attention FLOPs of the step, forward and backward (torch.utils.flop_counter); "
        "% peak: achieved / the 2048^3 GEMM; shape GEMM: [tokens, 576] x [576, 1536] GFLOP/s; by kind: profiler "
        "CPU self time, whose total exceeds the wall time by the profiler's own overhead"
    )


if __name__ == "__main__":
    main()
