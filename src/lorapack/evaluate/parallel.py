"""GPU replays on ``lorapack.executor``: a batch of GPUs runs on the executor's workers, a single GPU (or a
one-worker executor) in this process, where shipping the profile and the requests would cost more than it
saves."""

from __future__ import annotations

from collections.abc import Callable

from ..executor import Executor


def _warm_up() -> None:
    from ..twin.engine import warm_up

    warm_up()


def replay_executor(workers: int) -> Executor:
    """The executor of one evaluation's replays (engine compiled once per worker)."""
    return Executor(workers=max(1, workers), initializer=_warm_up)


class ExecutorMapper:
    """``mapper(fn, args_list)`` for ``Replayer`` over an ``Executor`` (results in job order)."""

    def __init__(self, executor: Executor) -> None:
        self.executor = executor

    def __call__(self, fn: Callable, args: list[tuple]) -> list:
        if self.executor.workers <= 1 or len(args) < 2:
            return [fn(*a) for a in args]
        return self.executor.map(fn, args)
