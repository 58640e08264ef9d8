"""What a regen backend is: the settings it answers with, and the one method the stage calls."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from eaglet.options import RegenOptions
from eaglet.placement import Placement
from eaglet.regen.conversations import Conversation
from eaglet.regen.run import Run
from eaglet.vllm_engine import EngineOptions


@dataclass(frozen=True)
class Settings:
    """How answers are made: the regen options (each backend reads its own part) and what is made
    of them before any backend opens."""

    options: RegenOptions
    out: Path  # the output file (a server's logs go beside it)
    placed: Placement | None  # local: the target across devices
    vllm: EngineOptions | None  # vllm: the engine's options (parallelism, memory, any vllm.LLM keyword)
    backoff: float = 1.0  # openai: seconds before the first retry, doubled each time


class Backend(Protocol):
    """One way to answer turns. Made from the settings (the target loaded, the endpoint found,
    before any output is touched), then run over the conversations still to do."""

    meta: dict[str, Any]  # what every output line records about how its answers were made

    def run(self, convs: Iterator[Conversation], run: Run, resources: contextlib.ExitStack) -> None:
        """Regenerate `convs`, reporting each through `run`; what must be stopped at the end (a
        server) goes on `resources`."""
