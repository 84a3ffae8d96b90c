"""Metrics exactly as the real benchmark computes them (twin.md §4), from an ``EngineResult``.

* sent = requests arrived before the window end and not held back by the client cap at the end (see
  ``types.py``); completed = finished by ``duration_s``;
* TTFT counts from ``t_sent`` (the injection time of a request the cap held back), not from ``t_arr``;
* throughput = Σ_completed (P + O) / duration (input + output tokens per second);
* incoming (ideal) = Σ_sent (P + O) / duration; ``starved`` = throughput < 0.9 × incoming;
* ITL = Σ_completed (t_last − t_first) / Σ_completed (O − 1): the token-weighted mean of all gaps;
* TTFT over completed requests; penalised TTFT counts each unfinished request as the whole window.
"""

from __future__ import annotations

import numpy as np

from .types import EngineResult, RequestArrays

STARVATION_RATIO = 0.9
ADAPTER_MIN_REQUESTS = 20  # per-adapter ratio test only for adapters with at least this many requests
ADAPTER_MAX_WAIT_S = 300.0  # a request open longer than this starves its adapter


def _stat(x: np.ndarray, fn) -> float:
    return float(fn(x)) if len(x) else float("nan")


def compute_metrics(res: EngineResult, req: RequestArrays, duration_s: float, n_adapters: int,
                    adapter_min_requests: int = ADAPTER_MIN_REQUESTS,
                    adapter_max_wait_s: float = ADAPTER_MAX_WAIT_S) -> dict:
    """Run-level metrics plus per-adapter starvation (twin.md §4.2 extension)."""
    p = req.prompt_tokens.astype(np.int64)
    o = req.output_tokens.astype(np.int64)
    # sent: arrived in the window and not held back by the client cap at the end (a request arriving
    # during the last step was sent although the engine never injected it)
    injected = np.isfinite(res.t_sent_s)
    not_held = np.arange(len(req)) >= res.held_end
    sent = (req.t_arr_s < duration_s) & (injected | not_held) & ~(injected & (res.t_sent_s >= duration_s))
    done = sent & np.isfinite(res.t_finish_s) & (res.t_finish_s <= duration_s)
    n_sent, n_done = int(sent.sum()), int(done.sum())

    input_tok_s = float(p[done].sum()) / duration_s
    output_tok_s = float(o[done].sum()) / duration_s
    throughput = input_tok_s + output_tok_s
    incoming = float((p[sent] + o[sent]).sum()) / duration_s

    ttft_ms = (res.t_first_s[done] - res.t_sent_s[done]) * 1000.0  # completed => injected
    gaps = o[done] - 1
    span_s = res.t_finish_s[done] - res.t_first_s[done]
    itl = float(span_s.sum() / gaps.sum() * 1000.0) if gaps.sum() > 0 else float("nan")
    multi = gaps > 0
    tpot = _stat(span_s[multi] / gaps[multi] * 1000.0, np.mean)
    ttft_mean = _stat(ttft_ms, np.mean)
    if n_sent:
        done_part = ttft_mean * n_done if n_done else 0.0
        ttft_pen = (done_part + (n_sent - n_done) * duration_s * 1000.0) / n_sent
    else:
        ttft_pen = float("nan")

    # per adapter: completed-token ratio and age of the oldest unfinished request at the end
    ad = req.adapter
    tok = p + o
    sent_tok = np.bincount(ad[sent], weights=tok[sent], minlength=n_adapters)
    done_tok = np.bincount(ad[done], weights=tok[done], minlength=n_adapters)
    sent_n = np.bincount(ad[sent], minlength=n_adapters)
    open_ = sent & ~done
    oldest = np.zeros(n_adapters)
    if open_.any():
        # a request sent during the last step was never injected (t_sent NaN): its age counts from arrival
        since = np.where(np.isfinite(res.t_sent_s), res.t_sent_s, req.t_arr_s)
        age = duration_s - since[open_]
        np.maximum.at(oldest, ad[open_], age)
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = np.where(sent_tok > 0, done_tok / sent_tok, 1.0)
    bad = ((ratio < STARVATION_RATIO) & (sent_n >= adapter_min_requests)) | (oldest > adapter_max_wait_s)

    tl = res.timeline
    return {
        "throughput_tok_s": throughput,
        "input_tok_s": input_tok_s,
        "output_tok_s": output_tok_s,
        "incoming_tok_s": incoming,
        "throughput_ratio": throughput / incoming if incoming > 0 else float("nan"),
        "starved": bool(throughput < STARVATION_RATIO * incoming),
        "itl_mean_ms": itl,
        "tpot_mean_ms": tpot,
        "ttft_mean_ms": ttft_mean,
        "ttft_median_ms": _stat(ttft_ms, np.median),
        "ttft_p99_ms": _stat(ttft_ms, lambda x: np.percentile(x, 99)),
        "ttft_penalised_mean_ms": ttft_pen,
        "n_arrived": n_sent,
        "n_completed": n_done,
        "n_generated": len(req),
        "preemptions": res.n_preemptions,
        "adapter_loads": res.n_gpu_loads,
        "adapter_disk_loads": res.n_disk_loads,
        "steps": res.n_steps,
        "busy_frac": res.busy_s / duration_s,
        "sched_s": res.sched_s,
        "load_s": res.load_s,
        "running_mean": _stat(tl.get("num_requests_running", np.zeros(0)), np.mean),
        "running_max": _stat(tl.get("num_requests_running", np.zeros(0)), np.max),
        "waiting_mean": _stat(tl.get("num_requests_waiting", np.zeros(0)), np.mean),
        "waiting_max": _stat(tl.get("num_requests_waiting", np.zeros(0)), np.max),
        "kv_usage_mean": _stat(tl.get("kv_cache_usage_perc", np.zeros(0)), np.mean),
        "adapters_starved": int(bad.sum()),
        "adapter_starved": bool(bad.any()),
        "starved_adapter_indices": [int(i) for i in np.flatnonzero(bad)],  # registration order
        "adapter_min_token_ratio": float(ratio[sent_n >= adapter_min_requests].min())
        if (sent_n >= adapter_min_requests).any() else float("nan"),
        "adapter_max_wait_s": float(oldest.max()) if n_adapters else 0.0,
    }
