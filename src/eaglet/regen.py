"""Regenerate the assistant turns of chat data with the target (`eaglet regen`).

A drafter learns to predict the target, so it should train on the target's own answers, not
on whatever model wrote the chat originally. Every assistant turn is regenerated turn by
turn: turn k is generated from the chat so far *with the regenerated answers* of turns < k,
exactly what the target would have seen serving that conversation.

Three backends:
- `local`: the target with Hugging Face `generate` (KV cache), batching the pending turns of
  many conversations by similar prompt length, left-padded;
- `openai`: any OpenAI-compatible `/chat/completions` endpoint (vLLM, SGLang), conversations
  in parallel threads, retries with exponential backoff. Standard library only;
- `llama.cpp`: llama-server on the target's GGUF, started and stopped by eaglet, with one
  parallel slot per conversation in flight (continuous batching). Prompts are rendered by the
  target's own chat template exactly as `local` renders them and sent as token ids; answers are
  decoded by the same tokenizer, so only the weights' quantization differs from `local`.

Output: one JSONL line per finished conversation, `{"id", "messages", "regen"}` (OpenAI-style
`messages`, which `eaglet prepare` reads), appended, flushed and fsynced line by line, so a
kill loses at most the conversations in flight. `--resume` skips ids already written and cuts
off a partial last line a kill left. Conversations that fail go to `OUT.errors.jsonl` (id +
reason), which each run rewrites; `--resume` retries them. An empty answer is such a failure, and
a run in which every chat fails (and OUT holds none from earlier runs) ends with an error.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import re
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from eaglet import llama_cpp, ranges
from eaglet.chat import ASSISTANT, Message, ReadStats, chat_prompt_ids, end_of_turn_ids, iter_records, stop_token_ids, to_messages
from eaglet.formats import RegenWriter, errors_path, open_output
from eaglet.placement import placement_from_options
from eaglet.target import (dtype_name, f32_target_gguf, find_target_gguf, generation_config, input_device,
                           load_target, load_tokenizer, parse_dtype, pick_device, resolve_target)

log = logging.getLogger(__name__)

BACKENDS = ("local", "openai", "llama.cpp")
RETRY_STATUS = {408, 409, 425, 429, 500, 502, 503, 504}  # worth another try; other 4xx are final


class RegenError(Exception):
    """A conversation cannot be regenerated; the message is the reason written to the errors file."""


class AllChatsFailed(RuntimeError):
    """Every chat of the run failed and OUT holds none: nothing for `eaglet prepare` to read."""


# ---------------------------------------------------------------------------------------------
# Conversations and turns (pure)
# ---------------------------------------------------------------------------------------------

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
    return messages[:assistant_indices(messages)[k]]


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
        self.messages = self.messages[:assistant_indices(self.messages)[self.done - 1] + 1]


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
    return [ordered[i:i + batch_size] for i in range(0, len(ordered), batch_size)]


# ---------------------------------------------------------------------------------------------
# Output file: one conversation per line, append-only, resumable
# ---------------------------------------------------------------------------------------------

def regen_record(conv: Conversation, meta: dict[str, Any]) -> dict[str, Any]:
    return {"id": conv.id, "messages": conv.messages, "regen": {**meta, "finish_reasons": conv.finish_reasons}}


# ---------------------------------------------------------------------------------------------
# Reading the input
# ---------------------------------------------------------------------------------------------

def iter_conversations(data: str, stats: ReadStats, num_samples: int | None, skip: int,
                       max_turns: int | None = None) -> Iterator[Conversation]:
    """The usable chats of `data`, like `eaglet prepare` selects them: records after `skip`,
    at most `num_samples` usable ones. A repeated id gets a `#n` suffix, because resume keys
    on ids and a duplicate must not pass for done."""
    seen: Counter = Counter()
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
                messages = messages[:answers[max_turns - 1] + 1]
        usable += 1
        seen[sample_id] += 1
        cid = sample_id if seen[sample_id] == 1 else f"{sample_id}#{seen[sample_id]}"
        yield Conversation(cid, messages)


# ---------------------------------------------------------------------------------------------
# Local backend: Hugging Face generate
# ---------------------------------------------------------------------------------------------

class LocalGenerator:
    """Batched generation with the target; prompts rendered by its own chat template."""

    def __init__(self, model, tokenizer, temperature: float, top_p: float, max_new_tokens: int):
        self.model, self.tokenizer = model, tokenizer
        self.device = input_device(model)
        self.stop_ids = stop_token_ids(model, tokenizer)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self.stop_ids)
        self.config = generation_config(temperature, top_p, max_new_tokens, self.pad_id, sorted(self.stop_ids))
        model.generation_config = self.config
        max_pos = getattr(model.config, "max_position_embeddings", None)
        self.max_prompt_tokens = (max_pos - max_new_tokens) if max_pos else None

    def prompt_ids(self, messages: list[Message]) -> list[int]:
        return chat_prompt_ids(self.tokenizer, messages)

    def generate(self, prompts: list[list[int]]) -> list[Turn]:
        width = max(len(p) for p in prompts)
        # Left padding: every row's last prompt token sits at the same column, where the
        # first new token is predicted; the mask (and positions derived from it) hide the pad.
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for r, p in enumerate(prompts):
            ids[r, width - len(p):] = torch.tensor(p)
            mask[r, width - len(p):] = 1
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                      generation_config=self.config)
        turns = []
        for row in out[:, width:].tolist():
            kept, reason, count = split_at_stop(row, self.stop_ids)
            turns.append(Turn(self.tokenizer.decode(kept, skip_special_tokens=True), reason, count))
        return turns


def run_local(convs: Iterator[Conversation], gen: LocalGenerator, batch_size: int, max_prompt_tokens: int | None,
              emit: Callable[[Conversation], None], fail: Callable[[Conversation, str], None],
              progress: Callable[[int], None], tick: Callable[[], None],
              out_of_time: Callable[[], bool] = lambda: False) -> None:
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
        pending: list[tuple[Conversation, list[int]]] = []
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
        pool = [conv for conv, _ in pending]
        for batch in length_batches(pending, lambda item: len(item[1]), batch_size):
            for conv, turn in zip((c for c, _ in batch), generate_or_split(gen, [ids for _, ids in batch])):
                reason = turn if isinstance(turn, str) else empty_answer(turn)
                if reason is not None:
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


def generate_or_split(gen: LocalGenerator, prompts: list[list[int]]) -> list[Turn | str]:
    """Generate a batch; when it runs out of memory, halve it, down to single prompts (whose
    failure becomes that conversation's error) instead of stopping the whole run."""
    try:
        return gen.generate(prompts)
    except torch.OutOfMemoryError:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if len(prompts) == 1:
            return [f"out of memory generating from a prompt of {len(prompts[0])} tokens"]
        half = len(prompts) // 2
        return generate_or_split(gen, prompts[:half]) + generate_or_split(gen, prompts[half:])


# ---------------------------------------------------------------------------------------------
# OpenAI-compatible endpoint backend
# ---------------------------------------------------------------------------------------------

@dataclass
class Endpoint:
    base_url: str
    model: str
    api_key: str | None = None
    timeout: float = 600.0
    max_retries: int = 5
    backoff: float = 1.0  # first retry waits about this many seconds, doubling each time
    max_backoff: float = 60.0


def url_opener(base_url: str) -> urllib.request.OpenerDirector:
    """urllib's opener, without proxies for a server on this machine: an HTTP(S)_PROXY meant
    for the internet must not swallow requests to a local vLLM."""
    host = urllib.parse.urlsplit(base_url).hostname or ""
    if host in ("localhost", "::1") or host.startswith("127."):
        return urllib.request.build_opener(urllib.request.ProxyHandler({}))
    return urllib.request.build_opener()


def backoff_delay(attempt: int, base: float, cap: float, retry_after: str | None = None) -> float:
    """Seconds to wait before retry `attempt` (0-based): the server's Retry-After when it gives
    seconds, else exponential with jitter (so parallel workers do not retry in lockstep)."""
    if retry_after:
        try:
            return min(max(float(retry_after), 0.0), cap)
        except ValueError:
            pass
    return min(cap, base * 2 ** attempt) * (0.5 + random.random() / 2)


def chat_request(ep: Endpoint, messages: list[Message], max_tokens: int, temperature: float, top_p: float
                 ) -> urllib.request.Request:
    body = {"model": ep.model, "messages": messages, "max_tokens": max_tokens, "temperature": temperature,
            "top_p": top_p}
    headers = {"Content-Type": "application/json"}
    if ep.api_key:
        headers["Authorization"] = f"Bearer {ep.api_key}"
    return urllib.request.Request(ep.base_url.rstrip("/") + "/chat/completions", data=json.dumps(body).encode(),
                                  headers=headers, method="POST")


def parse_chat_response(body: bytes) -> Turn:
    """An OpenAI chat completion -> Turn; `usage.completion_tokens` counts tokens when given,
    else the answer's whitespace-separated words stand in (only the progress bar uses it)."""
    try:
        resp = json.loads(body)
        choice = resp["choices"][0]
        # null content is an answer of nothing (all of it went to reasoning_content or tool calls):
        # empty_answer fails it, rather than retrying it like a garbled body
        text = choice["message"]["content"] or ""
    except (json.JSONDecodeError, KeyError, IndexError, TypeError) as e:
        raise ValueError(f"not a chat completion response ({type(e).__name__}: {body[:200]!r})") from e
    if not isinstance(text, str):
        raise ValueError(f"response message content is {type(text).__name__}, not a string")
    reason = choice.get("finish_reason") or "stop"
    usage = resp.get("usage") or {}
    tokens = usage.get("completion_tokens")
    return Turn(text, reason, int(tokens) if isinstance(tokens, int) else len(text.split()))


def post_with_retries(ep: Endpoint, request: urllib.request.Request, sleep: Callable[[float], None] = time.sleep
                      ) -> bytes:
    """POST; retry 429/5xx, timeouts, connection errors and garbled bodies with backoff.
    Other HTTP errors (400 context too long, 401...) will not get better: RegenError at once."""
    last = ""
    for attempt in range(ep.max_retries + 1):
        retry_after = None
        try:
            with url_opener(ep.base_url).open(request, timeout=ep.timeout) as resp:
                body = resp.read()
            parse_chat_response(body)  # a truncated or garbled body is retried like a 5xx
            return body
        except urllib.error.HTTPError as e:
            detail = e.read()[:300].decode("utf-8", "replace")
            last = f"HTTP {e.code}: {detail}"
            if e.code not in RETRY_STATUS:
                raise RegenError(last) from None
            retry_after = e.headers.get("Retry-After") if e.headers else None
        except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as e:
            reason = getattr(e, "reason", e)
            last = f"{type(e).__name__}: {reason}"
        except ValueError as e:
            last = str(e)
        if attempt < ep.max_retries:
            delay = backoff_delay(attempt, ep.backoff, ep.max_backoff, retry_after)
            log.debug("retry %d/%d in %.2f s after %s", attempt + 1, ep.max_retries, delay, last)
            sleep(delay)
    raise RegenError(f"gave up after {ep.max_retries + 1} attempts; last: {last}")


def regen_conversation_remote(ep: Endpoint, conv: Conversation, max_new_tokens: int, temperature: float,
                              top_p: float, progress: Callable[[int], None]) -> Conversation:
    """Regenerate every turn of one conversation, in order (turn k needs answer k-1)."""
    while not conv.finished:
        body = post_with_retries(ep, chat_request(ep, conv.prompt(), max_new_tokens, temperature, top_p))
        turn = parse_chat_response(body)
        empty = empty_answer(turn)
        if empty is not None:
            raise RegenError(empty)  # not retried: see empty_answer
        conv.record(turn)
        progress(turn.tokens)
    return conv


def endpoint_model(base_url: str, api_key: str | None, timeout: float) -> str:
    """The served model's name from GET /models (vLLM and SGLang serve one), for when --model is not given."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    req = urllib.request.Request(base_url.rstrip("/") + "/models", headers=headers)
    try:
        with url_opener(base_url).open(req, timeout=timeout) as resp:
            models = json.loads(resp.read())["data"]
        return str(models[0]["id"])
    except (OSError, ValueError, KeyError, IndexError, TypeError) as e:
        raise RuntimeError(f"--base-url {base_url}: could not list the served models ({e}); pass --model") from e


def run_parallel(convs: Iterator[Conversation], regen_one: Callable[[Conversation], Conversation], concurrency: int,
                 emit: Callable[[Conversation], None], fail: Callable[[Conversation, str], None],
                 tick: Callable[[], None]) -> None:
    """`regen_one` over conversations in parallel threads (a server's requests in flight); only
    this thread writes, so no file lock is needed. At most 2x `concurrency` conversations are
    read ahead, so memory stays flat. A RegenError fails its conversation; any other error
    (the server died) stops the run, as a kill would."""
    with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="regen") as pool:
        running: dict[Future, Conversation] = {}
        exhausted = False
        try:
            while True:
                while not exhausted and len(running) < 2 * concurrency:
                    conv = next(convs, None)
                    if conv is None:
                        exhausted = True
                        break
                    running[pool.submit(regen_one, conv)] = conv
                if not running:
                    return
                finished, _ = wait(running, timeout=0.5, return_when=FIRST_COMPLETED)
                tick()
                for fut in finished:
                    conv = running.pop(fut)
                    try:
                        emit(fut.result())
                    except RegenError as e:
                        fail(conv, f"turn {conv.done}: {e}")
        except BaseException:
            for fut in running:
                fut.cancel()  # queued conversations do not start; in-flight ones are lost, by design
            raise


# ---------------------------------------------------------------------------------------------
# llama.cpp backend: llama-server on the target's GGUF, prompts as token ids
# ---------------------------------------------------------------------------------------------

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


def target_limits(ref) -> tuple[Any, int | None]:
    """The target's generation config (None without one) and its positions, read without its weights."""
    from transformers import AutoConfig, GenerationConfig  # seconds to import: only the llama.cpp backend here

    try:
        generation = GenerationConfig.from_pretrained(ref.path)
    except OSError:  # no generation_config.json: the tokenizer's EOS alone
        generation = None
    return generation, getattr(AutoConfig.from_pretrained(ref.path), "max_position_embeddings", None)


# ---------------------------------------------------------------------------------------------
# The stage
# ---------------------------------------------------------------------------------------------

@dataclass
class RegenSummary:
    out: Path
    errors_file: Path
    written: int = 0
    already_done: int = 0
    failed: int = 0
    cut_short: int = 0
    out_of_time: bool = False  # stopped at --time-budget
    turns: int = 0
    tokens: int = 0
    seconds: float = 0.0
    finish_reasons: Counter = field(default_factory=Counter)
    errors: Counter = field(default_factory=Counter)  # reason head -> conversations
    first_failure: str | None = None  # "id: reason" of the first failed conversation
    stats: ReadStats = field(default_factory=ReadStats)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def lines(self) -> list[str]:
        out = [f"regenerated {self.written} conversations ({self.turns} turns, {self.tokens} tokens, "
               f"{self.tokens_per_s:.1f} tokens/s) -> {self.out}",
               f"read {self.stats.records} records; {self.already_done} already done (resume)"]
        if self.finish_reasons:
            out.append("  finish reasons: " + ", ".join(f"{k} {v}" for k, v in self.finish_reasons.most_common()))
        if self.out_of_time:
            out.append("  stopped at --time-budget: a rerun with --resume (and more time) continues")
        if self.cut_short:
            out.append(f"  cut short (a later prompt was too long, or time ran out; earlier turns kept): "
                       f"{self.cut_short}")
        for reason, n in self.stats.skipped.most_common():
            out.append(f"  skipped: {reason}: {n}")
        if self.failed:
            out.append(f"  failed: {self.failed} conversations, reasons in {self.errors_file} (--resume retries them)")
            for reason, n in self.errors.most_common(5):
                out.append(f"    {reason}: {n}")
        return out


def regenerate(data: str, out: str | os.PathLike, target: str | None = None, backend: str = "local", *,
               base_url: str | None = None, model: str | None = None, api_key: str | None = None,
               temperature: float = 0.0, top_p: float = 1.0, max_new_tokens: int = 512, batch_size: int = 16,
               concurrency: int = 8, max_retries: int = 5, timeout: float = 600.0, backoff: float = 1.0,
               resume: bool = False, num_samples: int | None = None, skip: int = 0, dtype: str = "auto",
               device: str | None = None, seed: int = 0, max_prompt_tokens: int | None = None,
               max_turns: int | None = None, time_budget: float | None = None,
               device_map: str | None = None, max_memory: str | None = None, offload_folder: str | None = None,
               target_gguf: str | os.PathLike | None = None, threads: int | None = None, engine_f32: bool = False,
               progress_bar: bool = True) -> RegenSummary:
    """Regenerate every assistant turn of the chats in `data` with the target; write `out` (JSONL).
    With `time_budget` (seconds) no new chat starts after that long. The local backend places the
    target with `device_map` (`eaglet.placement`) or on `device`; the llama.cpp backend runs
    llama-server on `target_gguf` with `concurrency` slots and `threads` threads."""
    if backend not in BACKENDS:
        raise ValueError(f"--backend {backend!r}: choose one of {', '.join(BACKENDS)}")
    placed = placement_from_options(device_map, max_memory, offload_folder, device)
    if placed is not None and backend != "local":
        raise ValueError(f"--device-map {device_map}: places the target of --backend local; the {backend} "
                         "endpoint's server places its own")
    ranges.at_least(0, temperature=temperature, skip=skip, max_retries=max_retries)
    ranges.within(0, 1, low_open=True, top_p=top_p)
    ranges.at_least(1, max_new_tokens=max_new_tokens, batch_size=batch_size, concurrency=concurrency,
                    num_samples=num_samples, max_prompt_tokens=max_prompt_tokens,
                    max_turns=max_turns, threads=threads)
    if backend != "llama.cpp" and (target_gguf is not None or threads is not None or engine_f32):
        raise ValueError(f"--target-gguf, --threads and --engine-f32 are the llama.cpp backend's (this is --backend "
                         f"{backend})")
    ranges.above(0, timeout=timeout, time_budget=time_budget)
    out = Path(out)
    done = open_output(out, resume)
    summary = RegenSummary(out, errors_path(out))

    meta: dict[str, Any] = {"backend": backend, "temperature": temperature, "top_p": top_p,
                            "max_new_tokens": max_new_tokens}
    if backend == "local":
        ref = resolve_target(target)
        tokenizer = load_tokenizer(ref)
        if not tokenizer.chat_template:
            raise ValueError(f"target {ref.name}: tokenizer has no chat template")
        torch.manual_seed(seed)
        dev = pick_device(device)
        gen = LocalGenerator(load_target(ref, parse_dtype(dtype, dev), dev, placed), tokenizer,
                             temperature, top_p, max_new_tokens)
        max_prompt_tokens = max_prompt_tokens or gen.max_prompt_tokens
        meta = {"target": ref.name, "target_revision": ref.revision, **meta,
                "dtype": dtype_name(parse_dtype(dtype, dev)),
                **({"seed": seed} if temperature > 0 else {})}
    elif backend == "llama.cpp":
        ref = resolve_target(target)
        tokenizer = load_tokenizer(ref)
        if not tokenizer.chat_template:
            raise ValueError(f"target {ref.name}: tokenizer has no chat template")
        generation, positions = target_limits(ref)
        gguf = find_target_gguf(target_gguf, ref.name, "the llama.cpp backend runs the target's GGUF")
        gguf = f32_target_gguf(gguf) if engine_f32 else gguf
        max_prompt_tokens = max_prompt_tokens or (positions - max_new_tokens if positions else None)
        server_options = {"threads": threads or os.cpu_count() or 1, "parallel": concurrency,
                          "ctx_size": (max_prompt_tokens or 4096) + max_new_tokens}
        meta = {"target": ref.name, "target_revision": ref.revision, **meta, "gguf": gguf.name,
                "server": llama_cpp.server_version(), **({"seed": seed} if temperature > 0 else {})}
    else:
        if not base_url:
            raise ValueError("--backend openai needs --base-url (e.g. http://127.0.0.1:8000/v1)")
        api_key = api_key or os.environ.get("OPENAI_API_KEY") or None
        model = model or endpoint_model(base_url, api_key, min(timeout, 30.0))
        ep = Endpoint(base_url, model, api_key, timeout, max_retries, backoff)
        meta = {"target": model, **meta, "base_url": base_url}

    stats = summary.stats
    if max_turns is not None and max_turns < 1:
        raise ValueError(f"--max-turns {max_turns}: must be at least 1")
    if time_budget is not None and time_budget <= 0:
        raise ValueError(f"--time-budget {time_budget}: must be > 0 seconds")
    selected = iter_conversations(data, stats, num_samples, skip, max_turns)
    started = time.time()

    def out_of_time() -> bool:
        summary.out_of_time = summary.out_of_time or (time_budget is not None and time.time() - started >= time_budget)
        return summary.out_of_time

    def todo() -> Iterator[Conversation]:
        for conv in selected:
            if out_of_time():
                return
            if conv.id in done:
                summary.already_done += 1
                continue
            yield conv

    total = (num_samples - len(done)) if num_samples is not None and len(done) <= num_samples else None
    bar = tqdm(total=total, desc="regen", unit="chat", file=sys.stderr, dynamic_ncols=True, disable=not progress_bar)
    lock = threading.Lock()
    t0 = time.time()

    def progress(tokens: int) -> None:  # called from worker threads (endpoint backend)
        with lock:
            summary.tokens += tokens
            summary.turns += 1

    def tick() -> None:
        bar.set_postfix_str(f"{summary.tokens / max(time.time() - t0, 1e-9):.1f} tok/s")

    errors_file = open(summary.errors_file, "w", encoding="utf-8")  # a report of this run; resume retries them
    try:
        with contextlib.ExitStack() as running, RegenWriter(out) as writer:
            def emit(conv: Conversation) -> None:
                if conv.done < conv.turns:
                    summary.cut_short += 1
                    conv.cut()
                writer.write(regen_record(conv, meta))
                summary.written += 1
                summary.finish_reasons.update(conv.finish_reasons)
                tick()
                bar.update(1)

            def fail(conv: Conversation, reason: str) -> None:
                errors_file.write(json.dumps({"id": conv.id, "reason": reason}, ensure_ascii=False) + "\n")
                errors_file.flush()
                os.fsync(errors_file.fileno())
                summary.failed += 1
                summary.errors[reason_kind(reason)] += 1
                summary.first_failure = summary.first_failure or f"{conv.id}: {' '.join(reason.split())}"

            if backend == "local":
                run_local(todo(), gen, batch_size, max_prompt_tokens, emit, fail, progress, tick, out_of_time)
            elif backend == "llama.cpp":
                server = running.enter_context(llama_cpp.llama_server(gguf, log_dir=out.with_name(out.name + ".llama-server"),
                                                                      **server_options))
                turns = LlamaCppTurns(server, tokenizer, end_of_turn_ids(tokenizer, generation), max_new_tokens,
                                      max_prompt_tokens, temperature, top_p, seed)
                t0 = time.time()  # the server's start-up is not regeneration time
                run_parallel(todo(), lambda conv: turns.regen(conv, progress), concurrency, emit, fail, tick)
            else:
                run_parallel(todo(), lambda conv: regen_conversation_remote(ep, conv, max_new_tokens, temperature,
                                                                            top_p, progress),
                             concurrency, emit, fail, tick)
    finally:
        errors_file.close()
        bar.close()
        summary.seconds = time.time() - t0
        if not summary.failed:
            summary.errors_file.unlink(missing_ok=True)  # no empty errors file to wonder about
    if summary.failed and not summary.written and not done:
        raise AllChatsFailed(f"{summary.errors_file}: all {summary.failed} chats failed and none was written to "
                             f"{out} (first: {summary.first_failure}); fix the cause, then rerun with --resume to "
                             f"retry them")
    return summary
