"""Kimi-K2.5 at its real head shapes: reading the heads alone, and what a training step needs.

    python bench/kimi_heads.py write --work DIR
    python -m torch.distributed.run --standalone --nproc_per_node 2 bench/kimi_heads.py ranks --work DIR [--cold]
    python bench/kimi_heads.py train --work DIR [--iters 2]

`write` makes DIR/heads, a head-only Kimi-K2.5 folder: its config (a `kimi_k25` wrapper around the
DeepSeek-V3 text config), an index that also places layer tensors in shards the folder lacks, and
only the two shards (of 64) that hold the heads, random bf16 values: embeddings and LM head
163,840 x 7,168 each (4.7 GB) and the final norm. It is skipped when the folder is complete.
Then DIR/data, 8 samples of 256 tokens at hidden size 7,168 in eaglet's v1 layout recording that
folder as its target, checked with `eaglet check --no-target`.

`ranks`, under torchrun (gloo): each rank reads the heads as offline `eaglet train` does
(`load_heads(resolve_target(folder), None, cpu)`); rank 0 prints each rank's RSS before and after,
its peak during the read, the heads' bf16 bytes, RSS after / heads bytes (the goal: at most 1.5)
and the read's GB/s. `--cold` first drops the head shards from the page cache (posix_fadvise).

`train` first computes what `eaglet train` at real width needs (drafter of `DraftConfig.from_target`:
64 heads x 128, MLP 18,432, draft vocabulary 32,000; fp32 weights, grads and AdamW moments, frozen
fp32 embeddings, the teacher's reordered bf16 LM head, activations) against MemAvailable. It runs the largest
configuration that fits, in a subprocess watched so it is killed before it could push the machine
into the OOM killer: 3 steps of `eaglet train`; else one real-width forward + backward of the
drafter and its teacher on one 256-token sample per iteration (no optimizer state; the frozen
embeddings and the teacher's LM head kept in bf16, as read); else the forward alone. It prints
which one ran, its peak RSS and seconds per step, and what the full one would need.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from eaglet import formats
from eaglet.heads import INDEX_FILE, heads_summary, locate_heads
from eaglet.target import cpu_description, load_heads, resolve_target

GB = 1e9
GIB = 1 << 30
VOCAB, HIDDEN, LAYERS = 163840, 7168, 61
DRAFT_VOCAB = 32000
SHARDS = 64
SEQ, SAMPLES, TTT_STEPS = 256, 8, 2
LAYER_IDS = [2, 30, 58, 61]  # three aux states, then the last layer's (hf_hidden_states ids)
EMBED, NORM, LM_HEAD = (
    "language_model.model.embed_tokens.weight",
    "language_model.model.norm.weight",
    "language_model.lm_head.weight",
)
FIRST_SHARD, LAST_SHARD = f"model-00001-of-{SHARDS:05d}.safetensors", f"model-{SHARDS:05d}-of-{SHARDS:05d}.safetensors"
# Layer tensors the index names in shards this folder does not have: a head-only download.
ABSENT_TENSORS = {
    f"language_model.model.layers.{i}.self_attn.o_proj.weight": f"model-{i + 2:05d}-of-{SHARDS:05d}.safetensors"
    for i in range(3)
}
HEADROOM = 2 * GIB  # kept free for the machine's other work when deciding what to start
MEM_FLOOR = 1 * GIB  # a watched run is killed when the machine's MemAvailable falls below this

KIMI_TEXT_CONFIG: dict[str, Any] = {
    "model_type": "deepseek_v3",
    "architectures": ["DeepseekV3ForCausalLM"],
    "hidden_size": HIDDEN,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "n_routed_experts": 384,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 1,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "vocab_size": VOCAB,
    "rms_norm_eps": 1e-5,
    "rope_theta": 50000.0,
    "rope_scaling": {
        "type": "yarn",
        "factor": 64.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    "max_position_embeddings": 262144,
    "tie_word_embeddings": False,
}
KIMI_CONFIG = {
    "model_type": "kimi_k25",
    "architectures": ["KimiK25ForConditionalGeneration"],
    "tie_word_embeddings": False,
    "text_config": KIMI_TEXT_CONFIG,
}


def heads_dir(work: Path) -> Path:
    return work / "heads"


def data_dir(work: Path) -> Path:
    return work / "data"


# ---------------------------------------------------------------------------------------------
# Memory figures (/proc)
# ---------------------------------------------------------------------------------------------


def proc_kib(path: str, field: str) -> int:
    """A `Field: N kB` line of a /proc file, in KiB (0 when absent)."""
    for line in Path(path).read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def rss() -> int:
    return proc_kib("/proc/self/status", "VmRSS") * 1024


def peak_rss() -> int:
    return proc_kib("/proc/self/status", "VmHWM") * 1024


def mem_available() -> int:
    return proc_kib("/proc/meminfo", "MemAvailable") * 1024


def reset_peak_rss() -> None:
    """Writing 5 to clear_refs resets VmHWM to the current RSS (Linux >= 4.0)."""
    Path("/proc/self/clear_refs").write_text("5")


def gb(n: float) -> str:
    return f"{n / GB:.2f} GB"


# ---------------------------------------------------------------------------------------------
# write: the head-only folder and a small dataset
# ---------------------------------------------------------------------------------------------


def random_bf16(rows: int, cols: int, std: float, seed: int) -> torch.Tensor:
    """[rows, cols] bf16 normal values, generated in place: one copy, never an fp32 one."""
    g = torch.Generator().manual_seed(seed)
    return torch.empty(rows, cols, dtype=torch.bfloat16).normal_(0.0, std, generator=g)


def save_shard(folder: Path, shard: str, tensors: dict[str, torch.Tensor]) -> None:
    """One safetensors shard, written under a temporary name and renamed: complete or absent."""
    tmp = folder / f"{shard}{formats.TMP_MARK}"
    save_file(tensors, tmp, metadata={"format": "pt"})
    os.replace(tmp, folder / shard)


def heads_complete(folder: Path) -> bool:
    """The folder has its config, index and both head shards, with the heads at Kimi's shapes."""
    try:
        location = locate_heads(folder)
    except (OSError, ValueError):
        return False
    shapes = {role: t.shape for role, t in location.tensors.items()}
    return shapes == {"embeddings": (VOCAB, HIDDEN), "final_norm": (HIDDEN,), "lm_head": (VOCAB, HIDDEN)}


