"""`eaglet check` read throughput vs a plain sequential `torch.load` loop over the same files.

    python bench/check_throughput.py [--dir DIR] [--gb 1.1] [--hidden-size 576] [--workers N]

Generates (or reuses, in --dir) a synthetic v1 dataset of random bf16 states, H=576 (SmolLM2),
4 states per token, lengths 256..2048, with consistent side files and each file's state
signatures recorded as extraction records them; then times
(a) a plain loop `torch.load(f, weights_only=True)` over every file,
(b) `check_dataset(dir, use_target=False)`: schema + values + side files + every file's states
    against their recorded signatures, and
(c) the same check with the signatures moved aside (what it costs without them).
Page cache: it cannot be dropped without root, so every file is read once first and all
runs read from memory; that measures the CPU cost of the check, which is what differs
between them (a cold disk is the same for all). Each is run twice, in two orders, and MB/s is
printed side by side with the ratios.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from eaglet import formats
from eaglet.check import check_dataset
from eaglet.formats import V1Sample
from eaglet.options import CheckOptions


def generate(
    out: Path, gb: float, hidden: int, vocab: int = 49152, layer_ids: tuple[int, ...] = (2, 15, 27, 30), seed: int = 0
) -> None:
    g = torch.Generator().manual_seed(seed)
    per_token = len(layer_ids) * hidden * 2 + 16
    target_tokens = int(gb * 1e9 / per_token)
    lengths: dict[int, int] = {}
    freq: dict[int, int] = {}
    total = masked_total = i = 0
    signed = []  # recorded once data_config.json, which keys the log, is written
    while total < target_tokens:
        T = int(torch.randint(256, 2049, (1,), generator=g))
        ids = torch.randint(0, vocab, (T,), generator=g)
        mask = torch.zeros(T, dtype=torch.long)
        mask[T // 3 :] = 1  # one assistant span, as a real chat would have
        states = [
            torch.randn(T, hidden, generator=g).mul_(0.5 * (k + 1)).to(torch.bfloat16) for k in range(len(layer_ids))
        ]
        signed.append((i, formats.state_signature(states), formats.token_digest(ids, mask)))
        formats.write_v1_sample(out, i, V1Sample(ids, states, mask), fsync=False)
        u, c = torch.unique(ids[mask == 1], return_counts=True)
        for t, n in zip(u.tolist(), c.tolist()):
            freq[t] = freq.get(t, 0) + n
        lengths[i] = T
        total += T
        masked_total += int(mask.sum())
        i += 1
    formats.write_sample_lengths(out / formats.SAMPLE_LENGTHS_FILE, lengths)
    formats.write_token_freq(out / formats.TOKEN_FREQ_FILE, freq)
    formats.write_json_atomic(
        out / formats.DATA_CONFIG_FILE,
        {
            "format": "speculators-v1",
            "hidden_size": hidden,
            "vocab_size": vocab,
            "layer_ids": list(layer_ids),
            "num_hidden_layers": layer_ids[-1],
            "last_hidden_state": "pre_norm",
            "hidden_states_dtype": "bfloat16",
            "num_samples": len(lengths),
            "num_tokens": total,
            "num_masked_tokens": masked_total,
            "seq_length": max(lengths.values()),
            "rows_per_folder": formats.ROWS_PER_FOLDER,
            "state_signatures": formats.SIGNATURES_DIR,
            "signature_key": "be0c4b17be0c4b17",  # what extraction draws at random
        },
    )
    log = formats.signature_log(out, "shard_0_of_1")
    for i, signature, tokens in signed:
        log.record(i, signature, tokens)


def plain_loop(files: list[Path]) -> float:
    t0 = time.perf_counter()
    for f in files:
        torch.load(f, map_location="cpu", weights_only=True)
    return time.perf_counter() - t0


def timed_check(folder: Path, workers: int | None, signed: bool = True) -> float:
    """Seconds of a whole check; `signed` False: with the recorded signatures moved aside, and
    data_config.json without the fields that record them (a dataset made without them)."""
    aside = folder.with_name(folder.name + "-signatures")
    config = formats.read_json(folder / formats.DATA_CONFIG_FILE)
    if not signed:
        (folder / formats.SIGNATURES_DIR).rename(aside)
        unsigned = {k: v for k, v in config.items() if k not in ("state_signatures", "signature_key")}
        formats.write_json_atomic(folder / formats.DATA_CONFIG_FILE, unsigned)
    try:
        return checked_seconds(folder, workers)
    finally:
        if not signed:
            aside.rename(folder / formats.SIGNATURES_DIR)
            formats.write_json_atomic(folder / formats.DATA_CONFIG_FILE, config)


def checked_seconds(folder: Path, workers: int | None) -> float:
    t0 = time.perf_counter()
    report = check_dataset(CheckOptions(path=folder, use_target=False, workers=workers))
    seconds = time.perf_counter() - t0
    if report.errors:
        raise SystemExit(f"the synthetic dataset should be clean: {report.lines()[-12:]}")
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=None, help="dataset folder to create or reuse (default: a temp folder, deleted)")
    ap.add_argument("--gb", type=float, default=1.1, help="dataset size to generate (default 1.1)")
    ap.add_argument("--hidden-size", type=int, default=576)
    ap.add_argument("--workers", type=int, default=None, help="check's reader threads (default: its own)")
    args = ap.parse_args()

    folder = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="eaglet-check-bench-"))
    try:
        if not (folder / formats.DATA_CONFIG_FILE).exists():
            t0 = time.perf_counter()
            generate(folder, args.gb, args.hidden_size)
            print(f"generated {folder} in {time.perf_counter() - t0:.1f} s")
        files = [p for _, p in sorted(formats.list_v1_files(folder).items())]
        mb = sum(p.stat().st_size for p in files) / 1e6
        for p in files:  # warm the page cache so both runs read from memory (see the docstring)
            with open(p, "rb") as f:
                while f.read(1 << 24):
                    pass
        print(
            f"{len(files)} files, {mb:,.0f} MB, {os.cpu_count()} CPUs, torch {torch.__version__}, "
            f"{torch.get_num_threads()} intra-op threads"
        )
        runs = {
            "plain": lambda: plain_loop(files),
            "check": lambda: timed_check(folder, args.workers),
            "unsigned": lambda: timed_check(folder, args.workers, signed=False),
        }
        rows = []
        for order in (("plain", "check", "unsigned"), ("unsigned", "check", "plain")):
            rows.append((order, {name: runs[name]() for name in order}))
        print(
            f"{'order':<24}{'torch.load MB/s':>16}{'check MB/s':>12}{'unsigned MB/s':>15}"
            f"{'check/load':>12}{'signed/unsigned':>17}"
        )
        for order, t in rows:
            print(
                f"{'-'.join(order):<24}{mb / t['plain']:>16,.0f}{mb / t['check']:>12,.0f}{mb / t['unsigned']:>15,.0f}"
                f"{t['plain'] / t['check']:>12.2f}{t['unsigned'] / t['check']:>17.2f}"
            )
    finally:
        if not args.dir:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
