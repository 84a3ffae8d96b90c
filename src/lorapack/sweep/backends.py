"""Executors: run work units and yield ``(unit, rows)`` as they complete.

* ``local`` -- in-process for one worker, else a process pool (``concurrent.futures``, fork on Linux);
* ``ray`` -- Ray tasks on an existing cluster (``address``) or on a local Ray instance started here and shut
  down at the end. Needs the optional extra: ``pip install 'lorapack[ray]'``. On a remote cluster every node
  needs lorapack installed (same version: rows record ``twin_version``).

Both call the same pure ``work.run_unit``, so they produce identical rows (timing aside); only the order in
which units complete differs. At most a few units per worker are in flight, so an interrupted sweep loses
little work and memory stays flat.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from collections.abc import Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait

from ..errors import LorapackError
from ..profile import Profile
from .work import Shortcuts, WorkUnit, run_unit

BACKENDS = ("local", "ray")
IN_FLIGHT_PER_WORKER = 3


def default_workers() -> int:
    return os.cpu_count() or 1


def _worker_init() -> None:
    os.environ.setdefault("NUMBA_NUM_THREADS", "1")
    from ..twin.engine import warm_up

    warm_up()


def run_local(units: Iterable[WorkUnit], profile: Profile, shortcuts: Shortcuts,
              workers: int) -> Iterator[tuple[WorkUnit, list[dict]]]:
    if workers <= 1:
        for unit in units:
            yield unit, run_unit(unit, profile, shortcuts)
        return
    ctx = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_worker_init)
    it = iter(units)
    pending: dict[Future, WorkUnit] = {}
    try:
        while True:
            while len(pending) < IN_FLIGHT_PER_WORKER * workers:
                unit = next(it, None)
                if unit is None:
                    break
                pending[pool.submit(run_unit, unit, profile, shortcuts)] = unit
            if not pending:
                break
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            for fut in done:
                unit = pending.pop(fut)
                yield unit, fut.result()
    finally:
        for fut in pending:
            fut.cancel()
        pool.shutdown(wait=True, cancel_futures=True)


def _ray_run_unit(unit: WorkUnit, profile: Profile, shortcuts: Shortcuts) -> list[dict]:
    os.environ.setdefault("NUMBA_NUM_THREADS", "1")
    return run_unit(unit, profile, shortcuts)


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


def run_ray(units: Iterable[WorkUnit], profile: Profile, shortcuts: Shortcuts,
            session: RaySession) -> Iterator[tuple[WorkUnit, list[dict]]]:
    ray = import_ray()
    session.start()
    pending: dict = {}
    try:
        cpus = int(ray.cluster_resources().get("CPU", 1)) or 1
        task = ray.remote(num_cpus=1, max_retries=2)(_ray_run_unit)
        prof_ref = ray.put(profile)
        it = iter(units)
        while True:
            while len(pending) < IN_FLIGHT_PER_WORKER * cpus:
                unit = next(it, None)
                if unit is None:
                    break
                pending[task.remote(unit, prof_ref, shortcuts)] = unit
            if not pending:
                break
            ready, _ = ray.wait(list(pending), num_returns=1)
            for ref in ready:
                unit = pending.pop(ref)
                yield unit, ray.get(ref)
    finally:
        for ref in pending:
            ray.cancel(ref, force=True)
        session.stop()


def execute(units: Iterable[WorkUnit], profile: Profile, shortcuts: Shortcuts, backend: str = "local",
            workers: int = 0, address: str | None = None,
            session: RaySession | None = None) -> Iterator[tuple[WorkUnit, list[dict]]]:
    """Run ``units``; for Ray pass a started ``session`` (else one is made here and stopped at the end)."""
    workers = workers if workers > 0 else default_workers()
    if backend == "local":
        if address is not None:
            raise LorapackError("--address is only used with --backend ray")
        return run_local(units, profile, shortcuts, workers)
    if backend == "ray":
        return run_ray(units, profile, shortcuts, session or RaySession(workers, address))
    raise LorapackError(f"--backend {backend}: expected one of {', '.join(BACKENDS)}")
