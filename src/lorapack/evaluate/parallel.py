"""A lazily started local process pool for GPU replays (one task per GPU; order of results kept)."""

from __future__ import annotations

import multiprocessing
import os
import sys
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor


def _worker_init() -> None:
    os.environ.setdefault("NUMBA_NUM_THREADS", "1")
    from ..twin.engine import warm_up

    warm_up()


class PoolMapper:
    """``mapper(fn, args_list)`` for ``Replayer``: in this process for one task or one worker, else on a
    process pool started at the first batch that needs it and kept until ``close``."""

    def __init__(self, workers: int) -> None:
        self.workers = max(1, int(workers))
        self._pool: ProcessPoolExecutor | None = None

    def __call__(self, fn: Callable, args: list[tuple]) -> list:
        if self.workers == 1 or len(args) < 2:
            return [fn(*a) for a in args]
        if self._pool is None:
            ctx = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
            self._pool = ProcessPoolExecutor(max_workers=self.workers, mp_context=ctx, initializer=_worker_init)
        futures = [self._pool.submit(fn, *a) for a in args]
        return [f.result() for f in futures]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def __enter__(self) -> PoolMapper:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
