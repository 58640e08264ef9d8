"""Each stage's options: the typed config, a frozen dataclass, its entry function takes. Imports no
torch (see eaglet.options)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from eaglet import families, ranges

from eaglet.options.declare import (
    ADMISSIONS,
    APPEND,
    AUX_LAYER_IDS_HELP,
    BOOL,
    chats_data_option,
    DEFAULT_METHODS,
    DEFAULT_PRESET,
    DEMO_OUT,
    device_map_option,
    device_option,
    DRAFTER_FAMILIES,
    EAGLE3,
    ENGINE_F32_HELP,
    EXPORT_DTYPE_NAMES,
    EXPORT_FORMAT_NAMES,
    EXTRACT_ENGINES,
    FLAG,
    HF_ENGINE,
    HYBRID_DRAFTS,
    last_hidden_state_option,
    LAYOUT_HELP,
    LM_HEAD_INITS,
    LOSS_ON,
    max_memory_option,
    METHODS,
    num_samples_option,
    OBJECTIVES,
    offload_folder_option,
    Option,
    option,
    parse_duration,
    parse_float,
    parse_layer_ids,
    parse_list,
    parse_threads,
    PREPARE_MAX_LENGTH,
    preset_text,
    PRESETS,
    PROMPT_SETS,
    REGEN_BACKENDS,
    skip_option,
    stored_top_k_option,
    target_option,
    WRITTEN_LAYOUT_NAMES,
)

# ---------------------------------------------------------------------------------------------
# Each stage's options: the typed config its entry function takes
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class VllmEngineOptions:
    """The vLLM engine's arguments a stage passes through (eaglet.vllm_engine.EngineOptions)."""

    tensor_parallel_size: int = option("vLLM: GPUs one model is split across (tensor parallelism)", type=int, default=1)
    pipeline_parallel_size: int = option(
        "vLLM: pipeline stages (nodes or GPU groups) the layers are split across", type=int, default=1
    )
    max_model_len: int | None = option(
        "vLLM: the engine's context in tokens (default: what the job needs: extract, "
        "the longest sample + 1; eval and regen, the target's positions)",
        type=int,
    )
    gpu_memory_utilization: float | None = option(
        "vLLM: on GPUs, the share of each GPU's memory the engine takes (default: vLLM's, 0.9)", type=parse_float
    )
    vllm_kv_cache_gib: float = option(
        "vLLM: on a CPU, GiB of memory for each engine's KV cache (VLLM_CPU_KVCACHE_SPACE)",
        type=parse_float,
        default=2.0,
    )
    vllm_args: str | None = option(
        'vLLM: any other vllm.LLM keywords as a JSON object, e.g. \'{"max_num_seqs": 64, "quantization": "fp8"}\'',
        metavar="JSON",
    )


@dataclass(frozen=True, kw_only=True)
class PrepareOptions:
    target: str | None = target_option()
    data: str = chats_data_option()
    out: str | Path = option("output folder", required=True, recipe=False)
    num_samples: int | None = num_samples_option()
    overwrite: bool = option("replace a prepared dataset already in --out", kind=FLAG)
    max_length: int | None = option(
        f"truncate chats to this many tokens (default {PREPARE_MAX_LENGTH}, or the target's positions where fewer)",
        type=int,
    )
    skip: int = skip_option()
    mix: str | None = option(
        "a second chat source (same formats as --data) whose chats follow --data's, e.g. "
        "'sharegpt' with its original answers beside regenerated ones"
    )
    mix_samples: int | None = option("keep at most this many chats of --mix", type=int)
    mix_skip: int = option("skip the first N records of --mix (past those --data drew from)", type=int, default=0)

    def check_numbers(self) -> None:
        """Each number in its range: by the stage, and by a recipe before its first stage runs."""
        ranges.at_least(1, max_length=self.max_length, num_samples=self.num_samples, mix_samples=self.mix_samples)
        ranges.at_least(0, skip=self.skip, mix_skip=self.mix_skip)


