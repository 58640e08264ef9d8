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

from dataclasses import dataclass

from eaglet.options.configs import (
    CHECK_REPORT_OPTIONS,
    CheckOptions,
    ConvertOptions,
    DecodeOptions,
    DemoOptions,
    EvalOptions,
    ExportOptions,
    ExtractOptions,
    ImportOptions,
    PrepareOptions,
    RegenOptions,
    RunOptions,
    TrainOptions,
    TrainSettings,
    VllmEngineOptions,
)
from eaglet.options.declare import (
    ADMISSIONS,
    OPTION,
    VALUE,
    APPEND,
    BASELINE,
    BOOL,
    defaults_of,
    DEVICE_MAP_STRATEGIES,
    DRAFTER_FAMILIES,
    DRAFTER_METHODS,
    EAGLE3,
    EMBEDDED_SHAREGPT,
    ENGINE_METHODS,
    env_switch,
    EXPORT_DTYPE_NAMES,
    EXPORT_FORMAT_NAMES,
    FILES_KEPT,
    FLAG,
    FOLDER_NOT_WRITTEN,
    HF_ENGINE,
    HF_METHODS,
    HYBRID_DRAFTS,
    LLAMA_CPP_BASELINE,
    LLAMA_CPP_METHODS,
    LM_HEAD_INITS,
    LOOKUP_METHODS,
    LOSS_ON,
    METHODS,
    OBJECTIVES,
    Option,
    option,
    options_of,
    OUTSIDE_BASELINES,
    OUTSIDE_METHODS,
    OWN_COUNTERPART,
    PARALLEL_METHODS,
    parse_duration,
    parse_float,
    parse_layer_ids,
    parse_list,
    parse_threads,
    PREPARE_MAX_LENGTH,
    PRESETS,
    PROMPT_SETS,
    REGEN_BACKENDS,
    REMOTE_CODE_ENV,
    STAGES_KEPT,
    STARTS_OVER,
    VLLM_BASELINE,
    VLLM_ENGINE,
    VLLM_FAMILY_METHODS,
    VLLM_METHODS,
    WRITTEN_LAYOUT_NAMES,
)

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
    "prepare",
    "chat data -> tokens + assistant-only loss mask",
    "Tokenize chats with the target's chat template; loss_mask = 1 on assistant tokens.",
    PrepareOptions,
    "eaglet.prepare:prepare",
    f"no new prepared dataset was written; {STARTS_OVER}",
)

EXTRACT = Stage(
    "extract",
    "target hidden states -> speculators v1 files",
    "Run the target on prepared chats and write rows_{a}-{b}/data_{i}.pt files (or, with --layout speculators, the "
    "Arrow table + hs_{i}.safetensors that speculators >= 0.6 trains from); resumable, shardable.",
    ExtractOptions,
    "eaglet.extract:extract",
    FILES_KEPT,
)

CONVERT = Stage(
    "convert",
    "a hidden-state dataset in another layout (v1, speculators, compact)",
    "Copy a hidden-state dataset (any layout `eaglet check` reads) into eaglet's v1 or speculators' layout, states "
    "bit for bit, with the side files the output needs; resumable.",
    ConvertOptions,
    "eaglet.convert:convert",
    FILES_KEPT,
)

DEMO = Stage(
    "demo",
    "the main job on the embedded default: regen -> ... -> eval",
    "Run the built-in demo recipe on the embedded default (SmolLM2-135M-Instruct + ShareGPT): regenerate a slice of "
    "ShareGPT, prepare, extract, check, train an EAGLE-3 drafter for the recipe's time budget, evaluate it on MT-bench "
    "against plain greedy and prompt lookup, and print one summary table. Every stage resumes, so a second run "
    "reuses finished work.",
    DemoOptions,
    "eaglet.recipe:run_demo",
    STAGES_KEPT,
)

