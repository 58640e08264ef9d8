"""Drafter training throughput and peak memory: efficient TTT attention vs the naive full mask.

    python bench/train_throughput.py [--seq 256 1024] [--ttt 1 7] [--iters 2] [--bf16]

SmolLM2-135M shapes (hidden 576, 9 heads / 3 kv heads of 64, MLP 1536, target vocab 49152,
draft vocab 32000), random weights and data, batch 1. One timed training step = teacher
(final norm + lm_head), TTT unroll, loss, backward, AdamW step. Each configuration runs in a
fresh subprocess so peak memory is its own: `torch.cuda.max_memory_allocated` on GPU; on CPU
the peak RSS (/proc/self/status VmHWM, reset through /proc/self/clear_refs after setup) minus
the RSS after setup. Prints tokens/s and peak memory side by side, and efficient/naive ratios.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from ttt_reference import NaiveTTTAttention  # noqa: E402

from eaglet.drafter import DiagonalTTTAttention, DraftConfig, Eagle3Draft, make_teacher, ttt_loss  # noqa: E402

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
    draft_vocab_size=32000,
    aux_layer_ids=[2, 15, 27],
)
IMPLS = {"efficient": DiagonalTTTAttention, "naive": NaiveTTTAttention}


def proc_status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def reset_peak_rss() -> bool:
    """Writing 5 to clear_refs resets VmHWM to the current RSS (Linux >= 4.0)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def worker(impl: str, ttt: int, seq: int, iters: int, bf16: bool) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    cfg = DraftConfig(**SMOLLM2)
    model = Eagle3Draft(cfg).to(device)
    H, V = cfg.hidden_size, cfg.target_vocab_size
    norm, head = torch.nn.RMSNorm(H).to(device), torch.nn.Linear(H, V, bias=False).to(device)
    ids = torch.randint(0, V, (1, seq), device=device)
    aux = torch.randn(1, seq, 3 * H, device=device)
    last = torch.randn(1, seq, H, device=device)
    mask = torch.ones(1, seq, dtype=torch.long, device=device)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            teacher = make_teacher(last, norm, head, model.d2t, model.t2d)
            loss, _ = ttt_loss(model(ids, aux, steps=ttt, attention=IMPLS[impl]), teacher, mask)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # warm-up: allocates optimizer state, so the peak below is the step itself
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        reset_peak_rss()
        base = proc_status_kib("VmRSS") * 1024
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = proc_status_kib("VmHWM") * 1024 - base
    seconds = (time.perf_counter() - t0) / iters
    return {
        "impl": impl,
        "ttt": ttt,
        "seq": seq,
        "tok_s": seq / seconds,
        "step_s": seconds,
        "peak_mib": peak / 2**20,
        "device": device.type,
    }


def run_config(impl: str, ttt: int, seq: int, iters: int, bf16: bool) -> dict:
    cmd = [sys.executable, __file__, "--worker", impl, str(ttt), str(seq), "--iters", str(iters)]
    cmd += ["--bf16"] if bf16 else []
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        return {"impl": impl, "ttt": ttt, "seq": seq, "error": res.stderr.strip().splitlines()[-1:]}
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--seq", type=int, nargs="+", default=None, help="sequence lengths (default CPU 256 1024, GPU 2048 8192)"
    )
    ap.add_argument("--ttt", type=int, nargs="+", default=[1, 7])
    ap.add_argument("--iters", type=int, default=2)
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--worker", nargs=3, metavar=("IMPL", "TTT", "SEQ"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        impl, ttt, seq = args.worker
        print(json.dumps(worker(impl, int(ttt), int(seq), args.iters, args.bf16)))
        return
    seqs = args.seq or ([2048, 8192] if torch.cuda.is_available() else [256, 1024])
    print(
        f"{'ttt':>3} {'seq':>6} | {'efficient tok/s':>15} {'peak MiB':>9} | {'naive tok/s':>11} {'peak MiB':>9} | "
        f"{'speed x':>7} {'memory x':>8}"
    )
    for ttt in args.ttt:
        for seq in seqs:
            e, n = (run_config(impl, ttt, seq, args.iters, args.bf16) for impl in ("efficient", "naive"))
            if "error" in e or "error" in n:
                print(f"{ttt:>3} {seq:>6} | error: {e.get('error') or n.get('error')}")
                continue
            print(
                f"{ttt:>3} {seq:>6} | {e['tok_s']:>15,.0f} {e['peak_mib']:>9,.0f} | {n['tok_s']:>11,.0f} "
                f"{n['peak_mib']:>9,.0f} | {e['tok_s'] / n['tok_s']:>7.2f} {n['peak_mib'] / max(e['peak_mib'], 1):>8.2f}",
                flush=True,
            )
    print(
        "speed x = efficient tok/s / naive tok/s; memory x = naive peak / efficient peak "
        f"({'GPU allocated' if torch.cuda.is_available() else 'CPU peak RSS delta'})"
    )


if __name__ == "__main__":
    main()
