"""The oracles the placement methods ask, and the twin runs spread over processes.

* ``proposed`` / ``proposed-lat`` -> the learned models (``lorapack.surrogate.load_oracle(kind="surrogate")``),
  ``proposed-fast`` -> the shallow trees (``kind="tree"``), ``proposed-exact`` -> the twin itself
  (``exact_oracle``: one seed, ``EXACT_DURATION_S`` simulated seconds, early termination, answers cached).
* ``ParallelTwinOracle``: a ``TwinOracle`` whose (candidate, seed) runs go to worker processes and whose
  answers are cached by candidate content; every answer keeps its per-seed runs in ``extra["runs"]`` (what
  verification reads).

Why ``proposed-exact`` simulates 1,200 s and not the hour: at a testing point the twin only has to tell a
GPU that keeps up from one whose queue grows; a queue that grows pushes the mean TTFT past any interactive
objective within minutes and starvation is called by the early-termination rules, so the shorter window
changes few decisions, and verification (>= 3 seeds, the full hour) checks every GPU of the plan anyway.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import LorapackError
from ..oracle import GpuCandidate, Oracle, Prediction, TwinOracle
from ..profile import Profile

EXACT_DURATION_S = 1200.0
EXACT_SEEDS = 1
RUN_KEYS = ("throughput_tok_s", "incoming_tok_s", "starved", "adapter_starved", "itl_mean_ms", "itl_p99_ms",
            "ttft_mean_ms", "ttft_p99_ms", "ttft_penalised_mean_ms", "stop_reason", "simulated_s",
            "starved_adapter_indices", "oom", "kv_cache_tokens", "error_type", "preemptions", "adapter_loads")


def default_workers() -> int:
    """Worker processes for twin runs: at most 2 (the machine is shared), at least 1."""
    env = os.environ.get("LORAPACK_WORKERS")
    if env:
        try:
            return max(1, int(env))
        except ValueError:
            raise LorapackError(f"LORAPACK_WORKERS={env!r}: expected a positive integer") from None
    return max(1, min(2, os.cpu_count() or 1))


# ---------------------------------------------------------------------------------------------------------
# a process pool shared by every placement call of this process (forked once; workers keep numba warm)

_POOLS: dict[int, ProcessPoolExecutor] = {}


def _worker_init() -> None:
    os.environ.setdefault("NUMBA_NUM_THREADS", "1")
    from ..twin.engine import warm_up

    warm_up()


def _shutdown_pools() -> None:
    for pool in _POOLS.values():
        pool.shutdown(wait=False, cancel_futures=True)
    _POOLS.clear()


def run_parallel(fn: Callable, items: Sequence, workers: int) -> list:
    """``[fn(*item) for item in items]``, spread over ``workers`` processes when there is more than one item."""
    if workers <= 1 or len(items) <= 1:
        return [fn(*it) for it in items]
    pool = _POOLS.get(workers)
    if pool is None:
        ctx = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
        pool = _POOLS[workers] = ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_worker_init)
        if len(_POOLS) == 1:
            atexit.register(_shutdown_pools)
    futures = [pool.submit(fn, *it) for it in items]
    return [f.result() for f in futures]


def _simulate_one(oracle: TwinOracle, cand: GpuCandidate, seed: int):
    return oracle.simulate(cand, seed)


def run_summary(m) -> dict:
    """The keys of one run that plans and verification keep (``RUN_KEYS`` of ``RunMetrics.to_dict()``)."""
    d = m.to_dict()
    return {k: d.get(k) for k in RUN_KEYS}


def candidate_key(c: GpuCandidate) -> tuple:
    return (c.profile.file_hash(), c.ranks.tobytes(), c.rates_rps.tobytes(), c.max_loras, c.slot_rank,
            c.cpu_loras, c.max_num_seqs, c.max_num_batched_tokens, c.input_tokens, c.output_tokens)


@dataclass
class ParallelTwinOracle(TwinOracle):
    """The twin as an oracle, runs in worker processes, answers cached by candidate (content, flags)."""

    workers: int = 1
    cache: bool = True
    name: str = "twin"
    cheap: bool = False
    _memo: dict = field(default_factory=dict, init=False, repr=False)
    cache_hits: int = field(default=0, init=False)

    def _predict_fitting(self, cands: Sequence[GpuCandidate], kv_tokens: Sequence[int]) -> list[Prediction]:
        keys = [candidate_key(c) for c in cands]
        todo: dict[tuple, GpuCandidate] = {}
        for k, c in zip(keys, cands, strict=True):
            if k in self._memo:
                self.cache_hits += 1
            elif k not in todo:
                todo[k] = c
        # workers get a plain TwinOracle (small to pickle: no cache)
        plain = TwinOracle(seeds=self.seeds, duration_s=self.duration_s, early_stop=self.early_stop)
        jobs = [(plain, c, s) for c in todo.values() for s in self.seeds]
        t0 = time.perf_counter()
        runs = run_parallel(_simulate_one, jobs, self.workers)
        self.sim_wall_s += time.perf_counter() - t0
        self.n_simulations += len(jobs)
        ns = len(self.seeds)
        fresh: dict[tuple, Prediction] = {}
        for j, (k, c) in enumerate(todo.items()):
            r = runs[j * ns:(j + 1) * ns]
            p = self.aggregate(c, r)
            p.extra["runs"] = [run_summary(m) for m in r]
            fresh[k] = p
            if self.cache:
                self._memo[k] = p
        return [fresh[k] if k in fresh else self._memo[k] for k in keys]


def exact_oracle(seed: int = 0, workers: int | None = None, duration_s: float = EXACT_DURATION_S) -> ParallelTwinOracle:
    """The oracle of ``proposed-exact``: the twin, one seed, ``duration_s`` with early termination."""
    return ParallelTwinOracle(seeds=tuple(seed + i for i in range(EXACT_SEEDS)), duration_s=duration_s,
                              early_stop=True, workers=default_workers() if workers is None else workers,
                              name="twin-exact")


def learned_oracle(profile: Profile, kind: str, models_dir: Path | None = None) -> Oracle:
    """The learned oracle of ``proposed`` (kind ``surrogate``) or ``proposed-fast`` (kind ``tree``)."""
    try:
        from ..surrogate import load_oracle  # type: ignore[attr-defined]
    except ImportError:
        raise LorapackError(f"no learned {kind} models for {profile.model}: lorapack.surrogate is not installed "
                            f"in this version; use --method proposed-exact (the twin as the oracle)") from None
    return load_oracle(profile, kind=kind, models_dir=models_dir)
