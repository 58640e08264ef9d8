"""eaglet's side of its vLLM engine, without vLLM: which Python runs it, the pipe protocol and its
failures (a stand-in worker named by $EAGLET_VLLM_PYTHON), vLLM's state files read back against
their samples, the engine options, which families a vLLM version serves, and how eval wires
vLLM's methods. The real engine: tests/test_vllm_engine.py."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from eaglet import formats, vllm_engine
from eaglet.evaluate.methods import reference_labels, variants_for, with_implied_methods
from eaglet.evaluate.settings import DecodeSettings
from eaglet.evaluate.vllm_methods import speculative_config
from eaglet.extract import extract
from eaglet.options import VllmEngineOptions
from eaglet.vllm_engine import EngineOptions, VllmError, VllmMissing, engine_options_from, vllm_engine as engine_ctx
from eaglet.options import ExtractOptions, PrepareOptions

# A stand-in for the worker: speaks its protocol (one JSON request a line on stdin, replies on
# --reply-fd), answers `generate` with the prompt reversed and `extract` with random states of
# the model's width (a file per prompt, as vLLM's connector writes them), and fails as its MODE says.
STAND_IN = """\
import json, os, sys
args = sys.argv
reply = os.fdopen(int(args[args.index("--reply-fd") + 1]), "w", buffering=1)
mode = os.environ.get("STAND_IN_MODE", "ok")
served = 0
for line in sys.stdin:
    req = json.loads(line)
    if req["op"] == "quit":
        break
    if req["op"] == "start":
        print("stand-in engine starting", file=sys.stderr, flush=True)
        if mode == "die-at-start":
            print("RuntimeError: no memory for the KV cache", file=sys.stderr, flush=True)
            sys.exit(3)
        start = req
        reply.write(json.dumps({"ok": True, "vllm_version": "0.0.stand-in", "start_seconds": 0.1}) + "\\n")
    elif req["op"] == "extract":
        import torch
        from safetensors.torch import save_file
        served += 1
        if mode == "die-in-second-extract" and served == 2:
            os._exit(9)
        hidden = json.load(open(os.path.join(start["engine"]["model"], "config.json")))["hidden_size"]
        paths = []
        for n, ids in enumerate(req["prompts"]):
            path = os.path.join(start["extract"]["folder"], f"{served}-{n}.safetensors")
            save_file({"hidden_states": torch.randn(len(ids), len(start["extract"]["layer_ids"]), hidden),
                       "token_ids": torch.tensor(ids)}, path)
            paths.append(path)
        reply.write(json.dumps({"ok": True, "paths": paths, "seconds": 0.01}) + "\\n")
    elif req["op"] == "generate":
        if mode == "refuse":
            reply.write(json.dumps({"ok": False, "type": "ValueError", "error": "prompt too long"}) + "\\n")
        elif mode == "die-in-request":
            sys.exit(9)
        else:
            outs = [{"token_ids": list(reversed(p))[:req["max_tokens"]], "finish_reason": "length"}
                    for p in req["prompts"]]
            reply.write(json.dumps({"ok": True, "outputs": outs, "seconds": 0.01, "counters": {
                "vllm:spec_decode_num_drafts": 2, "vllm:spec_decode_num_accepted_tokens_per_pos": [2, 1]}}) + "\\n")
