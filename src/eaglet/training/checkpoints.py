"""The run folder of `eaglet train`: its layout, checkpoints and pointers, metrics, lock and resume.

Layout of `out_dir`: `metrics.jsonl`, `train_config.json`, `checkpoints/step_XXXXXXXX/{model.safetensors,
config.json, training_state.pt}`, `checkpoints/latest.json`, `checkpoints/best.json`, `.lock`.

A checkpoint folder is written under a temporary name and renamed, so one that exists is
complete, and the pointers move only after the folder they name exists: a kill at any moment
leaves pointers to complete checkpoints. A checkpoint records the position in the data order, the
optimizer, scheduler and RNG states, so `resume=True` continues exactly; it also records the
options that define the trajectory and a fingerprint of the data, and a resume refuses others.
The folder has one writer at a time (`run_lock`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import shutil
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Iterator

import torch

from eaglet import formats
from eaglet.drafter import DraftModel
from eaglet.drafter.files import export_config, load_draft_weights
from eaglet.formats.runs import (
    BEST_FILE,
    CHECKPOINT_FILES,
    CHECKPOINTS_DIR,
    LATEST_FILE,
    LOCK_FILE,
    METRICS_FILE,
    STATE_FILE,
    TRAIN_CONFIG_FILE,
    checkpoint_name,
    is_checkpoint_name,
    is_own_checkpoint,
    read_pointer,
)
from eaglet.training.config import Plan, TrainConfig

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------------------------


def save_checkpoint(
    ckpt_root: Path, step: int, model: DraftModel, config_json: dict[str, Any], state: dict[str, Any]
) -> Path:
    """Write a checkpoint folder under a temp name, then rename: a folder that exists is complete."""
    final = ckpt_root / checkpoint_name(step)
    if final.is_symlink():
        raise FileExistsError(
            f"{final}: a symbolic link where the run saves its checkpoint; remove it (a run's "
            "checkpoints are folders of its own)"
        )
    if final.exists():  # the same step saved twice (an eval right at the end): replace it
        shutil.rmtree(final)
    with formats.atomic_dir(final) as tmp:
        formats.write_drafter_files(tmp, config_json, model.state_dict())
        torch.save(state, tmp / STATE_FILE)
    return final


def prune_checkpoints(ckpt_root: Path, keep: int, protect: set[str]) -> None:
    # only the folders a run writes, as it wrote them (a user's step_00000004.bak, an export put in a
    # checkpoint folder or named like one stay), and never through a link
    steps = sorted(
        p for p in ckpt_root.glob("step_*") if is_checkpoint_name(p.name) and p.is_dir() and not p.is_symlink()
    )
    for p in steps[:-keep] if keep > 0 else steps:
        if p.name in protect:
            continue
        if is_own_checkpoint(p):
            shutil.rmtree(p, ignore_errors=True)
        else:
            log.warning(
                "%s: not pruned: it holds files a run does not write there (%s); remove it yourself once they are safe",
                p,
                ", ".join(sorted(set(os.listdir(p)) - CHECKPOINT_FILES)) or "no state",
            )


def refuse_existing_run(out: Path, resume: bool) -> None:
    """A run folder train cannot write: checkpoints/ a link, checkpoints without the
    train_config.json every run writes first, or (without --resume) a run already there. First
    thing, before the data and the target load, and again where the run would start."""
    root = out / CHECKPOINTS_DIR
    if root.is_symlink():  # pruning old checkpoints would delete the folder it links to's
        raise FileExistsError(
            f"{root}: a symbolic link (to {os.readlink(root)}); a run folder keeps its "
            "checkpoints in a folder of its own: remove the link, or use another --out"
        )
    latest = read_pointer(root, LATEST_FILE)
    if latest and not (out / TRAIN_CONFIG_FILE).exists():  # written before the first checkpoint
        raise FileExistsError(
            f"{out}: checkpoints without {TRAIN_CONFIG_FILE}, which every eaglet run writes "
            "before its first: not a run of eaglet train's; use another --out"
        )
    if latest and not resume:
        raise ValueError(
            f"{out} already holds a training run (checkpoint {latest['path']}); pass --resume "
            "to continue it, or use another --out"
        )


@dataclass
class Checkpointer:
    """Saves the run's checkpoints and moves its pointers, and restores the latest one on --resume.
    `trajectory` (the options and what the batches hold) and `data` (`Source.fingerprint`) are
    what a resume must match; `record` is what each checkpoint's config.json says of the run."""

    out: Path
    keep: int  # newest step checkpoints kept, besides the best one
    trajectory: dict[str, Any]
    data: dict[str, Any]
    record: dict[str, Any]  # dataset, online, target, target_revision

    @property
    def root(self) -> Path:
        return self.out / CHECKPOINTS_DIR

    def restore_latest(
        self, resume: bool, draft: DraftModel, opt: torch.optim.Optimizer, sched: Any
    ) -> dict[str, Any] | None:
        """With --resume, the training state of the latest checkpoint, its weights, optimizer,
        scheduler and RNG restored; None to start from scratch. Without --resume a folder that
        holds a run is refused."""
        refuse_existing_run(self.out, resume)
        latest = read_pointer(self.root, LATEST_FILE)
        if resume and latest:
            return restore(self.root / latest["path"], draft, opt, sched, self.trajectory, self.data)[2]
        if resume:
            log.info("--resume: no checkpoint in %s; starting from scratch", self.root)
        return None

    def save(
        self,
        step: int,
        micro_position: int,
        draft: DraftModel,
        opt: torch.optim.Optimizer,
        sched: Any,
        best: dict[str, Any],
        plan: Plan,
        done: dict[str, Any],
        last_eval: dict[str, Any] | None,
    ) -> Path:
        """Write the checkpoint at `step` with everything a resume needs, point latest.json (and
        best.json, when `step` is the best) at it, and prune older ones."""
        rng = {"torch": torch.get_rng_state(), "python": random.getstate()}
        state = {
            "step": step,
            "micro_position": micro_position,
            "optimizer": opt.state_dict(),
            "scheduler": sched.state_dict(),
            "rng": rng,
            "best": best,
            "trajectory": self.trajectory,
            "plan": asdict(plan),
            "done": dict(done),
            "data": self.data,
        }
        extra = {"step": step, **self.record, "eval": last_eval}
        folder = save_checkpoint(self.root, step, draft, export_config(draft.config, extra), state)
        # the pointers only after the folder they name is complete: a kill in between leaves the old ones
        formats.write_json_atomic(self.root / LATEST_FILE, {"step": step, "path": folder.name})
        if best["step"] == step:
            formats.write_json_atomic(self.root / BEST_FILE, {**best, "path": folder.name})
        protect = {folder.name} | ({checkpoint_name(best["step"])} if best["step"] is not None else set())
        prune_checkpoints(self.root, self.keep, protect)
        return folder


