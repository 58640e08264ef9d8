"""The llama.cpp backend: llama-server on the target's GGUF, started and stopped by eaglet, one
parallel slot per conversation in flight (continuous batching). Prompts are rendered by the
target's own chat template exactly as the local backend renders them and sent as token ids;
answers are decoded by the same tokenizer, so only the weights' quantization differs."""

from __future__ import annotations

import contextlib
import os
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eaglet import llama_cpp
from eaglet.chat import chat_prompt_ids, end_of_turn_ids
from eaglet.layers import UNBOUNDED_POSITIONS, config_positions
from eaglet.regen.backend import Settings
from eaglet.regen.conversations import Conversation, RegenError, Turn, empty_answer, split_at_stop
from eaglet.regen.run import Run, run_parallel
from eaglet.target import TargetRef, f32_target_gguf, find_target_gguf, load_chat_tokenizer, resolve_target, text_config


@dataclass
class LlamaCppTurns:
    """What every request of a llama.cpp run shares: the server, the target's tokenizer and
    end-of-turn ids, and the sampling settings."""

    server: llama_cpp.LlamaServer
    tokenizer: Any
    stop_ids: set[int]
    max_new_tokens: int
    max_prompt_tokens: int | None
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def turn_seed(self, conv: Conversation) -> int:
        """A sampling seed per conversation and turn: a resumed run samples what a whole run would."""
        return zlib.crc32(f"{self.seed}:{conv.id}:{conv.done}".encode())

    def answer(self, ids: list[int], conv: Conversation) -> Turn:
        try:
            done = self.server.complete(ids, self.max_new_tokens, self.temperature, self.top_p, self.turn_seed(conv))
        except llama_cpp.LlamaServerError as e:
            if self.server.process.poll() is not None:
                raise  # the server is gone: every chat would fail; stop the run (--resume continues it)
            raise RegenError(str(e)) from None  # this request's own error (HTTP 400 and the like)
        kept, reason, count = split_at_stop(done.tokens, self.stop_ids)
        if reason == "length" and done.stop_type == "eos":  # an end-of-turn token llama.cpp knows and left out
            reason, count = "stop", len(kept) + 1
        return Turn(self.tokenizer.decode(kept, skip_special_tokens=True), reason, count)

    def regen(self, conv: Conversation, progress: Callable[[int], None]) -> Conversation:
        """Every turn of one conversation, in order; a turn whose prompt is too long ends the
        chat there (written cut short), as the local backend does."""
        while not conv.finished:
            try:
                ids = chat_prompt_ids(self.tokenizer, conv.prompt())
            except Exception as e:  # a template that raises on this chat (jinja raise_exception)
                raise RegenError(f"chat template failed: {type(e).__name__}: {e}") from None
            if self.max_prompt_tokens is not None and len(ids) > self.max_prompt_tokens:
                if conv.done:
                    return conv
                raise RegenError(f"prompt has {len(ids)} tokens, more than the {self.max_prompt_tokens} allowed")
            turn = self.answer(ids, conv)
            empty = empty_answer(turn)
            if empty is not None:
                raise RegenError(empty)
            conv.record(turn)
            progress(turn.tokens)
        return conv


UNNAMED_CONTEXT = 4096  # a slot's prompt room when neither --max-prompt-tokens nor the target's config bounds it


def prompt_limit(positions: int, max_prompt_tokens: int | None, max_new_tokens: int) -> int | None:
    """The longest prompt eaglet sends: --max-prompt-tokens, else what the target's positions
    leave after an answer; None when its config bounds none (the server then refuses a prompt
    longer than its context, and that chat fails)."""
    if max_prompt_tokens:
        return max_prompt_tokens
    return positions - max_new_tokens if positions < UNBOUNDED_POSITIONS else None


def target_generation(ref: TargetRef) -> Any:
    """The target's generation config (None without one), read without its weights."""
    from transformers import GenerationConfig  # seconds to import: only the llama.cpp backend here

    try:
        return GenerationConfig.from_pretrained(ref.path)  # a JSON file: no code runs
    except OSError:  # no generation_config.json: the tokenizer's EOS alone
        return None


@dataclass
class LlamaCppBackend:
    gguf: Path
    tokenizer: Any
    stop_ids: set[int]
    max_prompt_tokens: int | None
    settings: Settings
    meta: dict[str, Any]

    @classmethod
    def open(cls, s: Settings) -> LlamaCppBackend:
        ref = resolve_target(s.options.target)
        tokenizer = load_chat_tokenizer(ref)
        gguf = find_target_gguf(s.options.target_gguf, ref.name, "the llama.cpp backend runs the target's GGUF")
        gguf = f32_target_gguf(gguf) if s.options.engine_f32 else gguf
        max_prompt_tokens = prompt_limit(
            config_positions(text_config(ref)), s.options.max_prompt_tokens, s.options.max_new_tokens
        )
        meta = {
            "target": ref.name,
            "target_revision": ref.revision,
            "gguf": gguf.name,
            "server": llama_cpp.server_version(),
            **({"seed": s.options.seed} if s.options.temperature > 0 else {}),
        }
        return cls(gguf, tokenizer, end_of_turn_ids(tokenizer, target_generation(ref)), max_prompt_tokens, s, meta)

    def server_options(self) -> dict[str, Any]:
        # a context for the longest prompt and its answer in every slot (llama-server splits it among slots)
        o = self.settings.options
        return {
            "threads": o.threads or os.cpu_count() or 1,
            "parallel": o.concurrency,
            "ctx_size": (self.max_prompt_tokens or UNNAMED_CONTEXT) + o.max_new_tokens,
        }

    def run(self, convs: Iterator[Conversation], run: Run, resources: contextlib.ExitStack) -> None:
        s = self.settings
        server = resources.enter_context(
            llama_cpp.llama_server(
                self.gguf, log_dir=s.out.with_name(s.out.name + ".llama-server"), **self.server_options()
            )
        )
        turns = LlamaCppTurns(
            server,
            self.tokenizer,
            self.stop_ids,
            s.options.max_new_tokens,
            self.max_prompt_tokens,
            s.options.temperature,
            s.options.top_p,
            s.options.seed,
        )
        run.restart_clock()  # the server's start-up is not regeneration time
        run_parallel(
            convs, lambda conv: turns.regen(conv, run.progress), s.options.concurrency, run.emit, run.fail, run.tick
        )
