"""Chats, their records and their templates: the library every stage that reads chat data uses.

Reads ShareGPT JSON/JSONL (`conversations` with `from`/`value`), OpenAI-style JSONL
(`messages` with `role`/`content`) and the embedded ShareGPT file; renders a chat with the
target's own chat template; and marks with `loss_mask = 1` exactly the tokens the assistant
produced: everything after the template's generation prompt up to and including the
end-of-turn token, for every assistant turn.

No template is hard-coded. The assistant spans are derived from the template itself: the
rendering of the first i messages plus the generation prompt must be a prefix of the whole
chat, and the assistant's text must follow right after it. Character spans are mapped to
tokens with the fast tokenizer's offsets. A template where that does not hold fails loudly.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import ijson

from eaglet import embedded
from eaglet.options import EMBEDDED_SHAREGPT

log = logging.getLogger(__name__)


USER, ASSISTANT, SYSTEM = "user", "assistant", "system"
ROLE_ALIASES = {
    "human": USER,
    "user": USER,
    "gpt": ASSISTANT,
    "chatgpt": ASSISTANT,
    "assistant": ASSISTANT,
    "bard": ASSISTANT,
    "bing": ASSISTANT,
    "model": ASSISTANT,
    "system": SYSTEM,
    "developer": SYSTEM,  # OpenAI's newer name for the system message
}
# roles read only as a chat's first message, dropped (and counted) after it, as roles eaglet does
# not know are: a developer message mid-chat once was, and kept the chat whole
LATE_ROLES_DROPPED = ("developer",)
# A message's (role, text) keys: ShareGPT's and OpenAI's; a list may mix them, message by message
MESSAGE_KEYS = (("from", "value"), ("role", "content"))

Message = dict[str, str]
BOM = "\ufeff"
BOM_BYTES = BOM.encode("utf-8")
# OpenAI-style content parts whose text is the message's text; other parts (images, audio) are not
TEXT_PARTS = ("text", "input_text", "output_text")


class TemplateSpanError(ValueError):
    """The chat template does not let eaglet derive the assistant spans of a chat."""


# ---------------------------------------------------------------------------------------------
# Reading records
# ---------------------------------------------------------------------------------------------


class Tally(Counter):
    """Counts by reason, and where each reason first happened: the user fixes that record and
    knows what the others look like."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.first: dict[str, str] = {}  # reason -> "file:line (id ...)" or "file[index] (id ...)"

    def add(self, reason: str, where: str | None) -> None:
        self[reason] += 1
        if where:
            self.first.setdefault(reason, where)

    def lines(self, title: str) -> list[str]:
        return [
            f"{title}: {reason}: {n}" + (f" (first: {self.first[reason]})" if reason in self.first else "")
            for reason, n in self.most_common()
        ]


@dataclass
class ReadStats:
    records: int = 0
    skipped: Tally = field(default_factory=Tally)  # reason -> records skipped
    trimmed: Tally = field(default_factory=Tally)  # reason -> records cut short but kept
    dropped_roles: Tally = field(default_factory=Tally)  # unknown role -> messages dropped
    truncated_input: bool = False
    where: str | None = None  # the record being read: what a count names as its first case

    def skip(self, reason: str) -> None:
        self.skipped.add(reason, self.where)

    def trim(self, reason: str) -> None:
        self.trimmed.add(reason, self.where)


COMPRESSED = {
    "gzip": b"\x1f\x8b",
    "zstd": b"\x28\xb5\x2f\xfd",
    "bzip2": b"BZh",
    "xz": b"\xfd7zXZ\x00",
    "zip": b"PK\x03\x04",
}  # a file's first bytes

# Deeper than any chat record goes (array > record > turns > turn > content parts > part). The
# parser's prefixed events (and so ijson.items) cost memory with the square of the depth (20,000
# levels took 1 GB): records are built here from its plain events, bounded in depth, so one deep
# record in a .json array is named instead of exhausting memory with no message.
MAX_JSON_DEPTH = 64
OPENS, CLOSES = ("start_map", "start_array"), ("end_map", "end_array")


