"""What a training run is asked to do and how long it runs: `TrainConfig` (the options, checked
once), the `Plan` (schedule length and cadence), the learning-rate schedule, the
--time-budget calibration that sizes the plan from the first steps' measured tokens/s, and the
refusal of a micro-batch larger than the training device's memory.

No torch here: the options can be read and checked without loading it (a CUDA device's free
memory is asked of torch inside `available_memory`, which only the training loop calls).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from eaglet import families, ranges
from eaglet.options import LM_HEAD_INITS, LOSS_ON, OBJECTIVES, TrainSettings, env_switch
from eaglet.placement import Placement, placement_from_options, size_text

BUDGET_WARMUP_STEPS = 25  # default warmup under --time-budget (the schedule's length is not known yet)
CALIBRATION_STEPS = 20  # under --time-budget, steps timed before the schedule is sized (fewer if the budget is short)
CALIBRATION_SKIP = 2  # first steps left out of the timing (one-time allocations and kernel setup)
RESIZE_STEPS = 4 * CALIBRATION_STEPS  # steps after the sizing that are timed once more (training.loop.resize_budget)
RESIZE_SLACK = 0.05  # a re-sized plan within this share of the first is left as it was
UNSIZED_STEPS = 1 << 40  # the schedule's length before --time-budget has sized it
# The options only the parallel families take (their defaults: families.Family.parallel_defaults)
PARALLEL_OPTIONS = ("draft_layers", "block_size", "anchor_stride")
# EAGLE-3 drafter options a parallel drafter has no use for (its layers have no TTT unroll to feed)
EAGLE3_ONLY = ("fc_norm", "norm_output", "norm_before_residual", "sliding_window", "feature_loss_weight")


@dataclass(frozen=True, kw_only=True)
class TrainConfig(TrainSettings):
    """The training settings, checked once, with the family's defaults filled in. The fields and
    their defaults are declared once, in eaglet.options (`TrainSettings`)."""

    # Options that define the trajectory: a resumed run must use the same ones.
    TRAJECTORY = (
        "drafter",
        "draft_layers",
        "block_size",
        "anchor_stride",
        "epochs",
        "total_steps",
        "lr",
        "min_lr_ratio",
        "warmup_steps",
        "weight_decay",
        "max_grad_norm",
        "batch_size",
        "pack_tokens",
        "max_length",
        "ttt_steps",
        "ttt_ramp",
        "draft_vocab_size",
        "teacher_top_k",
        "loss_on",
        "objective",
        "feature_loss_weight",
        "lm_head_init",
        "freeze_lm_head",
        "fc_norm",
        "norm_output",
        "norm_before_residual",
        "sliding_window",
        "bf16",
        "time_budget",
        "eval_fraction",
        "seed",
    )

    # Numeric options and what they may be (None: the option's default applies).
    AT_LEAST_ONE = (
        "draft_layers",
        "anchor_stride",
        "total_steps",
        "stop_after",
        "batch_size",
        "grad_accum",
        "max_length",
        "ttt_steps",
        "draft_vocab_size",
        "sliding_window",
        "eval_every",
        "evals",
        "save_every",
        "log_every",
    )
    AT_LEAST_ZERO = ("warmup_steps", "keep_checkpoints", "weight_decay", "feature_loss_weight")
    ABOVE_ZERO = ("epochs", "lr", "max_grad_norm")

    def __post_init__(self) -> None:
        ranges.at_least(1, **{k: getattr(self, k) for k in self.AT_LEAST_ONE})
        ranges.at_least(0, **{k: getattr(self, k) for k in self.AT_LEAST_ZERO})
        ranges.above(0, **{k: getattr(self, k) for k in self.ABOVE_ZERO})
        ranges.seconds(time_budget=self.time_budget)
        ranges.within(0, 1, "the share of samples held out", high_open=True, eval_fraction=self.eval_fraction)
        ranges.within(0, 1, min_lr_ratio=self.min_lr_ratio)
        ranges.within(0, 1, "a fraction of the schedule", high_open=True, ttt_ramp=self.ttt_ramp)
        ranges.seeds(seed=self.seed)
        self.resolve_family()
        if self.loss_on not in LOSS_ON:
            raise ValueError(f"--loss-on {self.loss_on!r}: choose one of {list(LOSS_ON)}")
        if self.objective not in OBJECTIVES:
            raise ValueError(f"--objective {self.objective!r}: choose one of {list(OBJECTIVES)}")
        if self.lm_head_init not in LM_HEAD_INITS:
            raise ValueError(f"--lm-head-init {self.lm_head_init!r}: choose one of {list(LM_HEAD_INITS)}")
        if self.freeze_lm_head and self.lm_head_init != "target":
            raise ValueError("--freeze-lm-head keeps the LM head as initialised: it needs --lm-head-init target")
        ranges.check(">= 1 (or 0: the dense teacher)", lambda v: v >= 0, teacher_top_k=self.teacher_top_k)
        ranges.check(">= 1 (or 0: one sample per row)", lambda v: v >= 0, pack_tokens=self.pack_tokens)
        ranges.of_annotated_kinds(self)  # after the ranges: an inf count is said to be one
        if self.pack_tokens and self.pack_tokens < min_sample_tokens(self.ttt_steps):
            raise ValueError(
                f"--pack-tokens {self.pack_tokens}: a pack must hold a sample of at least "
                f"{min_sample_tokens(self.ttt_steps)} tokens (--ttt-steps {self.ttt_steps})"
            )
        if self.teacher_top_k == 0:
            object.__setattr__(self, "teacher_top_k", None)  # one spelling of "dense" in train_config.json
        if self.time_budget is not None and self.total_steps is not None:
            raise ValueError("--time-budget sizes the schedule itself: give it or --total-steps, not both")
        self.placement()  # a wrong --device-map, --max-memory or pairing with --device: refused now
        if self.device_map is not None and not self.online:
            raise ValueError(
                f"--device-map {self.device_map} places the target that --online runs; offline training "
                "reads stored hidden states and takes only the target's embeddings and LM head (fp32, "
                "on the CPU): add --online, or leave out --device-map"
            )
        if self.max_length is not None and self.max_length < min_sample_tokens(self.ttt_steps):
            raise ValueError(
                f"--max-length {self.max_length}: TTT step k at position t predicts token t+k+2, so "
                f"with --ttt-steps {self.ttt_steps} a sample needs at least "
                f"{min_sample_tokens(self.ttt_steps)} tokens for every step to train on one position; "
                f"use --max-length {min_sample_tokens(self.ttt_steps)} or more"
            )

    def placement(self) -> Placement | None:
        """Where --online loads the target: a device map, or None for one device."""
        return placement_from_options(self.device_map, self.max_memory, self.offload_folder, self.device)

    def resolve_family(self) -> None:
        """The family's options checked, a parallel family's defaults filled in (so train_config.json
        and a resume see them), an EAGLE-3 run's left None."""
        family = self.drafter
        if not families.is_family(family):  # registered now: a plug-in family registers at import
            raise ValueError(f"--drafter {family!r}: choose one of {list(families.FAMILIES)}")
        parallel = {k: getattr(self, k) for k in PARALLEL_OPTIONS}
        if not families.family(family).parallel:
            given = [k for k, v in parallel.items() if v is not None]
            if given:
                raise ValueError(
                    f"--{given[0].replace('_', '-')} is a p-eagle / dflash option; --drafter eagle3 has "
                    "one layer and drafts by training-time test"
                )
            return
        unused = [k for k in EAGLE3_ONLY if getattr(self, k)]
        if unused:
            raise ValueError(
                f"--{unused[0].replace('_', '-')} is an eagle3 option; --drafter {family} has no use for it"
            )
        for k, default in families.family(family).parallel_defaults().items():
            if getattr(self, k) is None:
                object.__setattr__(self, k, default)  # frozen: filled once, while it is made
        ranges.at_least(2, block_size=self.block_size)

    # Options left None to be decided (by the family here, by the device in train), as what they
    # are where they are used: deciding comes first
    @property
    def block(self) -> int:
        """A parallel family's block size (`__post_init__` fills in the family's default)."""
        assert self.block_size is not None, f"--drafter {self.drafter} has no block"
        return self.block_size

    @property
    def stride(self) -> int:
        """A parallel family's anchor stride (`__post_init__` fills in the default)."""
        assert self.anchor_stride is not None, f"--drafter {self.drafter} has no anchors"
        return self.anchor_stride

    @property
    def budget(self) -> float:
        """--time-budget's seconds, where one is given (the budget's code runs only then)."""
        assert self.time_budget is not None, "no --time-budget"
        return self.time_budget

    @property
    def computes_bf16(self) -> bool:
        """bf16 autocast or none, as train decided it for the device."""
        assert self.bf16 is not None, "bf16 is decided for the device before training"
        return self.bf16

    @property
    def compiles(self) -> bool:
        """torch.compile or not, as `resolve_packing` decided it."""
        assert self.compile is not None, "compile is decided with the packing before training"
        return self.compile

    @property
    def stat_positions(self) -> int:
        """Positions the per-position statistics have: TTT steps, P-EAGLE's K, DFlash's B - 1."""
        family = families.family(self.drafter)
        return family.drafts_per_pass(self.block) if family.parallel else self.ttt_steps

    def ttt_steps_at(self, step: int, total_steps: int) -> int:
        """The unroll length at this optimizer step: ttt_steps, or growing 1..ttt_steps over the ramp."""
        ramp = self.ttt_ramp * total_steps
        if ramp <= 0 or step >= ramp:
            return self.ttt_steps
        return min(self.ttt_steps, 1 + int(self.ttt_steps * step / ramp))

    def trajectory(self, world: int) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.TRAJECTORY}
        d["global_accum"] = self.grad_accum * world  # W processes x A equals 1 process x A*W
        return d


