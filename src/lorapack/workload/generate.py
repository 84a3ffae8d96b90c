"""Turn a ``Workload`` into the engine's ``RequestArrays`` (arrivals, adapters, and lengths from ``workload.lengths``).

Common random numbers: adapter ``i`` draws its arrivals from ``default_rng([seed, i, STREAM_ARRIVALS])`` and
its lengths from ``default_rng([seed, i, STREAM_LENGTHS])`` (and the unpredictable regime from
``STREAM_REGIME``), so its requests depend only on ``(seed, i)`` and its own rate: adding adapters or changing
another adapter's rate leaves them unchanged, and sweeping N or A reuses streams (smooth curves).
Trace mode draws scaling and assignment from its own streams keyed by ``(seed, TRACE_KEY)``.
"""

from __future__ import annotations

import math
import operator

import numpy as np

from ..errors import ResourceLimitError, SpecError
from ..guards import DEFAULT_LIMITS, FORCE_HINT, HARD_MAX_REQUESTS, Limits
from ..spec import (
    LognormalArrivals,
    ModulatedArrivals,
    PoissonArrivals,
    TraceArrivals,
    UnpredictableArrivals,
    Workload,
)
from ..twin.types import RequestArrays
from .arrivals import (
    TooManyArrivals,
    lognormal_times,
    modulated_times,
    poisson_times,
    unpredictable_multipliers,
    unpredictable_times,
)
from .lengths import length_draws, lengths_from_draws
from .trace import assign_adapters, assignment_weights, load_trace, scaled_trace

# Stream ids must be non-zero: numpy's SeedSequence treats [a, b] and [a, b, 0] as the same entropy.
STREAM_ARRIVALS = 1
STREAM_LENGTHS = 2
STREAM_REGIME = 3
TRACE_KEY = 0x7472616365  # "trace", in the adapter-index slot: no real adapter index reaches it
TRACE_STREAM_SCALE = 1
TRACE_STREAM_ASSIGN = 2


def stream_rng(seed: int, index: int, stream: int) -> np.random.Generator:
    """The generator of one (adapter or trace) stream."""
    return np.random.default_rng([seed, index, stream])


def _check_args(duration_s: float, seed: int) -> int:
    """Validate the window and return the seed as a plain int (SeedSequence needs it >= 0)."""
    numeric = isinstance(duration_s, int | float | np.floating | np.integer) and not isinstance(duration_s, bool)
    if not (numeric and math.isfinite(duration_s) and duration_s > 0):
        raise SpecError(f"duration_s: expected a finite number of seconds > 0, got {duration_s!r}")
    if isinstance(seed, bool):
        raise SpecError(f"seed: expected a non-negative integer, got {seed!r}")
    try:
        seed = operator.index(seed)
    except TypeError:
        raise SpecError(f"seed: expected a non-negative integer, got {seed!r}") from None
    if seed < 0:
        raise SpecError(f"seed: expected a non-negative integer, got {seed!r}")
    return seed


def adapter_ranks(workload: Workload) -> np.ndarray:
    """LoRA rank of every adapter, int32 [n_adapters], registration order."""
    return workload.ranks


def adapter_arrival_times(workload: Workload, index: int, duration_s: float, seed: int,
                          max_count: int | None = None) -> np.ndarray:
    """Arrival times of adapter ``index`` in ``[0, duration_s)`` (not for trace arrivals).

    More than ``max_count`` arrivals raise ``arrivals.TooManyArrivals``."""
    spec = workload.arrivals
    rate_rps = workload.adapters[index].rate_rps
    rng = stream_rng(seed, index, STREAM_ARRIVALS)
    if isinstance(spec, PoissonArrivals):
        return poisson_times(rng, rate_rps, duration_s, max_count=max_count)
    if isinstance(spec, LognormalArrivals):
        return lognormal_times(rng, rate_rps, duration_s, spec.sigma, max_count=max_count)
    if isinstance(spec, ModulatedArrivals):
        return modulated_times(rng, rate_rps, duration_s, spec, max_count)
    if isinstance(spec, UnpredictableArrivals):
        times, _ = unpredictable_times(rng, stream_rng(seed, index, STREAM_REGIME), rate_rps, duration_s, spec,
                                       max_count)
        return times
    raise TypeError(f"no per-adapter arrival process for {type(spec).__name__}")


def unpredictable_rate_multipliers(workload: Workload, duration_s: float, seed: int) -> np.ndarray:
    """float64 [n_adapters, n_periods]: each adapter's rate multiplier per period (unpredictable arrivals)."""
    spec = workload.arrivals
    if not isinstance(spec, UnpredictableArrivals):
        raise SpecError("rate multipliers exist only for arrivals of kind 'unpredictable'")
    seed = _check_args(duration_s, seed)
    n_periods = max(1, math.ceil(duration_s / spec.period_s))
    return np.stack([
        unpredictable_multipliers(stream_rng(seed, i, STREAM_REGIME).random((n_periods, 2)), spec)[1]
        for i in range(workload.n_adapters)
    ]) if workload.n_adapters else np.empty((0, n_periods))