def array_records(f: BinaryIO, path: Path) -> Iterator[Any]:
    """The records of a top-level JSON array, streamed; one nested deeper than MAX_JSON_DEPTH is
    refused, named by its index."""
    depth = record = 0
    builder: ijson.common.ObjectBuilder | None = None
    for event, value in ijson.basic_parse(f, use_float=True):
        if event in OPENS:
            depth += 1
            if depth > MAX_JSON_DEPTH:
                raise ValueError(
                    f"{path}[{record}]: nested deeper than {MAX_JSON_DEPTH} levels, which no chat "
                    "record is; fix or remove that record"
                )
        elif event in CLOSES:
            depth -= 1
        if depth == 0 or (depth == 1 and event in OPENS):  # the array itself
            if depth == 0 and event not in CLOSES:
                raise ValueError(f"{path}: not a JSON array of chat records")
            continue
        if builder is None:
            builder = ijson.common.ObjectBuilder()
        builder.event(event, value)
        if depth == 1:  # the record is complete (a container closed, or a scalar record)
            yield builder.value
            builder, record = None, record + 1


def iter_json_array(path: Path, stats: ReadStats) -> Iterator[tuple[str, Any]]:
    """Stream `(where, item)` of a JSON array; a file cut off mid-record yields every complete one."""
    with open(path, "rb") as f:
        if f.read(len(BOM_BYTES)) != BOM_BYTES:  # a leading UTF-8 BOM is not JSON: read past it
            f.seek(0)
        try:
            for n, item in enumerate(array_records(f, path)):
                yield f"{path}[{n}]", item
        except ijson.IncompleteJSONError as e:
            if not array_is_closed(path):  # the file really ends early: a cut-off download or copy
                stats.truncated_input = True
                log.warning(
                    "%s is cut off mid-record: kept the %d complete records before the cut", path, stats.records
                )
                return
            # A syntax error inside a closed array: going on as if cut off would drop every
            # record after it without a word.
            detail = " ".join(str(e).split())  # the parser's message spans lines
            raise ValueError(
                f"{path}: invalid JSON after record {stats.records} (near byte {f.tell()}: {detail}); "
                f"the array is closed, so this is not a cut-off file: fix or remove that record"
            ) from e
        except ijson.JSONError as e:
            raise ValueError(f"{path}: not a JSON array of chat records ({e})") from e


def array_is_closed(path: Path) -> bool:
    """Whether the file's last non-blank byte closes the top-level array."""
    with open(path, "rb") as f:
        f.seek(max(0, path.stat().st_size - 256))
        return f.read().rstrip().endswith(b"]")


def iter_jsonl(path: Path, stats: ReadStats) -> Iterator[tuple[str, Any]]:
    """`(where, record)` of a JSONL file; a line that is not UTF-8 or not JSON is skipped and
    counted, the first of each kind named with its line number."""
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
                if line_no == 1:
                    line = line.removeprefix(BOM)  # many editors start a UTF-8 file with one
                if not line.strip():
                    continue
                record = json.loads(line)
            except (ValueError, RecursionError) as e:
                # ValueError: bad JSON, bad UTF-8, an integer of over 4,300 digits; RecursionError: JSON
                # nested deeper than Python's parser goes, no chat record
                reason = "line not UTF-8" if isinstance(e, UnicodeDecodeError) else "invalid JSON line"
                stats.records += 1
                stats.skipped.add(reason, f"{path}:{line_no}")
                if stats.skipped[reason] == 1:
                    log.warning("%s:%d: %s skipped (%s; later ones are only counted)", path, line_no, reason, e)
                continue
            yield f"{path}:{line_no}", record


