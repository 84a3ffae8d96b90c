"""A real vLLM server started by a process that is then killed with SIGKILL leaves no process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from lorapack.testbed.guard import alive

pytestmark = pytest.mark.real



def test_kill_9_of_the_starter_stops_the_whole_vllm_tree(testbed, tmp_path):
    pids_file = tmp_path / "pids"
    code = textwrap.dedent(f"""
        from pathlib import Path
        import time
        from lorapack.testbed.env import find_testbed
        from lorapack.testbed.guard import descendants
        from lorapack.testbed.server import start_server
        s = start_server(find_testbed(), ["r8-0"], ["--max-loras", "1", "--max-lora-rank", "8",
                         "--max-model-len", "256"], Path({str(tmp_path)!r}))
        Path({str(pids_file)!r}).write_text(" ".join(map(str, [s.proc.pid] + descendants(s.proc.pid))))
        time.sleep(600)
    """)
    starter = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    try:
        deadline = time.monotonic() + 420
        while time.monotonic() < deadline and not pids_file.is_file():
            assert starter.poll() is None, "the starter died before its server was up"
            time.sleep(0.5)
        pids = [int(p) for p in pids_file.read_text().split()]
        assert len(pids) >= 3  # the guard, vllm's API server, its engine core (and the CPU worker)
        os.kill(starter.pid, signal.SIGKILL)
        starter.wait(timeout=10)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(alive(p) for p in pids):
            time.sleep(0.2)
        assert not [p for p in pids if alive(p)]
    finally:
        if starter.poll() is None:
            os.kill(starter.pid, signal.SIGKILL)
        if pids_file.is_file():
            for p in pids_file.read_text().split():
                try:
                    os.kill(int(p), signal.SIGKILL)
                except ProcessLookupError:
                    pass
