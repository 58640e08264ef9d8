"""Train an EAGLE-3 drafter (`eaglet train`): the entry `train` and its loop.

One entry, `train(dataset_dir, out_dir, target=None, ...)`. Offline (the default) it reads stored
hidden states in any layout `eaglet check` accepts (eaglet's v1, speculators' flat v1 and
hs_*.safetensors, SpecForge .ckpt[.gz]); online (`online=True`) it reads an `eaglet prepare`
output and runs the target inside the loop, with extract.py's capture code, to make the same
hidden states on the fly. Either way the loop sees one `Source`. It checks that the data and the
target agree, builds the draft vocabulary from the data's token frequencies, and trains with
AdamW (fp32 master weights, optional bf16 autocast), warmup + cosine, grad clipping and
accumulation, over length-bucketed batches. Every `eval_every` steps it measures per-TTT-step
accuracy on a held-out split and keeps the checkpoint with the best simulated acceptance length.

Data order is a pure function of (seed, epoch), and a checkpoint records the position in it, so
`resume=True` continues exactly. Under `torchrun` each process takes every W-th micro-batch of
the same global order (DDP averages the gradients), so W processes with accumulation A match
one process with accumulation A*W.

Layout of `out_dir`: `metrics.jsonl`, `checkpoints/step_XXXXXXXX/{model.safetensors,
config.json, training_state.pt}`, `checkpoints/latest.json`, `checkpoints/best.json`
(checkpoints.py owns it).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Collection, Iterator, cast

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR
from tqdm import tqdm

from eaglet import families, formats, layers
from eaglet.check import prepared_mask_problem, template_mismatch
from eaglet.drafter import STAT_ROWS, DraftModel, make_teacher_head, num_parameters, stats_summary
from eaglet.dataset import Dataset, check_target_matches, dataset_target, recorded_target_where
from eaglet.options import EAGLE3, TrainOptions, TrainSettings, defaults_of
from eaglet.heads import TargetHeads, heads_summary
from eaglet.target import (
    LAYER_CHECK_MAX_BYTES,
    TargetRef,
    fast_bf16,
    heads_of_model,
    load_heads,
    load_target,
    load_tokenizer,
    parse_dtype,
    prepared_target,
    resolve_target,
    target_source,
    whole_target_size,
)
from eaglet.training.checkpoints import (
    CHECKPOINTS_DIR,
    METRICS_FILE,
    TRAIN_CONFIG_FILE,
    Checkpointer,
    MetricsLog,
    checkpoint_name,
    refuse_existing_run,
    resumed_options,
    run_lock,
    truncate_metrics,
)
from eaglet.training.config import (
    CALIBRATION_SKIP,
    RESIZE_SLACK,
    RESIZE_STEPS,
    Calibration,
    Plan,
    TrainConfig,
    budget_steps,
    lr_lambda,
    refuse_unfit_micro_batch,
    resolve_packing,
)
from eaglet.training.data import (
    Batch,
    BatchStream,
    Prefetcher,
    Prepared,
    Source,
    bucketed_batches,
    offline_source,
    online_source,
    open_training_data,
    refuse_beyond_positions,
    refuse_too_short,
    refuse_wrong_last_state,
    refuse_wrong_layer_ids,
    split_indices,
)
from eaglet.training.distributed import Dist, env_rank, host_memory, init_distributed, process_device, teardown, wrap
from eaglet.training.heldout import evaluate
from eaglet.training.loss import forward_stats, refuse_non_finite
from eaglet.training.teacher import TeacherSource, build_drafter

log = logging.getLogger(__name__)


@dataclass
class TrainSummary:
    out: Path
    step: int
    total_steps: int
    best_step: int | None
    best_tau: float | None
    last_eval: dict[str, Any] | None
    train_tokens: int
    seconds: float
    trainable_parameters: int
    extra: dict[str, Any] = field(default_factory=dict)
    drafter: str = EAGLE3  # the family trained

    def lines(self) -> list[str]:
        rate = self.train_tokens / self.seconds if self.seconds > 0 else 0.0
        out = [
            f"trained {self.step}/{self.total_steps} steps ({self.trainable_parameters:,} trainable parameters), "
            f"{self.train_tokens:,} tokens in {self.seconds:.1f} s ({rate:,.0f} tok/s)"
        ]
        if self.last_eval:
            acc = " ".join(f"{a:.3f}" for a in self.last_eval["acc"])
            where = families.family(self.drafter).position_name
            out.append(f"held-out: acc per {where} [{acc}], simulated acceptance length {self.last_eval['tau']:.3f}")
        if self.best_step is not None:
            out.append(
                f"best checkpoint: step {self.best_step} (tau {self.best_tau:.3f}) in "
                f"{self.out / CHECKPOINTS_DIR / checkpoint_name(self.best_step)}"
            )
        return out


@dataclass
class Split:
    """The run's samples: the training order, the held-out batches, and the sizes the plan needs."""

    train_idx: list[int]
    eval_idx: list[int]
    stream: BatchStream
    eval_batches: list[list[int]]
    micro_per_step: int  # micro-batches per optimizer step, all processes together
    epoch_steps: int  # optimizer steps of --epochs
    tokens_per_step: float  # of an average optimizer step, to turn a measured tokens/s into steps


