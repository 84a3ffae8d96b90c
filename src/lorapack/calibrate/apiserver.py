"""Fit the API server's loop (``Profile.api_server``) and the TTFT constant on real runs (issue 27).

docs/trust-under-load.md, "Fitting the loop": the loop's constants move the tails (ITL p99, TTFT of the runs whose
stalls catch arrivals and first tokens), and per-chunk ITL through merged chunks; the step-time constants of the
refinement hold the bodies. So, after the refinement and with its engine constants fixed:

* the render time per label series and per adapter name keep the ratio of the registry fit (docs, section 3.0:
  9.45 µs per series, 0.122 µs per name) and are scaled by one factor ``s``; the render time of an empty registry
  stays at its 0.6 ms (poorly identified, and irrelevant next to the series);
* the loop's work per output ``kappa`` is one of ``KAPPA_GRID`` (its upper end is where the busiest reference runs,
  B ~ 750 at ~140 ms steps, would saturate the loop; their real ITL equals their TPOT: it does not);
* for each ``kappa`` a golden-section search over ``log s`` minimises the cost below; the TTFT constant
  (``FrontendModel.ttft_overhead_ms``) is refitted at every point as the median of real minus twin mean TTFT over
  the runs without queueing (``fit_frontend``'s rule; it needs no simulation: the constant adds to every TTFT).

Cost: the mean of squared log errors (in ``refine.RESIDUAL_SCALE`` units) of per-chunk ITL and ITL p99 over the
runs with real mean TTFT below ``TAIL_MAX_TTFT_MS`` (no long queue: the tail is the loop's), plus the same of mean
and p99 TTFT over the runs below ``FRONTEND_MAX_TTFT_MS``. Each candidate is one simulation of every run.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from ..profile import ApiServerModel, FrontendModel, Profile
from ..realruns import RunPrediction, row_float
from .refine import RESIDUAL_SCALE, Evaluator

# the registry fit of docs/trust-under-load.md (section 3.0): the start and the ratio kept between the two
REGISTRY_FIT = ApiServerModel(ms_per_output=0.1, scrape_base_ms=0.6, scrape_us_per_series=9.45,
                              scrape_us_per_label_name=0.122)
KAPPA_GRID = (0.05, 0.1, 0.15)  # ms of loop work per output of a step
SCALE_RANGE = (0.4, 3.0)  # of the render time per series and per name
GOLDEN_STEPS = 6
TAIL_MAX_TTFT_MS = 30_000.0
FRONTEND_MAX_TTFT_MS = 1000.0


def _log_err(pred: float | None, real: float | None) -> float:
    if pred is None or real is None or not (pred > 0 and real > 0) or not math.isfinite(pred):
        return math.nan
    return math.log(pred / real)


def api_cost(rows: Sequence[dict], preds: Sequence[RunPrediction | None], c_used_ms: float
             ) -> tuple[float, float, dict[str, float]]:
    """``(cost, ttft_overhead_ms, parts)`` of one candidate's predictions (made with TTFT constant ``c_used_ms``):
    the constant refitted on the runs without queueing, and the cost with it (module docstring)."""
    pairs = [(r, p) for r, p in zip(rows, preds, strict=True)
             if p is not None and not p.oom and (r.get("status") or "").strip() == "ok"]
    gaps = [row_float(r, "ttft_mean_ms") - p.ttft_mean_ms for r, p in pairs
            if (row_float(r, "ttft_mean_ms") or math.inf) < FRONTEND_MAX_TTFT_MS and math.isfinite(p.ttft_mean_ms)]
    c_ms = max(0.0, c_used_ms + float(np.median(gaps))) if gaps else c_used_ms
    shift = c_ms - c_used_ms
    n_short = len(gaps)
    parts: dict[str, list[float]] = {"itl": [], "itl_p99": [], "ttft": [], "ttft_p99": []}
    for r, p in pairs:
        real_ttft = row_float(r, "ttft_mean_ms") or math.inf
        if real_ttft < TAIL_MAX_TTFT_MS:
            parts["itl"].append(_log_err(p.itl_mean_ms, row_float(r, "itl_mean_ms")))
            parts["itl_p99"].append(_log_err(p.itl_p99_ms, row_float(r, "itl_p99_ms")))
        if real_ttft < FRONTEND_MAX_TTFT_MS:
            parts["ttft"].append(_log_err(p.ttft_mean_ms + shift, real_ttft))
            parts["ttft_p99"].append(_log_err(p.ttft_p99_ms + shift, row_float(r, "ttft_p99_ms")))
    means = {k: float(np.nanmean(np.square(np.asarray(v) / RESIDUAL_SCALE))) if v else 0.0 for k, v in parts.items()}
    means["n_short_runs"] = n_short  # (not a cost: the runs the TTFT constant comes from)
    return float(sum(v for k, v in means.items() if k != "n_short_runs")), c_ms, means


def fit_api_server(prof: Profile, rows: Sequence[dict], *, seeds: Sequence[int] = (0,), lengths: str = "lognormal",
                   workers: int = 0, log: Callable[[str], None] | None = None
                   ) -> tuple[ApiServerModel, FrontendModel, dict]:
    """The loop's constants and the TTFT constant for ``prof`` on ``rows`` (module docstring); returns them with
    a provenance record (every candidate tried, its cost and constant)."""
    c0 = prof.frontend.ttft_overhead_ms if prof.frontend is not None else 0.0
    tried: list[dict] = []

    def candidate(kappa: float, scale: float) -> ApiServerModel:
        return ApiServerModel(ms_per_output=kappa, scrape_base_ms=REGISTRY_FIT.scrape_base_ms,
                              scrape_us_per_series=REGISTRY_FIT.scrape_us_per_series * scale,
                              scrape_us_per_label_name=REGISTRY_FIT.scrape_us_per_label_name * scale)

    with Evaluator(list(rows), seeds=seeds, lengths=lengths, workers=workers) as ev:
        def cost(kappa: float, log_scale: float) -> float:
            api = candidate(kappa, math.exp(log_scale))
            preds = ev({prof.model: prof.model_copy(update={"api_server": api})})
            value, c_ms, parts = api_cost(rows, preds, c0)
            n_short = parts.pop("n_short_runs")
            tried.append({"ms_per_output": kappa, "scale": math.exp(log_scale), "cost": value,
                          "ttft_overhead_ms": c_ms, "n_points": n_short, **{f"cost_{k}": v for k, v in parts.items()}})
            if log:
                log(f"{prof.model}: API loop kappa {kappa:.3f} ms, render x{math.exp(log_scale):.2f}: cost "
                    f"{value:.2f} ({', '.join(f'{k} {v:.2f}' for k, v in parts.items())}), TTFT constant {c_ms:.2f} ms")
            return value

        lo, hi = (math.log(x) for x in SCALE_RANGE)
        g = (math.sqrt(5.0) - 1.0) / 2.0
        for kappa in KAPPA_GRID:
            a, b = lo, hi
            x1, x2 = b - g * (b - a), a + g * (b - a)
            f1, f2 = cost(kappa, x1), cost(kappa, x2)
            for _ in range(GOLDEN_STEPS - 2):
                if f1 <= f2:
                    b, x2, f2 = x2, x1, f1
                    x1 = b - g * (b - a)
                    f1 = cost(kappa, x1)
                else:
                    a, x1, f1 = x1, x2, f2
                    x2 = a + g * (b - a)
                    f2 = cost(kappa, x2)
    best = min(tried, key=lambda t: t["cost"])
    api = candidate(best["ms_per_output"], best["scale"])
    frontend = FrontendModel(ttft_overhead_ms=best["ttft_overhead_ms"])
    prov = {"method": "golden-section search of the render-time scale per loop work per output (grid), the TTFT "
                      "constant refitted at each point (median of real - twin mean TTFT over the runs below "
                      f"{FRONTEND_MAX_TTFT_MS:.0f} ms); cost: mean squared log errors of ITL mean and p99 (runs below "
                      f"{TAIL_MAX_TTFT_MS:.0f} ms) and of TTFT mean and p99 (runs below {FRONTEND_MAX_TTFT_MS:.0f} "
                      "ms); docs/trust-under-load.md",
            "metrics_scrape_s": "per run (realruns.metrics_poller_s)", "ttft_overhead_ms": best["ttft_overhead_ms"],
            "n_points": best["n_points"],
            "api_server": api.model_dump(), "best": best, "tried": tried}
    return api, frontend, prov
