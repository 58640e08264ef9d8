"""Shared fixtures: a tiny random-weight Llama with a real BPE tokenizer (seconds), and the
embedded SmolLM2 cached once per test session (about 30 s) for the end-to-end tests."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from eaglet.target import FAST_BF16_ENV
from eaglet.training.config import COMPILE_ENV
from eaglet.options import ExtractOptions, PrepareOptions, RegenOptions, TrainOptions

# `--dtype auto` (and train's bf16 default) follow the CPU: bf16 on one with AMX / AVX512-BF16,
# fp32 elsewhere. No test may depend on the machine: the suite runs the fp32 path of `auto` by
# default, in this process and in every subprocess it starts; tests of the bf16 path ask for it
# with the `auto_is_bf16` fixture.
os.environ[FAST_BF16_ENV] = "0"
os.environ[COMPILE_ENV] = "0"  # packed runs train eager unless a test asks for --compile

CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Speculative decoding drafts tokens with a small model and verifies them with the target.",
    "Hello! How can I help you today? Here is a short answer with numbers 1, 2 and 3.",
    "def add(a, b):\n    return a + b\n",
    "A user asks a question and the assistant answers it politely and precisely.",
]

CHATS = [
    [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "Hello! How can I help you today?"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Add two numbers in Python."},
        {"role": "assistant", "content": "def add(a, b):\n    return a + b"},
        {"role": "user", "content": "Thanks"},
        {"role": "assistant", "content": "You are welcome."},
    ],
    [
        {"role": "user", "content": "What does the fox do?"},
        {"role": "assistant", "content": "The quick brown fox jumps over the lazy dog."},
    ],
]


def make_tiny_tokenizer(folder: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token="<|im_start|>"
    )
    fast.chat_template = CHATML_TEMPLATE
    fast.save_pretrained(folder)
    return fast


def make_tiny_llama(folder: Path, vocab_size: int, num_layers: int = 8, seed: int = 0) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder)


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory) -> Path:
    """A folder with a random 8-layer Llama (hidden 64) and a trained 400-token BPE ChatML tokenizer."""
    folder = tmp_path_factory.mktemp("tiny_target")
    tok = make_tiny_tokenizer(folder)
    make_tiny_llama(folder, len(tok))
    return folder


@pytest.fixture
def auto_is_bf16(monkeypatch):
    """`auto` resolves as on a CPU with bf16 matrix units (emulated, and slow, on one without)."""
    monkeypatch.setenv(FAST_BF16_ENV, "1")


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture
def chats_jsonl(tmp_path) -> Path:
    """OpenAI-style chats, repeated with variations so batches mix lengths."""
    records = []
    for n in range(12):
        chat = [dict(m) for m in CHATS[n % len(CHATS)]]
        chat[-1]["content"] = chat[-1]["content"] + " " + " ".join(["More words."] * (n % 5))
        records.append({"id": f"chat{n}", "messages": chat})
    return write_jsonl(tmp_path / "chats.jsonl", records)


@pytest.fixture(scope="session")
def eaglet_home(tmp_path_factory):
    """A private EAGLET_HOME for the session; SmolLM2 is cached into it on first use."""
    home = tmp_path_factory.mktemp("eaglet_home")
    mp = pytest.MonkeyPatch()
    mp.setenv("EAGLET_HOME", str(home))
    yield home
    mp.undo()


@pytest.fixture(scope="session")
def smollm2_dir(eaglet_home) -> Path:
    from eaglet.target import ensure_embedded_target

    return ensure_embedded_target()


# The start of every llama-server stand-in script (an executable named by $EAGLET_LLAMA_SERVER
# that speaks llama-server's HTTP API): its --version line, its --port, and a handler base class
# whose `reply` sends JSON (or bytes of another kind). Each script goes on with `class H(Replies)`.
LLAMA_STAND_IN_PREAMBLE = """\
import json, os, sys, threading, time
from http.server import BaseHTTPRequestHandler, HTTPServer, ThreadingHTTPServer
args = sys.argv
if "--version" in args:
    sys.exit(print("version: 0 (stand-in)"))
