"""Range rules for the numeric options of every stage, applied in the stage's entry function, so
the command line, recipes and Python callers all get the same one-line error, named as the
command-line option (`--batch-size 0: must be >= 1`). None means "the default" and always passes.

Every rule also refuses inf and nan: no option takes them (a count or size made from one
overflows `int()`, a rate or fraction of one means nothing), and `inf >= 1` would pass a bare
comparison. The command line and recipes refuse them earlier, where they are parsed
(`options.parse_float`, `recipe.check_table`), with the same test: `finite`."""

from __future__ import annotations

import math
import numbers
from dataclasses import fields
from typing import Any, Callable


def finite(value: Any) -> bool:
    """Whether a number is neither inf nor nan; ints are always finite (and may exceed a float's range)."""
    return not isinstance(value, float) or math.isfinite(value)


def option_error(name: str, value: Any, rule: str, why: str = "") -> ValueError:
    return ValueError(f"--{name.replace('_', '-')} {value}: must be {rule}" + (f": {why}" if why else ""))


def check(rule: str, ok: Callable[[Any], bool], why: str = "", **values: Any) -> None:
    """Each value that is not None finite and `ok`, else the error that says `rule`."""
    for name, value in values.items():
        if value is None:
            continue
        if not isinstance(value, numbers.Real):  # text or a list read back from a file, not a number
            raise option_error(name, repr(value), f"a number {rule}", why)
        if not finite(value):
            raise option_error(name, value, f"{rule} and finite", why)
        if not ok(value):
            raise option_error(name, value, rule, why)


def at_least(least: float, **values: Any) -> None:
    check(f">= {least}", lambda v: v >= least, **values)


def above(bound: float, **values: Any) -> None:
    check(f"> {bound}", lambda v: v > bound, **values)


def within(
    low: float, high: float, why: str = "", high_open: bool = False, low_open: bool = False, **values: Any
) -> None:
    """Each value in the interval from low to high (closed unless said open)."""
    rule = f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"

    def ok(v: Any) -> bool:
        return (v > low if low_open else v >= low) and (v < high if high_open else v <= high)

    check(rule, ok, why, **values)


SEED_MAX = 2**64 - 1  # torch.manual_seed takes no larger seed (and a negative one only down to -2**63)


def seeds(**values: Any) -> None:
    """Random seeds torch takes."""
    within(0, SEED_MAX, "the seeds torch takes", **values)


# A duration or a data scale no run reaches: an hour a day for a century is still under this,
# and a schedule or chat count made from a larger one overflows later, far from the option.
# Tokens one generation makes, and tokens one decoding cycle drafts and verifies: beyond any model's
# positions (a million) and any tree a pass verifies (4096), a size is a typo, and would reach torch
# as a tensor of negative size
MAX_NEW_TOKENS = 1 << 20
MAX_CYCLE_TOKENS = 4096
MAX_SECONDS = 10 * 365 * 24 * 3600.0
MAX_SCALE = 1e6


def seconds(**values: Any) -> None:
    """Durations: above 0 and at most ten years."""
    within(0, MAX_SECONDS, "ten years at most", low_open=True, **values)


# What a config field's annotation admits (the annotations as written, `from __future__`
# strings): a bool is no count, and an int is a fine float.
ANNOTATED_KINDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "int": (lambda v: type(v) is int, "a whole number"),
    "float": (lambda v: type(v) in (int, float), "a number"),
    "bool": (lambda v: type(v) is bool, "true or false"),
    "str": (lambda v: type(v) is str, "text"),
    "list[int]": (lambda v: type(v) is list and all(type(i) is int for i in v), "a list of whole numbers"),
}


def of_annotated_kinds(config: Any) -> None:
    """Each field of a dataclass `config` of the kind its annotation says (None where it admits
    None), else the error that names it as its option: a value read back from a file (a resumed
    run's settings) is not parsed by the command line."""
    for f in fields(config):
        kind, _, optional = str(f.type).partition(" | ")
        value = getattr(config, f.name)
        if kind not in ANNOTATED_KINDS or (value is None and optional == "None"):
            continue
        ok, what = ANNOTATED_KINDS[kind]
        if not ok(value):
            raise option_error(f.name, repr(value), what)