def write_heads(folder: Path) -> None:
    """Config, index and the two head shards (one big tensor in memory at a time)."""
    folder.mkdir(parents=True, exist_ok=True)
    save_shard(folder, FIRST_SHARD, {EMBED: random_bf16(VOCAB, HIDDEN, 0.02, seed=1)})
    lm_head = random_bf16(VOCAB, HIDDEN, 0.02, seed=2)
    norm = (1.0 + 0.02 * torch.randn(HIDDEN, generator=torch.Generator().manual_seed(3))).to(torch.bfloat16)
    save_shard(folder, LAST_SHARD, {NORM: norm, LM_HEAD: lm_head})
    del lm_head
    weight_map = {EMBED: FIRST_SHARD, NORM: LAST_SHARD, LM_HEAD: LAST_SHARD, **ABSENT_TENSORS}
    index = {"metadata": {"total_size": 2 * VOCAB * HIDDEN * 2 + HIDDEN * 2}, "weight_map": weight_map}
    formats.write_json_atomic(folder / INDEX_FILE, index)
    formats.write_json_atomic(folder / "config.json", KIMI_CONFIG)


def data_config(folder: Path, lengths: dict[int, int], masked: int) -> formats.DataConfig:
    ref = resolve_target(str(folder))
    return formats.data_config_from(
        {
            "format": formats.FORMAT_V1,
            "target": ref.name,
            "target_path": ref.path,
            "target_revision": ref.revision,
            "architecture": KIMI_CONFIG["architectures"][0],
            "model_type": KIMI_TEXT_CONFIG["model_type"],
            "num_hidden_layers": LAYERS,
            "hidden_size": HIDDEN,
            "vocab_size": VOCAB,
            "layer_ids": LAYER_IDS,
            "aux_layer_ids": LAYER_IDS[:-1],
            "layer_id_convention": formats.LAYER_ID_CONVENTION,
            "last_hidden_state": formats.LAST_STATE_PRE_NORM,
            "compute_dtype": "bfloat16",
            "hidden_states_dtype": "bfloat16",
            "max_length": SEQ,
            "seq_length": max(lengths.values()),
            "num_samples": len(lengths),
            "num_tokens": sum(lengths.values()),
            "num_masked_tokens": masked,
            "rows_per_folder": formats.ROWS_PER_FOLDER,
            "command": "bench/kimi_heads.py write",
        },
        "data_config.json",
    )


