"""`eaglet <stage>`: a thin command line over each stage's entry function."""

from __future__ import annotations

import argparse
import logging
import shlex
import sys
from pathlib import Path

DEMO_OUT = "runs/demo"


def parse_layer_ids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--layer-ids {text!r}: expected integers like '2,15,27,30'") from None


def add_target_args(p: argparse.ArgumentParser,
                    default: str = "the embedded SmolLM2-135M-Instruct") -> None:
    p.add_argument("--target", default=None, help=f"Hugging Face model folder or hub id (default: {default})")


def add_extract_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layer-ids", type=parse_layer_ids, default=None,
                   help="hidden_states ids to store, aux ids then the last layer N (default: 2,N//2,N-3,N); "
                        "id 0 = embeddings, id k = output of decoder layer k-1")
    p.add_argument("--dtype", default="auto",
                   help="compute dtype of the target: auto (default: bf16 where the device computes it fast, on CUDA "
                        "and CPUs with AMX/AVX512-BF16, else fp32), bf16, fp16, fp32")
    p.add_argument("--store-dtype", default="bf16", help="dtype of stored hidden states (default bf16)")
    p.add_argument("--device", default=None, help="cpu or cuda[:i] (default: cuda if available)")
    p.add_argument("--batch-tokens", type=int, default=8192, help="padded tokens per forward pass (default 8192)")
    p.add_argument("--max-batch-size", type=int, default=64, help="samples per forward pass at most (default 64)")


def add_layout_arg(p: argparse.ArgumentParser, required: bool = False) -> None:
    p.add_argument("--layout", choices=("v1", "speculators", "compact"), required=required,
                   default=None if required else "v1",
                   help="v1: hidden_states/rows_{a}-{b}/data_{i}.pt (speculators v1, vLLM tooling"
                        + ("" if required else "; default") + "); speculators: the Arrow table (input_ids, "
                        "loss_mask, seq_len) + hidden_states/hs_{i}.safetensors that speculators >= 0.6 trains from; "
                        "compact: eaglet's own, a third of v1's bytes (6-bit aux states, the target's top-K in place "
                        "of the last state), read by eaglet check and train only")
    p.add_argument("--stored-top-k", type=int, default=16,
                   help="compact: how many of the target's most likely next tokens to store per position "
                        "(default 16, training's --teacher-top-k default; training can use up to this many)")


def add_foreign_dataset_args(p: argparse.ArgumentParser, online: bool = False) -> None:
    """What a foreign dataset without data_config.json does not record."""
    p.add_argument("--aux-layer-ids", type=parse_layer_ids, default=None,
                   help=("the 3 aux hidden_states ids: --online, the layers to capture (default 2,N//2,N-3); a "
                         if online else "the 3 aux hidden_states ids: for a ") +
                        "foreign dataset without data_config.json, the layers its stored aux states come from")
    p.add_argument("--last-hidden-state", choices=("pre_norm", "post_norm"), default=None,
                   help="a foreign dataset's last state, before or after the target's final norm "
                        "(default: data_config.json, else post_norm for SpecForge and pre_norm otherwise)")


def add_prepare_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-length", type=int, default=2048, help="truncate chats to this many tokens (default 2048)")
    p.add_argument("--skip", type=int, default=0, help="skip the first N records of the input")


def cmd_prepare(args: argparse.Namespace) -> None:
    from eaglet.data import prepare

    summary = prepare(args.target, args.data, args.out, args.max_length, args.num_samples, args.skip, args.command,
                      overwrite=args.overwrite)
    print("\n".join(summary.lines()))


def cmd_extract(args: argparse.Namespace) -> None:
    from eaglet.extract import extract

    summary = extract(args.prepared, args.out, args.target, args.layer_ids, args.dtype, args.store_dtype, args.device,
                      args.batch_tokens, args.max_batch_size, args.num_shards, args.shard_id, args.command,
                      layout=args.layout, stored_top_k=args.stored_top_k)
    print("\n".join(summary.lines()))


def cmd_convert(args: argparse.Namespace) -> None:
    from eaglet.convert import convert

    summary = convert(args.src, args.out, args.layout, args.target, args.aux_layer_ids, args.last_hidden_state,
                      args.command, stored_top_k=args.stored_top_k)
    print("\n".join(summary.lines()))