def iter_records(source: str, stats: ReadStats, option: str = "--data") -> Iterator[tuple[str, Any]]:
    """Yield `(sample_id, raw record)` from `sharegpt` (embedded), a .json array or a .jsonl file;
    `stats.where` names the record yielded last (file:line, or file[index], and its id). `option`:
    the option that named the file, for messages."""
    path = embedded.sharegpt_json() if source == EMBEDDED_SHAREGPT else Path(source)
    if not path.exists():
        raise FileNotFoundError(f"{option} {source}: no such file")
    if path.is_dir():
        raise IsADirectoryError(f"{option} {source}: a folder, not a chat file (.json or .jsonl)")
    if not path.is_file():  # a FIFO or a device: read twice here (its type, then its records), so refused
        raise ValueError(f"{option} {source}: not a regular file; save the chats to a .json or .jsonl file")
    with open(path, "rb") as f:
        magic = f.read(6)
    packed = next((kind for kind, start in COMPRESSED.items() if magic.startswith(start)), None)
    if packed:
        raise ValueError(
            f"{option} {source}: a {packed} file; decompress it first (eaglet reads .json and .jsonl text)"
        )
    # by content, whatever the name: a .json of JSON lines, or a JSON array pretty-printed into a
    # .jsonl (read line by line, its records ending in commas were skipped as invalid lines)
    with open(path, "rb") as f:
        start = f.read(1 << 16)
    if start.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise ValueError(f"{option} {source}: a UTF-16 text file; save it as UTF-8 (eaglet reads UTF-8 JSON)")
    if b"\r" in start and b"\n" not in start and len(start) > start.find(b"\r") + 1:
        raise ValueError(
            f"{option} {source}: its lines end in a carriage return alone (old Mac line endings); "
            "save it with \\n line endings"
        )
    head = start.removeprefix(BOM_BYTES).lstrip()
    is_array = head.startswith(b"[")
    items = iter_json_array(path, stats) if is_array else iter_jsonl(path, stats)
    for n, (where, rec) in enumerate(items):
        stats.records += 1
        rid = rec.get("id") if isinstance(rec, dict) else None
        stats.where = where if rid is None else f"{where} (id {rid})"
        yield (str(rid) if rid is not None else f"{path.name}:{n}"), rec


def message_text(turn: dict[str, Any], key: str, stats: ReadStats) -> str | None:
    """A message's text: a string, or OpenAI's list of content parts with the text parts joined
    (other parts, e.g. images, dropped and counted per message); None when it has no text."""
    content = turn.get(key)
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        return None
    texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") in TEXT_PARTS]
    if len(texts) < len(content):
        stats.trim("non-text content parts dropped (counted per message)")
    text_parts = [t for t in texts if isinstance(t, str)]
    return "\n".join(text_parts) if text_parts else None


# Characters a chat keeps before it is tokenized, per token it may keep: far more than any
# tokenizer's tokens span (~4 characters on average), so what the token budget keeps is never cut,
# and a record of any size costs the memory of its first budget x 64 characters.
MAX_CHARS_PER_TOKEN = 64


def cut_to_chars(messages: list[Message], budget: int) -> tuple[list[Message], bool]:
    """The messages cut to `budget` characters of content (the message that crosses the budget is
    cut there, later ones are dropped), and whether anything was cut."""
    kept: list[Message] = []
    used = 0
    for m in messages:
        if used + len(m["content"]) > budget:
            if budget - used > 0:
                kept.append({"role": m["role"], "content": m["content"][: budget - used]})
            return kept, True
        kept.append(m)
        used += len(m["content"])
    return kept, False


def within_chars(
    messages: list[Message], budget: int, stats: ReadStats, max_messages: int | None = None
) -> list[Message]:
    """The chat cut to `budget` characters (and `max_messages` messages: each renders at least one
    token) before it is rendered and tokenized, so that one huge record costs memory and time by
    the tokens kept, not by its size: the message that crosses the budget is cut there, later ones
    are dropped, and the chat ends at its last assistant message."""
    head = messages if max_messages is None else messages[:max_messages]
    kept, cut = cut_to_chars(head, budget)
    if cut:
        stats.trim("text far beyond --max-length cut before tokenizing")
    elif len(head) < len(messages):
        stats.trim("messages far beyond --max-length dropped before tokenizing")
    while kept and kept[-1]["role"] != ASSISTANT:
        kept.pop()
    return kept