def write_dataset(out: Path, target: Path) -> None:
    """SAMPLES random samples of SEQ tokens: ids below the vocabulary, the loss on the second half,
    four bf16 states [SEQ, HIDDEN] (the aux states, then the pre-norm last one)."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    lengths, freq = {}, {}
    for i in range(SAMPLES):
        ids = torch.randint(0, VOCAB, (SEQ,), generator=g)
        mask = (torch.arange(SEQ) >= SEQ // 2).long()
        states = [torch.randn(SEQ, HIDDEN, generator=g).to(torch.bfloat16) for _ in LAYER_IDS]
        formats.write_sample(out, formats.V1_LAYOUT, i, ids, states, mask)
        lengths[i] = SEQ
        for t in ids[mask.bool()].tolist():
            freq[t] = freq.get(t, 0) + 1
    formats.write_sample_lengths(out / formats.SAMPLE_LENGTHS_FILE, lengths)
    formats.write_token_freq(out / formats.TOKEN_FREQ_FILE, freq)
    formats.ensure_data_config(out, data_config(target, lengths, sum(freq.values())))


def check_dataset(data: Path) -> int:
    """`eaglet check DATA --no-target`; its report printed, its exit status returned."""
    cmd = [sys.executable, "-m", "eaglet.cli", "check", str(data), "--no-target"]
    res = subprocess.run(cmd, capture_output=True, text=True)
    print("$ eaglet check", data, "--no-target  ->  exit", res.returncode)
    print((res.stdout + res.stderr).rstrip())
    return res.returncode


def cmd_write(work: Path) -> None:
    folder = heads_dir(work)
    if heads_complete(folder):
        print(f"{folder}: complete, not rewritten")
    else:
        t0 = time.perf_counter()
        write_heads(folder)
        size = sum((folder / s).stat().st_size for s in (FIRST_SHARD, LAST_SHARD))
        seconds = time.perf_counter() - t0
        print(f"{folder}: wrote {gb(size)} in {seconds:.1f} s ({size / GB / seconds:.2f} GB/s)")
    location = locate_heads(folder)
    print(
        f"  shards present {list(location.head_shards)}, absent {len(location.missing_shards)} of "
        f"{len(location.shards)}; identity {resolve_target(str(folder)).revision}"
    )
    write_dataset(data_dir(work), folder)
    print(f"{data_dir(work)}: {SAMPLES} samples x {SEQ} tokens, states {len(LAYER_IDS)} x [{SEQ}, {HIDDEN}] bf16")
    if check_dataset(data_dir(work)) != 0:
        raise SystemExit("eaglet check reported problems in the dataset")


# ---------------------------------------------------------------------------------------------
# ranks: every rank reads the heads as offline training does
# ---------------------------------------------------------------------------------------------


@dataclass
class RankRead:
    rank: int
    rss_before: int
    rss_after: int
    peak: int  # VmHWM during the read (reset just before it)
    heads_bytes: int
    resolve_s: float  # resolve_target: config, tokenizer and sampled head bytes hashed
    read_s: float  # load_heads

    def row(self) -> str:
        return (
            f"{self.rank:>4} | {gb(self.rss_before):>10} {gb(self.rss_after):>10} {gb(self.peak):>10} | "
            f"{gb(self.heads_bytes):>10} {self.rss_after / self.heads_bytes:>7.2f} "
            f"{(self.rss_after - self.rss_before) / self.heads_bytes:>7.2f} | "
            f"{self.resolve_s:>9.2f} {self.read_s:>7.2f} {self.heads_bytes / GB / self.read_s:>6.2f}"
        )


RANK_HEADER = (
    f"{'rank':>4} | {'RSS before':>10} {'RSS after':>10} {'peak':>10} | {'heads bf16':>10} "
    f"{'after/h':>7} {'delta/h':>7} | {'resolve s':>9} {'read s':>7} {'GB/s':>6}"
)


def drop_from_page_cache(folder: Path) -> None:
    """Evict the head shards' pages (this folder's files only) so the read comes from disk."""
    for shard in locate_heads(folder).head_shards:
        fd = os.open(folder / shard, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_as_training(folder: Path, rank: int) -> RankRead:
    before = rss()
    reset_peak_rss()
    t0 = time.perf_counter()
    ref = resolve_target(str(folder))
    t1 = time.perf_counter()
    heads = load_heads(ref, None, torch.device("cpu"))
    t2 = time.perf_counter()
    tensors = [heads.embeddings, heads.final_norm.weight, heads.lm_head.weight]
    size = sum(t.numel() * t.element_size() for t in tensors)
    if rank == 0:
        print(f"rank 0 read {heads_summary(heads)}")
    return RankRead(rank, before, rss(), peak_rss(), size, t1 - t0, t2 - t1)


def cmd_ranks(work: Path, cold: bool) -> None:
    import torch.distributed as dist

    from eaglet.training.distributed import init_distributed

    d = init_distributed(torch.device("cpu"))
    if d.world == 1:
        raise SystemExit(
            "ranks: run under torchrun (python -m torch.distributed.run --standalone "
            "--nproc_per_node 2 bench/kimi_heads.py ranks --work DIR)"
        )
    if cold and d.main:
        drop_from_page_cache(heads_dir(work))
    d.barrier()
    mine = read_as_training(heads_dir(work), d.rank)
    d.barrier()
    rows: list[RankRead | None] = [None] * d.world
    dist.all_gather_object(rows, mine)
    if d.main:
        print(
            f"{cpu_description()}; {d.world} ranks (gloo) reading at once, page cache "
            f"{'dropped first' if cold else 'as left (warm after write)'}"
        )
        print(RANK_HEADER)
        for r in rows:
            print(r.row())
        worst = max(r.rss_after / r.heads_bytes for r in rows)
        print(
            f"after/h = RSS after / heads' bf16 bytes (goal <= 1.5: {'met' if worst <= 1.5 else 'NOT met'}, "
            f"worst {worst:.2f}); delta/h = (RSS after - before) / heads bytes; GB/s = heads bytes / read s"
        )
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# train: what a real-width training step needs, and the largest configuration that fits
# ---------------------------------------------------------------------------------------------


def kimi_draft_config(folder: Path) -> Any:
    """The drafter `eaglet train` builds for the folder's target (its text config, read without weights)."""
    from eaglet.drafter import DraftConfig
    from eaglet.heads import text_config

    return DraftConfig.from_target(text_config(folder), LAYER_IDS[:-1], DRAFT_VOCAB)