@dataclass(frozen=True, kw_only=True)
class ExtractOptions(VllmEngineOptions):
    prepared: str | Path = option("output folder of `eaglet prepare`", required=True, recipe=False)
    out: str | Path = option("dataset folder (hidden_states/ and side files go here)", required=True, recipe=False)
    target: str | None = target_option()
    layer_ids: list[int] | None = option(
        "hidden_states ids to store, aux ids then the last layer N (default: "
        "2,N//2,N-3,N); id 0 = embeddings, id k = output of decoder layer k-1",
        type=parse_layer_ids,
    )
    dtype: str = option(
        "compute dtype of the target: auto (bf16 where the device computes it fast, on CUDA and CPUs "
        "with AMX/AVX512-BF16, else fp32), bf16, fp16, fp32",
        default="auto",
    )
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
    engine: str = option(
        "what computes the states: hf (eaglet's own forwards of the Hugging Face model, with "
        "--device or --device-map) or vllm (vLLM's extract_hidden_states, in vLLM's own venv, with "
        "the vLLM options below); the files written are the same",
        default=HF_ENGINE,
        choices=EXTRACT_ENGINES,
    )

    def check_numbers(self) -> None:
        """Each number in its range: by the stage, and by a recipe before its first stage runs."""
        ranges.at_least(
            1,
            num_shards=self.num_shards,
            batch_tokens=self.batch_tokens,
            max_batch_size=self.max_batch_size,
            stored_top_k=self.stored_top_k,
        )


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

    scale: float = option(
        "multiply the recipe's data size (its [scale] options, e.g. regen.num_samples) by this",
        type=parse_float,
        default=1.0,
    )
    overrides: list[str] = option(
        "override one option, e.g. --set train.total_steps=200 (repeatable)",
        kind=APPEND,
        default=[],
        metavar="STAGE.KEY=VALUE",
        cli="set",
    )
    only: list[str] | None = option(
        "run only these stages (comma-separated); finished earlier stages are reused", type=parse_list
    )


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
    use_target: bool = option(
        "skip the checks that need the target", kind=FLAG, invert=True, recipe=False, cli="no_target"
    )
    identity_samples: int = option("files to recompute with the target", type=int, default=3)
    device_map: str | None = device_map_option()
    max_memory: str | None = max_memory_option()
    offload_folder: str | None = offload_folder_option()
    workers: int | None = option("reader threads (default: one per core, at most 8)", type=int)

    def check_numbers(self) -> None:
        """Each number in its range: by the stage, and by a recipe before its first stage runs."""
        ranges.at_least(0, identity_samples=self.identity_samples)
        ranges.at_least(1, workers=self.workers)


# how the command line shows check's report, not inputs of the check
CHECK_REPORT_OPTIONS = (
    Option("max_per_kind", "problems shown per kind", type=int, default=10, cli_only=True),
    Option("json", "print the report as JSON", kind=FLAG, cli_only=True),
)


