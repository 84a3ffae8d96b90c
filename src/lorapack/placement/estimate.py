"""What a placement will cost, estimated before any work, and refused when it is out of reach (issue 26, item 3).

``place()`` calls ``guard_placement`` once, right after validating the adapters and before the lower bound (whose
latency row alone simulates ~10 hour-long runs): in milliseconds, without the twin, it

* refuses an objective that no GPU can meet even with one adapter: a latency limit below the shortest engine
  step the profile allows (every token, the first included, waits at least one step);
* estimates the replicas ``--split-hot`` would make, the GPUs the plan needs at least, the memory of its entries
  and the requests the twin would simulate (verification, repair and consolidation; the twin as the method's
  oracle; the twin-validated smallest-pool search), and refuses past the placement limits of
  ``lorapack.guards`` (``--force`` lifts the soft ones, as for a single run).

Per GPU the estimate takes the step-time model's hard upper bound on throughput (``twin.early``), never less
than what the twin serves: replicas and GPUs are lower estimates, so a refusal is never an overestimate. (A
--split-hot adapter at 1e9 req/s made 65 million replicas, 11.5 GB, for 666 s; one at 3,000 req/s kept
``proposed-exact`` busy past 120 s: both now stop here in well under a second.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..errors import ResourceLimitError, SpecError
from ..guards import FORCE_HINT, Limits, fmt_bytes, fmt_count, machine_memory_bytes, min_step_ms
from ..objective import Objective
from ..oracle import default_slot_rank, length_law_problem
from ..profile import Profile
from .oracles import EXACT_DURATION_S
from .problem import Instance

# --split-hot: replicas carry at most this fraction of the capacity K(S) each (room to share a GPU)
SPLIT_TARGET = 0.5
VERIFY_DURATION_S = 3600.0  # verification simulates every GPU for the full hour
# repair, consolidation and spreading verify whole plans again: at least one more pass in practice
VERIFY_PASSES = 2
# testing points per GPU of the greedy with the twin as its oracle (measured: ~6 rows per GPU), and pools the
# smallest-pool search validates with the twin (bisection over a few sizes)
EXACT_POINTS_PER_GPU = 4
SEARCH_POOLS = 4


@dataclass(frozen=True)
class PlaceEstimate:
    """A lower estimate of one placement's size and cost, and what it comes from (for the messages)."""

    adapters: int
    entries: int  # adapters plus the replicas --split-hot adds
    gpus: int  # GPUs any plan needs at least (throughput, at the step-time model's bound per GPU)
    gpu_tok_s: float  # the most tokens/s one GPU could complete (that bound)
    twin_requests: float  # requests the twin would simulate, summed over its runs
    twin_from: str  # e.g. "3,600 req/s planned x 3 seeds x 3,600 s x 2 (verification, repair)"
    hottest: str  # the busiest adapter and its rate, e.g. "'hot' at 1e+09 req/s"
    memory_bytes: float


BYTES_PER_ENTRY = 256  # an entry's id reference, rank, rate, weight, the greedy's and the plan's state
BYTES_PER_GPU = 4096  # a GPU's fill, prediction, verdict and plan record


def gpu_capacity_bound_tok_s(profile: Profile, slot_rank: int) -> float:
    """The most tokens/s one GPU with ``--max-lora-rank slot_rank`` could complete: the step-time model's hard
    bound (each token needs at least the cheapest per-token step time), which the twin never exceeds."""
    from ..server import ServerConfig
    from ..twin.run import engine_config, resolve_server
    from ..twin.steptime import capacity_bound_tok_s

    ranks = np.array([slot_rank])
    srv = resolve_server(profile, ranks, ServerConfig(max_loras=1, max_lora_rank=slot_rank))
    return float(capacity_bound_tok_s(engine_config(profile, ranks, srv, 1.0).step_coef))