@dataclass
class Run:
    """What the steps of a run read: set up once, before the first step."""

    cfg: TrainConfig
    out: Path
    dist: Dist
    device: torch.device
    source: Source
    draft: DraftModel
    model: nn.Module  # the drafter, or its DDP wrapper under torchrun
    teachers: TeacherSource
    split: Split
    params: list[nn.Parameter]
    opt: torch.optim.Optimizer
    sched: LambdaLR
    saver: Checkpointer
    metrics: MetricsLog
    compilation: Compilation  # what --compile did: train_config.json records it after the first step


@dataclass
class RunState:
    """What the steps change, and a checkpoint saves: where the run is, its plan and best so far."""

    plan: Plan
    stop_after: int | None
    step: int = 0
    best: dict[str, Any] = field(default_factory=lambda: {"step": None, "tau": None})
    # training tokens and seconds so far (held-out evals and saves excluded)
    done: dict[str, Any] = field(default_factory=lambda: {"tokens": 0, "seconds": 0.0})
    last_eval: dict[str, Any] | None = None

    @property
    def stop(self) -> int:
        """The step this invocation ends at."""
        return min(self.plan.total_steps, self.stop_after) if self.stop_after is not None else self.plan.total_steps


def train(
    options: TrainOptions, show_progress: bool = True, command: str = "", given: Collection[str] | None = None
) -> TrainSummary:
    """Train a drafter on `options.dataset_dir` into `options.out_dir`: stored hidden states, or
    with `online` an `eaglet prepare` output. With `resume` the run's own settings apply, and those
    named in `given` (by default every setting that is not its declared default) are compared
    with them. The run folder has one writer at a time (`run_lock`)."""
    formats.refuse_overlap(options.out_dir, "train", {"the dataset": options.dataset_dir, "--target": options.target})
    with run_lock(Path(options.out_dir), env_rank() == 0):
        return train_locked(options, show_progress, command, given)


