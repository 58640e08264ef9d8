"""The vLLM side of eaglet's vLLM engine: one offline `vllm.LLM`, driven over a pipe.

Run by eaglet (`eaglet.vllm_engine`) with the Python of the venv vLLM is installed in, which may
not be eaglet's own (vLLM pins its own torch and transformers): this file imports vLLM, torch and
the standard library only, never eaglet. It talks through vLLM's public interfaces alone (`LLM`,
`SamplingParams`, `TokensPrompt`, `LLM.get_metrics`, the speculative and kv-transfer configs) and
patches nothing.

Protocol: one JSON object a line on stdin, one JSON reply a line on the file descriptor named by
--reply-fd (stdout belongs to vLLM's and its workers' logs, which go to stderr). The first request
is `start` (the engine's arguments); then `generate`, `extract`, `pass_costs` and `counters`, in
any order; `quit` (or end of input) stops the engine. A reply is {"ok": true, ...} or
{"ok": false, "error": "...", "type": "..."}; an error in one request leaves the engine running.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import sys
import time
import traceback
from typing import Any

import vllm
from vllm import SamplingParams
from vllm.inputs import TokensPrompt
from vllm.v1.metrics.reader import Counter, Vector

# What eaglet reads back of vLLM's counters (vllm/v1/metrics/reader.py names them without _total)
COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens")
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"
# vLLM's switch (vllm/envs.py) for an engine in this process rather than an engine process of its own
IN_PROCESS = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
CONNECTOR = "CpuHiddenStatesConnector"
CONNECTOR_MODULE = "eaglet_vllm_connector"


def engine_arguments(start: dict[str, Any]) -> dict[str, Any]:
    """vllm.LLM's keywords from a `start` request: the engine's own (passed through as given) plus,
    for extraction, the speculative method and the connector that write the states to disk."""
    args = dict(start["engine"])
    extract = start.get("extract")
    if extract:
        args["speculative_config"] = {
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": extract["layer_ids"]}},
        }
        args["kv_transfer_config"] = {
            "kv_connector": CONNECTOR,
            "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": extract["folder"]},
        }
    elif start.get("speculative_config"):
        args["speculative_config"] = start["speculative_config"]
    # counters (drafts, accepted per position) are read back after each request
    args["disable_log_stats"] = False
    return args


def counters(llm: Any) -> dict[str, Any]:
    """vLLM's speculative-decoding counters now: totals and accepted tokens per draft position."""
    found: dict[str, Any] = {name: 0 for name in COUNTERS}
    found[PER_POSITION] = []
    for metric in llm.get_metrics():
        if isinstance(metric, Counter) and metric.name in COUNTERS:
            found[metric.name] += int(metric.value)
        elif isinstance(metric, Vector) and metric.name == PER_POSITION:
            old = found[PER_POSITION]
            found[PER_POSITION] = [a + b for a, b in zip(metric.values, old + [0] * len(metric.values))]
    return found


def sampling(request: dict[str, Any]) -> Any:
    temperature = float(request.get("temperature", 0.0))
    return SamplingParams(
        max_tokens=int(request["max_tokens"]),
        temperature=temperature,
        top_p=float(request.get("top_p", 1.0)) if temperature > 0 else 1.0,
        seed=request.get("seed") if temperature > 0 else None,
        stop_token_ids=list(request.get("stop_token_ids", [])),
        ignore_eos=bool(request.get("ignore_eos", False)),
        detokenize=False,
    )


def prompts_of(token_lists: list[list[int]]) -> list[Any]:
    return [TokensPrompt(prompt_token_ids=list(ids)) for ids in token_lists]


def generate(llm: Any, request: dict[str, Any]) -> dict[str, Any]:
    """Continuations of token-id prompts, all submitted at once (vLLM batches them), and the wall
    time and counter increments of the whole call (one prompt a call gives them per prompt)."""
    before = counters(llm)
    t0 = time.perf_counter()
    outputs = llm.generate(prompts_of(request["prompts"]), sampling(request), use_tqdm=False)
    seconds = time.perf_counter() - t0
    after = counters(llm)
    return {
        "outputs": [
            {"token_ids": list(o.outputs[0].token_ids), "finish_reason": o.outputs[0].finish_reason} for o in outputs
        ],
        "seconds": seconds,
        "counters": difference(after, before),
    }


