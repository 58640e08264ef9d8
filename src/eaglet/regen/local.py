"""The local backend: the target with Hugging Face `generate` (KV cache), the pending turns of
many conversations batched by similar prompt length, left-padded."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from eaglet.chat import Message, chat_prompt_ids, stop_token_ids
from eaglet.regen.backend import Settings
from eaglet.regen.conversations import Conversation, Turn, empty_answer, length_batches, split_at_stop
from eaglet.regen.run import Run
from eaglet.target import (
    dtype_name,
    generation_config,
    input_device,
    load_chat_tokenizer,
    load_target,
    max_positions,
    parse_dtype,
    pick_device,
    resolve_target,
)


class LocalGenerator:
    """Batched generation with the target; prompts rendered by its own chat template."""

    def __init__(self, model, tokenizer, temperature: float, top_p: float, max_new_tokens: int):
        self.model, self.tokenizer = model, tokenizer
        self.device = input_device(model)
        self.stop_ids = stop_token_ids(model, tokenizer)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self.stop_ids)
        self.config = generation_config(temperature, top_p, max_new_tokens, self.pad_id, sorted(self.stop_ids))
        model.generation_config = self.config
        self.max_prompt_tokens = max_positions(model) - max_new_tokens

    def prompt_ids(self, messages: list[Message]) -> list[int]:
        return chat_prompt_ids(self.tokenizer, messages)

    def generate(self, prompts: list[list[int]]) -> list[Turn]:
        width = max(len(p) for p in prompts)
        # Left padding: every row's last prompt token sits at the same column, where the
        # first new token is predicted; the mask (and positions derived from it) hide the pad.
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for r, p in enumerate(prompts):
            ids[r, width - len(p) :] = torch.tensor(p)
            mask[r, width - len(p) :] = 1
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=ids.to(self.device), attention_mask=mask.to(self.device), generation_config=self.config
            )
        turns = []
        for row in out[:, width:].tolist():
            kept, reason, count = split_at_stop(row, self.stop_ids)
            turns.append(Turn(self.tokenizer.decode(kept, skip_special_tokens=True), reason, count))
        return turns


class Generator(Protocol):
    """What `run_local` generates with: the local target (`LocalGenerator`) or vLLM's engine."""

    def prompt_ids(self, messages: list[Message]) -> list[int]: ...

    def generate(self, prompts: list[list[int]]) -> list[Turn]: ...


def run_local(
    convs: Iterator[Conversation],
    gen: Generator,
    batch_size: int,
    max_prompt_tokens: int | None,
    emit: Callable[[Conversation], None],
    fail: Callable[[Conversation, str], None],
    progress: Callable[[int], None],
    tick: Callable[[], None],
    out_of_time: Callable[[], bool] = lambda: False,
) -> None:
    """Regenerate in rounds over a pool of conversations: each round renders every pooled
    conversation's next turn, batches the prompts by length and generates; finished
    conversations leave the pool (and are written) and new ones come in. Out of time, it stops
    after the batch at hand: pooled conversations keep the turns regenerated so far (written
    cut short), those with none are left for a later run."""
    pool: list[Conversation] = []
    pool_size = batch_size * 4  # more candidates than one batch, so batches match lengths well
    exhausted = False
    while True:
        while not exhausted and len(pool) < pool_size:
            conv = next(convs, None)
            if conv is None:
                exhausted = True
            else:
                pool.append(conv)
        if not pool:
            return
        pending = next_prompts(pool, gen, max_prompt_tokens, emit, fail)
        pool = [conv for conv, _ in pending]
        for batch in length_batches(pending, lambda item: len(item[1]), batch_size):
            for conv, turn in zip((c for c, _ in batch), generate_or_split(gen, [ids for _, ids in batch])):
                reason = turn if isinstance(turn, str) else empty_answer(turn)
                if reason is not None or isinstance(turn, str):  # (a str is the reason)
                    fail(conv, f"turn {conv.done}: {reason}")
                    pool.remove(conv)
                    continue
                conv.record(turn)
                progress(turn.tokens)
                if conv.finished:
                    emit(conv)
                    pool.remove(conv)
            tick()  # tokens/s moves per batch, not only when a conversation completes
            if out_of_time():
                for conv in pool:
                    if conv.done:
                        emit(conv)
                return


def next_prompts(
    pool: list[Conversation],
    gen: Generator,
    max_prompt_tokens: int | None,
    emit: Callable[[Conversation], None],
    fail: Callable[[Conversation, str], None],
) -> list[tuple[Conversation, list[int]]]:
    """Each pooled conversation's next prompt, rendered; a conversation whose prompt cannot be
    rendered fails, one whose prompt is too long ends there (written cut short, or failed on turn 0)."""
    pending = []
    for conv in pool:
        try:
            ids = gen.prompt_ids(conv.prompt())
        except Exception as e:  # a template that raises on this chat (jinja raise_exception)
            fail(conv, f"chat template failed on turn {conv.done}: {type(e).__name__}: {e}")
            continue
        if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
            if conv.done:
                emit(conv)  # writes the turns regenerated so far, as prepare keeps a truncated chat
            else:
                fail(conv, f"prompt of turn 0 has {len(ids)} tokens, more than the {max_prompt_tokens} allowed")
            continue
        pending.append((conv, ids))
    return pending


def generate_or_split(gen: Generator, prompts: list[list[int]]) -> list[Turn | str]:
    """Generate a batch; when it runs out of memory, halve it, down to single prompts (whose
    failure becomes that conversation's error) instead of stopping the whole run."""
    try:
        return [*gen.generate(prompts)]
    except torch.OutOfMemoryError:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if len(prompts) == 1:
            return [f"out of memory generating from a prompt of {len(prompts[0])} tokens"]
        half = len(prompts) // 2
        return generate_or_split(gen, prompts[:half]) + generate_or_split(gen, prompts[half:])


@dataclass
class LocalBackend:
    gen: LocalGenerator
    batch_size: int
    max_prompt_tokens: int | None
    meta: dict[str, Any]

    @classmethod
    def open(cls, s: Settings) -> LocalBackend:
        ref = resolve_target(s.options.target)
        tokenizer = load_chat_tokenizer(ref)
        torch.manual_seed(s.options.seed)
        dev = pick_device(s.options.device)
        dtype = parse_dtype(s.options.dtype, dev)
        gen = LocalGenerator(
            load_target(ref, dtype, dev, s.placed),
            tokenizer,
            s.options.temperature,
            s.options.top_p,
            s.options.max_new_tokens,
        )
        meta = {
            "target": ref.name,
            "target_revision": ref.revision,
            "dtype": dtype_name(dtype),
            **({"seed": s.options.seed} if s.options.temperature > 0 else {}),
        }
        return cls(gen, s.options.batch_size, s.options.max_prompt_tokens or gen.max_prompt_tokens, meta)

    def run(self, convs: Iterator[Conversation], run: Run, resources: contextlib.ExitStack) -> None:
        run_local(
            convs,
            self.gen,
            self.batch_size,
            self.max_prompt_tokens,
            run.emit,
            run.fail,
            run.progress,
            run.tick,
            run.out_of_time,
        )