def cmd_run(args: argparse.Namespace) -> None:
    from eaglet.recipe import run_recipe

    summary = run_recipe(args.recipe, args.out, args.scale, args.set, args.only, args.command)
    print("\n".join(summary.lines()))


def add_run_args(p: argparse.ArgumentParser, default_out: str | None) -> None:
    p.add_argument("--out", default=default_out,
                   help=f"output folder (default {default_out or 'runs/<recipe name>'})")
    p.add_argument("--scale", type=float, default=1.0,
                   help="multiply the recipe's data size (its [scale] options, e.g. regen.num_samples) by this")
    p.add_argument("--set", action="append", default=[], metavar="STAGE.KEY=VALUE",
                   help="override one option, e.g. --set train.total_steps=200 (repeatable)")
    p.add_argument("--only", type=parse_list, default=None,
                   help="run only these stages (comma-separated); finished earlier stages are reused")


def cmd_check(args: argparse.Namespace) -> None:
    """Print the report (or JSON); exit 1 when the dataset is not clean, so scripts can gate on it."""
    import json

    from eaglet.check import check_dataset

    report = check_dataset(args.dir, args.target, not args.no_target, args.identity_samples, args.workers)
    if args.json:
        print(json.dumps(report.to_json(), indent=2, default=str))
    else:
        print("\n".join(report.lines(args.max_per_kind)))
    if not report.clean:
        raise SystemExit(1)


TRAIN_OPTIONS = ("epochs", "total_steps", "stop_after", "lr", "min_lr_ratio", "warmup_steps", "weight_decay",
                 "max_grad_norm", "batch_size", "grad_accum", "max_length", "ttt_steps", "ttt_ramp", "draft_vocab_size",
                 "teacher_top_k", "loss_on", "feature_loss_weight", "lm_head_init", "freeze_lm_head", "fc_norm",
                 "norm_output", "norm_before_residual", "sliding_window", "bf16", "time_budget", "eval_fraction",
                 "eval_every", "evals", "save_every", "log_every", "keep_checkpoints", "seed", "device", "online",
                 "target_dtype", "aux_layer_ids", "last_hidden_state")


def cmd_train(args: argparse.Namespace) -> None:
    from eaglet.train import train

    names = TRAIN_OPTIONS
    if args.resume:  # the run's own settings apply; pass on only what was given now, to be compared with them
        names = tuple(given_options(args, TRAIN_OPTIONS))
    options = {k: getattr(args, k) for k in names}
    summary = train(args.data, args.out, args.target, args.resume, command=args.command, **options)
    print("\n".join(summary.lines()))


def cmd_regen(args: argparse.Namespace) -> None:
    from eaglet.regen import regenerate

    summary = regenerate(args.data, args.out, args.target, args.backend, base_url=args.base_url, model=args.model,
                         api_key=args.api_key, temperature=args.temperature, top_p=args.top_p,
                         max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                         concurrency=args.concurrency, max_retries=args.max_retries, timeout=args.timeout,
                         resume=args.resume, num_samples=args.num_samples, skip=args.skip, dtype=args.dtype,
                         device=args.device, seed=args.seed, max_prompt_tokens=args.max_prompt_tokens,
                         max_turns=args.max_turns, time_budget=args.time_budget)
    print("\n".join(summary.lines()))


def parse_duration(text: str) -> float:
    """Seconds from '600', '600s', '45m' or '1.5h'."""
    units = {"s": 1, "m": 60, "h": 3600}
    t = text.strip().lower()
    try:
        value = float(t[:-1]) * units[t[-1]] if t and t[-1] in units else float(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: a duration such as 600, 45m or 1.5h") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be positive")
    return value


def parse_list(text: str) -> list[str]:
    return [x for x in text.replace(",", " ").split() if x]