# ---------------------------------------------------------------------------------------------
# Resume
# ---------------------------------------------------------------------------------------------


def other_data_message(folder: Path, then: dict[str, Any] | None, now: dict[str, Any]) -> str | None:
    """Why a resume on `now` would continue on other data than the run's, or None when it is the
    same (a checkpoint from before fingerprints were recorded has nothing to compare)."""
    if then is None or all(then.get(k) == now[k] for k in ("layout", "samples", "digest")):
        return None
    return (
        f"--resume: {folder} was trained on {then['path']} ({then['layout']} layout, {then['samples']} samples); "
        f"{now['path']} is other data ({now['layout']} layout, {now['samples']} samples"
        f"{', other samples' if then['layout'] == now['layout'] else ''}), and the run's held-out split and best "
        "step would mix both: resume on the run's own dataset, or train into another --out"
    )


STATE_KEYS = ("step", "best", "trajectory", "plan", "done", "optimizer", "scheduler", "rng", "data")


def state_problem(state: Any) -> str | None:
    """What in a checkpoint's training state no run of eaglet's writes (None: nothing): its step
    and plan drive the loop, so a damaged one would train forever or fail deep inside."""
    if not isinstance(state, dict) or any(k not in state for k in STATE_KEYS):
        missing = [k for k in STATE_KEYS if not isinstance(state, dict) or k not in state]
        return f"no {', '.join(missing)}"
    step, plan, trajectory, best = state["step"], state["plan"], state["trajectory"], state["best"]
    if not (type(step) is int and step >= 0) or not isinstance(trajectory, dict) or not isinstance(best, dict):
        return f"step {step!r}, trajectory or best of the wrong kind"
    counts = ("total_steps", "eval_every", "save_every")
    if not isinstance(plan, dict) or any(type(plan.get(k)) is not int or plan[k] < 1 for k in counts):
        return f"plan {plan!r}: {', '.join(counts)} must be whole numbers >= 1"
    if step > plan["total_steps"]:
        return f"step {step} is past the plan's {plan['total_steps']} steps"
    given = trajectory.get("total_steps")
    if type(given) is int and trajectory.get("time_budget") is None and plan["total_steps"] != given:
        return f"plan of {plan['total_steps']} steps, the run's --total-steps is {given}"
    if best.get("step") is not None and not (type(best["step"]) is int and 0 <= best["step"] <= step):
        return f"best step {best['step']!r}, at most the checkpoint's step {step}"
    return None


