"""Replay a plan through the twin, one simulated server per GPU (placement.md §6.3, static routing).

The replay stream (``DerivedWorkload.replay``) is split over GPUs up front: a request of an adapter with one
route goes to that GPU; a request of a split adapter draws ``u ~ U[0, 1)`` (one draw per request of the
stream, seeded, independent of the plan) and goes to the route whose cumulative-weight interval holds ``u``.
Each GPU then runs the twin on its own requests with its own flags (registration order = the plan's order,
so the warm start is the one vLLM would have) for the whole replay window. A GPU whose ``(--max-loras,
--max-lora-rank)`` fails vLLM's start-up rule is a memory error (``oom``): none of its requests complete.

Fleet metrics: throughput and incoming tokens summed over GPUs; ITL token-weighted over every completed
request of the fleet (Σ decode spans / Σ gaps); TTFT mean and p99 over the completed requests of the fleet;
penalised TTFT counts every unfinished request as the whole window. A GPU is *starved* when its throughput
is below 0.9 × its incoming tokens (the paper's label); adapters are starved as the twin defines it. A
replay is *clean* when every GPU starts, no GPU and no adapter starves (the user's "no request starves":
a GPU that keeps up overall while one of its adapters waits is not clean) and every GPU meets the latency
objective.

A GPU's replay depends only on its adapters, their share intervals and its flags, so results are cached
by that key: searches over the pool size and plans that share GPUs replay each distinct GPU once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

from ..errors import SpecError
from ..objective import Objective
from ..placement.plan import Plan
from ..profile import Profile
from ..server import ServerConfig
from ..twin.types import RequestArrays
from ..workload.derive import DerivedWorkload

ROUTING_KEY = 0x726F757465  # "route"
NAN = float("nan")


# the names results.json gives the limits a replayed GPU breaks, in its order
VIOLATION_NAMES = {"max_ttft_s": "ttft", "max_ttft_p99_s": "ttft_p99", "max_itl_ms": "itl", "max_itl_p99_ms": "itl_p99"}


def violations(objective: Objective, gpu: GpuReplay) -> list[str]:
    """The limits ``gpu`` breaks (a GPU that completed nothing breaks every limit it has)."""
    broken = objective.latency_violations(gpu.ttft_mean_s, gpu.itl_mean_ms, gpu.ttft_p99_s, gpu.itl_p99_ms,
                                          unknown_breaks=True)
    return [name for k, name in VIOLATION_NAMES.items() if k in broken]


@dataclass
class GpuReplay:
    """What the twin measured for one GPU of a plan over the replay window."""

    n_adapters: int
    max_loras: int
    max_lora_rank: int
    n_requests: int
    oom: bool
    error_type: str | None
    starved: bool
    throughput_tok_s: float
    incoming_tok_s: float
    itl_mean_ms: float
    itl_p99_ms: float
    ttft_mean_s: float
    ttft_p99_s: float
    ttft_penalised_s: float
    n_completed: int
    starved_adapters: list[str]
    decode_gaps: int  # Σ (O − 1) over completed requests: the weight of this GPU's ITL in the fleet's
    decode_span_s: float  # Σ (t_last − t_first) over completed requests
    ttft_samples_s: np.ndarray = field(repr=False)  # float32, completed requests
    wall_s: float = 0.0


@dataclass
class FleetReplay:
    """A plan's replay: per-GPU results (plan order, empty GPUs skipped) and fleet metrics."""

    gpus: list[GpuReplay]
    window_s: float
    objective: Objective

    @property
    def gpus_used(self) -> int:
        return len(self.gpus)

    @property
    def oom_gpus(self) -> int:
        return sum(g.oom for g in self.gpus)

    @property
    def starved_gpus(self) -> int:
        """GPUs that start but serve < 0.9 × their incoming tokens (a refused GPU counts as OOM only)."""
        return sum(g.starved and not g.oom for g in self.gpus)

    @property
    def starved_adapters(self) -> int:
        return sum(len(g.starved_adapters) for g in self.gpus)

    @property
    def latency_violation_gpus(self) -> int:
        return sum(bool(violations(self.objective, g)) for g in self.gpus if not g.oom)

    @property
    def clean(self) -> bool:
        """Replay-clean: every GPU starts, no GPU and no adapter starves, every GPU meets the latency objective."""
        return (self.oom_gpus == 0 and self.starved_gpus == 0 and self.starved_adapters == 0
                and self.latency_violation_gpus == 0)

    @property
    def throughput_tok_s(self) -> float:
        return float(sum(g.throughput_tok_s for g in self.gpus))

    @property
    def incoming_tok_s(self) -> float:
        return float(sum(g.incoming_tok_s for g in self.gpus if math.isfinite(g.incoming_tok_s)))

    @property
    def itl_mean_ms(self) -> float:
        gaps = sum(g.decode_gaps for g in self.gpus)
        return sum(g.decode_span_s for g in self.gpus) / gaps * 1000.0 if gaps > 0 else NAN

    def _ttft(self) -> np.ndarray:
        parts = [g.ttft_samples_s for g in self.gpus if len(g.ttft_samples_s)]
        return np.concatenate(parts).astype(np.float64) if parts else np.empty(0)

    @property
    def ttft_mean_s(self) -> float:
        x = self._ttft()
        return float(x.mean()) if len(x) else NAN

    @property
    def ttft_p99_s(self) -> float:
        x = self._ttft()
        return float(np.percentile(x, 99)) if len(x) else NAN

    @property
    def ttft_penalised_s(self) -> float:
        sent = sum(g.n_requests for g in self.gpus)
        if not sent:
            return NAN
        done = self._ttft()
        return (float(done.sum()) + (sent - len(done)) * self.window_s) / sent

    def summary(self) -> dict:
        """Fleet metrics as a flat dict (JSON-ready apart from NaN)."""
        return {
            "gpus_used": self.gpus_used, "oom_gpus": self.oom_gpus, "starved_gpus": self.starved_gpus,
            "starved_adapters": self.starved_adapters, "latency_violation_gpus": self.latency_violation_gpus,
            "replay_clean": self.clean, "throughput_tok_s": self.throughput_tok_s,
            "incoming_tok_s": self.incoming_tok_s,
            "throughput_ratio": (self.throughput_tok_s / self.incoming_tok_s
                                 if self.incoming_tok_s > 0 else NAN),
            "itl_mean_ms": self.itl_mean_ms, "ttft_mean_s": self.ttft_mean_s, "ttft_p99_s": self.ttft_p99_s,
            "ttft_penalised_s": self.ttft_penalised_s,
            "requests": sum(g.n_requests for g in self.gpus),
            "completed": sum(g.n_completed for g in self.gpus),
        }

    def per_gpu(self) -> list[dict]:
        return [{k: v for k, v in g.__dict__.items() if k != "ttft_samples_s"}
                | {"latency_violations": violations(self.objective, g) if not g.oom else []}
                for g in self.gpus]


