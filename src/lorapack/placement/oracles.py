"""The oracles the placement methods ask, and the twin runs spread over processes.

* ``proposed`` / ``proposed-lat`` -> the learned models (``lorapack.surrogate.load_oracle(kind="surrogate")``),
  ``proposed-fast`` -> the shallow trees (``kind="tree"``), ``proposed-exact`` -> the twin itself
  (``exact_oracle``: one seed, ``EXACT_DURATION_S`` simulated seconds, early termination, answers cached).
* ``ParallelTwinOracle``: a ``TwinOracle`` whose (candidate, seed) runs go to worker processes
  (``lorapack.executor``'s, kept warm across calls; in-process until starting them pays) and whose
  answers are cached by candidate content; every answer keeps its per-seed runs in ``extra["runs"]`` (what
  verification reads).

Why ``proposed-exact`` simulates 1,200 s and not the hour: at a testing point the twin only has to tell a
GPU that keeps up from one whose queue grows; a queue that grows pushes the mean TTFT past any interactive
objective within minutes and starvation is called by the early-termination rules, so the shorter window
changes few decisions, and verification (>= 3 seeds, the full hour) checks every GPU of the plan anyway.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import LorapackError
from ..executor import Executor
from ..oracle import GpuCandidate, Oracle, Prediction, TwinOracle, length_law_key
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
# the twin runs' worker processes (``lorapack.executor``), kept warm across the placement calls of this process

WORKER_START_S = 1.5  # about what starting the twin's worker processes costs (spawn, imports, engine)
_EXECUTORS: dict[int, Executor] = {}
_in_process_s = 0.0  # seconds this process spent on batches of twin runs in-process


def close_executors() -> None:
    """Stop the kept worker processes (registered to run at exit)."""
    while _EXECUTORS:
        _EXECUTORS.popitem()[1].close()


def twin_executor(workers: int) -> Executor:
    """This process's executor of twin runs on ``workers`` worker processes (spawned, the engine compiled once
    in each): started on first use, kept warm for every later placement call, closed at exit. Use it from the
    main thread: the kernel stops the workers when the thread that started them ends."""
    from ..twin.engine import warm_up

    ex = _EXECUTORS.get(workers)
    if ex is None:
        if not _EXECUTORS:
            atexit.register(close_executors)
        ex = _EXECUTORS[workers] = Executor(workers, initializer=warm_up)
    return ex


def _simulate_all(jobs: list[tuple], workers: int) -> list:
    """``[TwinOracle.simulate(*job) for job in jobs]`` in job order, on ``workers`` processes when that pays.

    Until this process has started its workers, its batches run here while the rest of the batch (estimated
    from its jobs done so far) would not pay for starting them (``WORKER_START_S``), and until the process has
    spent ``2 * WORKER_START_S`` so: a placement with little to simulate (e.g. a few GPUs' verification) is
    done before workers would be ready. Results do not depend on where jobs run."""
    global _in_process_s
    out: list = []
    if workers > 1 and len(jobs) > 1 and workers not in _EXECUTORS:
        t_batch = time.perf_counter()
        while len(out) < len(jobs) and _in_process_s < 2 * WORKER_START_S:
            left, mean_s = len(jobs) - len(out), (time.perf_counter() - t_batch) / max(1, len(out))
            if out and left > 1 and mean_s * left * (1 - 1 / workers) > WORKER_START_S:  # workers save more
                break
            t0 = time.perf_counter()
            out.append(TwinOracle.simulate(*jobs[len(out)]))
            _in_process_s += time.perf_counter() - t0
    rest = jobs[len(out):]
    if workers <= 1 or len(rest) <= 1:
        return out + [TwinOracle.simulate(*job) for job in rest]
    if threading.current_thread() is not threading.main_thread():  # kept workers would die with this thread
        from ..twin.engine import warm_up

        with Executor(workers, initializer=warm_up) as own:
            return out + own.map(TwinOracle.simulate, rest)
    ex = twin_executor(workers)
    try:
        return out + ex.map(TwinOracle.simulate, rest)
    except BrokenProcessPool:  # a worker died (killed, out of memory): fresh workers next time
        _EXECUTORS.pop(workers, None)
        ex.close()
        raise


def run_summary(m) -> dict:
    """The keys of one run that plans and verification keep (``RUN_KEYS`` of ``RunMetrics.to_dict()``)."""
    d = m.to_dict()
    return {k: d.get(k) for k in RUN_KEYS}


def candidate_key(c: GpuCandidate) -> tuple:
    """What a twin answer depends on: the profile, adapters, flags, mean lengths and the length law."""
    return (c.profile.file_hash(), c.ranks.tobytes(), c.rates_rps.tobytes(), c.max_loras, c.slot_rank,
            c.cpu_loras, c.max_num_seqs, c.max_num_batched_tokens, c.input_tokens, c.output_tokens,
            length_law_key(c.lengths, c.profile))


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
        plain = TwinOracle(seeds=self.seeds, duration_s=self.duration_s, early_stop=self.early_stop,
                           arrivals=self.arrivals)
        jobs = [(plain, c, s) for c in todo.values() for s in self.seeds]
        t0 = time.perf_counter()
        runs = _simulate_all(jobs, self.workers)
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
