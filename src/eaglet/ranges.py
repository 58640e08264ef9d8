"""Range rules for the numeric options of every stage, applied in the stage's entry function, so
the command line, recipes and Python callers all get the same one-line error, named as the
command-line option (`--batch-size 0: must be >= 1`). None means "the default" and always passes."""

from __future__ import annotations

from typing import Any


def option_error(name: str, value: Any, rule: str) -> ValueError:
    return ValueError(f"--{name.replace('_', '-')} {value}: must be {rule}")


def at_least(least: float, **values: Any) -> None:
    for name, value in values.items():
        if value is not None and not value >= least:  # `not >=` also refuses NaN
            raise option_error(name, value, f">= {least}")


def above(bound: float, **values: Any) -> None:
    for name, value in values.items():
        if value is not None and not value > bound:
            raise option_error(name, value, f"> {bound}")


def within(low: float, high: float, why: str = "", high_open: bool = False, low_open: bool = False,
           **values: Any) -> None:
    """Each value in the interval from low to high (closed unless said open)."""
    rule = f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}" + (f": {why}" if why else "")
    for name, value in values.items():
        if value is None:
            continue
        ok_low = value > low if low_open else value >= low
        ok_high = value < high if high_open else value <= high
        if not (ok_low and ok_high):
            raise option_error(name, value, rule)