def train_locked(
    options: TrainOptions, show_progress: bool, command: str, given: Collection[str] | None
) -> TrainSummary:
    """`train` with the run folder's lock held."""
    dataset_dir, target, resume = options.dataset_dir, options.target, options.resume
    settings = options.settings()
    if resume:
        defaults = defaults_of(TrainSettings)
        settings = {k: v for k, v in settings.items() if (k in given if given is not None else v != defaults[k])}
    out = Path(options.out_dir)
    refuse_existing_run(out, resume)
    cfg, from_run = options_of_run(out, resume, settings)
    if env_rank() == 0:
        # checkpoint folders and pointers a kill left half-written: all beside the checkpoints, never
        # inside a folder of the user's there (a step_00000004.bak)
        formats.remove_stale_temp_files(out / CHECKPOINTS_DIR, recursive=False)
    with run_settings_named(out, from_run):
        data = open_training_data(dataset_dir, cfg, show_progress and env_rank() == 0)
        device = process_device(cfg.device)  # under torchrun, one device per process
        dist = init_distributed(device)
        if cfg.bf16 is None:  # resolved here, so train_config.json and a resume see what ran
            cfg = replace(cfg, bf16=fast_bf16(device))
        source, ref, draft, teachers = setup_model(dataset_dir, data, target, cfg, device)
    cfg = resolve_packing(cfg, max(source.cut_lengths().values()))  # before the trajectory is recorded
    refuse_unfit_micro_batch(cfg, max(source.cut_lengths().values()), draft.config.aux_width, str(device))
    split = setup_data(source, cfg, dist)
    state = RunState(Plan.first(cfg, split.epoch_steps), cfg.stop_after)
    params, opt, sched = setup_optimizer(draft, cfg, state)
    record = {
        "dataset": str(source.path.resolve()),
        "online": cfg.online,
        "target": ref.name,
        "target_revision": ref.revision,
    }
    saver = Checkpointer(
        out, cfg.keep_checkpoints, {**cfg.trajectory(dist.world), **source.identity()}, source.fingerprint(), record
    )
    refuse_too_short(source.lengths, split.train_idx, cfg)
    restore_or_start(saver, resume, state, draft, opt, sched)
    if dist.main:  # drop lines a killed run wrote after the checkpoint we start from (all, when from scratch)
        truncate_metrics(out / METRICS_FILE, state.step)
    dist.barrier()

    model, compilation = compiled(wrap(draft, device, dist), cfg.compiles)
    if dist.main:
        write_run_config(
            out,
            {
                **asdict(cfg),
                "world_size": dist.world,
                "total_steps": state.plan.total_steps,
                "warmup_steps": state.plan.warmup,
                "dataset": record["dataset"],
                "target": ref.name,
                "target_revision": ref.revision,
                "train_samples": len(split.train_idx),
                "eval_samples": len(split.eval_idx),
                "command": command,
                **compilation.record(),
            },
        )
    run = Run(
        cfg=cfg,
        out=out,
        dist=dist,
        device=device,
        source=source,
        draft=draft,
        model=model,
        teachers=teachers,
        split=split,
        params=params,
        opt=opt,
        sched=sched,
        saver=saver,
        metrics=MetricsLog(out, dist.main),
        compilation=compilation,
    )
    log_start(run, state)
    run_steps(run, state, show_progress)
    summary = finish(run, state)
    del run, model  # the DDP wrapper goes before the process group does (see distributed.teardown)
    teardown(dist)
    return summary


# ---------------------------------------------------------------------------------------------
# Setup: options, target and drafter, data, optimizer, resume
# ---------------------------------------------------------------------------------------------


def options_of_run(out: Path, resume: bool, options: dict[str, Any]) -> tuple[TrainConfig, set[str]]:
    """The options of this invocation, checked; with --resume the run's own, then those given now.
    Also the names of those taken from the run (none without --resume)."""
    if not resume:
        return TrainConfig(**options), set()
    # the run's own settings, then the options given now (a differing trajectory one is refused at restore)
    resumed = resumed_options(out)
    if not resumed:
        log.warning(
            "%s: no run recorded here yet (no %s: a run killed before it wrote one, or none); --resume "
            "starts a new run with the options given now",
            out,
            TRAIN_CONFIG_FILE,
        )
    try:
        TrainConfig(**resumed)
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"{out / TRAIN_CONFIG_FILE}: the run's settings do not make a training config ({e}; "
            "read from this file and, for the options a resume must match, from the latest "
            "checkpoint's training_state.pt); fix the file that holds it or train into a new --out"
        ) from e
    return TrainConfig(**{**resumed, **options}), set(resumed) - set(options)


@contextlib.contextmanager
def run_settings_named(out: Path, from_run: set[str]) -> Iterator[None]:
    """A refusal that names an option whose value a resume took from the run's train_config.json
    (not from this command line) says so, and where to fix it."""
    try:
        yield
    except ValueError as e:
        text = str(e)
        # the option's flag, or a field name of two words or more (one-word names occur in prose)
        named = sorted(
            k for k in from_run if f"--{k.replace('_', '-')}" in text or ("_" in k and re.search(rf"\b{k}\b", text))
        )
        if not named:
            raise
        raise ValueError(
            f"{text} ({', '.join(named)}: this run's own setting, which --resume read from "
            f"{out / TRAIN_CONFIG_FILE}; fix the file or train into a new --out)"
        ) from e


def setup_model(
    dataset_dir: str | Path, data: Dataset | Prepared, target: str | None, cfg: TrainConfig, device: torch.device
) -> tuple[Source, TargetRef, DraftModel, TeacherSource]:
    """The source of batches, the target it was checked against, the drafter built from the target's
    heads and the teacher. Offline only the heads are read; online the source holds the target."""
    if isinstance(data, Prepared):
        source, ref, target_heads = online_target(dataset_dir, data, target, cfg, device)
    else:
        source, ref, target_heads = offline_target(data, target, cfg, device)
    refuse_beyond_positions(source, cfg.max_length, target_heads.config)
    draft = build_drafter(target_heads, source.aux_layer_ids, source.token_freq, cfg, device)
    # the head as read: TeacherSource makes the one copy it computes with, in its compute dtype
    teacher_head = make_teacher_head(target_heads, source.last_hidden_state, head_dtype=None).to(device)
    teachers = TeacherSource(
        teacher_head, draft.d2t, draft.t2d, cfg.teacher_top_k, cfg.feature_loss_weight > 0, cfg.computes_bf16
    )
    return source, ref, draft, teachers


