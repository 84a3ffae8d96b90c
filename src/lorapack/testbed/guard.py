"""Run a command so that no process of it outlives whoever started it.

    python -m lorapack.testbed.guard [--nice=N] -- COMMAND [ARG ...]

A vLLM server is a process tree (the API server, its engine core, the engine's workers), and a test run that is
killed (``kill -9`` of pytest, a CI time-out) must not leave it behind holding a port and a core. The guard sits
between the starter and the command:

* ``PR_SET_PDEATHSIG``: the kernel sends the guard SIGTERM when its parent dies, however it dies;
* ``PR_SET_CHILD_SUBREAPER``: a grandchild whose parent exits is re-parented to the guard, not to init, so the
  guard still finds it;
* on SIGTERM / SIGINT / SIGHUP, on its parent's death, or when the command exits, the guard sends SIGTERM to
  every descendant, waits ``GRACE_S``, sends SIGKILL to those left, and exits (with the command's status when
  the command ended first).

Linux only (``prctl``); the testbed is Linux only.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
GRACE_S = 5.0


def _prctl(option: int, arg: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, arg, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({option}) failed")


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, exited but not yet reaped, counts as dead)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2:].split()[0] != "Z"


def descendants(root_pid: int) -> list[int]:
    """Every live process whose parent chain leads to ``root_pid`` (read from /proc; the root excluded)."""
    parent: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # the command name may hold spaces and parentheses: the fields after the last ')' are fixed
        fields = stat[stat.rfind(")") + 2:].split()
        parent[int(entry.name)] = int(fields[1])
    found, frontier = [], [root_pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        found += kids
        frontier += kids
    return found


def kill_tree(root_pid: int, grace_s: float = GRACE_S, include_root: bool = True) -> None:
    """SIGTERM to the tree under ``root_pid`` (and the root itself), SIGKILL after ``grace_s`` to what is left."""
    def tree() -> list[int]:
        return [p for p in descendants(root_pid) + ([root_pid] if include_root else []) if alive(p)]

    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 2.0)):
        pids = tree()
        if not pids:
            return
        for p in pids:
            try:
                os.kill(p, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and tree():
            _reap()
            time.sleep(0.05)
        _reap()


def _reap() -> None:
    """Collect exited children (the subreaper adopts orphans: they become zombies of ours until reaped)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def main(argv: list[str]) -> int:
    nice = 0
    if argv and argv[0].startswith("--nice="):
        nice = int(argv[0].split("=", 1)[1])
        argv = argv[1:]
    if not argv or argv[0] != "--" or len(argv) < 2:
        print("usage: python -m lorapack.testbed.guard [--nice=N] -- COMMAND [ARG ...]", file=sys.stderr)
        return 2
    if nice:
        os.nice(nice)
    starter = os.getppid()
    _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    if os.getppid() != starter:  # the starter died before the death signal was armed
        return 1
    stop = {"signal": 0}

    def on_signal(signum, _frame) -> None:
        stop["signal"] = signum

    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, on_signal)
    child = subprocess.Popen(argv[1:])
    status = None
    while status is None and not stop["signal"]:
        status = child.poll()
        time.sleep(0.1)
    kill_tree(os.getpid(), include_root=False)
    if status is None:
        return 128 + stop["signal"]
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
