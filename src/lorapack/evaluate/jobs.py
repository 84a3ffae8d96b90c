"""Scenario-level parallelism (``lorapack evaluate --jobs N``): groups of scenarios that share a derived
workload run in separate processes, each with its own placer, replay pool and caches; the results are merged in
the scenarios' order. Heavier groups (more adapters × load) start first so the last one to finish is short."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ..executor import Executor
from .runner import RESULTS_FORMAT, SMALLEST_POOL_PROTOCOL, Budget, evaluate_scenarios
from .scenario import Scenario


def workload_groups(scenarios: list[Scenario]) -> list[list[Scenario]]:
    """Consecutive scenarios with the same derived workload (a file's objective axis is innermost)."""
    groups: list[list[Scenario]] = []
    for sc in scenarios:
        if groups and groups[-1][0].workload_key() == sc.workload_key():
            groups[-1].append(sc)
        else:
            groups.append([sc])
    return groups


def _run_group(group: list[Scenario], methods: tuple[str, ...] | None, budget_s: float | None, started: float,
               workers: int, keep_plans: bool) -> dict[str, Any]:
    from . import placers
    from .parallel import ExecutorMapper, replay_executor

    placer = placers.default_placer(workers)
    with replay_executor(workers) as ex:
        return evaluate_scenarios(group, placer, methods, Budget(budget_s, t0=started), ExecutorMapper(ex),
                                  keep_plans=keep_plans)


def evaluate_parallel(scenarios: list[Scenario], methods: tuple[str, ...] | None, budget_s: float | None,
                      jobs: int, workers: int = 1, keep_plans: bool = False,
                      on_group: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """``evaluate_scenarios`` over workload groups in ``jobs`` processes; ``on_group(doc)`` as each ends."""
    started = time.monotonic()
    groups = workload_groups(scenarios)
    order = sorted(range(len(groups)), key=lambda i: -groups[i][0].n_adapters * groups[i][0].load_scale)
    done: dict[int, dict[str, Any]] = {}
    with Executor(workers=jobs, in_flight_per_worker=1) as ex:
        for k, doc in ex.imap(_run_group, [(groups[i], methods, budget_s, started, workers, keep_plans)
                                           for i in order]):
            done[order[k]] = doc
            if on_group:
                on_group(doc)
    docs = [done[i] for i in range(len(groups))]
    return {"format": RESULTS_FORMAT, "smallest_pool_protocol": SMALLEST_POOL_PROTOCOL,
            "scenarios": [s for d in docs for s in d["scenarios"]],
            "max_pack": [c for d in docs for c in d["max_pack"]], "skipped": [k for d in docs for k in d["skipped"]],
            "budget_s": budget_s, "wall_s": time.monotonic() - started, "jobs": jobs}
