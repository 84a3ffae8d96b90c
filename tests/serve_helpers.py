"""A ``lorapack serve`` process for the tests: loopback, a free port, stopped with its whole process group."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

LLAMA = "llama-3.1-8b-instruct"
START_TIMEOUT_S = 120.0  # generous: the machine may be busy (the engine's compiled code is cached)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def twin_server(*flags: str, env: dict[str, str] | None = None, log: Path | None = None):
    """Start ``lorapack serve FLAGS --port <free>`` and yield its base URL once ``/health`` answers."""
    port = free_port()
    argv = [sys.executable, "-m", "lorapack.cli", "serve", "--port", str(port), *flags]
    out = open(log, "w") if log is not None else subprocess.DEVNULL  # noqa: SIM115 - closed below
    proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT if log is not None else subprocess.DEVNULL,
                            env={**os.environ, **(env or {})}, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"lorapack serve exited with {proc.returncode}: "
                                   f"{log.read_text() if log is not None else ''}")
            try:
                if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"lorapack serve did not answer /health within {START_TIMEOUT_S} s")
            time.sleep(0.2)
        yield url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if log is not None:
            out.close()
