"""End-to-end runs against a live server, written in the runs schema of ``shared/data/real-runs/calibration.csv``.

A run: adapters with ranks and Poisson rates, request lengths from the twin's own log-normal law around the
given means (``workload.generate_requests``, seeded), sent for ``window_s`` seconds (``testbed.replay``); at
the window's end the open requests are cancelled, as a windowed benchmark does. Measured as the twin measures
(``twin/metrics.py``): completed = finished within the window; throughput = their input + output tokens per
second of window; incoming = the tokens of every request sent in the window; TTFT over completed requests
(the engine's queued -> first token interval when the server sends per-request metrics, else the client's);
ITL = all inter-token intervals of completed requests.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import SpecError
from ..testbed.replay import Arrival, ReplayOptions, ReplayResult, replay

STARVED_RATIO = 0.9  # shared/data/README.md §4: starved = throughput below 90 % of the offered tokens


@dataclass(frozen=True)
class RunAdapter:
    adapter_id: str
    rank: int
    rate_rps: float


@dataclass(frozen=True)
class RunSpec:
    """One end-to-end run: its id (the runs schema's ``run_id``), adapters (ranks, Poisson rates), window, seed (of
    the arrivals, lengths and prompts) and the mean request lengths the log-normal law is drawn around."""

    run_id: str
    adapters: tuple[RunAdapter, ...]
    window_s: float
    seed: int
    mean_input_tokens: float = 128.0
    mean_output_tokens: float = 128.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "adapters", tuple(self.adapters))
        if not self.adapters:
            raise SpecError(f"run {self.run_id}: no adapters")
        for name in ("window_s", "mean_input_tokens", "mean_output_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not (math.isfinite(v) and v > 0):
                raise SpecError(f"run {self.run_id}: {name} {v!r}: expected a positive number")


def arrivals_for(adapters: Sequence[RunAdapter], window_s: float, mean_input: float, mean_output: float,
                 seed: int) -> list[Arrival]:
    """The run's requests (twin's generator: Poisson per adapter, log-normal lengths), in time order."""
    from ..spec import Adapter, LengthsSpec, PoissonArrivals, Workload
    from ..workload import generate_requests

    wl = Workload(adapters=[Adapter(adapter_id=a.adapter_id, rank=a.rank, rate_rps=a.rate_rps) for a in adapters],
                  lengths=LengthsSpec(kind="lognormal", mean_input_tokens=mean_input, mean_output_tokens=mean_output),
                  arrivals=PoissonArrivals(), duration_s=window_s)
    req = generate_requests(wl, window_s, seed)
    return [Arrival(float(t), adapters[int(i)].adapter_id, int(p), int(o))
            for t, i, p, o in zip(req.t_arr_s, req.adapter, req.prompt_tokens, req.output_tokens, strict=True)]


def _counts(values: Sequence, fmt: str) -> str:
    c = Counter(values)
    return " ".join(f"{format(v, fmt)}:{n}" for v, n in sorted(c.items()))


def ttft_ms(r) -> float:
    if np.isfinite(r.queue_ms) and np.isfinite(r.engine_ttft_ms):
        return r.queue_ms + r.engine_ttft_ms
    return 1000.0 * r.ttft_s


def itl_ms(r) -> float:
    if np.isfinite(r.engine_itl_ms):
        return r.engine_itl_ms
    gaps = r.gaps_s
    return 1000.0 * float(np.mean(gaps)) if gaps else float("nan")


def run_once(url: str, model: str, run: RunSpec, api_key: str | None = None, stream: bool = False
             ) -> tuple[list[Arrival], ReplayResult]:
    """Send ``run``'s arrivals (``arrivals_for``) to the server at ``url`` (``model``: its base model; ``api_key``:
    a bearer token); the requests still open at the window's end are cancelled."""
    arrivals = arrivals_for(run.adapters, run.window_s, run.mean_input_tokens, run.mean_output_tokens, run.seed)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    res = replay(url, arrivals, ReplayOptions(model=model, seed=run.seed, stream=stream, window_s=run.window_s,
                                              headers=headers, timeout_s=run.window_s + 600.0))
    return arrivals, res


