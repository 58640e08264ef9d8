"""Recipes: the whole pipeline from one TOML file, stage by stage, resumable (`eaglet run`).

    regen -> prepare -> extract -> check -> train -> eval

A recipe has one table per stage, holding that stage's options (the keyword arguments of its
entry function: `regen.regenerate`, `data.prepare`, `extract.extract`, `check.check_dataset`,
`training.loop.train`, `evaluate.evaluate`), plus `[recipe]` (name, target, description) and `[scale]`
(the option paths `--scale` multiplies). A stage leaves `OUT/stages/<stage>.json` when it
finishes, with the options it ran with, its figures and its time; a rerun skips finished stages
and continues unfinished ones from where they stopped (regen, extract and train resume
themselves). Changing a finished stage's options, or the target, is refused rather than silently
mixing runs. Everything that can be checked without running a stage is checked before the first
one starts: every table key and option (name and type, `--set` and `--scale` applied), and that
each stage that runs finds the output it reads.

Built-in recipes live in `eaglet/recipes/` (`eaglet run demo`, `eaglet run smollm2-sharegpt`);
any other path to a .toml file works too.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import difflib
import json
import logging
import os
import textwrap
import time
import types
import typing
from dataclasses import MISSING, dataclass, field
from pathlib import Path
from typing import Any, Callable

from eaglet import families, formats, ranges
from eaglet.check import check_dataset
from eaglet.cli import resolve
from eaglet.evaluate import evaluate
from eaglet.extract import extract
from eaglet.options import (
    APPEND,
    BOOL,
    DRAFTER_FAMILIES,
    DRAFTER_METHODS,
    EAGLE3,
    FLAG,
    RECIPE_STAGES,
    CheckOptions,
    DemoOptions,
    EvalOptions,
    ExtractOptions,
    Option,
    PrepareOptions,
    RegenOptions,
    RunOptions,
    TrainOptions,
    defaults_of,
    parse_duration,
    parse_float,
    parse_layer_ids,
    parse_list,
    parse_threads,
)
from eaglet.options import STAGES as STAGE_OPTIONS
from eaglet.prepare import prepare
from eaglet.recipe_file import (
    apply_overrides,
    apply_scale,
    changed_inputs,
    input_digests,
    load_recipe,
    overridden,
    parse_value,
    recipe_path,
    toml_value,
)
from eaglet.regen import regenerate
from eaglet.target import TargetRef, resolve_target
from eaglet.training.loop import train

log = logging.getLogger(__name__)

STAGES = RECIPE_STAGES
STAGE_MARKERS = "stages"
SUMMARY_FILE = "summary.json"
CHATS_FILE = "chats.jsonl"
# The keys of [recipe] and [scale] and their types; `out` is the default of --out; `drafters`: train
# one drafter of each family (an equal share of [train]'s time budget each), evaluate each, keep the winner.
RECIPE_KEYS: dict[str, Any] = {
    "name": str,
    "target": str,
    "description": str,
    "out": str,
    "drafters": list[str],
    "why": str,
}
SCALE_KEYS: dict[str, Any] = {"multiply": list[str]}
# What the runner reads of a finished stage's marker: key -> (its Python types, its JSON name).
# "target" is read too, but may be missing (markers written before they recorded it).
MARKER_KEYS: dict[str, tuple[type | tuple[type, ...], str]] = {
    "options": (dict, "a JSON object"),
    "result": (dict, "a JSON object"),
    "seconds": ((int, float), "a number"),
}


# ---------------------------------------------------------------------------------------------
# Stages
# ---------------------------------------------------------------------------------------------


@dataclass
class Paths:
    root: Path

    @property
    def chats(self) -> Path:
        return self.root / "regen" / CHATS_FILE

    @property
    def prepared(self) -> Path:
        return self.root / "prepared"

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def train(self) -> Path:
        return self.root / "train"

    @property
    def eval(self) -> Path:
        return self.root / "eval"

    def marker(self, stage: str) -> Path:
        return self.root / STAGE_MARKERS / f"{stage}.json"

    def output_of(self, stage: str) -> Path:
        return {
            "regen": self.chats,
            "prepare": self.prepared,
            "extract": self.data,
            "check": self.data,
            "train": self.train,
            "eval": self.eval,
        }[stage]


def option_hint(o: Option) -> Any:
    """The type a recipe value of this option must have, from its declaration (eaglet.options)."""
    if o.kind == FLAG:
        return bool
    if o.kind == APPEND:
        return list[str]
    parsed_as: dict[Callable[[str], Any], Any] = {
        parse_layer_ids: list[int],
        parse_list: list[str],
        parse_duration: float,
        parse_float: float,
        parse_threads: int | str,
    }
    base = parsed_as.get(o.type, o.type)
    base = bool if o.kind == BOOL else base
    return base | None if o.default is None else base


def option_types(stage: str) -> dict[str, Any]:
    """A stage's recipe options and their types, from the one declaration of its options
    (eaglet.options): what the recipe wires itself (folders, target, resume) is not among them."""
    return {key: option_hint(o) for key, o in STAGE_OPTIONS[stage].recipe_options().items()}


def matches(value: Any, hint: Any) -> bool:
    """Whether a TOML value fits a type hint. An int fits float; a list fits list, tuple and
    Sequence hints, a string never does (`methods = "chain"` would be read letter by letter)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(matches(value, a) for a in args)
    if hint is Any:
        return True
    if hint is type(None):
        return value is None
    if hint is int:  # bool is an int to Python, not to a recipe
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if origin in (list, tuple, collections.abc.Sequence):
        item = args[0] if args else Any  # list[X], Sequence[X], tuple[X, ...]
        return isinstance(value, (list, tuple)) and all(matches(v, item) for v in value)
    if isinstance(hint, type):
        return isinstance(value, hint)
    return True  # a hint this check does not know: the stage checks the value itself