def online_target(
    dataset_dir: str | Path, prepared: Prepared, target: str | None, cfg: TrainConfig, device: torch.device
) -> tuple[Source, TargetRef, TargetHeads]:
    """The target `eaglet prepare` used, on this process's device (under torchrun every process
    runs its own copy), and the source that runs it on the prepared samples."""
    ref = prepared_target(dataset_dir, prepared.config, target)
    tmodel = load_target(ref, parse_dtype(cfg.target_dtype, device), device, cfg.placement())
    # a token id outside the vocabulary: refused now, else an IndexError at step N
    formats.check_prepared_token_ids(dataset_dir, prepared.samples, tmodel.config.vocab_size)
    # no stored file for `eaglet check` to read: the masks are compared with the template here
    problem = prepared_mask_problem(prepared.samples, prepared.config, load_tokenizer(ref))
    if problem:
        raise ValueError(
            f"{dataset_dir}/{problem}; prepare the data again with this target (`eaglet prepare` "
            "masks the assistant turns its chat template renders)"
        )
    n = tmodel.config.num_hidden_layers
    aux_ids = cfg.aux_layer_ids or layers.default_aux_ids(n)
    layers.check_aux_ids(aux_ids, n)
    return online_source(prepared, tmodel, [*aux_ids, n], device, cfg.max_length), ref, heads_of_model(tmodel)


def offline_target(
    ds: Dataset, target: str | None, cfg: TrainConfig, device: torch.device
) -> tuple[Source, TargetRef, TargetHeads]:
    """The heads of the target the dataset came from (embeddings for the drafter, final norm and LM
    head for the teacher), read alone as stored onto the training device; refused unless the target
    matches what the dataset records and its heads read the stored last states as recorded."""
    ref = resolve_target(dataset_target(ds, target), target_source(target, recorded_target_where(ds)))
    target_heads = load_heads(ref, None, device)
    log.info(
        "rank %d: host memory %s after reading the target's heads (%s); %s",
        env_rank(),
        host_memory(),
        heads_summary(target_heads),
        ref.name,
    )
    check_target_matches(ds.config, target_heads.config, ref)
    # as `eaglet check` with the target: masks made with another chat template mark other spans
    other = template_mismatch(ds.config.chat_template_sha256, load_tokenizer(ref))
    if other:
        raise ValueError(
            f"{ds.root / formats.DATA_CONFIG_FILE}: {other}; prepare and extract it again with this target"
        )
    layers.check_aux_ids(ds.aux_layer_ids, target_heads.config.num_hidden_layers)
    refuse_wrong_last_state(ds, target_heads)
    check_layer_ids(ds, ref)
    return offline_source(ds, cfg.max_length), ref, target_heads


def check_layer_ids(ds: Dataset, ref: TargetRef) -> None:
    """The layer-identity recompute on the dataset's first file, when the whole target is here and
    small enough to load in fp32 on the CPU; otherwise said, with how to run it."""
    size = whole_target_size(ref)
    if size is None or size > LAYER_CHECK_MAX_BYTES:
        why = "the folder holds only the heads" if size is None else f"the target's weights are {size:,} bytes"
        log.warning(
            "layer identity not checked by train (%s; train reads only the target's heads): run `eaglet check "
            "%s --target FULL_TARGET [--device-map auto] --identity-samples 2` once, with the whole target",
            why,
            ds.root,
        )
        return
    tmodel = load_target(ref, torch.float32, torch.device("cpu"))
    refuse_wrong_layer_ids(ds, tmodel)
    del tmodel


