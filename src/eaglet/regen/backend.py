"""What a regen backend is: the settings it answers with, and the one method the stage calls."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from eaglet.placement import Placement
from eaglet.regen.conversations import Conversation
from eaglet.regen.run import Run
from eaglet.vllm_engine import EngineOptions


@dataclass(frozen=True)
class Settings:
    """How answers are made: the regen options a backend reads (each backend its own part)."""

    out: Path  # the output file (a server's logs go beside it)
    target: str | None
    temperature: float
    top_p: float
    max_new_tokens: int
    max_prompt_tokens: int | None
    seed: int
    concurrency: int  # openai: conversations in flight; llama.cpp: the server's slots
    batch_size: int  # local
    dtype: str  # local
    device: str | None  # local
    placed: Placement | None  # local: the target across devices
    base_url: str | None  # openai
    model: str | None  # openai
    api_key: str | None  # openai
    max_retries: int  # openai
    timeout: float  # openai
    backoff: float  # openai
    target_gguf: str | None  # llama.cpp
    threads: int | None  # llama.cpp
    engine_f32: bool  # llama.cpp
    vllm: EngineOptions | None = None  # vllm: the engine's options (parallelism, memory, any vllm.LLM keyword)


class Backend(Protocol):
    """One way to answer turns. Made from the settings (the target loaded, the endpoint found,
    before any output is touched), then run over the conversations still to do."""

    meta: dict[str, Any]  # what every output line records about how its answers were made

    def run(self, convs: Iterator[Conversation], run: Run, resources: contextlib.ExitStack) -> None:
        """Regenerate `convs`, reporting each through `run`; what must be stopped at the end (a
        server) goes on `resources`."""
