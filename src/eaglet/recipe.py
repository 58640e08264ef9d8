"""Recipes: the whole pipeline from one TOML file, stage by stage, resumable (`eaglet run`).

    regen -> prepare -> extract -> check -> train -> eval

A recipe has one table per stage, holding that stage's options (the keyword arguments of its
entry function: `regen.regenerate`, `data.prepare`, `extract.extract`, `check.check_dataset`,
`train.train`, `evaluate.evaluate`), plus `[recipe]` (name, target, description) and `[scale]`
(the option paths `--scale` multiplies). A stage leaves `OUT/stages/<stage>.json` when it
finishes, with the options it ran with, its figures and its time; a rerun skips finished stages
and continues unfinished ones from where they stopped (regen, extract and train resume
themselves). Changing a finished stage's options is refused rather than silently mixing runs.

Built-in recipes live in `eaglet/recipes/` (`eaglet run demo`, `eaglet run smollm2-sharegpt`);
any other path to a .toml file works too.
"""

from __future__ import annotations

import logging
import shutil
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from eaglet import formats

log = logging.getLogger(__name__)

STAGES = ("regen", "prepare", "extract", "check", "train", "eval")
BUILTIN_DIR = Path(__file__).parent / "recipes"
STAGE_MARKERS = "stages"
SUMMARY_FILE = "summary.json"
CHATS_FILE = "chats.jsonl"


# ---------------------------------------------------------------------------------------------
# Reading, scaling and overriding a recipe
# ---------------------------------------------------------------------------------------------

def builtin_recipes() -> list[str]:
    return sorted(p.stem for p in BUILTIN_DIR.glob("*.toml"))


def recipe_path(spec: str | Path) -> Path:
    """A built-in recipe name or a path to a .toml file."""
    path = Path(spec)
    if path.is_file():
        return path
    builtin = BUILTIN_DIR / f"{spec}.toml"
    if builtin.is_file():
        return builtin
    raise FileNotFoundError(f"recipe {str(spec)!r}: no such file and not a built-in recipe "
                            f"({', '.join(builtin_recipes())})")


def load_recipe(spec: str | Path) -> dict[str, Any]:
    path = recipe_path(spec)
    try:
        with open(path, "rb") as f:
            recipe = tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{path}: invalid TOML ({e})") from None
    unknown = set(recipe) - {"recipe", "scale", *STAGES}
    if unknown:
        raise ValueError(f"{path}: unknown tables {sorted(unknown)}; expected [recipe], [scale] and stages "
                         f"{', '.join(STAGES)}")
    recipe.setdefault("recipe", {}).setdefault("name", path.stem)
    return recipe


def parse_value(raw: str) -> Any:
    """An option value read as TOML (numbers, booleans, lists), else as a string."""
    try:
        return tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        return raw.strip()


def parse_override(text: str) -> tuple[str, str, Any]:
    """`stage.key=value`, the value read by `parse_value`."""
    key, sep, raw = text.partition("=")
    stage, dot, name = key.strip().partition(".")
    if not sep or not dot or not name:
        raise ValueError(f"--set {text!r}: expected STAGE.KEY=VALUE, e.g. train.total_steps=100")
    return stage, name.strip(), parse_value(raw)


def apply_overrides(recipe: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in recipe.items()}
    for text in overrides:
        stage, name, value = parse_override(text)
        if stage not in ("recipe", *STAGES):
            raise ValueError(f"--set {text!r}: unknown stage {stage!r} (one of {', '.join(STAGES)})")
        out.setdefault(stage, {})[name] = value
    return out


def apply_scale(recipe: dict[str, Any], scale: float) -> dict[str, Any]:
    """Multiply the options `[scale] multiply` names (e.g. "regen.num_samples") by `scale`."""
    if scale <= 0:
        raise ValueError(f"--scale {scale}: must be positive")
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in recipe.items()}
    for path in recipe.get("scale", {}).get("multiply", []):
        stage, _, name = path.partition(".")
        value = out.get(stage, {}).get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            scaled = value * scale
            out[stage][name] = max(1, round(scaled)) if isinstance(value, int) else scaled
    return out


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
        return {"regen": self.chats, "prepare": self.prepared, "extract": self.data, "check": self.data,
                "train": self.train, "eval": self.eval}[stage]


def parameters(fn: Callable[..., Any], exclude: set[str]) -> set[str]:
    import inspect

    return {n for n, p in inspect.signature(fn).parameters.items()
            if n not in exclude and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}


def allowed_options(stage: str) -> set[str]:
    """A stage's recipe options: its entry function's keyword arguments, minus what the recipe
    wires itself (folders, target, resume, progress)."""
    from dataclasses import fields

    wired = {"out", "target", "command", "resume", "progress", "progress_bar", "show_progress"}
    if stage == "regen":
        from eaglet.regen import regenerate
        return parameters(regenerate, wired)
    if stage == "prepare":
        from eaglet.data import prepare
        return parameters(prepare, wired)
    if stage == "extract":
        from eaglet.extract import extract
        return parameters(extract, wired | {"prepared", "num_shards", "shard_id", "write_threads"})
    if stage == "check":
        from eaglet.check import check_dataset
        return parameters(check_dataset, wired | {"path", "use_target"})
    if stage == "train":
        from eaglet.train import TrainConfig
        return {f.name for f in fields(TrainConfig)}
    if stage == "eval":
        from eaglet.evaluate import DecodeSettings, evaluate
        return (parameters(evaluate, wired | {"drafter_path", "settings", "plot"})
                | {f.name for f in fields(DecodeSettings)} - {"eos_ids"})
    raise ValueError(f"unknown stage {stage!r}")


