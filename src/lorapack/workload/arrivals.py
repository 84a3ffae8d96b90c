"""Per-adapter arrival times: renewal processes (Poisson, log-normal gaps) and the "unpredictable" process.

Every function takes the adapter's own ``numpy.random.Generator`` so the caller controls common random
numbers. Gaps are drawn in blocks and cumulated (no Python loop per request). The running time is carried
into the next block by adding it to the block's first gap, so the sequential ``cumsum`` gives bit-identical
times whatever the block sizes: a longer window only appends arrivals.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from ..spec import ModulatedArrivals, UnpredictableArrivals

EMPTY_TIMES = np.empty(0, dtype=np.float64)

GapSampler = Callable[[int], np.ndarray]


MAX_BLOCK = 1 << 20  # draws per block: bounds the memory of one draw whatever the rate


class TooManyArrivals(Exception):
    """Generation passed its request budget (the caller turns it into a ``ResourceLimitError``)."""


def _block_size(expected: float, cv: float) -> int:
    # expected count + 6 sigma + 16: one block almost always suffices, the overshoot is cheap
    n = expected + 6.0 * math.sqrt(expected) * max(1.0, cv) + 16
    return MAX_BLOCK if not n < MAX_BLOCK else int(n)


def renewal_times(draw_gaps: GapSampler, rate_rps: float, window_s: float, cv: float = 1.0,
                  sizing_window_s: float | None = None, max_count: int | None = None) -> np.ndarray:
    """Arrival times in ``[0, window_s)`` of a renewal process started at 0 with mean gap ``1/rate_rps``.

    ``draw_gaps(n)`` returns n fresh gaps (a new array). ``sizing_window_s`` only sizes the first block (so
    the draws consumed do not depend on a truncated window). More than ``max_count`` arrivals raise
    ``TooManyArrivals`` (checked block by block, so a heavy-tailed law cannot exhaust the memory).
    """
    if rate_rps <= 0 or window_s <= 0:
        return EMPTY_TIMES
    n = _block_size(rate_rps * (sizing_window_s or window_s), cv)
    parts: list[np.ndarray] = []
    t_last = 0.0
    count = 0
    while True:
        gaps = draw_gaps(n)
        gaps[0] += t_last
        with np.errstate(over="ignore"):  # huge gaps of a tiny rate sum to inf: no arrival, which is right
            t = np.cumsum(gaps)
        done = not t[-1] < window_s  # also stops on inf/nan from absurdly small rates
        if done:
            t = t[: np.searchsorted(t, window_s, side="left")]
        count += len(t)
        if max_count is not None and count > max_count:
            raise TooManyArrivals(count)
        parts.append(t)
        if done:
            break
        t_last = float(t[-1])
        n = _block_size(rate_rps * (window_s - t_last), cv)
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def poisson_times(rng: np.random.Generator, rate_rps: float, window_s: float,
                  sizing_window_s: float | None = None, max_count: int | None = None) -> np.ndarray:
    """Poisson arrivals: exponential gaps with mean ``1/rate_rps``."""
    with np.errstate(over="ignore", divide="ignore"):  # an absurdly small rate gives inf gaps: no arrival
        scale = 1.0 / rate_rps if rate_rps > 0 else 0.0
        return renewal_times(lambda n: rng.standard_exponential(n) * scale, rate_rps, window_s, 1.0,
                             sizing_window_s, max_count)


def lognormal_times(rng: np.random.Generator, rate_rps: float, window_s: float, sigma: float = 1.0,
                    sizing_window_s: float | None = None, max_count: int | None = None) -> np.ndarray:
    """Log-normal gaps with mean ``1/rate_rps``: ``mu = -ln(rate) - sigma^2/2`` (placement.md §6.5)."""
    if rate_rps <= 0:
        return EMPTY_TIMES
    mu = -math.log(rate_rps) - 0.5 * sigma * sigma
    cv = math.sqrt(math.expm1(sigma * sigma)) if sigma < 26.0 else math.inf  # expm1 overflows past ~26.6

    def gaps(n: int) -> np.ndarray:
        with np.errstate(over="ignore", under="ignore"):  # a tiny rate gives inf gaps, i.e. no arrival
            return np.exp(mu + sigma * rng.standard_normal(n))

    return renewal_times(gaps, rate_rps, window_s, cv, sizing_window_s, max_count)


def unpredictable_multipliers(regime_u: np.ndarray, spec: UnpredictableArrivals) -> tuple[np.ndarray, np.ndarray]:
    """Per period: (uses log-normal gaps, rate multiplier) from uniforms ``regime_u`` of shape [K, 2].

    Period 0 runs at the nominal rate (multiplier 1, law drawn); from period 1 on the multiplier is
    multiplied or divided by ``factor`` with equal probability and clipped to ``[1/clip, clip]``.
    """
    k = len(regime_u)
    lognormal = regime_u[:, 0] < 0.5
    up = regime_u[:, 1] < 0.5
    mult = np.empty(k)
    m = 1.0
    lo, hi = 1.0 / spec.clip, spec.clip
    for j in range(k):  # one iteration per 300 s period, not per request; clipping makes it path-dependent
        if j > 0:
            m = min(hi, max(lo, m * spec.factor if up[j] else m / spec.factor))
        mult[j] = m
    return lognormal, mult


def unpredictable_times(rng: np.random.Generator, regime_rng: np.random.Generator, rate_rps: float,
                        window_s: float, spec: UnpredictableArrivals, max_count: int | None = None
                        ) -> tuple[np.ndarray, np.ndarray]:
    """Arrival times in ``[0, window_s)`` and the per-period multipliers of one adapter.

    Each period restarts its renewal process at the period start: a gap crossing the boundary is dropped
    and redrawn from the boundary with the new law and rate. More than ``max_count`` arrivals raise
    ``TooManyArrivals``.
    """
    n_periods = max(1, math.ceil(window_s / spec.period_s))
    # regime draws come from their own stream, shaped [K, 2] so a longer window only appends periods
    lognormal, mult = unpredictable_multipliers(regime_rng.random((n_periods, 2)), spec)
    if rate_rps <= 0:
        return EMPTY_TIMES, mult
    parts: list[np.ndarray] = []
    count = 0
    for j in range(n_periods):
        start = j * spec.period_s
        span = min(spec.period_s, window_s - start)
        rate = rate_rps * mult[j]
        left = None if max_count is None else max_count - count
        if lognormal[j]:
            t = lognormal_times(rng, rate, span, spec.sigma, sizing_window_s=spec.period_s, max_count=left)
        else:
            t = poisson_times(rng, rate, span, sizing_window_s=spec.period_s, max_count=left)
        count += len(t)
        parts.append(t + start)
    return np.concatenate(parts), mult


def modulated_times(rng: np.random.Generator, rate_rps: float, window_s: float, spec: ModulatedArrivals,
                    max_count: int | None = None) -> np.ndarray:
    """Arrival times in ``[0, window_s)`` of a Poisson process at ``rate_rps x multipliers[j mod K]`` in period
    ``j``: each period restarts the process at its start (exact for a memoryless law)."""
    if rate_rps <= 0 or window_s <= 0:
        return EMPTY_TIMES
    mult = spec.multipliers
    n_periods = max(1, math.ceil(window_s / spec.period_s))
    parts: list[np.ndarray] = []
    count = 0
    for j in range(n_periods):  # one iteration per period, not per request
        start = j * spec.period_s
        span = min(spec.period_s, window_s - start)
        left = None if max_count is None else max_count - count
        t = poisson_times(rng, rate_rps * mult[j % len(mult)], span, sizing_window_s=spec.period_s,
                          max_count=left)
        count += len(t)
        if len(t):
            parts.append(t + start)
    return np.concatenate(parts) if parts else EMPTY_TIMES