def read_state(folder: Path) -> dict[str, Any]:
    """A checkpoint's training state, refused with the file named when damaged."""
    state = formats.torch_load_safe(folder / STATE_FILE)
    problem = state_problem(state)
    if problem:
        raise ValueError(
            f"{folder / STATE_FILE}: damaged ({problem}); restore the checkpoint, or train into another --out"
        )
    return state


def restore(
    folder: Path,
    draft: DraftModel,
    opt: torch.optim.Optimizer,
    sched: Any,
    trajectory: dict[str, Any],
    data: dict[str, Any],
) -> tuple[int, dict[str, Any], dict[str, Any]]:
    """Load weights, optimizer, scheduler and RNG from a checkpoint; (step, best, the saved
    training state) to continue from. Refuses other data (`data`: Source.fingerprint) or settings."""
    if not (folder / STATE_FILE).exists():
        raise FileNotFoundError(
            f"{folder.parent / LATEST_FILE}: names {folder.name}, which has no {STATE_FILE}; the "
            "run folder was changed by hand: restore the checkpoint, or train into another --out"
        )
    state = read_state(folder)
    other = other_data_message(folder, state.get("data"), data)
    if other:
        raise ValueError(other)
    then = state["trajectory"]
    # A key an older checkpoint lacks was not recorded then: nothing to compare it with.
    diff = {k: (then[k], v) for k, v in trajectory.items() if k in then and then[k] != v}
    if diff:
        raise ValueError(
            f"--resume: {folder} was trained with other settings {{option: (then, now)}}: {diff}; "
            "leave these options out (a resume takes the run's own) or train into another --out"
        )
    load_draft_weights(draft, folder, keep_frozen=True)
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])
    log.info("resumed from %s (step %d)", folder, state["step"])
    return state["step"], state["best"], state


# Options that belong to one invocation, not to the run: a resume does not take them from it. The
# offload folder is scratch space of one process (a temporary one unless given), and a path read
# back from the run folder could lead the weights anywhere.
PER_INVOCATION = ("stop_after", "device", "offload_folder")


