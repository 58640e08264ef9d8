"""A recipe file: found by name or path, read (TOML), scaled (`--scale`) and overridden (`--set`); what
its tables may hold is checked by `recipe.validate`; and the digests of the files its stages'
options name, which a rerun compares before it reuses a finished stage.
"""

from __future__ import annotations

import hashlib
import json
import tomllib
from pathlib import Path
from typing import Any

from eaglet import ranges
from eaglet.options import RECIPE_STAGES


# ---------------------------------------------------------------------------------------------
# Reading, scaling and overriding a recipe
# ---------------------------------------------------------------------------------------------

BUILTIN_DIR = Path(__file__).parent / "recipes"


def toml_value(value: Any) -> str:
    return json.dumps(value, default=str)  # the TOML spelling of strings, numbers, booleans and lists


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
    if path.exists():  # a folder, a FIFO, a device
        raise ValueError(f"recipe {str(spec)!r}: not a regular file; give a .toml file or a built-in recipe")
    raise FileNotFoundError(
        f"recipe {str(spec)!r}: no such file and not a built-in recipe ({', '.join(builtin_recipes())})"
    )


def load_recipe(spec: str | Path) -> dict[str, Any]:
    path = recipe_path(spec)
    try:
        # a leading UTF-8 BOM, as many editors write one: TOML forbids it, the user never sees it
        recipe = tomllib.loads(path.read_bytes().removeprefix(b"\xef\xbb\xbf").decode("utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{path}: invalid TOML ({e})") from None
    except UnicodeDecodeError as e:  # tomllib names neither the file nor what to do
        raise ValueError(
            f"{path}: not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start}); TOML is "
            f"UTF-8: save the recipe as UTF-8"
        ) from None
    unknown = set(recipe) - {"recipe", "scale", *RECIPE_STAGES}
    if unknown:
        raise ValueError(
            f"{path}: unknown tables {sorted(unknown)}; expected [recipe], [scale] and stages "
            f"{', '.join(RECIPE_STAGES)}"
        )
    for name, table in recipe.items():
        if not isinstance(table, dict):
            raise ValueError(f"{path}: {name} = {toml_value(table)} is not a table; write its options under [{name}]")
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
        if stage not in ("recipe", *RECIPE_STAGES):
            raise ValueError(f"--set {text!r}: unknown stage {stage!r} (one of {', '.join(RECIPE_STAGES)})")
        out.setdefault(stage, {})[name] = value
    return out


def overridden(overrides: list[str]) -> dict[str, str]:
    """ "stage.key" -> the --set text that sets it, so that an error names the --set, not the file."""
    return {f"{stage}.{name}": text for text in overrides for stage, name, _ in [parse_override(text)]}


def apply_scale(recipe: dict[str, Any], scale: float) -> dict[str, Any]:
    """Multiply the options `[scale] multiply` names (e.g. "regen.num_samples") by `scale`."""
    # inf, nan or a size no run reaches would reach round() below as an OverflowError
    ranges.within(0, ranges.MAX_SCALE, "data sizes no run reaches beyond", low_open=True, scale=scale)
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in recipe.items()}
    for path in recipe.get("scale", {}).get("multiply", []):
        stage, _, name = path.partition(".")
        value = out.get(stage, {}).get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            scaled = value * scale
            if not ranges.finite(scaled):
                raise ValueError(
                    f"--scale {scale:g}: {path} = {value} times it is beyond any number; use a smaller --scale"
                )
            # a count scaled to below one is one (a small --scale), never a count given below one:
            # that stays as given, for the stage to refuse
            out[stage][name] = (
                max(1, round(scaled))
                if isinstance(value, int) and value >= 1
                else (round(scaled) if isinstance(value, int) else scaled)
            )
    return out


def input_digests(options: dict[str, Any]) -> dict[str, str]:
    """The sha256 of each file a stage's options name (a chat file, a prompts file): a rerun
    compares them, so a file changed since is not taken as read already."""
    digests = {}
    for value in options.values():
        if isinstance(value, str) and value and Path(value).is_file():
            with open(value, "rb") as f:
                digests[value] = hashlib.file_digest(f, "sha256").hexdigest()
    return digests


def changed_inputs(recorded: Any, options: dict[str, Any] | None) -> list[str]:
    """The files whose content differs from what a marker recorded (none where it recorded none:
    markers from before they did)."""
    if not isinstance(recorded, dict) or options is None:
        return []
    now = input_digests(options)
    return [path for path, digest in recorded.items() if path in now and now[path] != digest]