def type_name(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(type_name(a) for a in args)
    if origin in (list, tuple, collections.abc.Sequence):
        return f"list of {type_name(args[0])}" if args else "list"
    return "None" if hint is type(None) else getattr(hint, "__name__", str(hint))


def likely_meant(value: Any, hint: Any) -> Any:
    """The value of the right type the user most likely meant ("4" -> 4, "chain,tree" ->
    ["chain", "tree"], 3 -> [3]), or None when no guess fits."""
    if isinstance(value, str):
        guesses = [parse_value(value), [parse_value(v) for v in value.split(",")]]
    else:
        guesses = [[value]]
    return next((g for g in guesses if matches(g, hint)), None)


def key_label(source: str | Path, table: str, key: str, set_by: dict[str, str]) -> str:
    text = set_by.get(f"{table}.{key}")
    return f"--set {text} (recipe {source})" if text else f"{source} [{table}].{key}"


def closest(word: str, options: collections.abc.Iterable[str]) -> str:
    match = difflib.get_close_matches(word, list(options), n=1)
    return f" (did you mean {match[0]!r}?)" if match else ""


def check_table(
    source: str | Path, table: str, values: dict[str, Any], types_: dict[str, Any], set_by: dict[str, str]
) -> None:
    """Every key of a table is one it takes, with a value of the type it takes."""
    for key, value in values.items():
        label = key_label(source, table, key, set_by)
        noun = "option" if table in STAGES else "key"
        if key not in types_:
            raise ValueError(
                f"{label}: unknown {noun}{closest(key, types_)}; [{table}] takes {', '.join(sorted(types_))}"
            )
        if not matches(value, types_[key]):
            guess = likely_meant(value, types_[key])
            fix = f"write {toml_value(guess)}" if guess is not None else "give it a value of that type"
            raise ValueError(
                f"{label}: {toml_value(value)} is a {type(value).__name__}, expected {type_name(types_[key])}; {fix}"
            )
        if not ranges.finite(value):  # TOML spells them inf and nan, as --set does
            raise ValueError(
                f"{label}: {value} is not a finite number; write a number such as 1.0 (no option takes inf or nan)"
            )


def check_scale_paths(source: str | Path, paths: list[str]) -> None:
    """[scale] multiply names numeric stage options ("regen.num_samples"): a typo would leave the
    data size unscaled without a word."""
    every = {f"{s}.{k}": hint for s in STAGES for k, hint in option_types(s).items()}
    twice = sorted({p for p in paths if paths.count(p) > 1})
    if twice:  # it would be multiplied by --scale once for each time it is named
        raise ValueError(f"{source} [scale].multiply: {', '.join(map(repr, twice))} named more than once")
    for path in paths:
        if path not in every:
            raise ValueError(
                f"{source} [scale].multiply: {path!r} names no stage option{closest(path, every)}; "
                f'write STAGE.OPTION, e.g. "regen.num_samples"'
            )
        if not matches(1, every[path]):
            raise ValueError(
                f"{source} [scale].multiply: {path!r} is a {type_name(every[path])} option, not a "
                f"number; --scale multiplies numbers: remove it from multiply"
            )


def validate(recipe: dict[str, Any], source: str | Path = "recipe", set_by: dict[str, str] | None = None) -> None:
    """Every key of every table is one the recipe or its stage's entry function takes, with a value
    of the type it takes: fail before hours of work, not in the middle. `set_by` ("stage.key" ->
    --set text) names the --set that gave a value rather than the file."""
    set_by = set_by or {}
    if not any(stage in recipe for stage in STAGES):  # it would run nothing, and say it succeeded
        raise ValueError(f"{source}: names no stage; add a table for each stage to run: {', '.join(STAGES)}")
    check_table(source, "recipe", recipe.get("recipe", {}), RECIPE_KEYS, set_by)
    check_table(source, "scale", recipe.get("scale", {}), SCALE_KEYS, set_by)
    check_scale_paths(source, recipe.get("scale", {}).get("multiply", []))
    for stage in STAGES:
        if stage in recipe:
            check_table(source, stage, recipe[stage], option_types(stage), set_by)
    refuse_what_a_file_may_not_set(recipe, source, set_by)
    if "regen" in recipe and "data" in recipe.get("prepare", {}):
        raise ValueError(
            f"{key_label(source, 'prepare', 'data', set_by)}: set, but this recipe regenerates its "
            f"chats and prepare reads the [regen] output; move 'data' to [regen] or drop the [regen] "
            f"table"
        )


# Options a recipe file may not set, only the user (--set): where the environment's API key goes
USER_ONLY_KEYS = {"base_url": "the environment's OPENAI_API_KEY is sent to it"}
# Folders a stage writes into: from a recipe file, inside the working folder only (as [recipe].out)
WRITTEN_FOLDER_KEYS = ("offload_folder",)


def refuse_what_a_file_may_not_set(recipe: dict[str, Any], source: str | Path, set_by: dict[str, str]) -> None:
    """A downloaded recipe sends no key to an endpoint it names and writes nowhere outside the
    working folder; the same values given with --set are the user's own."""
    for stage in STAGES:
        for key, value in recipe.get(stage, {}).items():
            if f"{stage}.{key}" in set_by:
                continue
            label = key_label(source, stage, key, set_by)
            if key in USER_ONLY_KEYS:
                raise ValueError(
                    f"{label}: a recipe file may not name it ({USER_ONLY_KEYS[key]}); give it yourself "
                    f"with --set {stage}.{key}=..."
                )
            if key in WRITTEN_FOLDER_KEYS and isinstance(value, str):
                formats.inside_folder(Path.cwd(), value, label)


def check_ranges(recipe: dict[str, Any], source: str | Path) -> None:
    """Every stage's numbers, checked now, before the first stage runs: by the config dataclass
    that checks them (train's TrainConfig, eval's DecodeSettings: eaglet.options `Stage.checked_by`),
    else by the stage options' own `check_numbers`. An out-of-range number would otherwise stop the
    recipe only when its stage starts, after the stages before it."""
    for stage in STAGES:
        if stage not in recipe:
            continue
        checked_by = STAGE_OPTIONS[stage].checked_by
        cls = resolve(checked_by) if checked_by else STAGE_OPTIONS[stage].config
        fields = dataclasses.fields(cls)
        # what a recipe table never sets (the stage's paths) is left empty: only numbers are checked here
        unset = {f.name: None for f in fields if f.default is MISSING and f.default_factory is MISSING}
        given = {k: v for k, v in recipe[stage].items() if k in {f.name for f in fields}}
        try:
            made = cls(**{**unset, **given})
            if not checked_by and hasattr(made, "check_numbers"):
                made.check_numbers()
        except ValueError as e:
            raise ValueError(f"{source} [{stage}]: {e}") from None


def run_regen(opts: dict[str, Any], paths: Paths, target: str | None, command: str) -> dict[str, Any]:
    s = regenerate(RegenOptions(out=paths.chats, target=target, resume=True, **opts))
    log_lines(s.lines())
    return {
        "conversations": s.written + s.already_done,
        "failed": s.failed,
        "turns": s.turns,
        "tokens": s.tokens,
        "tokens_per_s": round(s.tokens / s.seconds, 1) if s.seconds else None,
    }


def run_prepare(
    opts: dict[str, Any], paths: Paths, target: str | None, command: str, has_regen: bool
) -> dict[str, Any]:
    # `validate` refused 'data' here when the recipe regenerates
    data = {"data": str(paths.chats)} if has_regen else {}
    # an unfinished earlier attempt is redone whole (prepare is quick): replaced as prepare replaces
    # a dataset, the old one kept until the new is complete, and a folder of other files refused.
    # A finished one without this recipe's marker was made outside it: never replaced unasked.
    if (paths.prepared / formats.PREPARE_CONFIG_FILE).exists():
        raise ValueError(
            f"{paths.prepared}: a finished prepared dataset that {paths.marker('prepare')} does not "
            f"record (made outside this recipe, or its marker removed); remove {paths.prepared} to "
            "have the recipe prepare it again, or use another --out"
        )
    s = prepare(PrepareOptions(target=target, out=paths.prepared, **{**opts, **data, "overwrite": True}), command)
    log_lines(s.lines())
    return {"samples": s.samples, "tokens": s.tokens, "assistant_tokens": s.masked_tokens}


def run_extract(opts: dict[str, Any], paths: Paths, target: str | None, command: str) -> dict[str, Any]:
    s = extract(ExtractOptions(prepared=paths.prepared, out=paths.data, target=target, **opts), command)
    log_lines(s.lines())
    return {
        "samples": s.written + s.already_done,
        "tokens": s.tokens_on_disk,
        "bytes": s.bytes_on_disk,
        "tokens_per_s": round(s.tokens / s.seconds, 1) if s.seconds else None,
    }


def run_check(opts: dict[str, Any], paths: Paths, target: str | None, command: str) -> dict[str, Any]:
    report = check_dataset(CheckOptions(path=paths.data, target=target, **opts))
    log_lines(report.lines())
    if not report.clean:
        raise ValueError(
            f"check: {paths.data} is not clean, training would learn from wrong data:\n" + "\n".join(report.lines())
        )
    return {
        "verdict": "CLEAN",
        "files": report.files,
        "tokens": report.tokens,
        "next_token_accuracy": report.next_token_accuracy,
    }


def run_train(
    opts: dict[str, Any], paths: Paths, target: str | None, command: str, families: list[str]
) -> dict[str, Any]:
    """One drafter, or with [recipe] drafters one of each family into train/FAMILY, each with an
    equal share of the time budget."""
    if not families:
        return train_one(opts, paths.train, paths, target, command)
    share = {"time_budget": opts["time_budget"] / len(families)} if opts.get("time_budget") else {}
    runs = {}
    for family in families:
        print(f"  drafter {family} -> {paths.train / family}")
        runs[family] = train_one({**opts, **share, "drafter": family}, paths.train / family, paths, target, command)
    return {"families": runs}


def train_one(opts: dict[str, Any], out: Path, paths: Paths, target: str | None, command: str) -> dict[str, Any]:
    # online training runs the target in the loop on the prepared chats: no extract stage needed
    data = paths.prepared if opts.get("online") else paths.data
    # resumed: the options of the recipe are those given now, compared with the run's own
    s = train(
        TrainOptions(dataset_dir=data, out_dir=out, target=target, resume=True, **opts),
        command=command,
        given=set(opts),
    )
    log_lines(s.lines())
    last = s.last_eval or {}
    return {
        "steps": s.step,
        "best_step": s.best_step,
        "best_tau": s.best_tau,
        "heldout_acc": last.get("acc"),
        "heldout_tau": last.get("tau"),
        "train_tokens": s.train_tokens,
        "tokens_per_s": round(s.train_tokens / s.seconds, 1) if s.seconds else None,
        "drafter": opts.get("drafter", EAGLE3),
    }


def family_methods(methods: list[str], family: str) -> list[str]:
    """A recipe's [eval] methods for one family's drafter: "chain" stands for the drafter's own
    proposal (a parallel family's block), a tree only for EAGLE-3."""
    if not families.family(family).parallel:
        return list(methods)
    own = [family if m == "chain" else m for m in methods if m != "tree"]
    return list(dict.fromkeys(own))


def run_eval(
    opts: dict[str, Any], paths: Paths, target: str | None, command: str, families: list[str]
) -> dict[str, Any]:
    """The drafter measured; with [recipe] drafters each family's, in its own run against plain
    greedy, and the one whose best drafter method is fastest kept (`kept`, said why)."""
    if not families:
        return eval_one(opts, paths.train, paths.eval, target)
    methods = opts.get("methods", defaults_of(EvalOptions)["methods"])
    runs = {}
    for family in families:
        print(f"  drafter {family} ({paths.train / family}) -> {paths.eval / family}")
        runs[family] = eval_one(
            {**opts, "methods": family_methods(methods, family)}, paths.train / family, paths.eval / family, target
        )
    return {"families": runs, "kept": winner(runs, paths)}


def eval_one(opts: dict[str, Any], drafter: Path, out: Path, target: str | None) -> dict[str, Any]:
    result = evaluate(EvalOptions(drafter_path=drafter, target=target, out=out, **opts))
    log_lines(result.table().splitlines())
    return {"sets": result.sets, "json": str(result.json_path), "plot": str(result.plot_path)}


def best_drafter_method(run: dict[str, Any]) -> tuple[str, float] | None:
    """(method, speedup over plain greedy) of a run's fastest drafter method, over its prompt sets' mean."""
    scores: dict[str, list[float]] = {}
    for methods in run["sets"].values():
        for m, r in methods.items():
            if m in DRAFTER_METHODS and r.get("speedup") is not None:
                scores.setdefault(m, []).append(r["speedup"])
    if not scores:
        return None
    return max(((m, sum(v) / len(v)) for m, v in scores.items()), key=lambda mv: mv[1])


def winner(runs: dict[str, dict[str, Any]], paths: Paths) -> dict[str, Any]:
    """The family whose best drafter method ran fastest against plain greedy on this machine."""
    best = {f: b for f, run in runs.items() if (b := best_drafter_method(run)) is not None}
    if not best:
        raise ValueError(
            f"eval: no drafter method measured a speedup in {paths.eval}; add a drafter method "
            f"(chain, hybrid) to [eval] methods"
        )
    family = max(best, key=lambda f: best[f][1])
    why = ", ".join(f"{f} {m} {s:.2f}x" for f, (m, s) in sorted(best.items(), key=lambda fb: -fb[1][1]))
    return {
        "family": family,
        "drafter": str(paths.train / family),
        "method": best[family][0],
        "speedup": round(best[family][1], 4),
        "why": f"fastest against plain greedy here: {why}",
    }


def log_lines(lines: list[str]) -> None:
    for line in lines:
        print(f"    {line}")


# ---------------------------------------------------------------------------------------------
# Running a recipe
# ---------------------------------------------------------------------------------------------


def recipe_out(meta: dict[str, Any], source: Any) -> Path:
    """The run folder a recipe names itself (`[recipe] out`, else runs/NAME): a path the recipe
    file may only name inside the working folder (a downloaded recipe never writes elsewhere);
    --out is the user's own and goes anywhere."""
    if meta.get("out"):
        out = formats.inside_folder(Path.cwd(), meta["out"], f"{source} [recipe].out")
        if os.path.realpath(out) == os.path.realpath(Path.cwd()):
            raise ValueError(
                f"{source} [recipe].out {meta['out']!r}: the working folder itself; a run folder "
                "inside it, e.g. runs/NAME"
            )
        return out
    name = meta["name"]
    if not name or Path(name).name != name or name in (".", ".."):
        raise ValueError(
            f"{source} [recipe].name {name!r}: a plain name (it names the folder runs/NAME), without '/' or '..'"
        )
    return Path("runs") / name


@dataclass
class RecipeSummary:
    name: str
    out: Path
    stages: dict[str, dict[str, Any]] = field(default_factory=dict)  # stage -> {seconds, result, reused}
    why: str = ""  # [recipe] why: the reason for the recipe's choices, said under the table

    def lines(self) -> list[str]:
        return summary_lines(self)


def run_demo(options: DemoOptions, command: str = "") -> RecipeSummary:
    """`eaglet demo`: `run` of the built-in recipe "demo", with the same options."""
    return run_recipe(options.as_run(), command)


def run_recipe(options: RunOptions, command: str = "") -> RecipeSummary:
    """Run (or continue) every stage of a recipe into `out`; returns the figures of each stage."""
    out, only, scale = options.out, options.only, options.scale
    source, overrides = recipe_path(options.spec), options.overrides
    set_by = overridden(overrides)
    recipe = apply_overrides(load_recipe(source), overrides)
    validate(recipe, source, set_by)
    recipe = apply_scale(recipe, scale)
    validate(recipe, source, set_by)  # what --scale wrote is checked too, not assumed of its type
    check_ranges(recipe, source)
    meta = recipe["recipe"]
    paths = Paths(Path(out) if out else recipe_out(meta, source))
    target = meta.get("target") or None
    families = check_families(meta.get("drafters") or [], recipe, source)
    stages = [s for s in STAGES if s in recipe]
    if only is not None and not only:  # "--only ," names no stage: it is no licence to run them all
        raise ValueError("--only: no stage named; give stages such as --only prepare,extract")
    if only:
        bad = set(only) - set(stages)
        if bad:
            raise ValueError(f"--only {sorted(bad)}: not stages of this recipe ({', '.join(stages)})")
    with formats.output_lock(paths.root, "run"):  # one run per OUT: a second is refused, naming the first
        plan = plan_stages(recipe, paths, only, source)
        ref = resolve_target(target)
        ran_with = target_record(ref)
        done = finished_stages(recipe, paths, ref)
        summary = RecipeSummary(meta["name"], paths.root, why=meta.get("why", ""))
        runners: dict[str, Callable[..., dict[str, Any]]] = {
            "regen": run_regen,
            "prepare": lambda o, p, t, c: run_prepare(o, p, t, c, "regen" in stages),
            "extract": run_extract,
            "check": run_check,
            "train": lambda o, p, t, c: run_train(o, p, t, c, families),
            "eval": lambda o, p, t, c: run_eval(o, p, t, c, families),
        }
        print(f"recipe {meta['name']} (scale {scale:g}) -> {paths.root}")
        for i, stage in enumerate(stages, 1):
            options = recipe[stage]
            recorded = stage_record(recipe, stage)
            header = f"[{i}/{len(stages)}] {stage} -> {paths.output_of(stage)}"
            if plan[stage] == "reuse":
                print(f"{header}: done earlier ({format_seconds(done[stage]['seconds'])}), reusing it")
                summary.stages[stage] = {**done[stage], "reused": True}
                continue
            if plan[stage] == "skip":
                print(f"{header}: skipped (--only)")
                continue
            print(header)
            t0 = time.perf_counter()
            result = runners[stage](options, paths, target, command)
            record = {
                "options": recorded,
                "inputs": input_digests(recipe[stage]),
                "target": ran_with,
                "result": jsonable(result),
                "seconds": time.perf_counter() - t0,
            }
            formats.write_json_atomic(paths.marker(stage), record)
            summary.stages[stage] = {**record, "reused": False}
        formats.write_json_atomic(
            paths.root / SUMMARY_FILE, {"recipe": meta, "target": ran_with, "scale": scale, "stages": summary.stages}
        )
        return summary


def stage_record(recipe: dict[str, Any], stage: str) -> dict[str, Any]:
    """The options a stage's marker records: its table's, and for train and eval the families
    [recipe] drafters asks for (another list is another run)."""
    families = recipe.get("recipe", {}).get("drafters")
    extra = {"drafters": families} if families and stage in ("train", "eval") else {}
    return jsonable({**recipe[stage], **extra})


def check_families(families: list[str], recipe: dict[str, Any], source: str | Path) -> list[str]:
    """[recipe] drafters: known families, once each, and no single family fixed in [train]."""
    unknown = [f for f in families if f not in DRAFTER_FAMILIES]
    if unknown:
        raise ValueError(f"{source} [recipe].drafters: {unknown} not drafter families ({', '.join(DRAFTER_FAMILIES)})")
    if len(set(families)) != len(families):
        raise ValueError(f"{source} [recipe].drafters: {families} names a family twice")
    if families and "drafter" in recipe.get("train", {}):
        raise ValueError(f"{source}: [train].drafter and [recipe].drafters both choose the family; keep one")
    return list(families)


def input_stage(stage: str, recipe: dict[str, Any]) -> str | None:
    """The stage whose output this one reads; None: it reads only what its options name."""
    if stage == "prepare":
        return "regen" if "regen" in recipe else None  # without [regen], prepare reads its own `data`
    if stage == "train":  # online: the target runs in the loop on the prepared chats
        return "prepare" if recipe["train"].get("online") else "extract"
    return {"extract": "prepare", "check": "extract", "eval": "train"}.get(stage)


def plan_stages(recipe: dict[str, Any], paths: Paths, only: list[str] | None, source: str | Path) -> dict[str, str]:
    """What each stage of the recipe does, decided before any runs: "reuse" (finished in OUT),
    "skip" (left out by --only) or "run". Refuses a stage that would run without the output it
    reads, which would otherwise fail, after the stages before it, on a missing folder."""
    plan = {
        s: "reuse" if paths.marker(s).exists() else "skip" if only and s not in only else "run"
        for s in STAGES
        if s in recipe
    }
    for stage, does in plan.items():
        need = input_stage(stage, recipe)
        if does == "reuse" and need is not None and plan.get(need) == "run":
            raise ValueError(
                f"{paths.marker(stage)}: {stage} finished on the output of {need}, which runs again "
                f"now ({paths.marker(need)} is missing): reusing {paths.output_of(stage)} would pair it "
                f"with data it was not made from; remove {paths.output_of(stage)} and "
                f"{paths.marker(stage)} too (it is made again), or use another --out"
            )
        if does != "run" or need is None or plan.get(need) in ("run", "reuse"):
            continue
        if need in plan:  # left out by --only: name every unfinished stage up the chain at once
            missing = [need]
            while plan.get(input_stage(missing[-1], recipe) or "") == "skip":
                missing.append(input_stage(missing[-1], recipe) or "")
            raise ValueError(
                f"--only {','.join(only or [])}: {stage} reads the output of {need} "
                f"({paths.output_of(need)}), which is not finished in {paths.root}; add "
                f"{','.join(reversed(missing))} to --only"
            )
        if not paths.marker(need).exists():  # a stage outside the recipe may have finished in OUT earlier
            online = " or set online = true in [train] (the target runs in the loop)" if stage == "train" else ""
            raise ValueError(
                f"{source}: [{stage}] reads the output of {need} ({paths.output_of(need)}), but the "
                f"recipe has no [{need}] table and {paths.root} holds no finished {need}; add the "
                f"table [{need}] (an empty one takes its defaults){online}"
            )
    return plan


def target_record(ref: TargetRef) -> dict[str, str]:
    """What a marker records of the target: a same-named target with other weights has another
    revision."""
    return {"name": ref.name, "revision": ref.revision}


def finished_stages(recipe: dict[str, Any], paths: Paths, ref: TargetRef) -> dict[str, dict[str, Any]]:
    """The markers in OUT, each checked against this run before any stage runs: every one must
    have run with this target (OUT is one target's run, stages outside the recipe included, since
    their output is read), and a stage of the recipe with these options."""
    done, target = {}, target_record(ref)
    for stage in STAGES:
        marker = paths.marker(stage)
        if not marker.exists():
            continue
        record = read_marker(marker)
        then = record.get("target")
        if then is None:
            # A marker from before markers recorded their target: nothing tells which it ran
            # with. It is reused as before (refusing would strand every run made so far), and
            # left as it is (writing this run's target into it would claim what nobody checked).
            print(f"note: {marker} does not record its target; reusing it as if run with {target['name']}")
        elif then.get("name") != ref.name or not ref.is_revision(then.get("revision")):
            raise ValueError(
                f"{marker}: {stage} ran with target {then.get('name')} (revision "
                f"{then.get('revision')}), this run's is {target['name']} (revision "
                f"{target['revision']}); use another --out for this target, or delete {paths.root} "
                f"to start over"
            )
        now = stage_record(recipe, stage) if stage in recipe else None
        if now is not None and record["options"] != now:
            raise ValueError(
                f"{stage}: {paths.root} already holds this stage run with other options "
                f"{option_diff(record['options'], now)}; use another output folder "
                f"or remove {paths.output_of(stage)} and {marker}"
            )
        changed = changed_inputs(record.get("inputs"), now)
        if changed:
            raise ValueError(
                f"{stage}: {', '.join(changed)} changed since {paths.root} ran this stage (its content "
                f"differs from what {marker} records), so its output is not reused; remove "
                f"{paths.output_of(stage)} and {marker} to run it again on the file as it is now, or "
                "use another output folder"
            )
        done[stage] = record
    return done


def marker_problem(record: Any) -> str | None:
    """What keeps the runner from reading a parsed stage marker, or None."""
    if not isinstance(record, dict):
        return f"it holds a JSON {type(record).__name__}, not an object"
    for key, (kinds, name) in MARKER_KEYS.items():
        if key not in record:
            return f"it has no {key!r}"
        if not isinstance(record[key], kinds) or isinstance(record[key], bool):
            return f"its {key!r} is {toml_value(record[key])}, not {name}"
    if record.get("target") is not None and not isinstance(record["target"], dict):
        return f"its 'target' is {toml_value(record['target'])}, not an object with a name and a revision"
    return None


def unreadable_marker(marker: Path, problem: str) -> ValueError:
    return ValueError(
        f"{marker}: not a readable stage marker: {problem}; delete it and the same command reruns that stage"
    )


def read_marker(marker: Path) -> dict[str, Any]:
    """A finished stage's marker, with every key the runner reads; one that cannot be read (cut
    off, edited, from another program) is refused naming it: without it the stage simply reruns."""
    try:
        record = formats.read_json(marker)
    except ValueError as e:  # not JSON, or not UTF-8: read_json's reason, the path is said once
        raise unreadable_marker(marker, f"not valid JSON ({e.__cause__ or e})") from None
    problem = marker_problem(record)
    if problem:
        raise unreadable_marker(marker, problem)
    return record


def jsonable(x: Any) -> Any:
    return json.loads(json.dumps(x, default=str))


def option_diff(then: dict[str, Any], now: dict[str, Any]) -> dict[str, Any]:
    return {k: (then.get(k), now.get(k)) for k in sorted(set(then) | set(now)) if then.get(k) != now.get(k)}


def format_seconds(s: float) -> str:
    m, sec = divmod(int(round(s)), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m{sec:02d}s" if h else f"{m}m{sec:02d}s"


# ---------------------------------------------------------------------------------------------
# The summary table
# ---------------------------------------------------------------------------------------------


def stage_figures(stage: str, r: dict[str, Any]) -> str:
    if stage == "regen":
        return f"{r['conversations']} chats regenerated ({r['failed']} failed), {r['tokens']:,} new tokens" + (
            f", {r['tokens_per_s']} tok/s" if r.get("tokens_per_s") else ""
        )
    if stage == "prepare":
        return f"{r['samples']} samples, {r['tokens']:,} tokens ({r['assistant_tokens']:,} assistant)"
    if stage == "extract":
        return f"{r['samples']} samples, {r['tokens']:,} tokens, {r['bytes'] / 2**20:,.0f} MiB"
    if stage == "check":
        acc = r.get("next_token_accuracy") or {}
        teacher = f", target's next-token accuracy {acc['stored_last']:.1%}" if "stored_last" in acc else ""
        return f"{r['verdict']}: {r['files']} files{teacher}"
    if stage in ("train", "eval") and "families" in r:
        parts = [f"{family}: {stage_figures(stage, run)}" for family, run in r["families"].items()]
        kept = r.get("kept")
        if kept:
            parts.append(f"kept {kept['family']} ({kept['drafter']}), {kept['why']}")
        return "\n" + "\n".join(f"{'':<19}{p}" for p in parts)
    if stage == "train":
        acc = " ".join(f"{a:.2f}" for a in r.get("heldout_acc") or [])
        where = families.family(r.get("drafter", EAGLE3)).position_name
        return (
            f"{r['steps']} steps; held-out acc per {where} [{acc}], simulated tau "
            f"{r['heldout_tau']:.2f} (best {r['best_tau']:.2f} at step {r['best_step']})"
            if r.get("heldout_tau") is not None
            else f"{r['steps']} steps"
        )
    if stage == "eval":
        parts = []
        for name, methods in r["sets"].items():
            pld = methods.get("prompt-lookup", {}).get("speedup")
            for m in DRAFTER_METHODS:
                if m in methods:
                    x = methods[m]
                    vs_pld = f", {x['speedup'] / pld:.2f}x vs prompt lookup" if pld else ""
                    parts.append(f"{name} {m}: tau {x['tau']:.2f}, {x['speedup']:.2f}x vs plain{vs_pld}")
            if pld:
                parts.append(f"{name} prompt lookup: {pld:.2f}x vs plain")
        return "; ".join(parts) + f"; plot {r['plot']}"
    return ""


def recorded_figures(stage: str, result: dict[str, Any]) -> str:
    """`stage_figures`, or what is missing from a reused marker's result (one written by another
    version): the summary comes after every stage ran, too late to fail on it."""
    try:
        return stage_figures(stage, result)
    except KeyError as e:
        return f"(its marker's result has no {e})"
    except (TypeError, ValueError):
        return "(its marker's result holds figures of another form)"


def summary_lines(s: RecipeSummary) -> list[str]:
    lines = [f"recipe {s.name}: {s.out}", f"{'stage':<8} {'time':>9}  figures", "-" * 60]
    total = 0.0
    for stage, rec in s.stages.items():
        total += rec["seconds"]
        lines.append(
            f"{stage:<8} {format_seconds(rec['seconds']):>9}  {recorded_figures(stage, rec['result'])}"
            + ("  (reused)" if rec.get("reused") else "")
        )
    lines.append(f"{'total':<8} {format_seconds(total):>9}")
    if s.why:
        lines += textwrap.wrap(f"why: {s.why}", width=110, subsequent_indent="  ")
    return lines