def setup_data(source: Source, cfg: TrainConfig, dist: Dist) -> Split:
    """The seeded split, the global order of micro-batches, and the sizes of a step and an epoch."""
    train_idx, eval_idx = split_indices(list(source.lengths), cfg.eval_fraction, cfg.seed)
    cut = source.cut_lengths()
    stream = BatchStream(train_idx, cut, cfg.batch_size, cfg.seed, cfg.pack_tokens or None)
    micro_per_step = cfg.grad_accum * dist.world
    epoch_steps = max(1, int(cfg.epochs * stream.per_epoch) // micro_per_step)
    tokens_per_step = micro_per_step * sum(cut[i] for i in train_idx) / max(1, stream.per_epoch)
    # held-out batches stay one sample per row, packed or not: comparable across runs
    return Split(
        train_idx,
        eval_idx,
        stream,
        bucketed_batches(eval_idx, source.lengths, cfg.batch_size, None),
        micro_per_step,
        epoch_steps,
        tokens_per_step,
    )


@dataclass
class Compilation:
    """What --compile did in this invocation. `compile: true` in train_config.json is the option
    asked for; torch.compile can still leave the steps eager (no C++ compiler on the CPU, or
    dynamo giving up on a frame without an error), so the graphs inductor actually built are
    counted and recorded beside it."""

    wrapped: bool = False  # the model went under torch.compile
    graphs: int = 0  # graphs inductor built for this run's steps
    stepped: bool = False  # a training step has run since (it is what builds the graphs)

    @property
    def mode(self) -> str | None:
        """The steps' mode: inductor once a step ran a compiled graph, eager when none will; None until a step says."""
        if self.graphs:
            return "inductor"
        return "eager" if not self.wrapped or self.stepped else None

    def record(self) -> dict[str, Any]:
        """The train_config.json fields: the mode that ran and how many graphs it compiled."""
        return {"compile_mode": self.mode, "compile_graphs": self.graphs}


def compiled(model: nn.Module, enabled: bool) -> tuple[nn.Module, Compilation]:
    """`model` under torch.compile (inductor) for the training steps, or as is, with the record of
    what compiling did. Packed micro-batches have one shape, so one graph serves every step (a TTT
    ramp adds one per unroll length); the drafter itself stays eager for held-out evaluation, whose
    batches vary in length. On a CPU inductor builds C++: without a compiler the steps run eager,
    with a warning."""
    compilation = Compilation()
    if not enabled:
        return model, compilation
    if next(model.parameters()).device.type == "cpu" and not cpp_compiler():
        log.warning(
            "--compile: no C++ compiler (%s) for torch.compile on the CPU; training eager", os.environ.get("CXX", "c++")
        )
        return model, compilation
    compilation.wrapped = True
    # a compiled Module is a Module (torch's OptimizedModule); its stubs say only Callable
    return cast(nn.Module, torch.compile(model, backend=counting_inductor(compilation), dynamic=False)), compilation


def counting_inductor(compilation: Compilation) -> Any:
    """Inductor, counting into `compilation` each graph it returns. A backend of its own per run:
    dynamo guards its cached graphs on the backend, so an earlier run's graphs (same code, same
    shapes) are not reused uncounted."""
    inductor = torch._dynamo.lookup_backend("inductor")

    def backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Any:
        fn = inductor(gm, example_inputs)
        compilation.graphs += 1  # after it returned: a backend error dynamo swallows counts nothing
        return fn

    return backend


def record_compilation(run: Run) -> None:
    """After the first step of an invocation: train_config.json says whether the steps ran compiled
    (a --compile that built no graph is warned about, not left to pass as compiled)."""
    c = run.compilation
    c.stepped = True
    if c.wrapped and not c.graphs:
        log.warning("--compile: torch.compile built no graph in the first step; the steps run eager")
    if run.dist.main:
        config = formats.read_json(run.out / TRAIN_CONFIG_FILE)
        write_run_config(run.out, {**config, **c.record()})


def cpp_compiler() -> str | None:
    """The C++ compiler inductor would call on the CPU, if there is one."""
    return shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++") or shutil.which("clang++")


def setup_optimizer(
    draft: DraftModel, cfg: TrainConfig, state: RunState
) -> tuple[list[nn.Parameter], torch.optim.Optimizer, LambdaLR]:
    """AdamW over the trainable parameters, warmup + cosine over the plan."""
    params = [p for p in draft.parameters() if p.requires_grad]
    # The fused kernel updates every parameter in one pass (CPU and CUDA): 11 vs 30 ms a step for
    # the foreach default on the drafter's 9.4 M parameters (2 AMX cores, bench/train_step_profile.py),
    # a sixth of a 400-token step. A resumed run keeps the kind its checkpoint was saved with.
    fused = next(iter(params)).device.type in ("cpu", "cuda")
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay, fused=fused)
    # the schedule reads the plan at every step: one that --time-budget sizes, or a resume restores, applies at once
    sched = LambdaLR(opt, lambda s: lr_lambda(state.plan.warmup, state.plan.total_steps, cfg.min_lr_ratio)(s))
    return params, opt, sched