port = int(args[args.index("--port") + 1])
class Replies(BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def reply(self, body, kind="application/json"):
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(200); self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data))); self.end_headers(); self.wfile.write(data)
"""


def llama_server_stand_in(folder: Path, script: str, monkeypatch) -> Path:
    """Install `script` (LLAMA_STAND_IN_PREAMBLE and the rest) as $EAGLET_LLAMA_SERVER."""
    body, exe = folder / "llama_stand_in.py", folder / "llama-server"
    body.write_text(script)
    exe.write_text(f'#!/bin/sh\nexec {sys.executable} {body} "$@"\n')
    exe.chmod(0o755)
    monkeypatch.setenv("EAGLET_LLAMA_SERVER", str(exe))
    return exe


# The embedded target's greedy answers to a few HumanEval prompts, and an EAGLE-3 drafter trained to
# memorise them: what the real-engine tests (llama.cpp, vLLM) serve, so that what they measure is
# the engine's handling of the drafter (its conventions), not generalisation.
MEMORISED_PROMPTS = 4
MEMORISED_TOKENS = 48


@pytest.fixture(scope="session")
def memorised_eagle3(smollm2_dir, tmp_path_factory) -> dict[str, Path]:
    from eaglet.extract import extract
    from eaglet.prepare import prepare
    from eaglet.prompts import load_prompt_set
    from eaglet.regen import regenerate
    from eaglet.training.loop import train

    root = tmp_path_factory.mktemp("memorised")
    prompts = load_prompt_set("humaneval", MEMORISED_PROMPTS)
    chats = write_jsonl(
        root / "chats.jsonl",
        [
            {"id": p.id, "messages": [{"role": "user", "content": p.turns[0]}, {"role": "assistant", "content": "-"}]}
            for p in prompts
        ],
    )  # the answer is regenerated
    eval_prompts = write_jsonl(root / "prompts.jsonl", [{"id": p.id, "prompt": p.turns[0]} for p in prompts])
    regenerate(
        RegenOptions(
            data=str(chats), out=root / "hf.jsonl", backend="local", dtype="fp32", max_new_tokens=MEMORISED_TOKENS
        ),
        progress_bar=False,
    )
    prepare(PrepareOptions(target=None, data=str(root / "hf.jsonl"), out=root / "prepared"))
    extract(ExtractOptions(prepared=root / "prepared", out=root / "data", dtype="fp32"), show_progress=False)
    train(
        TrainOptions(
            dataset_dir=root / "data",
            out_dir=root / "train",
            bf16=False,
            total_steps=60,
            lr=5e-3,
            warmup_steps=5,
            draft_vocab_size=2048,
            teacher_top_k=8,
            eval_fraction=0.0,
            evals=1,
        ),
        show_progress=False,
    )
    return {"root": root, "chats": chats, "prompts": eval_prompts, "data": root / "data", "run": root / "train"}


# Module-scoped fixtures several test modules use (a module that defines its own wins).
@pytest.fixture(scope="module")
def dataset(tiny_target, tmp_path_factory) -> Path:
    """The tiny target's hidden-state dataset of 20 chats of mixed lengths (helpers.chat_records)."""
    from eaglet.extract import extract
    from eaglet.prepare import prepare
    from helpers import chat_records

    work = tmp_path_factory.mktemp("train_data")
    records = chat_records()
    prepare(
        PrepareOptions(
            target=str(tiny_target),
            data=str(write_jsonl(work / "chats.jsonl", records)),
            out=work / "prep",
            max_length=512,
        )
    )
    extract(ExtractOptions(prepared=work / "prep", out=work / "data", target=str(tiny_target)), show_progress=False)
    return work / "data"


@pytest.fixture(scope="module")
def target(tiny_target):
    """The tiny target loaded in fp32, on one thread: this tiny model is all per-op overhead, and a
    second thread only spins (about 10x slower on a shared 2-core machine)."""
    from transformers import AutoModelForCausalLM

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    torch.set_num_threads(threads)
