"""``lorapack.executor``: one way to run independent jobs (in-process, worker processes, Ray)."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lorapack.errors import LorapackError
from lorapack.executor import Executor


def square(x: int) -> int:
    return x * x


def fail_on(x: int, bad: int) -> int:
    if x == bad:
        raise ValueError(f"job {x} failed")
    return x


def open_paths(_: int) -> list[str]:
    """Paths of the files this process has open (Linux)."""
    out = []
    for fd in Path("/proc/self/fd").iterdir():
        try:
            out.append(os.readlink(fd))
        except OSError:
            pass
    return out


def worker_pid(_: int) -> tuple[int, int]:
    return os.getpid(), os.getppid()


@pytest.mark.parametrize("workers", [1, 2])
def test_map_keeps_job_order_and_imap_names_each_job(workers: int) -> None:
    jobs = [(i,) for i in range(12)]
    with Executor(workers) as ex:
        assert ex.map(square, jobs) == [i * i for i in range(12)]
        seen = dict(ex.imap(square, jobs))
    assert seen == {i: i * i for i in range(12)}


def test_in_process_with_one_worker_and_pool_otherwise() -> None:
    with Executor(1) as ex:
        assert ex.map(worker_pid, [(0,)]) == [(os.getpid(), os.getppid())]
    with Executor(2) as ex:
        pids = ex.map(worker_pid, [(i,) for i in range(6)])
    assert all(pid != os.getpid() and ppid == os.getpid() for pid, ppid in pids)  # our direct children


@pytest.mark.parametrize("workers", [1, 2])
def test_a_failing_job_raises_in_the_caller(workers: int) -> None:
    with Executor(workers) as ex, pytest.raises(ValueError, match="job 3 failed"):
        ex.map(fail_on, [(i, 3) for i in range(8)])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="lists open files from /proc (Linux)")
def test_workers_do_not_inherit_the_callers_open_files(tmp_path: Path) -> None:
    lock = tmp_path / ".lock"
    with lock.open("a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        with Executor(2) as ex:
            seen = ex.map(open_paths, [(i,) for i in range(4)])
    assert all(str(lock) not in paths for paths in seen)


def test_bad_options() -> None:
    with pytest.raises(LorapackError, match="--backend gpu"):
        Executor(backend="gpu")
    with pytest.raises(LorapackError, match="--workers -1"):
        Executor(-1)
    with pytest.raises(LorapackError, match="--address is only used with --backend ray"):
        Executor(2, address="127.0.0.1:6379")


DYING_WORKER = """
import os, sys
from concurrent.futures.process import BrokenProcessPool
from lorapack.executor import Executor

def job(i, payload):
    if i == 0:
        os._exit(3)  # the worker dies abruptly (killed, out of memory, could not start)
    return len(payload)

if __name__ == "__main__":
    try:
        with Executor(workers=2) as ex:  # payloads larger than a pipe's buffer: the feeder blocks on a write
            ex.map(job, [(i, b"x" * 1_000_000) for i in range(12)])
    except BrokenProcessPool:
        print("broken pool reported")
"""


def _interpreters() -> list[str]:
    """This one, and Debian's python3.11 when present (3.11.2 on Debian 12: it has CPython gh-94777, which
    ``Executor.close`` works around); the executor needs only the standard library."""
    found = [sys.executable]
    system = Path("/usr/bin/python3.11")
    if system.is_file() and system.resolve() != Path(sys.executable).resolve():
        found.append(str(system))
    return found


@pytest.mark.parametrize("python", _interpreters())
def test_a_worker_that_dies_is_an_error_not_a_hang(python: str, tmp_path: Path) -> None:
    script = tmp_path / "dying.py"
    script.write_text(DYING_WORKER)
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.run([python, str(script)], capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert p.returncode == 0 and "broken pool reported" in p.stdout, p.stderr[-2000:]



def refault_share(_: int) -> float:
    """Allocate, touch and free 30 blocks of 1-3 MiB four times (as a sweep job's arrays come and go): the page
    faults of the last three rounds per fault of the first. glibc's defaults map such blocks anew or give the
    heap's top back on free, so every round faults them in again (~1.0); a process that keeps what it frees
    faults once (~0)."""
    import ctypes
    import resource

    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    sizes = [(1 << 20) * (1 + i % 3) for i in range(30)]

    def round_faults() -> int:
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        blocks = [libc.malloc(n) for n in sizes]
        for b, n in zip(blocks, sizes, strict=True):
            ctypes.memset(b, 1, n)
        for b in reversed(blocks):
            libc.free(b)
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0

    first = round_faults()
    return sum(round_faults() for _ in range(3)) / 3 / first


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc: Linux only")
def test_workers_keep_freed_memory_for_their_next_job() -> None:
    """A sweep job allocates and frees the same arrays thousands of times; workers keep what they free rather
    than fault it back in (``keep_freed_memory``: 5x fewer page faults, ~6 % less wall on a sweep)."""
    with Executor(2) as ex:
        shares = ex.map(refault_share, [(i,) for i in range(2)])
    assert all(s < 0.05 for s in shares), shares
    caller = subprocess.run([sys.executable, "-c", "from tests.test_executor import refault_share as f; "
                             "print(f(0))"], capture_output=True, text=True, check=True,
                            cwd=Path(__file__).resolve().parents[1]).stdout
    assert float(caller) > 0.5  # glibc's defaults, in a process that did not ask