def cmd_eval(args: argparse.Namespace) -> None:
    from eaglet.evaluate import DecodeSettings, evaluate

    settings = DecodeSettings(max_new_tokens=args.max_new_tokens, depth=args.depth, top_k=args.top_k,
                              total_tokens=args.total_tokens, chain_depth=args.chain_depth,
                              min_draft_prob=args.min_draft_prob, lookup_tokens=args.lookup_tokens,
                              max_ngram=args.max_ngram, hybrid_draft=args.hybrid_draft,
                              hybrid_chain_depth=args.hybrid_chain_depth, drop_rivals=args.drop_rivals,
                              admission=args.admission,
                              temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    result = evaluate(args.drafter, args.target, args.prompts, args.num_prompts, args.methods, settings, args.dtype,
                      args.device, args.threads, args.out, plot=not args.no_plot)
    print(result.table())
    for label, path in (("results", result.json_path), ("plot", result.plot_path)):
        if path is not None:
            print(f"{label}: {path}")


def cmd_export(args: argparse.Namespace) -> None:
    from eaglet.export import export_drafter

    summary = export_drafter(args.ckpt, args.out, args.format, args.dtype, args.verifier, args.num_speculative_tokens)
    print("\n".join(summary.lines()))


def cmd_import(args: argparse.Namespace) -> None:
    from eaglet.export import import_drafter

    print("\n".join(import_drafter(args.dir, args.out, args.target).lines()))


def add_export_parsers(sub: argparse._SubParsersAction) -> None:
    """`eaglet export` and `eaglet import`: drafter folders for and from vLLM / SGLang."""
    p = sub.add_parser("export", help="write a drafter folder that vLLM (speculators) or SGLang (eagle) loads",
                       description="Check a trained drafter (shapes, d2t/t2d, layer ids) and write it as a "
                                   "speculators folder (vLLM) or an EAGLE-3 / SGLang folder: config.json + "
                                   "model.safetensors, atomically.")
    p.add_argument("ckpt", help="checkpoint folder (checkpoints/step_N) or train run folder (its best checkpoint)")
    p.add_argument("out", help="output folder (must not exist, or be empty)")
    p.add_argument("--format", required=True, choices=("speculators", "eagle"),
                   help="speculators: vLLM; eagle: SGLang and the official EAGLE-3 code (vLLM loads it too)")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="weight dtype (default bf16)")
    p.add_argument("--verifier", default=None,
                   help="target name or path recorded as the verifier (default: the checkpoint's target)")
    p.add_argument("--num-speculative-tokens", type=int, default=3,
                   help="speculators: default draft length vLLM reads from the folder (default 3)")
    p.set_defaults(func=cmd_export)
    p = sub.add_parser("import", help="read a speculators / EAGLE-3 / SGLang drafter into an eaglet checkpoint",
                       description="Read a drafter folder (speculators, official EAGLE-3 incl. pytorch_model.bin, "
                                   "SGLang) and write an eaglet checkpoint folder (model.safetensors + config.json). "
                                   "Unknown or mismatched tensors are refused, with their names.")
    p.add_argument("dir", help="drafter folder")
    p.add_argument("--out", required=True, help="output checkpoint folder (must not exist, or be empty)")
    p.add_argument("--target", default=None,
                   help="target model folder or hub id, for folders without embeddings or layer ids")
    p.set_defaults(func=cmd_import)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eaglet", description="Train EAGLE-3 draft models and prove they speed up decoding.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="stage", required=True, metavar="STAGE")
    parser.stage_parsers = sub.choices  # name -> subparser (read by given_options)

    p = sub.add_parser("prepare", help="chat data -> tokens + assistant-only loss mask",
                       description="Tokenize chats with the target's chat template; loss_mask = 1 on assistant tokens.")
    add_target_args(p)
    p.add_argument("--data", default="sharegpt",
                   help="ShareGPT .json/.jsonl, OpenAI-style messages .jsonl, or 'sharegpt' for the embedded ShareGPT")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--num-samples", type=int, default=None, help="stop after this many usable chats")
    p.add_argument("--overwrite", action="store_true", help="replace a prepared dataset already in --out")
    add_prepare_args(p)
    p.set_defaults(func=cmd_prepare)

    p = sub.add_parser("extract", help="target hidden states -> speculators v1 files",
                       description="Run the target on prepared chats and write rows_{a}-{b}/data_{i}.pt files (or, "
                                   "with --layout speculators, the Arrow table + hs_{i}.safetensors that speculators "
                                   ">= 0.6 trains from); resumable, shardable.")
    p.add_argument("--prepared", required=True, help="output folder of `eaglet prepare`")
    p.add_argument("--out", required=True, help="dataset folder (hidden_states/ and side files go here)")
    add_target_args(p)
    add_extract_args(p)
    p.add_argument("--num-shards", type=int, default=1, help="split the samples into K shards (default 1)")
    p.add_argument("--shard-id", type=int, default=0, help="which shard this process extracts (default 0)")
    add_layout_arg(p)
    p.set_defaults(func=cmd_extract)

    p = sub.add_parser("convert", help="a hidden-state dataset in another layout (v1, speculators, compact)",
                       description="Copy a hidden-state dataset (any layout `eaglet check` reads) into eaglet's v1 "
                                   "or speculators' layout, states bit for bit, with the side files the output "
                                   "needs; resumable.")
    p.add_argument("src", help="dataset folder to read")
    p.add_argument("--out", required=True, help="folder to write (not the source)")
    add_layout_arg(p, required=True)
    add_target_args(p, "data_config.json's target; needed when the source has none")
    add_foreign_dataset_args(p)
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("demo", help="the main job on the embedded default: regen -> ... -> eval (~20 min)",
                       description="Run the built-in demo recipe on the embedded default (SmolLM2-135M-Instruct + "
                                   "ShareGPT): regenerate a slice of ShareGPT, prepare, extract, check, train a "
                                   "drafter, evaluate it on MT-bench, and print one summary table. Every stage "
                                   "resumes, so a second run reuses finished work.")
    add_run_args(p, DEMO_OUT)
    p.set_defaults(func=cmd_run, recipe="demo")

    p = sub.add_parser("run", help="run a recipe (a TOML file or a built-in name) stage by stage, resumably",
                       description="Run every stage of a recipe: regen, prepare, extract, check, train, eval, each "
                                   "with the options of its table in the TOML file. Finished stages are recorded "
                                   "in OUT/stages/ and reused; unfinished ones continue where they stopped. "
                                   "Built-in recipes: demo, smollm2-sharegpt.")
    p.add_argument("recipe", help="path to a recipe .toml, or a built-in recipe name")
    add_run_args(p, None)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("check", help="prove a hidden-state dataset is right before training",
                       description="Check every file of a hidden-state dataset (v1, flat v1, SpecForge .ckpt[.gz], "
                                   "speculators hs_*.safetensors): schema, values, side files; with a target, layer "
                                   "identity and loss mask vs chat template on sampled files. Exit 0 only when clean.")
    p.add_argument("dir", help="dataset folder")
    add_target_args(p, "data_config.json's target_path")
    p.add_argument("--no-target", action="store_true", help="skip the checks that need the target")
    p.add_argument("--identity-samples", type=int, default=3, help="files to recompute with the target (default 3)")
    p.add_argument("--workers", type=int, default=None, help="reader threads (default: one per core, at most 8)")
    p.add_argument("--max-per-kind", type=int, default=10, help="problems shown per kind (default 10)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_check)
    p = sub.add_parser("train", help="train an EAGLE-3 drafter on a hidden-state dataset",
                       description="Train the one-layer EAGLE-3 drafter with training-time test on stored hidden "
                                   "states (any layout `eaglet check` reads) or, with --online, on an `eaglet prepare` "
                                   "output with the target run inside the loop; metrics.jsonl, checkpoints "
                                   "(safetensors + config.json), best by simulated acceptance length. "
                                   "Multi-process: torchrun --nproc_per_node N -m eaglet.cli train ...")
    p.add_argument("data", help="hidden-state dataset folder (eaglet v1, speculators, SpecForge), or with --online "
                                "the output folder of `eaglet prepare`")
    p.add_argument("--out", required=True, help="run folder (metrics.jsonl, checkpoints/)")
    add_target_args(p, "data_config.json's target_path; --online: the target `eaglet prepare` used")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its latest checkpoint")
    p.add_argument("--online", action="store_true",
                   help="compute the hidden states with the target inside the loop (no disk); DATA is a prepare folder")
    p.add_argument("--target-dtype", default="auto",
                   help="--online: compute dtype of the target (default auto: bf16 where fast, else fp32)")
    add_foreign_dataset_args(p, online=True)
    p.add_argument("--epochs", type=float, default=1.0, help="schedule length in epochs (default 1)")
    p.add_argument("--total-steps", type=int, default=None, help="schedule length in optimizer steps (overrides --epochs)")
    p.add_argument("--stop-after", type=int, default=None, help="stop this run at this step; --resume continues")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (default 2e-3)")
    p.add_argument("--min-lr-ratio", type=float, default=0.0, help="cosine floor as a fraction of --lr (default 0)")
    p.add_argument("--warmup-steps", type=int, default=None, help="linear warmup steps (default 2%% of the schedule)")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--max-grad-norm", type=float, default=0.5, help="gradient clipping norm (default 0.5)")
    p.add_argument("--batch-size", type=int, default=1, help="samples per micro-batch per process (default 1)")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step per process (default 1)")
    p.add_argument("--max-length", type=int, default=None, help="truncate samples to this many tokens")
    p.add_argument("--ttt-steps", type=int, default=2,
                   help="training-time-test unroll length (default 2, the CPU's chain of 2; EAGLE-3 on GPUs: 7)")
    p.add_argument("--ttt-ramp", type=float, default=0.0,
                   help="grow the unroll from 1 step to --ttt-steps over this fraction of the schedule (default 0)")
    p.add_argument("--draft-vocab-size", type=int, default=None, help="draft vocabulary (default min(8192, target vocab))")
    p.add_argument("--teacher-top-k", type=int, default=16,
                   help="keep the target's top-k draft tokens per position, computed once per sample and cached "
                        "(default 16; 0: the dense teacher over the whole draft vocabulary, recomputed every epoch)")
    p.add_argument("--loss-on", choices=("assistant", "all"), default="all",
                   help="positions the loss trains on: every token (default) or assistant tokens only; held-out "
                        "accuracy is always on assistant tokens")
    p.add_argument("--feature-loss-weight", type=float, default=0.0,
                   help="weight of a smooth-L1 regression of the target's next last-layer state (EAGLE-1; default 0)")
    p.add_argument("--lm-head-init", choices=("random", "target"), default="random",
                   help="initial LM head and final norm: random (default) or the target's rows")
    p.add_argument("--freeze-lm-head", action="store_true", help="keep the LM head and final norm as initialised")
    p.add_argument("--time-budget", type=parse_duration, default=None,
                   help="train for about this long (e.g. 600, 45m, 1.5h): the schedule is sized from the measured "
                        "tokens/s after the first steps; held-out evaluations are not counted")
    p.add_argument("--fc-norm", action="store_true", help="EAGLE-3.1: RMSNorm before fc")
    p.add_argument("--norm-output", action="store_true", help="EAGLE-3.1: feed the post-norm output to the next step")
    p.add_argument("--norm-before-residual", action="store_true",
                   help="the layer's residual is the normalised fused state (speculators' default drafter)")
    p.add_argument("--sliding-window", type=int, default=None,
                   help="the drafter attends to the last W positions only (default: all; speculators trains 2048)")
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                   help="bf16 autocast, master weights stay fp32 (default: where the device computes bf16 fast, "
                        "i.e. CUDA and CPUs with AMX/AVX512-BF16; elsewhere bf16 products are emulated and slow)")
    p.add_argument("--eval-fraction", type=float, default=0.05, help="held-out fraction of samples (default 0.05)")
    p.add_argument("--eval-every", type=int, default=None, help="evaluate every N steps (default: --evals times a run)")
    p.add_argument("--evals", type=int, default=10, help="held-out evaluations over the run (default 10)")
    p.add_argument("--save-every", type=int, default=None, help="checkpoint every N steps (default: at evaluations)")
    p.add_argument("--log-every", type=int, default=10, help="write train metrics every N steps (default 10)")
    p.add_argument("--keep-checkpoints", type=int, default=2, help="newest checkpoints kept besides the best (default 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.set_defaults(func=cmd_train)
    p = sub.add_parser("regen", help="regenerate the assistant turns of chats with the target",
                       description="Regenerate every assistant turn, turn by turn, with the target (local Hugging Face "
                                   "generation, or an OpenAI-compatible endpoint such as vLLM/SGLang), so the drafter "
                                   "learns the target's own answers. Writes JSONL incrementally; --resume continues.")
    p.add_argument("--data", default="sharegpt",
                   help="ShareGPT .json/.jsonl, OpenAI-style messages .jsonl, or 'sharegpt' for the embedded ShareGPT")
    p.add_argument("--out", required=True, help="output .jsonl (failures go to OUT.errors.jsonl)")
    add_target_args(p)
    p.add_argument("--backend", choices=("local", "openai"), default="local",
                   help="local: Hugging Face generate (default); openai: an OpenAI-compatible chat endpoint")
    p.add_argument("--base-url", default=None, help="endpoint base URL, e.g. http://127.0.0.1:8000/v1 (openai backend)")
    p.add_argument("--model", default=None, help="served model name (openai backend; default: the first of GET /models)")
    p.add_argument("--api-key", default=None, help="endpoint API key (default: $OPENAI_API_KEY, if set)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1)")
    p.add_argument("--max-new-tokens", type=int, default=512, help="tokens per answer at most (default 512)")
    p.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="local: longest prompt to answer; a chat stops at a longer turn "
                        "(default: the target's context minus --max-new-tokens)")
    p.add_argument("--batch-size", type=int, default=16, help="local: prompts per generate call (default 16)")
    p.add_argument("--concurrency", type=int, default=8, help="openai: conversations in flight (default 8)")
    p.add_argument("--max-retries", type=int, default=5, help="openai: retries per request (default 5)")
    p.add_argument("--timeout", type=float, default=600.0, help="openai: seconds per request (default 600)")
    p.add_argument("--resume", action="store_true", help="continue an existing --out, skipping the ids it holds")
    p.add_argument("--num-samples", type=int, default=None, help="stop after this many usable chats")
    p.add_argument("--skip", type=int, default=0, help="skip the first N records of the input")
    p.add_argument("--max-turns", type=int, default=None,
                   help="answer at most the first N assistant turns of each chat (default: all)")
    p.add_argument("--time-budget", type=parse_duration, default=None,
                   help="start no new chat after this long (e.g. 30m); chats under way keep their finished turns")
    p.add_argument("--dtype", default="auto",
                   help="local: compute dtype auto (default: bf16 where fast, else fp32), bf16, fp16, fp32")
    p.add_argument("--device", default=None, help="local: cpu or cuda[:i] (default: cuda if available)")
    p.add_argument("--seed", type=int, default=0, help="local sampling seed (default 0)")
    p.set_defaults(func=cmd_regen)

    from eaglet.evaluate import (CPU_CHAIN_DEPTH, CPU_MIN_DRAFT_PROB, CPU_TREE, DEFAULT_METHODS, HYBRID_CHAIN_DEPTH,
                                 ADMISSIONS, HYBRID_DRAFTS, HYBRID_LOOKUP_TOKENS, HYBRID_MAX_NGRAM, METHODS, PROMPT_SETS)
    p = sub.add_parser("eval", help="acceptance length and speedup of a drafter on prompt sets",
                       description="Decode prompt sets with plain greedy and with each method (speculative chain / "
                                   "tree with the drafter; hybrid: the drafter's chain and prompt lookup's continuation "
                                   "verified in one pass; ngram: prompt lookup in eaglet's engine; Hugging Face prompt "
                                   "lookup), interleaved per prompt; report "
                                   "tau, acceptance per draft position, tokens/s, speedup over plain greedy and "
                                   "whether outputs equal plain greedy's. Table, OUT/eval.json and OUT/eval.png.")
    p.add_argument("drafter", help="eaglet checkpoint or run folder (its best checkpoint), or an EAGLE-3 / "
                                   "speculators drafter folder")
    add_target_args(p, default="the target recorded in the drafter's checkpoint")
    p.add_argument("--prompts", type=parse_list, default=["mtbench"],
                   help=f"comma-separated prompt sets: {', '.join(PROMPT_SETS)} or a JSONL file of "
                        "{\"prompt\"} / {\"turns\"} / {\"messages\"} lines (default mtbench: first turns)")
    p.add_argument("--num-prompts", type=int, default=None, help="first N prompts of each set (default: all)")
    p.add_argument("--methods", type=parse_list, default=list(DEFAULT_METHODS),
                   help=f"besides plain greedy, comma-separated from {', '.join(METHODS)} "
                        f"(default {','.join(DEFAULT_METHODS)})")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens per answer at most (default 128)")
    p.add_argument("--depth", type=int, default=CPU_TREE["depth"], help=f"tree depth (default {CPU_TREE['depth']})")
    p.add_argument("--top-k", type=int, default=CPU_TREE["top_k"],
                   help=f"tree branching per node (default {CPU_TREE['top_k']})")
    p.add_argument("--total-tokens", type=int, default=CPU_TREE["total_tokens"],
                   help=f"tree draft tokens verified per pass (default {CPU_TREE['total_tokens']}; "
                        "EAGLE-2's GPU setting is 60 with depth 7, top-k 10)")
    p.add_argument("--chain-depth", type=int, default=CPU_CHAIN_DEPTH,
                   help=f"draft tokens per pass in chain mode (default {CPU_CHAIN_DEPTH})")
    p.add_argument("--min-draft-prob", type=float, default=CPU_MIN_DRAFT_PROB,
                   help="propose only draft tokens whose path probability under the drafter is at least this; a "
                        f"cycle with none left is a plain one-token pass (default {CPU_MIN_DRAFT_PROB})")
    p.add_argument("--hybrid-draft", choices=HYBRID_DRAFTS, default="chain",
                   help="hybrid: the drafter's part of each cycle, a chain or its tree (default chain)")
    p.add_argument("--hybrid-chain-depth", type=int, default=HYBRID_CHAIN_DEPTH,
                   help=f"hybrid: the depth of the drafter's chain (default {HYBRID_CHAIN_DEPTH})")
    p.add_argument("--drop-rivals", action="store_true",
                   help="hybrid with --admission all and --min-draft-prob: leave out drafted tokens that rival a "
                        "lookup token trusted beyond 1 - P (at most one sibling is right, so such a rival is right "
                        "with at most P)")
    p.add_argument("--admission", choices=ADMISSIONS, default="cost",
                   help="hybrid and ngram: 'cost' verifies a proposed token only where its calibrated chance of "
                        "acceptance pays for the longer target pass (pass times measured before decoding; "
                        "--min-draft-prob then applies to the drafter only); 'all' "
                        "verifies every proposed token (default cost)")
    p.add_argument("--lookup-tokens", type=int, default=HYBRID_LOOKUP_TOKENS,
                   help=f"hybrid and ngram: tokens prompt lookup adds to a cycle at most (default {HYBRID_LOOKUP_TOKENS})")
    p.add_argument("--max-ngram", type=int, default=HYBRID_MAX_NGRAM,
                   help=f"hybrid and ngram: the longest n-gram looked up (default {HYBRID_MAX_NGRAM})")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1)")
    p.add_argument("--dtype", default="bf16", help="target and drafter dtype: bf16 (default), fp16, fp32")
    p.add_argument("--device", default=None, help="cpu or cuda[:i] (default: cuda if available)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    p.add_argument("--out", default=None, help="folder for eval.json and eval.png")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG plot")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.set_defaults(func=cmd_eval)
    add_export_parsers(sub)
    return parser


