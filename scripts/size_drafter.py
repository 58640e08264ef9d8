#!/usr/bin/env python3
"""What `eaglet train` needs per GPU for a target, from its config.json: the drafter eaglet builds
(`DraftConfig.from_target`), its trainable parameters, the optimizer's bytes and the activation
bytes of one micro-batch at given context lengths, and the dataset's bytes per token per layout.

    python scripts/size_drafter.py path/to/config.json [--context 4096,16384] [--ttt-steps 7]

The drafter is instantiated on the meta device (no bytes), so the parameter count is the real
module's. Memory is counted, not measured:
  * static: AdamW over fp32 master weights = 4 (weights) + 4 (grads) + 8 (two moments) bytes per
    trainable parameter; plus the frozen fp32 embeddings the drafter copies from the target, and
    the teacher's fp32 final norm and LM head (both target-sized: vocab x hidden);
  * activations: the tensors autograd keeps for backward in one TTT step of the one-layer drafter
    under bf16 autocast, per token (listed in `activation_bytes_per_token`), times the TTT steps
    (every step's graph lives until backward) and the context length. Attention keeps no
    (L x L) scores (`drafter.attention.diagonal_ttt_attention`). Allocator slack and temporaries add to
    it, so treat the total as a floor.
A Kimi-K2.5 config nests the text model under "text_config"; that is what is sized.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402

from eaglet.drafter import DraftConfig, Eagle3Draft, num_parameters  # noqa: E402
from eaglet.formats import v1_min_bytes_per_token  # noqa: E402
from eaglet.layers import default_aux_ids  # noqa: E402

BF16, FP32 = 2, 4
ADAMW_BYTES = FP32 + FP32 + 2 * FP32  # master weight, its gradient, two moments
GIB = 2**30


def text_config(raw: dict[str, Any]) -> SimpleNamespace:
    """The language model's config as attributes (a multimodal config's "text_config")."""
    return SimpleNamespace(**raw.get("text_config", raw))


def compact_bytes_per_token(hidden_size: int, top_k: int) -> int:
    """docs/formats.md: 3H*0.75 (6-bit codes) + 3H/16 (fp16 scale per 32) + 6K (int32 id + fp16
    log-prob) + 5 (int32 input id + uint8 mask)."""
    return 3 * hidden_size * 3 // 4 + 3 * hidden_size // 16 + 6 * top_k + 5


def activation_bytes_per_token(cfg: DraftConfig, dense_teacher: bool = False) -> int:
    """Bytes autograd keeps per token for one TTT step (bf16 autocast, fp32 logits and loss)."""
    H, inter, V = cfg.hidden_size, cfg.intermediate_size, cfg.draft_vocab_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    bf16_values = (
        2 * H  # the norms' inputs: embeddings and the fused hidden state
        + 2 * H  # their concatenation, the input of q/k/v
        + q
        + 2 * kv  # roped q, k, v (kept by attention)
        + q  # attention output (the input of o_proj)
        + 2 * H  # post-attention norm input and output (the MLP's input)
        + 4 * inter  # gate, up, act(gate), act(gate) * up (the input of down)
        + 2 * H  # final norm input and output (the LM head's input)
    )
    fp32_values = (
        cfg.num_heads  # attention log-sum-exp per head
        + 2 * V  # logits and their log-softmax
        + (V if dense_teacher else 0)
    )
    return BF16 * bf16_values + FP32 * fp32_values


@dataclass(frozen=True)
class Sizing:
    cfg: DraftConfig
    trainable: int  # drafter parameters the optimizer updates
    frozen: int  # the drafter's copy of the target's embeddings
    teacher: int  # the teacher's parameters: the target's final norm and LM head
    per_token_step: int  # activation bytes per token per TTT step

    @property
    def optimizer_bytes(self) -> int:
        return ADAMW_BYTES * self.trainable

    @property
    def static_bytes(self) -> int:
        return self.optimizer_bytes + FP32 * (self.frozen + self.teacher)

    def activation_bytes(self, context: int, ttt_steps: int, batch: int = 1) -> int:
        # the fc's 3H bf16 input (the aux states) is kept once, not per step
        return batch * context * (ttt_steps * self.per_token_step + 3 * self.cfg.target_hidden_size * BF16)


def size(raw_config: dict[str, Any], draft_vocab_size: int | None = None) -> Sizing:
    c = text_config(raw_config)
    n = c.num_hidden_layers
    cfg = DraftConfig.from_target(c, default_aux_ids(n), draft_vocab_size)
    with torch.device("meta"):
        draft = Eagle3Draft(cfg)
    teacher = c.vocab_size * c.hidden_size + c.hidden_size
    return Sizing(
        cfg,
        num_parameters(draft),
        num_parameters(draft, trainable_only=False) - num_parameters(draft),
        teacher,
        activation_bytes_per_token(cfg),
    )


def gib(n: int) -> str:
    return f"{n / GIB:,.1f} GiB"


def report(name: str, raw_config: dict[str, Any], contexts: list[int], ttt_steps: int, top_k: int = 16) -> str:
    """A markdown section: the drafter eaglet builds, its memory per GPU, the data's bytes."""
    s = size(raw_config)
    cfg = s.cfg
    H = cfg.target_hidden_size
    target = text_config(raw_config)
    lines = [
        f"**{name}** (hidden {H}, {target.num_attention_heads} heads, {target.num_hidden_layers} layers, "
        f"vocab {cfg.target_vocab_size}): eaglet's drafter has {cfg.num_heads} heads x head_dim {cfg.head_dim}, "
        f"{cfg.num_kv_heads} KV heads, intermediate {cfg.intermediate_size}, draft vocab {cfg.draft_vocab_size}, "
        f"aux layers {cfg.aux_layer_ids}.",
        "",
        "| per GPU | bytes |",
        "| --- | --- |",
        f"| trainable parameters | {s.trainable:,} ({s.trainable / 1e9:.2f} B) |",
        f"| AdamW: fp32 weights + grads + 2 moments ({ADAMW_BYTES} B/param) | {gib(s.optimizer_bytes)} |",
        f"| frozen fp32 embeddings + teacher norm and LM head | {gib(FP32 * (s.frozen + s.teacher))} |",
        f"| activations per token per TTT step | {s.per_token_step:,} B |",
    ]
    for context in contexts:
        act = s.activation_bytes(context, ttt_steps)
        lines.append(
            f"| activations, {context:,} tokens x {ttt_steps} TTT steps | {gib(act)} "
            f"(total {gib(s.static_bytes + act)}) |"
        )
    lines += [
        f"| dataset per token: v1 (4 bf16 states) | {v1_min_bytes_per_token(H):,} B |",
        f"| dataset per token: compact (K = {top_k}) | {compact_bytes_per_token(H, top_k):,} B |",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("config", help="a target's config.json")
    p.add_argument("--name", help="what to call it (default: the file's folder)")
    p.add_argument("--context", default="4096,16384", help="comma-separated context lengths")
    p.add_argument("--ttt-steps", type=int, default=7)
    args = p.parse_args(argv)
    path = Path(args.config)
    raw = json.loads(path.read_text())
    contexts = [int(x) for x in args.context.split(",") if x]
    print(report(args.name or path.parent.name, raw, contexts, args.ttt_steps))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
