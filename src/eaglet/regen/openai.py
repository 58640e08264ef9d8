"""The openai backend: any OpenAI-compatible `/chat/completions` endpoint (vLLM, SGLang),
conversations in parallel threads, retries with exponential backoff. Standard library only."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from eaglet.chat import Message
from eaglet.regen.backend import Settings
from eaglet.regen.conversations import Conversation, RegenError, Turn, empty_answer
from eaglet.regen.run import Run, run_parallel

log = logging.getLogger(__name__)

RETRY_STATUS = {408, 409, 425, 429, 500, 502, 503, 504}  # worth another try; other 4xx are final


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
    return min(cap, base * 2**attempt) * (0.5 + random.random() / 2)


def chat_request(
    ep: Endpoint, messages: list[Message], max_tokens: int, temperature: float, top_p: float
) -> urllib.request.Request:
    body = {
        "model": ep.model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "top_p": top_p,
    }
    headers = {"Content-Type": "application/json"}
    if ep.api_key:
        headers["Authorization"] = f"Bearer {ep.api_key}"
    return urllib.request.Request(
        ep.base_url.rstrip("/") + "/chat/completions", data=json.dumps(body).encode(), headers=headers, method="POST"
    )


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


def post_with_retries(
    ep: Endpoint, request: urllib.request.Request, sleep: Callable[[float], None] = time.sleep
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


def regen_conversation_remote(
    ep: Endpoint,
    conv: Conversation,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    progress: Callable[[int], None],
) -> Conversation:
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


@dataclass
class OpenAIBackend:
    ep: Endpoint
    settings: Settings
    meta: dict[str, Any]

    @classmethod
    def open(cls, s: Settings) -> OpenAIBackend:
        if not s.options.base_url:
            raise ValueError("--backend openai needs --base-url (e.g. http://127.0.0.1:8000/v1)")
        api_key = s.options.api_key or os.environ.get("OPENAI_API_KEY") or None
        model = s.options.model or endpoint_model(s.options.base_url, api_key, min(s.options.timeout, 30.0))
        ep = Endpoint(s.options.base_url, model, api_key, s.options.timeout, s.options.max_retries, s.backoff)
        return cls(ep, s, {"target": model, "base_url": s.options.base_url})

    def run(self, convs: Iterator[Conversation], run: Run, resources: contextlib.ExitStack) -> None:
        o = self.settings.options
        # looked up when called, so a test can stand in for one conversation's requests
        run_parallel(
            convs,
            lambda conv: regen_conversation_remote(
                self.ep, conv, o.max_new_tokens, o.temperature, o.top_p, run.progress
            ),
            o.concurrency,
            run.emit,
            run.fail,
            run.tick,
        )
