"""A lower bound on the GPUs any plan needs (placement.md §5), so every plan reports its optimality gap.

**Capacity ``K(S)``.** The twin serves one adapter of rank ``S`` (``--max-loras 1``, ``--max-lora-rank S``: the
largest KV cache), the workload's length law (``Instance.lengths``: fixed, log-normal with its cv, empirical;
none given: the profile's law around the workload's means), arrivals far above capacity (a
client cap of 4,096 waiting requests keeps the queue finite), scheduler overhead zero, 1,800 s; ``C(S)`` = the
tokens of requests completed in [300 s, 1,800 s] per second. More adapters only add LoRA and scheduler cost
and take KV memory, so no GPU whose largest rank is ``S`` completes more; a GPU that is not starved has offered
load <= throughput / 0.9, hence ``K(S) = C(S) / 0.9``.

**Latency row** (objectives with latency limits): ``K(S) = min(C(S) / 0.9, L(S))`` where ``L(S)`` is the largest
offered load (tokens/s) at which that best-case GPU -- one adapter of rank ``S``, ``--max-loras 1`` -- still
meets every latency limit in at least one of the verification's seeds, simulated as verification does (the
full hour, the verifier's arrival law: Poisson or a load profile). A GPU with more adapters pays LoRA and
scheduler costs on top, so no GPU that passes verification carries more (up to simulation noise, which the
"one seed of three" rule and the bracket's upper end absorb). Bisection: the bracket ``(0, K(S)]`` halved
``LATENCY_BISECTION_STEPS`` times, ``L(S)`` = its upper end (the smallest load seen failing), or 0 when not even
the lightest load tried passes -- then no GPU meets the objective and ``lower_bound`` says so (splitting hot
adapters would not help); about ten hour-long runs per rank class, cached.

``C(S)`` and ``L(S)`` are computed lazily and cached on disk, one JSON file in the user cache directory
(``$LORAPACK_CACHE_DIR``, else ``$XDG_CACHE_HOME/lorapack``, else ``~/.cache/lorapack``), keyed by profile
hash, twin source hash, ``S``, the rounded mean lengths and the length law (unless the profile's own): the first bound for a profile and lengths costs
about a second per rank class, later ones nothing.

**Aggregated MILP**: one integer ``y_S`` per rank class, continuous demand and count splits ``f_{r,S}``,
``m_{r,S}`` (``S >= r``); minimise ``Σ y_S`` subject to demand, count, capacity ``Σ_r f_{r,S} <= K(S) y_S`` and
(optional) ``Σ_r m_{r,S} <= N_max y_S``. Any valid plan induces a feasible solution, so the optimum is a lower
bound. Its structure (nested neighbourhoods) lets ``min_gpus`` solve it exactly without a MILP solver;
the tests hold it to ``scipy.optimize.milp`` (HiGHS).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import LorapackError, SpecError
from ..objective import STARVATION_RATIO, Objective
from ..oracle import CandidateArrivals, default_slot_rank
from ..profile import Profile
from ..server import ServerConfig
from ..spec import LengthsSpec
from .greedy import N_MAX
from .problem import Instance

CAPACITY_FORMAT = 1
CAPACITY_DURATION_S = 1800.0
CAPACITY_WARMUP_S = 300.0
CAPACITY_CLIENT_CAP = 4096

# capacity function: (slot rank S) -> C(S), completed tokens/s at saturation
CapacityFn = Callable[[int], float]
LATENCY_BISECTION_STEPS = 6  # bracket / 64: < 2 % of K(S)


def cache_dir() -> Path:
    env = os.environ.get("LORAPACK_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "lorapack"


def _twin_source_hash() -> str:
    twin = Path(__file__).resolve().parent.parent / "twin"
    h = hashlib.sha256()
    for f in sorted(twin.glob("*.py")):
        h.update(f.read_bytes())
    return h.hexdigest()[:12]


def _capacity_key(profile: Profile, slot_rank: int, mean_input_tokens: float, mean_output_tokens: float,
                  lengths: LengthsSpec | None = None) -> str:
    from ..oracle import length_law_key

    law = length_law_key(lengths, profile)  # None for the profile's law: keys of older caches stay valid
    return (f"f{CAPACITY_FORMAT}|{profile.gpu}|{profile.model}|{profile.file_hash()}|twin-{_twin_source_hash()}|"
            f"S{slot_rank}|in{round(mean_input_tokens)}|out{round(mean_output_tokens)}"
            + ("" if law is None else "|law-" + "-".join(str(x) for x in law)))


def simulate_capacity_tok_s(profile: Profile, slot_rank: int, mean_input_tokens: float,
                            mean_output_tokens: float, seed: int = 0, lengths: LengthsSpec | None = None) -> float:
    """``C(S)``: completed tokens/s of one saturated GPU (see the module docstring)."""
    from ..oracle import GpuCandidate, candidate_workload
    from ..profile import SchedulerModel
    from ..twin.run import engine_config, resolve_server, simulate_requests
    from ..twin.steptime import capacity_bound_tok_s
    from ..workload import generate_requests

    zero = SchedulerModel(ms_per_running=0.0, const_ms=0.0, ms_per_waiting=0.0, ms_per_waiting_slot_ratio=0.0,
                          baseline_ms=0.0)
    prof = profile.model_copy(update={"scheduler": zero})
    ranks = np.array([slot_rank])
    flags = ServerConfig(max_loras=1, max_lora_rank=slot_rank, client_cap=CAPACITY_CLIENT_CAP)
    srv = resolve_server(prof, ranks, flags)
    if not srv.starts:
        raise LorapackError(f"{profile.model}: vLLM does not start with --max-loras 1 --max-lora-rank {slot_rank}")
    cfg = engine_config(prof, ranks, srv, CAPACITY_DURATION_S)
    tau = mean_input_tokens + mean_output_tokens
    # arrivals at twice the step-time model's hard upper bound on throughput (at most 200 req/s): saturated
    rate = min(2.0 * capacity_bound_tok_s(cfg.step_coef) / tau, 200.0)
    cand = GpuCandidate(profile=prof, ranks=ranks, rates_rps=np.array([rate]),
                        server=ServerConfig(max_loras=1, max_lora_rank=slot_rank),
                        mean_input_tokens=mean_input_tokens, mean_output_tokens=mean_output_tokens, lengths=lengths)
    req = generate_requests(candidate_workload(cand, CAPACITY_DURATION_S), CAPACITY_DURATION_S, seed)
    _m, res = simulate_requests(prof, ranks, req, flags, CAPACITY_DURATION_S)
    assert res is not None
    tok = req.prompt_tokens.astype(np.float64) + req.output_tokens
    done = np.isfinite(res.t_finish_s) & (res.t_finish_s >= CAPACITY_WARMUP_S) & \
        (res.t_finish_s <= CAPACITY_DURATION_S)
    return float(tok[done].sum()) / (CAPACITY_DURATION_S - CAPACITY_WARMUP_S)


def _read_cache(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def twin_capacity(profile: Profile, mean_input_tokens: float, mean_output_tokens: float,
                  use_cache: bool = True, lengths: LengthsSpec | None = None) -> CapacityFn:
    """``S -> C(S)`` from the twin, cached on disk (see the module docstring); ``lengths``: the workload's
    length law (None: the profile's)."""
    return _disk_cached("capacity.json",
                        lambda s: _capacity_key(profile, s, mean_input_tokens, mean_output_tokens, lengths),
                        lambda s: simulate_capacity_tok_s(profile, s, round(mean_input_tokens),
                                                          round(mean_output_tokens), lengths=lengths), use_cache)


def _disk_cached(file: str, key_of: Callable[[int], str], compute: Callable[[int], float],
                 use_cache: bool) -> CapacityFn:
    """``S -> compute(S)``, memoised and cached in ``cache_dir() / file`` under ``key_of(S)``."""
    path = cache_dir() / file
    memo: dict[int, float] = {}

    def cap(slot_rank: int) -> float:
        if slot_rank in memo:
            return memo[slot_rank]
        key = key_of(slot_rank)
        data = _read_cache(path) if use_cache else {}
        if key in data:
            memo[slot_rank] = float(data[key])
            return memo[slot_rank]
        c = compute(slot_rank)
        memo[slot_rank] = c
        if use_cache:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                data = _read_cache(path)  # re-read: another process may have added entries
                data[key] = c
                tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
                tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
                tmp.replace(path)
            except OSError:
                pass  # an unwritable cache only costs time
        return c

    return cap


@dataclass(frozen=True)
class VerifierRuns:
    """How verification simulates a GPU, which the latency row ``L(S)`` repeats: the arrival law (None:
    Poisson), the seeds and the window."""

    arrivals: CandidateArrivals | None = None
    seeds: tuple[int, ...] = (1000, 1001, 1002)
    duration_s: float = 3600.0
    lengths: LengthsSpec | None = None  # the workload's length law (None: the profile's)


def latency_capacity(profile: Profile, mean_input_tokens: float, mean_output_tokens: float, objective: Objective,
                     throughput_capacity: CapacityFn, runs: VerifierRuns = VerifierRuns(),
                     use_cache: bool = True) -> CapacityFn:
    """``S -> L(S)``, the latency row of the bound (module docstring), cached on disk. ``throughput_capacity``
    gives ``C(S)`` (the bracket's top); ``runs`` are the verifier's."""
    arrivals = runs.arrivals
    law = "poisson" if arrivals is None else hashlib.sha256(arrivals.model_dump_json().encode()).hexdigest()[:16]
    limits = json.dumps(objective.limits(), sort_keys=True)

    def key_of(s: int) -> str:
        # "lat2": since L(S) = 0 when no load tried meets the limits (it was the lightest load tried)
        return (f"{_capacity_key(profile, s, mean_input_tokens, mean_output_tokens, runs.lengths)}|lat2{limits}|"
                f"law-{law}|"
                f"seeds{','.join(map(str, runs.seeds))}|{runs.duration_s:g}s")

    def compute(s: int) -> float:
        return simulate_latency_capacity_tok_s(profile, s, mean_input_tokens, mean_output_tokens, objective,
                                               float(throughput_capacity(s)) / STARVATION_RATIO, runs)

    return _disk_cached("latency_capacity.json", key_of, compute, use_cache)


def simulate_latency_capacity_tok_s(profile: Profile, slot_rank: int, mean_input_tokens: float,
                                    mean_output_tokens: float, objective: Objective, top_tok_s: float,
                                    runs: VerifierRuns) -> float:
    """``L(S)`` by bisection on one adapter's rate (module docstring); ``top_tok_s`` if the top of the bracket
    already passes (no latency limit binds before starvation)."""
    from ..oracle import GpuCandidate, TwinOracle

    tau = mean_input_tokens + mean_output_tokens
    seeds = runs.seeds
    plain = TwinOracle(seeds=seeds, duration_s=runs.duration_s, early_stop=False, arrivals=runs.arrivals)

    def passes(rate_rps: float) -> bool:  # in at least one seed: the first passing seed ends it
        cand = GpuCandidate(profile=profile, ranks=np.array([slot_rank]), rates_rps=np.array([rate_rps]),
                            server=ServerConfig(max_loras=1, max_lora_rank=slot_rank),
                            mean_input_tokens=mean_input_tokens,
                            mean_output_tokens=mean_output_tokens, lengths=runs.lengths)
        return any(objective.check(TwinOracle.aggregate(cand, [plain.simulate(cand, s)])) is None for s in seeds)

    top = top_tok_s / tau
    lo, hi = 0.0, top  # the top (11 % above saturation) is tested only if every lower load passes
    for _ in range(LATENCY_BISECTION_STEPS):
        mid = 0.5 * (lo + hi)
        if passes(mid):
            lo = mid
        else:
            hi = mid
    if hi == top and passes(top):
        return top_tok_s
    if lo == 0.0:  # not even the lightest load tried (top / 2**steps) met the limits: no GPU meets them
        return 0.0
    return hi * tau


class ObjectiveUnreachable(SpecError):
    """No GPU meets the objective's latency limits even with one adapter alone at a light load."""


@dataclass
class LowerBound:
    """The bound and its parts. ``gpus`` counts the N_max row; compare methods that may exceed N_max per GPU
    (dlora, loraserve) with ``gpus_no_nmax``."""

    gpus: int
    gpus_no_nmax: int
    throughput_bound: int  # ceil(τ Σλ / max_S K(S))
    count_bound: int  # ceil(M / N_max)
    capacity_tok_s: dict[int, float]  # K(S) = min(C(S) / 0.9, L(S)) per slot rank class
    hot_adapters: list[str] = field(default_factory=list)  # τλ_i > max_{S >= r_i} K(S)
    solve_ms: float = 0.0
    n_max: int = N_MAX
    latency_capacity_tok_s: dict[int, float] = field(default_factory=dict)  # L(S); empty: no latency row

    def to_dict(self) -> dict:
        return {"gpus": self.gpus, "gpus_no_nmax": self.gpus_no_nmax, "throughput_bound": self.throughput_bound,
                "count_bound": self.count_bound, "n_max": self.n_max,
                "capacity_tok_s": {str(k): round(v, 1) for k, v in self.capacity_tok_s.items()},
                "latency_capacity_tok_s": {str(k): round(v, 1) for k, v in self.latency_capacity_tok_s.items()},
                "hot_adapters": list(self.hot_adapters), "solve_ms": round(self.solve_ms, 3)}


def min_gpus(classes: list[int], demand: dict[int, float], count: dict[int, int], k: dict[int, float],
             n_max: int | None) -> int:
    """The optimum of the aggregated MILP (module docstring), solved exactly by a dynamic programme.

    A rank class ``r`` may be served by slots ``S >= r`` only, so the neighbourhoods are nested and Hall's
    condition reduces to the suffixes: a ``y`` is feasible iff for every class ``t``, the capacity of the
    GPUs whose slot is ``>= t`` covers the demand of the classes ``>= t`` (``Σ_{S>=t} K(S) y_S >= Σ_{r>=t} d_r``)
    and likewise their adapter slots the adapters (``Σ_{S>=t} N_max y_S >= Σ_{r>=t} n_r``). Over the classes
    from the largest down, ``best[Y]`` is the most capacity ``Y`` GPUs of the classes seen so far can give while
    meeting every suffix seen so far; adding class ``S`` is a max-plus step, ``best'[Y] = K(S) Y +
    max_{Y'<=Y} (best[Y'] - K(S) Y')`` (a prefix maximum). The answer is the smallest ``Y`` left feasible.
    Exact, microseconds, and no ``scipy.optimize`` import (about 0.3 s of a cold ``lorapack place``);
    ``tests/test_bound_dp.py`` checks it against ``scipy.optimize.milp`` on random instances."""
    if not classes:
        return 0
    desc = sorted(classes, reverse=True)
    scale = max(max(demand.values(), default=0.0), 1.0)
    tol = 1e-9 * scale  # demand exactly equal to a capacity multiple stays feasible
    suffix_demand, suffix_count, best_k = {}, {}, {}
    d_acc, n_acc, k_acc = 0.0, 0, 0.0
    for s in desc:
        d_acc += float(demand[s])
        n_acc += int(count[s])
        k_acc = max(k_acc, float(k[s]))
        suffix_demand[s], suffix_count[s], best_k[s] = d_acc, n_acc, k_acc
    # a feasible Y: each class served alone by GPUs of the best class at or above it
    y_max = 0
    for s in desc:
        if demand[s] > 0:
            if best_k[s] <= 0:
                raise LorapackError(f"the lower bound has no GPU class with capacity for rank class {s}")
            y_max += math.ceil(float(demand[s]) / best_k[s])
        if n_max is not None:
            y_max += math.ceil(int(count[s]) / n_max)
    y = np.arange(y_max + 1, dtype=np.float64)
    best = np.full(y_max + 1, -np.inf)
    best[0] = 0.0
    for s in desc:
        ks = float(k[s])
        best = ks * y + np.maximum.accumulate(best - ks * y)
        infeasible = best < suffix_demand[s] - tol
        if n_max is not None:
            infeasible |= y * n_max < suffix_count[s]
        best[infeasible] = -np.inf
    feasible = np.flatnonzero(np.isfinite(best))
    if feasible.size == 0:  # cannot happen: y_max is feasible by construction
        raise LorapackError("the lower-bound programme found no feasible GPU count")
    return int(feasible[0])


def lower_bound(inst: Instance, profile: Profile | None = None, *, n_max: int = N_MAX,
                capacity: CapacityFn | None = None, latency_capacity: CapacityFn | None = None) -> LowerBound:
    """The aggregated-MILP lower bound of placement.md §5 for ``inst`` (rates incl. headroom).

    ``capacity`` maps a slot rank ``S`` to ``C(S)`` (completed tokens/s at saturation); default the twin's
    (``twin_capacity``, needs ``profile``). ``latency_capacity`` maps ``S`` to ``L(S)`` (the latency row, module
    docstring; None: no latency limit). Toy capacities are for tests."""
    t0 = time.perf_counter()
    if capacity is None:
        if profile is None:
            raise LorapackError("lower_bound needs a profile or a capacity function")
        capacity = twin_capacity(profile, inst.mean_input_tokens, inst.mean_output_tokens, lengths=inst.lengths)
    slot = np.array([default_slot_rank(int(r)) for r in inst.ranks])
    classes = sorted(set(slot.tolist()))
    k_thr = {s: float(capacity(s)) / STARVATION_RATIO for s in classes}
    k_lat = {s: float(latency_capacity(s)) for s in classes} if latency_capacity is not None else {}
    unmet = [s for s, v in k_lat.items() if v <= 0]
    if unmet:
        s = unmet[0]
        raise ObjectiveUnreachable(f"no GPU meets the latency limits even with one adapter alone (--max-lora-rank {s}) at "
                        f"{k_thr[s] / 2 ** LATENCY_BISECTION_STEPS:,.0f} tok/s, 1/{2 ** LATENCY_BISECTION_STEPS} of "
                        f"what it serves saturated, in any of the verifier's seeds; expected looser limits "
                        f"(splitting adapters or more GPUs cannot help)")
    k = {s: min(k_thr[s], k_lat.get(s, math.inf)) for s in classes}
    d_tok = inst.demand_tok_s
    demand = {s: float(d_tok[slot == s].sum()) for s in classes}
    # adapters, not entries: the replicas of a split adapter may share a GPU
    count = {s: len({a for a, x in zip(inst.adapter_ids, slot, strict=True) if x == s}) for s in classes}
    # hot: one adapter's demand (all its replicas: split entries share an id) above every admissible K(S)
    best_k = {s: max(k[x] for x in classes if x >= s) for s in classes}
    per_adapter: dict[str, float] = {}
    cls: dict[str, int] = {}
    for a, d, s in zip(inst.adapter_ids, d_tok, slot, strict=True):
        per_adapter[a] = per_adapter.get(a, 0.0) + float(d)
        cls[a] = int(s)
    hot = [a for a, d in per_adapter.items() if d > best_k[cls[a]]]
    g = min_gpus(classes, demand, count, k, n_max)
    g_free = min_gpus(classes, demand, count, k, None)
    return LowerBound(
        gpus=max(g, 1), gpus_no_nmax=max(g_free, 1),
        throughput_bound=max(1, math.ceil(float(d_tok.sum()) / max(k.values()) - 1e-9)),
        count_bound=max(1, math.ceil(len(set(inst.adapter_ids)) / n_max)), capacity_tok_s=k, hot_adapters=hot,
        solve_ms=(time.perf_counter() - t0) * 1e3, n_max=n_max, latency_capacity_tok_s=k_lat)
