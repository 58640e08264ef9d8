"""`eaglet <stage>`: a thin command line over each stage's entry function.

The parser is made from the declarations in `eaglet.options`; a stage's module (and with it torch)
is imported only when that stage runs, so `--help` answers at once.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import logging
import os
import shlex
import sys
from pathlib import Path
from typing import Any, Callable

from eaglet.options import APPEND, BOOL, FLAG, REMOTE_CODE_ENV, STAGES, Option, Stage


def resolve(ref: str) -> Any:
    """`module:name` -> the object. Imported here, not at the top: a stage's module pulls in torch
    and transformers (seconds), which `--help` and the other stages do not need."""
    module, name = ref.split(":")
    return getattr(importlib.import_module(module), name)


def add_option(p: argparse.ArgumentParser, o: Option) -> None:
    if o.positional:
        p.add_argument(o.name, help=o.help_text())
    elif o.kind == FLAG:
        p.add_argument(o.flag, action="store_true", dest=o.name, help=o.help_text())
    elif o.kind == BOOL:
        p.add_argument(o.flag, action=argparse.BooleanOptionalAction, default=None, dest=o.name, help=o.help_text())
    elif o.kind == APPEND:
        p.add_argument(o.flag, action="append", default=[], dest=o.name, metavar=o.metavar, help=o.help_text())
    else:
        p.add_argument(
            o.flag,
            type=o.type,
            default=o.default,
            choices=o.choices,
            required=o.required,
            dest=o.name,
            metavar=o.metavar,
            help=o.help_text(),
        )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="eaglet", description="Train EAGLE-3 draft models and prove they speed up decoding."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="let a model folder's own Python code run (its auto_map: custom model types, "
        "tokenizers such as Kimi-K2.5's), in eaglet and in the engines it starts; without it "
        "such a target is refused (same as EAGLET_TRUST_REMOTE_CODE=1)",
    )
    sub = parser.add_subparsers(dest="stage", required=True, metavar="STAGE")
    parser.set_defaults(stage_parsers=sub.choices)  # name -> subparser (`stage_parsers`)
    for stage in STAGES.values():
        p = sub.add_parser(stage.name, help=stage.help, description=stage.description)
        for o in stage.options:
            add_option(p, o)
    return parser


# ---------------------------------------------------------------------------------------------
# From parsed arguments to the entry function
# ---------------------------------------------------------------------------------------------


def stage_options(stage: Stage, args: argparse.Namespace) -> Any:
    """The stage's options object from the parsed arguments."""
    return stage.config(
        **{
            o.key: (not getattr(args, o.name)) if o.invert else getattr(args, o.name)
            for o in stage.options
            if not o.cli_only
        }
    )


def call_entry(stage: Stage, args: argparse.Namespace, **runtime: Any) -> Any:
    entry = resolve(stage.entry)
    if "command" in inspect.signature(entry).parameters:
        runtime["command"] = args.command
    return entry(stage_options(stage, args), **runtime)


def run_default(stage: Stage, args: argparse.Namespace) -> None:
    print("\n".join(call_entry(stage, args).lines()))


def run_check(stage: Stage, args: argparse.Namespace) -> None:
    """Print the report (or JSON); exit 1 when the dataset is not clean, so scripts can gate on it."""
    if args.max_per_kind < 0:  # refused before the check's minutes, not after them
        raise ValueError(f"--max-per-kind {args.max_per_kind}: must be >= 0")
    report = call_entry(stage, args)
    print(
        json.dumps(report.to_json(), indent=2, default=str) if args.json else "\n".join(report.lines(args.max_per_kind))
    )
    if not report.clean:
        raise SystemExit(1)


def run_train(stage: Stage, args: argparse.Namespace) -> None:
    # with --resume the run's own settings apply; those written now are compared with them
    given = given_options(args, [o.name for o in stage.options]) if args.resume else None
    keys = None if given is None else {o.key for o in stage.options if o.name in given}
    print("\n".join(call_entry(stage, args, given=keys).lines()))


def run_eval(stage: Stage, args: argparse.Namespace) -> None:
    result = call_entry(stage, args)
    print(result.table())
    for label, path in (("results", result.json_path), ("plot", result.plot_path)):
        if path is not None:
            print(f"{label}: {path}")


RUNNERS: dict[str, Callable[[Stage, argparse.Namespace], None]] = {
    "check": run_check,
    "train": run_train,
    "eval": run_eval,
}


def stage_parsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """Each stage's subparser, by stage name."""
    return parser.get_default("stage_parsers")


def given_options(args: argparse.Namespace, names: list[str]) -> set[str]:
    """Which of `names` were written on the command line: parse it again with a marker as their default."""
    stage = stage_parsers(args.parser)[args.stage]
    unset = object()
    saved = {n: stage.get_default(n) for n in names}
    stage.set_defaults(**{n: unset for n in names})
    try:
        probe = args.parser.parse_args(args.argv)
    finally:
        stage.set_defaults(**saved)
    return {n for n in names if getattr(probe, n) is not unset}


# ---------------------------------------------------------------------------------------------
# main: one line for the user on any failure
# ---------------------------------------------------------------------------------------------

INTERRUPTED = {name: s.interrupted for name, s in STAGES.items()}


def interrupted_advice(args: argparse.Namespace) -> str:
    """What an interrupted stage left and the command that continues it, in one line."""
    resume = "the same command" if getattr(args, "resume", False) else "the same command with --resume"
    return INTERRUPTED[args.stage].format(resume=resume)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args = parser.parse_args(argv)
    args.command = shlex.join(["eaglet", *argv])
    args.parser, args.argv = parser, argv
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s"
    )
    for noisy in ("transformers", "huggingface_hub", "accelerate"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    stage = STAGES[args.stage]
    if args.trust_remote_code:  # read by every loader of a target, and inherited by the engines eaglet starts
        os.environ[REMOTE_CODE_ENV] = "1"
    try:
        RUNNERS.get(stage.name, run_default)(stage, args)
    except KeyboardInterrupt:
        clear_progress_bars()
        print(f"eaglet {args.stage}: interrupted; {interrupted_advice(args)}", file=sys.stderr)
        return 130
    except Exception as e:  # one line for the user; the traceback only with -v
        if args.verbose:
            raise
        clear_progress_bars()
        print(f"eaglet {args.stage}: error: {error_line(e)}", file=sys.stderr)
        return 2
    return 0


def clear_progress_bars() -> None:
    """Erase progress bars an error left open, so the error gets a line of its own."""
    tqdm = sys.modules.get("tqdm")
    for bar in list(getattr(getattr(tqdm, "tqdm", None), "_instances", ())):
        bar.leave = False
        bar.close()


def error_line(e: Exception) -> str:
    """The message of an error in one line; an unexpected kind also names its type and -v."""
    from eaglet.formats import WriteFailed, os_error_reason  # here: formats imports torch (see `resolve`)

    if isinstance(e, OSError) and not isinstance(e, WriteFailed) and e.filename is not None:
        path = Path(e.filename)  # a folder eaglet could not create or a file it could not open
        return f"{path}: {os_error_reason(e, path)}"
    text = " ".join(str(e).split("\n")).strip() or type(e).__name__
    if isinstance(e, (ValueError, OSError, RuntimeError)):
        return text
    return f"{type(e).__name__}: {text} (run with -v for the traceback)"


if __name__ == "__main__":
    sys.exit(main())
