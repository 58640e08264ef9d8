"""Conversations and turns, pure: what every backend regenerates, one assistant turn at a time,
with the target's own earlier answers in the history; the input's chats as conversations; an
output line."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from eaglet.chat import ASSISTANT, Message, ReadStats, iter_records, to_messages


class RegenError(Exception):
    """A conversation cannot be regenerated; the message is the reason written to the errors file."""


class AllChatsFailed(RuntimeError):
    """Every chat of the run failed and OUT holds none: nothing for `eaglet prepare` to read."""


@dataclass
class Turn:
    """One regenerated assistant turn."""

    text: str
    finish_reason: str  # "stop" (end-of-turn) or "length" (hit max_new_tokens)
    tokens: int  # generated tokens, end-of-turn token included


def assistant_indices(messages: list[Message]) -> list[int]:
    return [i for i, m in enumerate(messages) if m["role"] == ASSISTANT]


def turn_prompt(messages: list[Message], k: int) -> list[Message]:
    """The messages the target answers for assistant turn k: everything before it. Callers
    store each regenerated answer back into `messages`, so the history is the target's own."""
    return messages[: assistant_indices(messages)[k]]


def with_answer(messages: list[Message], k: int, text: str) -> list[Message]:
    out = [dict(m) for m in messages]
    out[assistant_indices(messages)[k]] = {"role": ASSISTANT, "content": text}
    return out


@dataclass
class Conversation:
    """A chat being regenerated: `messages` holds regenerated answers for turns < `done`."""

    id: str
    messages: list[Message]
    done: int = 0
    finish_reasons: list[str] = field(default_factory=list)
    tokens: int = 0

    @property
    def turns(self) -> int:
        return len(assistant_indices(self.messages))

    @property
    def finished(self) -> bool:
        return self.done >= self.turns

    def prompt(self) -> list[Message]:
        return turn_prompt(self.messages, self.done)

    def record(self, turn: Turn) -> None:
        self.messages = with_answer(self.messages, self.done, turn.text)
        self.finish_reasons.append(turn.finish_reason)
        self.tokens += turn.tokens
        self.done += 1

    def cut(self) -> None:
        """Keep only the turns regenerated so far (a later prompt is too long to answer)."""
        self.messages = self.messages[: assistant_indices(self.messages)[self.done - 1] + 1]


def empty_answer(turn: Turn) -> str | None:
    """Why `turn` cannot be kept when it answers nothing (empty or whitespace only), else None.

    Such a turn trains nothing, and `eaglet prepare` cuts a chat at an empty message, so it
    must not pass for finished (a `--resume` would skip it): the chat fails, into the errors
    file, and `--resume` retries it. It is not retried within the run: greedy decoding
    answers the same prompt the same way again, and a server that sends no content (a chat
    template or reasoning-parser problem) keeps doing so, so retries would only spend backoff."""
    if turn.text.strip():
        return None
    return f"empty answer (finish_reason {turn.finish_reason}), nothing to train on"


def reason_kind(reason: str) -> str:
    """A failure reason's head, for the summary's counts: without the "turn N: " it happened
    on, so failures of one kind on different turns count together."""
    return re.sub(r"^turn \d+: ", "", reason).split(":")[0][:80]


def split_at_stop(tokens: list[int], stop_ids: set[int]) -> tuple[list[int], str, int]:
    """Generated tokens -> (answer tokens without the end-of-turn token, finish reason, count).
    Tokens after the first stop token are padding `generate` added for finished rows."""
    for i, t in enumerate(tokens):
        if t in stop_ids:
            return tokens[:i], "stop", i + 1
    return tokens, "length", len(tokens)


def length_batches(items: list[Any], key: Callable[[Any], int], batch_size: int) -> list[list[Any]]:
    """Sort by `key` (prompt length) and cut into batches: little padding per batch."""
    ordered = sorted(items, key=key)
    return [ordered[i : i + batch_size] for i in range(0, len(ordered), batch_size)]


def regen_record(conv: Conversation, meta: dict[str, Any]) -> dict[str, Any]:
    return {"id": conv.id, "messages": conv.messages, "regen": {**meta, "finish_reasons": conv.finish_reasons}}


def iter_conversations(
    data: str, stats: ReadStats, num_samples: int | None, skip: int, max_turns: int | None = None
) -> Iterator[Conversation]:
    """The usable chats of `data`, like `eaglet prepare` selects them: records after `skip`,
    at most `num_samples` usable ones. A repeated id gets a `#n` suffix, because resume keys
    on ids and a duplicate must not pass for done; the suffix is one no earlier chat has (a
    record may itself be named `x#2`), so the ids depend on the records' order alone."""
    seen: Counter = Counter()
    given: set[str] = set()
    usable = 0
    for n, (sample_id, record) in enumerate(iter_records(data, stats)):
        if n < skip:
            continue
        if num_samples is not None and usable >= num_samples:
            return
        messages = to_messages(record, stats)
        if isinstance(messages, str):
            stats.skip(messages)
            continue
        if max_turns is not None:  # keep the chat up to its max_turns-th assistant answer
            answers = assistant_indices(messages)
            if len(answers) > max_turns:
                messages = messages[: answers[max_turns - 1] + 1]
        usable += 1
        cid = sample_id
        while cid in given:
            seen[sample_id] += 1
            cid = f"{sample_id}#{seen[sample_id] + 1}"
        given.add(cid)
        yield Conversation(cid, messages)
