"""Engines eaglet runs as child processes (llama-server, vLLM): started in their own session so a
Ctrl-C reaches eaglet alone, killed with eaglet however it dies, and always stopped."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess

STOP_GRACE_S = 10.0
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent() -> None:
    """Run in the child before exec: the kernel sends it SIGTERM when the process that started it
    dies, however it dies (a SIGKILL leaves no `finally` to stop it)."""
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def stop(process: subprocess.Popen, grace: float = STOP_GRACE_S) -> None:
    """SIGTERM to the child's process group, SIGKILL after `grace` seconds: nothing is left running
    (an engine's own children included)."""
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


def log_tail(path: os.PathLike | str, chars: int = 2000) -> str:
    """The last `chars` characters of a child's log ("" when it cannot be read)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - chars))
            return f.read().decode(errors="replace")
    except OSError:
        return ""
