"""`eaglet check DIR`: prove a hidden-state dataset is right before GPU hours go into training.

Every file is read (never a sample of them), only with `torch.load(weights_only=True)` or
safetensors, so a file that needs arbitrary pickled objects is reported, never executed.
Per file: schema (keys, dtypes, shapes), values (mask 0/1 and not empty, token ids in range,
no NaN/Inf, no all-zero rows, sane RMS). Per dataset: side files agree with the files, no
duplicate or missing index, folder naming. With a target: a few sampled files are recomputed
and every stored slot is matched against every layer, so a wrong id, order or norm convention
is named ("slot 2 matches layer 28, not 27"); the loss mask is checked against the assistant
spans the chat template produces.

Entry point: `check_dataset(path, target=None, ...) -> CheckReport`.
"""

from __future__ import annotations

import contextlib
import math
import os
import pickle
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from eaglet import formats, ranges

# Problem kinds: stable names (tests and `--json` users match on them), grouped in the report.
UNSAFE_PICKLE = "unsafe pickle"
UNREADABLE = "unreadable file"
WRONG_KEYS = "wrong keys"
WRONG_DTYPE = "wrong dtype"
WRONG_SHAPE = "wrong shape"
LENGTH_MISMATCH = "length mismatch"
HIDDEN_SIZE = "hidden size mismatch"
STATE_COUNT = "hidden state count mismatch"
MASK_VALUES = "loss_mask not 0/1"
MASK_EMPTY = "empty loss_mask"
TOKEN_RANGE = "token id out of range"
NON_FINITE = "NaN/Inf"
ALL_ZERO = "all-zero hidden state"
RMS_BOUNDS = "RMS out of bounds"
DATA_CONFIG = "data_config.json"
SAMPLE_LENGTHS = "sample_lengths.json"
TOKEN_FREQ = "token_freq.pt"
DUPLICATE_INDEX = "duplicate index"
MISSING_INDEX = "missing index"
FOLDER_NAMING = "folder naming"
STRAY_FILE = "stray file"
BROKEN_LINK = "broken link"
TABLE_ROW = "file vs table row"  # speculators' layout: a hs_{i} file against row i of its Arrow table
STORED_TEACHER = "stored teacher"  # the compact layout's top-K of the target
CHECKSUM = "checksum mismatch"  # the compact layout's tensors against the checksums written with them
AUX_CODES = "impossible aux codes"  # the compact layout's 6-bit codes and scales no encoder output has
NO_FILES = "no hidden-state files"
LAYER_IDENTITY = "layer identity"
MASK_TEMPLATE = "mask vs chat template"
TOO_LONG = "longer than the target"  # more tokens than the target has positions
NOT_CHECKED = "not checked"

ERROR, WARNING = "error", "warning"

# RMS of one stored state (a whole [T, H] tensor). Below the floor a state carries no signal;
# above the ceiling it is headed for fp16/bf16 overflow. Both are far outside what real targets
# produce (tiny random models ~0.02, 70B residual streams tens to hundreds).
RMS_FLOOR, RMS_CEILING = 1e-5, 1e4
# A file whose median row RMS in a slot is this far from the dataset's median for that slot is
# an outlier (a different layer or a different model). Median rows, not the plain RMS: the
# first token's "attention sink" row is hundreds of times larger than the rest, so the plain
# RMS of a short file is dominated by it and would flag every short file.
RMS_OUTLIER_FACTOR = 10.0
# Layer identity: a stored slot "is" a recomputed state when it is this close. bf16 storage
# alone gives rel err ~0.004; a recompute on other hardware / kernels adds a little.
IDENTITY_COS, IDENTITY_REL_ERR = 0.99, 0.1
# ...and it "is another layer" when another candidate is at least this much closer.
IDENTITY_MARGIN = 0.5
TEACHER_AGREEMENT = 0.9  # next-token argmax of the stored last state vs the recomputed one
# A compact file's stored log-probabilities against the recomputed target's, mean over positions:
# fp16 storage and the bf16 last state they were computed from account for a few hundredths.
TEACHER_LOG_PROB_ERR = 0.1


# ---------------------------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Problem:
    kind: str  # one of the kinds above
    path: str  # file (relative to the dataset folder) or side file the problem is in
    message: str
    severity: str = ERROR  # warnings are reported but do not make the dataset unclean


@dataclass
class Expect:
    """What every file must look like: from data_config.json, else from the first file."""

    format: str
    hidden_size: int | None = None
    num_states: int | None = None
    dtype: str | None = None  # e.g. "bfloat16"
    vocab_size: int | None = None
    source: str = "data_config.json"  # where these expectations come from (said in messages)
    teacher_top_k: int | None = None  # the compact layout's K (data_config.json)
    compact_version: int | None = None  # the compact layout's version (data_config.json): 1 has no checksums
    gen_prompt_ids: list[int] | None = None  # the chat template's generation prompt, tokenized
    eot_ids: frozenset[int] = frozenset()  # special tokens that can end an assistant turn


@dataclass
class Sample:
    """One file in the common shape every layout maps to: states in layer-id order."""

    input_ids: torch.Tensor
    loss_mask: torch.Tensor | None  # None: the format stores none (speculators >= 0.5 may not)
    states: list[torch.Tensor]  # the compact layout's: the three aux states, dequantized
    teacher: formats.StoredTeacher | None = None  # the compact layout's top-K in place of the last state


@dataclass
class FileResult:
    index: int
    path: str  # relative to the dataset folder
    nbytes: int
    problems: list[Problem] = field(default_factory=list)
    readable: bool = False
    schema_ok: bool = False  # shapes and dtypes all as expected (layer identity needs this)
    length: int | None = None
    masked: int = 0
    hidden_size: int | None = None
    num_states: int | None = None
    dtype: str | None = None
    slot_sumsq: list[float] = field(default_factory=list)  # per slot, over finite rows
    slot_elems: list[int] = field(default_factory=list)
    slot_median_row_rms: list[float] = field(default_factory=list)
    slot_max_row_rms: list[float] = field(default_factory=list)
    masked_tokens: tuple[list[int], list[int]] = ((), ())  # (token ids, counts) over masked positions
    template_checked: bool = False  # the mask was compared with the chat template's assistant spans


@dataclass
class SlotStats:
    slot: int
    layer: str
    rms: float
    median_row_rms: float  # mean over files of the file's median row RMS
    min_file_median_row_rms: float
    max_file_median_row_rms: float
    max_row_rms: float


@dataclass
class SlotIdentity:
    slot: int
    expected: str
    best: str
    cos: float  # mean row cosine with the expected state (worst sampled file)
    rel_err: float  # ||stored - expected|| / ||expected|| (worst sampled file)
    max_abs_err: float
    best_cos: float
    best_rel_err: float


@dataclass
class CheckReport:
    path: str
    format: str | None = None
    files: int = 0
    samples: int = 0
    tokens: int = 0
    masked_tokens: int = 0
    bytes: int = 0
    seconds: float = 0.0
    workers: int = 1
    length_histogram: dict[str, int] = field(default_factory=dict)
    slots: list[SlotStats] = field(default_factory=list)
    identity: list[SlotIdentity] = field(default_factory=list)
    identity_files: list[str] = field(default_factory=list)
    target: str | None = None
    next_token_accuracy: dict[str, float] = field(default_factory=dict)
    template_checked_files: int = 0
    generation_prompt: str | None = None
    problems: list[Problem] = field(default_factory=list)

    @property
    def errors(self) -> list[Problem]:
        return [p for p in self.problems if p.severity == ERROR]

    @property
    def clean(self) -> bool:
        return not self.errors

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["clean"] = self.clean
        d["problem_counts"] = dict(Counter(p.kind for p in self.errors))
        d["warning_counts"] = dict(Counter(p.kind for p in self.problems if p.severity == WARNING))
        return d

    def lines(self, max_per_kind: int = 10) -> list[str]:
        return report_lines(self, max_per_kind)


# ---------------------------------------------------------------------------------------------
# Loading: only weights_only / safetensors; errors classified, never raised
# ---------------------------------------------------------------------------------------------

# What torch's weights-only unpickler says when a file asks for an object outside its
# allow-list (a class, a function to call). Garbage bytes also raise UnpicklingError, but with
# "Unsupported operand" and the like: those are corrupt files, not unsafe ones.
UNSAFE_PICKLE_MARKERS = formats.PICKLED_CODE_MARKERS  # torch's words for a pickle that needs code


def is_unsafe_pickle_error(e: BaseException) -> bool:
    return isinstance(e, pickle.UnpicklingError) and any(m in str(e) for m in UNSAFE_PICKLE_MARKERS)


def unsafe_global_name(e: BaseException) -> str:
    for line in str(e).splitlines():
        if "Unsupported global" in line:
            return line.split("GLOBAL", 1)[-1].split(" was not")[0].strip()
    return "a non-tensor object"