def trainable_parameters(c: Any) -> int:
    """The drafter's trainable parameters (all but the frozen embeddings): fc, q/k/v/o over the
    2H input, the SwiGLU MLP, the draft LM head and four norms."""
    H, width, kv = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    attention = 2 * H * width + 2 * (2 * H * kv) + width * H
    return 3 * c.target_hidden_size * H + attention + 3 * H * c.intermediate_size + H * c.draft_vocab_size + 4 * H


def activation_bytes(c: Any, tokens: int, ttt: int) -> int:
    """A rough upper figure for one micro-batch's saved activations and temporaries: per token and
    TTT step about 24 H-wide, 6 MLP-wide and 4 draft-vocabulary-wide fp32 rows, plus the teacher's
    full-vocabulary logits of each token (bf16 and fp32 rows)."""
    per_token_step = 24 * c.hidden_size + 6 * c.intermediate_size + 4 * c.draft_vocab_size
    return tokens * ttt * per_token_step * 4 + tokens * c.target_vocab_size * 6


@dataclass
class Estimate:
    """A configuration's host memory: what it holds while building (the heads as read, the drafter,
    transient copies) and while stepping; it needs the larger of the two."""

    name: str
    setup: list[tuple[str, int]]
    steps: list[tuple[str, int]]

    @property
    def total(self) -> int:
        return max(sum(n for _, n in self.setup), sum(n for _, n in self.steps))