RUN = Stage(
    "run",
    "run a recipe (a TOML file or a built-in name) stage by stage, resumably",
    "Run every stage of a recipe: regen, prepare, extract, check, train, eval, each with the options of its table in "
    "the TOML file. Finished stages are recorded in OUT/stages/ and reused; unfinished ones continue where they "
    "stopped. Built-in recipes: demo, smollm2-sharegpt.",
    RunOptions,
    "eaglet.recipe:run_recipe",
    STAGES_KEPT,
)

CHECK = Stage(
    "check",
    "prove a hidden-state dataset is right before training",
    "Check every file of a hidden-state dataset (v1, flat v1, SpecForge .ckpt[.gz], speculators hs_*.safetensors): "
    "schema, values, side files; with a target, layer identity and loss mask vs chat template on sampled files. "
    "Exit 0 only when clean.",
    CheckOptions,
    "eaglet.check.dataset:check_dataset",
    f"check writes nothing; {STARTS_OVER}",
    report_options=CHECK_REPORT_OPTIONS,
)

TRAIN = Stage(
    "train",
    "train a drafter (EAGLE-3, P-EAGLE or DFlash) on a hidden-state dataset",
    "Train a drafter of the --drafter family (EAGLE-3's one layer with training-time test by default) on stored "
    "hidden states (any layout `eaglet check` "
    "reads) or, with --online, on an `eaglet prepare` output with the target run inside the loop; metrics.jsonl, "
    "checkpoints (safetensors + config.json), best by simulated acceptance length. Multi-process: torchrun "
    "--nproc_per_node N -m eaglet.cli train ...",
    TrainOptions,
    "eaglet.training.loop:train",
    "checkpoints up to the last save are kept; {resume} continues from the latest",
    checked_by="eaglet.training.config:TrainConfig",
)

REGEN = Stage(
    "regen",
    "regenerate the assistant turns of chats with the target",
    "Regenerate every assistant turn, turn by turn, with the target (local Hugging Face generation, or an "
    "OpenAI-compatible endpoint such as vLLM/SGLang), so the drafter learns the target's own answers. Writes JSONL "
    "incrementally; --resume continues.",
    RegenOptions,
    "eaglet.regen:regenerate",
    "every finished chat in --out is kept; {resume} skips them and continues",
)

EVAL = Stage(
    "eval",
    "acceptance length and speedup of a drafter on prompt sets",
    "Decode prompt sets with plain greedy and with each method (speculative chain / tree with the drafter; hybrid: "
    "the drafter's chain and prompt lookup's continuation verified in one pass; ngram: prompt lookup in eaglet's "
    "engine; Hugging Face prompt lookup; llama.cpp's llama-server plain, with the drafter exported to GGUF, or with "
    "its n-gram lookup; vLLM's engine plain, with its n-gram proposer, or serving the drafter exported for it), "
    "interleaved per prompt; report tau, acceptance per draft position, tokens/s, speedup over plain greedy (an "
    "engine's methods: over that engine's plain decoding) and whether outputs equal it, and each engine's "
    "first-draft acceptance beside eaglet's own decoding of the drafter. Table, OUT/eval.json and OUT/eval.png.",
    EvalOptions,
    "eaglet.evaluate:evaluate",
    f"no results were written; {STARTS_OVER}",
    checked_by="eaglet.evaluate.settings:DecodeSettings",
)

EXPORT = Stage(
    "export",
    "write a drafter that vLLM (speculators), SGLang (eagle) or llama.cpp (gguf) loads",
    "Check a trained drafter (shapes, d2t/t2d, layer ids) and write it as a speculators folder (vLLM), an EAGLE-3 "
    "/ SGLang folder (config.json + model.safetensors) or one llama.cpp GGUF file, atomically.",
    ExportOptions,
    "eaglet.export:export_drafter",
    FOLDER_NOT_WRITTEN,
)

IMPORT = Stage(
    "import",
    "read a speculators / EAGLE-3 / SGLang drafter into an eaglet checkpoint",
    "Read a drafter folder (speculators, official EAGLE-3 incl. pytorch_model.bin, SGLang) and write an eaglet "
    "checkpoint folder (model.safetensors + config.json). Unknown or mismatched tensors are refused, with their "
    "names.",
    ImportOptions,
    "eaglet.export:import_drafter",
    FOLDER_NOT_WRITTEN,
)

