"""A ``lorapack serve`` process for the tests: loopback, a free port, stopped with its whole process group
(``lorapack.serve.launch.twin_process``)."""

from __future__ import annotations

import signal
import socket
from contextlib import contextmanager
from pathlib import Path

from lorapack.serve.launch import twin_process

LLAMA = "llama-3.1-8b-instruct"
START_TIMEOUT_S = 120.0  # generous: the machine may be busy (the engine's compiled code is cached)


def sigint_default() -> None:
    """``preexec_fn``: SIGINT back to its default in a child the test will interrupt. A non-interactive shell
    starts background jobs with SIGINT ignored (as CI may start pytest), children inherit it, and Python and
    bash keep ignoring a signal ignored at their start: the test's SIGINT would never arrive."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def twin_server(*flags: str, env: dict[str, str] | None = None, log: Path | None = None):
    """Start ``lorapack serve FLAGS --port <free>`` and yield its base URL once ``/health`` answers."""
    with twin_process(flags, log=log, env=env, start_timeout_s=START_TIMEOUT_S) as url:
        yield url
