"""What simulating a workload spec will cost, estimated before anything is generated (``guards.Estimate``).

Kept with the workloads it reads (arrival laws, length tables, traces); ``lorapack.guards`` holds the limits,
the checks and the estimate of arrays already built."""

from __future__ import annotations

import math

import numpy as np

from ..guards import HARD_MAX_REQUESTS, Estimate, fmt_count, min_step_ms
from ..spec import ModulatedArrivals, TraceArrivals, UnpredictableArrivals
from .lengths import load_lengths_table
from .trace import load_trace


def _mean_tokens(workload) -> float:
    arr, lengths = workload.arrivals, workload.lengths
    if isinstance(arr, TraceArrivals) and arr.trace_lengths:
        tr = load_trace(arr.path)
        return float(tr.prompt_tokens.mean() + tr.output_tokens.mean()) if len(tr) else 0.0
    if lengths.kind == "empirical":
        table = load_lengths_table(lengths.path)
        return float(table[:, 0].mean() + table[:, 1].mean())
    if lengths.kind == "fixed":
        return float(max(1, round(lengths.mean_input_tokens)) + max(1, round(lengths.mean_output_tokens)))
    return float(lengths.mean_input_tokens + lengths.mean_output_tokens)


def estimate_workload(workload, duration_s: float, step_coef=None) -> Estimate:
    """The cost of simulating ``workload`` for ``duration_s`` (before generating anything).

    Renewal arrivals: the nominal count (sum of rates x window); generation enforces the budget as it goes,
    since heavy-tailed gaps can exceed it. Unpredictable arrivals also cost one draw per adapter-period.
    Trace arrivals: the trace's requests after ``start_s`` times ``load_scale`` (all copies are built before
    the window is cut)."""
    n = workload.n_adapters
    arr = workload.arrivals
    kw: dict = {}
    if isinstance(arr, TraceArrivals):
        t = load_trace(arr.path).t_s
        i0, i1 = (int(i) for i in np.searchsorted(t, [arr.start_s, arr.start_s + duration_s], side="left"))
        n_after, n_window = len(t) - i0, i1 - i0
        requests = n_window * arr.load_scale
        src = (f"arrivals.load_scale {arr.load_scale:g} x {n_window:,} trace requests in the first "
               f"{duration_s:g} s")
        scaled = n_after * math.ceil(arr.load_scale)
        if scaled > HARD_MAX_REQUESTS:  # the copies are built before the window is cut
            requests = max(requests, scaled)
            src = f"arrivals.load_scale {arr.load_scale:g} x {n_after:,} trace requests"
        kw = {"extra_bytes": scaled * 48.0, "extra_from": f"{fmt_count(scaled)} load-scaled trace requests"}
    else:
        rate = float(workload.rates_rps.sum())
        requests = rate * duration_s
        src = f"adapter rates summing to {rate:g} req/s over duration_s {duration_s:g} s"
        if isinstance(arr, ModulatedArrivals):
            requests *= arr.mean_multiplier
            src += f" x the rate profile's mean multiplier {arr.mean_multiplier:.3g}"
        if isinstance(arr, UnpredictableArrivals):
            per = max(1, math.ceil(duration_s / arr.period_s))
            kw = {"periods": float(per) * n,
                  "periods_from": f"arrivals.period_s {arr.period_s:g} over duration_s {duration_s:g} s "
                                  f"({fmt_count(per)} periods x {n:,} adapters)"}
    return Estimate(requests=requests, requests_from=src, duration_s=float(duration_s), n_adapters=n,
                    tokens_per_request=_mean_tokens(workload),
                    min_step_ms=min_step_ms(step_coef) if step_coef is not None else 0.0, **kw)
