"""Fixtures of the ``real`` tier: the installed testbed and a pool of vLLM servers (docs/testbed.md).

Tests that need the same server (same adapters, same flags) share one: ``servers.get(adapters, flags)``
starts it on first use and keeps it. At most ``MAX_SERVERS`` run at once (the least recently used is stopped
to make room); every server is stopped, with its whole process tree, when the session ends, and dies with
pytest if pytest is killed (``lorapack.testbed.guard``). A test that needs a server nobody else has touched
(its adapter residency, its counters) asks for ``fresh=True``.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import pytest

from lorapack.testbed.env import INSTALL_HINT, Testbed, find_testbed
from lorapack.testbed.server import CLIENT_NICE, RunningServer, raise_priority, start_server

MAX_SERVERS = 2


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


@pytest.fixture(scope="session")
def testbed() -> Testbed:
    tb = find_testbed()
    if tb is None:
        if _in_ci():
            pytest.fail(f"CI=true and the testbed is not installed: {INSTALL_HINT}")
        pytest.skip(f"testbed not installed: {INSTALL_HINT}")
    # before any server starts: the tier runs ahead of other work on the machine where it may (the servers stay
    # SERVER_NICE steps below this client; lorapack.testbed.server.CLIENT_NICE)
    nice = raise_priority()
    if nice != CLIENT_NICE:
        print(f"real tier: running at nice {nice} (raising it to {CLIENT_NICE} is not permitted here); "
              "other work on the machine can blur the timing-dependent checks")
    return tb


class ServerPool:
    def __init__(self, testbed: Testbed, log_dir: Path) -> None:
        self.testbed = testbed
        self.log_dir = log_dir
        self.running: OrderedDict[tuple, RunningServer] = OrderedDict()
        self.n_fresh = 0

    def get(self, adapters: Sequence[str], flags: Sequence[str], fresh: bool = False) -> RunningServer:
        key = (tuple(adapters), tuple(flags))
        if fresh:
            self.n_fresh += 1
            key += (f"fresh-{self.n_fresh}",)
        server = self.running.get(key)
        if server is not None and server.alive():
            self.running.move_to_end(key)
            return server
        if server is not None:
            del self.running[key]
        while len(self.running) >= MAX_SERVERS:
            _, oldest = self.running.popitem(last=False)
            oldest.stop()
        server = start_server(self.testbed, adapters, flags, self.log_dir)
        self.running[key] = server
        return server

    def release(self, server: RunningServer) -> None:
        """Stop a server now (a test that changed its state for good)."""
        for key, s in list(self.running.items()):
            if s is server:
                del self.running[key]
        server.stop()

    def stop_all(self) -> None:
        while self.running:
            _, server = self.running.popitem()
            server.stop()


@pytest.fixture(scope="session")
def servers(testbed: Testbed, tmp_path_factory: pytest.TempPathFactory):
    pool = ServerPool(testbed, tmp_path_factory.mktemp("vllm-logs"))
    try:
        yield pool
    finally:
        pool.stop_all()
