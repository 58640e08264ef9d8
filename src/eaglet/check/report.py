"""What `eaglet check` finds and how it says it: the kinds of problem, the report of a dataset,
and its text."""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any

from eaglet import formats

# The kinds of problem a layout's own schema check reports are named where the layouts are; they
# are check's kinds as much as those below (eaglet.check exports them all).
from eaglet.formats import AUX_CODES, TABLE_ROW, WRONG_DTYPE, WRONG_KEYS, WRONG_SHAPE  # noqa: F401

# Problem kinds: stable names (tests and `--json` users match on them), grouped in the report.
UNSAFE_PICKLE = "unsafe pickle"
UNREADABLE = "unreadable file"
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
STORED_TEACHER = "stored teacher"  # the compact layout's top-K of the target
CHECKSUM = "checksum mismatch"  # the compact layout's tensors against the checksums written with them
NO_FILES = "no hidden-state files"
LAYER_IDENTITY = "layer identity"
STATE_SIGNATURE = "state signature"  # a file's states against the signatures extraction recorded
MASK_TEMPLATE = "mask vs chat template"
TOO_LONG = "longer than the target"  # more tokens than the target has positions
NOT_CHECKED = "not checked"

ERROR, WARNING = "error", "warning"


@dataclass(frozen=True)
class Problem:
    kind: str  # one of the kinds above
    path: str  # file (relative to the dataset folder) or side file the problem is in
    message: str
    severity: str = ERROR  # warnings are reported but do not make the dataset unclean


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
    format: str | None = None  # the layout's name (a formats.FORMAT_*), None when no layout was found
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
# Text report
# ---------------------------------------------------------------------------------------------


def report_lines(r: CheckReport, max_per_kind: int = 10) -> list[str]:
    layout = formats.find_layout(r.format)
    out = [f"eaglet check {r.path}", f"  format: {layout.description if layout else 'none found'}"]
    out += file_lines(r) + slot_lines(r)
    if r.next_token_accuracy:
        a = r.next_token_accuracy
        what = "the stored teacher's argmax" if layout and layout.stores_teacher else "lm_head(norm(last))"
        out.append(
            f"  next-token accuracy of {what} on {a['positions']} masked positions: stored "
            f"{a['stored_last']:.1%}, recomputed {a['recomputed']:.1%}, agreement {a['agreement']:.1%}"
        )
    if r.generation_prompt:
        out.append(
            f"  loss mask vs chat template (generation prompt {r.generation_prompt!r}): "
            f"{r.template_checked_files} files checked"
        )
    out += problem_lines(r.problems, max_per_kind)
    out.append("result: CLEAN" if r.clean else f"result: NOT CLEAN ({len(r.errors)} problems)")
    return out


def file_lines(r: CheckReport) -> list[str]:
    """The files read: how many, their tokens and bytes, how fast, their lengths."""
    if not r.files:
        return []
    share = r.masked_tokens / max(r.tokens, 1)
    mb = r.bytes / 1e6
    return [
        f"  {r.files} files, {r.samples} samples, {r.tokens:,} tokens, {r.masked_tokens:,} masked "
        f"({share:.1%}), {mb:,.1f} MB, {r.bytes / max(r.tokens, 1):,.0f} bytes/token",
        f"  read in {r.seconds:.2f} s ({mb / max(r.seconds, 1e-9):,.0f} MB/s, {r.workers} threads)",
        "  lengths: " + ", ".join(f"{k}: {v}" for k, v in r.length_histogram.items()),
    ]


def slot_lines(r: CheckReport) -> list[str]:
    """Per-slot statistics, and the layer identity of each slot where a target was checked against."""
    out = []
    if r.slots:
        out.append(
            "  per-layer statistics (RMS over all tokens; median row RMS: mean [min..max] over files; max row RMS):"
        )
        for s in r.slots:
            out.append(
                f"    slot {s.slot} ({s.layer}): rms {s.rms:.4g}, median row rms {s.median_row_rms:.4g} "
                f"[{s.min_file_median_row_rms:.4g}..{s.max_file_median_row_rms:.4g}], "
                f"max row rms {s.max_row_rms:.4g}"
            )
    if r.identity:
        out.append(f"  layer identity vs {r.target} on {len(r.identity_files)} sampled files (worst file per slot):")
        for i in r.identity:
            mark = "ok" if i.best == i.expected else f"best match {i.best} (rel err {i.best_rel_err:.3g})"
            out.append(
                f"    slot {i.slot} = {i.expected}: cos {i.cos:.5f}, rel err {i.rel_err:.3g}, "
                f"max abs err {i.max_abs_err:.3g}; {mark}"
            )
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