def estimate_placement(inst: Instance, profile: Profile, twin_seconds_per_rps: float, split_hot: bool
                       ) -> PlaceEstimate:
    """``inst``'s placement at a glance. ``twin_seconds_per_rps``: simulated seconds the twin runs per req/s
    planned (``twin_seconds``); ``split_hot``: replicas as ``--split-hot`` makes them."""
    import warnings

    slots = sorted({default_slot_rank(int(r)) for r in inst.ranks})
    with warnings.catch_warnings():  # a rank outside the calibrated range is warned about where it is simulated
        warnings.simplefilter("ignore")
        cap = {s: gpu_capacity_bound_tok_s(profile, s) for s in slots}
    best = max(cap.values())
    demand = inst.demand_tok_s
    entries = inst.n
    if split_hot:
        for d, r in zip(demand, inst.ranks, strict=True):
            k = max(v for s, v in cap.items() if s >= default_slot_rank(int(r)))
            entries += max(0, math.ceil(float(d) / (SPLIT_TARGET * k)) - 1)
    gpus = max(1, math.ceil(float(demand.sum()) / best - 1e-9))
    i = int(np.argmax(inst.rates_rps))
    planned_rps = float(inst.rates_rps.sum())
    return PlaceEstimate(
        adapters=len(set(inst.adapter_ids)), entries=entries, gpus=gpus, gpu_tok_s=best,
        twin_requests=planned_rps * twin_seconds_per_rps,
        twin_from=f"{planned_rps:,.4g} req/s planned x {twin_seconds_per_rps:,.0f} simulated s",
        hottest=f"'{inst.adapter_ids[i]}' at {float(inst.nominal_rates_rps[i]):.4g} req/s",
        memory_bytes=entries * BYTES_PER_ENTRY + gpus * BYTES_PER_GPU)


def twin_seconds(verify: bool, verify_seeds: int, twin_oracle: bool, pool_search: bool) -> tuple[float, str]:
    """Simulated seconds per req/s planned that the twin runs in a placement, and how they add up: the
    verification (``verify_seeds`` x the hour, ``VERIFY_PASSES`` times), the twin as the method's oracle
    (``EXACT_POINTS_PER_GPU`` testing points of ``EXACT_DURATION_S`` per GPU: the GPUs together carry the
    planned rate), the smallest-pool search validated by the twin (``SEARCH_POOLS`` pools)."""
    parts = []
    if verify:
        parts.append((verify_seeds * VERIFY_DURATION_S * VERIFY_PASSES,
                      f"verification {verify_seeds} seeds x {VERIFY_DURATION_S:,.0f} s x {VERIFY_PASSES} passes"))
    if twin_oracle:
        parts.append((EXACT_DURATION_S * EXACT_POINTS_PER_GPU,
                      f"the twin as the oracle {EXACT_POINTS_PER_GPU} x {EXACT_DURATION_S:,.0f} s"))
    if pool_search:
        parts.append((EXACT_DURATION_S * SEARCH_POOLS, f"the pool search {SEARCH_POOLS} x {EXACT_DURATION_S:,.0f} s"))
    return float(sum(p[0] for p in parts)), " + ".join(p[1] for p in parts)


