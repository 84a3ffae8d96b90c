"""Early termination (twin.early) and the resumable engine: every rule on its own, and the labels it writes."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from engine_cases import build_case, random_params
from lorapack.oracle import GpuCandidate, candidate_workload
from lorapack.profile import find_profile
from lorapack.server import ServerConfig
from lorapack.twin.early import (
    STOP_HEALTHY,
    EarlyStopOptions,
    WindowSeries,
    adapter_labels_settled,
    arrived_by,
    healthy_converged,
    run_with_early_stop,
    starvation_certain,
    starvation_likely,
    starved_trend,
)
from lorapack.twin.engine import WAITING, Engine, simulate_fast
from lorapack.twin.metrics import compute_metrics
from lorapack.twin.run import engine_config, resolve_server
from lorapack.twin.types import EngineResult, RequestArrays
from lorapack.workload import generate_requests

OPTS = EarlyStopOptions()
LLAMA = find_profile("llama-3.1-8b-instruct")


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b, equal_nan=True)


def _results_equal(x: EngineResult, y: EngineResult) -> None:
    for f in ("t_sent_s", "t_first_s", "t_finish_s", "n_preempted"):
        assert _same(getattr(x, f), getattr(y, f)), f
    for f in ("n_steps", "n_preemptions", "n_gpu_loads", "n_disk_loads", "busy_s", "sched_s", "load_s", "held_end"):
        assert getattr(x, f) == getattr(y, f), f
    assert x.timeline.keys() == y.timeline.keys()
    for k in x.timeline:
        assert _same(x.timeline[k], y.timeline[k]), k


# ---- the resumable engine ----

@pytest.mark.parametrize("seed", range(12))
def test_paused_and_resumed_equals_uninterrupted_bit_for_bit(seed: int) -> None:
    rng = np.random.default_rng(seed)
    case = build_case(random_params(rng))
    cfg, req = case.cfg, case.req
    whole = simulate_fast(cfg, req)
    eng = Engine(cfg, req)
    stops = np.sort(rng.uniform(0, cfg.duration_s * 1.1, size=rng.integers(1, 12)))
    for t in stops:
        eng.advance_to(float(t))
        assert eng.t_s >= min(t, cfg.duration_s) or eng.done  # a pause lands on the first step end >= t
    eng.advance_to(float("inf"))
    _results_equal(eng.result(), whole)
    # and two different pause schedules agree on the snapshot at a common point
    a, b = Engine(cfg, req), Engine(cfg, req)
    t_mid = cfg.duration_s / 2
    for t in stops[stops < t_mid]:
        a.advance_to(float(t))
    a.advance_to(t_mid)
    b.advance_to(t_mid)
    assert a.snapshot() == b.snapshot()


def test_advance_to_the_past_changes_nothing() -> None:
    case = build_case(random_params(np.random.default_rng(99)))
    cfg, req = case.cfg, case.req
    eng = Engine(cfg, req).advance_to(cfg.duration_s / 2)
    before = eng.snapshot()
    eng.advance_to(0.0)
    assert eng.snapshot() == before


def _starved_with_preemption():
    """A small-KV server under overload: preemption victims and older arrivals wait together."""
    cand = GpuCandidate(profile=LLAMA, ranks=np.full(16, 8), rates_rps=np.full(16, 1.5),
                        server=ServerConfig(max_loras=16))
    req = generate_requests(candidate_workload(cand, 600.0), 600.0, 3)
    srv = resolve_server(LLAMA, cand.ranks, ServerConfig(max_loras=16))
    cfg = engine_config(LLAMA, cand.ranks, srv, 600.0)
    cfg.kv_blocks = 400  # tiny KV: preemptions
    return cfg, req


def test_oldest_wait_is_the_age_of_the_oldest_waiting_request() -> None:
    cfg, req = _starved_with_preemption()
    eng = Engine(cfg, req)
    checked_victims = 0
    for t in np.arange(20.0, 600.0, 20.0):
        eng.advance_to(float(t))
        snap = eng.snapshot()
        status, t_sent = eng.state.requests.status, eng.state.requests.t_sent_s
        waiting = status == WAITING
        if not waiting.any():
            assert snap["oldest_wait_s"] == 0.0
            continue
        assert snap["oldest_wait_s"] == pytest.approx(eng.t_s - t_sent[waiting].min())
        # with preemption victims waiting, the oldest waiter is not the latest victim
        victims = waiting & (eng.state.requests.n_preempted > 0)
        if victims.any() and (waiting & ~victims).any():
            checked_victims += 1
            assert snap["oldest_wait_s"] >= eng.t_s - t_sent[waiting & ~victims].min()
    assert eng.snapshot()["n_preemptions"] > 0 and checked_victims > 0


def test_snapshot_without_the_oldest_wait_is_the_same_snapshot() -> None:
    """The early-stop loop skips the per-request scan for the oldest waiter's age until the healthy test needs it."""
    cfg, req = _starved_with_preemption()
    eng = Engine(cfg, req)
    for t in (30.0, 200.0, 450.0):
        eng.advance_to(t)
        full, cheap = eng.snapshot(), eng.snapshot(oldest_wait=False)
        assert np.isnan(cheap.pop("oldest_wait_s")) and eng.oldest_wait_s() == full.pop("oldest_wait_s")
        assert cheap == full