@dataclass(frozen=True, kw_only=True)
class TrainSettings:
    """How a drafter trains: the settings `training.config.TrainConfig` checks and the run records
    in train_config.json (a resume takes them from there)."""

    online: bool = option(
        "compute the hidden states with the target inside the loop (no disk); DATA is a prepare folder", kind=FLAG
    )
    target_dtype: str = option(
        "--online: compute dtype of the target (auto: bf16 where fast, else fp32)", default="auto"
    )
    device_map: str | None = device_map_option("--online: ")
    max_memory: str | None = max_memory_option("--online: ")
    offload_folder: str | None = offload_folder_option("--online: ")
    aux_layer_ids: list[int] | None = option(
        "--online: the layers to capture (default 2,N//2,N-3); otherwise " + AUX_LAYER_IDS_HELP, type=parse_layer_ids
    )
    last_hidden_state: str | None = last_hidden_state_option()
    drafter: str = option(
        "the drafter family: eagle3 (one layer, a chain of drafts by training-time test), p-eagle "
        "(EAGLE-3's features, --block-size drafts from one pass through mask-token positions) or "
        "dflash (block diffusion: the target's fused states injected as context into every layer, "
        "a block of --block-size - 1 drafts from one pass)",
        default=EAGLE3,
        choices=DRAFTER_FAMILIES,
    )
    draft_layers: int | None = option(
        "p-eagle / dflash: decoder layers of the drafter (default: the family's: "
        f"{families.defaults_text('draft_layers')})",
        type=int,
    )
    block_size: int | None = option(
        "p-eagle: drafts per pass, K; dflash: the block, anchor + B-1 drafts (default: the "
        f"family's: {families.defaults_text('block_size')})",
        type=int,
    )
    anchor_stride: int | None = option(
        "p-eagle / dflash: a block is trained at every N-th position that counts (the "
        "grid turns one position a step, so every position is an anchor in turn; "
        f"default: the family's: {families.defaults_text('anchor_stride')})",
        type=int,
    )
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
    pack_tokens: int | None = option(
        "pack samples into rows of exactly N tokens, one after another, each kept apart "
        "in attention, RoPE and the loss: one shape for every step, no padding between "
        "samples (default: the longest sample rounded up to 256, at least 1024; 0: one "
        "sample per row)",
        type=int,
    )
    compile: bool | None = option(
        "torch.compile the drafter's training steps (default: when packed, so one graph "
        "serves every step; EAGLET_COMPILE=0 makes the default off; held-out evaluation "
        "stays eager)",
        kind=BOOL,
    )
    max_length: int | None = option("truncate samples to this many tokens", type=int)
    ttt_steps: int = option(
        "training-time-test unroll length (2: the CPU's chain of 2; EAGLE-3 on GPUs: 7)", type=int, default=2
    )
    ttt_ramp: float = option(
        "grow the unroll from 1 step to --ttt-steps over this fraction of the schedule", type=parse_float, default=0.0
    )
    draft_vocab_size: int | None = option("draft vocabulary (default min(8192, target vocab))", type=int)
    teacher_top_k: int | None = option(
        "keep the target's top-k draft tokens per position, computed once per sample "
        "and cached (0: the dense teacher over the whole draft vocabulary, recomputed "
        "every epoch)",
        type=int,
        default=16,
    )
    loss_on: str = option(
        "positions the loss trains on: every token or assistant tokens only; held-out accuracy is "
        "always on assistant tokens",
        default="all",
        choices=LOSS_ON,
    )
    objective: str = option(
        "what each position minimises: ce (soft cross-entropy against the target), lk (-log of "
        "the drafter/target overlap, the sampled acceptance rate) or lk-hybrid (KL blended into TV "
        "as the overlap grows); LK losses, Samarin et al. 2026",
        default="ce",
        choices=OBJECTIVES,
    )
    feature_loss_weight: float = option(
        "weight of a smooth-L1 regression of the target's next last-layer state (EAGLE-1)",
        type=parse_float,
        default=0.0,
    )
    lm_head_init: str = option(
        "initial LM head and final norm: random or the target's rows", default="random", choices=LM_HEAD_INITS
    )
    freeze_lm_head: bool = option("keep the LM head and final norm as initialised", kind=FLAG)
    time_budget: float | None = option(
        "train for about this long (e.g. 600, 45m, 1.5h): the schedule is sized from "
        "the measured tokens/s after the first steps; held-out evaluations are not "
        "counted",
        type=parse_duration,
    )
    fc_norm: bool = option("EAGLE-3.1: RMSNorm before fc", kind=FLAG)
    norm_output: bool = option("EAGLE-3.1: feed the post-norm output to the next step", kind=FLAG)
    norm_before_residual: bool = option(
        "the layer's residual is the normalised fused state (speculators' default drafter)", kind=FLAG
    )
    sliding_window: int | None = option(
        "the drafter attends to the last W positions only (default: all; speculators trains 2048)", type=int
    )
    bf16: bool | None = option(
        "bf16 autocast, master weights stay fp32 (default: where the device computes bf16 "
        "fast, i.e. CUDA and CPUs with AMX/AVX512-BF16; elsewhere bf16 products are emulated "
        "and slow)",
        kind=BOOL,
    )
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
    dataset_dir: str | Path = option(
        "hidden-state dataset folder (eaglet v1, speculators, SpecForge), or with "
        "--online the output folder of `eaglet prepare`",
        positional=True,
        cli="data",
    )
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
    backend: str = option(
        "local: Hugging Face generate; openai: an OpenAI-compatible chat endpoint; llama.cpp: "
        "llama-server on the target's GGUF, run by eaglet with --concurrency parallel slots; vllm: "
        "vLLM's offline engine on the target, run by eaglet in vLLM's own venv",
        default="local",
        choices=REGEN_BACKENDS,
    )
    target_gguf: str | Path | None = option(
        "llama.cpp: the target's GGUF file (default: the embedded SmolLM2 GGUF, for the embedded target)"
    )
    threads: int | None = option("llama.cpp: CPU threads of the server (default: all cores)", type=int)
    engine_f32: bool = option(
        f"llama.cpp: {ENGINE_F32_HELP}, and greedy answers are the local backend's (but where "
        "two tokens nearly tie: the engines round fp32 sums differently)",
        kind=FLAG,
    )
    base_url: str | None = option("endpoint base URL, e.g. http://127.0.0.1:8000/v1 (openai backend)")
    model: str | None = option("served model name (openai backend; default: the first of GET /models)")
    api_key: str | None = option("endpoint API key (default: $OPENAI_API_KEY, if set)")
    temperature: float = option("0 = greedy", type=parse_float, default=0.0)
    top_p: float = option("nucleus sampling mass", type=parse_float, default=1.0)
    max_new_tokens: int = option("tokens per answer at most", type=int, default=512)
    max_prompt_tokens: int | None = option(
        "local, llama.cpp and vllm: longest prompt to answer; a chat stops at a "
        "longer turn (default: the target's context minus --max-new-tokens)",
        type=int,
    )
    batch_size: int = option("local and vllm: prompts per generate call", type=int, default=16)
    concurrency: int = option(
        "openai: conversations in flight; llama.cpp: the server's parallel slots", type=int, default=8
    )
    max_retries: int = option("openai: retries per request", type=int, default=5)
    timeout: float = option("openai: seconds per request", type=parse_float, default=600.0)
    resume: bool = option("continue an existing --out, skipping the ids it holds", kind=FLAG, recipe=False)
    num_samples: int | None = num_samples_option()
    skip: int = skip_option()
    max_turns: int | None = option("answer at most the first N assistant turns of each chat (default: all)", type=int)
    time_budget: float | None = option(
        "start no new chat after this long (e.g. 30m); chats under way keep their finished turns", type=parse_duration
    )
    dtype: str = option(
        "local and vllm: compute dtype auto (bf16 where fast, else fp32), bf16, fp16, fp32", default="auto"
    )
    device: str | None = device_option("local: ")
    device_map: str | None = device_map_option("local: ")
    max_memory: str | None = max_memory_option("local: ")
    offload_folder: str | None = offload_folder_option("local: ")
    seed: int = option("local and vllm sampling seed", type=int, default=0)

    def check_numbers(self) -> None:
        """Each number in its range: by the stage, and by a recipe before its first stage runs."""
        ranges.at_least(0, temperature=self.temperature, skip=self.skip, max_retries=self.max_retries)
        ranges.within(0, 1, low_open=True, top_p=self.top_p)
        ranges.seeds(seed=self.seed)
        ranges.at_least(
            1,
            max_new_tokens=self.max_new_tokens,
            batch_size=self.batch_size,
            concurrency=self.concurrency,
            num_samples=self.num_samples,
            max_prompt_tokens=self.max_prompt_tokens,
            max_turns=self.max_turns,
            threads=self.threads,
        )
        ranges.within(1, ranges.MAX_NEW_TOKENS, "more than any model's positions", max_new_tokens=self.max_new_tokens)
        ranges.above(0, timeout=self.timeout)
        ranges.seconds(time_budget=self.time_budget)


