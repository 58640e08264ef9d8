"""The run folder of `eaglet train`, as files: where its checkpoints, pointers, metrics and
config live, and which checkpoint a path names. Training writes it (`eaglet.training.checkpoints`);
export, eval and the held-out evaluation read it through `resolve_checkpoint`.

Layout of a run folder: `metrics.jsonl`, `train_config.json`, `.lock`,
`checkpoints/step_XXXXXXXX/{model.safetensors, config.json, training_state.pt}`,
`checkpoints/latest.json` and `checkpoints/best.json` (`{"step": N, "path": "step_..."}`).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from eaglet.formats.drafters import DRAFTER_CONFIG_FILE, DRAFTER_WEIGHTS_FILE
from eaglet.formats.io import inside_folder, read_json

CHECKPOINTS_DIR = "checkpoints"
METRICS_FILE = "metrics.jsonl"
MODEL_FILE = DRAFTER_WEIGHTS_FILE
STATE_FILE = "training_state.pt"
LATEST_FILE = "latest.json"
BEST_FILE = "best.json"
TRAIN_CONFIG_FILE = "train_config.json"
LOCK_FILE = ".lock"


def checkpoint_name(step: int) -> str:
    """The folder of the checkpoint at `step`, under checkpoints/."""
    return f"step_{step:08d}"


CHECKPOINT_NAME_RE = re.compile(r"step_\d{8,}")  # what `checkpoint_name` writes, and nothing else


def is_checkpoint_name(name: str) -> bool:
    """A folder name `checkpoint_name` writes (a user's `step_00000004.bak` is not one)."""
    return CHECKPOINT_NAME_RE.fullmatch(name) is not None


# What `save_checkpoint` writes into a checkpoint folder, and nothing else
CHECKPOINT_FILES = frozenset({DRAFTER_CONFIG_FILE, MODEL_FILE, STATE_FILE})


def is_own_checkpoint(folder: Path) -> bool:
    """A checkpoint folder as a run wrote it: its name, and its files and no others (pruning may
    delete it; a folder a user put there, or one holding a user's files, is not the run's)."""
    if not is_checkpoint_name(folder.name) or folder.is_symlink() or not folder.is_dir():
        return False
    names = set(os.listdir(folder))
    return STATE_FILE in names and names <= CHECKPOINT_FILES


def run_checkpoints_above(path: str | os.PathLike) -> Path | None:
    """The checkpoints/ folder of a train run that `path` is in (or is), if any: a run prunes it."""
    here = Path(os.path.realpath(path))
    for folder in (here, *here.parents):
        if folder.name == CHECKPOINTS_DIR and (folder.parent / TRAIN_CONFIG_FILE).exists():
            return folder
    return None


def refuse_inside_checkpoints(out: str | os.PathLike, stage: str) -> None:
    """A drafter folder is never written among a run's checkpoints: the run's pruning deletes
    step folders there, and a folder named like one would pass for a checkpoint."""
    folder = run_checkpoints_above(out)
    if folder is not None:
        raise FileExistsError(
            f"--out {out}: inside {folder}, a train run's checkpoints, which the run prunes as it "
            f"goes: nothing was written; `eaglet {stage}` elsewhere, e.g. into "
            f"{folder.parent / 'exported'}"
        )


def read_pointer(ckpt_root: Path, name: str) -> dict[str, Any] | None:
    """latest.json or best.json (None when absent): its "path" names a checkpoint folder inside
    `ckpt_root`, or the file is refused, named (a hand-edited path could lead export elsewhere)."""
    path = ckpt_root / name
    if not path.exists():
        return None
    pointer = read_json(path)
    if not isinstance(pointer, dict) or not isinstance(pointer.get("path"), str):
        raise ValueError(
            f'{path}: expected {{"step": N, "path": "step_..."}}, found {str(pointer)[:80]}; '
            "`eaglet train DATA --out RUN --resume` rewrites it, or name a checkpoint folder"
        )
    inside_folder(ckpt_root, pointer["path"], str(path))
    return pointer


def resolve_checkpoint(path: str | Path) -> Path:
    """A folder with config.json as is; a train run folder (or its checkpoints/) -> its best,
    else latest, checkpoint."""
    p = Path(path)
    if (p / DRAFTER_CONFIG_FILE).exists():
        return p
    for root in (p / CHECKPOINTS_DIR, p):
        for pointer in (BEST_FILE, LATEST_FILE):
            read = read_pointer(root, pointer)
            if read is not None:
                folder = root / read["path"]
                if not (folder / DRAFTER_CONFIG_FILE).exists():
                    raise FileNotFoundError(
                        f"{root / pointer}: names {folder.name}, which is not a complete "
                        "checkpoint (deleted or changed by hand); `eaglet train DATA --out "
                        f"{p} --resume` rewrites the pointers, or name a checkpoint folder"
                    )
                return folder
    raise FileNotFoundError(f"{p}: no {DRAFTER_CONFIG_FILE}, and no {CHECKPOINTS_DIR}/{BEST_FILE} pointing at one")
