"""The API server's loop and the per-step noise in the engines (docs/engine-semantics.md, "The API server",
"Step noise"; docs/trust-under-load.md).

* the fast engine reproduces the literal reference engine with the loop modelled (per-output work, /metrics
  scrapes whose render time grows with the label series, merged chunks), per request and in every counter;
* a live engine gives the batch run's results with it, bit for bit;
* switched off (all constants 0) the engines are the engines without it (the existing suites check them);
* hand-made cases pin the rules: a scrape stalls arrivals and delivery, outputs queued behind it leave as one
  chunk per request, and the render time follows the registry of label sets.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_cases import assert_engines_agree, build_case, case_params, describe_case
from lorapack.twin.engine import Engine, simulate_fast
from lorapack.twin.reference import simulate_reference
from lorapack.twin.steptime import StepModel
from lorapack.twin.types import EngineConfig, RequestArrays

SETTINGS = dict(derandomize=True, deadline=None, database=None, print_blob=False,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@st.composite
def api_settings(draw) -> dict:
    """The loop's constants, from off to a loop that is mostly stalled (scrapes every few steps), and the
    per-step noise (docs/engine-semantics.md, "Step noise"), off or on."""
    return {"step_noise_sigma": draw(st.sampled_from([0.0, 0.03, 0.4])),
            "step_noise_seed": draw(st.sampled_from([0, 7, 2**64 - 1])),
            "api_ms_per_output": draw(st.sampled_from([0.0, 0.05, 0.5, 3.0])),
            "output_proc_chunk": draw(st.sampled_from([1, 3, 128])),
            "metrics_scrape_s": draw(st.sampled_from([0.0, 0.05, 0.3, 2.0])),
            "scrape_base_ms": draw(st.sampled_from([0.0, 1.0, 40.0])),
            "scrape_us_per_series": draw(st.sampled_from([0.0, 50.0, 2000.0])),
            "scrape_us_per_label_name": draw(st.sampled_from([0.0, 30.0]))}


def _with_api(case, api: dict):
    return dataclasses.replace(case, cfg=dataclasses.replace(case.cfg, **api), name=f"{case.name} api={api}")


@settings(max_examples=60, **SETTINGS)
@given(params=case_params(max_requests=200), api=api_settings())
def test_fast_engine_equals_reference_with_the_api_loop(params, api) -> None:
    assert_engines_agree(_with_api(build_case(params), api))


@pytest.mark.slow
@settings(max_examples=300, **SETTINGS)
@given(params=case_params(), api=api_settings())
def test_fast_engine_equals_reference_with_the_api_loop_many(params, api) -> None:
    assert_engines_agree(_with_api(build_case(params), api))


@pytest.mark.slow
@settings(max_examples=30, **SETTINGS)
@given(params=case_params(max_requests=120), api=api_settings())
def test_uncompiled_path_with_the_api_loop(params, api) -> None:
    assert_engines_agree(_with_api(build_case(params), api), compiled=False)


RESULT_COLUMNS = ("t_sent_s", "t_first_s", "t_finish_s", "n_preempted", "n_merged")


@settings(max_examples=40, **SETTINGS)
@given(params=case_params(max_requests=200), api=api_settings())
def test_live_engine_equals_batch_with_the_api_loop(params, api) -> None:
    """Requests added one by one right before the engine passes their arrival (after steps that ran past
    earlier ones: the loop's late arrivals), results drained as they come: the batch run, bit for bit."""
    case = _with_api(build_case(params), api)
    cfg, req = case.cfg, case.req
    res = simulate_fast(cfg, req)
    eng = Engine.live(cfg, capacity=4)
    got: dict[int, tuple] = {}

    def drain() -> None:
        d = eng.drain_finished()
        for j, rid in enumerate(d["id"]):
            got[int(rid)] = tuple(d[c][j] if c != "n_merged" else d["n_merged"][j] for c in RESULT_COLUMNS)

    n_added = int((req.t_arr_s < cfg.duration_s).sum())
    for i in range(n_added):
        eng.advance_to(req.t_arr_s[i])
        eng.add_request(req.t_arr_s[i], int(req.adapter[i]), int(req.prompt_tokens[i]), int(req.output_tokens[i]))
        if i % 3 == 0:
            drain()
    eng.advance_to(cfg.duration_s)
    drain()
    n = int(eng.counters["n_known"])
    undelivered = set()  # tokens in the loop's open batch: a live engine sends them at a later pass
    for k in range(n):
        rid = int(eng._live.ids[k])
        if rid not in got:
            got[rid] = tuple(getattr(eng.state.requests, c)[k] for c in RESULT_COLUMNS)
            if eng.state.requests.batch_tokens[k] > 0:
                undelivered.add(rid)
    what = describe_case(case)
    for i in range(n_added):
        for c, v in zip(RESULT_COLUMNS, got[i], strict=True):
            want = getattr(res, c)[i]
            same = (np.isnan(want) and np.isnan(v)) if isinstance(want, float) and np.isnan(want) else want == v
            # a batch run ends at the window's end, where the loop's open batch leaves (after the end: a live
            # run has no end and keeps it open)
            if c == "n_merged" and not res.t_finish_s[i] <= cfg.duration_s:
                continue
            if c in ("t_first_s", "t_finish_s", "n_merged") and i in undelivered:
                continue
            # (a request that can never fit the KV cache is preempted at every loop pass: a live engine waiting
            # for arrivals passes more often than a batch run, which jumps to the end; it never finishes)
            if c == "n_preempted" and np.isnan(res.t_finish_s[i]):
                continue
            if c in ("t_first_s", "t_finish_s") and want > cfg.duration_s:
                continue
            assert same, f"{what}: request {i} {c}: live {v!r}, batch {want!r}"


# ---- hand-made cases ---------------------------------------------------------------------------------


def _config(**kw) -> EngineConfig:
    """One adapter, a 10 ms step whatever the batch (c0 only), room for everything."""
    kw.setdefault("duration_s", 20.0)
    return EngineConfig(load_ms=np.zeros(2), disk_ms=np.zeros(2), max_loras=2, max_cpu_loras=2, kv_blocks=10_000,
                        step_coef=StepModel(c0_ms=10.0, c1_ms_per_req=0.0).to_array(), **kw)


def test_a_scrape_holds_an_arrival_and_merges_the_chunks_behind_it() -> None:
    """A request arriving during a 100 ms scrape waits for it; the tokens of a running request produced during
    the scrape reach the client in one chunk when it ends."""
    req = RequestArrays(np.array([0.5, 2.03]), np.array([0, 1]), np.array([16, 16]), np.array([400, 5]))
    cfg = _config(metrics_scrape_s=2.0, scrape_base_ms=100.0)
    res = simulate_fast(cfg, req)
    base = simulate_fast(_config(), req)
    # scrapes at 0, 2.1 and 4.2 s (each answer + 2 s); the engine is idle after request 0's end at 4.5 s
    assert res.n_scrapes == 3 and math.isclose(res.scrape_s, 0.3)
    # request 1 arrives at 2.03 s, before the second scrape, and is done before it: no wait
    assert res.t_first_s[1] == pytest.approx(base.t_first_s[1], abs=1e-12)
    assert res.n_merged[1] == 0
    # request 0 runs through the scrapes at 2.1 and 4.2 s: the ten tokens of each 100 ms stall leave as one chunk
    assert res.n_merged[0] == 2 * 9
    # the engine's work is the same; only the client's view moves (the last chunk leaves later or at once)
    assert res.n_steps == base.n_steps
    assert res.t_finish_s[0] >= base.t_finish_s[0]
    # ITL p99 sees the long gaps: one per scrape of ~110 ms
    assert res.gap_hist.sum() < base.gap_hist.sum()


def test_an_arrival_inside_a_scrape_waits_for_its_end() -> None:
    req = RequestArrays(np.array([2.12]), np.array([0]), np.array([16]), np.array([3]))
    res = simulate_fast(_config(metrics_scrape_s=2.0, scrape_base_ms=100.0), req)
    # scrapes: [0, 0.1), [2.1, 2.2): the request is handed over at 2.2 s and computed in one 10 ms step
    assert res.t_first_s[0] == pytest.approx(2.21, abs=1e-9)
    assert simulate_reference(_config(metrics_scrape_s=2.0, scrape_base_ms=100.0), req).t_first_s[0] == \
        res.t_first_s[0]


def test_output_work_delays_the_first_token_by_the_outputs_of_its_step() -> None:
    """``api_ms_per_output``: the loop turns the step's B outputs into chunks before a new request's own."""
    req = RequestArrays(np.array([0.0, 0.0, 0.0]), np.array([0, 0, 1]), np.array([16, 16, 16]), np.array([5, 5, 5]))
    res = simulate_fast(_config(api_ms_per_output=1.0), req)
    base = simulate_fast(_config(), req)
    assert np.allclose(res.t_first_s - base.t_first_s, 0.003)  # three outputs in the step: 3 ms
    assert np.allclose(res.t_finish_s - base.t_finish_s, 0.003)


def test_the_render_time_grows_with_the_label_sets_seen() -> None:
    """Many adapters coming and going: every new (running, waiting) set is a series; the scrapes slow down."""
    rng = np.random.default_rng(5)
    n_ad = 64
    t = np.sort(rng.uniform(0, 60, 600))
    req = RequestArrays(t, rng.integers(0, n_ad, 600), rng.integers(16, 64, 600), rng.integers(2, 30, 600))
    cfg = EngineConfig(load_ms=np.zeros(n_ad), disk_ms=np.zeros(n_ad), max_loras=8, max_cpu_loras=n_ad,
                       kv_blocks=10_000, step_coef=StepModel(c0_ms=10.0, c1_ms_per_req=0.0).to_array(), duration_s=60.0,
                       metrics_scrape_s=2.0, scrape_us_per_series=100.0)
    res = simulate_fast(cfg, req)
    assert res.label_series > 300
    # each scrape renders the series seen so far: the registry grows through the run, so the scrapes' summed
    # render time lies between a third and all of (scrapes x final series x 100 µs)
    top = res.n_scrapes * res.label_series * 1e-4
    assert top / 3 < res.scrape_s < top
    # the same adapter always busy: the sets repeat and the registry stays small
    few = simulate_fast(cfg, RequestArrays(t, np.zeros(600, np.int64), req.prompt_tokens, req.output_tokens))
    assert few.label_series < 5


def test_step_noise_moves_the_tail_not_the_mean() -> None:
    """A mean-one multiplier per step: a light server's throughput and mean ITL stay (within 1 %), its ITL spread
    grows with sigma; the same seed gives the same run, another seed another one."""
    from lorapack.twin.gaps import percentile_ms
    from lorapack.twin.metrics import compute_metrics

    rng = np.random.default_rng(3)
    t = np.sort(rng.uniform(0, 600, 1200))
    req = RequestArrays(t, rng.integers(0, 2, 1200), rng.integers(16, 200, 1200), rng.integers(20, 200, 1200))
    base = _config(duration_s=600.0)
    runs = {}
    for sigma, seed in ((0.0, 0), (0.1, 0), (0.1, 1)):
        cfg = dataclasses.replace(base, step_noise_sigma=sigma, step_noise_seed=seed)
        res = simulate_fast(cfg, req)
        runs[sigma, seed] = (res, compute_metrics(res, req, 600.0, 2, cfg=cfg))
    (r0, m0), (r1, m1), (r2, _m2) = runs[0.0, 0], runs[0.1, 0], runs[0.1, 1]
    assert m1.itl_mean_ms == pytest.approx(m0.itl_mean_ms, rel=0.01)
    assert m1.throughput_tok_s == pytest.approx(m0.throughput_tok_s, rel=0.01)
    spread0 = percentile_ms(r0.gap_hist, 90) / percentile_ms(r0.gap_hist, 10)
    spread1 = percentile_ms(r1.gap_hist, 90) / percentile_ms(r1.gap_hist, 10)
    assert spread1 > spread0 * 1.1
    again = simulate_fast(dataclasses.replace(base, step_noise_sigma=0.1), req)
    assert np.array_equal(again.t_finish_s, r1.t_finish_s, equal_nan=True)
    assert not np.array_equal(r2.t_finish_s, r1.t_finish_s, equal_nan=True)


# ---- fitting the loop (calibrate.apiserver) ------------------------------------------------------------------


def test_the_fit_cost_refits_the_ttft_constant_and_scores_the_tails() -> None:
    """``api_cost``: the TTFT constant moves by the median gap of the runs without queueing (no simulation); a
    candidate whose tails are right costs nothing, one 5 % off costs one unit per term."""
    from lorapack.calibrate.apiserver import api_cost
    from lorapack.realruns import RunPrediction

    rows = [{"status": "ok", "ttft_mean_ms": str(t), "ttft_p99_ms": str(3 * t), "itl_mean_ms": "20",
             "itl_p99_ms": "60"} for t in (40.0, 50.0, 60.0)]
    right = [RunPrediction(oom=False, ttft_mean_ms=t - 4.0, ttft_p99_ms=3 * t - 4.0, itl_mean_ms=20.0, itl_p99_ms=60.0)
             for t in (40.0, 50.0, 60.0)]
    cost, c_ms, parts = api_cost(rows, right, c_used_ms=10.0)
    assert c_ms == pytest.approx(14.0) and cost == pytest.approx(0.0, abs=1e-12)
    off = [RunPrediction(oom=False, ttft_mean_ms=p.ttft_mean_ms, ttft_p99_ms=p.ttft_p99_ms, itl_mean_ms=20.0,
                         itl_p99_ms=60.0 * math.exp(0.05)) for p in right]
    cost, _c, parts = api_cost(rows, off, c_used_ms=10.0)
    assert parts["itl_p99"] == pytest.approx(1.0) and cost == pytest.approx(1.0) and parts["n_short_runs"] == 3