def estimates(c: Any, base: int) -> list[Estimate]:
    """Largest first: `eaglet train` (AdamW), forward + backward, forward alone. `base` is a bare
    process's RSS (interpreter, torch)."""
    p = trainable_parameters(c)
    VH = c.target_vocab_size * c.hidden_size
    acts = activation_bytes(c, SEQ, TTT_STEPS)
    process = ("process (python, torch)", base)
    # the in-process runs keep the heads as read and build the drafter around them (`worker`)
    lean_setup = [
        ("heads as read, bf16", 2 * VH * 2),
        ("trainable fp32 weights", 4 * p),
        ("reordering the teacher's LM head (two bf16 copies)", 2 * VH * 2),
        process,
    ]
    lean = [
        ("frozen embeddings bf16, as read (lossless)", VH * 2),
        ("teacher LM head reordered bf16", VH * 2),
        ("autocast bf16 copies of the weights", 2 * p),
        ("activations (estimate)", acts),
        process,
    ]
    return [
        Estimate(
            "eaglet train, 3 AdamW steps",
            [
                ("heads as read, bf16", 2 * VH * 2),
                ("drafter: trainable fp32 weights", 4 * p),
                ("drafter: frozen embeddings fp32", VH * 4),
                ("reordering the teacher's LM head (two bf16 copies)", 2 * VH * 2),
                process,
            ],
            [
                ("trainable fp32 weights + grads + AdamW m, v (16 B/param)", 16 * p),
                ("frozen embeddings fp32", VH * 4),
                ("teacher LM head reordered bf16 (DraftFirstHead)", VH * 2),
                ("autocast bf16 copies of the weights", 2 * p),
                ("activations (estimate)", acts),
                process,
            ],
        ),
        Estimate(
            "forward + backward, no optimizer state",
            lean_setup,
            [("trainable fp32 weights + grads (8 B/param)", 8 * p), *lean],
        ),
        Estimate("forward alone (no grad)", lean_setup, [("trainable fp32 weights (4 B/param)", 4 * p), *lean]),
    ]


def print_estimate(e: Estimate, budget: int) -> None:
    print(f"  {e.name}: {gb(e.total)} {'fits' if e.total <= budget else 'does NOT fit'} in {gb(budget)}")
    for phase, parts in (("building", e.setup), ("stepping", e.steps)):
        print(f"    {phase}: {gb(sum(n for _, n in parts))}")
        for label, n in parts:
            print(f"      {gb(n):>10}  {label}")


@dataclass
class Watched:
    returncode: int | None
    peak: int  # the child's max RSS (wait4's ru_maxrss)
    killed: str | None  # why the watchdog killed it


def run_watched(cmd: list[str], budget: int, log: Path) -> Watched:
    """Run `cmd` with stdout/stderr to `log`, killing it as soon as its RSS passes `budget` or the
    machine's MemAvailable falls below MEM_FLOOR (before the kernel's OOM killer would pick a victim)."""
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    killed = None
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            return Watched(proc.returncode, usage.ru_maxrss * 1024, killed)
        try:
            child = proc_kib(f"/proc/{proc.pid}/status", "VmRSS") * 1024
        except OSError:
            child = 0
        why = (
            f"RSS {gb(child)} over the budget {gb(budget)}"
            if child > budget
            else f"MemAvailable {gb(mem_available())} under {gb(MEM_FLOOR)}"
            if mem_available() < MEM_FLOOR
            else None
        )
        if why and killed is None:
            killed = why
            os.kill(proc.pid, signal.SIGKILL)
        time.sleep(0.05)