@dataclass(frozen=True, kw_only=True)
class DecodeOptions:
    """How every method of `eaglet eval` decodes: the settings `evaluate.settings.DecodeSettings`
    checks, and fills in from the device preset where left None."""

    max_new_tokens: int = option("tokens per answer at most", type=int, default=128)
    preset: str = option(
        "the settings below that are choices for a kind of device (presets.toml); an option given wins over its preset",
        default=DEFAULT_PRESET,
        choices=tuple(PRESETS),
    )
    depth: int | None = option(f"tree depth (default: the preset's: {preset_text('eval', 'depth')})", type=int)
    top_k: int | None = option(
        f"tree branching per node (default: the preset's: {preset_text('eval', 'top_k')})", type=int
    )
    total_tokens: int | None = option(
        f"tree draft tokens verified per pass (default: the preset's: {preset_text('eval', 'total_tokens')})", type=int
    )
    chain_depth: int | None = option(
        f"draft tokens per pass in chain mode (default: the preset's: {preset_text('eval', 'chain_depth')})", type=int
    )
    min_draft_prob: float | None = option(
        "propose only draft tokens whose path probability under the drafter is at "
        "least this; a cycle with none left is a plain one-token pass (default: "
        f"the preset's: {preset_text('eval', 'min_draft_prob')})",
        type=parse_float,
    )
    hybrid_draft: str = option(
        "hybrid: the drafter's part of each cycle, a chain or its tree", default="chain", choices=HYBRID_DRAFTS
    )
    hybrid_chain_depth: int = option("hybrid: the depth of the drafter's chain", type=int, default=1)
    drop_rivals: bool = option(
        "hybrid with --admission all and --min-draft-prob: leave out drafted tokens that rival "
        "a lookup token trusted beyond 1 - P (at most one sibling is right, so such a rival is "
        "right with at most P)",
        kind=FLAG,
    )
    admission: str = option(
        "hybrid and ngram: 'cost' verifies a proposed token only where its calibrated chance of "
        "acceptance pays for the longer target pass (pass times measured before decoding; "
        "--min-draft-prob then applies to the drafter only); 'all' verifies every proposed token",
        default="cost",
        choices=ADMISSIONS,
    )
    lookup_tokens: int = option("hybrid and ngram: tokens prompt lookup adds to a cycle at most", type=int, default=4)
    max_ngram: int = option("hybrid and ngram: the longest n-gram looked up", type=int, default=3)
    temperature: float = option("0 = greedy", type=parse_float, default=0.0)
    top_p: float = option("nucleus sampling mass", type=parse_float, default=1.0)
    seed: int = option("sampling seed", type=int, default=0)