def restore_or_start(
    saver: Checkpointer, resume: bool, state: RunState, draft: DraftModel, opt: torch.optim.Optimizer, sched: LambdaLR
) -> None:
    """With --resume, continue from the latest checkpoint: its step, best, plan and time done."""
    saved = saver.restore_latest(resume, draft, opt, sched)
    if saved is None:
        return
    state.step, state.best = saved["step"], saved["best"]
    if "plan" in saved:
        state.plan = Plan(**saved["plan"])
    state.done = saved.get("done", state.done)


def write_run_config(out: Path, config: dict[str, Any]) -> None:
    """train_config.json: every option as this run uses it, its schedule, data and target."""
    out.mkdir(parents=True, exist_ok=True)
    formats.write_json_atomic(out / TRAIN_CONFIG_FILE, config)


def log_start(run: Run, state: RunState) -> None:
    cfg, plan = run.cfg, state.plan
    log.info(
        "drafter: %s trainable parameters; %d train / %d held-out samples; %s (%d micro-batches of %d per step)",
        f"{num_parameters(run.draft):,}",
        len(run.split.train_idx),
        len(run.split.eval_idx),
        f"{plan.total_steps} steps" if plan.calibrated else f"steps sized to a {cfg.time_budget:.0f} s budget",
        run.split.micro_per_step,
        cfg.batch_size,
    )


# ---------------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------------


@dataclass
class StepResult:
    sums: torch.Tensor  # [STAT_ROWS, ttt_steps] over this process's micro-batches
    tokens: int  # this process's real tokens
    grad_norm: torch.Tensor
    ttt_steps: int  # the unroll this step trained


@dataclass
class Progress:
    """What one invocation's loop keeps besides the run state, none of it saved: the train stats
    since the last metrics line, the --time-budget timing and the progress bar."""

    sums: torch.Tensor
    t0: float  # wall clock at the loop's start ("elapsed" in metrics lines)
    calibration: Calibration
    bar: tqdm
    tokens: int = 0
    # (step, tokens, seconds) where this invocation sized the plan: timed again RESIZE_STEPS later
    resize_from: tuple[int, int, float] | None = None

    def add(self, result: StepResult) -> None:
        self.sums += result.sums
        self.tokens += result.tokens


def start_progress(run: Run, state: RunState, show_progress: bool) -> Progress:
    sums = torch.zeros(STAT_ROWS, run.cfg.stat_positions, device=run.device)
    t0 = time.time()
    calibration = Calibration(state.step + CALIBRATION_SKIP)  # --time-budget: timing starts here
    bar = tqdm(
        total=state.stop if state.plan.calibrated else None,
        initial=state.step,
        desc="train",
        unit="step",
        file=sys.stderr,
        dynamic_ncols=True,
        disable=not (show_progress and run.dist.main),
    )
    return Progress(sums, t0, calibration, bar)


def run_steps(run: Run, state: RunState, show_progress: bool) -> None:
    """Train up to state.stop: each step, then its metrics line, held-out evaluation and checkpoint
    when due; under --time-budget the plan is sized once the first steps are timed."""
    progress = start_progress(run, state, show_progress)
    prefetch = Prefetcher(lambda m: micro_batch(run, m), background=run.source.background)
    run.draft.train()
    first_step = state.step
    try:
        while state.step < state.stop:
            t_step = time.perf_counter()
            result = train_step(run, state, prefetch)
            if state.step == first_step + 1:
                record_compilation(run)  # the first step built the compiled graphs, or ran eager
            progress.bar.update(1)
            progress.add(result)
            state.done["tokens"] += int(run.dist.all_sum(torch.tensor([result.tokens], device=run.device)).item())
            state.done["seconds"] += time.perf_counter() - t_step
            calibrate_budget(run, state, progress)
            resize_budget(run, state, progress)
            maybe_log(run, state, progress, result)
            maybe_save(run, state, maybe_evaluate(run, state))
    finally:
        prefetch.close()
        progress.bar.close()
        run.metrics.close()


