"""A ``lorapack serve`` process for the tests: loopback, a free port, stopped with its whole process group
(``lorapack.serve.launch.twin_process``)."""

from __future__ import annotations

import socket
from contextlib import contextmanager
from pathlib import Path

from lorapack.serve.launch import twin_process

LLAMA = "llama-3.1-8b-instruct"
START_TIMEOUT_S = 120.0  # generous: the machine may be busy (the engine's compiled code is cached)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def twin_server(*flags: str, env: dict[str, str] | None = None, log: Path | None = None):
    """Start ``lorapack serve FLAGS --port <free>`` and yield its base URL once ``/health`` answers."""
    with twin_process(flags, log=log, env=env, start_timeout_s=START_TIMEOUT_S) as url:
        yield url
