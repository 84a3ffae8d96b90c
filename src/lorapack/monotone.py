"""Searches over integers for a monotone predicate: its boundary, and the smallest feasible pool (placement, the
re-planner, the evaluation's pools, the length law's reachable cv)."""

from __future__ import annotations

from collections.abc import Callable


def first_true(pred: Callable[[int], bool], false_at: int, true_at: int) -> int:
    """Bisection: the smallest x in (false_at, true_at] with ``pred(x)``, for a predicate that is False up to
    some point and True after it, known (or taken) False at ``false_at`` and True at ``true_at``."""
    while true_at - false_at > 1:
        mid = (true_at + false_at) // 2
        if pred(mid):
            true_at = mid
        else:
            false_at = mid
    return true_at


def bisect_smallest(feasible: Callable[[int], bool], lo: int, hi: int) -> tuple[int | None, list[tuple[int, bool]]]:
    """Smallest G in [lo, hi] with ``feasible(G)``, assuming feasibility is monotone in G: galloping up from
    ``lo`` (lo, lo+1, lo+3, lo+7, ...) to the first feasible G, then bisection below it. Returns
    ``(G or None, probes)``."""
    probes: list[tuple[int, bool]] = []
    memo: dict[int, bool] = {}

    def test(g: int) -> bool:
        if g not in memo:
            memo[g] = bool(feasible(g))
            probes.append((g, memo[g]))
        return memo[g]

    lo = max(1, lo)
    if hi < lo:
        return None, probes
    bad, step, g = lo - 1, 1, lo
    while not test(g):
        bad = g
        if g >= hi:
            return None, probes
        g = min(g + step, hi)
        step *= 2
    return first_true(test, bad, g), probes