def micro_batch(run: Run, m: int) -> Batch:
    """Micro-batch m of the global order: one pack of --pack-tokens, or --batch-size samples."""
    indices = run.split.stream[m]
    return run.source.load_pack(indices, run.cfg.pack_tokens) if run.cfg.pack_tokens else run.source.load(indices)


def train_step(run: Run, state: RunState, prefetch: Prefetcher) -> StepResult:
    """One optimizer step over this process's grad_accum micro-batches; under DDP the gradients
    are averaged on the last one only."""
    cfg, dist = run.cfg, run.dist
    # the full unroll while --time-budget times the first steps: they set the schedule's length
    steps = cfg.ttt_steps_at(state.step, state.plan.total_steps) if state.plan.calibrated else cfg.ttt_steps
    step_sums = torch.zeros(STAT_ROWS, cfg.stat_positions, device=run.device)
    step_tokens = 0
    for a in range(cfg.grad_accum):
        m = (
            state.step * run.split.micro_per_step + a * dist.world + dist.rank
        )  # every W-th micro-batch of the global order
        last_micro = state.step + 1 == state.stop and a == cfg.grad_accum - 1
        batch = prefetch.get(m, None if last_micro else m + dist.world).to(run.device)
        sync = a == cfg.grad_accum - 1 or dist.world == 1
        # DDP's no_sync (reached through a compiled wrapper too); one process has nothing to skip
        with contextlib.nullcontext() if sync else getattr(run.model, "no_sync")():
            loss, sums = forward_stats(run.model, run.teachers, batch, cfg, run.device, steps, cfg.loss_on, state.step)
            refuse_non_finite(loss, state.step + 1, batch)
            (loss / cfg.grad_accum).backward()
        step_sums += sums
        step_tokens += batch.tokens
    grad_norm = torch.nn.utils.clip_grad_norm_(run.params, cfg.max_grad_norm)
    run.opt.step()
    run.sched.step()
    run.opt.zero_grad(set_to_none=True)
    state.step += 1
    return StepResult(step_sums, step_tokens, grad_norm, steps)


def calibrate_budget(run: Run, state: RunState, progress: Progress) -> None:
    """Under --time-budget, once the first steps are timed: the plan that fits the budget at the
    measured tokens/s, rank 0's on every rank (each process times its own steps)."""
    cfg = run.cfg
    if state.plan.calibrated:
        return
    measured = progress.calibration.rate(state.step, state.done["tokens"], state.done["seconds"], cfg.budget)
    # Rank 0's timing decides when, as it decides how many steps: ranks that timed their steps
    # differently would otherwise wait forever on each other's broadcast.
    if not run.dist.from_main(int(measured is not None)):
        return
    rate, timed = measured or (0.0, 0)  # another rank's figures: only rank 0's are broadcast
    total = run.dist.from_main(
        budget_steps(cfg.budget, state.step, state.done["seconds"], rate, run.split.tokens_per_step)
    )
    adopt_plan(
        run,
        state,
        progress,
        Plan.sized(cfg, total, state.step),  # the same schedule on every rank
        f"{rate:.0f} tok/s over {timed} steps",
    )
    progress.resize_from = (state.step, state.done["tokens"], state.done["seconds"])


def resize_budget(run: Run, state: RunState, progress: Progress) -> None:
    """Every RESIZE_STEPS steps while less than half the budget is spent: the plan re-sized at the
    rate of the last RESIZE_STEPS steps, the warm-up kept, where it differs by more than RESIZE_SLACK.
    The first steps run slower (kernels warming up, and the first epoch reads every sample from disk
    while later ones find it cached): sized on them alone, the demo's 540 s budget trained 362 s."""
    if progress.resize_from is None or state.step < progress.resize_from[0] + RESIZE_STEPS:
        return
    step0, tokens0, seconds0 = progress.resize_from
    cfg, plan = run.cfg, state.plan
    # rank 0's seconds decide whether to time on, as they decide the plan: ranks whose own seconds
    # differ would otherwise stop taking part in these broadcasts at different steps
    timing_on = run.dist.from_main(int(state.done["seconds"] < 0.5 * cfg.budget))
    progress.resize_from = (state.step, state.done["tokens"], state.done["seconds"]) if timing_on else None
    rate = (state.done["tokens"] - tokens0) / max(state.done["seconds"] - seconds0, 1e-9)
    total = run.dist.from_main(
        budget_steps(cfg.budget, state.step, state.done["seconds"], rate, run.split.tokens_per_step)
    )
    if abs(total - plan.total_steps) <= RESIZE_SLACK * plan.total_steps:
        return
    resized = Plan.make(cfg, total, calibrated=True)
    resized.warmup = plan.warmup  # the learning rate goes on from where it is
    adopt_plan(run, state, progress, resized, f"{rate:.0f} tok/s over steps {step0}-{state.step}")


