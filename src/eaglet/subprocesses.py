"""Engines eaglet runs as child processes (llama-server, vLLM): started in their own session so a
Ctrl-C reaches eaglet alone, killed with eaglet however it dies, and always stopped."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from typing import Any

STOP_GRACE_S = 10.0
PR_SET_PDEATHSIG = 1  # linux/prctl.h

# Runs first in the child, then becomes the engine (exec keeps the death signal): the kernel sends
# the engine SIGTERM when the process that started it dies, however it dies (a SIGKILL leaves no
# `finally` to stop it). A launcher, not Popen's preexec_fn: with preexec_fn Python must fork(),
# which copies eaglet's page tables and can fail with ENOMEM once eaglet holds gigabytes of
# weights; without one it vforks, whatever eaglet's size.
DIE_WITH_PARENT = f"""
import ctypes, os, signal, sys
ctypes.CDLL(None).prctl({PR_SET_PDEATHSIG}, signal.SIGTERM)
if os.getppid() != int(sys.argv[1]):  # eaglet died before the line above: nobody would stop us
    sys.exit(1)
os.execvp(sys.argv[2], sys.argv[2:])
"""


def spawn(command: list[str], **popen: Any) -> subprocess.Popen:
    """Start `command` in a session of its own (a Ctrl-C reaches eaglet alone), killed with eaglet on
    Linux; `popen` goes to subprocess.Popen."""
    if sys.platform.startswith("linux"):
        command = [sys.executable, "-I", "-S", "-c", DIE_WITH_PARENT, str(os.getpid()), *command]
    return subprocess.Popen(command, start_new_session=True, **popen)


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
