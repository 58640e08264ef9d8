"""What every hidden-state dataset layout shares: the side files beside its sample files, how
layer ids and the last state are recorded, and the common views a layout's reader maps its files
to (training's `TrainingSample`, `eaglet check`'s `FileStates` with its `Finding`s).

Whether the last state is before or after the target's final norm is a property of the dataset
(data_config.json, or the layout's convention), not of a file.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

import torch

from eaglet import layers
from eaglet.formats.io import read_json, write_json_atomic

HIDDEN_STATES_DIR = "hidden_states"
DATA_CONFIG_FILE = "data_config.json"
SAMPLE_LENGTHS_FILE = "sample_lengths.json"
ROWS_PER_FOLDER = 2000
# rows_{a}-{b}: the folder of samples a..b-1 (v1's name; SpecForge and the compact layout group files the same way)
V1_FOLDER_RE = re.compile(r"^rows_(\d+)-(\d+)$")

# How layer ids index the target: id 0 = embeddings, id k = output of decoder layer k-1
# (Hugging Face `output_hidden_states`, vLLM and SGLang all count this way).
LAYER_ID_CONVENTION = "hf_hidden_states: 0 = embeddings, k = output of decoder layer k-1"
# The last state (id N) is stored before the target's final norm, as vLLM/speculators do;
# the teacher distribution is lm_head(final_norm(h_N)).
LAST_STATE_PRE_NORM = "pre_norm"
LAST_STATE_POST_NORM = "post_norm"  # the last state after the target's final norm (SpecForge's `hidden_state`)
LAST_STATE_CONVENTIONS = (LAST_STATE_PRE_NORM, LAST_STATE_POST_NORM)
EAGLE3_NUM_STATES = layers.NUM_STORED  # three aux states (low, mid, high), then the last layer's


def rows_folder(index: int, rows_per_folder: int = ROWS_PER_FOLDER) -> str:
    """`rows_{a}-{b}`, the folder of sample `index` in the layouts that group files by rows."""
    start = (index // rows_per_folder) * rows_per_folder
    return f"rows_{start}-{start + rows_per_folder}"


def write_sample_lengths(path: str | os.PathLike, lengths: dict[int, int]) -> None:
    write_json_atomic(path, {str(i): int(n) for i, n in sorted(lengths.items())})


def read_sample_lengths(path: str | os.PathLike) -> dict[int, int]:
    """{sample index: tokens}; anything else is named with the file."""
    raw = read_json(path)
    try:
        if not isinstance(raw, dict):
            raise TypeError(f"a JSON {type(raw).__name__}")
        wrong = [f"{k!r}: {v!r}" for k, v in raw.items() if type(v) is not int or not k.isdigit()]
        if wrong:  # "35" or 35.0 for a count: not what eaglet writes, so not a file to trust
            raise TypeError(f"entries {', '.join(wrong[:3])} are no index: token count")
        return {int(k): v for k, v in raw.items()}
    except (TypeError, ValueError) as e:
        raise ValueError(
            f'{path}: expected {{"sample index": tokens, ...}} ({e}); `eaglet check` for the full '
            "report, or extract the dataset again"
        ) from None


# ---------------------------------------------------------------------------------------------
# The training view: every layout's reader returns the same fields
# ---------------------------------------------------------------------------------------------


@dataclass
class StoredTeacher:
    """The target's top-K next tokens at each position (full vocabulary ids, most likely first)."""

    ids: torch.Tensor  # int32 [T, K]
    log_probs: torch.Tensor  # fp16 [T, K], log_softmax over the full vocabulary


@dataclass
class TrainingSample:
    input_ids: torch.Tensor  # int64 [T]
    aux_hidden: torch.Tensor  # [T, 3H]: the three aux states concatenated in layer-id order
    last_hidden: torch.Tensor | None  # [T, H]: the last layer's state (None: the compact layout stores the teacher)
    loss_mask: torch.Tensor  # int64 [T]
    teacher: StoredTeacher | None = None  # the compact layout's stored teacher


