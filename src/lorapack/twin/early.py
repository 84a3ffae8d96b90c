"""Early termination of a twin run, for dataset generation and placement checks.

The run advances in windows of ``window_s`` simulated seconds (the engine pauses between steps, so a
paused run is the uninterrupted run). After each window the tests below look at the window series; each is
a pure function (``healthy_converged``, ``starvation_certain``, ``starvation_likely``, ``starved_trend``,
``adapter_labels_settled``) so that it can be tested on its own.

* **healthy convergence** — after ``healthy_min_s``: the tokens completed since warm-up over the tokens that
  arrived since warm-up above ``healthy_ratio`` (a backlog that builds up shows here), no upward trend of
  the waiting queue after warm-up (one-sided p < ``trend_p``), the oldest *waiting* request younger than
  ``healthy_max_wait_s`` (a starving cold adapter would show up here), **and the per-adapter labels
  settled** (``adapter_labels_settled``: even if every request still open, or still to arrive, took twice
  the slowest sojourn seen so far, every adapter would still complete >= 90 % of its tokens by ``T`` and
  nothing would wait 300 s; otherwise the run goes on, usually to the end). Then ``F(T) ≈ I − Q̄``, with
  ``I`` the tokens of all arrivals in the window (known exactly: arrivals are pre-generated) and ``Q̄`` the
  mean in-flight tokens after warm-up; no adapter is starved.
* **starvation** — after ``starved_min_s``, when starvation is *certain* (even completing tokens at the
  GPU's maximum possible rate from now on, ``F(t) + min(Q(t) + R(t), (T − t)·C_max) < 0.9·I``; F completed,
  Q in-system, R still-to-arrive tokens, ``C_max`` from the step-time model: every token costs at least
  ``min(p1, c1)`` ms) or *likely* (each of the last ``starved_windows`` windows had goodput below
  ``(0.9 − starved_margin)`` × the offered rate and the waiting queue grows, one-sided p < ``trend_p``):
  stop once the goodput's linear trend over those windows has settled (its drift over the remaining time
  is within ``starved_max_drift`` of the goodput) and integrate that trend to ``T``. A run that misses
  >= 10 % of its tokens has at least one starved adapter, so ``adapter_starved`` is True; *which* adapters
  starve by ``T`` is not known (``adapter_labels_exact`` False: the indices are those starved at the stop).

ITL and completed-only TTFT are those measured up to the stop. Why the thresholds are conservative:
in adapter-starved runs (few slots, many adapters) the goodput keeps rising for tens of minutes as queues
build and batches fill, so an early extrapolation would be biased low.

Early termination needs the client cap off (held-back arrivals would make ``I`` unknown); with the cap on
the run is simulated in full.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..guards import Limits
from .metrics import (
    ADAPTER_GRACE_S,
    ADAPTER_MAX_WAIT_S,
    ADAPTER_MIN_REQUESTS,
    STARVATION_RATIO,
    RunMetrics,
    compute_metrics,
    finishable_mask,
)
from .steptime import capacity_bound_tok_s
from .types import EngineConfig, EngineResult, RequestArrays

if TYPE_CHECKING:  # the engine (and numba) is imported where a run starts: a placement that only reads the
    from .engine import Engine  # step-time bound (placement.estimate) does not pay for it

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
    sojourn_margin: float = 2.0  # adapter labels: open requests may take this many times the slowest sojourn


@dataclass
class WindowSeries:
    """What the rules see after each window: its end time and per-window rates / end-of-window levels."""

    t_marks: list[float]
    goodput: list[float]  # completed tokens per second in the window
    offered: list[float]  # arrived tokens per second in the window
    waiting: list[int]  # waiting requests at the window end
    inflight: list[int]  # in-system tokens at the window end

    @classmethod
    def empty(cls) -> WindowSeries:
        return cls([], [], [], [], [])

    def after(self, t_s: float) -> np.ndarray:
        """Mask of the windows that end after ``t_s``."""
        return np.asarray(self.t_marks, float) > t_s


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


def grows(y: np.ndarray, trend_p: float) -> bool:
    """One-sided test: does ``y`` trend upward (p < ``trend_p``)?"""
    slope, p = _slope_p(np.asarray(y, float))
    return slope > 0 and p < trend_p


def healthy_converged(ws: WindowSeries, oldest_wait_s: float, opts: EarlyStopOptions) -> bool:
    """Run-level healthy test: completed vs arrived tokens since warm-up, no growing queue, no old waiter."""
    if not ws.t_marks or ws.t_marks[-1] < opts.healthy_min_s:
        return False
    warm = ws.after(opts.warmup_s)
    if warm.sum() < 3:
        return False
    t = np.asarray(ws.t_marks, float)
    span = np.diff(np.concatenate([[0.0], t]))
    done = float((np.asarray(ws.goodput) * span)[warm].sum())
    arrived = float((np.asarray(ws.offered) * span)[warm].sum())
    ratio = done / arrived if arrived > 0 else 1.0
    return (ratio > opts.healthy_ratio and not grows(np.asarray(ws.waiting, float)[warm], opts.trend_p)
            and oldest_wait_s < opts.healthy_max_wait_s)


def starvation_certain(completed_tok: float, inflight_tok: float, to_arrive_tok: float, t_s: float, T: float,
                       c_max_tok_s: float, total_tok: float) -> bool:
    """Starved even if the GPU completed tokens at its maximum possible rate from now on."""
    return completed_tok + min(inflight_tok + to_arrive_tok, (T - t_s) * c_max_tok_s) < STARVATION_RATIO * total_tok


def starvation_likely(ws: WindowSeries, opts: EarlyStopOptions) -> bool:
    """Each of the last ``starved_windows`` windows clearly below 0.9 x offered and the waiting queue grows."""
    k = opts.starved_windows
    if len(ws.goodput) < k:
        return False
    if not all(g < (STARVATION_RATIO - opts.starved_margin) * o
               for g, o in zip(ws.goodput[-k:], ws.offered[-k:], strict=True)):
        return False
    return grows(np.asarray(ws.waiting, float), opts.trend_p)


def starved_trend(ws: WindowSeries, completed_tok: float, t_s: float, T: float, total_tok: float,
                  opts: EarlyStopOptions) -> float | None:
    """Completed tokens at ``T`` from the goodput's linear trend over the last windows, or None while the
    trend has not settled (its drift over the remaining time exceeds ``starved_max_drift`` of the goodput)."""
    k = opts.starved_windows
    if len(ws.goodput) < k:
        return None
    mid = np.asarray(ws.t_marks[-k:], float) - opts.window_s / 2
    g = np.asarray(ws.goodput[-k:], float)
    b, a = np.polyfit(mid, g, 1)
    if abs(b) * (T - t_s) > opts.starved_max_drift * max(float(g.mean()), 1e-9):
        return None
    return float(min(completed_tok + a * (T - t_s) + b * (T * T - t_s * t_s) / 2, total_tok))


def adapter_labels_settled(res: EngineResult, req: RequestArrays, t_s: float, T: float, n_adapters: int,
                           opts: EarlyStopOptions) -> bool:
    """Would every adapter's label at ``T`` be "not starved" whatever happens after ``t_s``?

    Worst case: every request still open at ``t_s`` (or arriving later) takes ``sojourn_margin`` times the
    slowest first-token time plus ``sojourn_margin`` times its own output length at the slowest per-token
    pace seen so far. The label (``twin.metrics``: completed-token ratio < 0.9 with >= 20 requests, or a
    request open for more than 300 s) must be "not starved" for every adapter in that worst case; in the
    best case (everything done at once) it is "not starved" anyway. As in ``compute_metrics``, the ratio
    counts the requests sent ``ADAPTER_GRACE_S`` before the end; ``compute_metrics`` also leaves out the ones
    still streaming at the end, which only raises a ratio (an unfinished request leaves the denominator), so
    counting them here stays on the safe side."""
    done = np.isfinite(res.t_finish_s) & (res.t_finish_s <= t_s)
    if not done.any():
        return False
    o = req.output_tokens.astype(np.int64)
    ttft_hi = float(np.max(res.t_first_s[done] - res.t_sent_s[done]))
    multi = done & (o > 1)
    pace_hi = float(np.max((res.t_finish_s[multi] - res.t_first_s[multi]) / (o[multi] - 1))) if multi.any() else 0.0
    sent = req.t_arr_s < T
    start = np.maximum(req.t_arr_s, t_s)  # an open request cannot finish before now
    finish_hi = start + opts.sojourn_margin * (ttft_hi + (o - 1) * pace_hi)
    open_at_T = sent & ~done & (finish_hi > T)
    if (open_at_T & (req.t_arr_s < T - ADAPTER_MAX_WAIT_S)).any():
        return False
    tok = req.prompt_tokens.astype(np.int64) + o
    ad = req.adapter
    ripe = sent & (req.t_arr_s < (T - ADAPTER_GRACE_S if T > 2 * ADAPTER_GRACE_S else T))
    sent_tok = np.bincount(ad[ripe], weights=tok[ripe], minlength=n_adapters)
    sent_n = np.bincount(ad[ripe], minlength=n_adapters)
    ok_tok = ripe & ~open_at_T
    worst = np.bincount(ad[ok_tok], weights=tok[ok_tok], minlength=n_adapters)
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = np.where(sent_tok > 0, worst / sent_tok, 1.0)
    return not ((ratio < STARVATION_RATIO) & (sent_n >= ADAPTER_MIN_REQUESTS)).any()


def arrived_by(res: EngineResult, req: RequestArrays, t_s: float) -> tuple[EngineResult, RequestArrays]:
    """The result and arrivals of the requests that arrived before ``t_s`` (a prefix: arrivals are sorted).

    ``compute_metrics`` over a window ending at ``t_s`` reads nothing of the later ones (never sent) but their
    count (``n_generated``); on the whole arrays it cost ~0.15 s per stop of a big starved run, most of it on
    requests that had not arrived."""
    k = int(np.searchsorted(req.t_arr_s, t_s, side="left"))
    if k == len(req):
        return res, req
    head = dataclasses.replace(res, t_sent_s=res.t_sent_s[:k], t_first_s=res.t_first_s[:k],
                               t_finish_s=res.t_finish_s[:k], n_preempted=res.n_preempted[:k],
                               n_merged=None if res.n_merged is None else res.n_merged[:k])
    return head, RequestArrays(req.t_arr_s[:k], req.adapter[:k], req.prompt_tokens[:k], req.output_tokens[:k])


def _full_run_metrics(res: EngineResult, req: RequestArrays, cfg: EngineConfig) -> RunMetrics:
    T = float(cfg.duration_s)
    return compute_metrics(res, req, T, cfg.n_adapters, cfg=cfg).replace(stop_reason=STOP_FULL, simulated_s=T)


def run_with_early_stop(cfg: EngineConfig, req: RequestArrays, opts: EarlyStopOptions,
                        limits: Limits | None = None) -> tuple[EngineResult, RunMetrics, Engine]:
    """Simulate with early termination; returns the (possibly partial) result, the metrics with
    extrapolated run-level values, and the engine (for its final snapshot)."""
    from .engine import Engine

    eng = Engine(cfg, req, limits=limits)
    T = float(cfg.duration_s)
    if cfg.client_cap > 0 or not (opts.certain or opts.likely or opts.healthy):
        eng.advance_to(T)
        res = eng.result()
        return res, _full_run_metrics(res, req, cfg), eng

    tok = req.prompt_tokens.astype(np.int64) + req.output_tokens
    in_window = req.t_arr_s < T
    total_tok = float(tok[in_window].sum())
    # the label's denominator: what an idle server could finish by T (no client cap: sent = arrived)
    finishable_tok = float(tok[in_window & finishable_mask(req, req.t_arr_s, T, cfg)].sum())  # t_sent = t_arr
    cum_tok = np.concatenate([[0], np.cumsum(tok)])
    c_max = capacity_bound_tok_s(cfg.step_coef)
    w = opts.window_s
    prev = eng.snapshot(oldest_wait=False)
    ws = WindowSeries.empty()
    reason = STOP_FULL
    done_tok_est = float("nan")
    labels_unsettled = False  # the healthy test passed but the adapter labels were not settled
    while not eng.done:
        t0 = ws.t_marks[-1] if ws.t_marks else 0.0
        eng.advance_to(min(t0 + w, T))
        snap = eng.snapshot(oldest_wait=False)  # the oldest waiter's age only when the healthy test gets to it
        t_now = min(snap["t_s"], T)
        span = max(t_now - t0, 1e-9)
        lo, hi = np.searchsorted(req.t_arr_s, [t0, t_now], side="right")
        ws.goodput.append((snap["completed_tokens"] - prev["completed_tokens"]) / span)
        ws.offered.append(float(cum_tok[hi] - cum_tok[lo]) / span)
        ws.waiting.append(snap["num_requests_waiting"])
        ws.inflight.append(snap["inflight_tokens"])
        ws.t_marks.append(t_now)
        prev = snap
        if eng.done:
            break
        f_t, q_t = snap["completed_tokens"], snap["inflight_tokens"]
        # healthy_converged ends with ``oldest_wait_s < healthy_max_wait_s``: testing it with no waiter first, then
        # the real age, decides as one test with the age would
        if opts.healthy and not labels_unsettled and healthy_converged(ws, 0.0, opts) and \
                eng.oldest_wait_s() < opts.healthy_max_wait_s:
            if adapter_labels_settled(eng.result(), req, t_now, T, cfg.n_adapters, opts):
                q_bar = float(np.mean(np.asarray(ws.inflight, float)[ws.after(opts.warmup_s)]))
                done_tok_est = total_tok - q_bar
                reason = STOP_HEALTHY
                break
            labels_unsettled = True  # the worst case does not depend on when we look: no healthy stop
        if (opts.certain or opts.likely) and t_now >= opts.starved_min_s and len(ws.goodput) >= opts.starved_windows:
            certain = opts.certain and starvation_certain(f_t, q_t, total_tok - snap["sent_tokens"], t_now, T,
                                                          c_max, finishable_tok)
            likely = not certain and opts.likely and starvation_likely(ws, opts)
            if certain or likely:
                est = starved_trend(ws, f_t, t_now, T, total_tok, opts)
                if est is not None:
                    done_tok_est = est
                    reason = STOP_CERTAIN if certain else STOP_LIKELY
                    break

    res = eng.result()
    t_stop = min(eng.t_s, T)
    if reason == STOP_FULL:
        return res, _full_run_metrics(res, req, cfg), eng

    snap = eng.snapshot()
    # latency metrics from what was simulated
    out = compute_metrics(*arrived_by(res, req, t_stop), t_stop, cfg.n_adapters, cfg=cfg).replace(n_generated=len(req))
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
    starved = bool(throughput < STARVATION_RATIO * finishable_tok / T)
    out = out.replace(
        throughput_tok_s=throughput, input_tok_s=throughput * frac_in, output_tok_s=throughput * (1 - frac_in),
        incoming_tok_s=incoming, finishable_tok_s=finishable_tok / T,
        throughput_ratio=throughput / incoming if incoming else float("nan"),
        starved=starved, ttft_penalised_mean_ms=pen,
        n_arrived=n_sent_total, n_completed=n_done, stop_reason=reason, simulated_s=t_stop,
    )
    if reason == STOP_HEALTHY:  # settled: no adapter starves by T (adapter_labels_settled)
        out = out.replace(n_adapters_starved=0, adapter_starved=False, starved_adapter_indices=(),
                          adapter_labels_exact=True)
    else:  # >= 10 % of the tokens missing: some adapter starves; which ones is not known before T
        out = out.replace(adapter_starved=True, adapter_labels_exact=False)
    return res, out, eng