def adopt_plan(run: Run, state: RunState, progress: Progress, plan: Plan, measured: str) -> None:
    """`plan` from now on, said in the log and recorded in train_config.json (written before the
    schedule had its length)."""
    state.plan = plan
    progress.bar.reset(total=state.stop)
    progress.bar.update(state.step)
    if run.dist.main:
        log.info("--time-budget %.0f s: %s -> %d steps in all", run.cfg.time_budget, measured, plan.total_steps)
        config = formats.read_json(run.out / TRAIN_CONFIG_FILE)
        write_run_config(run.out, {**config, "total_steps": plan.total_steps, "warmup_steps": plan.warmup})


def maybe_log(run: Run, state: RunState, progress: Progress, result: StepResult) -> None:
    """Every log_every steps and at the last: a train metrics line over the steps since the last one."""
    if state.step % run.cfg.log_every != 0 and state.step != state.stop:
        return
    dist, done = run.dist, state.done
    tokens = int(dist.all_sum(torch.tensor([progress.tokens], device=run.device)).item())
    summary = stats_summary(dist.all_sum(progress.sums).cpu())
    run.metrics.write(
        {
            "step": state.step,
            "split": "train",
            "lr": run.sched.get_last_lr()[0],
            "grad_norm": float(result.grad_norm),
            "tokens": tokens,
            "elapsed": time.time() - progress.t0,
            "train_tokens": done["tokens"],
            "train_seconds": round(done["seconds"], 3),
            "ttt_steps": result.ttt_steps,
            **summary,
        }
    )
    progress.bar.set_postfix(
        loss=f"{summary['loss'][0] or 0:.3f}",
        acc=f"{summary['acc'][0]:.3f}",
        tau=f"{summary['tau']:.2f}",
        tok_s=f"{done['tokens'] / max(done['seconds'], 1e-9):.0f}",
    )
    progress.sums.zero_()
    progress.tokens = 0


def maybe_evaluate(run: Run, state: RunState) -> bool:
    """Every eval_every steps and at the last: the held-out evaluation, its metrics line and the
    best so far. True when this step is a new best, whose checkpoint is then due."""
    plan = state.plan
    if not (plan.calibrated and (state.step % plan.eval_every == 0 or state.step == state.stop)):
        return False
    result = evaluate(run.draft, run.teachers, run.source.load, run.split.eval_batches, run.cfg, run.device, run.dist)
    if result is None:
        return False
    run.metrics.write(
        {
            "step": state.step,
            "split": "eval",
            "train_tokens": state.done["tokens"],
            "train_seconds": round(state.done["seconds"], 3),
            **result,
        }
    )
    state.last_eval = result
    # an evaluation over no position measures nothing: it can never be the best
    improved = result["positions"][0] > 0 and (state.best["tau"] is None or result["tau"] > state.best["tau"])
    if improved:
        state.best = {"step": state.step, "tau": result["tau"]}  # best.json follows once its checkpoint is saved
    return improved


def maybe_save(run: Run, state: RunState, new_best: bool) -> None:
    """Every save_every steps, at the last and at a new best: a checkpoint (rank 0 writes it)."""
    plan = state.plan
    if not (plan.calibrated and (state.step % plan.save_every == 0 or state.step == state.stop or new_best)):
        return
    if run.dist.main:
        run.saver.save(
            state.step,
            state.step * run.split.micro_per_step,
            run.draft,
            run.opt,
            run.sched,
            state.best,
            plan,
            state.done,
            state.last_eval,
        )
    run.dist.barrier()


def finish(run: Run, state: RunState) -> TrainSummary:
    """The summary, with a held-out evaluation of the last weights if the loop made none."""
    if state.last_eval is None and run.split.eval_batches:
        state.last_eval = evaluate(
            run.draft, run.teachers, run.source.load, run.split.eval_batches, run.cfg, run.device, run.dist
        )
    return TrainSummary(
        run.out,
        state.step,
        state.plan.total_steps,
        state.best["step"],
        state.best["tau"],
        state.last_eval,
        state.done["tokens"],
        state.done["seconds"],
        num_parameters(run.draft),
        drafter=run.cfg.drafter,
    )