@pytest.mark.parametrize("seed", range(4))
def test_stop_metrics_read_only_the_requests_arrived_by_the_stop(seed: int) -> None:
    """``arrived_by``: the metrics of a run stopped at t, over the requests arrived by t, equal those over all
    requests field by field (``n_generated`` counts all)."""
    case = build_case(random_params(np.random.default_rng(seed)))
    cfg, req = case.cfg, case.req
    eng = Engine(cfg, req).advance_to(cfg.duration_s * 0.4)
    t_stop = min(eng.t_s, cfg.duration_s)
    res = eng.result()
    whole = compute_metrics(res, req, t_stop, cfg.n_adapters, cfg=cfg)
    head_res, head_req = arrived_by(res, req, t_stop)
    assert len(head_req) <= len(req)
    part = compute_metrics(head_res, head_req, t_stop, cfg.n_adapters, cfg=cfg).replace(n_generated=len(req))
    for f in dataclasses.fields(whole):
        a, b = getattr(whole, f.name), getattr(part, f.name)
        assert a == b or (isinstance(a, float) and np.isnan(a) and np.isnan(b)), f.name


# ---- each rule on its own ----

def _series(goodput, offered, waiting, w: float = 60.0) -> WindowSeries:
    n = len(goodput)
    return WindowSeries(t_marks=[w * (k + 1) for k in range(n)], goodput=list(goodput), offered=list(offered),
                        waiting=list(waiting), inflight=[1000] * n)


def test_healthy_test_passes_a_steady_run() -> None:
    rng = np.random.default_rng(0)
    off = 1000 + rng.normal(0, 20, 20)
    ws = _series(off * (1 + rng.normal(0, 0.005, 20)), off, rng.integers(0, 4, 20))
    assert healthy_converged(ws, oldest_wait_s=1.0, opts=OPTS)


@pytest.mark.parametrize("case", ["backlog", "queue_grows", "old_waiter", "too_early"])
def test_healthy_test_can_fail(case: str) -> None:
    n = 20
    good, off, wait, oldest = [1000.0] * n, [1000.0] * n, [2] * n, 1.0
    if case == "backlog":  # 5 % of the tokens pile up while the waiting count stays flat (long requests)
        good = [950.0] * n
    elif case == "queue_grows":
        wait = [2 + 3 * k for k in range(n)]
    elif case == "old_waiter":
        oldest = 120.0
    ws = _series(good, off, wait)
    if case == "too_early":
        ws = _series(good[:10], off[:10], wait[:10])  # 600 s < healthy_min_s
    assert not healthy_converged(ws, oldest, OPTS)


def test_certain_starvation_is_token_accounting() -> None:
    # completed 100, 50 in system, 50 to arrive: at most 200 of 1000 tokens can complete
    assert starvation_certain(100.0, 50.0, 50.0, t_s=1000.0, T=3600.0, c_max_tok_s=1e9, total_tok=1000.0)
    # enough in system and time: not certain
    assert not starvation_certain(100.0, 900.0, 0.0, t_s=1000.0, T=3600.0, c_max_tok_s=1e9, total_tok=1000.0)
    # ... unless the GPU cannot complete them in the time left
    assert starvation_certain(100.0, 900.0, 0.0, t_s=3599.0, T=3600.0, c_max_tok_s=10.0, total_tok=1000.0)


def test_likely_starvation_needs_every_window_low_and_a_growing_queue() -> None:
    k = OPTS.starved_windows
    low, off = [700.0] * k, [1000.0] * k
    grow = [100 * j for j in range(k)]
    assert starvation_likely(_series(low, off, grow), OPTS)
    assert not starvation_likely(_series(low[:-1] + [880.0], off, grow), OPTS)  # one window near 0.9
    assert not starvation_likely(_series(low, off, [500] * k), OPTS)  # flat queue
    assert not starvation_likely(_series(low[:3], off[:3], grow[:3]), OPTS)  # too few windows