def _per_adapter_lengths(workload: Workload, counts: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Lengths of every request grouped by adapter (adapter 0's first), each adapter from its own stream."""
    spec = workload.lengths
    total = int(counts.sum())
    if spec.kind == "fixed":
        return lengths_from_draws(spec, None, total)
    draws = [length_draws(spec, int(c), stream_rng(seed, i, STREAM_LENGTHS))
             for i, c in enumerate(counts) if c > 0]
    if not draws:
        return np.empty(0, np.int32), np.empty(0, np.int32)
    return lengths_from_draws(spec, np.concatenate(draws), total)


def _stable_time_order(t_s: np.ndarray) -> np.ndarray:
    """The permutation of a stable argsort of ``t_s`` (input is in adapter order, so ties -> lower adapter).

    Without exact ties every correct sort gives the same permutation, and the unstable introsort is ~3x faster
    than numpy's stable (tim)sort on a million floats; fall back to the stable sort only if a tie exists.
    """
    order = np.argsort(t_s)
    t_sorted = t_s[order]
    if len(t_sorted) > 1 and bool(np.any(t_sorted[1:] == t_sorted[:-1])):
        order = np.argsort(t_s, kind="stable")
    return order


def generate_requests(workload: Workload, duration_s: float, seed: int, limits: Limits | None = None
                      ) -> RequestArrays:
    """All requests of ``workload`` arriving in ``[0, duration_s)``, sorted by time (ties: lower adapter).

    The adapter of a request is its registration index in ``workload.adapters``. Generation stops with a
    ``ResourceLimitError`` once it passes ``limits.request_budget()`` requests (checked as it goes: the
    nominal rate is not a bound for heavy-tailed gaps); ``twin.run.simulate`` estimates the cost even before.
    """
    seed = _check_args(duration_s, seed)
    budget = (limits or DEFAULT_LIMITS).request_budget()
    if isinstance(workload.arrivals, TraceArrivals):
        return _trace_requests(workload, workload.arrivals, float(duration_s), seed, budget)

    times: list[np.ndarray] = []
    total = 0
    for i in range(workload.n_adapters):
        try:
            t = adapter_arrival_times(workload, i, float(duration_s), seed, budget - total)
        except TooManyArrivals:
            limit = "a hard limit" if budget == HARD_MAX_REQUESTS else FORCE_HINT
            raise ResourceLimitError(
                f"adapter '{workload.adapters[i].adapter_id}' (rate_rps {workload.adapters[i].rate_rps:g}, "
                f"{workload.arrivals.kind} arrivals) takes the run past {budget:,} requests within "
                f"{float(duration_s):g} s; the limit is {budget:,} requests ({limit})") from None
        total += len(t)
        times.append(t)
    counts = np.fromiter((len(t) for t in times), dtype=np.int64, count=len(times))
    t_all = np.concatenate(times) if times else np.empty(0)
    adapter = np.repeat(np.arange(workload.n_adapters, dtype=np.int32), counts)
    prompt, output = _per_adapter_lengths(workload, counts, seed)
    order = _stable_time_order(t_all)
    return RequestArrays(t_all[order], adapter[order], prompt[order], output[order])


def _trace_requests(workload: Workload, spec: TraceArrivals, duration_s: float, seed: int,
                    budget: int = HARD_MAX_REQUESTS) -> RequestArrays:
    trace = load_trace(spec.path)
    first = int(np.searchsorted(trace.t_s, spec.start_s, side="left"))
    scaled = (len(trace) - first) * math.ceil(spec.load_scale)  # every copy is built before the window cut
    if scaled > budget:
        limit = "a hard limit" if budget == HARD_MAX_REQUESTS else FORCE_HINT
        raise ResourceLimitError(f"arrivals.load_scale {spec.load_scale:g} x {len(trace) - first:,} trace requests "
                                 f"= {scaled:,} requests to build; the limit is {budget:,} requests ({limit})")
    t0 = trace.t_s[first:] - spec.start_s
    # scaling comes before assignment (placement.md §6.2), and before the window cut
    idx, t = scaled_trace(t0, spec.load_scale, spec.jitter_s, stream_rng(seed, TRACE_KEY, TRACE_STREAM_SCALE))
    n = int(np.searchsorted(t, duration_s, side="left"))
    idx, t = idx[:n] + first, t[:n]

    assign_rng = stream_rng(seed, TRACE_KEY, TRACE_STREAM_ASSIGN)
    weights = assignment_weights(workload.n_adapters, spec.assignment, spec.zipf_s, spec.dirichlet_alpha,
                                 assign_rng)
    adapter = assign_adapters(n, weights, assign_rng)

    if spec.trace_lengths:
        prompt, output = trace.prompt_tokens[idx], trace.output_tokens[idx]
    else:
        # each adapter's requests (in time order) take lengths from its own stream, as in synthetic mode
        by_adapter = np.argsort(adapter, kind="stable")
        counts = np.bincount(adapter, minlength=workload.n_adapters)
        p_grouped, o_grouped = _per_adapter_lengths(workload, counts, seed)
        prompt = np.empty(n, np.int32)
        output = np.empty(n, np.int32)
        prompt[by_adapter] = p_grouped
        output[by_adapter] = o_grouped
    # times are sorted already; re-sort only to put exact ties in adapter order (the RequestArrays contract)
    order = np.lexsort((adapter, t))
    return RequestArrays(t[order], adapter[order], prompt[order], output[order])