def given_options(args: argparse.Namespace, names: tuple[str, ...]) -> set[str]:
    """Which of `names` were written on the command line: parse it again with a marker as their default."""
    stage = args.parser.stage_parsers[args.stage]
    unset = object()
    saved = {n: stage.get_default(n) for n in names}
    stage.set_defaults(**{n: unset for n in names})
    try:
        probe = args.parser.parse_args(args.argv)
    finally:
        stage.set_defaults(**saved)
    return {n for n in names if getattr(probe, n) is not unset}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args = parser.parse_args(argv)
    args.command = shlex.join(["eaglet", *argv])
    args.parser, args.argv = parser, argv
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s")
    for noisy in ("transformers", "huggingface_hub", "accelerate"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    try:
        args.func(args)
    except KeyboardInterrupt:
        clear_progress_bars()
        print(f"eaglet {args.stage}: interrupted; finished files are kept, the same command resumes",
              file=sys.stderr)
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
    from eaglet.formats import WriteFailed, os_error_reason

    if isinstance(e, OSError) and not isinstance(e, WriteFailed) and e.filename is not None:
        path = Path(e.filename)  # a folder eaglet could not create or a file it could not open
        return f"{path}: {os_error_reason(e, path)}"
    text = " ".join(str(e).split("\n")).strip() or type(e).__name__
    if isinstance(e, (ValueError, OSError, RuntimeError)):
        return text
    return f"{type(e).__name__}: {text} (run with -v for the traceback)"


if __name__ == "__main__":
    sys.exit(main())
