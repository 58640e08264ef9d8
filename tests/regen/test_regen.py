"""`eaglet regen`: the local backend against an independent greedy loop, the endpoint backend
against a stand-in OpenAI-compatible server on loopback (history, retries, errors file),
resume after a kill, and `eaglet prepare` reading the output back."""

from __future__ import annotations

import json
import re
import shutil
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from conftest import LLAMA_STAND_IN_PREAMBLE, llama_server_stand_in, write_jsonl
from helpers import target_gguf
from eaglet import regen
from eaglet.cli import main
from eaglet.formats import errors_path, read_prepared
from eaglet.prepare import prepare
from eaglet.regen import conversations
from eaglet.regen import local as regen_local
from eaglet.regen import openai as regen_openai
from eaglet.options import PrepareOptions, RegenOptions

# ---------------------------------------------------------------------------------------------
# Fixtures
# ---------------------------------------------------------------------------------------------

CHATS = [
    [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "Hi!"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Add two numbers in Python."},
        {"role": "assistant", "content": "def add(a, b): return a + b"},
        {"role": "user", "content": "Thanks"},
        {"role": "assistant", "content": "You are welcome."},
    ],
    [
        {"role": "user", "content": "What does the fox do?"},
        {"role": "assistant", "content": "It jumps."},
        {"role": "user", "content": "Over what?"},
        {"role": "assistant", "content": "The lazy dog."},
        {"role": "user", "content": "Why?"},
        {"role": "assistant", "content": "Nobody knows."},
    ],
    [
        {"role": "user", "content": "A user asks a question and the assistant answers it politely and precisely. " * 3},
        {"role": "assistant", "content": "Sure."},
    ],
]


@pytest.fixture(autouse=True)
def one_thread():
    """The tiny model's matrices are too small to split across threads; on a busy machine the
    thread hand-off costs far more than the math (seen: 60x)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def lively_target(tiny_target, tmp_path_factory) -> Path:
    """tiny_target with its matrices scaled up: the random model then answers with varied
    tokens and sometimes ends its turn, instead of repeating one token (a weak test). Its
    generation_config.json carries sampling defaults that greedy regen must ignore."""
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("lively_target")
    for f in tiny_target.iterdir():
        if f.is_file() and not f.name.startswith("model"):
            shutil.copy(f, folder / f.name)
    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(10)
    # Hub-style sampling defaults, as many checkpoints ship: regen must not let them leak in.
    model.generation_config.update(do_sample=True, temperature=0.3, top_k=3, repetition_penalty=3.0)
    model.save_pretrained(folder)
    return folder


def chats_file(path: Path, n: int, tag: str = "") -> Path:
    records = []
    for i in range(n):
        chat = [dict(m) for m in CHATS[i % len(CHATS)]]
        for m in chat:
            if m["role"] == "user":
                m["content"] = f"{m['content']} [{tag}{i}]"  # distinct prompts: the server tells chats apart
        records.append({"id": f"c{i}", "messages": chat})
    return write_jsonl(path, records)


def read_out(path: Path) -> dict[str, dict]:
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    by_id = {r["id"]: r for r in recs}
    assert len(by_id) == len(recs), "duplicate ids in the output"
    return by_id


def last_line(stderr: str) -> str:
    """The message main() ends with, after the progress bar's redraws (one line: nothing but a bar before it)."""
    lines = stderr.rstrip("\n").split("\n")
    assert all(line.startswith("regen: ") or "\r" in line for line in lines[:-1]), lines
    return lines[-1]


def answers(rec: dict) -> list[str]:
    return [m["content"] for m in rec["messages"] if m["role"] == "assistant"]


