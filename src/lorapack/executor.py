"""One way to run a batch of independent jobs: in-process, in local worker processes, or on Ray.

Sweeps, the calibration's refinement and validation (and later evaluation) hand a function and a list of
argument tuples to ``Executor.imap``, which yields ``(index, result)`` as jobs complete; ``Executor.map``
returns the results in job order. Results never depend on the backend, only the completion order does.

* ``local`` with one worker runs the jobs in-process, in order (no pickling; what tests and debugging use).
* ``local`` with more workers: a pool of ``spawn``-ed worker processes (fresh interpreters, children of the
  caller). They inherit no open file of the caller, so they never hold a lock the caller took (the sweep's
  ``OUT/.lock``), and they exit when the caller dies, even by ``SIGKILL``: on Linux the kernel signals them
  (``PR_SET_PDEATHSIG``, armed in the worker initializer), elsewhere a watchdog thread notices that the
  parent is gone (between jobs: compiled code holds the interpreter). The kernel signal follows the thread
  that started the workers, so use an executor from a thread that outlives it (normally the main thread).
* ``ray``: Ray tasks on an existing cluster (``address``) or on a local Ray instance started here and shut
  down at the end (``RaySession``). Needs the optional extra: ``pip install 'lorapack[ray]'``.

At most ``in_flight_per_worker`` jobs per worker are submitted ahead, so an interrupted run loses little work
and memory stays flat; leaving the ``with`` block (or an error in a job) cancels what has not started.

Ctrl-C: the terminal sends SIGINT to the whole process group, workers included. Local workers never see it:
they are started with SIGINT blocked (``_sigint_blocked``; a blocked signal mask is inherited across fork and
exec, so a worker cannot be interrupted while it imports, before its initializer runs) and ignore it from
then on. Only the caller gets the ``KeyboardInterrupt``; leaving the ``with`` block with it, or
``stop_all_workers()`` (what ``lorapack``'s ``main()`` calls), ends the workers at once with SIGTERM instead of
waiting for their running jobs: no ``KeyboardInterrupt`` tracebacks from workers, and no job left running.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from typing import Any

from .errors import LorapackError

BACKENDS = ("local", "ray")
IN_FLIGHT_PER_WORKER = 3
WATCHDOG_INTERVAL_S = 1.0
PR_SET_PDEATHSIG = 1  # linux/prctl.h
TERMINATE_GRACE_S = 5.0  # after SIGTERM, how long stopped workers get before SIGKILL


def default_workers() -> int:
    return os.cpu_count() or 1


def _die_with_parent(parent_pid: int) -> None:
    """Exit this worker when its parent process dies (kernel signal on Linux, watchdog thread everywhere)."""
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):  # no prctl: the watchdog below still works
            pass
    if os.getppid() != parent_pid:  # the parent died before the signal was armed
        os._exit(1)

    def watch() -> None:
        while True:
            time.sleep(WATCHDOG_INTERVAL_S)
            if os.getppid() != parent_pid:
                os._exit(1)

    threading.Thread(target=watch, name="lorapack-parent-watchdog", daemon=True).start()


def _unblock_broken_pool(pool: ProcessPoolExecutor) -> None:
    """After a worker died abruptly (killed, out of memory, could not start): let the pool shut down.

    Python before 3.11.5 (e.g. Debian 12's 3.11.2) then hangs for ever (CPython gh-94777): the pool's feeder
    thread is blocked writing a job into a pipe no worker reads any more, and shutting down waits for it.
    Closing the read end makes that write fail and the shutdown finish; later Pythons do it themselves (in the
    pool's manager thread: closing it here too would race with that)."""
    if sys.version_info >= (3, 11, 5) or not getattr(pool, "_broken", False):
        return
    reader = getattr(getattr(pool, "_call_queue", None), "_reader", None)
    if reader is not None:
        try:
            reader.close()
        except OSError:
            pass


@contextlib.contextmanager
def _sigint_blocked() -> Iterator[None]:
    """SIGINT blocked in this thread for the block (a SIGINT that arrives meanwhile is delivered after it).

    Worker processes started in the block inherit the blocked mask (fork and exec keep it), so Ctrl-C, which
    reaches the whole process group, cannot interrupt them while they start (CPython's resource tracker
    starts its process the same way)."""
    if not hasattr(signal, "pthread_sigmask"):  # not POSIX: nothing to block
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _ignore_sigint() -> None:
    """In a worker: Ctrl-C is the caller's to handle (it stops the workers), never a traceback here."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # ignored now: a pending one is dropped


def _terminate_workers(pool: ProcessPoolExecutor) -> None:
    """End the pool's worker processes now (SIGTERM, then SIGKILL after ``TERMINATE_GRACE_S``): their running
    jobs are abandoned. The pool's manager thread then finds them gone and marks the pool broken."""
    from multiprocessing.connection import wait as wait_sentinels

    procs = [p for p in list((getattr(pool, "_processes", None) or {}).values()) if p.is_alive()]
    for p in procs:
        with contextlib.suppress(Exception):
            p.terminate()  # SIGTERM's default action: the worker ends at once, without a traceback
    deadline = time.monotonic() + TERMINATE_GRACE_S
    alive = {p.sentinel: p for p in procs}
    while alive and time.monotonic() < deadline:
        for sentinel in wait_sentinels(list(alive), timeout=max(0.0, deadline - time.monotonic())):
            alive.pop(sentinel, None)  # type: ignore[call-overload]
    for p in alive.values():
        with contextlib.suppress(Exception):
            p.kill()
    deadline = time.monotonic() + 2.0  # let the manager thread notice (``_unblock_broken_pool`` needs it)
    while procs and not getattr(pool, "_broken", True) and time.monotonic() < deadline:
        time.sleep(0.01)


_LIVE: weakref.WeakSet[Executor] = weakref.WeakSet()
_IN_WORKER = {"on": False}  # this process is a local worker (``_worker_init`` ran)


def _stop_nested(signum: int, frame: object) -> None:
    """SIGTERM to a worker that started workers of its own (``evaluate --jobs``): stop them the same way and
    release this process's multiprocessing resources as a normal exit would (else the resource tracker warns
    of leaked semaphores), then exit at once. Further SIGTERMs are ignored meanwhile: the caller's pool sends
    one more to every worker when it sees the first one gone, and it must not cut this cleanup short."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        stop_all_workers()
        from multiprocessing import util

        util._exit_function()  # what a worker process runs on its way out: finalizers, semaphores unlinked
    finally:
        os._exit(128 + signal.SIGTERM)


def stop_all_workers() -> None:
    """After an interrupt: end the worker processes of every executor of this process at once and close the
    executors (their running jobs are abandoned). ``lorapack``'s ``main()`` calls it before exiting with 130."""
    for ex in list(_LIVE):
        with contextlib.suppress(Exception):
            ex.close(terminate=True)


# glibc's mallopt parameters (malloc.h): blocks up to 32 MiB (glibc's largest threshold) come from the heap, not
# from a mapping unmapped on free; the heap's top is given back to the kernel only above 1 GiB free
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
WORKER_MALLOPT = {M_MMAP_THRESHOLD: 32 << 20, M_TRIM_THRESHOLD: 1 << 30}


def keep_freed_memory() -> bool:
    """Let glibc's malloc keep memory this process frees, for its next job, instead of returning it to the
    kernel and faulting it back in (zeroed) on the next allocation. A sweep job allocates and frees the same
    arrays thousands of times: on placement-like-llama (597 configs, 2 workers) the defaults cost 1.24 M minor
    page faults and 6.2 s of system time, these settings 0.24 M and 2.2 s, 46.4 -> 44.4 s wall, the same peak
    memory (docs/sweep.md, "Memory the workers keep"). Workers call it; False where malloc is not glibc's."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (e.g. musl): keep its defaults
        return False
    return all(mallopt(param, value) == 1 for param, value in WORKER_MALLOPT.items())


def _worker_init(parent_pid: int, initializer: Callable[[], Any] | None) -> None:
    _ignore_sigint()
    _IN_WORKER["on"] = True
    os.environ.setdefault("NUMBA_NUM_THREADS", "1")  # one core per worker: no nested thread pools
    keep_freed_memory()
    _die_with_parent(parent_pid)
    if initializer is not None:
        initializer()


def _ray_call(fn: Callable[..., Any], args: tuple) -> Any:
    os.environ.setdefault("NUMBA_NUM_THREADS", "1")
    keep_freed_memory()
    return fn(*args)


def import_ray():
    try:
        import ray
    except ImportError:
        raise LorapackError("--backend ray needs Ray: pip install 'lorapack[ray]'") from None
    return ray


def _check_reachable(addr: str, timeout_s: float = 5.0) -> None:
    """Fail fast on a ``host:port`` nobody listens on (Ray itself would retry for minutes)."""
    import socket

    hostport = addr.split("://", 1)[-1]
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit():
        return  # "auto" and other forms: let Ray resolve them
    try:
        socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise LorapackError(f"--address {addr}: cannot reach a Ray cluster there ({exc.strerror or exc}); "
                            f"expected the head node's host:port (see `ray status`), or omit --address to "
                            f"start a local Ray instance") from None


class RaySession:
    """Connects to (or starts) Ray on ``start()``; shuts down on ``stop()`` only what it started."""

    def __init__(self, workers: int, address: str | None = None):
        self.workers, self.address = workers, address
        self.started = False

    def start(self) -> RaySession:
        import logging

        ray = import_ray()
        if ray.is_initialized():
            return self
        addr = self.address or os.environ.get("RAY_ADDRESS") or "local"
        kwargs: dict = {"include_dashboard": False, "log_to_driver": False, "logging_level": logging.WARNING}
        if addr == "local":
            kwargs["num_cpus"] = max(1, self.workers)
        else:
            _check_reachable(addr)
        try:
            ray.init(address=addr, **kwargs)
        except Exception as exc:  # connection errors, bad addresses
            raise LorapackError(f"--backend ray: cannot start or reach Ray at '{addr}' "
                                f"({' '.join(str(exc).split())[:200]})") from None
        self.started = True
        return self

    def stop(self) -> None:
        if self.started:
            import_ray().shutdown()
            self.started = False


class Executor:
    """Runs independent jobs ``fn(*args)``; use as a context manager to keep the workers between batches.

    ``workers`` 0 = all cores. ``initializer`` runs once in every worker process (e.g. compile the engine
    there, so that jobs' timings exclude it). ``session``: a started ``RaySession`` to reuse (``ray`` only).
    """

    def __init__(self, workers: int = 0, backend: str = "local", address: str | None = None,
                 initializer: Callable[[], Any] | None = None, session: RaySession | None = None,
                 in_flight_per_worker: int = IN_FLIGHT_PER_WORKER) -> None:
        if backend not in BACKENDS:
            raise LorapackError(f"--backend {backend}: expected one of {', '.join(BACKENDS)}")
        if workers < 0:
            raise LorapackError(f"--workers {workers}: expected an integer >= 0 (0 = all cores)")
        if backend == "local" and address is not None:
            raise LorapackError("--address is only used with --backend ray")
        self.workers = workers if workers > 0 else default_workers()
        self.backend, self.address, self.initializer = backend, address, initializer
        self.in_flight = max(1, in_flight_per_worker)
        self._session, self._own_session = session, False
        self._pool: ProcessPoolExecutor | None = None

    # ---- lifetime ----
    def __enter__(self) -> Executor:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        # Ctrl-C: stop the workers now rather than wait for their running jobs
        self.close(terminate=exc_type is not None and issubclass(exc_type, KeyboardInterrupt))

    def close(self, terminate: bool = False) -> None:
        """Stop the workers: after their running jobs (default), or at once (``terminate``: after an interrupt)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            if terminate:
                _terminate_workers(pool)
            _unblock_broken_pool(pool)
            # after terminating, no cancelling: the pool fails its pending futures itself, and CPython 3.11's
            # crashes on one already cancelled (InvalidStateError in its manager thread), however late
            pool.shutdown(wait=True, cancel_futures=not terminate)
        if self._own_session and self._session is not None:
            self._session.stop()
            self._session, self._own_session = None, False

    def _local_pool(self) -> ProcessPoolExecutor:
        if self._pool is None:
            # spawn: fresh interpreters that inherit no open file (no lock) and are our direct children (so
            # the kernel can signal them when we die); a forkserver would be their parent and outlive us
            self._pool = ProcessPoolExecutor(max_workers=self.workers, mp_context=multiprocessing.get_context("spawn"),
                                             initializer=_worker_init, initargs=(os.getpid(), self.initializer))
            _LIVE.add(self)
            if _IN_WORKER["on"] and threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGTERM, _stop_nested)  # (plain workers keep SIGTERM's default: instant)
        return self._pool

    # ---- running ----
    def imap(self, fn: Callable[..., Any], jobs: Iterable[tuple]) -> Iterator[tuple[int, Any]]:
        """Yield ``(index, fn(*jobs[index]))`` as jobs complete (in order for the in-process path).

        A job's exception is raised here; the jobs not yet started are then cancelled."""
        if self.backend == "ray":
            return self._imap_ray(fn, jobs)
        if self.workers <= 1:
            return ((i, fn(*args)) for i, args in enumerate(jobs))
        return self._imap_pool(fn, jobs)

    def map(self, fn: Callable[..., Any], jobs: Sequence[tuple]) -> list[Any]:
        """``[fn(*args) for args in jobs]``, run by the backend."""
        out: list[Any] = [None] * len(jobs)
        for i, result in self.imap(fn, jobs):
            out[i] = result
        return out

    def _imap_pool(self, fn: Callable[..., Any], jobs: Iterable[tuple]) -> Iterator[tuple[int, Any]]:
        pool = self._local_pool()
        it = enumerate(jobs)
        pending: dict[Future, int] = {}
        interrupted = False
        try:
            while True:
                while len(pending) < self.in_flight * self.workers:
                    nxt = next(it, None)
                    if nxt is None:
                        break
                    with _sigint_blocked():  # submit() starts the workers as they are needed
                        fut = pool.submit(fn, *nxt[1])
                    pending[fut] = nxt[0]
                if not pending:
                    break
                done, _ = wait(pending, return_when=FIRST_COMPLETED)
                for fut in done:
                    yield pending.pop(fut), fut.result()
        except KeyboardInterrupt:
            interrupted = True
            raise
        finally:
            # after Ctrl-C the workers are terminated instead: CPython 3.11's pool then fails every pending
            # future and crashes on one already cancelled (InvalidStateError in its manager thread)
            for fut in () if interrupted else pending:
                fut.cancel()

    def _imap_ray(self, fn: Callable[..., Any], jobs: Iterable[tuple]) -> Iterator[tuple[int, Any]]:
        ray = import_ray()
        if self._session is None:
            self._session, self._own_session = RaySession(self.workers, self.address), True
        self._session.start()
        pending: dict = {}
        try:
            cpus = int(ray.cluster_resources().get("CPU", 1)) or 1
            task = ray.remote(num_cpus=1, max_retries=2)(_ray_call)
            fn_ref = ray.put(fn)
            it = enumerate(jobs)
            while True:
                while len(pending) < self.in_flight * cpus:
                    nxt = next(it, None)
                    if nxt is None:
                        break
                    pending[task.remote(fn_ref, nxt[1])] = nxt[0]
                if not pending:
                    break
                ready, _ = ray.wait(list(pending), num_returns=1)
                for ref in ready:
                    yield pending.pop(ref), ray.get(ref)
        finally:
            for ref in pending:
                ray.cancel(ref, force=True)
