"""The compact layout against v1 on the same samples, side by side: bytes per token (measured,
and computed from the layout at H = 7168), extraction and training tokens/s, held-out
acceptance per TTT step (acc@1..K) and simulated tau after the same training steps (same seed,
same split), and how often the stored top-K holds the teacher training uses exactly.

    python bench/compact.py PREPARED --out runs/bench-compact --extract-samples 24 --steps 400

PREPARED is an `eaglet prepare` folder. The bench extracts it as v1 (OUT/v1, reused when there),
converts that to compact (OUT/compact), extracts the first --extract-samples samples both ways
for the extraction speed, then trains one drafter on each (OUT/train_v1, OUT/train_compact)
with the demo recipe's training settings. Writes OUT/results.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from eaglet import formats
from eaglet.convert import convert
from eaglet.prepare import prepare  # noqa: F401  (PREPARED comes from it)
from eaglet.extract import extract
from eaglet.training.checkpoints import iter_metrics
from eaglet.dataset import open_dataset
from eaglet.training.loop import train
from eaglet.options import ConvertOptions, ExtractOptions, TrainOptions

TRAIN = dict(
    lr=2e-3,
    ttt_steps=2,
    draft_vocab_size=8192,
    teacher_top_k=16,
    loss_on="all",
    eval_fraction=0.1,
    batch_size=1,
    seed=0,
    log_every=10,
)


def bytes_per_token(folder: Path) -> float:
    listing = formats.list_dataset_files(folder)
    lengths = formats.read_sample_lengths(folder / formats.SAMPLE_LENGTHS_FILE)
    return sum(p.stat().st_size for _, p in listing.files) / sum(lengths[i] for i, _ in listing.files)


def layout_bytes(hidden: int, top_k: int) -> dict[str, float]:
    """Bytes per token from the layouts' definitions (tensor payload only)."""
    v1 = formats.v1_min_bytes_per_token(hidden)
    compact = 3 * hidden * 3 / 4 + 3 * hidden / formats.FP6_GROUP * 2 + top_k * (4 + 2) + 4 + 1
    return {"v1": v1, "compact": compact, "ratio": compact / v1}


def prepared_subset(prepared: Path, out: Path, n: int) -> Path:
    """The first n samples of an `eaglet prepare` folder, as a folder of its own."""
    if out.exists():
        return out
    out.mkdir(parents=True)
    lines = (prepared / formats.PREPARED_FILE).read_text().splitlines(keepends=True)[:n]
    (out / formats.PREPARED_FILE).write_text("".join(lines))
    for name in (formats.PREPARE_CONFIG_FILE, formats.TOKEN_FREQ_FILE):
        shutil.copy(prepared / name, out / name)
    return out


def extraction_rate(prepared: Path, out: Path, layout: str) -> float:
    if out.exists():
        shutil.rmtree(out)
    t0 = time.time()
    s = extract(ExtractOptions(prepared=prepared, out=out, layout=layout), show_progress=False)
    return s.tokens / (time.time() - t0)


def teacher_coverage(compact: Path, v1: Path, samples: int = 10) -> dict[str, float]:
    """Over `samples` files: how often the stored top-K yields exactly the top-16 teacher that
    training computes from v1's last state (ids and order), and how often its argmax agrees."""
    from transformers import AutoModelForCausalLM

    from eaglet.drafter import build_draft_vocab, make_teacher, make_teacher_head, teacher_from_top_k
    from eaglet.target import resolve_target

    ds = open_dataset(v1)
    model = AutoModelForCausalLM.from_pretrained(resolve_target(ds.config.get("target_path")).path, dtype=torch.float32)
    head = make_teacher_head(model, formats.LAST_STATE_PRE_NORM)
    d2t, t2d = build_draft_vocab(
        ds.token_freq, model.config.vocab_size, min(TRAIN["draft_vocab_size"], model.config.vocab_size)
    )
    exact = argmax = total = 0
    cfiles = dict(formats.list_dataset_files(compact).files)
    for i in sorted(ds.files)[:samples]:
        last = formats.read_v1_sample(ds.files[i]).hidden_states[-1].float()[None]
        ref = make_teacher(last, head.final_norm, head.lm_head, d2t, t2d, top_k=TRAIN["teacher_top_k"])
        st = formats.read_safetensors(cfiles[i])
        got = teacher_from_top_k(
            st["teacher_ids"][None], st["teacher_log_probs"][None], d2t, t2d, TRAIN["teacher_top_k"]
        )
        exact += int((got.ids == ref.ids).all(-1).sum())
        argmax += int(((got.argmax == ref.argmax) | ~ref.in_draft).sum())
        total += ref.ids.shape[1]
    return {"positions": total, "exact_top16": exact / total, "argmax_agrees": argmax / total}