def eagle3_states(path: str | os.PathLike, states: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(aux [T, 3H], last [T, H]) from the states in layer-id order."""
    if len(states) != EAGLE3_NUM_STATES:
        raise ValueError(
            f"{path}: {len(states)} hidden states; EAGLE-3 training needs {EAGLE3_NUM_STATES} "
            "(three aux layers, then the last layer)"
        )
    return torch.cat(states[:-1], dim=-1), states[-1]


def drop_batch_dim(t: Any, dims: int) -> Any:
    """SpecForge versions differ on a leading batch dimension of 1; accept both."""
    if isinstance(t, torch.Tensor) and t.dim() == dims + 1 and t.shape[0] == 1:
        return t[0]
    return t


# ---------------------------------------------------------------------------------------------
# The check view: a file's states in layer-id order, with what its own schema gets wrong
# ---------------------------------------------------------------------------------------------

# The kinds of finding a layout's schema hook reports; `eaglet check` reports them under these
# names (stable: tests and `--json` users match on them), beside the kinds of its own checks.
WRONG_KEYS = "wrong keys"
WRONG_DTYPE = "wrong dtype"
WRONG_SHAPE = "wrong shape"
TABLE_ROW = "file vs table row"  # speculators' layout: a hs_{i} file against row i of its Arrow table
AUX_CODES = "impossible aux codes"  # the compact layout's 6-bit codes and scales no encoder output has


@dataclass(frozen=True)
class Finding:
    """Something wrong with one file's schema, found by its layout (check adds the file's path)."""

    kind: str  # one of the kinds above
    message: str


@dataclass
class FileStates:
    """One file in the common shape every layout maps to for `eaglet check`: states in layer-id order.

    Fields are as stored (not yet checked to be tensors of the right dtype: that is check's job)."""

    input_ids: Any
    loss_mask: Any | None  # None: the layout stores none (speculators >= 0.5 may not)
    states: list[torch.Tensor]  # the compact layout's: the three aux states, dequantized
    teacher: StoredTeacher | None = None  # the compact layout's top-K in place of the last state


def keys_findings(obj: Any, expected: tuple[str, ...], optional: tuple[str, ...] = ()) -> list[Finding]:
    """A WRONG_KEYS finding when `obj` is not a dict of exactly `expected` (plus `optional`) keys."""
    if not isinstance(obj, dict):
        return [Finding(WRONG_KEYS, f"expected a dict of {list(expected)}, got {type(obj).__name__}")]
    missing = [k for k in expected if k not in obj]
    extra = sorted(str(k) for k in obj if k not in expected and k not in optional)
    if missing or extra:
        return [Finding(WRONG_KEYS, f"keys {sorted(map(str, obj))}: missing {missing}, unexpected {extra}")]
    return []


def lacks_keys(obj: Any, expected: tuple[str, ...]) -> bool:
    """Whether `obj` cannot be read at all for want of a dict or of one of the `expected` keys
    (extra keys are reported, but the file is still read)."""
    return not isinstance(obj, dict) or any(k not in obj for k in expected)


def sparse_tensors(obj: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
    """(key, tensor) of each tensor of a file (in lists too) that is not dense: no reader takes one."""
    tensors = [(k, t) for k, v in obj.items() for t in (v if isinstance(v, (list, tuple)) else [v])]
    return [(k, t) for k, t in tensors if isinstance(t, torch.Tensor) and t.layout != torch.strided]


def stored_kind_findings(
    obj: dict[str, Any], token_names: tuple[str, ...], allowed: tuple[torch.dtype, ...] = (torch.int64,)
) -> list[Finding]:
    """What a file's tensors must be as its layout stores them (docs/formats.md): token ids and
    masks of the `allowed` integer kinds (int64; a narrower one cuts ids above its range), every
    tensor dense (a sparse one is no state any reader takes)."""
    kinds = " or ".join(str(d).removeprefix("torch.") for d in allowed)
    found = [
        Finding(WRONG_DTYPE, f"{name} is {str(t.dtype).removeprefix('torch.')}: the layout stores {kinds}")
        for name in token_names
        if isinstance(t := obj.get(name), torch.Tensor) and t.dtype not in allowed
    ]
    return found + [
        Finding(WRONG_DTYPE, f"{k} is a {t.layout} tensor: the layout stores dense (strided) tensors")
        for k, t in sparse_tensors(obj)
    ]


def stacked_states_finding(hs: torch.Tensor) -> Finding | None:
    """safetensors layouts stack the states as `hidden_states` [T, S, H]."""
    return None if hs.dim() == 3 else Finding(WRONG_SHAPE, f"hidden_states {tuple(hs.shape)}: expected [T, S, H]")


def fmt_rows(rows: list[int], limit: int = 5) -> str:
    """The first `limit` of `rows`, and how many there are when there are more (for messages)."""
    shown = ", ".join(map(str, rows[:limit]))
    return shown + (f", ... ({len(rows)} rows)" if len(rows) > limit else "")