@dataclass
class TableSample:
    """A speculators-layout file with its row of the Arrow table (None when the table has no such row)."""

    tensors: dict[str, torch.Tensor]
    row: int
    table_rows: int
    fields: tuple[torch.Tensor, torch.Tensor, int] | None  # (input_ids, loss_mask, seq_len)


def load_raw(path: Path, fmt: str) -> Any:
    if fmt == formats.FORMAT_SPECULATORS_ARROW:
        folder, row = formats.speculators_row_of(path)
        tensors, rows = formats.read_safetensors(path), len(formats.read_speculators_rows(folder))
        return TableSample(tensors, row, rows, formats.speculators_row(folder, row) if row < rows else None)
    if fmt == formats.FORMAT_SPECFORGE:
        return formats.read_specforge_sample(path)
    if fmt == formats.FORMAT_COMPACT:
        return formats.read_compact_file(path)
    if fmt == formats.FORMAT_HS_SAFETENSORS:
        return formats.read_safetensors(path)
    return formats.torch_load_safe_mmap(path)


def load_problem(e: BaseException, rel: str) -> Problem:
    if is_unsafe_pickle_error(e):
        return Problem(UNSAFE_PICKLE, rel, f"needs arbitrary pickled objects ({unsafe_global_name(e)}); "
                                           "refused by torch.load(weights_only=True), not executed")
    text = str(e)
    if "central directory" in text:  # torch.save writes a zip; its directory is at the very end
        why = "not a complete zip archive (its central directory, at the end of the file, is missing)"
    elif "WeightsUnpickler error:" in text:  # the useful part of the weights-only unpickler's message
        why = text.split("WeightsUnpickler error:", 1)[1].strip().splitlines()[0][:120]
    else:
        why = (text.strip().splitlines() or [""])[0][:120]
    return Problem(UNREADABLE, rel, f"truncated or corrupt: {type(e).__name__}: {why}")


# ---------------------------------------------------------------------------------------------
# Schema: each layout -> Sample, with the problems of its own keys and shapes
# ---------------------------------------------------------------------------------------------

def keys_problem(obj: Any, expected: tuple[str, ...], optional: tuple[str, ...], rel: str) -> Problem | None:
    if not isinstance(obj, dict):
        return Problem(WRONG_KEYS, rel, f"expected a dict of {list(expected)}, got {type(obj).__name__}")
    missing = [k for k in expected if k not in obj]
    extra = sorted(str(k) for k in obj if k not in expected and k not in optional)
    if missing or extra:
        return Problem(WRONG_KEYS, rel, f"keys {sorted(map(str, obj))}: missing {missing}, unexpected {extra}")
    return None


def strip_batch_dim(t: Any, dims: int) -> Any:
    """SpecForge versions differ on a leading batch dimension of 1; accept both."""
    if isinstance(t, torch.Tensor) and t.dim() == dims + 1 and t.shape[0] == 1:
        return t[0]
    return t


def to_sample(obj: Any, fmt: str, rel: str) -> tuple[Sample | None, list[Problem]]:
    if fmt in (formats.FORMAT_V1, formats.FORMAT_V1_FLAT):
        p = keys_problem(obj, formats.V1_KEYS, (), rel)
        if p and (not isinstance(obj, dict) or any(k not in obj for k in formats.V1_KEYS)):
            return None, [p]
        hs = obj["hidden_states"]
        if not isinstance(hs, (list, tuple)) or not all(isinstance(h, torch.Tensor) for h in hs):
            return None, [p] if p else [Problem(WRONG_SHAPE, rel, "hidden_states must be a list of tensors")]
        return Sample(obj["input_ids"], obj["loss_mask"], list(hs)), [p] if p else []
    if fmt == formats.FORMAT_SPECFORGE:
        p = keys_problem(obj, formats.SPECFORGE_KEYS, (), rel)
        if p and (not isinstance(obj, dict) or any(k not in obj for k in formats.SPECFORGE_KEYS)):
            return None, [p]
        last, aux = strip_batch_dim(obj["hidden_state"], 2), strip_batch_dim(obj["aux_hidden_state"], 2)
        ids, mask = strip_batch_dim(obj["input_ids"], 1), strip_batch_dim(obj["loss_mask"], 1)
        if not (isinstance(aux, torch.Tensor) and isinstance(last, torch.Tensor)) or aux.dim() != 2 or last.dim() != 2 \
                or aux.shape[-1] != 3 * last.shape[-1]:
            shapes = [tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__ for t in (last, aux)]
            return None, ([p] if p else []) + [Problem(WRONG_SHAPE, rel, f"hidden_state {shapes[0]} and aux_hidden_state "
                                                                         f"{shapes[1]}: expected [T, H] and [T, 3H]")]
        # aux_hidden_state is the three aux states concatenated low, mid, high; the last comes after.
        return Sample(ids, mask, [*aux.chunk(3, dim=-1), last]), [p] if p else []
    if fmt == formats.FORMAT_SPECULATORS_ARROW:
        return table_sample(obj, rel)
    if fmt == formats.FORMAT_COMPACT:
        return compact_sample(obj, rel)
    if fmt == formats.FORMAT_HS_SAFETENSORS:
        p = keys_problem(obj, formats.HS_SAFETENSORS_KEYS, ("loss_mask",), rel)
        if p and (not isinstance(obj, dict) or any(k not in obj for k in formats.HS_SAFETENSORS_KEYS)):
            return None, [p]
        hs = obj["hidden_states"]
        if hs.dim() != 3:
            return None, ([p] if p else []) + [Problem(WRONG_SHAPE, rel, f"hidden_states {tuple(hs.shape)}: expected [T, S, H]")]
        return Sample(obj["token_ids"], obj.get("loss_mask"), list(hs.unbind(1))), [p] if p else []
    raise ValueError(f"unknown format {fmt}")


def table_sample(t: TableSample, rel: str) -> tuple[Sample | None, list[Problem]]:
    """The file's states with its table row's tokens and mask; the row must describe the file,
    or speculators skips the sample (token ids) or trains on a wrong mask (length)."""
    obj = t.tensors
    p = keys_problem(obj, formats.HS_SAFETENSORS_KEYS, ("loss_mask",), rel)
    if p and any(k not in obj for k in formats.HS_SAFETENSORS_KEYS):
        return None, [p]
    probs = [p] if p else []
    if t.fields is None:
        return None, probs + [Problem(TABLE_ROW, rel, f"no row {t.row} in the Arrow table ({t.table_rows} rows): "
                                                      "a file of another dataset, or a table written short")]
    ids, mask, seq_len = t.fields
    hs, token_ids = obj["hidden_states"], obj["token_ids"]
    if hs.dim() != 3:
        return None, probs + [Problem(WRONG_SHAPE, rel, f"hidden_states {tuple(hs.shape)}: expected [T, S, H]")]
    if token_ids.shape != ids.shape or not torch.equal(token_ids.long(), ids):
        where = (f"{token_ids.shape[0]} token ids, the row has {ids.shape[0]}" if token_ids.shape != ids.shape else
                 f"first difference at position {int((token_ids.long() != ids).nonzero()[0])}")
        probs.append(Problem(TABLE_ROW, rel, f"token_ids differ from row {t.row}'s input_ids ({where}): speculators "
                                             "skips this sample"))
    if seq_len != ids.shape[0]:
        probs.append(Problem(TABLE_ROW, rel, f"row {t.row}: seq_len {seq_len}, its input_ids hold {ids.shape[0]}"))
    return Sample(ids, mask, list(hs.unbind(1))), probs


COMPACT_DTYPES = {"aux_codes": (torch.uint8,), "aux_scales": (torch.float16,), "teacher_ids": (torch.int32,),
                  "teacher_log_probs": (torch.float16,), "loss_mask": (torch.uint8,),
                  "input_ids": (torch.int32, torch.int64)}


def checksum_problems(f: formats.CompactFile, exp: Expect, rel: str) -> list[Problem]:
    """One per tensor whose bytes do not match the checksum written with the file (a version-1
    dataset's files carry none: data_config.json's warning says so once)."""
    if exp.compact_version == formats.COMPACT_UNCHECKED_VERSION and not formats.has_compact_checksums(f.metadata):
        return []
    return [Problem(CHECKSUM, rel, f"{why}; {formats.COMPACT_REWRITE_FILE}")
            for why in formats.compact_checksum_problems(f)]