def run_row(run: RunSpec, model_label: str, identity, arrivals: Sequence[Arrival], res: ReplayResult,
            idle_service_s: Callable[[int, int], float] | None = None) -> dict:
    """One row of the runs schema from ``run`` replayed (``run_once``: ``arrivals``, ``res``; ``identity``: the
    server's ``probe.Identity``).

    ``idle_service_s(prompt, output)``: a request's time on an idle server. The offered tokens behind
    ``throughput_ratio`` and ``starved`` then count only the requests that could have finished by the window's
    end, as the twin counts them (``twin.metrics.finishable_mask``): without it a short window on an idle
    server would look starved by the requests still in flight at its end."""
    run_id, adapters, window_s, seed = run.run_id, run.adapters, run.window_s, run.seed
    w = float(window_s)
    recs = res.records
    sent = [r for r in recs if np.isfinite(r.t_sent_s) and r.t_sent_s < w]
    finishable = sent if idle_service_s is None else [
        r for r in sent if r.t_sent_s + idle_service_s(r.prompt_tokens, r.output_tokens) <= w]
    done = [r for r in sent if r.status == 200 and np.isfinite(r.t_finish_s) and r.t_finish_s <= w
            and r.completion_tokens > 0]
    failed = [r for r in sent if r.status not in (0, 200) or (r.status == 200 and r.error)]
    p_done = sum(r.prompt_tokens for r in done)
    o_done = sum(r.completion_tokens for r in done)
    incoming_tok = sum(r.prompt_tokens + r.output_tokens for r in sent) / w
    tput = (p_done + o_done) / w
    ttfts = np.array([ttft_ms(r) for r in done]) if done else np.array([np.nan])
    # every inter-token interval: a request's mean interval weighted by its number of intervals
    n_int = np.array([max(r.completion_tokens - 1, 0) for r in done], dtype=float)
    itls = np.array([itl_ms(r) for r in done], dtype=float)
    ok = np.isfinite(itls) & (n_int > 0)
    itl_mean = float(np.sum(itls[ok] * n_int[ok]) / np.sum(n_int[ok])) if ok.any() else float("nan")
    running = [s.running for s in res.samples if s.t_s <= w and np.isfinite(s.running)]
    waiting = [s.waiting for s in res.samples if s.t_s <= w and np.isfinite(s.waiting)]
    offered = sum(r.prompt_tokens + r.output_tokens for r in finishable) / w
    ratio = tput / offered if offered > 0 else float("nan")
    ranks = [a.rank for a in adapters]
    return {
        "run_id": run_id, "model": model_label, "engine": "v1", "vllm_version": identity.vllm_version,
        "n_adapters": len(adapters), "max_loras": identity.max_loras, "max_lora_rank": identity.max_lora_rank,
        "max_cpu_loras": identity.max_cpu_loras, "max_num_seqs": identity.max_num_seqs,
        "max_num_batched_tokens": identity.max_num_batched_tokens,
        "rank_counts": _counts(ranks, "d"), "rate_counts": _counts([a.rate_rps for a in adapters], ".6g"),
        "window_s": w, "num_prompts": "", "duration_s": w,
        "mean_input_tokens": float(np.mean([a.prompt_tokens for a in arrivals])) if arrivals else "",
        "mean_output_tokens": float(np.mean([a.output_tokens for a in arrivals])) if arrivals else "",
        "status": "ok", "error_type": "", "kv_cache_tokens": identity.kv_cache_tokens,
        "incoming_req_s": sum(a.rate_rps for a in adapters), "incoming_tok_s": incoming_tok,
        "n_completed": len(done), "input_tok_s": p_done / w, "output_tok_s": o_done / w,
        "throughput_tok_s": tput, "throughput_ratio": ratio,
        "starved": int(ratio < STARVED_RATIO) if np.isfinite(ratio) else "",
        "ttft_mean_ms": float(np.nanmean(ttfts)), "ttft_median_ms": float(np.nanmedian(ttfts)),
        "ttft_p99_ms": float(np.nanpercentile(ttfts, 99)), "tpot_mean_ms": float(np.nanmean(itls)) if ok.any() else "",
        "itl_mean_ms": itl_mean, "itl_median_ms": "", "itl_p99_ms": "",
        "running_mean": float(np.mean(running)) if running else "", "running_max": max(running) if running else "",
        "waiting_max": max(waiting) if waiting else "", "waiting_end": waiting[-1] if waiting else "",
        "kv_usage_mean": "",
        # beyond the research schema
        "seed": seed, "n_sent": len(sent), "n_failed": len(failed), "offered_finishable_tok_s": offered,
        "ttft_source": "engine" if any(np.isfinite(r.queue_ms) for r in done) else "client",
    }


def per_adapter_ttft(res: ReplayResult, window_s: float) -> dict[str, float]:
    """Mean TTFT (ms) per adapter over the requests completed in the window."""
    by: dict[str, list[float]] = {}
    for r in res.records:
        if r.status == 200 and np.isfinite(r.t_finish_s) and r.t_finish_s <= window_s:
            by.setdefault(str(r.adapter_id), []).append(ttft_ms(r))
    return {k: float(np.mean(v)) for k, v in by.items()}