STAGES: dict[str, Stage] = {
    s.name: s for s in (PREPARE, EXTRACT, CONVERT, DEMO, RUN, CHECK, TRAIN, REGEN, EVAL, EXPORT, IMPORT)
}
RECIPE_STAGES = ("regen", "prepare", "extract", "check", "train", "eval")  # the tables of a recipe, in order


def markdown_table(stage: Stage) -> str:
    """The option table of a stage's docs page, made from the declarations."""
    rows = ["| option | default | what it does |", "| --- | --- | --- |"]
    for o in stage.options:
        flag = o.flag.upper() if o.positional else o.flag
        if o.kind == BOOL:
            flag = f"{o.flag} / --no-{o.flag[2:]}"
        default = (
            ""
            if o.default in (None, False, []) or o.kind in (FLAG, APPEND)
            else (",".join(map(str, o.default)) if isinstance(o.default, (list, tuple)) else str(o.default))
        )
        what = (
            o.help + (f" One of: {', '.join(o.choices)}." if o.choices else "") + (" Required." if o.required else "")
        )
        rows.append(f"| `{flag}` | {f'`{default}`' if default else ''} | {what.replace('|', '/')} |")
    return "\n".join(rows)


# what `from eaglet.options import ...` gives: the stages' declarations here, and the names of its modules
__all__ = [
    "OPTION",
    "VALUE",
    "ADMISSIONS",
    "APPEND",
    "BASELINE",
    "BOOL",
    "CHECK",
    "CHECK_REPORT_OPTIONS",
    "CheckOptions",
    "CONVERT",
    "ConvertOptions",
    "DecodeOptions",
    "defaults_of",
    "DEMO",
    "DemoOptions",
    "DEVICE_MAP_STRATEGIES",
    "DRAFTER_FAMILIES",
    "DRAFTER_METHODS",
    "EAGLE3",
    "EMBEDDED_SHAREGPT",
    "ENGINE_METHODS",
    "env_switch",
    "EVAL",
    "EvalOptions",
    "EXPORT",
    "EXPORT_DTYPE_NAMES",
    "EXPORT_FORMAT_NAMES",
    "ExportOptions",
    "EXTRACT",
    "ExtractOptions",
    "FILES_KEPT",
    "FLAG",
    "FOLDER_NOT_WRITTEN",
    "HF_ENGINE",
    "HF_METHODS",
    "HYBRID_DRAFTS",
    "IMPORT",
    "ImportOptions",
    "LLAMA_CPP_BASELINE",
    "LLAMA_CPP_METHODS",
    "LM_HEAD_INITS",
    "LOOKUP_METHODS",
    "LOSS_ON",
    "markdown_table",
    "METHODS",
    "OBJECTIVES",
    "Option",
    "option",
    "options_of",
    "OUTSIDE_BASELINES",
    "OUTSIDE_METHODS",
    "OWN_COUNTERPART",
    "PARALLEL_METHODS",
    "parse_duration",
    "parse_float",
    "parse_layer_ids",
    "parse_list",
    "parse_threads",
    "PREPARE",
    "PREPARE_MAX_LENGTH",
    "PrepareOptions",
    "PRESETS",
    "PROMPT_SETS",
    "RECIPE_STAGES",
    "REGEN",
    "REGEN_BACKENDS",
    "RegenOptions",
    "REMOTE_CODE_ENV",
    "RUN",
    "RunOptions",
    "Stage",
    "STAGES",
    "STAGES_KEPT",
    "STARTS_OVER",
    "TRAIN",
    "TrainOptions",
    "TrainSettings",
    "VLLM_BASELINE",
    "VLLM_ENGINE",
    "VLLM_FAMILY_METHODS",
    "VLLM_METHODS",
    "VllmEngineOptions",
    "WRITTEN_LAYOUT_NAMES",
]