@dataclass(frozen=True, kw_only=True)
class EvalOptions(DecodeOptions, VllmEngineOptions):
    drafter_path: str | Path = option(
        "eaglet checkpoint or run folder (its best checkpoint), or an EAGLE-3 / speculators drafter folder",
        positional=True,
        cli="drafter",
    )
    target: str | None = target_option("the target recorded in the drafter's checkpoint")
    other_target: bool = option(
        "evaluate with a --target whose revision is not the one the drafter was trained for "
        "(refused by default: a same-shape target of other weights runs, and accepts little)",
        kind=FLAG,
    )
    prompt_sets: list[str] = option(
        f"comma-separated prompt sets: {', '.join(PROMPT_SETS)} or a JSONL file of "
        '{"prompt"} / {"turns"} / {"messages"} lines (mtbench: first turns)',
        type=parse_list,
        default=["mtbench"],
        cli="prompts",
    )
    num_prompts: int | None = option("first N prompts of each set (default: all)", type=int)
    methods: list[str] = option(
        f"besides plain greedy, comma-separated from {', '.join(METHODS)}",
        type=parse_list,
        default=list(DEFAULT_METHODS),
    )
    dtype: str = option(
        "target and drafter dtype: auto (each method, plain greedy included, at the dtype where a "
        "pass of its size is fastest, timed before decoding: bf16 or fp32 on a CPU, bf16 elsewhere), "
        "bf16, fp16, fp32",
        default="auto",
    )
    device: str | None = device_option()
    device_map: str | None = device_map_option()
    max_memory: str | None = max_memory_option()
    offload_folder: str | None = offload_folder_option()
    threads: int | str = option(
        "CPU threads: auto (each method at 1 or all cores, whichever makes a pass of its size "
        "fastest, timed like --dtype auto), or N for every method and the llama.cpp and vLLM "
        "engines (vLLM: all cores under auto)",
        type=parse_threads,
        default="auto",
    )
    target_gguf: str | Path | None = option(
        "llama.cpp methods: the target's GGUF file the servers run (default: the "
        "embedded SmolLM2 GGUF, for the embedded target)"
    )
    engine_f32: bool = option(
        f"llama.cpp methods: {ENGINE_F32_HELP}; the first-draft line then checks the export's conventions alone",
        kind=FLAG,
    )
    out: str | Path | None = option(
        "folder for eval.json and eval.png (and drafter.gguf, the export llama.cpp-eagle3 "
        "ran; vllm-drafter/, the export vLLM's drafter methods ran, and vllm-logs/)",
        recipe=False,
    )
    plot: bool = option("skip the PNG plot", kind=FLAG, invert=True, recipe=False, cli="no_plot")

    def decode_settings(self) -> dict[str, Any]:
        """How every method decodes, as DecodeSettings takes it."""
        return {f.name: getattr(self, f.name) for f in fields(DecodeOptions)}


@dataclass(frozen=True, kw_only=True)
class ExportOptions:
    ckpt: str | Path = option(
        "checkpoint folder (checkpoints/step_N) or train run folder (its best checkpoint)", positional=True
    )
    out: str | Path = option(
        "output folder (must not exist, or be empty); --format gguf: a file ending .gguf", positional=True
    )
    fmt: str = option(
        "speculators: vLLM; eagle: SGLang and the official EAGLE-3 code (vLLM loads it too); gguf: "
        "llama-server --spec-type draft-eagle3",
        choices=EXPORT_FORMAT_NAMES,
        required=True,
        cli="format",
    )
    target_gguf: str | Path | None = option(
        "gguf: the target's GGUF file, whose tokenizer the drafter carries "
        "(default: the embedded SmolLM2 GGUF, for a drafter of the embedded "
        "target)"
    )
    dtype: str = option("weight dtype", default="bf16", choices=EXPORT_DTYPE_NAMES)
    verifier: str | None = option("target name or path recorded as the verifier (default: the checkpoint's target)")
    speculative_tokens: int = option(
        "speculators: the draft length vLLM reads from the folder when its config sets none",
        type=int,
        default=3,
        cli="num_speculative_tokens",
    )


@dataclass(frozen=True, kw_only=True)
class ImportOptions:
    src: str | Path = option("drafter folder", positional=True, cli="dir")
    out: str | Path = option("output checkpoint folder (must not exist, or be empty)", required=True)
    target: str | None = option("target model folder or hub id, for folders without embeddings or layer ids")
