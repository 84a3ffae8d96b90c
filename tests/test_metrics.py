"""Metrics on hand-built engine results: every definition of ``twin.metrics`` with numbers checked by hand."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from lorapack.twin.metrics import STARVATION_RATIO, RunMetrics, compute_metrics
from lorapack.twin.types import EngineResult, RequestArrays

NAN = float("nan")


def _build(rows: list[tuple], timeline: dict | None = None, **counters) -> tuple[EngineResult, RequestArrays]:
    """rows: (adapter, P, O, t_arr, t_sent, t_first, t_finish)."""
    a = np.array(rows, dtype=float)
    req = RequestArrays(t_arr_s=a[:, 3], adapter=a[:, 0].astype(int), prompt_tokens=a[:, 1].astype(int),
                        output_tokens=a[:, 2].astype(int))
    res = EngineResult(t_sent_s=a[:, 4], t_first_s=a[:, 5], t_finish_s=a[:, 6],
                       n_preempted=np.zeros(len(a), dtype=np.int32), timeline=timeline or {}, **counters)
    return res, req


T = 10.0
# adapter, P, O, t_arr, t_sent, t_first, t_finish
CASE = [
    (0, 10, 11, 0.0, 0.0, 1.0, 2.0),  # done: TTFT 1, span 1 over 10 gaps (0.1 s/token)
    (1, 20, 2, 1.0, 1.0, 1.5, 3.5),  # done: TTFT 0.5, span 2 over 1 gap (2 s/token)
    (0, 5, 1, 2.0, 2.0, 2.5, 2.5),  # done: one output token, no gap (not in TPOT)
    (1, 4, 3, 3.0, 5.0, 6.0, 7.0),  # done, held by the client cap: TTFT from t_sent = 1 (not 3 from t_arr)
    (0, 100, 50, 8.0, 8.0, 9.0, NAN),  # sent, unfinished
    (1, 7, 7, 9.0, 9.0, 9.5, 10.5),  # sent, finishes after the window: not completed
    (0, 3, 5, 9.2, 9.2, 9.4, 10.0),  # done exactly at T (counts: t_finish <= T)
    (1, 1000, 1000, 9.5, NAN, NAN, NAN),  # held back by the client cap until the end: never sent, excluded
]
HELD_END = len(CASE)  # the client cap held every arrival up to here at some point (types.py conventions)


@pytest.fixture(scope="module")
def m() -> RunMetrics:
    res, req = _build(CASE, n_preemptions=3, n_gpu_loads=4, n_disk_loads=1, n_steps=17, busy_s=5.0,
                      held_end=HELD_END)
    return compute_metrics(res, req, T, n_adapters=2)


def test_counts(m: RunMetrics) -> None:
    assert m.n_generated == 8
    assert m.n_arrived == 7  # never-sent request excluded
    assert m.n_completed == 5
    assert (m.n_preemptions, m.n_adapter_loads, m.n_adapter_disk_loads, m.n_steps) == (3, 4, 1, 17)
    assert m.busy_frac == pytest.approx(0.5)


def test_throughput_counts_only_completed_prompt_plus_output(m: RunMetrics) -> None:
    # completed: P = 10+20+5+4+3 = 42, O = 11+2+1+3+5 = 22
    assert m.input_tok_s == pytest.approx(42 / T)
    assert m.output_tok_s == pytest.approx(22 / T)
    assert m.throughput_tok_s == pytest.approx(64 / T)


def test_incoming_counts_sent_requests(m: RunMetrics) -> None:
    # sent (7 requests): 21 + 22 + 6 + 7 + 150 + 14 + 8 = 228 tokens; the never-sent 2000 are not counted
    assert m.incoming_tok_s == pytest.approx(228 / T)
    assert m.throughput_ratio == pytest.approx(64 / 228)
    assert m.starved is True


def test_itl_is_token_weighted(m: RunMetrics) -> None:
    # Σ span / Σ (O-1) over completed = (1 + 2 + 0 + 1 + 0.6) / (10 + 1 + 0 + 2 + 4)
    itl = 4.6 / 17 * 1000
    assert m.itl_mean_ms == pytest.approx(itl)
    # the mean of per-request ITLs (= TPOT) is very different here: (0.1 + 2 + 0.5 + 0.15) / 4
    assert m.tpot_mean_ms == pytest.approx(2.75 / 4 * 1000)
    assert abs(m.itl_mean_ms - m.tpot_mean_ms) > 100


def test_ttft_from_sent_over_completed(m: RunMetrics) -> None:
    ttft_s = [1.0, 0.5, 0.5, 1.0, 0.2]  # the held request counts 1 s (t_first - t_sent), not 3 s
    assert m.ttft_mean_ms == pytest.approx(np.mean(ttft_s) * 1000)
    assert m.ttft_median_ms == pytest.approx(500.0)
    assert m.ttft_p99_ms == pytest.approx(np.percentile(ttft_s, 99) * 1000)


def test_penalised_ttft_formula(m: RunMetrics) -> None:
    # (mean_TTFT * completed + (sent - completed) * T * 1000) / sent
    assert m.ttft_penalised_mean_ms == pytest.approx((640.0 * 5 + 2 * T * 1000) / 7)


def test_never_sent_requests_do_not_change_anything() -> None:
    res, req = _build(CASE[:-1])
    full_res, full_req = _build(CASE, held_end=HELD_END)
    a = compute_metrics(res, req, T, 2)
    b = compute_metrics(full_res, full_req, T, 2)
    for k in ("throughput_tok_s", "incoming_tok_s", "itl_mean_ms", "ttft_mean_ms", "ttft_penalised_mean_ms",
              "n_arrived", "n_completed", "starved", "n_adapters_starved"):
        assert getattr(a, k) == getattr(b, k), k
    assert (a.n_generated, b.n_generated) == (7, 8)


def test_arrived_during_the_last_step_is_sent() -> None:
    # not injected (t_sent NaN) but not held back either (index >= held_end): the client sent it
    res, req = _build(CASE, held_end=0)
    m = compute_metrics(res, req, T, 2, adapter_max_wait_s=1e9)
    assert m.n_arrived == 8 and m.n_completed == 5
    assert m.incoming_tok_s == pytest.approx(2228 / T)
    assert m.ttft_penalised_mean_ms == pytest.approx((640.0 * 5 + 3 * T * 1000) / 8)
    # its age at the end counts from its arrival (0.5 s), not NaN; the oldest open one is req 4 (2 s)
    assert m.adapter_max_wait_s == pytest.approx(2.0)
    res, req = _build([(0, 5, 5, 0.0, 0.0, 0.1, 0.2), (1, 5, 5, 9.99, NAN, NAN, NAN)])
    m = compute_metrics(res, req, T, 2)
    assert m.adapter_max_wait_s == pytest.approx(0.01) and m.n_adapters_starved == 0


def test_held_request_injected_at_or_after_the_end_is_not_sent() -> None:
    res, req = _build([(0, 5, 5, 0.0, 0.0, 0.1, 0.2), (0, 5, 5, 1.0, T, NAN, NAN)], held_end=2)
    assert compute_metrics(res, req, T, 1).n_arrived == 1


def test_sent_after_window_end_is_not_sent() -> None:
    res, req = _build([(0, 10, 10, 0.0, 0.0, 1.0, 2.0), (0, 10, 10, 5.0, 5.0, 6.0, 7.0)])
    m = compute_metrics(res, req, 5.0, 1)  # second request sent exactly at T: outside [0, T)
    assert (m.n_arrived, m.n_completed) == (1, 1)
    assert m.incoming_tok_s == pytest.approx(20 / 5.0)


@pytest.mark.parametrize("n_done, starved", [(90, False), (89, True), (100, False), (0, True)])
def test_starved_threshold_is_strictly_below_0_9(n_done: int, starved: bool) -> None:
    assert STARVATION_RATIO == 0.9
    rows = [(0, 4, 6, i * 0.001, i * 0.001, 0.5, 0.6 if i < n_done else NAN) for i in range(100)]
    res, req = _build(rows)
    m = compute_metrics(res, req, 1.0, 1, adapter_min_requests=1000)
    assert m.throughput_ratio == pytest.approx(n_done / 100)
    assert m.starved is starved


def test_no_completed_requests() -> None:
    res, req = _build([(0, 10, 10, 0.0, 0.0, NAN, NAN), (0, 10, 10, 1.0, 1.0, NAN, NAN)])
    m = compute_metrics(res, req, 10.0, 1)
    assert m.throughput_tok_s == 0.0 and m.n_completed == 0
    assert math.isnan(m.itl_mean_ms) and math.isnan(m.ttft_mean_ms) and math.isnan(m.tpot_mean_ms)
    assert m.ttft_penalised_mean_ms == pytest.approx(10_000.0)  # everybody waited the whole window
    assert m.starved is True


def test_empty_run() -> None:
    res, req = _build([(0, 1, 1, 0.0, 0.0, 0.0, 0.0)], held_end=1)
    res.t_sent_s[:] = NAN  # held back all along: nothing sent
    m = compute_metrics(res, req, 10.0, 3)
    assert (m.n_arrived, m.n_completed, m.incoming_tok_s, m.starved) == (0, 0, 0.0, False)
    assert math.isnan(m.ttft_penalised_mean_ms) and math.isnan(m.throughput_ratio)
    assert m.n_adapters_starved == 0 and m.adapter_starved is False


def test_single_token_outputs_have_no_itl() -> None:
    res, req = _build([(0, 10, 1, 0.0, 0.0, 1.0, 1.0)])
    m = compute_metrics(res, req, 10.0, 1)
    assert math.isnan(m.itl_mean_ms) and math.isnan(m.tpot_mean_ms)
    assert m.ttft_mean_ms == pytest.approx(1000.0)


# ---- per-adapter starvation (``twin.metrics``, per-adapter starvation) -------------------------------------------------


def _adapter_case(n0: int, done0: int, n1: int, old_open_age_s: float | None, T: float = 1000.0):
    """Adapter 0: n0 requests, the first done0 complete. Adapter 1: n1 requests all complete, plus (optionally)
    one unfinished request sent old_open_age_s before the end."""
    rows = []
    for i in range(n0):
        t = float(i)
        rows.append((0, 5, 5, t, t, t + 0.1, t + 0.2 if i < done0 else NAN))
    for i in range(n1):
        t = float(i) + 0.5
        rows.append((1, 5, 5, t, t, t + 0.1, t + 0.2))
    if old_open_age_s is not None:
        t = T - old_open_age_s
        rows.append((1, 5, 5, t, t, NAN, NAN))
    rows.sort(key=lambda r: r[3])
    return _build(rows)


def test_adapter_starved_by_token_ratio_needs_min_requests() -> None:
    # adapter 0: 10 of 20 complete (ratio 0.5), adapter 1 healthy
    res, req = _adapter_case(20, 10, 50, None)
    m = compute_metrics(res, req, 1000.0, 2, adapter_min_requests=20, adapter_max_wait_s=1e9)
    assert m.n_adapters_starved == 1 and m.adapter_starved is True
    assert m.adapter_min_token_ratio == pytest.approx(0.5)
    # the same adapter with fewer requests than the minimum is not judged on its ratio
    m = compute_metrics(res, req, 1000.0, 2, adapter_min_requests=21, adapter_max_wait_s=1e9)
    assert m.n_adapters_starved == 0 and m.adapter_starved is False
    assert m.adapter_min_token_ratio == pytest.approx(1.0)  # only adapter 1 qualifies


def test_a_long_request_still_streaming_at_the_end_does_not_starve_its_adapter() -> None:
    """20 short requests done (0.1 s per token), then one of 5,000 output tokens sent 300 s before the end of a
    420-s window with its first token out: at the run's pace it is due after the end, so it is in service, not
    starving its adapter (alone it is 94 % of the adapter's tokens). The same request with 1,000 output tokens
    was due at 220 s: stalled, it counts and starves the adapter."""
    def case(o_long: int):
        rows = [(0, 5, 11, float(i), float(i), i + 0.1, i + 1.1) for i in range(20)]
        rows.append((0, 5, o_long, 120.0, 120.0, 120.5, NAN))
        return _build(rows)

    m = compute_metrics(*case(5000), 420.0, 1, adapter_min_requests=20)
    assert m.itl_p99_ms == pytest.approx(100.0) and m.adapter_starved is False
    m = compute_metrics(*case(1000), 420.0, 1, adapter_min_requests=20, adapter_max_wait_s=1e9)
    assert m.adapter_starved is True and m.adapter_min_token_ratio < 0.9
    # open longer than the wait limit starves it however it is served
    assert compute_metrics(*case(5000), 420.0, 1, adapter_min_requests=20,
                           adapter_max_wait_s=250.0).adapter_starved is True


def test_adapter_ratio_at_0_9_is_not_starved() -> None:
    res, req = _adapter_case(20, 18, 0, None)
    m = compute_metrics(res, req, 1000.0, 2, adapter_min_requests=20, adapter_max_wait_s=1e9)
    assert m.adapter_min_token_ratio == pytest.approx(0.9) and m.adapter_starved is False
    res, req = _adapter_case(20, 17, 0, None)
    assert compute_metrics(res, req, 1000.0, 2, adapter_min_requests=20,
                           adapter_max_wait_s=1e9).adapter_starved is True


def test_adapter_starved_by_max_wait() -> None:
    # adapter 1 completes everything but one request that has been open for 400 s at the end
    res, req = _adapter_case(5, 5, 5, 400.0)
    m = compute_metrics(res, req, 1000.0, 2, adapter_min_requests=20, adapter_max_wait_s=300.0)
    assert m.adapter_max_wait_s == pytest.approx(400.0)
    assert m.n_adapters_starved == 1 and m.adapter_starved is True
    m = compute_metrics(res, req, 1000.0, 2, adapter_min_requests=20, adapter_max_wait_s=500.0)
    assert m.adapter_starved is False
    # the aggregate label is a different thing: 1 of 11 requests open -> ratio 10/11 > 0.9
    assert m.starved is False


def test_adapter_max_wait_ignores_never_sent() -> None:
    res, req = _adapter_case(5, 5, 5, 400.0)
    res.t_sent_s[np.isnan(res.t_first_s)] = NAN  # the open request was held back by the cap all along
    res.held_end = len(req)
    m = compute_metrics(res, req, 1000.0, 2, adapter_max_wait_s=300.0)
    assert m.adapter_max_wait_s == 0.0 and m.adapter_starved is False


def test_timeline_statistics() -> None:
    tl = {"num_requests_running": np.array([0, 2, 4.0]), "num_requests_waiting": np.array([1, 0, 5.0]),
          "kv_cache_usage_perc": np.array([0.0, 0.3, 0.6])}
    res, req = _build(CASE, timeline=tl)
    m = compute_metrics(res, req, T, 2)
    assert (m.running_reqs_mean, m.running_reqs_max) == (2.0, 4.0)
    assert (m.waiting_reqs_mean, m.waiting_reqs_max) == (2.0, 5.0)
    assert m.kv_usage_mean_frac == pytest.approx(0.3)
    res, req = _build(CASE)  # no timeline: NaN, no crash
    assert math.isnan(compute_metrics(res, req, T, 2).running_reqs_mean)


def test_to_dict_keeps_the_json_keys(m: RunMetrics) -> None:
    d = m.to_dict()
    # the keys of the untyped result before RunMetrics (simulate --json, sweep columns): a contract
    for k in ("throughput_tok_s", "input_tok_s", "output_tok_s", "incoming_tok_s", "throughput_ratio", "starved",
              "itl_mean_ms", "tpot_mean_ms", "ttft_mean_ms", "ttft_median_ms", "ttft_p99_ms",
              "ttft_penalised_mean_ms", "n_arrived", "n_completed", "n_generated", "preemptions", "adapter_loads",
              "adapter_disk_loads", "steps", "busy_frac", "sched_s", "load_s", "running_mean", "running_max",
              "waiting_mean", "waiting_max", "kv_usage_mean", "adapters_starved", "adapter_starved",
              "starved_adapter_indices", "adapter_min_token_ratio", "adapter_max_wait_s", "oom", "error_type",
              "kv_cache_tokens", "stop_reason", "simulated_s", "server", "wall_s", "duration_s", "seed", "model",
              "gpu"):
        assert k in d, k
    assert (d["preemptions"], d["adapter_loads"], d["steps"], d["adapters_starved"]) == (3, 4, 17, m.n_adapters_starved)
    assert d["starved_adapter_indices"] == list(m.starved_adapter_indices)
    json.dumps({k: v for k, v in d.items()})  # plain Python values only
