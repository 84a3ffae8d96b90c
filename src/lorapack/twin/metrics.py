"""Metrics exactly as the real benchmark computes them, from an ``EngineResult``.

* sent = requests arrived before the window end and not held back by the client cap at the end (see
  ``types.py``); completed = finished by ``duration_s``;
* TTFT counts from ``t_sent`` (the injection time of a request the cap held back), not from ``t_arr``;
* throughput = Σ_completed (P + O) / duration (input + output tokens per second);
* incoming (ideal) = Σ_sent (P + O) / duration (the benchmark's definition, kept for calibration and validation);
* ``starved`` = throughput < 0.9 × ``finishable_tok_s``: the tokens of the sent requests that an idle server
  could have completed by the window's end (sent time + the request's service time alone on the GPU <= end;
  ``idle_service_s``). Requests unfinished at the end are cancelled and excluded, as in the benchmark; without
  this rule a short window on an idle server would be "starved" by the requests still in flight at its end.
  On the one-hour windows of the real runs the two denominators differ by about 0.1 %;
* ITL = Σ_completed (t_last − t_first) / Σ_completed (chunks − 1): the mean of all inter-chunk gaps, as the
  benchmark averages its per-chunk ``itl`` lists (chunks = O unless the API server's loop merged tokens,
  ``EngineResult.n_merged``); TPOT = the mean over requests of (t_last − t_first) / (O − 1);
* ``itl_median_ms``, ``itl_p99_ms``: percentiles of every inter-token gap that ended in the window (the engine's
  log-binned gap histogram, ``twin.gaps``; a gap across a stall or a preemption is one long gap, as the client
  sees it). Engines without a histogram give the p99 over completed requests of their mean gap instead;
* per adapter: completed-token ratio over the requests sent ``adapter_grace_s`` before the end and not still
  streaming at the end (first token out, the rest not yet due at the run's p99 inter-token gap), and the age
  of its oldest unfinished request (``adapter_starved``: ratio < 0.9 with >= 20 such requests, or age > 300 s);
* TTFT over completed requests, plus ``EngineResult.ttft_overhead_ms`` (the API server's share, a profile
  constant); penalised TTFT counts each unfinished request as the whole window.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..server import ServerConfig
from .gaps import percentile_ms
from .steptime import compute_ms
from .types import EngineConfig, EngineResult, RequestArrays

STARVATION_RATIO = 0.9
# per-adapter label (lorapack's extension of the benchmark's labels): the ratio test counts adapters with at least this many requests
# sent ADAPTER_GRACE_S before the end; a request open longer than ADAPTER_MAX_WAIT_S starves its adapter
ADAPTER_MIN_REQUESTS = 20
ADAPTER_MAX_WAIT_S = 300.0
ADAPTER_GRACE_S = 120.0
NAN = float("nan")


@dataclass(frozen=True)
class RunMetrics:
    """Everything one twin run reports. ``to_dict()`` gives the ``simulate --json`` keys.

    Metrics of a run whose server does not start (``oom``) are NaN, counts 0 and labels ``None``. Fields
    that only the high-level API knows (``server``, ``wall_s``, ``duration_s``, ``seed``, ``model``,
    ``gpu``) are ``None`` where it did not set them.
    """

    # the server's start-up (vLLM's memory rule)
    oom: bool = False  # vLLM would not start with these flags
    error_type: str | None = None
    kv_cache_tokens: int = 0
    # rates and ratios of the window
    throughput_tok_s: float = NAN  # completed input + output tokens per second
    input_tok_s: float = NAN
    output_tok_s: float = NAN
    incoming_tok_s: float = NAN  # tokens of the sent requests per second
    finishable_tok_s: float = NAN  # of those, the tokens an idle server could have completed by the end
    throughput_ratio: float = NAN
    starved: bool | None = None  # throughput < 0.9 x finishable
    # latencies of the completed requests
    itl_mean_ms: float = NAN  # mean gap between chunks (= between tokens unless chunks merged)
    tpot_mean_ms: float = NAN  # mean of per-request mean gaps
    itl_median_ms: float = NAN  # token-weighted percentiles of the inter-token gaps (twin.gaps)
    itl_p99_ms: float = NAN
    ttft_mean_ms: float = NAN
    ttft_median_ms: float = NAN
    ttft_p99_ms: float = NAN
    ttft_penalised_mean_ms: float = NAN  # unfinished requests count the whole window
    # counts
    n_arrived: int = 0  # sent in the window (requests vLLM rejects excluded: ``n_rejected``)
    n_rejected: int = 0  # sent in the window but longer than --max-model-len: vLLM refuses them, nothing served
    rejected_tok_s: float = 0.0  # their tokens per second (in no other rate)
    n_completed: int = 0
    n_generated: int = 0  # arrivals generated (sent or not)
    n_preemptions: int = 0
    n_adapter_loads: int = 0  # CPU -> GPU activations
    n_adapter_disk_loads: int = 0
    n_steps: int = 0
    # engine time accounting
    busy_frac: float = NAN  # share of the window spent in steps
    sched_s: float = NAN
    load_s: float = NAN
    # timeline statistics (2 s samples)
    running_reqs_mean: float = NAN
    running_reqs_max: float = NAN
    waiting_reqs_mean: float = NAN
    waiting_reqs_max: float = NAN
    kv_usage_mean_frac: float = NAN
    # per-adapter starvation (lorapack's extension of the benchmark's labels)
    n_adapters_starved: int = 0
    adapter_starved: bool | None = None
    starved_adapter_indices: tuple[int, ...] = ()  # registration order
    adapter_min_token_ratio: float = NAN
    adapter_max_wait_s: float = NAN
    adapter_labels_exact: bool = True  # False: an early stop knew the run starved, not which adapters (twin.early)
    # how the run ended, with which flags
    stop_reason: str | None = None  # "full" or an early-stop reason (twin.early)
    simulated_s: float = NAN  # simulated window (< duration_s after an early stop)
    server: ServerConfig | None = None
    # set by ``twin.run.simulate``
    wall_s: float | None = None
    duration_s: float | None = None
    seed: int | None = None
    model: str | None = None
    gpu: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The metrics under their JSON / Parquet keys (a contract: keys are added, never renamed)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name == "server":
                v = None if v is None else v.to_dict()
            elif f.name == "starved_adapter_indices":
                v = list(v)
            out[_KEYS.get(f.name, f.name)] = v
        return out

    def replace(self, **changes: Any) -> RunMetrics:
        return dataclasses.replace(self, **changes)


# fields whose JSON / Parquet key predates the typed result (the keys are a contract)
_KEYS = {
    "n_preemptions": "preemptions", "n_adapter_loads": "adapter_loads",
    "n_adapter_disk_loads": "adapter_disk_loads", "n_steps": "steps", "running_reqs_mean": "running_mean",
    "running_reqs_max": "running_max", "waiting_reqs_mean": "waiting_mean", "waiting_reqs_max": "waiting_max",
    "kv_usage_mean_frac": "kv_usage_mean", "n_adapters_starved": "adapters_starved",
}


def _stat(x: np.ndarray, fn) -> float:
    return float(fn(x)) if len(x) else float("nan")


def idle_service_s(prompt_tokens: np.ndarray, output_tokens: np.ndarray, step_coef: np.ndarray,
                   max_num_batched_tokens: int) -> np.ndarray:
    """Per request, its time on an otherwise idle server: its prefill chunks, then one step per further
    output token, each step with this request alone (B = 1, one adapter; no scheduler time, no load)."""
    p = np.asarray(prompt_tokens, dtype=np.float64)
    chunks = np.ceil(p / max_num_batched_tokens)
    base = compute_ms(step_coef, 1, 0, 0, 0.0, 1)  # a step's fixed part
    per_prefill_token = compute_ms(step_coef, 1, 1, 1, 0.0, 1) - base
    decode_ms = compute_ms(step_coef, 1, 0, 1, 0.0, 1)
    out = chunks * base + p * per_prefill_token + (np.asarray(output_tokens, dtype=np.float64) - 1) * decode_ms
    return out / 1000.0


def _sent_at(res_t_sent_s: np.ndarray, req: RequestArrays, idx: np.ndarray) -> np.ndarray:
    """When requests ``idx`` were sent: a request sent during the last step was never injected (t_sent NaN),
    it counts from its arrival."""
    t = res_t_sent_s[idx]
    return np.where(np.isfinite(t), t, req.t_arr_s[idx])


def finishable_mask(req: RequestArrays, t_sent_s: np.ndarray, duration_s: float, cfg: EngineConfig | None) -> np.ndarray:
    """Requests that an idle server could complete by ``duration_s`` when sent at ``t_sent_s`` (NaN: at their
    arrival); all of them when ``cfg`` is None (the benchmark's plain count)."""
    ok = np.ones(len(req), dtype=bool)
    if cfg is None or not len(req):
        return ok
    # only requests sent within the longest possible service time of the end can miss it: test those alone
    mnbt = int(cfg.max_num_batched_tokens)
    horizon_s = float(idle_service_s(req.prompt_tokens.max(keepdims=True), req.output_tokens.max(keepdims=True),
                                     cfg.step_coef, mnbt)[0])
    late = np.flatnonzero(~(t_sent_s <= duration_s - horizon_s))  # NaN (never injected) included
    if len(late):
        service_s = idle_service_s(req.prompt_tokens[late], req.output_tokens[late], cfg.step_coef, mnbt)
        ok[late] = _sent_at(t_sent_s, req, late) + service_s <= duration_s
    return ok


def compute_metrics(res: EngineResult, req: RequestArrays, duration_s: float, n_adapters: int,
                    adapter_min_requests: int = ADAPTER_MIN_REQUESTS, adapter_max_wait_s: float = ADAPTER_MAX_WAIT_S,
                    adapter_grace_s: float = ADAPTER_GRACE_S, cfg: EngineConfig | None = None) -> RunMetrics:
    """Run-level metrics plus per-adapter starvation (lorapack's extension of the benchmark's labels).

    ``cfg`` (the run's engine configuration) lets the starvation labels count only what could have finished
    (``finishable_tok_s``); without it every sent request counts."""
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
    could_finish = sent & finishable_mask(req, res.t_sent_s, duration_s, cfg)
    finishable = float((p[could_finish] + o[could_finish]).sum()) / duration_s

    # completed => injected
    ttft_ms = (res.t_first_s[done] - res.t_sent_s[done]) * 1000.0 + float(res.ttft_overhead_ms)
    gaps = o[done] - 1
    span_s = res.t_finish_s[done] - res.t_first_s[done]
    # per chunk, as the benchmark: tokens the API server's loop merged into an earlier chunk make no gap
    chunk_gaps = gaps if res.n_merged is None else gaps - res.n_merged[done].astype(np.int64)
    itl = float(span_s.sum() / chunk_gaps.sum() * 1000.0) if chunk_gaps.sum() > 0 else float("nan")
    multi = gaps > 0
    tpot = _stat(span_s[multi] / gaps[multi] * 1000.0, np.mean)
    if res.gap_hist is not None:
        itl_median, itl_p99 = percentile_ms(res.gap_hist, 50.0), percentile_ms(res.gap_hist, 99.0)
    else:
        itl_median = NAN
        itl_p99 = _stat(span_s[multi] / gaps[multi] * 1000.0, lambda x: np.percentile(x, 99))
    ttft_mean = _stat(ttft_ms, np.mean)
    if n_sent:
        done_part = ttft_mean * n_done if n_done else 0.0
        ttft_pen = (done_part + (n_sent - n_done) * duration_s * 1000.0) / n_sent
    else:
        ttft_pen = float("nan")

    # per adapter: completed-token ratio and age of the oldest unfinished request at the end. The ratio counts
    # requests sent at least ``adapter_grace_s`` before the end, and not the ones still streaming at the end:
    # first token out and the rest of its output not yet due at the run's p99 inter-token gap. One long
    # request in flight at the cut would otherwise flag a healthy adapter with few requests (1,420 output
    # tokens at a 90-ms pace outlast the grace: docs/replan.md, "Unclean windows"). Requests that wait unserved
    # count, and so do ones that started long ago and stalled; one open longer than ``adapter_max_wait_s``
    # starves its adapter however it is served.
    ad = req.adapter
    tok = p + o
    cut = duration_s - adapter_grace_s if duration_s > 2 * adapter_grace_s else duration_s
    # (no first token, or no p99 gap: NaN, which compares False -- not streaming)
    due_s = res.t_first_s + (o - 1) * (itl_p99 / 1000.0)
    streaming = sent & ~done & (res.t_first_s <= duration_s) & (due_s > duration_s)
    ripe = could_finish & (req.t_arr_s < cut) & ~streaming
    sent_tok = np.bincount(ad[ripe], weights=tok[ripe], minlength=n_adapters)
    done_tok = np.bincount(ad[ripe & done], weights=tok[ripe & done], minlength=n_adapters)
    sent_n = np.bincount(ad[ripe], minlength=n_adapters)
    open_ = sent & ~done
    oldest = np.zeros(n_adapters)
    if open_.any():
        age = duration_s - _sent_at(res.t_sent_s, req, np.flatnonzero(open_))
        np.maximum.at(oldest, ad[open_], age)
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = np.where(sent_tok > 0, done_tok / sent_tok, 1.0)
    bad = ((ratio < STARVATION_RATIO) & (sent_n >= adapter_min_requests)) | (oldest > adapter_max_wait_s)

    tl = res.timeline
    no_samples = np.zeros(0)
    qualifies = sent_n >= adapter_min_requests
    return RunMetrics(
        throughput_tok_s=throughput,
        input_tok_s=input_tok_s,
        output_tok_s=output_tok_s,
        incoming_tok_s=incoming,
        finishable_tok_s=finishable,
        throughput_ratio=throughput / incoming if incoming > 0 else NAN,
        starved=bool(throughput < STARVATION_RATIO * finishable),
        itl_mean_ms=itl,
        tpot_mean_ms=tpot,
        itl_median_ms=itl_median,
        itl_p99_ms=itl_p99,
        ttft_mean_ms=ttft_mean,
        ttft_median_ms=_stat(ttft_ms, np.median),
        ttft_p99_ms=_stat(ttft_ms, lambda x: np.percentile(x, 99)),
        ttft_penalised_mean_ms=ttft_pen,
        n_arrived=n_sent,
        n_completed=n_done,
        n_generated=len(req),
        n_preemptions=res.n_preemptions,
        n_adapter_loads=res.n_gpu_loads,
        n_adapter_disk_loads=res.n_disk_loads,
        n_steps=res.n_steps,
        busy_frac=res.busy_s / duration_s,
        sched_s=res.sched_s,
        load_s=res.load_s,
        running_reqs_mean=_stat(tl.get("num_requests_running", no_samples), np.mean),
        running_reqs_max=_stat(tl.get("num_requests_running", no_samples), np.max),
        waiting_reqs_mean=_stat(tl.get("num_requests_waiting", no_samples), np.mean),
        waiting_reqs_max=_stat(tl.get("num_requests_waiting", no_samples), np.max),
        kv_usage_mean_frac=_stat(tl.get("kv_cache_usage_perc", no_samples), np.mean),
        n_adapters_starved=int(bad.sum()),
        adapter_starved=bool(bad.any()),
        starved_adapter_indices=tuple(int(i) for i in np.flatnonzero(bad)),
        adapter_min_token_ratio=float(ratio[qualifies].min()) if qualifies.any() else NAN,
        adapter_max_wait_s=float(oldest.max()) if n_adapters else 0.0,
    )