class StandIn:
    """An OpenAI-compatible chat server on 127.0.0.1 answering deterministically: the answer
    is a function of the last user message and the assistant turns in the history. Markers in
    the user message script failures: FLAKY (first try 500), BUSY (first try 429 +
    Retry-After), SLOW (first try sleeps past the client's timeout), BAD (always 400), EMPTY /
    BLANK / NULL (first try answers "", whitespace, null content)."""

    def __init__(self):
        self.requests: list[dict] = []
        self.lock = threading.Lock()
        self.tries: dict[str, int] = {}
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def reply(self, code: int, obj: dict, headers: dict | None = None) -> None:
                body = json.dumps(obj).encode()
                try:
                    self.send_response(code)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    for k, v in (headers or {}).items():
                        self.send_header(k, v)
                    self.end_headers()
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client timed out and left

            def do_GET(self):
                if self.path == "/v1/models":
                    self.reply(200, {"object": "list", "data": [{"id": "stand-in-model", "object": "model"}]})
                else:
                    self.reply(404, {"error": "no such path"})

            def do_POST(self):
                if self.path != "/v1/chat/completions":
                    return self.reply(404, {"error": "no such path"})
                req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                user = [m["content"] for m in req["messages"] if m["role"] == "user"][-1]
                with stand_in.lock:
                    stand_in.requests.append(req)
                    tries = stand_in.tries[user] = stand_in.tries.get(user, 0) + 1
                if "BAD" in user:
                    return self.reply(400, {"error": {"message": "prompt is too long"}})
                if "ALWAYS500" in user:
                    return self.reply(500, {"error": "boom"})
                if tries == 1 and "FLAKY" in user:
                    return self.reply(500, {"error": "internal"})
                if tries == 1 and "BUSY" in user:
                    return self.reply(429, {"error": "rate limited"}, {"Retry-After": "0"})
                if tries == 1 and "SLOW" in user:
                    threading.Event().wait(1.0)
                empty = {"EMPTY": "", "BLANK": " \n ", "NULL": None}
                first_try = [v for k, v in empty.items() if k in user] if tries == 1 else []
                text = first_try[0] if first_try else stand_in.answer(req["messages"])
                self.reply(
                    200,
                    {
                        "id": "x",
                        "object": "chat.completion",
                        "model": req["model"],
                        "choices": [
                            {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
                        ],
                        "usage": {
                            "prompt_tokens": 1,
                            "completion_tokens": len((text or "").split()),
                            "total_tokens": 1,
                        },
                    },
                )

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    @staticmethod
    def answer(messages: list[dict]) -> str:
        user = [m["content"] for m in messages if m["role"] == "user"][-1]
        earlier = sum(m["role"] == "assistant" for m in messages)
        return f"re: {user.upper()} #{earlier}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def stand_in():
    server = StandIn()
    yield server
    server.close()


def endpoint_regen(data: Path, out: Path, server: StandIn, **kw):
    kw = {"base_url": server.url, "concurrency": 4, "max_retries": 3, "timeout": 5.0, **kw}
    return regen.regenerate(
        RegenOptions(data=str(data), out=out, backend="openai", **kw), backoff=0.01, progress_bar=False
    )


# ---------------------------------------------------------------------------------------------
# Pure pieces
# ---------------------------------------------------------------------------------------------


def test_turn_prompts_and_stop_split():
    chat = CHATS[1]
    assert conversations.turn_prompt(chat, 0) == chat[:2]
    updated = conversations.with_answer(chat, 0, "NEW")
    assert conversations.turn_prompt(updated, 1) == [chat[0], chat[1], {"role": "assistant", "content": "NEW"}, chat[3]]
    assert conversations.split_at_stop([5, 6, 2, 0, 0], {2}) == ([5, 6], "stop", 3)
    assert conversations.split_at_stop([5, 6, 7], {2}) == ([5, 6, 7], "length", 3)
    assert errors_path(Path("a/out.jsonl")) == Path("a/out.errors.jsonl")
    assert regen_openai.backoff_delay(3, 1.0, 60.0, "2") == 2.0
    assert 4.0 <= regen_openai.backoff_delay(3, 1.0, 60.0) <= 8.0
    assert regen_openai.backoff_delay(30, 1.0, 60.0) <= 60.0


# ---------------------------------------------------------------------------------------------
# Local backend
# ---------------------------------------------------------------------------------------------


def reference_greedy(model, tokenizer, messages: list[dict], max_new: int) -> tuple[str, str]:
    """Plain greedy decoding, one prompt, no padding, no KV cache, no `generate`."""
    ids = tokenizer(
        tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), add_special_tokens=False
    )["input_ids"]
    new: list[int] = []
    with torch.no_grad():
        for _ in range(max_new):
            nxt = int(model(torch.tensor([ids + new])).logits[0, -1].argmax())
            if nxt == tokenizer.eos_token_id:
                return tokenizer.decode(new, skip_special_tokens=True), "stop"
            new.append(nxt)
    return tokenizer.decode(new, skip_special_tokens=True), "length"


