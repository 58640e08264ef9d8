"""The prompt sets `eaglet eval` decodes: MT-bench, HumanEval and held-out ShareGPT from the
embedded wheels, or any JSONL of prompts."""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from eaglet import embedded
from eaglet.chat import Message, ReadStats, iter_records, to_messages
from eaglet.options import EMBEDDED_SHAREGPT, PROMPT_SETS

# The embedded ShareGPT's first records feed `eaglet prepare` / `eaglet regen` by default; the
# held-out prompts come from far behind them.
SHAREGPT_HELDOUT_START = 15_000  # of the 17,671 complete records the embedded file holds


@dataclass
class Prompt:
    """A conversation to continue: fixed `context` messages, then each user turn in `turns`
    is answered in order (the next turn sees the target's greedy answer to the previous one)."""

    set_name: str
    id: str
    turns: list[str]
    context: list[Message] = field(default_factory=list)


def mtbench_prompts(both_turns: bool) -> Iterator[Prompt]:
    name = "mtbench-2turn" if both_turns else "mtbench"
    with open(embedded.mtbench_questions()) as f:
        for line in f:
            q = json.loads(line)
            turns = q["turns"] if both_turns else q["turns"][:1]
            yield Prompt(name, str(q["question_id"]), list(turns))


def humaneval_prompts() -> Iterator[Prompt]:
    with gzip.open(embedded.humaneval_problems(), "rt") as f:
        for line in f:
            p = json.loads(line)
            yield Prompt("humaneval", p["task_id"], [p["prompt"]])


def sharegpt_prompts(start: int = SHAREGPT_HELDOUT_START) -> Iterator[Prompt]:
    """First user turns of embedded ShareGPT chats from `start` on (held out from training)."""
    stats = ReadStats()
    for n, (sid, record) in enumerate(iter_records(EMBEDDED_SHAREGPT, stats)):
        if n < start:
            continue
        messages = to_messages(record, stats)
        if isinstance(messages, str):
            continue
        first_user = next(m for m in messages if m["role"] == "user")
        yield Prompt("sharegpt", sid, [first_user["content"]])


PROMPT_ROLES = ("system", "user", "assistant")


def refuse_non_text(value: Any, where: str) -> None:
    """JSON's \\ud800 escapes decode to lone surrogates, which no tokenizer takes (a raw TypeError
    deep in it): a string that is not text is refused with its line."""
    pending = [value]  # a stack, not recursion: a record may nest as deep as JSON reads
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(
                    f"{where}: {item[max(0, e.start - 20) : e.end + 20]!r} holds a lone surrogate "
                    f"({item[e.start]!r}), which is no text; fix the line"
                ) from None
        elif isinstance(item, dict):
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)


def jsonl_prompts(path: Path) -> Iterator[Prompt]:
    """Any JSONL: one prompt per line, `{"prompt": str}`, `{"turns": [str, ...]}` or
    `{"messages": [...]}` ending with a user message; optional `"id"`."""
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, 1):
            where = f"{path}:{line_no}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{where}: not UTF-8 ({e})") from None
            if line_no == 1:
                line = line.removeprefix("\ufeff")  # a UTF-8 BOM, as many editors start a file with
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except (ValueError, RecursionError) as e:
                # ValueError: bad JSON or an integer of over 4,300 digits; RecursionError: nested too deep
                raise ValueError(f"{where}: invalid JSON ({e})") from None
            pid = str(rec.get("id", line_no)) if isinstance(rec, dict) else str(line_no)
            refuse_non_text(rec, where)
            if isinstance(rec, dict) and isinstance(rec.get("prompt"), str):
                if not rec["prompt"].strip():  # as an empty turn: nothing to answer
                    raise ValueError(f"{where}: field 'prompt' is empty")
                yield Prompt(path.stem, pid, [rec["prompt"]])
            elif isinstance(rec, dict) and isinstance(rec.get("turns"), list) and rec["turns"]:
                if not all(isinstance(t, str) and t.strip() for t in rec["turns"]):
                    raise ValueError(f"{where}: field 'turns': every turn is a non-empty string")
                yield Prompt(path.stem, pid, list(rec["turns"]))
            elif isinstance(rec, dict) and isinstance(rec.get("messages"), list) and rec["messages"]:
                msgs = rec["messages"]
                if not all(
                    isinstance(m, dict) and m.get("role") in PROMPT_ROLES and isinstance(m.get("content"), str)
                    for m in msgs
                ):
                    raise ValueError(
                        f"{where}: field 'messages': every message needs a 'role' ({', '.join(PROMPT_ROLES)}) "
                        "and a 'content' string"
                    )
                if msgs[-1]["role"] != "user" or not msgs[-1]["content"].strip():
                    raise ValueError(
                        f"{where}: field 'messages': the last message must be the user's, and not "
                        f"empty; got {msgs[-1]['role']!r} {msgs[-1]['content'][:40]!r}"
                    )
                yield Prompt(path.stem, pid, [msgs[-1]["content"]], [dict(m) for m in msgs[:-1]])
            else:
                raise ValueError(f"{where}: expected a 'prompt' string, a 'turns' list or a 'messages' list")


def load_prompt_set(spec: str, limit: int | None) -> list[Prompt]:
    """`mtbench`, `mtbench-2turn`, `humaneval`, `sharegpt`, or a path to a JSONL of prompts."""
    if spec in ("mtbench", "mtbench-2turn"):
        source: Iterator[Prompt] = mtbench_prompts(spec == "mtbench-2turn")
    elif spec == "humaneval":
        source = humaneval_prompts()
    elif spec == "sharegpt":
        source = sharegpt_prompts()
    elif Path(spec).is_file():
        source = jsonl_prompts(Path(spec))
    else:
        raise ValueError(f"--prompts {spec!r}: not one of {', '.join(PROMPT_SETS)} and not a file")
    out: list[Prompt] = []
    for p in source:
        if limit is not None and len(out) >= limit:
            break
        out.append(p)
    if not out:
        where = f" after record {SHAREGPT_HELDOUT_START} of the embedded ShareGPT" if spec == "sharegpt" else ""
        raise ValueError(f"--prompts {spec!r}: no usable prompts{where}")
    return out