def difference(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    old = before[PER_POSITION]
    return {
        **{name: after[name] - before[name] for name in COUNTERS},
        PER_POSITION: [a - (old[i] if i < len(old) else 0) for i, a in enumerate(after[PER_POSITION])],
    }


def written(path: str) -> bool:
    """Whether the connector has written `path`: it holds an exclusive lock on PATH.lock until then."""
    lock = path + ".lock"
    if not os.path.exists(lock):
        return os.path.exists(path)
    with open(lock) as f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
    os.remove(lock)
    return True


def wait_written(llm: Any, paths: list[str], timeout: float = 600.0) -> None:
    """Until the connector has written every file. The connector writes a finished request's file
    at a later engine step; an engine in this process (one device, no engine process) steps only
    when asked, so it is stepped (LLMEngine.step) until then."""
    deadline = time.monotonic() + timeout
    pending = [p for p in paths if not written(p)]
    while pending:
        if time.monotonic() > deadline:
            raise RuntimeError(f"vLLM did not write {pending[0]} within {timeout:.0f} s")
        if IN_PROCESS:
            llm.llm_engine.step()
        else:
            time.sleep(0.01)
        pending = [p for p in pending if not written(p)]


def extract(llm: Any, request: dict[str, Any]) -> dict[str, Any]:
    """The hidden states of token-id prompts: one prefill each (a single generated token, which
    is not stored), written by the connector; the files' paths, in the prompts' order."""
    t0 = time.perf_counter()
    outputs = llm.generate(prompts_of(request["prompts"]), sampling({"max_tokens": 1}), use_tqdm=False)
    paths = []
    for o in outputs:
        path = (o.kv_transfer_params or {}).get("hidden_states_path")
        if not path:
            raise RuntimeError(f"vLLM returned no hidden_states_path for request {o.request_id}")
        paths.append(path)
    wait_written(llm, paths)
    return {"paths": paths, "seconds": time.perf_counter() - t0}


def timed(llm: Any, prompt: list[int], params: Any) -> float:
    t0 = time.perf_counter()
    llm.generate(prompts_of([prompt]), params, use_tqdm=False)
    return time.perf_counter() - t0


def pass_costs(llm: Any, request: dict[str, Any]) -> dict[str, Any]:
    """The engine's cost of one forward step, without a request's fixed costs (scheduling, input
    and output processing), from medians of `repeats` timed requests after a cached prefix:
    a decode step is (a request that decodes `steps` + 1 tokens - one that decodes 1) / steps;
    a step over q new tokens is that plus (a request that prefills q new tokens - one that prefills 1).
    Prefix caching keeps the prefix, so only the new tokens are computed."""
    prefix, filler, repeats = list(request["prefix"]), list(request["filler"]), int(request.get("repeats", 5))
    steps = int(request.get("steps", 16))
    one = sampling({"max_tokens": 1})
    timed(llm, prefix, one)  # the prefix into the cache

    def median(fn: Any) -> float:
        times = sorted(fn(r) for r in range(repeats))
        return times[len(times) // 2]

    def tail(r: int, q: int) -> list[int]:  # a new tail each repeat: only the prefix is ever a cache hit
        return [filler[(r * 7 + i) % len(filler)] for i in range(q)]

    many = sampling({"max_tokens": steps + 1, "ignore_eos": True})
    decode = (
        median(lambda r: timed(llm, prefix + tail(r, 1), many)) - median(lambda r: timed(llm, prefix + tail(r, 1), one))
    ) / steps
    prefill = {q: median(lambda r, q=q: timed(llm, prefix + tail(r, q), one)) for q in request["sizes"]}
    return {
        "decode_step": decode,
        "step": {str(q): decode + prefill[q] - prefill[1] for q in prefill},
        "request": {str(q): t for q, t in prefill.items()},
    }


def start_engine(request: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    t0 = time.perf_counter()
    llm = vllm.LLM(**engine_arguments(request))
    return llm, {"vllm_version": vllm.__version__, "start_seconds": time.perf_counter() - t0}


HANDLERS = {
    "generate": generate,
    "extract": extract,
    "pass_costs": pass_costs,
    "counters": lambda llm, _request: {"counters": counters(llm)},
}


def serve(reply: Any) -> None:
    """Answer requests until `quit` or the end of stdin."""
    llm = None
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        op = request.get("op")
        if op == "quit":
            break
        try:
            if op == "start":
                if llm is not None:
                    raise RuntimeError("the engine is already started")
                llm, answer = start_engine(request)
            elif op in HANDLERS:
                if llm is None:
                    raise RuntimeError(f"{op} before start")
                answer = HANDLERS[op](llm, request)
            else:
                raise ValueError(f"unknown request {op!r}")
            reply.write(json.dumps({"ok": True, **answer}) + "\n")
        except Exception as e:  # the engine stays up; eaglet raises it with the request that failed
            traceback.print_exc(file=sys.stderr)
            reply.write(json.dumps({"ok": False, "type": type(e).__name__, "error": str(e)}) + "\n")
            if llm is None:
                break  # nothing to serve without an engine
        reply.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reply-fd", type=int, required=True)
    args = parser.parse_args()
    reply = os.fdopen(args.reply_fd, "w", buffering=1)
    # Anything printed to stdout (vLLM, its engine process, torch) goes to the log on stderr.
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    serve(reply)


if __name__ == "__main__":
    main()
