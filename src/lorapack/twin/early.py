"""Early termination of a twin run (twin.md §7.4), for dataset generation and placement checks.

The run advances in windows of ``window_s`` simulated seconds (the engine pauses between steps, so a
paused run is the uninterrupted run). After each window:

* **healthy convergence** — after ``healthy_min_s``: completed / (sent − in flight) tokens above
  ``healthy_ratio``, no upward trend of the waiting queue after warm-up (one-sided p < ``trend_p``), and the
  oldest waiting request younger than ``healthy_max_wait_s`` (a starving cold adapter would show up here).
  Then ``F(T) ≈ I − Q̄``, with ``I`` the tokens of all arrivals in the window (known exactly: arrivals are
  pre-generated) and ``Q̄`` the mean in-flight tokens after warm-up.
* **starvation** — after ``starved_min_s``, when starvation is *certain* (even completing tokens at the
  GPU's maximum possible rate from now on, ``F(t) + min(Q(t) + R(t), (T − t)·C_max) < 0.9·I``; F completed,
  Q in-system, R still-to-arrive tokens, ``C_max`` from the step-time model: every token costs at least
  ``min(p1, c1)`` ms) or *likely* (each of the last ``starved_windows`` windows had goodput below
  ``(0.9 − starved_margin)`` × the offered rate and the waiting queue grows, one-sided p < ``trend_p``):
  stop once the goodput's linear trend over those windows has settled (its drift over the remaining time
  is within ``starved_max_drift`` of the goodput) and integrate that trend to ``T``.

ITL and completed-only TTFT are those measured up to the stop. Why the thresholds are conservative:
in adapter-starved runs (few slots, many adapters) the goodput keeps rising for tens of minutes as queues
build and batches fill, so an early extrapolation would be biased low.

Early termination needs the client cap off (held-back arrivals would make ``I`` unknown); with the cap on
the run is simulated in full.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..guards import Limits
from .engine import Engine
from .metrics import STARVATION_RATIO, RunMetrics, compute_metrics
from .steptime import C1, P1
from .types import EngineConfig, EngineResult, RequestArrays

STOP_FULL, STOP_CERTAIN, STOP_LIKELY, STOP_HEALTHY = "full", "certain_starved", "likely_starved", "healthy_converged"


@dataclass(frozen=True)
class EarlyStopOptions:
    """Switches and thresholds of the early-termination rules. The defaults trade speed for accuracy of the
    extrapolated throughput; ``bench/sweep_shortcuts.py`` measures both against full-length runs."""

    certain: bool = True
    likely: bool = True
    healthy: bool = True
    window_s: float = 60.0
    starved_min_s: float = 1200.0  # starved extrapolation needs a settled goodput
    starved_windows: int = 15  # windows used for the goodput trend
    starved_margin: float = 0.05  # likely test: goodput < (0.9 - margin) x offered in each of them
    starved_max_drift: float = 0.005  # trend x remaining time must stay within 0.5 % of the goodput
    trend_p: float = 0.01  # one-sided p-value for "the waiting queue grows"
    healthy_min_s: float = 900.0
    healthy_ratio: float = 0.97
    healthy_max_wait_s: float = 60.0
    warmup_s: float = 300.0


def _slope_p(y: np.ndarray) -> tuple[float, float]:
    """Least-squares slope of ``y`` over its index and the one-sided p-value of ``slope > 0``."""
    n = len(y)
    if n < 3 or np.ptp(y) == 0:
        return 0.0, 1.0
    x = np.arange(n, dtype=float) - (n - 1) / 2.0
    sxx = float(x @ x)
    slope = float(x @ (y - y.mean())) / sxx
    resid = y - y.mean() - slope * x
    dof = n - 2
    se = math.sqrt(float(resid @ resid) / dof / sxx)
    if se == 0.0:
        return slope, 0.0 if slope > 0 else 1.0
    from scipy.special import stdtr  # Student-t CDF (scipy.stats costs ~0.8 s to import)

    return slope, float(stdtr(dof, -slope / se))


def capacity_bound_tok_s(step_coef: np.ndarray) -> float:
    """Upper bound on completed tokens per second: each token needs >= min(p1, c1) ms of step time."""
    per_token_ms = min(step_coef[P1], step_coef[C1])
    return 1000.0 / per_token_ms if per_token_ms > 0 else float("inf")


def _full_run_metrics(res: EngineResult, req: RequestArrays, cfg: EngineConfig) -> RunMetrics:
    T = float(cfg.duration_s)
    return compute_metrics(res, req, T, cfg.n_adapters).replace(stop_reason=STOP_FULL, simulated_s=T)


def run_with_early_stop(cfg: EngineConfig, req: RequestArrays, opts: EarlyStopOptions,
                        limits: Limits | None = None) -> tuple[EngineResult, RunMetrics, Engine]:
    """Simulate with early termination; returns the (possibly partial) result, the metrics with
    extrapolated run-level values, and the engine (for its final snapshot)."""
    eng = Engine(cfg, req, limits=limits)
    T = float(cfg.duration_s)
    if cfg.client_cap > 0 or not (opts.certain or opts.likely or opts.healthy):
        eng.advance_to(T)
        res = eng.result()
        return res, _full_run_metrics(res, req, cfg), eng

    tok = req.prompt_tokens.astype(np.int64) + req.output_tokens
    in_window = req.t_arr_s < T
    total_tok = float(tok[in_window].sum())
    cum_tok = np.concatenate([[0], np.cumsum(tok)])
    c_max = capacity_bound_tok_s(cfg.step_coef)
    w = opts.window_s
    prev = eng.snapshot()
    goodput, offered, waiting, inflight, t_marks = [], [], [], [], []
    reason = STOP_FULL
    done_tok_est = float("nan")
    while not eng.done:
        t0 = t_marks[-1] if t_marks else 0.0
        eng.advance_to(min(t0 + w, T))
        snap = eng.snapshot()
        t_now = min(snap["t_s"], T)
        span = max(t_now - t0, 1e-9)
        lo, hi = np.searchsorted(req.t_arr_s, [t0, t_now], side="right")
        goodput.append((snap["completed_tokens"] - prev["completed_tokens"]) / span)
        offered.append(float(cum_tok[hi] - cum_tok[lo]) / span)
        waiting.append(snap["num_requests_waiting"])
        inflight.append(snap["inflight_tokens"])
        t_marks.append(t_now)
        prev = snap
        if eng.done:
            break
        f_t, q_t = snap["completed_tokens"], snap["inflight_tokens"]
        if opts.healthy and t_now >= opts.healthy_min_s:
            ratio = f_t / max(snap["sent_tokens"] - q_t, 1.0)
            warm = [x for x, tm in zip(waiting, t_marks, strict=True) if tm > opts.warmup_s]
            slope, p = _slope_p(np.array(warm, float))
            grows = slope > 0 and p < opts.trend_p
            if ratio > opts.healthy_ratio and not grows and snap["oldest_wait_s"] < opts.healthy_max_wait_s:
                q_bar = float(np.mean([q for q, tm in zip(inflight, t_marks, strict=True) if tm > opts.warmup_s]))
                done_tok_est = total_tok - q_bar
                reason = STOP_HEALTHY
                break
        k = opts.starved_windows
        if (opts.certain or opts.likely) and t_now >= opts.starved_min_s and len(goodput) >= k:
            r_t = total_tok - snap["sent_tokens"]
            certain = opts.certain and f_t + min(q_t + r_t, (T - t_now) * c_max) < STARVATION_RATIO * total_tok
            likely = False
            if opts.likely and all(g < (STARVATION_RATIO - opts.starved_margin) * o
                                   for g, o in zip(goodput[-k:], offered[-k:], strict=True)):
                slope, p = _slope_p(np.array(waiting, float))
                likely = slope > 0 and p < opts.trend_p
            if certain or likely:
                # extrapolate the goodput's linear trend, but only once it has settled
                mid = np.array(t_marks[-k:]) - w / 2
                b, a = np.polyfit(mid, np.array(goodput[-k:]), 1)
                g_mean = float(np.mean(goodput[-k:]))
                if abs(b) * (T - t_now) <= opts.starved_max_drift * max(g_mean, 1e-9):
                    done_tok_est = min(f_t + a * (T - t_now) + b * (T * T - t_now * t_now) / 2, total_tok)
                    reason = STOP_CERTAIN if certain else STOP_LIKELY
                    break

    res = eng.result()
    t_stop = min(eng.t_s, T)
    if reason == STOP_FULL:
        return res, _full_run_metrics(res, req, cfg), eng

    snap = eng.snapshot()
    out = compute_metrics(res, req, t_stop, cfg.n_adapters)  # latency metrics from what was simulated
    n_sent_total = int(in_window.sum())
    done_tok = max(done_tok_est, float(snap["completed_tokens"]))
    per_req = snap["completed_tokens"] / snap["n_completed"] if snap["n_completed"] else float(np.mean(tok))
    n_done = int(min(round(snap["n_completed"] + (done_tok - snap["completed_tokens"]) / per_req), n_sent_total))
    throughput = done_tok / T
    incoming = total_tok / T
    ttft = out.ttft_mean_ms
    pen = ((ttft if np.isfinite(ttft) else 0.0) * n_done + (n_sent_total - n_done) * T * 1000.0) / n_sent_total \
        if n_sent_total else float("nan")
    frac_in = float(req.prompt_tokens[in_window].sum()) / total_tok if total_tok else 0.5
    out = out.replace(
        throughput_tok_s=throughput, input_tok_s=throughput * frac_in, output_tok_s=throughput * (1 - frac_in),
        incoming_tok_s=incoming, throughput_ratio=throughput / incoming if incoming else float("nan"),
        starved=bool(throughput < STARVATION_RATIO * incoming), ttft_penalised_mean_ms=pen,
        n_arrived=n_sent_total, n_completed=n_done, stop_reason=reason, simulated_s=t_stop,
    )
    return res, out, eng