def validate(recipe: dict[str, Any]) -> None:
    """Every option of every stage is one its entry function takes: fail before hours of work."""
    for stage in STAGES:
        if stage in recipe:
            unknown = set(recipe[stage]) - allowed_options(stage)
            if unknown:
                raise ValueError(f"recipe [{stage}]: unknown options {sorted(unknown)}; "
                                 f"allowed: {', '.join(sorted(allowed_options(stage)))}")


def run_regen(opts: dict[str, Any], paths: Paths, target: str | None, command: str) -> dict[str, Any]:
    from eaglet.regen import regenerate

    opts = dict(opts)
    data = opts.pop("data", "sharegpt")
    s = regenerate(data, paths.chats, target, resume=True, **opts)
    log_lines(s.lines())
    return {"conversations": s.written + s.already_done, "failed": s.failed, "turns": s.turns,
            "tokens": s.tokens, "tokens_per_s": round(s.tokens / s.seconds, 1) if s.seconds else None}


def run_prepare(opts: dict[str, Any], paths: Paths, target: str | None, command: str,
                has_regen: bool) -> dict[str, Any]:
    from eaglet.data import prepare

    opts = dict(opts)
    if has_regen and "data" in opts:
        raise ValueError("recipe [prepare]: 'data' is set, but this recipe regenerates its chats: prepare reads "
                         "the [regen] output; move 'data' to [regen] or drop the [regen] table")
    data = str(paths.chats) if has_regen else opts.pop("data", "sharegpt")
    if paths.prepared.exists():  # an unfinished earlier attempt: prepare is quick, redo it whole
        shutil.rmtree(paths.prepared)
    s = prepare(target, data, paths.prepared, command=command, **opts)
    log_lines(s.lines())
    return {"samples": s.samples, "tokens": s.tokens, "assistant_tokens": s.masked_tokens}


def run_extract(opts: dict[str, Any], paths: Paths, target: str | None, command: str) -> dict[str, Any]:
    from eaglet.extract import extract

    s = extract(paths.prepared, paths.data, target, command=command, **opts)
    log_lines(s.lines())
    return {"samples": s.written + s.already_done, "tokens": s.tokens_on_disk, "bytes": s.bytes_on_disk,
            "tokens_per_s": round(s.tokens / s.seconds, 1) if s.seconds else None}


def run_check(opts: dict[str, Any], paths: Paths, target: str | None, command: str) -> dict[str, Any]:
    from eaglet.check import check_dataset

    report = check_dataset(paths.data, target, True, **opts)
    log_lines(report.lines())
    if not report.clean:
        raise ValueError(f"check: {paths.data} is not clean, training would learn from wrong data:\n"
                         + "\n".join(report.lines()))
    return {"verdict": "CLEAN", "files": report.files, "tokens": report.tokens,
            "next_token_accuracy": report.next_token_accuracy}


def run_train(opts: dict[str, Any], paths: Paths, target: str | None, command: str) -> dict[str, Any]:
    from eaglet.train import train

    # online training runs the target in the loop on the prepared chats: no extract stage needed
    data = paths.prepared if opts.get("online") else paths.data
    s = train(data, paths.train, target, resume=True, command=command, **opts)
    log_lines(s.lines())
    last = s.last_eval or {}
    return {"steps": s.step, "best_step": s.best_step, "best_tau": s.best_tau, "heldout_acc": last.get("acc"),
            "heldout_tau": last.get("tau"), "train_tokens": s.train_tokens,
            "tokens_per_s": round(s.train_tokens / s.seconds, 1) if s.seconds else None}


def run_eval(opts: dict[str, Any], paths: Paths, target: str | None, command: str) -> dict[str, Any]:
    from dataclasses import fields

    from eaglet.evaluate import DecodeSettings, evaluate

    opts = dict(opts)
    setting_names = {f.name for f in fields(DecodeSettings)} - {"eos_ids"}
    settings = DecodeSettings(**{k: opts.pop(k) for k in list(opts) if k in setting_names})
    result = evaluate(paths.train, target, settings=settings, out=paths.eval, **opts)
    log_lines(result.table().splitlines())
    return {"sets": result.sets, "json": str(result.json_path), "plot": str(result.plot_path)}


def log_lines(lines: list[str]) -> None:
    for line in lines:
        print(f"    {line}")


# ---------------------------------------------------------------------------------------------
# Running a recipe
# ---------------------------------------------------------------------------------------------