def check_estimate(est: PlaceEstimate, limits: Limits, how: str) -> None:
    """``ResourceLimitError`` (one line: the input, the estimate, the limit) past a placement limit; ``how``
    says what the twin's requests come from."""
    soft = not limits.force
    hint = f"({FORCE_HINT})"
    if est.entries > est.adapters:
        what = (f"--split-hot makes at least {fmt_count(est.entries - est.adapters)} replicas (each at most "
                f"{SPLIT_TARGET:g} of the {est.gpu_tok_s:,.0f} tok/s one GPU could complete; busiest adapter "
                f"{est.hottest}) for at least {fmt_count(est.gpus)} GPUs")
    else:
        what = f"{fmt_count(est.adapters)} adapters for at least {fmt_count(est.gpus)} GPUs"
    mem, hard_mem = est.memory_bytes, machine_memory_bytes()
    if mem > hard_mem:
        raise ResourceLimitError(f"{what}: placing them needs about {fmt_bytes(mem)} of memory; the limit is all "
                                 f"of this machine's memory, {fmt_bytes(hard_mem)} (a hard limit)")
    if soft and est.entries > limits.max_place_entries:
        raise ResourceLimitError(f"{what}: {fmt_count(est.entries)} adapters and replicas to place; the limit is "
                                 f"{limits.max_place_entries:,} {hint}")
    if soft and mem > limits.memory_limit():
        raise ResourceLimitError(f"{what}: placing them needs about {fmt_bytes(mem)} of memory; the limit is "
                                 f"{fmt_bytes(limits.memory_limit())} {hint}")
    if soft and est.twin_requests > limits.max_place_twin_requests:
        raise ResourceLimitError(
            f"{what}: the twin would simulate about {fmt_count(est.twin_requests)} requests ({est.twin_from}: "
            f"{how}); the limit is {limits.max_place_twin_requests:,} {hint}, or --no-verify and a learned "
            f"method cost none")


_LIMIT_FLAGS = {"max_ttft_s": ("--max-ttft-s", "s", 1e3), "max_ttft_p99_s": ("--max-ttft-p99-s", "s", 1e3),
                "max_itl_ms": ("--max-itl-ms", "ms", 1.0), "max_itl_p99_ms": ("--max-itl-p99-ms", "ms", 1.0)}


def objective_flags(objective: Objective) -> str:
    """The objective's latency limits as ``place``'s flags, e.g. ``--max-ttft-s 2 --max-itl-ms 50``."""
    return " ".join(f"{_LIMIT_FLAGS[k][0]} {v:g}" for k, v in objective.limits().items())


def check_objective_reachable(objective: Objective, profile: Profile) -> None:
    """``SpecError`` when a latency limit lies below the shortest engine step the profile allows (one request,
    one token, no adapter, no scheduler): every token -- the first one too -- waits at least one step, so no
    GPU meets it even with one adapter at the lowest load, and splitting adapters cannot help."""
    from ..guards import profile_step_coef

    floor_ms = min_step_ms(profile_step_coef(profile))
    if floor_ms <= 0:
        return
    for key, limit in objective.limits().items():
        flag, unit, ms_per_unit = _LIMIT_FLAGS[key]
        if limit * ms_per_unit < floor_ms:
            raise SpecError(f"{flag} {limit:g}: no GPU can meet it, even with one adapter at the lowest load: one "
                            f"engine step of {profile.model} on {profile.gpu} takes at least {floor_ms:.1f} ms, and "
                            f"every token waits at least one step; expected {flag} >= "
                            f"{floor_ms / ms_per_unit:.3g} {unit} (more adapters or GPUs cannot help)")


def guard_placement(inst: Instance, profile: Profile, config, twin_oracle: bool, pool_search: bool) -> PlaceEstimate:
    """The one check ``place()`` runs before any work: the objective is reachable at all, and the placement's
    estimate (``estimate_placement``) is within the limits (``config.force`` lifts the soft ones). ``config``:
    the ``PlaceConfig``; ``twin_oracle``: the method asks the twin; ``pool_search``: a twin-validated search."""
    check_objective_reachable(config.objective, profile)
    secs, how = twin_seconds(config.verify, config.verify_seeds, twin_oracle, pool_search)
    est = estimate_placement(inst, profile, secs, config.split_hot)
    check_estimate(est, Limits(force=bool(config.force)), how)
    return est


def asks_the_twin(oracle_kind: str | None, inst: Instance, profile: Profile) -> bool:
    """Whether a greedy method of oracle ``oracle_kind`` ends up asking the twin: its own, or a learned one
    whose training does not cover the workload's length law (``api.Context.oracle_of`` falls back)."""
    if oracle_kind == "twin":
        return True
    return oracle_kind is not None and bool(length_law_problem(inst.candidate(profile, [0], 1)))