def impossible_codes_problem(codes: torch.Tensor, scales: torch.Tensor, aux: torch.Tensor,
                             rel: str) -> Problem | None:
    """The aux groups [T, 3, H/32] whose codes and scale the encoder cannot have written, by row
    (`aux`: the states they dequantize to)."""
    bad = formats.impossible_fp6_groups(codes, scales, aux)
    if not bad.any():
        return None
    t, s, g = (int(i) for i in bad.nonzero()[0])
    n, scale = formats.FP6_GROUP, float(scales[t, s, g])
    top = int((formats.unpack_6bit(codes[t, s]) & 31).reshape(-1, n)[g].max())
    why = ("a negative scale, which the encoder never writes" if math.copysign(1.0, scale) < 0 else
           f"scale 0 with codes up to magnitude {top}, but at scale 0 the encoder writes only +-0" if scale == 0 else
           f"largest code magnitude {top} at scale {scale:.3g}, but the encoder stores each group's largest value "
           "as 31 (E3M2's largest)")
    rows = bad.flatten(1).any(1).nonzero().flatten().tolist()
    return Problem(AUX_CODES, rel, f"aux row {t}, state {s}, values {g * n}..{(g + 1) * n - 1}: {why} "
                                   f"({int(bad.sum())} such groups, rows {fmt_rows(rows)}); "
                                   + formats.COMPACT_REWRITE_FILE)


def compact_sample(f: formats.CompactFile, rel: str) -> tuple[Sample | None, list[Problem]]:
    """The dequantized aux states and the stored teacher, after the layout's keys, dtypes and shapes
    and its codes' invariants."""
    obj = f.tensors
    p = keys_problem(obj, formats.COMPACT_KEYS, (), rel)
    if p and any(k not in obj for k in formats.COMPACT_KEYS):
        return None, [p]
    probs = [p] if p else []
    bad = [f"{k} is {obj[k].dtype}" for k, ok in COMPACT_DTYPES.items() if obj[k].dtype not in ok]
    if bad:
        return None, probs + [Problem(WRONG_DTYPE, rel, f"{', '.join(bad)}: expected " + ", ".join(
            f"{k} {'/'.join(str(d).removeprefix('torch.') for d in ok)}" for k, ok in COMPACT_DTYPES.items()))]
    try:
        formats.compact_fields(obj, rel)
    except ValueError as e:
        return None, probs + [Problem(WRONG_SHAPE, rel, str(e).removeprefix(f"{rel}: "))]
    aux = formats.dequantize_fp6(obj["aux_codes"], obj["aux_scales"])
    probs += [q for q in [impossible_codes_problem(obj["aux_codes"], obj["aux_scales"], aux, rel)] if q]
    teacher = formats.StoredTeacher(obj["teacher_ids"], obj["teacher_log_probs"])
    return Sample(obj["input_ids"], obj["loss_mask"], list(aux.unbind(1)), teacher), probs


def stored_teacher_problems(t: formats.StoredTeacher, vocab_size: int | None, rel: str) -> list[Problem]:
    """Ids inside the vocabulary and distinct per position; log-probabilities finite, <= 0, most
    likely first, summing to at most 1."""
    out = []
    ids, lp = t.ids.long(), t.log_probs.float()
    if vocab_size is not None and ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        out.append(Problem(STORED_TEACHER, rel, f"teacher_ids {int(ids.min())}..{int(ids.max())} outside "
                                                f"[0, {vocab_size})"))
    repeats = (ids.sort(-1).values.diff(dim=-1) == 0).any(-1)  # [T]: a token twice at that position
    if repeats.any():
        out.append(Problem(STORED_TEACHER, rel, f"teacher_ids repeat a token at position {int(repeats.nonzero()[0])}"))
    if not torch.isfinite(lp).all():
        out.append(Problem(STORED_TEACHER, rel, "teacher_log_probs hold NaN/Inf at positions "
                                                + fmt_rows((~torch.isfinite(lp)).any(-1).nonzero().flatten().tolist())))
        return out
    bad = (lp > 1e-3).any(-1) | (lp.diff(dim=-1) > 1e-3).any(-1) | (lp.exp().sum(-1) > 1.01)  # [T]
    if bad.any():
        out.append(Problem(STORED_TEACHER, rel, "teacher_log_probs are not log-probabilities of the most likely tokens "
                                                "in order (> 0, increasing, or summing past 1) at positions "
                                                + fmt_rows(bad.nonzero().flatten().tolist())))
    return out