def to_messages(record: Any, stats: ReadStats, max_messages: int | None = None) -> list[Message] | str:
    """Normalize one record to alternating `[system?] user assistant ...` messages.

    Returns the messages, or the reason the record is skipped. Roles eaglet does not know are
    dropped and counted; a chat that stops alternating or has an empty message is cut there.
    With `max_messages`, normalizing stops one message past it (`within_chars` keeps that many
    and counts the drop): a record of a million messages costs memory by those kept.
    """
    if not isinstance(record, dict):
        return "record is not an object"
    if isinstance(record.get("conversations"), list):
        raw, keys = record["conversations"], MESSAGE_KEYS
    elif isinstance(record.get("messages"), list):
        raw, keys = record["messages"], MESSAGE_KEYS[::-1]
    else:
        return "no 'conversations' or 'messages' list"
    messages: list[Message] = []
    reasoned: list[int] = []  # the assistant messages whose reasoning_content is dropped
    for turn in raw:
        if max_messages is not None and len(messages) > max_messages:
            return messages  # within_chars keeps max_messages and ends them at an assistant message
        role_key, text_key = next((k for k in keys if isinstance(turn, dict) and k[0] in turn), keys[0])
        if not isinstance(turn, dict) or not isinstance(turn.get(role_key), str):
            return f"message without a string '{role_key}'"
        named = turn[role_key].strip().lower()
        role = ROLE_ALIASES.get(named)
        if role is None or (named in LATE_ROLES_DROPPED and messages):
            stats.dropped_roles.add(turn[role_key], stats.where)
            continue
        text = message_text(turn, text_key, stats)
        if text is None:
            if role == ASSISTANT and turn.get("tool_calls"):
                stats.trim("assistant tool-call turns skipped (counted per turn)")
                continue
            return f"message with non-string '{text_key}'"
        expected = USER if not messages or messages[-1]["role"] in (SYSTEM, ASSISTANT) else ASSISTANT
        if role == SYSTEM and not messages:
            messages.append({"role": SYSTEM, "content": text})
            continue
        if role != expected:
            if not messages or messages[-1]["role"] == SYSTEM:
                stats.trim("leading non-user messages dropped (counted per message)")
                continue
            stats.trim("roles stop alternating: cut there")
            break
        if not text.strip():
            stats.trim("empty message: cut there")
            break
        if role == ASSISTANT and turn.get("weight") == 0 and not isinstance(turn.get("weight"), bool):
            # OpenAI's fine-tuning format: not to be trained on; eaglet trains every assistant turn
            # it keeps (and `check` holds a turn left out of the mask for a fault), so the chat ends here
            stats.trim("assistant turn of weight 0: chat cut there")
            break
        if role == ASSISTANT and turn.get("reasoning_content"):
            reasoned.append(len(messages))
        messages.append({"role": role, "content": text})
    while messages and messages[-1]["role"] != ASSISTANT:
        messages.pop()
    if not any(m["role"] == ASSISTANT for m in messages):
        return "no assistant turn"
    for i in reasoned:
        if i < len(messages):  # the answer it came with is kept
            stats.trim("assistant reasoning_content dropped, the answer kept (counted per turn)")
    return messages


# ---------------------------------------------------------------------------------------------
# Template -> tokens + loss mask
# ---------------------------------------------------------------------------------------------