# ---------------------------------------------------------------------------------------------------------
# splitting the stream


@dataclass(frozen=True)
class GpuTask:
    """Everything one GPU's replay depends on (hashable key + the arrays)."""

    key: tuple
    ranks: np.ndarray
    requests: RequestArrays
    flags: ServerConfig  # the GPU's flags (``GpuPlan.server``; hashable, part of ``key``)
    adapter_ids: tuple[str, ...]


def routing_draws(derived: DerivedWorkload, seed: int) -> np.ndarray:
    """One uniform per replay request: where a request of a split adapter goes (plan-independent)."""
    return np.random.default_rng([int(seed), ROUTING_KEY]).random(len(derived.replay))


def split_plan(plan: Plan, derived: DerivedWorkload, draws: np.ndarray, partial: bool = False) -> list[GpuTask]:
    """One task per non-empty GPU of ``plan``: its requests (local adapter indices) and flags.

    ``partial`` allows a plan of a subset of the adapters (the others' requests are dropped)."""
    index = {a: i for i, a in enumerate(derived.adapter_ids)}
    routes = plan.routes()
    missing = [a for a in derived.adapter_ids if a not in routes]
    if missing and not partial:
        raise SpecError(f"plan of {plan.method!r} routes no GPU for {len(missing)} adapter(s) "
                        f"(e.g. {missing[0]}); expected every adapter placed")
    unknown = [a for a in routes if a not in index]
    if unknown:
        raise SpecError(f"plan of {plan.method!r} places unknown adapter {unknown[0]!r}")
    # share interval [lo, hi) of every (adapter, gpu) pair, in the route order of the plan
    interval: dict[tuple[int, int], tuple[float, float]] = {}
    for a, lst in routes.items():
        lo = 0.0
        for j, (gi, w) in enumerate(lst):
            hi = 1.0 if j == len(lst) - 1 else lo + w
            interval[(index[a], gi)] = (lo, hi)
            lo = hi
    rep = derived.replay
    order = np.argsort(rep.adapter, kind="stable")  # requests grouped by adapter, time order inside
    bounds = np.searchsorted(rep.adapter[order], np.arange(len(derived.adapter_ids) + 1))
    tasks = []
    for gi, g in enumerate(plan.gpus):
        if not g.adapters:
            continue
        picks, local, key = [], [], []
        for li, a in enumerate(g.adapters):
            ai = index[a]
            lo, hi = interval.get((ai, gi), (0.0, 0.0))
            rows = order[bounds[ai]:bounds[ai + 1]]
            if (lo, hi) != (0.0, 1.0):
                u = draws[rows]
                rows = rows[(u >= lo) & (u < hi)]
            picks.append(rows)
            local.append(np.full(len(rows), li, dtype=np.int32))
            key.append((ai, lo, hi))
        rows = np.concatenate(picks)
        loc = np.concatenate(local)
        srt = np.lexsort((loc, rep.t_arr_s[rows]))
        rows, loc = rows[srt], loc[srt]
        req = RequestArrays(rep.t_arr_s[rows], loc, rep.prompt_tokens[rows], rep.output_tokens[rows])
        flags = g.server
        tasks.append(GpuTask(key=(tuple(key), flags), ranks=derived.ranks[[index[a] for a in g.adapters]],
                             requests=req, flags=flags, adapter_ids=tuple(g.adapters)))
    return tasks


