"""Inter-token gaps as a log-binned histogram, for ITL percentiles without per-token times (``twin.metrics``).

The real benchmark's ITL statistics are over the flattened list of every gap between two streamed tokens of
a request. The engines add each gap (``t_token - t_previous_token`` of the same request, so a gap spanning
a stall or a preemption is one long gap, as the client sees it) to ``GAP_BINS`` bins from ``GAP_MIN_MS``:
each doubling split into ``SUB_BINS`` linear bins (0.8-1.6 % wide); a percentile read from the histogram is
exact to about one percent. Bins are read off the bits of the gap as a float64 (exponent and leading mantissa
bits): no logarithm, no library call.

Every gap that ends inside the window counts, whether or not its request completes by the window's end (the
benchmark keeps only completed requests; the difference is the unfinished requests' gaps, a small share
except in starved runs). ``gap_bin`` is written in the numba subset: the fast engine inlines it, the
reference engine calls it as plain Python, so both bin every gap identically.
"""

from __future__ import annotations

import numpy as np

GAP_MIN_MS = 0.1  # lower edge of the first bin (no engine step is this short)
SUB_BITS = 6
SUB_BINS = 1 << SUB_BITS  # linear bins per doubling (64): each is 0.8-1.6 % wide
OCTAVES = 32  # up to 0.1 ms * 2**32 ~ 4e8 ms; longer gaps land in the last bin
GAP_BINS = SUB_BINS * OCTAVES
_MANTISSA_BITS = 52  # of a float64, whose exponent is stored with a bias of 1023
_BIN_OF_ONE = 1023 * SUB_BINS  # the bits of x = 1.0 shifted as below


def gap_bin(gap_s: float) -> int:
    """The histogram bin of one gap of ``gap_s`` seconds: the doubling ``E`` of ``x = gap / GAP_MIN_MS`` and the
    linear sub-bin within it, i.e. ``E * SUB_BINS + floor((x / 2**E - 1) * SUB_BINS)``.

    For ``x = 1.f * 2**E`` (a normal float64 > 1) that is the biased exponent followed by the ``SUB_BITS``
    leading bits of the mantissa ``f``, minus the same for 1.0: one shift of the float's bits, exact (the same
    bins as ``math.frexp``: ``(e - 1) * SUB_BINS + int((2m - 1) * SUB_BINS)`` with ``x = m * 2**e``). Written in
    the numba subset (the fast engine inlines it; the reference engine calls it as plain Python)."""
    x = gap_s * 1000.0 / GAP_MIN_MS
    if x <= 1.0:
        return 0
    k = (np.float64(x).view(np.int64) >> (_MANTISSA_BITS - SUB_BITS)) - _BIN_OF_ONE
    return int(k) if k < GAP_BINS else GAP_BINS - 1


def bin_edges_ms(k: int) -> tuple[float, float]:
    """Lower and upper edge of bin ``k`` in ms."""
    octave, sub = divmod(k, SUB_BINS)
    base = GAP_MIN_MS * 2.0 ** octave
    return base * (1.0 + sub / SUB_BINS), base * (1.0 + (sub + 1) / SUB_BINS)


def new_histogram() -> np.ndarray:
    return np.zeros(GAP_BINS, dtype=np.int64)


def percentile_ms(hist: np.ndarray, q: float) -> float:
    """The ``q``-th percentile (0-100) of the gaps in ``hist``, in ms (NaN for an empty histogram), by linear
    interpolation inside the bin."""
    total = int(hist.sum())
    if total == 0:
        return float("nan")
    target = q / 100.0 * total
    cum = np.cumsum(hist)
    k = min(int(np.searchsorted(cum, target, side="left")), len(hist) - 1)
    below = float(cum[k - 1]) if k > 0 else 0.0
    frac = (target - below) / float(hist[k]) if hist[k] > 0 else 0.0
    lo, hi = bin_edges_ms(k)
    return float(lo + min(max(frac, 0.0), 1.0) * (hi - lo))