def render(tokenizer, messages: list[Message], add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def chat_prompt_ids(tokenizer, messages: list[Message]) -> list[int]:
    """Tokens the target answers from: the chat rendered with the generation prompt. The
    template writes BOS itself (as in `tokenize_chat`), so no special tokens are added."""
    return tokenizer(render(tokenizer, messages, add_generation_prompt=True), add_special_tokens=False)["input_ids"]


def assistant_char_spans(
    tokenizer, messages: list[Message], full: str | None = None, char_limit: int | None = None
) -> tuple[str, list[tuple[int, int]]]:
    """Render the chat (unless `full` is its rendering); return the text and, per assistant turn
    that starts within `char_limit` characters, `(start, content_end)`.

    `start` is where the generation prompt ends (the assistant's first character),
    `content_end` where its text ends; the end-of-turn token is found later, from tokens. Each
    turn renders the chat up to it again, so turns past what is kept are not looked at: a chat of
    many thousand turns would cost the square of their number.
    """
    full = render(tokenizer, messages, add_generation_prompt=False) if full is None else full
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != ASSISTANT:
            continue
        prefix = render(tokenizer, messages[:i], add_generation_prompt=True)
        if char_limit is not None and len(prefix) >= char_limit:
            break
        if not full.startswith(prefix):
            raise TemplateSpanError(
                f"chat template: the rendering of the first {i} messages plus the generation prompt is not "
                f"a prefix of the whole chat, so assistant turn {i} cannot be located "
                f"(prefix ends {prefix[-60:]!r}; chat there reads {full[max(0, len(prefix) - 60) : len(prefix)]!r})"
            )
        start = len(prefix)
        text = m["content"].strip()  # many templates trim; whitespace kept by others lies inside the span
        pos = full.find(text, start)
        if pos < 0 or full[start:pos].strip():
            raise TemplateSpanError(
                f"chat template: assistant turn {i}'s text does not follow its generation prompt "
                f"(after the prompt the chat reads {full[start : start + 80]!r})"
            )
        spans.append((start, pos + len(text)))
    return full, spans


def special_token_ids(tokenizer) -> set[int]:
    ids = set(tokenizer.all_special_ids)
    ids.update(i for i, t in tokenizer.added_tokens_decoder.items() if t.special)
    return ids


def tokenize_chat(
    tokenizer, messages: list[Message], special_ids: set[int] | None = None, max_tokens: int | None = None
) -> tuple[list[int], list[int], int]:
    """Tokens, loss mask, and the number of assistant turns that ended without an end-of-turn token;
    with `max_tokens`, the first that many, and the turns that begin in them."""
    full = render(tokenizer, messages, add_generation_prompt=False)
    # apply_chat_template(tokenize=True) tokenizes exactly this way: the template adds BOS itself.
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids: list[int] = enc["input_ids"]
    offsets: list[tuple[int, int]] = enc["offset_mapping"]
    cut = max_tokens is not None and len(ids) > max_tokens
    if cut:
        ids, offsets = ids[:max_tokens], offsets[:max_tokens]
    _, spans = assistant_char_spans(tokenizer, messages, full, (offsets[-1][1] if ids else 0) if cut else None)
    special_ids = special_token_ids(tokenizer) if special_ids is None else special_ids
    mask = [0] * len(ids)
    missing_eot = 0
    j = 0
    for start, end in spans:
        # A token that starts in the template (e.g. the prompt's "\n" merged with leading
        # spaces of the answer) is template: at inference the prompt ends before it.
        while j < len(ids) and offsets[j][0] < start:
            j += 1
        while j < len(ids) and offsets[j][0] < end:
            mask[j] = 1
            j += 1
        # End-of-turn: the first special token after the text, with only whitespace between.
        k = j
        while k < len(ids) and ids[k] not in special_ids and not full[offsets[k][0] : offsets[k][1]].strip():
            k += 1
        if k < len(ids) and ids[k] in special_ids:
            for t in range(j, k + 1):
                mask[t] = 1
            j = k + 1
        elif not (cut and k >= len(ids)):  # (a turn cut by max_tokens may have its end-of-turn past the cut)
            missing_eot += 1
    return ids, mask, missing_eot


def template_hash(tokenizer) -> str:
    return hashlib.sha256((tokenizer.chat_template or "").encode()).hexdigest()[:16]


def stop_token_ids(model, tokenizer) -> set[int]:
    """End-of-turn ids: the tokenizer's EOS and the model's generation_config EOS (chat models
    like Llama 3 end turns with a token other than the tokenizer's EOS)."""
    return end_of_turn_ids(tokenizer, getattr(model, "generation_config", None))


def end_of_turn_ids(tokenizer, config) -> set[int]:
    """`stop_token_ids` from a tokenizer and a generation config (None: the tokenizer's alone)."""
    ids: set[int] = set()
    for source in (tokenizer.eos_token_id, getattr(config, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(int(i) for i in source)
    if not ids:
        raise ValueError("the target's tokenizer and generation config name no end-of-turn (EOS) token")
    return ids