def train_command(work: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "eaglet.cli",
        "train",
        str(data_dir(work)),
        "--out",
        str(work / "run"),
        "--target",
        str(heads_dir(work)),
        "--total-steps",
        "3",
        "--batch-size",
        "1",
        "--ttt-steps",
        str(TTT_STEPS),
        "--max-length",
        str(SEQ),
        "--draft-vocab-size",
        str(DRAFT_VOCAB),
        "--pack-tokens",
        "0",
        "--no-compile",
        "--evals",
        "1",
        "--log-every",
        "1",
        "--eval-fraction",
        "0.125",
    ]


def train_seconds_per_step(run: Path) -> float:
    """Training seconds per step from the run's last train metrics line."""
    from eaglet.training.checkpoints import METRICS_FILE

    lines = [json.loads(x) for x in (run / METRICS_FILE).read_text().splitlines() if x.strip()]
    last = [x for x in lines if x.get("split") == "train"][-1]
    return last["train_seconds"] / last["step"]


def worker_result(work: Path) -> Path:
    return work / "worker.json"


def lean_drafter(heads: Any, src: Any, cfg: Any) -> Any:
    """`build_drafter`'s drafter (its config, draft vocabulary and kind of initialisation) around the embeddings
    as read, bf16: built on the meta device, then every part but the embeddings made real. Its own
    fp32 embeddings would be an exact copy, and loading them makes a second (2 x 4.7 GB)."""
    from torch import nn

    from eaglet.drafter import DraftConfig, Eagle3Draft, build_draft_vocab

    torch.manual_seed(cfg.seed)
    dcfg = DraftConfig.from_target(heads.config, src.aux_layer_ids, cfg.draft_vocab_size)
    with torch.device("meta"):
        draft = Eagle3Draft(dcfg)
    for name, part in draft.named_children():
        if name != "embed_tokens":
            part.to_empty(device="cpu")
    draft.reset_parameters()
    draft.d2t, draft.t2d = build_draft_vocab(src.token_freq, dcfg.target_vocab_size, dcfg.draft_vocab_size)
    draft.embed_tokens.weight = nn.Parameter(heads.embeddings, requires_grad=False)
    return draft


def worker(work: Path, backward: bool, iters: int) -> dict[str, Any]:
    """The real-width drafter and teacher of `eaglet train` from the real-shape heads and data, then
    `iters` micro-batches of one sample through `forward_stats` (teacher, drafter, loss) and, with
    `backward`, its backward. The frozen embeddings and the teacher's LM head stay bf16 as read
    (the bf16 autocast teacher computes with bf16 weights anyway); no optimizer state."""

    from eaglet.dataset import open_dataset
    from eaglet.drafter import TeacherHead
    from eaglet.training.config import TrainConfig
    from eaglet.training.data import offline_source
    from eaglet.training.loss import forward_stats
    from eaglet.training.teacher import TeacherSource

    cfg = TrainConfig(
        total_steps=iters, ttt_steps=TTT_STEPS, max_length=SEQ, draft_vocab_size=DRAFT_VOCAB, pack_tokens=0, bf16=True
    )
    src = offline_source(open_dataset(data_dir(work)), SEQ)
    heads = load_heads(resolve_target(str(heads_dir(work))), None, torch.device("cpu"))
    draft = lean_drafter(heads, src, cfg)
    teachers = TeacherSource(
        TeacherHead(heads.final_norm, heads.lm_head), draft.d2t, draft.t2d, cfg.teacher_top_k, False, True
    )
    _ = teachers.lm_head  # the reordered bf16 head (TeacherSource then lets the head as read go)
    del heads
    setup_peak, setup_rss = peak_rss(), rss()
    reset_peak_rss()
    times = []
    for i in range(iters):
        batch = src.load([i % len(src.lengths)])
        t0 = time.perf_counter()
        with torch.set_grad_enabled(backward):
            loss, _ = forward_stats(draft, teachers, batch, cfg, torch.device("cpu"), TTT_STEPS, cfg.loss_on)
            if backward:
                loss.backward()
        draft.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return {
        "setup_peak": setup_peak,
        "setup_rss": setup_rss,
        "step_peak": peak_rss(),
        "seconds": times,
        "trainable": sum(p.numel() for p in draft.parameters() if p.requires_grad),
        "loss": float(loss),
    }