# ---------------------------------------------------------------------------------------------------------
# one GPU


def replay_gpu(profile: Profile, task: GpuTask, window_s: float) -> GpuReplay:
    """The twin run of one GPU over the whole window (pure: safe in a worker process)."""
    import time

    from ..twin.run import simulate_requests

    t0 = time.perf_counter()
    a, s = task.flags.max_loras, task.flags.max_lora_rank
    m, res = simulate_requests(profile, task.ranks, task.requests, task.flags, window_s)
    req = task.requests
    if res is None:  # vLLM refuses to start: nothing completes
        p = req.prompt_tokens.astype(np.int64)
        o = req.output_tokens.astype(np.int64)
        sent = req.t_arr_s < window_s
        return GpuReplay(
            n_adapters=len(task.ranks), max_loras=a, max_lora_rank=s, n_requests=int(sent.sum()), oom=True,
            error_type=m.error_type, starved=True, throughput_tok_s=0.0,
            incoming_tok_s=float((p[sent] + o[sent]).sum()) / window_s, itl_mean_ms=NAN, itl_p99_ms=NAN,
            ttft_mean_s=NAN, ttft_p99_s=NAN, ttft_penalised_s=window_s, n_completed=0,
            starved_adapters=list(task.adapter_ids), decode_gaps=0, decode_span_s=0.0,
            ttft_samples_s=np.empty(0, np.float32), wall_s=time.perf_counter() - t0)
    done = np.isfinite(res.t_finish_s) & (res.t_finish_s <= window_s) & (req.t_arr_s < window_s)
    ttft = (res.t_first_s[done] - res.t_sent_s[done] + res.ttft_overhead_ms / 1000.0).astype(np.float32)
    gaps = req.output_tokens[done].astype(np.int64) - 1
    span = res.t_finish_s[done] - res.t_first_s[done]
    return GpuReplay(
        n_adapters=len(task.ranks), max_loras=a, max_lora_rank=s, n_requests=m.n_arrived, oom=False,
        error_type=None, starved=bool(m.starved), throughput_tok_s=m.throughput_tok_s,
        incoming_tok_s=m.incoming_tok_s, itl_mean_ms=m.itl_mean_ms,
        itl_p99_ms=m.itl_p99_ms,  # every inter-token gap of the window (twin.gaps)
        ttft_mean_s=m.ttft_mean_ms / 1000.0, ttft_p99_s=m.ttft_p99_ms / 1000.0,
        ttft_penalised_s=m.ttft_penalised_mean_ms / 1000.0, n_completed=m.n_completed,
        starved_adapters=[task.adapter_ids[i] for i in m.starved_adapter_indices],
        decode_gaps=int(gaps.sum()), decode_span_s=float(span.sum()), ttft_samples_s=ttft,
        wall_s=time.perf_counter() - t0)


# ---------------------------------------------------------------------------------------------------------
# a whole plan

# ``mapper(fn, [(args), ...])`` -> results in order; the default runs in this process
Mapper = Callable[[Callable, list[tuple]], Iterable]


def _serial(fn: Callable, args: list[tuple]) -> list:
    return [fn(*a) for a in args]


class Replayer:
    """Replays plans of one derived workload on one profile; caches GPU results across plans."""

    def __init__(self, profile: Profile, derived: DerivedWorkload, seed: int = 0,
                 mapper: Mapper | None = None) -> None:
        self.profile = profile
        self.derived = derived
        self.draws = routing_draws(derived, seed)
        self.mapper = mapper or _serial
        self.cache: dict[tuple, GpuReplay] = {}
        self.simulated = 0  # GPU replays actually run (cache misses)

    def replay(self, plan: Plan, objective: Objective | None = None, partial: bool = False
               ) -> FleetReplay:
        return self.replay_many([plan], objective, partial)[0]

    def replay_many(self, plans: list[Plan], objective: Objective | None = None, partial: bool = False
                    ) -> list[FleetReplay]:
        """Replay several plans; their distinct uncached GPUs run in one parallel batch."""
        split = [split_plan(p, self.derived, self.draws, partial) for p in plans]
        todo = {t.key: t for tasks in split for t in tasks if t.key not in self.cache}
        if todo:
            window = self.derived.replay_window_s
            results = self.mapper(replay_gpu, [(self.profile, t, window) for t in todo.values()])
            for key, r in zip(todo, results, strict=True):
                self.cache[key] = r
            self.simulated += len(todo)
        return [FleetReplay(gpus=[self.cache[t.key] for t in tasks], window_s=self.derived.replay_window_s,
                            objective=objective or Objective.throughput()) for tasks in split]