def final_eval(run: Path) -> dict[str, Any]:
    rows = [r for r in iter_metrics(run) if r.get("split") == "eval"]
    train_rows = [r for r in iter_metrics(run) if r.get("split") == "train"]
    last = rows[-1]
    return {
        "step": last["step"],
        "acc": last["acc"],
        "tau": last["tau"],
        "train_tokens": last["train_tokens"],
        "train_seconds": last["train_seconds"],
        "tokens_per_s": last["train_tokens"] / max(last["train_seconds"], 1e-9),
        "curve": [(r["train_tokens"], r["acc"][0]) for r in rows],
        "train_rows": len(train_rows),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("prepared", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--extract-samples", type=int, default=24)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--evals", type=int, default=4)
    args = ap.parse_args()
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}

    v1, compact = out / "v1", out / "compact"
    if not (v1 / formats.DATA_CONFIG_FILE).exists() or len(formats.list_v1_files(v1)) == 0:
        extract(ExtractOptions(prepared=args.prepared, out=v1))
    t0 = time.time()  # a finished conversion is reused (convert skips complete files), a killed one finished
    s = convert(ConvertOptions(src=v1, out=compact, layout="compact"))
    if s.written:
        results["convert_tokens_per_s"] = s.tokens / (time.time() - t0)
    cfg = open_dataset(v1).config
    hidden = cfg["hidden_size"]
    options = {**TRAIN, "draft_vocab_size": min(TRAIN["draft_vocab_size"], cfg["vocab_size"])}
    results["bytes_per_token"] = {"v1": bytes_per_token(v1), "compact": bytes_per_token(compact)}
    results["bytes_per_token"]["ratio"] = results["bytes_per_token"]["compact"] / results["bytes_per_token"]["v1"]
    results["layout_bytes"] = {str(h): layout_bytes(h, 16) for h in (hidden, 4096, 7168)}
    results["teacher"] = teacher_coverage(compact, v1)

    sub = prepared_subset(args.prepared, out / "prep_subset", args.extract_samples)
    results["extract_tokens_per_s"] = {
        name: extraction_rate(sub, out / f"extract_{name}", name) for name in ("v1", "compact")
    }

    for name, data in (("v1", v1), ("compact", compact)):
        run = out / f"train_{name}"
        if not (run / "metrics.jsonl").exists() or not any(
            r.get("step") == args.steps and r.get("split") == "eval" for r in iter_metrics(run)
        ):
            shutil.rmtree(run, ignore_errors=True)
            train(TrainOptions(dataset_dir=data, out_dir=run, total_steps=args.steps, evals=args.evals, **options))
        results[f"train_{name}"] = final_eval(run)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    print_table(results)


def print_table(r: dict[str, Any]) -> None:
    b, e, tv, tc = r["bytes_per_token"], r["extract_tokens_per_s"], r["train_v1"], r["train_compact"]
    rows = [
        ("bytes/token (measured)", f"{b['v1']:,.0f}", f"{b['compact']:,.0f}", f"{b['ratio']:.3f}x"),
        *[
            (f"bytes/token at H = {h} (layout)", f"{x['v1']:,.0f}", f"{x['compact']:,.0f}", f"{x['ratio']:.3f}x")
            for h, x in r["layout_bytes"].items()
        ],
        ("extraction tokens/s", f"{e['v1']:,.0f}", f"{e['compact']:,.0f}", f"{e['compact'] / e['v1']:.2f}x"),
        (
            "training tokens/s",
            f"{tv['tokens_per_s']:,.0f}",
            f"{tc['tokens_per_s']:,.0f}",
            f"{tc['tokens_per_s'] / tv['tokens_per_s']:.2f}x",
        ),
        ("training tokens", f"{tv['train_tokens']:,}", f"{tc['train_tokens']:,}", ""),
        *[
            (f"held-out acc@{k + 1}", f"{a:.4f}", f"{c:.4f}", f"{c - a:+.4f}")
            for k, (a, c) in enumerate(zip(tv["acc"], tc["acc"]))
        ],
        ("simulated tau", f"{tv['tau']:.4f}", f"{tc['tau']:.4f}", f"{tc['tau'] - tv['tau']:+.4f}"),
    ]
    print(f"{'':34s} {'v1':>10s} {'compact':>10s} {'compact vs v1':>14s}")
    for name, a, c, d in rows:
        print(f"{name:34s} {a:>10s} {c:>10s} {d:>14s}")
    t = r["teacher"]
    print(
        f"stored top-16 gives training's exact top-16 teacher on {t['exact_top16']:.1%} of {t['positions']} "
        f"positions; its argmax agrees on {t['argmax_agrees']:.1%}"
    )


if __name__ == "__main__":
    main()