def cmd_train(work: Path, iters: int) -> None:
    c = kimi_draft_config(heads_dir(work))
    base = rss()
    available = mem_available()
    budget = available - HEADROOM
    print(
        f"{cpu_description()}, {torch.get_num_threads()} threads; MemAvailable {gb(available)}, budget "
        f"{gb(budget)} (MemAvailable - {gb(HEADROOM)} headroom)"
    )
    print(
        f"drafter (DraftConfig.from_target of Kimi-K2.5): hidden {c.hidden_size}, {c.num_heads} heads x "
        f"{c.head_dim} ({c.num_kv_heads} KV), MLP {c.intermediate_size}, draft vocabulary {c.draft_vocab_size} of "
        f"{c.target_vocab_size}; {trainable_parameters(c):,} trainable parameters; {SEQ} tokens, TTT {TTT_STEPS}"
    )
    plans = estimates(c, base)
    for e in plans:
        print_estimate(e, budget)
    chosen = next((i for i, e in enumerate(plans) if e.total <= budget), None)
    if chosen is None:
        print("nothing fits: no run started")
        return
    print(
        f"running: {plans[chosen].name}"
        + (
            ""
            if chosen == 0
            else f" (the full `eaglet train` would need {gb(plans[0].total)}, {gb(plans[0].total - budget)} over the budget)"
        )
    )
    log = work / f"train-{chosen}.log"
    if chosen == 0:
        shutil.rmtree(work / "run", ignore_errors=True)
        w = run_watched(train_command(work), budget, log)
        report_watched(w, log)
        if w.returncode == 0:
            print(
                f"  peak RSS {gb(w.peak)} (estimate {gb(plans[0].total)}); "
                f"{train_seconds_per_step(work / 'run'):.1f} s/step"
            )
        return
    cmd = [sys.executable, __file__, "worker", "--work", str(work), "--iters", str(iters)]
    w = run_watched(cmd + (["--backward"] if chosen == 1 else []), budget, log)
    report_watched(w, log)
    if w.returncode == 0:
        r = json.loads(worker_result(work).read_text())
        steps = " ".join(f"{s:.1f}" for s in r["seconds"])
        print(
            f"  {'trainable':>14} {'setup RSS':>10} {'setup peak':>10} {'step peak':>10} {'estimate':>10} | "
            f"s/step per iteration (first warms up)"
        )
        print(
            f"  {r['trainable']:>14,} {gb(r['setup_rss']):>10} {gb(r['setup_peak']):>10} {gb(r['step_peak']):>10} "
            f"{gb(plans[chosen].total):>10} | {steps}"
        )
        print(
            f"  peak RSS of the process (wait4) {gb(w.peak)}; loss {r['loss']:.3f}; s/step is teacher (top-"
            f"16 of the full vocabulary) + drafter forward{' + backward' if chosen == 1 else ''}, no AdamW"
        )


def report_watched(w: Watched, log: Path) -> None:
    if w.killed:
        print(f"  KILLED by the watchdog: {w.killed}")
    if w.returncode != 0:
        print(f"  exit {w.returncode}; last lines of {log}:")
        print("\n".join("    " + x for x in log.read_text().splitlines()[-25:]))


# ---------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("step", choices=("write", "ranks", "train", "worker"))
    ap.add_argument("--work", type=Path, required=True, help="work folder (DIR/heads, DIR/data, DIR/run)")
    ap.add_argument("--cold", action="store_true", help="ranks: drop the head shards from the page cache first")
    ap.add_argument("--iters", type=int, default=2, help="train: micro-batches timed in the in-process fallback")
    ap.add_argument("--backward", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    work = args.work.resolve()
    if args.step == "write":
        cmd_write(work)
    elif args.step == "ranks":
        cmd_ranks(work, args.cold)
    elif args.step == "train":
        cmd_train(work, args.iters)
    else:
        formats.write_json_atomic(worker_result(work), worker(work, args.backward, args.iters))


if __name__ == "__main__":
    main()