def test_local_greedy_batched_equals_unbatched_and_uses_regenerated_history(lively_target, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    data = chats_file(tmp_path / "chats.jsonl", 12)
    kw = {"target": str(lively_target), "dtype": "fp32", "device": "cpu", "max_new_tokens": 12}
    one = regen.regenerate(RegenOptions(data=str(data), out=tmp_path / "b1.jsonl", batch_size=1, **kw))
    many = regen.regenerate(RegenOptions(data=str(data), out=tmp_path / "b8.jsonl", batch_size=8, **kw))
    assert one.written == many.written == 12 and one.turns == many.turns == 21
    b1, b8 = read_out(tmp_path / "b1.jsonl"), read_out(tmp_path / "b8.jsonl")
    assert b1 == b8  # left padding + attention mask change nothing in greedy fp32

    # Independent reference, turn by turn: each prompt carries the reference's own earlier answers.
    model = AutoModelForCausalLM.from_pretrained(lively_target, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(lively_target)
    reasons = set()
    for rec in b8.values():
        history = [dict(m) for m in rec["messages"]]
        for k, idx in enumerate(conversations.assistant_indices(history)):
            text, reason = reference_greedy(model, tokenizer, history[:idx], 12)
            assert history[idx]["content"] == text and rec["regen"]["finish_reasons"][k] == reason
            reasons.add(reason)
    assert reasons == {"stop", "length"}  # both ends of a turn are exercised
    assert rec["regen"]["target"] == str(lively_target) and rec["regen"]["temperature"] == 0.0
    # Regenerated, not copied: no original answer survives.
    originals = {m["content"] for chat in CHATS for m in chat if m["role"] == "assistant"}
    assert not originals & {a for r in b8.values() for a in answers(r)}


def test_local_sampling_is_seeded(lively_target, tmp_path):
    data = chats_file(tmp_path / "chats.jsonl", 4)
    kw = {
        "target": str(lively_target),
        "dtype": "fp32",
        "device": "cpu",
        "max_new_tokens": 8,
        "temperature": 0.9,
        "top_p": 0.9,
        "batch_size": 4,
    }
    regen.regenerate(RegenOptions(data=str(data), out=tmp_path / "s1.jsonl", seed=3, **kw))
    regen.regenerate(RegenOptions(data=str(data), out=tmp_path / "s2.jsonl", seed=3, **kw))
    assert read_out(tmp_path / "s1.jsonl") == read_out(tmp_path / "s2.jsonl")
    rec = next(iter(read_out(tmp_path / "s1.jsonl").values()))
    assert rec["regen"]["temperature"] == 0.9 and rec["regen"]["top_p"] == 0.9


def test_local_prompt_too_long(lively_target, tmp_path):
    """A first prompt over the limit fails (errors file); a later one keeps the turns before it."""
    data = chats_file(tmp_path / "chats.jsonl", 4)
    out = tmp_path / "out.jsonl"
    s = regen.regenerate(
        RegenOptions(
            data=str(data),
            out=out,
            target=str(lively_target),
            dtype="fp32",
            device="cpu",
            max_new_tokens=4,
            max_prompt_tokens=55,
        ),
        progress_bar=False,
    )
    recs = read_out(out)
    errors = [json.loads(line) for line in errors_path(out).read_text().splitlines()]
    assert {e["id"] for e in errors} == {"c3"} and "tokens, more than the 55 allowed" in errors[0]["reason"]
    assert s.failed == 1 and s.cut_short >= 1
    assert any(len(answers(r)) < len(conversations.assistant_indices(CHATS[int(r["id"][1:])])) for r in recs.values())


def test_local_time_budget_stops_after_the_batch_at_hand(lively_target, tmp_path):
    """Out of time after the first batch: the chats of that batch are written with the turns
    finished so far (cut short), no other chat is; regenerate() with no time left starts none."""
    from eaglet.chat import ReadStats
    from eaglet.target import load_target, load_tokenizer, resolve_target

    data = chats_file(tmp_path / "chats.jsonl", 12)
    ref = resolve_target(str(lively_target))
    gen = regen_local.LocalGenerator(
        load_target(ref, torch.float32, torch.device("cpu")), load_tokenizer(ref), 0.0, 1.0, 4
    )
    batches, written = [], []
    regen_local.run_local(
        conversations.iter_conversations(str(data), ReadStats(), None, 0, None),
        gen,
        2,
        None,
        written.append,
        lambda conv, reason: pytest.fail(reason),
        lambda tokens: None,
        lambda: batches.append(1),
        out_of_time=lambda: len(batches) >= 1,
    )
    assert len(batches) == 1 and 1 <= len(written) <= 2  # only the chats of the one batch that ran
    assert all(conv.done == 1 for conv in written)
    s = regen.regenerate(
        RegenOptions(
            data=str(data),
            out=tmp_path / "out.jsonl",
            target=str(lively_target),
            dtype="fp32",
            device="cpu",
            max_new_tokens=4,
            time_budget=1e-9,
        ),
        progress_bar=False,
    )
    assert s.out_of_time and s.written == 0 and "stopped at --time-budget" in "\n".join(s.lines())


# ---------------------------------------------------------------------------------------------
# Endpoint backend
# ---------------------------------------------------------------------------------------------


def test_endpoint_turn_by_turn_history(stand_in, tmp_path):
    data = chats_file(tmp_path / "chats.jsonl", 6)
    s = endpoint_regen(data, tmp_path / "out.jsonl", stand_in, temperature=0.5, top_p=0.8, max_new_tokens=33)
    assert s.written == 6 and s.failed == 0 and s.turns == 10
    assert s.tokens == sum(len(StandIn.answer(r["messages"]).split()) for r in stand_in.requests)
    recs = read_out(tmp_path / "out.jsonl")
    for rec in recs.values():
        msgs = rec["messages"]
        for k, idx in enumerate(conversations.assistant_indices(msgs)):
            # The request for turn k is exactly the output before it, i.e. with regenerated answers...
            sent = [r for r in stand_in.requests if r["messages"] == msgs[:idx]]
            assert len(sent) == 1, (rec["id"], k)
            # ...and the answer stored is what the server said to that request.
            assert msgs[idx]["content"] == StandIn.answer(msgs[:idx])
        assert rec["regen"] == {
            "target": "stand-in-model",
            "backend": "openai",
            "temperature": 0.5,
            "top_p": 0.8,
            "max_new_tokens": 33,
            "base_url": stand_in.url,
            "finish_reasons": ["stop"] * len(answers(rec)),
        }
    assert all(
        r["model"] == "stand-in-model" and r["max_tokens"] == 33 and r["temperature"] == 0.5 and r["top_p"] == 0.8
        for r in stand_in.requests
    )
    # Multi-turn: the second answer saw the first regenerated one (its "#1" counts it).
    assert answers(recs["c2"])[2].endswith("#2") and "#" in answers(recs["c2"])[1]


def test_endpoint_retries_and_errors_file(stand_in, tmp_path):
    records = [
        {"id": "ok", "messages": [{"role": "user", "content": "plain"}, {"role": "assistant", "content": "x"}]},
        {"id": "flaky", "messages": [{"role": "user", "content": "FLAKY one"}, {"role": "assistant", "content": "x"}]},
        {"id": "busy", "messages": [{"role": "user", "content": "BUSY one"}, {"role": "assistant", "content": "x"}]},
        {"id": "slow", "messages": [{"role": "user", "content": "SLOW one"}, {"role": "assistant", "content": "x"}]},
        {"id": "bad", "messages": [{"role": "user", "content": "BAD one"}, {"role": "assistant", "content": "x"}]},
        {
            "id": "bad2",
            "messages": [
                {"role": "user", "content": "fine first"},
                {"role": "assistant", "content": "x"},
                {"role": "user", "content": "then BAD"},
                {"role": "assistant", "content": "y"},
            ],
        },
        {"id": "down", "messages": [{"role": "user", "content": "ALWAYS500"}, {"role": "assistant", "content": "x"}]},
    ]
    data = write_jsonl(tmp_path / "chats.jsonl", records)
    out = tmp_path / "out.jsonl"
    s = endpoint_regen(data, out, stand_in, timeout=0.4, max_retries=2)
    assert set(read_out(out)) == {"ok", "flaky", "busy", "slow"}
    assert s.written == 4 and s.failed == 3
    errors = {e["id"]: e["reason"] for e in map(json.loads, errors_path(out).read_text().splitlines())}
    assert set(errors) == {"bad", "bad2", "down"}
    assert "HTTP 400" in errors["bad"] and "prompt is too long" in errors["bad"]
    assert errors["bad2"].startswith("turn 1: HTTP 400")
    assert "gave up after 3 attempts" in errors["down"] and "HTTP 500" in errors["down"]
    tries = stand_in.tries
    assert tries["FLAKY one"] == 2 and tries["BUSY one"] == 2 and tries["SLOW one"] == 2
    assert tries["BAD one"] == 1 and tries["ALWAYS500"] == 3  # a 400 is final; a 500 is retried

    # Resume retries only the failed conversations.
    n = len(stand_in.requests)
    s2 = endpoint_regen(data, out, stand_in, resume=True, max_retries=0)
    assert s2.already_done == 4 and s2.written == 0 and s2.failed == 3
    assert sorted(r["messages"][-1]["content"] for r in stand_in.requests[n:]) == [
        "ALWAYS500",
        "BAD one",
        "fine first",
        "then BAD",
    ]


def test_resume_after_kill(stand_in, tmp_path):
    data = chats_file(tmp_path / "chats.jsonl", 10)
    out = tmp_path / "out.jsonl"
    endpoint_regen(data, out, stand_in)
    lines = out.read_bytes().splitlines(keepends=True)
    assert len(lines) == 10
    # A kill mid-write: 6 complete lines and half of the 7th, without its newline.
    killed = b"".join(lines[:6]) + lines[6][: len(lines[6]) // 2]
    out.write_bytes(killed)
    kept_ids = {json.loads(line)["id"] for line in lines[:6]}

    with pytest.raises(ValueError, match="--resume"):
        endpoint_regen(data, out, stand_in)  # never overwrites
    assert out.read_bytes() == killed

    n = len(stand_in.requests)
    s = endpoint_regen(data, out, stand_in, resume=True)
    assert s.already_done == 6 and s.written == 4
    new_lines = out.read_bytes().splitlines(keepends=True)
    assert new_lines[:6] == lines[:6]  # complete lines untouched
    recs = read_out(out)  # asserts no duplicate ids
    assert set(recs) == {f"c{i}" for i in range(10)}
    redone = {
        re.search(r"\[(\d+)\]", next(m["content"] for m in r["messages"] if m["role"] == "user")).group(1)
        for r in stand_in.requests[n:]
    }
    assert redone == {k[1:] for k in set(recs) - kept_ids}  # done ids not asked again

    # A second resume has nothing to do.
    assert endpoint_regen(data, out, stand_in, resume=True).written == 0


def test_output_reads_back_with_prepare(stand_in, tiny_target, tmp_path):
    data = chats_file(tmp_path / "chats.jsonl", 5)
    out = tmp_path / "regen.jsonl"
    endpoint_regen(data, out, stand_in, num_samples=4, skip=1)
    recs = read_out(out)
    assert set(recs) == {"c1", "c2", "c3", "c4"}
    summary = prepare(PrepareOptions(target=str(tiny_target), data=str(out), out=tmp_path / "prepared"))
    assert summary.samples == 4
    samples, _ = read_prepared(tmp_path / "prepared")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_target)
    for sample in samples:
        masked = tok.decode([t for t, m in zip(sample.input_ids, sample.loss_mask) if m])
        for text in answers(recs[sample.sample_id]):
            assert text in masked


def test_cli_regen(stand_in, tmp_path, capsys):
    data = chats_file(tmp_path / "chats.jsonl", 3)
    out = tmp_path / "cli.jsonl"
    argv = [
        "regen",
        "--data",
        str(data),
        "--out",
        str(out),
        "--backend",
        "openai",
        "--base-url",
        stand_in.url,
        "--model",
        "served-name",
        "--concurrency",
        "2",
        "--max-new-tokens",
        "16",
    ]
    assert main(argv) == 0
    assert "regenerated 3 conversations" in capsys.readouterr().out
    assert {r["regen"]["target"] for r in read_out(out).values()} == {"served-name"}
    assert main(argv) == 2  # exists, no --resume: refused
    assert "--resume" in capsys.readouterr().err
    assert main(argv + ["--resume"]) == 0
    assert len(read_out(out)) == 3


def test_max_turns_keeps_the_first_answers(stand_in, tmp_path):
    data = chats_file(tmp_path / "chats.jsonl", 6)
    s = endpoint_regen(data, tmp_path / "out.jsonl", stand_in, max_turns=1)
    assert s.written == 6 and s.turns == 6
    for rec in read_out(tmp_path / "out.jsonl").values():
        assert len(conversations.assistant_indices(rec["messages"])) == 1
        assert rec["messages"][-1]["role"] == "assistant"  # later user turns are dropped with their answers
    with pytest.raises(ValueError, match="--max-turns 0"):
        endpoint_regen(data, tmp_path / "out2.jsonl", stand_in, max_turns=0)


# ---------------------------------------------------------------------------------------------
# Failures that must not pass for success
# ---------------------------------------------------------------------------------------------


def test_every_chat_failing_is_an_error(stand_in, tmp_path, capsys):
    """Nothing written and every chat failed: exit 2 with one line naming the errors file, the
    count and the first reason. (Some chats written, some failed: success, as the retries test shows.)"""
    records = [
        {"id": f"c{i}", "messages": [{"role": "user", "content": f"BAD {i}"}, {"role": "assistant", "content": "x"}]}
        for i in range(3)
    ]
    data = write_jsonl(tmp_path / "chats.jsonl", records)
    out = tmp_path / "out.jsonl"
    argv = [
        "regen",
        "--data",
        str(data),
        "--out",
        str(out),
        "--backend",
        "openai",
        "--base-url",
        stand_in.url,
        "--max-retries",
        "0",
    ]
    assert main(argv) == 2
    err = last_line(capsys.readouterr().err)
    assert err.startswith("eaglet regen: error: ")
    assert str(errors_path(out)) in err and "all 3 chats failed" in err
    assert "HTTP 400" in err and "prompt is too long" in err and "--resume" in err
    assert len(errors_path(out).read_text().splitlines()) == 3
    with pytest.raises(conversations.AllChatsFailed):  # the same on a resume, while OUT holds no chat
        endpoint_regen(data, out, stand_in, resume=True, max_retries=0)


def test_endpoint_empty_answer_fails_the_chat_and_resume_retries_it(stand_in, tmp_path):
    """An empty, whitespace-only or null answer is a failure of its chat, at once (no retry
    within the run), not a finished chat; the resume asks again and writes the answers."""

    def chat(cid: str, *users: str) -> dict:
        return {
            "id": cid,
            "messages": [
                m for u in users for m in ({"role": "user", "content": u}, {"role": "assistant", "content": "x"})
            ],
        }

    data = write_jsonl(
        tmp_path / "chats.jsonl",
        [
            chat("ok", "plain"),
            chat("empty", "EMPTY one"),
            chat("blank", "BLANK one"),
            chat("null", "NULL one"),
            chat("later", "fine first", "then EMPTY"),
        ],
    )
    out = tmp_path / "out.jsonl"
    s = endpoint_regen(data, out, stand_in)
    assert set(read_out(out)) == {"ok"} and s.written == 1 and s.failed == 4
    errors = {e["id"]: e["reason"] for e in map(json.loads, errors_path(out).read_text().splitlines())}
    assert set(errors) == {"empty", "blank", "null", "later"}
    assert all("empty answer" in r for r in errors.values()) and errors["later"].startswith("turn 1: empty answer")
    assert all(stand_in.tries[u] == 1 for u in ("EMPTY one", "BLANK one", "NULL one", "then EMPTY"))

    s2 = endpoint_regen(data, out, stand_in, resume=True)
    assert s2.already_done == 1 and s2.written == 4 and s2.failed == 0
    recs = read_out(out)
    assert set(recs) == {"ok", "empty", "blank", "null", "later"}
    assert all(a.strip() for r in recs.values() for a in answers(r))


def test_local_empty_answer_fails_the_chat(lively_target, tmp_path, monkeypatch):
    """Local: a turn whose first generated token is the stop token fails its chat (a later turn
    too: the chat is not written cut short), and the resume regenerates it."""
    records = [
        {"id": r["id"], "messages": [dict(m) for m in r["messages"]]}
        for r in map(json.loads, chats_file(tmp_path / "plain.jsonl", 4).read_text().splitlines())
    ]
    records[0]["messages"][0]["content"] += " EMPTY"  # c0: turn 0
    records[1]["messages"][3]["content"] += " EMPTY"  # c1: turn 1
    data = write_jsonl(tmp_path / "chats.jsonl", records)
    real_generate = regen_local.LocalGenerator.generate

    def generate(gen, prompts):
        # What a row that starts with the stop token becomes: split, then decoded.
        kept, reason, count = conversations.split_at_stop([min(gen.stop_ids)], gen.stop_ids)
        stopped = conversations.Turn(gen.tokenizer.decode(kept, skip_special_tokens=True), reason, count)
        turns = real_generate(gen, prompts)
        return [stopped if "EMPTY" in gen.tokenizer.decode(p) else t for p, t in zip(prompts, turns)]

    out = tmp_path / "out.jsonl"
    kw = {"dtype": "fp32", "device": "cpu", "max_new_tokens": 4}
    with monkeypatch.context() as m:
        m.setattr(regen_local.LocalGenerator, "generate", generate)
        s = regen.regenerate(RegenOptions(data=str(data), out=out, target=str(lively_target), **kw))
    assert set(read_out(out)) == {"c2", "c3"} and s.failed == 2 and s.cut_short == 0
    assert s.errors == {"empty answer (finish_reason stop), nothing to train on": 2}  # one kind, two turns
    errors = {e["id"]: e["reason"] for e in map(json.loads, errors_path(out).read_text().splitlines())}
    assert errors == {
        "c0": "turn 0: " + conversations.empty_answer(conversations.Turn("", "stop", 1)),
        "c1": "turn 1: " + conversations.empty_answer(conversations.Turn("", "stop", 1)),
    }
    s2 = regen.regenerate(RegenOptions(data=str(data), out=out, target=str(lively_target), resume=True, **kw))
    assert s2.written == 2 and set(read_out(out)) == {"c0", "c1", "c2", "c3"}


# ---------------------------------------------------------------------------------------------
# Ctrl-C: the message names what continues the stage
# ---------------------------------------------------------------------------------------------


def test_interrupt_message_names_the_command_that_resumes(stand_in, tmp_path, capsys, monkeypatch):
    from eaglet import cli

    data = chats_file(tmp_path / "chats.jsonl", 6)
    out = tmp_path / "out.jsonl"
    argv = [
        "regen",
        "--data",
        str(data),
        "--out",
        str(out),
        "--backend",
        "openai",
        "--base-url",
        stand_in.url,
        "--concurrency",
        "1",
    ]
    real = regen_openai.regen_conversation_remote

    def ctrl_c_at_c3(ep, conv, *rest):
        if conv.id == "c3":
            raise KeyboardInterrupt
        return real(ep, conv, *rest)

    with monkeypatch.context() as m:
        m.setattr(regen_openai, "regen_conversation_remote", ctrl_c_at_c3)
        assert main(argv) == 130
    assert last_line(capsys.readouterr().err) == (
        "eaglet regen: interrupted; every finished chat in --out is kept; "
        "the same command with --resume skips them and continues"
    )
    kept = set(read_out(out))
    assert kept and "c3" not in kept
    assert main(argv) == 2 and "--resume" in capsys.readouterr().err  # the plain same command is refused...
    assert main(argv + ["--resume"]) == 0  # ...the one the message names finishes the job
    assert set(read_out(out)) == {f"c{i}" for i in range(6)}

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("eaglet.training.loop.train", interrupted)
    train_argv = ["train", str(tmp_path / "data"), "--out", str(tmp_path / "run")]
    assert main(train_argv) == 130
    assert last_line(capsys.readouterr().err) == (
        "eaglet train: interrupted; checkpoints up to the last save are "
        "kept; the same command with --resume continues from the latest"
    )
    assert main(train_argv + ["--resume"]) == 130
    assert last_line(capsys.readouterr().err).endswith("; the same command continues from the latest")  # has it

    # Every stage has its own advice, one line each.
    assert set(cli.INTERRUPTED) == set(cli.stage_parsers(cli.build_parser()))
    assert all("\n" not in text for text in cli.INTERRUPTED.values())


# ---------------------------------------------------------------------------------------------
# llama.cpp backend, against a stand-in llama-server ($EAGLET_LLAMA_SERVER): the real one is
# tested in test_llama_cpp_server.py where llama.cpp is installed
# ---------------------------------------------------------------------------------------------

LLAMA_STAND_IN = (
    LLAMA_STAND_IN_PREAMBLE
    + """\
log = os.environ["STAND_IN_LOG"]
delay = float(os.environ.get("STAND_IN_DELAY", "0"))
lock = threading.Lock()
class H(Replies):
    def do_GET(self):
        self.reply({"status": "ok"})
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with lock, open(log, "a") as f:
            f.write(json.dumps({"argv": args[1:], **body}) + "\\n")
        time.sleep(delay)
        prompt = body["prompt"]
        # an answer that depends on the whole prompt; the end-of-turn token is left out of
        # `tokens` and said by stop_type only (llama.cpp includes it; regen takes either)
        answer = [10 + (sum(prompt) + 7 * i) % 40 for i in range(2 + len(prompt) % 4)]
        n = body["n_predict"]
        self.reply({"tokens": answer[:n], "stop_type": "eos" if len(answer) <= n else "limit",
                    "timings": {"prompt_n": len(prompt), "predicted_n": min(n, len(answer) + 1)}})
ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
"""
)


@pytest.fixture
def llama_stand_in(tmp_path, monkeypatch) -> Path:
    """A llama-server stand-in; returns the JSONL log of the requests it got."""
    log = tmp_path / "requests.jsonl"
    llama_server_stand_in(tmp_path, LLAMA_STAND_IN, monkeypatch)
    monkeypatch.setenv("STAND_IN_LOG", str(log))
    return log


def running_commands(part: str) -> list[str]:
    """Command lines of the running processes that contain `part` (Linux's /proc; elsewhere none)."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            line = proc.joinpath("cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # it exited while we looked
            continue
        if part in line:
            found.append(line)
    return found


def llama_regen(data: Path, out: Path, target: Path, **kw):
    gguf = target_gguf(out.parent / "target.gguf")  # a whole GGUF, as checked before the server starts
    kw = {"target": str(target), "target_gguf": gguf, "concurrency": 3, "threads": 1, "max_new_tokens": 4, **kw}
    return regen.regenerate(RegenOptions(data=str(data), out=out, backend="llama.cpp", **kw), progress_bar=False)


def test_llama_cpp_prompts_are_the_targets_template_with_regenerated_history(llama_stand_in, tiny_target, tmp_path):
    from transformers import AutoTokenizer

    from eaglet.chat import chat_prompt_ids

    data = chats_file(tmp_path / "chats.jsonl", 8)
    s = llama_regen(data, tmp_path / "out.jsonl", tiny_target)
    assert s.written == 8 and s.failed == 0 and s.turns == 14
    tokenizer = AutoTokenizer.from_pretrained(tiny_target)
    requests = [json.loads(line) for line in llama_stand_in.read_text().splitlines()]
    argv = requests[0]["argv"]
    assert argv[argv.index("--parallel") + 1] == "3" and argv[argv.index("--threads") + 1] == "1"
    asked = {tuple(r["prompt"]) for r in requests}
    reasons = set()
    for rec in read_out(tmp_path / "out.jsonl").values():
        history = [dict(m) for m in rec["messages"]]
        for k, idx in enumerate(conversations.assistant_indices(history)):
            prompt = chat_prompt_ids(tokenizer, history[:idx])  # the earlier answers are the regenerated ones
            assert tuple(prompt) in asked
            expected = [10 + (sum(prompt) + 7 * i) % 40 for i in range(2 + len(prompt) % 4)]
            reason = "stop" if len(expected) <= 4 else "length"
            assert history[idx]["content"] == tokenizer.decode(expected[:4], skip_special_tokens=True)
            assert rec["regen"]["finish_reasons"][k] == reason
            reasons.add(reason)
        assert rec["regen"]["backend"] == "llama.cpp" and rec["regen"]["gguf"] == "target.gguf"
    assert reasons == {"stop", "length"}
    assert all(r["temperature"] == 0.0 and r["top_k"] == 1 and r["n_predict"] == 4 for r in requests)


def test_llama_cpp_sampling_seeds_per_conversation_and_turn(llama_stand_in, tiny_target, tmp_path):
    data = chats_file(tmp_path / "chats.jsonl", 4)
    llama_regen(data, tmp_path / "out.jsonl", tiny_target, temperature=0.7, seed=3)
    seeds = [json.loads(line)["seed"] for line in llama_stand_in.read_text().splitlines()]
    assert len(set(seeds)) == len(seeds) == 7  # one seed per turn, none shared
    llama_stand_in.unlink()
    llama_regen(data, tmp_path / "again.jsonl", tiny_target, temperature=0.7, seed=3)
    assert sorted(json.loads(line)["seed"] for line in llama_stand_in.read_text().splitlines()) == sorted(seeds)


def test_llama_cpp_prompt_too_long_fails_turn_0_and_cuts_later_turns(llama_stand_in, tiny_target, tmp_path):
    data = chats_file(tmp_path / "chats.jsonl", 4)
    s = llama_regen(data, tmp_path / "out.jsonl", tiny_target, max_prompt_tokens=40)
    errors = [json.loads(line) for line in s.errors_file.read_text().splitlines()]
    assert errors and all("more than the 40 allowed" in e["reason"] for e in errors)
    assert s.written + s.failed == 4


def test_llama_cpp_options_belong_to_its_backend(tmp_path):
    with pytest.raises(ValueError, match="--target-gguf, --threads and --engine-f32 are the llama.cpp backend.s"):
        regen.regenerate(RegenOptions(data="x.jsonl", out=tmp_path / "o.jsonl", backend="local", threads=2))


def test_llama_cpp_kill_leaves_no_server_and_resume_loses_nothing(llama_stand_in, tiny_target, tmp_path, monkeypatch):
    """A SIGKILL of eaglet mid-run: complete lines only, no llama-server left running (it dies
    with its parent), and --resume writes what a whole run writes."""
    import os
    import signal
    import subprocess
    import time

    data = chats_file(tmp_path / "chats.jsonl", 12)
    whole = tmp_path / "whole.jsonl"
    llama_regen(data, whole, tiny_target)
    gguf = target_gguf(tmp_path / "target.gguf")
    out = tmp_path / "out.jsonl"
    argv = [
        sys.executable,
        "-m",
        "eaglet",
        "regen",
        "--data",
        str(data),
        "--out",
        str(out),
        "--backend",
        "llama.cpp",
        "--target",
        str(tiny_target),
        "--target-gguf",
        str(gguf),
        "--concurrency",
        "2",
        "--threads",
        "1",
        "--max-new-tokens",
        "4",
    ]
    llama_stand_in.unlink()
    proc = subprocess.Popen(argv, env={**os.environ, "STAND_IN_DELAY": "0.3"}, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (out.exists() and len(out.read_bytes().splitlines()) >= 3):
        time.sleep(0.1)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    time.sleep(1.0)  # the kernel's SIGTERM to the orphan, and its exit
    assert not running_commands(str(tmp_path / "llama_stand_in.py")), "a llama-server outlived the killed run"
    kept = read_out(out)  # every line complete
    assert 3 <= len(kept) < 12
    assert subprocess.run(argv + ["--resume"], capture_output=True).returncode == 0
    assert read_out(out) == read_out(whole)


def test_llama_cpp_backend_names_a_damaged_target_gguf_before_the_server_starts(chats_jsonl, tmp_path, monkeypatch):
    """A cut-off --target-gguf is named with what is wrong, nothing written, no server started
    (before, llama-server's own words and an empty output)."""
    from eaglet import embedded

    llama_server_stand_in(tmp_path, LLAMA_STAND_IN_PREAMBLE + "raise SystemExit('started')\n", monkeypatch)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(embedded.smollm2_gguf().read_bytes()[:4096])
    with pytest.raises(ValueError, match=r"cut\.gguf"):
        regen.regenerate(
            RegenOptions(data=str(chats_jsonl), out=tmp_path / "out.jsonl", backend="llama.cpp", target_gguf=cut),
            progress_bar=False,
        )
    assert not (tmp_path / "out.jsonl").exists() or not (tmp_path / "out.jsonl").read_text()


def test_the_errors_report_replaces_only_an_errors_report(stand_in, tmp_path):
    """OUT.errors.jsonl once was opened for writing whatever it was: the chats given as --data, or
    a link (its target emptied). Both are refused before anything is written; the run's own
    earlier report is replaced."""
    chats = [{"id": "a", "messages": [{"role": "user", "content": "plain"}, {"role": "assistant", "content": "x"}]}]
    data = write_jsonl(tmp_path / "q.errors.jsonl", chats)
    before = data.read_bytes()
    with pytest.raises(
        FileExistsError,
        match=r"q.errors.jsonl: regen writes its errors report here, and this file "
        "holds other records",
    ):
        endpoint_regen(data, tmp_path / "q.jsonl", stand_in)
    assert data.read_bytes() == before and not (tmp_path / "q.jsonl").exists()

    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (tmp_path / "r.errors.jsonl").symlink_to(victim)
    chats_file = write_jsonl(tmp_path / "chats.jsonl", chats)
    with pytest.raises(
        FileExistsError, match="r.errors.jsonl: regen writes its errors report here, and this is a symbolic link"
    ):
        endpoint_regen(chats_file, tmp_path / "r.jsonl", stand_in)
    assert victim.read_text() == "precious"

    report = tmp_path / "s.errors.jsonl"
    report.write_text(json.dumps({"id": "old", "reason": "HTTP 500"}) + "\n")
    endpoint_regen(chats_file, tmp_path / "s.jsonl", stand_in)
    assert not report.exists()  # replaced by this run's, which had no failure


def test_resume_appends_only_to_regens_own_lines_made_the_same_way(stand_in, tmp_path):
    """A file of the user's (records with ids, the last without its newline) once had its last
    record cut and regen lines appended; lines of another temperature were continued."""
    data = chats_file(tmp_path / "chats.jsonl", 3)
    mine = tmp_path / "mine.jsonl"
    mine.write_text('{"id": "a", "conversations": []}\n{"id": "b", "conversations": []}')
    before = mine.read_bytes()
    with pytest.raises(ValueError, match=r"mine.jsonl:1: not a regen record \(no id, messages and regen fields\)"):
        endpoint_regen(data, mine, stand_in, resume=True)
    assert mine.read_bytes() == before

    out = tmp_path / "out.jsonl"
    endpoint_regen(data, out, stand_in, num_samples=2)
    with pytest.raises(ValueError, match=r"out.jsonl:1: made with temperature 0.0, this run has 0.7"):
        endpoint_regen(data, out, stand_in, resume=True, temperature=0.7)
    assert endpoint_regen(data, out, stand_in, resume=True).written == 1  # the same options continue it


def test_repeated_ids_never_collide_with_a_record_of_that_name(tmp_path):
    """The second `same` became `same#2`, and so was a record named `same#2`: a resume counted
    one of them done and never regenerated it."""
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}]
    data = write_jsonl(
        tmp_path / "dup.jsonl", [{"id": i, "messages": chat} for i in ("same", "same", "same#2", "same")]
    )
    ids = [c.id for c in conversations.iter_conversations(str(data), conversations.ReadStats(), None, 0)]
    assert ids == ["same", "same#2", "same#2#2", "same#3"]