def resumed_options(out: Path) -> dict[str, Any]:
    """The TrainConfig options the run in `out` was started with ({} when it recorded none yet).

    train_config.json holds every option (its total_steps and warmup_steps as the schedule sized them);
    the checkpoint's trajectory holds the trajectory options exactly as given."""
    ckpt_root = out / CHECKPOINTS_DIR
    latest = read_pointer(ckpt_root, LATEST_FILE)
    if not (out / TRAIN_CONFIG_FILE).exists():
        return {}
    names = {f.name for f in fields(TrainConfig)} - set(PER_INVOCATION)
    saved = formats.read_json(out / TRAIN_CONFIG_FILE)
    # killed before its first checkpoint: train_config.json, written at the start, holds the run's options
    trajectory = read_state(ckpt_root / latest["path"])["trajectory"] if latest else {}
    return {k: v for k, v in {**saved, **trajectory}.items() if k in names}


def truncate_metrics(path: Path, step: int) -> None:
    """Drop metric lines a killed run wrote after the checkpoint we resume from. A link is refused:
    the run appends to this file, and an append follows a link out of the run folder."""
    if path.is_symlink():
        raise ValueError(
            f"{path}: a link (to {os.readlink(path)}); a run writes its metrics inside its folder only: "
            "remove the link, or train into another --out"
        )
    if not path.exists():
        return
    records = formats.read_jsonl_log(path)
    for n, r in enumerate(records, 1):
        if not isinstance(r, dict) or type(r.get("step")) is not int or r["step"] < 0:
            raise ValueError(
                f"{path}: record {n} ({json.dumps(r)[:80]}) is no metric line of a run (no step "
                "number >= 0); restore the file or remove that line, then resume"
            )
    keep = [r for r in records if r["step"] <= step]
    formats.write_text_atomic(path, "".join(json.dumps(r) + "\n" for r in keep))


# ---------------------------------------------------------------------------------------------
# Metrics
# ---------------------------------------------------------------------------------------------


class MetricsLog:
    """metrics.jsonl (always) and TensorBoard (only when the `tensorboard` package is present)."""

    def __init__(self, out: Path, enabled: bool):
        self.path, self.enabled, self.tb = out / METRICS_FILE, enabled, None
        if not enabled:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter  # optional: needs the `tensorboard` package

            self.tb = SummaryWriter(str(out / "tensorboard"))
        except ImportError:
            log.info("tensorboard is not installed; metrics go to %s only", self.path)

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with open(self.path, "ab") as f:  # one write per line: a kill leaves at worst a torn last line
            f.write((json.dumps(record) + "\n").encode("utf-8"))
        if self.tb is not None:
            split, step = record["split"], record["step"]
            for k, (loss, acc) in enumerate(zip(record["loss"], record["acc"])):
                if loss is not None:
                    self.tb.add_scalar(f"{split}/loss_{k}", loss, step)
                self.tb.add_scalar(f"{split}/acc_{k}", acc, step)
            self.tb.add_scalar(f"{split}/tau", record["tau"], step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def iter_metrics(out_dir: str | Path) -> Iterator[dict[str, Any]]:
    """metrics.jsonl's records; a torn last line (a kill mid-write) is dropped with a warning."""
    yield from formats.read_jsonl_log(Path(out_dir) / METRICS_FILE)


# ---------------------------------------------------------------------------------------------
# One writer per run folder
# ---------------------------------------------------------------------------------------------

RunFolderBusy = formats.OutputBusy  # another process holds the run folder's lock


@contextlib.contextmanager
def run_lock(out: Path, enabled: bool = True) -> Iterator[None]:
    """One writer per run folder: an exclusive lock on OUT/.lock for the whole run
    (`formats.output_lock`: a killed run never leaves it stuck). Only rank 0 writes, so only rank 0
    takes it."""
    if not enabled:
        yield
        return
    formats.claim_output(out, "train")  # before the lock, which lives inside the run folder
    with formats.output_lock(
        out,
        "train",
        "is writing this run folder; wait for it to end, or train into another --out",
        lock=out / LOCK_FILE,
    ):
        yield
