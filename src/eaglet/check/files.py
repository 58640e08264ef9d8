"""What one file of a hidden-state dataset can tell on its own: whether it loads (only with
`torch.load(weights_only=True)` or safetensors, so a file that needs arbitrary pickled objects is
reported, never executed), its layout's schema, dtypes and shapes against the dataset's
expectations, and its values (mask 0/1 and not empty, token ids in range, no NaN/Inf, no
all-zero rows, sane RMS, a stored teacher's log-probabilities), and its states against the
signatures extraction recorded for it (a slot swapped, another layer's states, values changed)."""

from __future__ import annotations

import math
import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from eaglet import formats
from eaglet.check.report import (
    ALL_ZERO,
    CHECKSUM,
    HIDDEN_SIZE,
    LAYER_IDENTITY,
    LENGTH_MISMATCH,
    MASK_EMPTY,
    MASK_TEMPLATE,
    MASK_VALUES,
    NON_FINITE,
    RMS_BOUNDS,
    STATE_COUNT,
    STATE_SIGNATURE,
    STORED_TEACHER,
    TOKEN_RANGE,
    UNREADABLE,
    UNSAFE_PICKLE,
    WARNING,
    WRONG_DTYPE,
    WRONG_SHAPE,
    Problem,
)
from eaglet.formats import fmt_rows

# RMS of one stored state (a whole [T, H] tensor). Below the floor a state carries no signal;
# above the ceiling it is headed for fp16/bf16 overflow. Both are far outside what real targets
# produce (tiny random models ~0.02, 70B residual streams tens to hundreds).
RMS_FLOOR, RMS_CEILING = 1e-5, 1e4


@dataclass
class Expect:
    """What every file must look like: from data_config.json, else from the first file."""

    layout: formats.Layout
    hidden_size: int | None = None
    num_states: int | None = None
    dtype: str | None = None  # e.g. "bfloat16"
    vocab_size: int | None = None
    source: str = "data_config.json"  # where these expectations come from (said in messages)
    teacher_top_k: int | None = None  # a stored teacher's K (data_config.json)
    config: dict | None = None  # data_config.json, for the layout's own checks (compact version 1 has no checksums)
    gen_prompt_ids: list[int] | None = None  # the chat template's generation prompt, tokenized
    eot_ids: frozenset[int] = frozenset()  # special tokens that can end an assistant turn
    # each file's state signatures as extraction recorded them (None: the dataset records none)
    signatures: dict[int, list[formats.Recorded]] | None = None
    signatures_required: bool = False  # data_config.json records the log: a file without a line is damage
    problems: list[Problem] = field(default_factory=list)  # found reading these expectations


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
    masked_tokens: tuple[list[int], list[int]] = field(default_factory=lambda: ([], []))  # (ids, counts) masked
    tokens_signed: bool = False  # input_ids and loss_mask match the digest extraction recorded for this file
    states_signed: bool = False  # every slot matches the signature extraction recorded for this file
    template_checked: bool = False  # the mask was compared with the chat template's assistant spans


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


def load_problem(e: BaseException, rel: str) -> Problem:
    if is_unsafe_pickle_error(e):
        return Problem(
            UNSAFE_PICKLE,
            rel,
            f"needs arbitrary pickled objects ({unsafe_global_name(e)}); "
            "refused by torch.load(weights_only=True), not executed",
        )
    text = str(e)
    if "central directory" in text:  # torch.save writes a zip; its directory is at the very end
        why = "not a complete zip archive (its central directory, at the end of the file, is missing)"
    elif "WeightsUnpickler error:" in text:  # the useful part of the weights-only unpickler's message
        why = text.split("WeightsUnpickler error:", 1)[1].strip().splitlines()[0][:120]
    else:
        why = (text.strip().splitlines() or [""])[0][:120]
    return Problem(UNREADABLE, rel, f"truncated or corrupt: {type(e).__name__}: {why}")


# ---------------------------------------------------------------------------------------------
# Schema: dtypes and shapes of the common view, against the dataset's expectations
# ---------------------------------------------------------------------------------------------


