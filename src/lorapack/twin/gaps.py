"""Inter-token gaps as a log-binned histogram, for ITL percentiles without per-token times (twin.md §4.2).

The real benchmark's ITL statistics are over the flattened list of every gap between two streamed tokens of
a request. The engines add each gap (``t_token - t_previous_token`` of the same request, so a gap spanning
a stall or a preemption is one long gap, as the client sees it) to ``GAP_BINS`` logarithmic bins of 1 %
width from ``GAP_MIN_MS``; a percentile read from the histogram is exact to about half a percent.

Every gap that ends inside the window counts, whether or not its request completes by the window's end (the
benchmark keeps only completed requests; the difference is the unfinished requests' gaps, a small share
except in starved runs). ``gap_bin`` is written in the numba subset: the fast engine inlines it, the
reference engine calls it as plain Python, so both bin every gap identically.
"""

from __future__ import annotations

import math

import numpy as np

GAP_MIN_MS = 0.1  # lower edge of the first bin (no engine step is this short)
GAP_BIN_RATIO = 1.01  # each bin is 1 % wider than the previous one
GAP_BINS = 2000  # up to 0.1 ms * 1.01**2000 ~ 4e7 ms; longer gaps land in the last bin
_LOG_RATIO = math.log(GAP_BIN_RATIO)


def gap_bin(gap_s: float) -> int:
    """The histogram bin of one gap of ``gap_s`` seconds."""
    ms = gap_s * 1000.0
    if ms <= GAP_MIN_MS:
        return 0
    k = int(math.log(ms / GAP_MIN_MS) / _LOG_RATIO)
    return k if k < GAP_BINS else GAP_BINS - 1


def new_histogram() -> np.ndarray:
    return np.zeros(GAP_BINS, dtype=np.int64)


def percentile_ms(hist: np.ndarray, q: float) -> float:
    """The ``q``-th percentile (0-100) of the gaps in ``hist``, in ms (NaN for an empty histogram).

    Linear interpolation inside the bin (its edges are ``GAP_MIN_MS * GAP_BIN_RATIO**k`` and ``**(k+1)``)."""
    total = int(hist.sum())
    if total == 0:
        return float("nan")
    target = q / 100.0 * total
    cum = np.cumsum(hist)
    k = int(np.searchsorted(cum, target, side="left"))
    k = min(k, len(hist) - 1)
    below = float(cum[k - 1]) if k > 0 else 0.0
    frac = (target - below) / float(hist[k]) if hist[k] > 0 else 0.0
    lo = GAP_MIN_MS * GAP_BIN_RATIO ** k
    return float(lo + min(max(frac, 0.0), 1.0) * (lo * GAP_BIN_RATIO - lo))
