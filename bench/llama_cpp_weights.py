"""llama-server with an eaglet drafter, per weight type of the target: what verifying drafts costs.

    python bench/llama_cpp_weights.py DRAFTER [--weights q4_1,q8_0,f32] [--prompts mtbench]
                                      [--num-prompts 10] [--max-new-tokens 128] [--threads 1]

For each weight type of the embedded target's GGUF (q4_1: as it ships; q8_0: its f32 copy
quantized to Q8_0; f32: its f32 copy, eaglet's own weights), llama-server decodes the same
prompts greedily without a drafter and with DRAFTER (exported to GGUF) as its eagle3 drafter,
and the table gives tokens/s by the engine's clock, the eagle3 speedup over plain, the drafts'
acceptance per position and tau. Where a pass over a few tokens costs about what a pass over one
does, accepted drafts pay; where it costs one pass per token, they cannot: the last column is
that cost, the milliseconds the target takes for 1 to 8 new tokens after a cached prompt. Run it
with nothing else on the machine.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from eaglet import embedded, formats, llama_cpp
from eaglet.chat import chat_prompt_ids
from eaglet.export import export_drafter
from eaglet.prompts import load_prompt_set
from eaglet.target import cpu_description, f32_target_gguf, load_tokenizer, resolve_target
from eaglet.options import ExportOptions

PASS_SIZES = (1, 2, 3, 4, 8)


def decode_all(server: llama_cpp.LlamaServer, prompts: list[list[int]], n: int) -> tuple[int, float]:
    """Tokens generated and engine seconds over every prompt."""
    tokens, seconds = 0, 0.0
    for ids in prompts:
        c = server.complete(ids, n)
        tokens, seconds = tokens + c.generated, seconds + c.seconds
    return tokens, seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("drafter", help="eaglet run folder or checkpoint")
    p.add_argument("--weights", default="q4_1,q8_0,f32")
    p.add_argument("--prompts", default="mtbench")
    p.add_argument("--num-prompts", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--chain-depth", type=int, default=2, help="drafts per step (llama.cpp's --spec-draft-n-max)")
    p.add_argument("--min-draft-prob", type=float, default=0.35)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="eaglet-llama-weights-"))
    source = embedded.smollm2_gguf()
    f32 = f32_target_gguf(source)
    targets = {"q4_1": source, "f32": f32}
    if "q8_0" in args.weights:
        targets["q8_0"] = work / "target.q8_0.gguf"
        formats.write_gguf_as(f32, targets["q8_0"], "Q8_0")
    drafter = work / "drafter.gguf"
    export_drafter(ExportOptions(ckpt=args.drafter, out=drafter, fmt=formats.FORMAT_GGUF))
    tokenizer = load_tokenizer(resolve_target(None))
    prompts = [
        chat_prompt_ids(tokenizer, [{"role": "user", "content": q.turns[0]}])
        for q in load_prompt_set(args.prompts, args.num_prompts)
    ]
    options = dict(threads=args.threads, draft_max=args.chain_depth, draft_p_min=args.min_draft_prob)
    rows = []
    for w in args.weights.split(","):
        specs = {
            "plain": llama_cpp.ServerSpec(None, None),
            "eagle3": llama_cpp.ServerSpec(drafter, llama_cpp.SPEC_EAGLE3),
        }
        with llama_cpp.llama_servers(targets[w], specs, log_dir=work / "logs", **options) as servers:
            for ids in prompts[:1]:  # untimed warm-up
                for s in servers.values():
                    s.complete(ids, 8)
            before = servers["eagle3"].spec_counts()
            plain = decode_all(servers["plain"], prompts, args.max_new_tokens)
            eagle3 = decode_all(servers["eagle3"], prompts, args.max_new_tokens)
            counts = servers["eagle3"].spec_counts().minus(before)
            costs = servers["plain"].pass_costs(prompts[0], prompts[1], PASS_SIZES)
        reached = counts.reached_per_position
        acceptance = [round(a / r, 2) if r else 0.0 for a, r in zip(reached[1:], reached)]
        plain_tps, eagle3_tps = plain[0] / plain[1], eagle3[0] / eagle3[1]
        tau = eagle3[0] / max(1, eagle3[0] - counts.accepted)
        rows.append((w, plain_tps, eagle3_tps, eagle3_tps / plain_tps, tau, acceptance, costs))
        print(rows[-1], flush=True)
    print(
        f"\nllama-server, {args.num_prompts} {args.prompts} prompts, {args.max_new_tokens} new tokens, greedy, "
        f"{args.threads} thread(s), chain {args.chain_depth} (p >= {args.min_draft_prob}); {cpu_description()}"
    )
    print(
        f"{'weights':<8}{'plain tok/s':>12}{'eagle3 tok/s':>14}{'speedup':>9}{'tau':>7}  {'acceptance':<14}"
        f"ms to process {'/'.join(map(str, PASS_SIZES))} new tokens"
    )
    for w, plain_tps, eagle3_tps, speedup, tau, acceptance, costs in rows:
        print(
            f"{w:<8}{plain_tps:>12.1f}{eagle3_tps:>14.1f}{speedup:>8.2f}x{tau:>7.2f}  {str(acceptance):<14}"
            f"{' / '.join(map(str, costs))}"
        )


if __name__ == "__main__":
    main()