"""


@pytest.fixture
def stand_in(tmp_path, monkeypatch) -> Path:
    body, exe = tmp_path / "stand_in.py", tmp_path / "python"
    body.write_text(STAND_IN)
    exe.write_text(f'#!/bin/sh\nexec {sys.executable} {body} "$@"\n')
    exe.chmod(0o755)
    monkeypatch.setenv(vllm_engine.PYTHON_ENV, str(exe))
    return exe


def test_the_named_python_must_be_an_executable(tmp_path, monkeypatch):
    monkeypatch.setenv(vllm_engine.PYTHON_ENV, str(tmp_path / "nothing"))
    with pytest.raises(VllmMissing, match="EAGLET_VLLM_PYTHON=.*nothing: not an executable file"):
        vllm_engine.vllm_python()


def test_a_request_goes_through_and_the_engine_stops(stand_in, tmp_path):
    with engine_ctx("some/model", log_dir=tmp_path / "logs") as engine:
        done = engine.generate([[1, 2, 3], [7, 8]], max_tokens=2)
        assert engine.version == "0.0.stand-in"
        assert done.outputs == [[3, 2], [8, 7]] and done.drafts == 2 and done.accepted_per_position == [2, 1]
        process = engine.process
    assert process.poll() is not None  # stopped on the way out
    assert "stand-in engine starting" in next((tmp_path / "logs").glob("vllm-*.log")).read_text()


@pytest.mark.parametrize(
    "mode, said",
    [
        ("die-at-start", r"exited with code 3[\s\S]*no memory for the KV cache"),
        ("refuse", "vLLM refused generate: ValueError: prompt too long"),
        ("die-in-request", "exited with code 9"),
    ],
)
def test_an_engine_that_fails_is_a_clear_error_and_nothing_runs(stand_in, tmp_path, monkeypatch, mode, said):
    monkeypatch.setenv("STAND_IN_MODE", mode)
    with pytest.raises(VllmError, match=said):
        with engine_ctx("some/model", log_dir=tmp_path) as engine:
            process = engine.process
            engine.generate([[1, 2]], max_tokens=1)
    if mode != "die-at-start":
        assert process.poll() is not None


def test_engine_options_are_vllms_keywords_and_environment():
    o = engine_options_from(
        VllmEngineOptions(
            tensor_parallel_size=8,
            max_model_len=4097,
            gpu_memory_utilization=0.85,
            vllm_kv_cache_gib=3,
            vllm_args='{"max_num_seqs": 64}',
        ),
        dtype="bfloat16",
        threads=2,
    )
    kw = o.llm_keywords("m")
    assert kw["tensor_parallel_size"] == 8 and kw["max_model_len"] == 4097 and kw["max_num_seqs"] == 64
    assert kw["skip_tokenizer_init"] and kw["dtype"] == "bfloat16" and kw["gpu_memory_utilization"] == 0.85
    assert o.environment() == {"VLLM_CPU_KVCACHE_SPACE": "3", "VLLM_CPU_OMP_THREADS_BIND": "0-1"}
    assert "distributed_executor_backend" not in kw  # eight devices: vLLM's own executor
    one = EngineOptions().llm_keywords("m")
    assert "gpu_memory_utilization" not in one  # vLLM's own default
    assert one["distributed_executor_backend"] == "uni"  # one device: the engine in the worker's process
    assert EngineOptions().environment() == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    mp = engine_options_from(VllmEngineOptions(vllm_args='{"distributed_executor_backend": "mp"}'))
    assert not mp.in_process and mp.environment() == {"VLLM_CPU_KVCACHE_SPACE": "2"}


@pytest.mark.parametrize(
    "kwargs, said",
    [
        ({"tensor_parallel_size": 0}, "--tensor-parallel-size 0: must be >= 1"),
        ({"gpu_memory_utilization": 1.5}, "--gpu-memory-utilization 1.5"),
        ({"vllm_args": "{max_num_seqs: 1}"}, "--vllm-args .*not JSON"),
        ({"vllm_args": "[1]"}, "--vllm-args .*a JSON object"),
        # a recipe's vllm_args ran a model folder's code, or another model
        (
            {"vllm_args": '{"trust_remote_code": true, "model": "/x"}'},
            "--vllm-args: model, trust_remote_code are eaglet's to set",
        ),
        # ... or imported a class it named, wrote downloads or read media anywhere
        (
            {"vllm_args": '{"worker_extension_cls": "os.Evil", "download_dir": "/x", "allowed_local_media_path": "/"}'},
            "--vllm-args: allowed_local_media_path, download_dir, worker_extension_cls are eaglet's to set",
        ),
        (
            {"vllm_args": '{"scheduler_cls": "x.S", "reasoning_parser_plugin": "/x.py"}'},
            "--vllm-args: reasoning_parser_plugin, scheduler_cls are eaglet's to set",
        ),
        ({"vllm_args": '{"compilation_config": {"backend": "x.f"}}'}, "compilation_config: give its level as a number"),
        # ... or set what an option of eaglet's sets, unrecorded
        ({"vllm_args": '{"dtype": "float16"}'}, "--vllm-args: dtype: eaglet's option --dtype sets it"),
        ({"vllm_args": '{"load_format": "dummy"}'}, "--vllm-args: load_format 'dummy' runs random weights"),
    ],
)
def test_engine_options_out_of_range_are_refused(kwargs, said):
    with pytest.raises(ValueError, match=said):
        engine_options_from(VllmEngineOptions(**kwargs))


def test_which_vllm_serves_which_family():
    assert vllm_engine.serves("eagle3", "0.34.0") and vllm_engine.serves("dflash", "0.32.0+cpu")
    assert vllm_engine.serves("p-eagle", "0.33.1") and not vllm_engine.serves("p-eagle", "0.34.0")
    assert not vllm_engine.serves("p-eagle", "0.31.2")
    with pytest.raises(ValueError, match="vLLM 0.34.0 does not serve p-eagle drafters; vLLM 0.32 to 0.33.x does"):
        vllm_engine.refuse_unserved("p-eagle", "0.34.0")


def write_states(path: Path, ids: list[int], layers: int, hidden: int) -> Path:
    save_file({"hidden_states": torch.randn(len(ids), layers, hidden), "token_ids": torch.tensor(ids)}, path)
    return path


def test_vllms_file_is_checked_against_its_sample(tmp_path):
    good = write_states(tmp_path / "a.safetensors", [5, 6, 7], 4, 8)
    states = formats.read_vllm_states(good, [5, 6, 7], 4, 8, "sample x")
    assert len(states) == 4 and states[0].shape == (3, 8)
    with pytest.raises(ValueError, match=r"a.safetensors \(sample x\): vLLM's token_ids .* from position 1"):
        formats.read_vllm_states(good, [5, 9, 7], 4, 8, "sample x")
    with pytest.raises(ValueError, match=r"hidden_states are \(3, 4, 8\), expected \(3, 3, 8\)"):
        formats.read_vllm_states(good, [5, 6, 7], 3, 8, "sample x")
    (tmp_path / "torn.safetensors").write_bytes(good.read_bytes()[:100])
    with pytest.raises(ValueError, match="torn.safetensors: not a readable safetensors file"):
        formats.read_vllm_states(tmp_path / "torn.safetensors", [5, 6, 7], 4, 8, "sample x")


def test_extract_refuses_device_map_with_vllm_before_reading(tmp_path):
    with pytest.raises(ValueError, match="--device-map auto: places the target of --engine hf"):
        extract(ExtractOptions(prepared=tmp_path / "nothing", out=tmp_path / "out", engine="vllm", device_map="auto"))
    with pytest.raises(ValueError, match="--engine 'sglang'"):
        extract(ExtractOptions(prepared=tmp_path / "nothing", out=tmp_path / "out", engine="sglang"))


def test_vllm_methods_bring_their_baseline_and_eaglets_own_decoding():
    methods = with_implied_methods(["vllm-eagle3", "vllm-ngram", "vllm-p-eagle"])
    assert methods[:3] == ["p-eagle", "chain", "vllm"]
    labels = reference_labels(variants_for(methods, DecodeSettings()))
    assert labels["vllm-eagle3"] == labels["vllm-ngram"] == "vllm" and labels["vllm"] == "plain"
    assert labels["chain"] == "plain"


def test_speculative_configs_follow_eaglets_settings(tmp_path):
    s = DecodeSettings(chain_depth=3, lookup_tokens=5, max_ngram=4)
    assert speculative_config("vllm", s, None, None) is None
    assert speculative_config("vllm-ngram", s, None, None) == {
        "method": "ngram",
        "num_speculative_tokens": 5,
        "prompt_lookup_max": 4,
        "prompt_lookup_min": 1,
    }
    eagle3 = type("D", (), {"config": type("C", (), {"family": "eagle3"})()})()
    assert speculative_config("vllm-eagle3", s, tmp_path, eagle3) == {
        "method": "eagle3",
        "model": str(tmp_path),
        "num_speculative_tokens": 3,
    }
    p = type("D", (), {"config": type("C", (), {"family": "p-eagle", "block_size": 8})()})()
    assert speculative_config("vllm-p-eagle", s, tmp_path, p)["parallel_drafting"] is True
    d = type("D", (), {"config": type("C", (), {"family": "dflash", "block_size": 16})()})()
    assert speculative_config("vllm-dflash", s, tmp_path, d) == {
        "method": "dflash",
        "model": str(tmp_path),
        "num_speculative_tokens": 15,
    }


def test_the_worker_imports_nothing_of_eaglets():
    """It runs in vLLM's venv, where eaglet's pins (and eaglet itself) may be missing."""
    folder = Path(vllm_engine.WORKER_DIR)
    for path in folder.glob("*.py"):
        assert "eaglet." not in "".join(
            line for line in path.read_text().splitlines(True) if line.startswith(("import", "from"))
        ), path
    assert (folder / f"{vllm_engine.WORKER_MODULE}.py").is_file() and os.access(folder, os.R_OK)


def test_an_engine_that_dies_mid_extraction_leaves_complete_files_and_a_rerun_finishes(
    stand_in, tiny_target, chats_jsonl, tmp_path, monkeypatch
):
    """The engine killed after its first batch: the error names it, every file written is whole,
    the engine's scratch folder is gone, and the rerun writes the rest."""
    from eaglet.prepare import prepare

    monkeypatch.setattr("eaglet.extract.engine_record", lambda: "vllm 0.0.stand-in")
    prepare(PrepareOptions(target=str(tiny_target), data=str(chats_jsonl), out=tmp_path / "prepared"))
    out = tmp_path / "data"
    monkeypatch.setenv("STAND_IN_MODE", "die-in-second-extract")
    with pytest.raises(VllmError, match="vLLM extract: the engine exited with code 9"):
        extract(
            ExtractOptions(prepared=tmp_path / "prepared", out=out, engine="vllm", batch_tokens=64, max_batch_size=4),
            show_progress=False,
        )
    first = formats.list_dataset_files(out).files
    assert 0 < len(first) < 12
    assert not [p for p in out.iterdir() if p.name.startswith(".vllm")]
    monkeypatch.setenv("STAND_IN_MODE", "ok")
    again = extract(
        ExtractOptions(prepared=tmp_path / "prepared", out=out, engine="vllm", batch_tokens=64, max_batch_size=4),
        show_progress=False,
    )
    assert again.already_done == len(first) and again.written == 12 - len(first)
    assert formats.read_data_config(out).engine == "vllm 0.0.stand-in"


def test_an_engine_missing_from_the_set_up_is_named_before_anything_is_written(
    tiny_target, chats_jsonl, tmp_path, monkeypatch
):
    from eaglet.prepare import prepare

    prepare(PrepareOptions(target=str(tiny_target), data=str(chats_jsonl), out=tmp_path / "prepared"))
    monkeypatch.setenv(vllm_engine.PYTHON_ENV, str(tmp_path / "no-python"))
    with pytest.raises(VllmMissing, match="EAGLET_VLLM_PYTHON=.*no-python: not an executable file"):
        extract(
            ExtractOptions(prepared=tmp_path / "prepared", out=tmp_path / "data", engine="vllm"), show_progress=False
        )
    assert not (tmp_path / "data").exists()