def is_int_tensor(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool


def formats_dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def mask_schema_problems(m: Any, T: int, rel: str) -> list[Problem]:
    out = []
    if not isinstance(m, torch.Tensor) or m.dim() != 1:
        out.append(Problem(WRONG_SHAPE, rel, f"loss_mask is {getattr(m, 'shape', type(m).__name__)}: expected [T]"))
    elif m.shape[0] != T:
        out.append(Problem(LENGTH_MISMATCH, rel, f"loss_mask has {m.shape[0]} entries, input_ids has {T}"))
    if isinstance(m, torch.Tensor) and not is_int_tensor(m):
        out.append(Problem(WRONG_DTYPE, rel, f"loss_mask is {m.dtype}: expected an integer dtype"))
    return out


def state_schema_problems(h: torch.Tensor, j: int, T: int, exp: Expect, rel: str) -> tuple[list[Problem], bool]:
    """Dtype and shape problems of slot `j`, and whether it is well-formed enough for value checks."""
    out: list[Problem] = []
    src = f"({exp.source})"
    ok = True
    if not h.is_floating_point():
        out.append(Problem(WRONG_DTYPE, rel, f"hidden state slot {j} is {h.dtype}: expected a float dtype"))
        ok = False
    elif exp.dtype and formats_dtype_name(h.dtype) != exp.dtype:
        out.append(
            Problem(
                WRONG_DTYPE, rel, f"hidden state slot {j} is {formats_dtype_name(h.dtype)}, recorded {exp.dtype} {src}"
            )
        )
    if h.dim() != 2:
        out.append(Problem(WRONG_SHAPE, rel, f"hidden state slot {j} has shape {tuple(h.shape)}: expected [T, H]"))
        return out, False
    if h.shape[0] != T:
        out.append(Problem(LENGTH_MISMATCH, rel, f"hidden state slot {j} has {h.shape[0]} rows, input_ids has {T}"))
        ok = False
    if exp.hidden_size is not None and h.shape[1] != exp.hidden_size:
        out.append(
            Problem(HIDDEN_SIZE, rel, f"hidden state slot {j} has H={h.shape[1]}, expected {exp.hidden_size} {src}")
        )
    return out, ok


def schema_problems(s: formats.FileStates, exp: Expect, rel: str) -> tuple[list[Problem], list[bool]]:
    """Dtype and shape problems, and per state whether it is well-formed enough for value checks."""
    out: list[Problem] = []
    ids = s.input_ids
    if not is_int_tensor(ids) or ids.dim() != 1:
        what = f"{ids.dtype} {tuple(ids.shape)}" if isinstance(ids, torch.Tensor) else type(ids).__name__
        out.append(
            Problem(
                WRONG_DTYPE if isinstance(ids, torch.Tensor) and ids.dim() == 1 else WRONG_SHAPE,
                rel,
                f"input_ids is {what}: expected an integer tensor [T]",
            )
        )
        return out, [False] * len(s.states)
    T = ids.shape[0]
    if s.loss_mask is not None:
        out += mask_schema_problems(s.loss_mask, T, rel)
    if exp.num_states is not None and len(s.states) != exp.num_states:
        out.append(
            Problem(
                STATE_COUNT,
                rel,
                f"{len(s.states)} hidden states, expected {exp.num_states} (one per layer id) ({exp.source})",
            )
        )
    usable = []
    for j, h in enumerate(s.states):
        probs, ok = state_schema_problems(h, j, T, exp, rel)
        out += probs
        usable.append(ok)
    return out, usable


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
        return ids[max(0, s - g) : s] == gen or (g > 1 and ids[max(0, s - g + 1) : s] == gen[:-1])

    for s, e in runs:
        if not after_prompt(s):
            issues.append(f"masked run at tokens {s}..{e - 1} does not start after the generation prompt")
        if e < T and ids[e - 1] not in eot_ids:
            issues.append(f"masked run at tokens {s}..{e - 1} does not end on an end-of-turn token")
    starts = {s for s, _ in runs}
    for p in range(T - g + 1):
        if ids[p] == gen[0] and ids[p : p + g] == gen:
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
            out.append(
                Problem(
                    NON_FINITE,
                    rel,
                    f"slot {j} row {real[0]}: {kinds} ({len(bad_rows)} of {T} rows "
                    f"non-finite, rows {fmt_rows(bad_rows.tolist())})",
                )
            )
        else:  # finite values whose square overflows fp32: still far out of any sane range
            out.append(Problem(RMS_BOUNDS, rel, f"slot {j} row {int(bad_rows[0])}: values beyond 1e19"))
    zero = (row_norm == 0).nonzero().flatten()
    if len(zero) == T:
        out.append(Problem(ALL_ZERO, rel, f"slot {j} is all zeros"))
    elif len(zero):
        out.append(
            Problem(ALL_ZERO, rel, f"slot {j}: {len(zero)} of {T} rows are all zeros (rows {fmt_rows(zero.tolist())})")
        )
    fin = row_norm[finite].double()
    sumsq, elems = float((fin * fin).sum()), int(fin.numel()) * H
    rms = math.sqrt(sumsq / elems) if elems else 0.0
    if len(zero) < T and elems and not RMS_FLOOR <= rms <= RMS_CEILING:
        out.append(Problem(RMS_BOUNDS, rel, f"slot {j} RMS {rms:.3g} outside [{RMS_FLOOR:g}, {RMS_CEILING:g}]"))
    row_rms = fin / math.sqrt(H)
    med = float(row_rms.median()) if len(row_rms) else 0.0
    mx = float(row_rms.max()) if len(row_rms) else 0.0
    return out, sumsq, elems, med, mx


def mask_value_problems(m: torch.Tensor, rel: str) -> list[Problem]:
    out = []
    bad = (m != 0) & (m != 1)
    if bool(bad.any()):
        vals = sorted(set(m[bad].tolist()))[:5]
        out.append(
            Problem(MASK_VALUES, rel, f"loss_mask holds {vals} at {int(bad.sum())} positions: expected only 0/1")
        )
    elif not bool((m == 1).any()):
        out.append(Problem(MASK_EMPTY, rel, f"loss_mask has no 1 in {m.shape[0]} positions: nothing to train on"))
    return out


def stored_teacher_problems(t: formats.StoredTeacher, vocab_size: int | None, rel: str) -> list[Problem]:
    """Ids inside the vocabulary and distinct per position; log-probabilities finite, <= 0, most
    likely first, summing to at most 1."""
    out = []
    ids, lp = t.ids.long(), t.log_probs.float()
    if vocab_size is not None and ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        out.append(
            Problem(STORED_TEACHER, rel, f"teacher_ids {int(ids.min())}..{int(ids.max())} outside [0, {vocab_size})")
        )
    repeats = (ids.sort(-1).values.diff(dim=-1) == 0).any(-1)  # [T]: a token twice at that position
    if repeats.any():
        out.append(Problem(STORED_TEACHER, rel, f"teacher_ids repeat a token at position {int(repeats.nonzero()[0])}"))
    if not torch.isfinite(lp).all():
        out.append(
            Problem(
                STORED_TEACHER,
                rel,
                "teacher_log_probs hold NaN/Inf at positions "
                + fmt_rows((~torch.isfinite(lp)).any(-1).nonzero().flatten().tolist()),
            )
        )
        return out
    bad = (lp > 1e-3).any(-1) | (lp.diff(dim=-1) > 1e-3).any(-1) | (lp.exp().sum(-1) > 1.01)  # [T]
    if bad.any():
        out.append(
            Problem(
                STORED_TEACHER,
                rel,
                "teacher_log_probs are not log-probabilities of the most likely tokens "
                "in order (> 0, increasing, or summing past 1) at positions "
                + fmt_rows(bad.nonzero().flatten().tolist()),
            )
        )
    return out


# ---------------------------------------------------------------------------------------------
# One file
# ---------------------------------------------------------------------------------------------


def check_file(index: int, path: Path, root: Path, exp: Expect) -> FileResult:
    """Everything one file can tell on its own. Runs in worker threads; never raises."""
    rel = str(path.relative_to(root))
    res = FileResult(index, rel, path.stat().st_size)
    layout = exp.layout
    try:
        raw = layout.read_raw(path)
    except Exception as e:  # any failure to load is a finding about the file, not a crash
        res.problems.append(load_problem(e, rel))
        return res
    res.readable = True
    damage = [Problem(CHECKSUM, rel, why) for why in layout.damage(raw, exp.config)]
    res.problems += damage
    try:
        states, findings = layout.file_states(raw, rel)
    except Exception as e:
        res.problems.append(Problem(WRONG_SHAPE, rel, f"unexpected content: {type(e).__name__}: {e}"))
        return res
    probs = [Problem(f.kind, rel, f.message) for f in findings]
    res.problems += probs
    if states is None:
        return res
    try:
        check_states(res, states, exp, damage + probs)
    except Exception as e:  # a kind of tensor no check foresaw: a finding about the file, not a crash
        res.schema_ok = False
        res.problems.append(Problem(WRONG_SHAPE, rel, f"unexpected content: {type(e).__name__}: {e}"))
    return res


def check_states(res: FileResult, states: formats.FileStates, exp: Expect, found: list[Problem]) -> None:
    """The schema and values of a file's states (`found`: what its bytes and keys showed already)."""
    rel = res.path
    schema, usable = schema_problems(states, exp, rel)
    res.problems += schema
    res.num_states = len(states.states)
    if states.states and states.states[0].dim() == 2:
        res.hidden_size, res.dtype = int(states.states[0].shape[1]), formats_dtype_name(states.states[0].dtype)
    if not is_int_tensor(states.input_ids) or states.input_ids.dim() != 1:
        return
    res.schema_ok = not schema and not found  # damaged bytes: no recompute can judge them
    res.length = int(states.input_ids.shape[0])
    res.problems += token_range_problems(states.input_ids, exp.vocab_size, rel)
    check_mask(res, states, exp)
    if states.teacher is not None:
        res.problems += teacher_problems(states.teacher, exp, rel)
    check_slot_values(res, states.states, usable)
    if exp.signatures is not None and all(usable) and len(usable) == exp.num_states:
        recorded = exp.signatures.get(res.index)
        mismatches = []
        if recorded is not None:
            tokens = formats.token_digest(states.input_ids, states.loss_mask)
            res.tokens_signed = any(r.tokens == tokens for r in recorded)
            mismatches = formats.signature_mismatches(formats.state_signature(states.states), recorded)
            res.states_signed = not mismatches
        res.problems += signature_problems(recorded, mismatches, res.tokens_signed, exp, rel)


def slot_name(exp: Expect, j: int) -> str:
    ids = (exp.config or {}).get("layer_ids")
    return f"slot {j} (layer {ids[j]})" if isinstance(ids, list) and j < len(ids) else f"slot {j}"


def signature_problems(
    recorded: list[formats.Recorded] | None,
    mismatches: list[formats.SlotMismatch],
    tokens_signed: bool,
    exp: Expect,
    rel: str,
) -> list[Problem]:
    """A file's states (and, by `tokens_signed`, its tokens) against the signatures extraction
    recorded for its index: every slot of every file, in one more read of each (`formats.signatures`)."""
    if recorded is None and exp.signatures_required:
        return [
            Problem(
                STATE_SIGNATURE,
                rel,
                f"no signature line vouches for this file in {formats.SIGNATURES_DIR}/, though "
                f"{formats.DATA_CONFIG_FILE} records that extraction kept one for every file (its line was "
                "removed, or the file was copied in from another dataset): its states cannot be told from "
                "another layer's: re-extract this file",
            )
        ]
    if recorded is None:
        return [
            Problem(
                STATE_SIGNATURE,
                rel,
                f"no signature recorded for this file in {formats.SIGNATURES_DIR}/: this dataset's extraction "
                "did not write it (or an older eaglet did); its slots are checked by their scale only",
                WARNING,
            )
        ]
    out = []
    if not tokens_signed:
        out.append(
            Problem(
                STATE_SIGNATURE,
                rel,
                "input_ids or loss_mask are not what extraction wrote beside these states (shifted against "
                "them, edited, or another sample's): re-extract this file",
            )
        )
    for m in mismatches:
        if m.holds is not None:
            out.append(
                Problem(
                    LAYER_IDENTITY,
                    rel,
                    f"{slot_name(exp, m.slot)} holds the states extraction wrote in {slot_name(exp, m.holds)} "
                    "(slots swapped or filled from the wrong layer): re-extract this file",
                )
            )
        else:
            out.append(
                Problem(
                    STATE_SIGNATURE,
                    rel,
                    f"{slot_name(exp, m.slot)} is not what extraction wrote there (its signature is "
                    f"{m.distance:.2g} off, relative; {formats.SIGNATURE_TOLERANCE:g} allowed): another layer's "
                    "states, another file's, or values changed since: re-extract this file",
                )
            )
    return out


def token_range_problems(ids: torch.Tensor, vocab_size: int | None, rel: str) -> list[Problem]:
    if not ids.shape[0] or vocab_size is None:
        return []
    lo, hi = int(ids.min()), int(ids.max())
    if 0 <= lo and hi < vocab_size:
        return []
    bad = ((ids < 0) | (ids >= vocab_size)).nonzero().flatten().tolist()
    return [Problem(TOKEN_RANGE, rel, f"token ids {lo}..{hi} outside [0, {vocab_size}) at positions {fmt_rows(bad)}")]


def check_mask(res: FileResult, s: formats.FileStates, exp: Expect) -> None:
    """The mask's values; its masked tokens (for token_freq.pt); and, with the chat template's
    generation prompt, its runs against the assistant turns."""
    m, ids = s.loss_mask, s.input_ids
    if m is None or not is_int_tensor(m) or m.dim() != 1:
        return
    res.problems += mask_value_problems(m, res.path)
    if m.shape[0] != ids.shape[0]:
        return
    masked_ids = ids[m == 1]
    res.masked = int(masked_ids.numel())
    u, c = torch.unique(masked_ids, return_counts=True)
    res.masked_tokens = (u.tolist(), c.tolist())
    if exp.gen_prompt_ids:
        res.template_checked = True
        issues = mask_template_issues(ids.tolist(), (m == 1).int().tolist(), exp.gen_prompt_ids, exp.eot_ids)
        if issues:
            more = f" (+{len(issues) - 1} more)" if len(issues) > 1 else ""
            res.problems.append(Problem(MASK_TEMPLATE, res.path, issues[0] + more))


def teacher_problems(t: formats.StoredTeacher, exp: Expect, rel: str) -> list[Problem]:
    out = stored_teacher_problems(t, exp.vocab_size, rel)
    k = t.ids.shape[1]
    if exp.teacher_top_k is not None and k != exp.teacher_top_k:
        out.append(
            Problem(
                WRONG_SHAPE,
                rel,
                f"teacher_ids hold {k} tokens per position, expected {exp.teacher_top_k} ({exp.source})",
            )
        )
    return out


def check_slot_values(res: FileResult, states: list[torch.Tensor], usable: list[bool]) -> None:
    """Each well-formed slot's value problems and statistics (NaN where a slot is not usable)."""
    for j, (h, ok) in enumerate(zip(states, usable)):
        probs, sumsq, elems, med, mx = (
            state_value_problems(h, j, res.path) if ok else ([], 0.0, 0, float("nan"), float("nan"))
        )
        res.problems += probs
        res.slot_sumsq.append(sumsq)
        res.slot_elems.append(elems)
        res.slot_median_row_rms.append(med)
        res.slot_max_row_rms.append(mx)
