"""The vLLM backend: vLLM's offline engine on the target (`eaglet.vllm_engine`, no server), started
and stopped by eaglet. It regenerates in rounds exactly as the local backend does (`run_local`:
each pooled conversation's next turn rendered by the target's own chat template, prompts of
similar length sent together) and vLLM batches each round's prompts itself; prompts go as token
ids and answers come back as token ids, decoded by the same tokenizer as every other backend's."""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

from eaglet.chat import Message, chat_prompt_ids, end_of_turn_ids
from eaglet.layers import config_positions
from eaglet.regen.backend import Settings
from eaglet.regen.conversations import Conversation, Turn, split_at_stop
from eaglet.regen.llama_server import target_generation
from eaglet.regen.local import run_local
from eaglet.regen.run import Run
from eaglet.target import dtype_name, load_chat_tokenizer, parse_dtype, resolve_target, text_config
from eaglet.vllm_engine import VllmEngine, engine_record, vllm_engine


@dataclass
class VllmGenerator:
    """Prompts -> turns through a running engine (what `run_local` calls)."""

    engine: VllmEngine
    tokenizer: Any
    stop_ids: set[int]
    max_new_tokens: int
    temperature: float
    top_p: float
    seed: int
    rounds: int = 0

    def prompt_ids(self, messages: list[Message]) -> list[int]:
        return chat_prompt_ids(self.tokenizer, messages)

    def generate(self, prompts: list[list[int]]) -> list[Turn]:
        # sampled runs: a seed per round, so two rounds never draw the same numbers
        self.rounds += 1
        seed = zlib.crc32(f"{self.seed}:{self.rounds}".encode())
        done = self.engine.generate(
            prompts, self.max_new_tokens, sorted(self.stop_ids), self.temperature, self.top_p, seed
        )
        turns = []
        for tokens in done.outputs:
            kept, reason, count = split_at_stop(tokens, self.stop_ids)
            turns.append(Turn(self.tokenizer.decode(kept, skip_special_tokens=True), reason, count))
        return turns


@dataclass
class VllmBackend:
    settings: Settings
    target: str
    tokenizer: Any
    stop_ids: set[int]
    max_prompt_tokens: int
    meta: dict[str, Any]

    @classmethod
    def open(cls, s: Settings) -> VllmBackend:
        ref = resolve_target(s.options.target)
        tokenizer = load_chat_tokenizer(ref)
        positions = config_positions(text_config(ref))
        context = min(s.vllm.max_model_len or positions, positions) if s.vllm else positions
        max_prompt_tokens = s.options.max_prompt_tokens or context - s.options.max_new_tokens
        if max_prompt_tokens < 1:
            raise ValueError(
                f"--max-new-tokens {s.options.max_new_tokens} leaves no room for a prompt in the engine's "
                f"{context} positions"
            )
        dtype = dtype_name(parse_dtype(s.options.dtype, s.options.device))
        meta = {
            "target": ref.name,
            "target_revision": ref.revision,
            "dtype": dtype,
            "engine": engine_record(),
            **({"seed": s.options.seed} if s.options.temperature > 0 else {}),
        }
        return cls(s, ref.path, tokenizer, end_of_turn_ids(tokenizer, target_generation(ref)), max_prompt_tokens, meta)

    def run(self, convs: Iterator[Conversation], run: Run, resources: contextlib.ExitStack) -> None:
        s = self.settings
        assert s.vllm is not None
        options = replace(
            s.vllm,
            dtype=self.meta["dtype"],
            seed=s.options.seed,
            max_model_len=s.vllm.max_model_len or self.max_prompt_tokens + s.options.max_new_tokens,
        )
        engine = resources.enter_context(
            vllm_engine(self.target, options, log_dir=s.out.with_name(s.out.name + ".vllm"))
        )
        run.restart_clock()  # the engine's start-up is not regeneration time
        gen = VllmGenerator(
            engine,
            self.tokenizer,
            self.stop_ids,
            s.options.max_new_tokens,
            s.options.temperature,
            s.options.top_p,
            s.options.seed,
        )
        run_local(
            convs,
            gen,
            s.options.batch_size,
            self.max_prompt_tokens,
            run.emit,
            run.fail,
            run.progress,
            run.tick,
            run.out_of_time,
        )