# "0": --compile is off unless asked for (the test suite sets it: compiling every tiny run would
# dominate its time); "1" or unset: on where the steps are packed.
COMPILE_ENV = "EAGLET_COMPILE"
PACK_MIN_TOKENS = 1024  # the default pack: at least this many tokens a row
PACK_ROUND_TOKENS = 256


def pack_budget(longest: int) -> int:
    """The default --pack-tokens: the longest training sample (after --max-length) rounded up to
    a multiple of 256, at least 1,024, so that no sample is cut by packing and a row holds a
    few short ones (attention costs grow with the square of a row's length)."""
    return max(PACK_MIN_TOKENS, -(-longest // PACK_ROUND_TOKENS) * PACK_ROUND_TOKENS)


def resolve_packing(cfg: TrainConfig, longest: int) -> TrainConfig:
    """`cfg` with --pack-tokens and --compile decided: the default pack for this data, and
    compiling where the steps are packed (one shape: one graph)."""
    pack = pack_budget(longest) if cfg.pack_tokens is None else cfg.pack_tokens
    default = env_switch(COMPILE_ENV, "compile packed steps", "never compile by default")
    compile_steps = bool(pack) and default is not False if cfg.compile is None else cfg.compile
    return replace(cfg, pack_tokens=pack, compile=compile_steps)


# ---------------------------------------------------------------------------------------------
# A micro-batch within the training device's memory
# ---------------------------------------------------------------------------------------------

STORED_STATES = 4  # a token's states from the target: its 3 aux states and its last one
LEAST_VALUE_BYTES = 2  # bf16 / fp16, the narrowest a state is held in (fp32 takes twice as much)
MEMINFO = Path("/proc/meminfo")


def micro_batch_tokens(cfg: TrainConfig, longest: int) -> int:
    """Tokens of the largest training micro-batch: --batch-size packs of --pack-tokens, or
    --batch-size samples padded to the longest one (after --max-length)."""
    return cfg.batch_size * (cfg.pack_tokens or longest)


def token_state_bytes(hidden_size: int, ttt_steps: int) -> int:
    """Bytes of hidden states a training token holds at least: the target's states and the
    drafter's output at every TTT step (all kept until the loss), 2 bytes a value. A lower
    bound: the drafter's other activations, the teacher and the gradients come on top."""
    return (STORED_STATES + ttt_steps) * hidden_size * LEAST_VALUE_BYTES


def meminfo_available(text: str) -> int | None:
    """The MemAvailable bytes of /proc/meminfo's text (None where it has no such line)."""
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key == "MemAvailable":
            return int(rest.split()[0]) * 1024  # written in kB
    return None


def available_memory(device: str) -> tuple[int, str] | None:
    """(bytes a micro-batch may take on the training device now, where that figure comes from),
    or None where it is not known (no /proc/meminfo, another kind of device)."""
    if device.startswith("cuda"):
        import torch  # here only: the loop that calls this has it loaded, the option checks must not

        free, _total = torch.cuda.mem_get_info(torch.device(device))
        return free, f"free on {device}"
    if device == "cpu" and MEMINFO.exists():
        available = meminfo_available(MEMINFO.read_text())
        return None if available is None else (available, "MemAvailable")
    return None


def micro_batch_sizing(cfg: TrainConfig, longest: int) -> tuple[str, str]:
    """The options that size a micro-batch, as an error names them, and the ones that shrink it."""
    if cfg.pack_tokens:
        times = f" x --batch-size {cfg.batch_size}" if cfg.batch_size > 1 else ""
        return f"--pack-tokens {cfg.pack_tokens}{times}", "lower --pack-tokens or --batch-size"
    return (
        f"--batch-size {cfg.batch_size} x samples of up to {longest:,} tokens",
        "lower --batch-size, or --max-length",
    )


def refuse_unfit_micro_batch(cfg: TrainConfig, longest: int, hidden_size: int, device: str) -> None:
    """Refuse, before any step, a micro-batch whose hidden states alone exceed the memory the
    training device has: else the allocator fails at the first step with a bare byte count.
    `cfg` has its packing resolved (`resolve_packing`); `longest` is the longest sample after
    --max-length; `hidden_size` the target's."""
    tokens = micro_batch_tokens(cfg, longest)
    per_token = token_state_bytes(hidden_size, cfg.ttt_steps)
    have = available_memory(device)
    if have is None or tokens * per_token <= have[0]:
        return
    sizing, fix = micro_batch_sizing(cfg, longest)
    raise ValueError(
        f"{sizing}: one micro-batch of {tokens:,} tokens needs at least {size_text(tokens * per_token)} "
        f"for its hidden states alone (the target's {STORED_STATES} states and the drafter's output at "
        f"each of {cfg.ttt_steps} TTT steps, {hidden_size:,} values each at {LEAST_VALUE_BYTES} bytes: "
        f"{per_token:,} bytes a token), this machine has {size_text(have[0])} available ({have[1]}); "
        f"{fix}"
    )


def min_sample_tokens(ttt_steps: int) -> int:
    """The shortest sample that gives every TTT step a position: step k at t predicts t+k+2."""
    return ttt_steps + 2


# ---------------------------------------------------------------------------------------------
# The schedule
# ---------------------------------------------------------------------------------------------


@dataclass
class Plan:
    """The schedule's length and cadence. Fixed from the options, or under --time-budget sized
    after the first steps from the measured tokens/s (recorded in checkpoints, so a resumed
    run keeps it)."""

    total_steps: int
    warmup: int
    eval_every: int
    save_every: int
    calibrated: bool = True

    @classmethod
    def make(cls, cfg: TrainConfig, total_steps: int, calibrated: bool) -> Plan:
        warmup = (
            cfg.warmup_steps
            if cfg.warmup_steps is not None
            else (max(1, total_steps // 50) if cfg.time_budget is None else BUDGET_WARMUP_STEPS)
        )
        eval_every = cfg.eval_every or max(1, total_steps // max(1, cfg.evals))
        return cls(total_steps, warmup, eval_every, cfg.save_every or eval_every, calibrated)

    @classmethod
    def first(cls, cfg: TrainConfig, epoch_steps: int) -> Plan:
        """The plan a run starts with: from the options, or open-ended until --time-budget has timed the first steps."""
        if cfg.time_budget is None:
            total = cfg.total_steps or epoch_steps
            if total > UNSIZED_STEPS:  # finite, and still a run that never ends: a typo, not a plan
                given = f"--total-steps {cfg.total_steps}" if cfg.total_steps else f"--epochs {cfg.epochs:g}"
                raise ValueError(
                    f"{given}: a schedule of {total:,} optimizer steps, more than the {UNSIZED_STEPS:,} "
                    "eaglet plans; give fewer, or --time-budget"
                )
            return cls.make(cfg, total, calibrated=True)
        return cls.make(cfg, UNSIZED_STEPS, calibrated=False)

    @classmethod
    def sized(cls, cfg: TrainConfig, total_steps: int, step: int) -> Plan:
        """The plan --time-budget sizes at `step`, once the first steps are timed."""
        plan = cls.make(cfg, total_steps, calibrated=True)
        if cfg.warmup_steps is None:  # a short budget: warm up over at most 5% of it, never undoing steps done
            plan.warmup = max(step, min(BUDGET_WARMUP_STEPS, total_steps // 20))
        return plan


def lr_lambda(warmup: int, total: int, min_ratio: float) -> Callable[[int], float]:
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


# ---------------------------------------------------------------------------------------------
# --time-budget: the schedule sized from the first steps' tokens/s
# ---------------------------------------------------------------------------------------------


def budget_steps(budget: float, step: int, seconds_done: float, rate: float, tokens_per_step: float) -> int:
    """Total optimizer steps that fit `budget` seconds of training, `seconds_done` of them spent
    reaching `step`, at `rate` tokens/s."""
    left = max(0.0, budget - seconds_done)
    return step + max(1, int(left * rate / max(tokens_per_step, 1.0)))


@dataclass
class Calibration:
    """The training tokens and seconds done when the timing starts, at step `start` (the first
    CALIBRATION_SKIP steps of this invocation are left out)."""

    start: int
    tokens: int = 0
    seconds: float = 0.0

    def rate(self, step: int, tokens_done: int, seconds_done: float, budget: float) -> tuple[float, int] | None:
        """(tokens/s, steps timed) once enough steps are timed to size the schedule, else None.
        Call it after every step: at `start` it records where the timing begins."""
        if step == self.start:
            self.tokens, self.seconds = tokens_done, seconds_done
        steps, tokens, seconds = step - self.start, tokens_done - self.tokens, seconds_done - self.seconds
        if steps > 0 and (steps >= CALIBRATION_STEPS or seconds >= 0.05 * budget):
            return tokens / max(seconds, 1e-9), steps
        return None