@dataclass
class RecipeSummary:
    name: str
    out: Path
    stages: dict[str, dict[str, Any]] = field(default_factory=dict)  # stage -> {seconds, result, reused}

    def lines(self) -> list[str]:
        return summary_lines(self)


def run_recipe(spec: str | Path, out: str | Path | None = None, scale: float = 1.0,
               overrides: list[str] | None = None, only: list[str] | None = None,
               command: str = "") -> RecipeSummary:
    """Run (or continue) every stage of a recipe into `out`; returns the figures of each stage."""
    recipe = apply_scale(apply_overrides(load_recipe(spec), overrides or []), scale)
    meta = recipe["recipe"]
    paths = Paths(Path(out or meta.get("out") or Path("runs") / meta["name"]))
    target = meta.get("target") or None
    validate(recipe)
    stages = [s for s in STAGES if s in recipe]
    if only:
        bad = set(only) - set(stages)
        if bad:
            raise ValueError(f"--only {sorted(bad)}: not stages of this recipe ({', '.join(stages)})")
    summary = RecipeSummary(meta["name"], paths.root)
    runners: dict[str, Callable[..., dict[str, Any]]] = {
        "regen": run_regen, "prepare": lambda o, p, t, c: run_prepare(o, p, t, c, "regen" in stages),
        "extract": run_extract, "check": run_check, "train": run_train, "eval": run_eval}
    print(f"recipe {meta['name']} (scale {scale:g}) -> {paths.root}")
    for i, stage in enumerate(stages, 1):
        options = recipe[stage]
        marker = paths.marker(stage)
        header = f"[{i}/{len(stages)}] {stage} -> {paths.output_of(stage)}"
        if marker.exists():
            done = formats.read_json(marker)
            if done["options"] != jsonable(options):
                raise ValueError(f"{stage}: {paths.root} already holds this stage run with other options "
                                 f"{option_diff(done['options'], jsonable(options))}; use another output folder "
                                 f"or remove {paths.output_of(stage)} and {marker}")
            print(f"{header}: done earlier ({format_seconds(done['seconds'])}), reusing it")
            summary.stages[stage] = {**done, "reused": True}
            continue
        if only and stage not in only:
            print(f"{header}: skipped (--only)")
            continue
        print(header)
        t0 = time.perf_counter()
        result = runners[stage](options, paths, target, command)
        record = {"options": jsonable(options), "result": jsonable(result), "seconds": time.perf_counter() - t0}
        formats.write_json_atomic(marker, record)
        summary.stages[stage] = {**record, "reused": False}
    formats.write_json_atomic(paths.root / SUMMARY_FILE, {"recipe": meta, "scale": scale, "stages": summary.stages})
    return summary


def jsonable(x: Any) -> Any:
    import json

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
        return (f"{r['conversations']} chats regenerated ({r['failed']} failed), {r['tokens']:,} new tokens"
                + (f", {r['tokens_per_s']} tok/s" if r.get("tokens_per_s") else ""))
    if stage == "prepare":
        return f"{r['samples']} samples, {r['tokens']:,} tokens ({r['assistant_tokens']:,} assistant)"
    if stage == "extract":
        return f"{r['samples']} samples, {r['tokens']:,} tokens, {r['bytes'] / 2**20:,.0f} MiB"
    if stage == "check":
        acc = r.get("next_token_accuracy") or {}
        teacher = f", target's next-token accuracy {acc['stored_last']:.1%}" if "stored_last" in acc else ""
        return f"{r['verdict']}: {r['files']} files{teacher}"
    if stage == "train":
        acc = " ".join(f"{a:.2f}" for a in r.get("heldout_acc") or [])
        return (f"{r['steps']} steps; held-out acc per TTT step [{acc}], simulated tau "
                f"{r['heldout_tau']:.2f} (best {r['best_tau']:.2f} at step {r['best_step']})"
                if r.get("heldout_tau") is not None else f"{r['steps']} steps")
    if stage == "eval":
        parts = []
        for name, methods in r["sets"].items():
            pld = methods.get("prompt-lookup", {}).get("speedup")
            for m in ("chain", "tree"):
                if m in methods:
                    x = methods[m]
                    vs_pld = f", {x['speedup'] / pld:.2f}x vs prompt lookup" if pld else ""
                    parts.append(f"{name} {m}: tau {x['tau']:.2f}, {x['speedup']:.2f}x vs plain{vs_pld}")
            if pld:
                parts.append(f"{name} prompt lookup: {pld:.2f}x vs plain")
        return "; ".join(parts) + f"; plot {r['plot']}"
    return ""


def summary_lines(s: RecipeSummary) -> list[str]:
    lines = [f"recipe {s.name}: {s.out}", f"{'stage':<8} {'time':>9}  figures", "-" * 60]
    total = 0.0
    for stage, rec in s.stages.items():
        total += rec["seconds"]
        lines.append(f"{stage:<8} {format_seconds(rec['seconds']):>9}  {stage_figures(stage, rec['result'])}"
                     + ("  (reused)" if rec.get("reused") else ""))
    lines.append(f"{'total':<8} {format_seconds(total):>9}")
    return lines