def is_int_tensor(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool


def schema_problems(s: Sample, exp: Expect, rel: str) -> tuple[list[Problem], list[bool]]:
    """Dtype and shape problems, and per state whether it is well-formed enough for value checks."""
    out: list[Problem] = []
    src = f"({exp.source})"
    ids = s.input_ids
    if not is_int_tensor(ids) or ids.dim() != 1:
        what = f"{ids.dtype} {tuple(ids.shape)}" if isinstance(ids, torch.Tensor) else type(ids).__name__
        out.append(Problem(WRONG_DTYPE if isinstance(ids, torch.Tensor) and ids.dim() == 1 else WRONG_SHAPE, rel,
                           f"input_ids is {what}: expected an integer tensor [T]"))
        return out, [False] * len(s.states)
    T = ids.shape[0]
    if s.loss_mask is not None:
        m = s.loss_mask
        if not isinstance(m, torch.Tensor) or m.dim() != 1:
            out.append(Problem(WRONG_SHAPE, rel, f"loss_mask is {getattr(m, 'shape', type(m).__name__)}: expected [T]"))
        elif m.shape[0] != T:
            out.append(Problem(LENGTH_MISMATCH, rel, f"loss_mask has {m.shape[0]} entries, input_ids has {T}"))
        if isinstance(m, torch.Tensor) and not is_int_tensor(m):
            out.append(Problem(WRONG_DTYPE, rel, f"loss_mask is {m.dtype}: expected an integer dtype"))
    if exp.num_states is not None and len(s.states) != exp.num_states:
        out.append(Problem(STATE_COUNT, rel, f"{len(s.states)} hidden states, expected {exp.num_states} "
                                             f"(one per layer id) {src}"))
    usable = []
    for j, h in enumerate(s.states):
        ok = True
        if not h.is_floating_point():
            out.append(Problem(WRONG_DTYPE, rel, f"hidden state slot {j} is {h.dtype}: expected a float dtype"))
            ok = False
        elif exp.dtype and formats_dtype_name(h.dtype) != exp.dtype:
            out.append(Problem(WRONG_DTYPE, rel, f"hidden state slot {j} is {formats_dtype_name(h.dtype)}, "
                                                 f"recorded {exp.dtype} {src}"))
        if h.dim() != 2:
            out.append(Problem(WRONG_SHAPE, rel, f"hidden state slot {j} has shape {tuple(h.shape)}: expected [T, H]"))
            usable.append(False)
            continue
        if h.shape[0] != T:
            out.append(Problem(LENGTH_MISMATCH, rel, f"hidden state slot {j} has {h.shape[0]} rows, input_ids has {T}"))
            ok = False
        if exp.hidden_size is not None and h.shape[1] != exp.hidden_size:
            out.append(Problem(HIDDEN_SIZE, rel, f"hidden state slot {j} has H={h.shape[1]}, expected "
                                                 f"{exp.hidden_size} {src}"))
        usable.append(ok)
    return out, usable


def formats_dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---------------------------------------------------------------------------------------------
# Values
# ---------------------------------------------------------------------------------------------

def masked_runs(mask: list[int]) -> list[tuple[int, int]]:
    """[start, end) of every run of ones."""
    runs, start = [], None
    for i, m in enumerate(mask):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    if start is not None:
        runs.append((start, len(mask)))
    return runs


def mask_template_issues(ids: list[int], mask: list[int], gen: list[int], eot_ids: frozenset[int]) -> list[str]:
    """Compare the loss mask with the assistant spans the chat template implies.

    The messages are gone, so the template cannot be re-rendered; but `eaglet prepare` (and
    every correct pipeline) masks exactly "after the generation prompt, through the
    end-of-turn token". So: every masked run must start right after the generation prompt's
    tokens and end on a special (end-of-turn) token, unless the sample was truncated there;
    and every generation prompt followed by text must start a masked run, or an assistant
    turn was left out. A shifted, inverted or user-turn mask fails all three.
    """
    g, T = len(gen), len(ids)
    runs = masked_runs(mask)
    issues = []

    def after_prompt(s: int) -> bool:
        # Exact, or the prompt's last token merged with the first assistant token (BPE) and got masked.
        return ids[max(0, s - g):s] == gen or (g > 1 and ids[max(0, s - g + 1):s] == gen[:-1])

    for s, e in runs:
        if not after_prompt(s):
            issues.append(f"masked run at tokens {s}..{e - 1} does not start after the generation prompt")
        if e < T and ids[e - 1] not in eot_ids:
            issues.append(f"masked run at tokens {s}..{e - 1} does not end on an end-of-turn token")
    starts = {s for s, _ in runs}
    for p in range(T - g + 1):
        if ids[p] == gen[0] and ids[p:p + g] == gen:
            q = p + g
            if q < T and q not in starts and (q - 1) not in starts:
                issues.append(f"assistant turn at token {q} (after the generation prompt) is not in the loss mask")
    return issues


def state_value_problems(h: torch.Tensor, j: int, rel: str) -> tuple[list[Problem], float, int, float, float]:
    """NaN/Inf, zero rows and RMS of one [T, H] state, in one pass over the data.

    Returns problems, sum of squares and element count over finite rows, median and max row RMS.
    """
    out: list[Problem] = []
    T, H = h.shape
    if T == 0:
        return out, 0.0, 0, 0.0, 0.0
    row_norm = torch.linalg.vector_norm(h, dim=1, dtype=torch.float32)  # one read of the tensor
    finite = torch.isfinite(row_norm)
    if not bool(finite.all()):
        bad_rows = (~finite).nonzero().flatten()
        real = [int(r) for r in bad_rows[:1000] if not bool(torch.isfinite(h[r]).all())]
        if real:
            kinds = "NaN" if bool(torch.isnan(h[real[0]]).any()) else "Inf"
            out.append(Problem(NON_FINITE, rel, f"slot {j} row {real[0]}: {kinds} ({len(bad_rows)} of {T} rows "
                                                f"non-finite, rows {fmt_rows(bad_rows.tolist())})"))
        else:  # finite values whose square overflows fp32: still far out of any sane range
            out.append(Problem(RMS_BOUNDS, rel, f"slot {j} row {int(bad_rows[0])}: values beyond 1e19"))
    zero = (row_norm == 0).nonzero().flatten()
    if len(zero) == T:
        out.append(Problem(ALL_ZERO, rel, f"slot {j} is all zeros"))
    elif len(zero):
        out.append(Problem(ALL_ZERO, rel, f"slot {j}: {len(zero)} of {T} rows are all zeros "
                                          f"(rows {fmt_rows(zero.tolist())})"))
    fin = row_norm[finite].double()
    sumsq, elems = float((fin * fin).sum()), int(fin.numel()) * H
    rms = math.sqrt(sumsq / elems) if elems else 0.0
    if len(zero) < T and elems and not RMS_FLOOR <= rms <= RMS_CEILING:
        out.append(Problem(RMS_BOUNDS, rel, f"slot {j} RMS {rms:.3g} outside [{RMS_FLOOR:g}, {RMS_CEILING:g}]"))
    row_rms = fin / math.sqrt(H)
    med = float(row_rms.median()) if len(row_rms) else 0.0
    mx = float(row_rms.max()) if len(row_rms) else 0.0
    return out, sumsq, elems, med, mx


def fmt_rows(rows: list[int], limit: int = 5) -> str:
    shown = ", ".join(map(str, rows[:limit]))
    return shown + (f", ... ({len(rows)} rows)" if len(rows) > limit else "")


def check_file(index: int, path: Path, root: Path, exp: Expect) -> FileResult:
    """Everything one file can tell on its own. Runs in worker threads; never raises."""
    rel = str(path.relative_to(root))
    res = FileResult(index, rel, path.stat().st_size)
    try:
        obj = load_raw(path, exp.format)
    except Exception as e:  # any failure to load is a finding about the file, not a crash
        res.problems.append(load_problem(e, rel))
        return res
    res.readable = True
    damage = checksum_problems(obj, exp, rel) if isinstance(obj, formats.CompactFile) else []
    res.problems += damage
    try:
        sample, probs = to_sample(obj, exp.format, rel)
    except Exception as e:
        res.problems.append(Problem(WRONG_SHAPE, rel, f"unexpected content: {type(e).__name__}: {e}"))
        return res
    res.problems += probs
    if sample is None:
        return res
    schema, usable = schema_problems(sample, exp, rel)
    res.problems += schema
    res.num_states = len(sample.states)
    if sample.states and sample.states[0].dim() == 2:
        res.hidden_size, res.dtype = int(sample.states[0].shape[1]), formats_dtype_name(sample.states[0].dtype)
    if not is_int_tensor(sample.input_ids) or sample.input_ids.dim() != 1:
        return res
    res.schema_ok = not schema and not probs and not damage  # damaged bytes: no recompute can judge them
    ids = sample.input_ids
    res.length = T = int(ids.shape[0])
    if T and exp.vocab_size is not None:
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= exp.vocab_size:
            bad = ((ids < 0) | (ids >= exp.vocab_size)).nonzero().flatten().tolist()
            res.problems.append(Problem(TOKEN_RANGE, rel, f"token ids {lo}..{hi} outside [0, {exp.vocab_size}) "
                                                          f"at positions {fmt_rows(bad)}"))
    m = sample.loss_mask
    if m is not None and is_int_tensor(m) and m.dim() == 1:
        res.problems += mask_value_problems(m, rel)
        if m.shape[0] == T:
            masked_ids = ids[m == 1]
            res.masked = int(masked_ids.numel())
            u, c = torch.unique(masked_ids, return_counts=True)
            res.masked_tokens = (u.tolist(), c.tolist())
            if exp.gen_prompt_ids:
                res.template_checked = True
                issues = mask_template_issues(ids.tolist(), (m == 1).int().tolist(), exp.gen_prompt_ids, exp.eot_ids)
                if issues:
                    more = f" (+{len(issues) - 1} more)" if len(issues) > 1 else ""
                    res.problems.append(Problem(MASK_TEMPLATE, rel, issues[0] + more))
    if sample.teacher is not None:
        res.problems += stored_teacher_problems(sample.teacher, exp.vocab_size, rel)
        k = sample.teacher.ids.shape[1]
        if exp.teacher_top_k is not None and k != exp.teacher_top_k:
            res.problems.append(Problem(WRONG_SHAPE, rel, f"teacher_ids hold {k} tokens per position, expected "
                                                          f"{exp.teacher_top_k} ({exp.source})"))
    for j, (h, ok) in enumerate(zip(sample.states, usable)):
        if not ok:
            res.slot_sumsq.append(0.0), res.slot_elems.append(0)
            res.slot_median_row_rms.append(float("nan")), res.slot_max_row_rms.append(float("nan"))
            continue
        probs_j, sumsq, elems, med, mx = state_value_problems(h, j, rel)
        res.problems += probs_j
        res.slot_sumsq.append(sumsq), res.slot_elems.append(elems)
        res.slot_median_row_rms.append(med), res.slot_max_row_rms.append(mx)
    return res


def mask_value_problems(m: torch.Tensor, rel: str) -> list[Problem]:
    out = []
    bad = (m != 0) & (m != 1)
    if bool(bad.any()):
        vals = sorted(set(m[bad].tolist()))[:5]
        out.append(Problem(MASK_VALUES, rel, f"loss_mask holds {vals} at {int(bad.sum())} positions: expected only 0/1"))
    elif not bool((m == 1).any()):
        out.append(Problem(MASK_EMPTY, rel, f"loss_mask has no 1 in {m.shape[0]} positions: nothing to train on"))
    return out


# ---------------------------------------------------------------------------------------------
# Dataset level
# ---------------------------------------------------------------------------------------------

def read_config(root: Path, fmt: str | None) -> tuple[dict | None, list[Problem]]:
    path = root / formats.DATA_CONFIG_FILE
    if not path.exists():
        # This project's layout always has one; foreign layouts may not (then files set the bar).
        sev = ERROR if fmt in formats.EAGLET_LAYOUTS else WARNING
        return None, [Problem(DATA_CONFIG, formats.DATA_CONFIG_FILE, "missing: expectations are inferred from the "
                                                                      "first file", sev)]
    try:
        cfg = formats.read_json(path)
        if not isinstance(cfg, dict):
            raise ValueError(f"a JSON {type(cfg).__name__}, not an object")
    except Exception as e:
        return None, [Problem(DATA_CONFIG, formats.DATA_CONFIG_FILE, f"unreadable: {e}")]
    probs = []
    ids = cfg.get("layer_ids")
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        probs.append(Problem(DATA_CONFIG, formats.DATA_CONFIG_FILE, f"layer_ids {ids!r}: expected a list of ints"))
    else:
        if len(ids) != formats.EAGLE3_NUM_STATES:
            probs.append(Problem(DATA_CONFIG, formats.DATA_CONFIG_FILE,
                                 f"layer_ids {ids}: EAGLE-3 needs {formats.EAGLE3_NUM_STATES} states "
                                 f"({formats.EAGLE3_NUM_STATES - 1} aux layers and the last)"))
        if any(b <= a for a, b in zip(ids, ids[1:])):
            probs.append(Problem(DATA_CONFIG, formats.DATA_CONFIG_FILE, f"layer_ids {ids} are not strictly increasing"))
        n = cfg.get("num_hidden_layers")
        if isinstance(n, int) and ids and ids[-1] != n:
            probs.append(Problem(DATA_CONFIG, formats.DATA_CONFIG_FILE,
                                 f"layer_ids {ids} end at {ids[-1]}, the target has num_hidden_layers={n}"))
    version_problem = formats.compact_version_problem(cfg) if fmt == formats.FORMAT_COMPACT else None
    if version_problem:
        probs.append(Problem(DATA_CONFIG, formats.DATA_CONFIG_FILE, version_problem))
    version_warning = formats.compact_version_warning(cfg) if fmt == formats.FORMAT_COMPACT else None
    if version_warning:
        probs.append(Problem(DATA_CONFIG, formats.DATA_CONFIG_FILE, version_warning, WARNING))
    for key in ("hidden_size", "vocab_size"):
        if key in cfg and not isinstance(cfg[key], int):
            probs.append(Problem(DATA_CONFIG, formats.DATA_CONFIG_FILE, f"{key} {cfg[key]!r}: expected an int"))
    return cfg, probs


def expect_from_config(cfg: dict, fmt: str) -> Expect:
    ids = cfg.get("layer_ids")
    compact = fmt == formats.FORMAT_COMPACT  # its files hold the aux states (dequantized) and a teacher
    return Expect(fmt, cfg.get("hidden_size") if isinstance(cfg.get("hidden_size"), int) else None,
                  len(ids) - compact if isinstance(ids, list) else None,
                  None if compact else cfg.get("hidden_states_dtype"),
                  cfg.get("vocab_size") if isinstance(cfg.get("vocab_size"), int) else None,
                  teacher_top_k=(cfg.get("compact") or {}).get("teacher_top_k") if compact else None,
                  compact_version=(cfg.get("compact") or {}).get("version") if compact else None)


def expect_from_file(first: FileResult, fmt: str, vocab_size: int | None) -> Expect:
    return Expect(fmt, first.hidden_size, first.num_states, first.dtype, vocab_size,
                  source=f"as in the first file, {first.path}")


def index_problems(listing: formats.DatasetFiles, expected_count: int | None) -> list[Problem]:
    out = []
    by_index: dict[int, list[Path]] = defaultdict(list)
    for i, p in listing.files:
        by_index[i].append(p)
    for i, paths in sorted(by_index.items()):
        if len(paths) > 1:
            out.append(Problem(DUPLICATE_INDEX, str(paths[1]), f"index {i} appears {len(paths)} times: "
                                                               + ", ".join(str(p) for p in paths)))
    n = expected_count if expected_count is not None else (max(by_index) + 1 if by_index else 0)
    missing = [i for i in range(n) if i not in by_index]
    if missing:
        out.append(Problem(MISSING_INDEX, "", f"{len(missing)} of {n} indices have no file: {fmt_rows(missing, 10)}"))
    extra = sorted(i for i in by_index if i >= n)
    if extra:
        out.append(Problem(MISSING_INDEX, "", f"indices {fmt_rows(extra, 10)} beyond the {n} samples recorded"))
    for i, p, why in listing.misplaced:
        out.append(Problem(FOLDER_NAMING, str(p), why))
    for p in listing.stray:
        out.append(Problem(STRAY_FILE, str(p), "not a hidden-state file of this layout (a killed writer's temp "
                                               "file?)", WARNING))
    for p, why in listing.broken_links:
        out.append(Problem(BROKEN_LINK, str(p), f"{why}; replace it with the file or remove it"))
    for p, why in listing.unfollowed_links:
        out.append(Problem(BROKEN_LINK, str(p), why, WARNING))
    return out


def config_totals_problems(cfg: dict, results: list[FileResult]) -> list[Problem]:
    """data_config.json's counts against the files (only meaningful when every file read)."""
    out = []
    lengths = [r.length for r in results if r.length is not None]
    facts = {"num_samples": len(results), "num_tokens": sum(lengths),
             "num_masked_tokens": sum(r.masked for r in results), "seq_length": max(lengths, default=0)}
    for key, actual in facts.items():
        if key in cfg and cfg[key] != actual:
            out.append(Problem(DATA_CONFIG, formats.DATA_CONFIG_FILE, f"{key} is {cfg[key]}, the files hold {actual}"))
    return out


def sample_lengths_problems(root: Path, results: list[FileResult], required: bool) -> list[Problem]:
    path = root / formats.SAMPLE_LENGTHS_FILE
    name = formats.SAMPLE_LENGTHS_FILE
    if not path.exists():
        return [Problem(SAMPLE_LENGTHS, name, "missing", ERROR if required else WARNING)] if required else []
    try:
        recorded = formats.read_sample_lengths(path)
    except Exception as e:
        return [Problem(SAMPLE_LENGTHS, name, f"unreadable: {type(e).__name__}: {e}")]
    actual = {r.index: r.length for r in results if r.length is not None}
    out = []
    wrong = [(i, recorded[i], n) for i, n in sorted(actual.items()) if i in recorded and recorded[i] != n]
    for i, rec, n in wrong[:3]:
        out.append(Problem(SAMPLE_LENGTHS, name, f"sample {i}: recorded length {rec}, file has {n}"
                                                 + (f" ({len(wrong)} samples disagree)" if len(wrong) > 1 else "")))
    files = {r.index for r in results}
    only_rec, only_files = sorted(set(recorded) - files), sorted(files - set(recorded))
    if only_rec:
        out.append(Problem(SAMPLE_LENGTHS, name, f"lists {len(only_rec)} samples with no file: {fmt_rows(only_rec)}"))
    if only_files:
        out.append(Problem(SAMPLE_LENGTHS, name, f"misses {len(only_files)} samples that have files: {fmt_rows(only_files)}"))
    return out


def load_token_freq(root: Path, required: bool) -> tuple[dict[int, int] | None, list[Problem]]:
    """The recorded counts, or why there are none. A 50k-entry dict takes ~0.3 s through the
    weights-only unpickler (pure Python), so check_dataset reads it beside the file scan."""
    path = root / formats.TOKEN_FREQ_FILE
    name = formats.TOKEN_FREQ_FILE
    if not path.exists():
        return None, [Problem(TOKEN_FREQ, name, "missing")] if required else []
    try:
        return formats.read_token_freq(path), []
    except Exception as e:
        return None, [load_problem(e, name)] if is_unsafe_pickle_error(e) else \
            [Problem(TOKEN_FREQ, name, f"unreadable: {type(e).__name__}: {str(e)[:160]}")]


def token_freq_problems(recorded: dict[int, int], results: list[FileResult]) -> list[Problem]:
    actual: Counter = Counter()
    for r in results:
        for t, c in zip(*r.masked_tokens):
            actual[t] += c
    diff = sorted(t for t in set(recorded) | set(actual) if recorded.get(t, 0) != actual.get(t, 0))
    if not diff:
        return []
    t = diff[0]
    return [Problem(TOKEN_FREQ, formats.TOKEN_FREQ_FILE,
                    f"disagrees with the files' masked tokens on {len(diff)} token ids "
                    f"(e.g. id {t}: recorded {recorded.get(t, 0)}, files have {actual.get(t, 0)}; "
                    f"recorded total {sum(recorded.values())}, files {sum(actual.values())})")]


def rms_outlier_problems(results: list[FileResult]) -> list[Problem]:
    out = []
    num = max((len(r.slot_median_row_rms) for r in results), default=0)
    for j in range(num):
        vals = [(r, r.slot_median_row_rms[j]) for r in results
                if len(r.slot_median_row_rms) > j and math.isfinite(r.slot_median_row_rms[j]) and r.slot_median_row_rms[j] > 0]
        if len(vals) < 3:
            continue
        med = sorted(v for _, v in vals)[len(vals) // 2]
        for r, v in vals:
            if v > med * RMS_OUTLIER_FACTOR or v < med / RMS_OUTLIER_FACTOR:
                out.append(Problem(RMS_BOUNDS, r.path, f"slot {j} median row RMS {v:.3g} is {v / med:.3g}x the dataset's "
                                                       f"median {med:.3g} for this slot"))
    return out


def slot_stats(results: list[FileResult], layer_names: list[str]) -> list[SlotStats]:
    out = []
    num = max((len(r.slot_sumsq) for r in results), default=0)
    for j in range(num):
        rs = [r for r in results if len(r.slot_elems) > j and r.slot_elems[j]]
        if not rs:
            continue
        sumsq, elems = sum(r.slot_sumsq[j] for r in rs), sum(r.slot_elems[j] for r in rs)
        meds = [r.slot_median_row_rms[j] for r in rs]
        out.append(SlotStats(j, layer_names[j] if j < len(layer_names) else "?", math.sqrt(sumsq / elems),
                             sum(meds) / len(meds), min(meds), max(meds), max(r.slot_max_row_rms[j] for r in rs)))
    return out


def length_histogram(lengths: list[int]) -> dict[str, int]:
    """Power-of-two buckets: the shape that decides padding waste and batch sizes."""
    hist: Counter = Counter()
    for n in lengths:
        lo = 0 if n < 64 else 1 << (n.bit_length() - 1)
        hist[lo] += 1
    return {(f"{lo}-{max(lo * 2, 64) - 1}"): hist[lo] for lo in sorted(hist)}


# ---------------------------------------------------------------------------------------------
# Target-based checks: layer identity, teacher accuracy, chat template
# ---------------------------------------------------------------------------------------------

def default_last_convention(fmt: str) -> str:
    # vLLM / speculators capture the residual stream before the final norm; SpecForge's offline
    # `hidden_state` is what its target head (lm_head only, no norm) consumes: after the norm.
    return "post_norm" if fmt == formats.FORMAT_SPECFORGE else formats.LAST_STATE_PRE_NORM


def generation_prompt(tokenizer) -> tuple[list[int], str] | None:
    """The tokens a chat template appends for `add_generation_prompt=True` (e.g. '<|im_start|>assistant\\n')."""
    msgs = [{"role": "user", "content": "Hi"}]
    try:
        with_p = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        without = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False)
    except Exception:
        return None
    if not with_p.startswith(without) or len(with_p) == len(without):
        return None
    text = with_p[len(without):]
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return (list(ids), text) if ids else None


@dataclass
class Recomputed:
    states: dict[str, torch.Tensor]  # "layer k" (pre-norm outputs, k = 0..N) and "layer N post-norm", fp32 [T, H]
    logits_fn: Any  # h_post_norm [T, H] -> logits
    norm: Any  # the final norm module, or None
    head: Any = None  # the LM head module (for fp32 log-probabilities)


@torch.inference_mode()
def recompute(model, input_ids: torch.Tensor, device: torch.device) -> Recomputed:
    """Every candidate a stored slot could be: embeddings, each decoder layer's output, the
    last layer's output before and after the final norm. Forward hooks, so no HF convention
    about what `hidden_states[-1]` means is relied on."""
    from eaglet.target import base_model, decoder_layers

    layers = decoder_layers(model)
    n = len(layers)
    outs: dict[int, torch.Tensor] = {}

    def hook(k: int):
        def f(_m, _a, output):
            outs[k] = (output[0] if isinstance(output, tuple) else output)[0].float().cpu()
        return f

    handles = [layer.register_forward_hook(hook(k + 1)) for k, layer in enumerate(layers)]
    try:
        base = base_model(model)
        ids = input_ids.to(device)[None]
        out = base(input_ids=ids, use_cache=False)
        emb = base.get_input_embeddings()(ids)[0].float().cpu()
    finally:
        for h in handles:
            h.remove()
    states = {"layer 0": emb, **{f"layer {k}": outs[k] for k in range(1, n + 1)},
              f"layer {n} post-norm": out.last_hidden_state[0].float().cpu()}
    norm = getattr(base, "norm", None)
    head = model.get_output_embeddings()
    dtype = next(model.parameters()).dtype

    def logits_fn(h: torch.Tensor) -> torch.Tensor:
        return head(h.to(device, dtype)).float().cpu()

    return Recomputed(states, logits_fn, norm if isinstance(norm, torch.nn.Module) else None, head)


def compare(stored: torch.Tensor, ref: torch.Tensor) -> tuple[float, float, float]:
    """(mean row cosine, relative Frobenius error, max abs error). Cosine alone cannot tell a
    state from its RMS-normed self (a norm with unit weights only rescales rows), so the
    relative error, which sees the scale, decides; cosine and max abs error are reported."""
    s, r = stored.float(), ref.float()
    cos = float(torch.nn.functional.cosine_similarity(s, r, dim=-1, eps=1e-12).mean())
    rel = float(torch.linalg.vector_norm(s - r) / torch.linalg.vector_norm(r).clamp_min(1e-30))
    return cos, rel, float((s - r).abs().max())


def expected_labels(layer_ids: list[int], last_convention: str, n: int) -> list[str]:
    labels = [f"layer {k}" for k in layer_ids]
    if labels and layer_ids[-1] == n and last_convention == "post_norm":
        labels[-1] = f"layer {n} post-norm"
    return labels


def slot_identity_problem(j: int, num_slots: int, expected: str, best: str, stats: dict[str, tuple[float, float, float]],
                          last_convention: str, rel: str) -> Problem | None:
    """Name what a slot really holds when it is not what the config records."""
    e_cos, e_rel, _ = stats[expected]
    b_cos, b_rel, _ = stats[best]
    expected_ok = e_cos >= IDENTITY_COS and e_rel <= IDENTITY_REL_ERR
    clearly_other = best != expected and b_rel < IDENTITY_MARGIN * e_rel and b_rel <= IDENTITY_REL_ERR
    if expected_ok and not clearly_other:
        return None
    name = f"slot {j} (last)" if j == num_slots - 1 else f"slot {j}"
    detail = f"(rel err {b_rel:.3g} vs {e_rel:.3g}, cos {b_cos:.4f} vs {e_cos:.4f})"
    if clearly_other:
        if best.split(" post-norm")[0] == expected.split(" post-norm")[0]:  # same layer, other side of the norm
            what = "post-norm" if best.endswith("post-norm") else "pre-norm"
            return Problem(LAYER_IDENTITY, rel, f"{name} matches {best.split(' post-norm')[0]} {what}, recorded "
                                                f"{last_convention} {detail}")
        return Problem(LAYER_IDENTITY, rel, f"{name} matches {best}, not {expected.removeprefix('layer ')} {detail}")
    return Problem(LAYER_IDENTITY, rel, f"{name} matches no layer of the target: recorded {expected} has rel err "
                                        f"{e_rel:.3g}, cos {e_cos:.4f}; closest is {best} (rel err {b_rel:.3g})")


def teacher_accuracy(rec: Recomputed, stored_last: torch.Tensor | formats.StoredTeacher, last_convention: str,
                     ids: torch.Tensor, mask: torch.Tensor | None, n: int) -> tuple[int, int, int, int] | None:
    """(positions, stored correct, recomputed correct, agreeing) for next-token argmax on masked
    positions; the stored argmax is lm_head(norm(stored last)), or a compact file's first teacher id."""
    if rec.norm is None:
        return None
    with torch.inference_mode():
        pred_ref = rec.logits_fn(rec.states[f"layer {n} post-norm"]).argmax(-1)
        if isinstance(stored_last, formats.StoredTeacher):
            pred_stored = stored_last.ids[:, 0].long()
        else:
            param = next(rec.norm.parameters(), None)
            dev = param.device if param is not None else torch.device("cpu")
            dt = param.dtype if param is not None else torch.float32
            h = stored_last.to(dev, dt)
            h = rec.norm(h) if last_convention == formats.LAST_STATE_PRE_NORM else h
            pred_stored = rec.logits_fn(h).argmax(-1)
    pos = (mask[1:] == 1) if mask is not None else torch.ones(len(ids) - 1, dtype=torch.bool)
    nxt = ids[1:]
    ps, pr = pred_stored[:-1][pos], pred_ref[:-1][pos]
    return int(pos.sum()), int((ps == nxt[pos]).sum()), int((pr == nxt[pos]).sum()), int((ps == pr).sum())


@torch.inference_mode()
def log_probs_at(h: torch.Tensor, head: torch.nn.Module, ids: torch.Tensor, chunk: int = 8192) -> torch.Tensor:
    """fp32 log_softmax(head(h)) at `ids` [T, K], whatever the head's dtype, a slice of the
    vocabulary at a time (neither a [T, vocab] tensor nor an fp32 copy of the head)."""
    w, bias = head.weight, getattr(head, "bias", None)
    h = h.to(w.device, torch.float32)
    lse = torch.full((h.shape[0],), float("-inf"), device=w.device)
    for v in range(0, w.shape[0], chunk):
        logits = h @ w[v:v + chunk].float().T + (0 if bias is None else bias[v:v + chunk].float())
        lse = torch.logaddexp(lse, logits.logsumexp(-1))
    idx = ids.to(w.device).long()
    picked = (h[:, None, :] * w[idx].float()).sum(-1) + (0 if bias is None else bias[idx].float())
    return (picked - lse[:, None]).cpu()


def stored_log_prob_problem(rec: Recomputed, t: formats.StoredTeacher, n: int, rel: str) -> Problem | None:
    """A compact file's stored log-probabilities against the recomputed target's at the same ids."""
    ref = log_probs_at(rec.states[f"layer {n} post-norm"], rec.head, t.ids)
    err = (ref - t.log_probs.float()).abs().mean().item()
    if err <= TEACHER_LOG_PROB_ERR:
        return None
    return Problem(STORED_TEACHER, rel, f"teacher_log_probs differ from the recomputed target's by {err:.3f} nats on "
                                        f"average (at most {TEACHER_LOG_PROB_ERR} expected): another model, or a "
                                        "post-norm state normed twice")


def pick_identity_files(results: list[FileResult], k: int) -> list[FileResult]:
    """Evenly spread over the dataset (first, last, between): deterministic and representative."""
    ok = sorted((r for r in results if r.schema_ok and r.length), key=lambda r: r.index)
    if len(ok) <= k:
        return ok
    return [ok[round(i * (len(ok) - 1) / max(k - 1, 1))] for i in range(k)]


def identity_check(report: CheckReport, root: Path, exp: Expect, model, files: list[FileResult], layer_ids: list[int],
                   last_convention: str, device: torch.device) -> None:
    n = model.config.num_hidden_layers
    labels = expected_labels(layer_ids, last_convention, n)
    worst: dict[int, SlotIdentity] = {}
    acc = [0, 0, 0, 0]
    for r in files:
        sample, _ = to_sample(load_raw(root / r.path, exp.format), exp.format, r.path)
        rec = recompute(model, sample.input_ids, device)
        for j, h in enumerate(sample.states):
            if j >= len(labels):
                break
            stats = {name: compare(h, ref) for name, ref in rec.states.items()}
            best = min(stats, key=lambda name: stats[name][1])
            expected = labels[j]
            slots = len(sample.states) + (sample.teacher is not None)  # compact: the last slot is the teacher
            p = slot_identity_problem(j, slots, expected, best, stats, last_convention, r.path)
            if p:
                report.problems.append(p)
            e_cos, e_rel, e_abs = stats[expected]
            cur = worst.get(j)
            if cur is None or e_rel > cur.rel_err:
                worst[j] = SlotIdentity(j, expected, best, e_cos, e_rel, e_abs, stats[best][0], stats[best][1])
        mask = sample.loss_mask if isinstance(sample.loss_mask, torch.Tensor) else None
        if sample.teacher is not None:
            p = stored_log_prob_problem(rec, sample.teacher, n, r.path)
            if p:
                report.problems.append(p)
        t = teacher_accuracy(rec, sample.teacher or sample.states[-1], last_convention, sample.input_ids, mask, n)
        if t:
            acc = [a + b for a, b in zip(acc, t)]
    report.identity = [worst[j] for j in sorted(worst)]
    report.identity_files = [r.path for r in files]
    if acc[0]:
        report.next_token_accuracy = {"positions": acc[0], "stored_last": acc[1] / acc[0],
                                      "recomputed": acc[2] / acc[0], "agreement": acc[3] / acc[0]}
        if acc[3] / acc[0] < TEACHER_AGREEMENT:
            report.problems.append(Problem(LAYER_IDENTITY, files[-1].path if files else "",
                                           f"the stored next-token argmax agrees with the recomputed target on only "
                                           f"{acc[3] / acc[0]:.1%} of masked positions ({len(files)} sampled files)"))


def too_long_problems(results: list[FileResult], model) -> list[Problem]:
    """Samples longer than the target's positions: states the target never makes in use."""
    from eaglet.decode import max_positions

    limit = max_positions(model)
    return [Problem(TOO_LONG, r.path, f"{r.length} tokens, the target has {limit} positions "
                                      f"(max_position_embeddings): prepare with --max-length {limit} or less")
            for r in results if r.length is not None and r.length > limit]


def layer_identity_problems(root: Path, fmt: str, sample: Path, model, layer_ids: list[int],
                            last_convention: str) -> list[Problem]:
    """The layer-identity errors `eaglet check --target` would report for one file, with the
    target already loaded: train runs this before spending hours on states whose recorded
    layer ids are not what the files hold (an edited data_config.json trains a drafter that the
    engines feed other layers, and that is then never accepted)."""
    report = CheckReport(str(root))
    probe = FileResult(0, str(sample.relative_to(root)), 0, schema_ok=True, length=1)
    with torch.inference_mode():
        identity_check(report, root, Expect(fmt), model, [probe], layer_ids, last_convention,
                       next(model.parameters()).device)
    return [p for p in report.problems if p.kind == LAYER_IDENTITY and p.severity == ERROR]


def target_revision_problem(cfg: dict | None, ref) -> Problem | None:
    """The data records the revision (content hash) of the target it came from; a target of other
    weights explains every identity mismatch that follows, so it is said first, in one line."""
    recorded = (cfg or {}).get("target_revision")
    if not recorded or recorded == ref.revision:
        return None
    return Problem(LAYER_IDENTITY, formats.DATA_CONFIG_FILE,
                   f"target_revision {recorded} ({(cfg or {}).get('target', '?')}) is not the revision of the target "
                   f"checked against, {ref.name} ({ref.revision}): other weights, so no stored state will match; "
                   "check against the target the data was extracted with")


def load_target_for_check(spec: str, cfg: dict | None):
    """(ref, tokenizer, model, device). Recompute in the recorded compute dtype, as extraction did."""
    from eaglet.target import load_target, load_tokenizer, parse_dtype, pick_device, resolve_target

    ref = resolve_target(spec)
    tokenizer = load_tokenizer(ref)
    dtype = parse_dtype((cfg or {}).get("compute_dtype") or "fp32")
    device = pick_device(None)
    return ref, tokenizer, load_target(ref, dtype, device), device


# ---------------------------------------------------------------------------------------------
# The entry function
# ---------------------------------------------------------------------------------------------

@contextlib.contextmanager
def single_threaded_ops():
    """One intra-op thread per torch op while files are checked in parallel: the per-file ops
    are small (a few MB), and OpenMP teams on top of the reader threads made the scan 3-10x
    slower and erratic on 2 cores (measured). Process-wide, so restored right after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def check_dataset(path: str | os.PathLike, target: str | None = None, use_target: bool = True,
                  identity_samples: int = 3, workers: int | None = None) -> CheckReport:
    """Check every file of the hidden-state dataset at `path`; with a target (`target`, else
    data_config's `target_path`), also layer identity and mask-vs-template on sampled files."""
    ranges.at_least(0, identity_samples=identity_samples)
    ranges.at_least(1, workers=workers)
    root = Path(path)
    report = CheckReport(str(root))
    if not root.is_dir():
        report.problems.append(Problem(NO_FILES, str(root), "not a folder"))
        return report
    cfg_rows = formats.ROWS_PER_FOLDER
    if (root / formats.DATA_CONFIG_FILE).exists():
        try:
            cfg_rows = int(formats.read_json(root / formats.DATA_CONFIG_FILE).get("rows_per_folder", cfg_rows))
        except Exception:
            pass  # read_config reports an unreadable config below
    listing = formats.list_dataset_files(root, cfg_rows)
    report.format = listing.format
    if listing.format is None:
        report.problems.append(Problem(NO_FILES, str(root), "no v1 (hidden_states/rows_*/data_*.pt), compact, "
                                                            "speculators (Arrow table + hidden_states/hs_*.safetensors), flat "
                                                            "data_*.pt, SpecForge *.ckpt[.gz] or hs_*.safetensors "
                                                            "files found"))
        return report
    cfg, cfg_problems = read_config(root, listing.format)
    report.problems += cfg_problems
    table_rows = None
    if listing.format == formats.FORMAT_SPECULATORS_ARROW:
        try:
            table_rows = len(formats.read_speculators_rows(root))
        except ValueError as e:
            report.problems.append(Problem(UNREADABLE, formats.ARROW_STATE_FILE, str(e)))
            return report

    # The target (and its tokenizer) first: the tokenizer lets every file's mask be checked.
    model = device = tokenizer = None
    spec = target or (cfg or {}).get("target_path")
    if use_target and spec:
        try:
            ref, tokenizer, model, device = load_target_for_check(spec, cfg)
            report.target = ref.name
            report.problems += [p for p in [target_revision_problem(cfg, ref)] if p]
        except Exception as e:
            # --target asks for these checks: one that cannot run is not a pass. A target merely
            # recorded in data_config.json may live on another machine: then a warning.
            asked = target is not None
            report.problems.append(Problem(NOT_CHECKED, str(spec), f"layer identity and mask vs template "
                                                                   f"{'could not run' if asked else 'skipped'}: "
                                                                   f"target not loadable ({type(e).__name__}: {e})",
                                           ERROR if asked else WARNING))
    elif not use_target:
        report.problems.append(Problem(NOT_CHECKED, "", "layer identity and mask vs template skipped (--no-target)",
                                       WARNING))
    else:
        report.problems.append(Problem(NOT_CHECKED, "", "layer identity and mask vs template skipped: no --target and "
                                                        "no target_path in data_config.json", WARNING))

    files = sorted(listing.files, key=lambda ip: (ip[0], str(ip[1])))
    vocab = (cfg or {}).get("vocab_size") if isinstance((cfg or {}).get("vocab_size"), int) else None
    if vocab is None and model is not None:
        vocab = model.config.vocab_size
    t0 = time.time()
    first: FileResult | None = None
    if cfg is not None:
        exp = expect_from_config(cfg, listing.format)
    else:  # no config: the first readable file sets the bar for all others
        probe = Expect(listing.format, vocab_size=vocab)
        first = next((r for r in (check_file(i, p, root, probe) for i, p in files[:20]) if r.num_states), None)
        exp = expect_from_file(first, listing.format, vocab) if first else probe
    if tokenizer is not None:
        gp = generation_prompt(tokenizer)
        if gp:
            from eaglet.data import special_token_ids, template_hash

            exp.gen_prompt_ids, report.generation_prompt = gp
            exp.eot_ids = frozenset(special_token_ids(tokenizer))
            recorded = (cfg or {}).get("chat_template_sha256")
            if recorded and recorded != template_hash(tokenizer):
                report.problems.append(Problem(MASK_TEMPLATE, formats.DATA_CONFIG_FILE,
                                               f"chat_template_sha256 {recorded} is not the target tokenizer's "
                                               f"({template_hash(tokenizer)}): the data was prepared with another template"))
        else:
            report.problems.append(Problem(NOT_CHECKED, "", "mask vs template skipped: the chat template has no "
                                                            "separable generation prompt", WARNING))

    workers = workers or min(8, os.cpu_count() or 1)
    report.workers = workers
    # Threads, not processes: torch.load reads and every tensor op here release the GIL, and
    # threads avoid pickling tensors back from workers (measured faster on 2 cores).
    required = listing.format in formats.EAGLET_LAYOUTS  # side files eaglet always writes
    with ThreadPoolExecutor(max_workers=workers) as pool, single_threaded_ops():
        freq_future = pool.submit(load_token_freq, root, required)
        results = list(pool.map(lambda ip: check_file(ip[0], ip[1], root, exp), files))
        recorded_freq, freq_problems = freq_future.result()
    report.seconds = time.time() - t0
    for r in results:
        report.problems += r.problems
    report.template_checked_files = sum(r.template_checked for r in results)

    # Dataset level.
    unique = {r.index: r for r in results}
    recorded = (cfg or {}).get("num_samples") if isinstance((cfg or {}).get("num_samples"), int) else None
    if recorded is not None and table_rows is not None and recorded != table_rows:
        report.problems.append(Problem(DATA_CONFIG, formats.DATA_CONFIG_FILE, f"num_samples is {recorded}, the Arrow "
                                                                              f"table has {table_rows} rows"))
    report.problems += index_problems(listing, table_rows if table_rows is not None else recorded)
    report.problems += sample_lengths_problems(root, list(unique.values()), required)
    report.problems += freq_problems
    if recorded_freq is not None:
        report.problems += token_freq_problems(recorded_freq, list(unique.values()))
    if cfg is not None:
        report.problems += config_totals_problems(cfg, list(unique.values()))
    if model is not None:
        report.problems += too_long_problems(list(unique.values()), model)
    report.problems += rms_outlier_problems(results)

    layer_ids = (cfg or {}).get("layer_ids")
    if model is not None and not isinstance(layer_ids, list):
        from eaglet.target import default_layer_ids

        layer_ids = default_layer_ids(model.config.num_hidden_layers)
    names = [f"layer {k}" for k in layer_ids] if isinstance(layer_ids, list) else []
    report.slots = slot_stats(results, names)
    report.files = len(results)
    report.samples = len(unique)
    lengths = [r.length for r in unique.values() if r.length is not None]
    report.tokens, report.masked_tokens = sum(lengths), sum(r.masked for r in unique.values())
    report.bytes = sum(r.nbytes for r in results)
    report.length_histogram = length_histogram(lengths)

    if model is not None and isinstance(layer_ids, list):
        n = model.config.num_hidden_layers
        last_conv = (cfg or {}).get("last_hidden_state") or default_last_convention(listing.format)
        if exp.hidden_size is not None and exp.hidden_size != model.config.hidden_size:
            report.problems.append(Problem(LAYER_IDENTITY, formats.DATA_CONFIG_FILE,
                                           f"hidden size {exp.hidden_size} is not the target's {model.config.hidden_size}"))
        elif any(not 0 <= k <= n for k in layer_ids):
            report.problems.append(Problem(LAYER_IDENTITY, formats.DATA_CONFIG_FILE,
                                           f"layer_ids {layer_ids} are not all in 0..{n} for this {n}-layer target"))
        else:
            identity_check(report, root, exp, model, pick_identity_files(results, identity_samples), layer_ids,
                           last_conv, device)
    return report


# ---------------------------------------------------------------------------------------------
# Text report
# ---------------------------------------------------------------------------------------------

FORMAT_DESCRIPTIONS = {
    formats.FORMAT_V1: "speculators v1 (hidden_states/rows_{a}-{b}/data_{i}.pt)",
    formats.FORMAT_V1_FLAT: "speculators v1, flat (data_{i}.pt)",
    formats.FORMAT_SPECFORGE: "SpecForge offline (rows_{a}-{b}/data_{i}.ckpt[.gz])",
    formats.FORMAT_HS_SAFETENSORS: "speculators hs_{row}.safetensors, flat (loss_mask in each file, no table)",
    formats.FORMAT_SPECULATORS_ARROW: "speculators >= 0.6 (Arrow table + hidden_states/hs_{row}.safetensors)",
    formats.FORMAT_COMPACT: "eaglet compact (compact/rows_{a}-{b}/data_{i}.safetensors: 6-bit aux, stored teacher)",
}


def report_lines(r: CheckReport, max_per_kind: int = 10) -> list[str]:
    out = [f"eaglet check {r.path}", f"  format: {FORMAT_DESCRIPTIONS.get(r.format, 'none found')}"]
    if r.files:
        share = r.masked_tokens / max(r.tokens, 1)
        mb = r.bytes / 1e6
        out.append(f"  {r.files} files, {r.samples} samples, {r.tokens:,} tokens, {r.masked_tokens:,} masked "
                   f"({share:.1%}), {mb:,.1f} MB, {r.bytes / max(r.tokens, 1):,.0f} bytes/token")
        out.append(f"  read in {r.seconds:.2f} s ({mb / max(r.seconds, 1e-9):,.0f} MB/s, {r.workers} threads)")
        out.append("  lengths: " + ", ".join(f"{k}: {v}" for k, v in r.length_histogram.items()))
    if r.slots:
        out.append("  per-layer statistics (RMS over all tokens; median row RMS: mean [min..max] over files; max row RMS):")
        for s in r.slots:
            out.append(f"    slot {s.slot} ({s.layer}): rms {s.rms:.4g}, median row rms {s.median_row_rms:.4g} "
                       f"[{s.min_file_median_row_rms:.4g}..{s.max_file_median_row_rms:.4g}], max row rms {s.max_row_rms:.4g}")
    if r.identity:
        out.append(f"  layer identity vs {r.target} on {len(r.identity_files)} sampled files (worst file per slot):")
        for s in r.identity:
            mark = "ok" if s.best == s.expected else f"best match {s.best} (rel err {s.best_rel_err:.3g})"
            out.append(f"    slot {s.slot} = {s.expected}: cos {s.cos:.5f}, rel err {s.rel_err:.3g}, "
                       f"max abs err {s.max_abs_err:.3g}; {mark}")
    if r.next_token_accuracy:
        a = r.next_token_accuracy
        what = "the stored teacher's argmax" if r.format == formats.FORMAT_COMPACT else "lm_head(norm(last))"
        out.append(f"  next-token accuracy of {what} on {a['positions']} masked positions: stored "
                   f"{a['stored_last']:.1%}, recomputed {a['recomputed']:.1%}, agreement {a['agreement']:.1%}")
    if r.generation_prompt:
        out.append(f"  loss mask vs chat template (generation prompt {r.generation_prompt!r}): "
                   f"{r.template_checked_files} files checked")
    out += problem_lines(r.problems, max_per_kind)
    out.append("result: CLEAN" if r.clean else f"result: NOT CLEAN ({len(r.errors)} problems)")
    return out


def problem_lines(problems: list[Problem], max_per_kind: int) -> list[str]:
    if not problems:
        return ["problems: none"]
    out = []
    for severity in (ERROR, WARNING):
        group: dict[str, list[Problem]] = defaultdict(list)
        for p in problems:
            if p.severity == severity:
                group[p.kind].append(p)
        if not group:
            continue
        out.append(f"{'problems' if severity == ERROR else 'warnings'} ({sum(map(len, group.values()))}):")
        for kind, ps in sorted(group.items(), key=lambda kv: -len(kv[1])):
            out.append(f"  [{kind}] {len(ps)}")
            for p in ps[:max_per_kind]:
                out.append(f"    {p.path + ': ' if p.path else ''}{p.message}")
            if len(ps) > max_per_kind:
                out.append(f"    ... and {len(ps) - max_per_kind} more")
    return out