def test_starved_trend_integrates_a_settled_goodput_and_waits_otherwise() -> None:
    k = OPTS.starved_windows
    flat = _series([500.0] * k, [1000.0] * k, [0] * k)
    t = flat.t_marks[-1]
    est = starved_trend(flat, completed_tok=4e5, t_s=t, T=3600.0, total_tok=1e7, opts=OPTS)
    assert est == pytest.approx(4e5 + 500.0 * (3600.0 - t))
    rising = _series([500.0 + 10 * j for j in range(k)], [1000.0] * k, [0] * k)
    assert starved_trend(rising, 4e5, t, 3600.0, 1e7, OPTS) is None
    assert starved_trend(flat, 4e5, t, 3600.0, total_tok=5e5, opts=OPTS) == 5e5  # capped at the offered tokens


def _labels_case(tail_long: bool):
    """Adapter 0: 25 requests of 100 tokens, done by t = 1000 s; one more arrives at T - 150 s, before the
    per-adapter grace cut (long or short). Adapter 1: busy and healthy."""
    t_arr = list(np.linspace(10.0, 900.0, 25)) + [3450.0]
    out = [50] * 25 + [5000 if tail_long else 2]
    a = [0] * 26
    t_arr += list(np.linspace(5.0, 3590.0, 200))
    out += [50] * 200
    a += [1] * 200
    order = np.argsort(t_arr, kind="stable")
    req = RequestArrays(np.array(t_arr)[order], np.array(a)[order], np.full(len(t_arr), 50)[order],
                        np.array(out)[order])
    n = len(req)
    done = req.t_arr_s < 1000.0
    res = EngineResult(t_sent_s=np.where(req.t_arr_s < 1000.0, req.t_arr_s, np.nan),
                       t_first_s=np.where(done, req.t_arr_s + 0.05, np.nan),
                       t_finish_s=np.where(done, req.t_arr_s + 0.05 + 0.02 * (req.output_tokens - 1), np.nan),
                       n_preempted=np.zeros(n, np.int32))
    return res, req


def test_adapter_labels_settle_only_when_no_tail_request_can_starve_an_adapter() -> None:
    res, req = _labels_case(tail_long=False)
    assert adapter_labels_settled(res, req, 1000.0, 3600.0, 2, OPTS)
    # a 5,000-token request 150 s before the end may still be open: adapter 0 could end below 90 %
    res, req = _labels_case(tail_long=True)
    assert not adapter_labels_settled(res, req, 1000.0, 3600.0, 2, OPTS)


# ---- the labels an early stop writes ----

def _run(cand: GpuCandidate, seed: int, early: bool, duration_s: float = 3600.0):
    req = generate_requests(candidate_workload(cand, duration_s), duration_s, seed)
    srv = resolve_server(LLAMA, cand.ranks, ServerConfig(max_loras=cand.max_loras, max_cpu_loras=cand.cpu_loras))
    cfg = engine_config(LLAMA, cand.ranks, srv, duration_s)
    opts = OPTS if early else EarlyStopOptions(certain=False, likely=False, healthy=False)
    return run_with_early_stop(cfg, req, opts)[1]


@pytest.mark.slow
@pytest.mark.parametrize("n, a, rate, seed", [(32, 32, 0.2, 0), (96, 16, 0.05, 1), (64, 8, 1.5, 2),
                                              (128, 32, 0.00625, 3)])
def test_early_labels_equal_the_full_runs(n: int, a: int, rate: float, seed: int) -> None:
    rates = np.full(n, rate) * np.where(np.arange(n) % 3 == 0, 4.0, 1.0)
    cand = GpuCandidate(profile=LLAMA, ranks=np.where(np.arange(n) % 2 == 0, 8, 16), rates_rps=rates,
                        server=ServerConfig(max_loras=a))
    early, full = _run(cand, seed, True), _run(cand, seed, False)
    assert early.starved == full.starved
    assert early.adapter_starved == full.adapter_starved
    if early.adapter_labels_exact:
        assert early.starved_adapter_indices == full.starved_adapter_indices
    if early.stop_reason == STOP_HEALTHY:
        assert early.n_adapters_starved == full.n_adapters_starved == 0
        assert early.throughput_tok_s == pytest.approx(full.throughput_tok_s, rel=0.01)
