"""Property tests of the twin engines, with hypothesis.

* ``test_reference_invariants_and_conservation``: the reference engine with ``check_invariants=True``
  (asserts |U| <= A, resident adapters <= A / N_cpu, 0 <= free <= blocks_total, block accounting,
  running <= max_num_seqs, budget >= 0, no admission in a step that preempted, time monotone after every
  step) plus request and token conservation from its ``ReferenceTrace``.
* ``test_result_properties`` and ``test_bit_identical_reruns``: properties that can be read from an
  ``EngineResult`` alone, for the reference engine and for the fast engine (``engine.simulate_fast``).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from engine_cases import Case, build_case, case_params, corner_cases, describe_case
from lorapack.twin.engine import simulate_fast  # required: a missing engine or numba fails the suite
from lorapack.twin.reference import (
    FINISHED,
    NOT_INJECTED,
    RUNNING,
    WAITING,
    run_reference,
    simulate_reference,
)
from lorapack.twin.steptime import C0
from lorapack.twin.types import TIMELINE_COLUMNS, EngineResult

SETTINGS = dict(derandomize=True, deadline=None, database=None, print_blob=False,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

ENGINES = ["reference", "fast"]


def get_engine(name: str):
    return simulate_reference if name == "reference" else simulate_fast


def _timeline_len(duration_s: float, dt_s: float) -> int:
    k = 0
    while k * dt_s < duration_s:
        k += 1
    return k


def check_result_properties(case: Case, res: EngineResult) -> None:
    """Properties every engine's result must satisfy (no access to internal state)."""
    cfg, req = case.cfg, case.req
    n = len(req)
    duration = cfg.duration_s
    t_arr = req.t_arr_s
    out = req.output_tokens.astype(np.int64)
    sent, first, fin = (np.asarray(x, dtype=np.float64) for x in (res.t_sent_s, res.t_first_s, res.t_finish_s))
    n_pre = np.asarray(res.n_preempted)
    assert sent.shape == first.shape == fin.shape == n_pre.shape == (n,)
    dt_min = float(cfg.step_coef[C0]) / 1000.0  # every step lasts at least c0 (all other terms are >= 0)
    eps = 1e-9

    # requests: injected FCFS (a prefix of the arrivals), at a step start t with t_arr <= t < T
    injected = ~np.isnan(sent)
    n_inj = int(injected.sum())
    assert injected[:n_inj].all(), "injected requests are not a prefix of the arrivals"
    assert (sent[injected] >= t_arr[injected]).all()
    assert (sent[injected] < duration).all()
    if cfg.client_cap == 0:
        assert (sent[injected] == t_arr[injected]).all(), "t_sent != t_arr without a client cap"
    has_first = ~np.isnan(first)
    finished = ~np.isnan(fin)
    assert not (has_first & ~injected).any() and not (finished & ~has_first).any()
    assert (n_pre[~injected] == 0).all() and (n_pre >= 0).all()
    assert (first[has_first] >= sent[has_first] + dt_min * (1 - eps)).all(), "first token too early"
    # a completed request produced exactly O tokens: O - 1 more steps after the first token
    gap = fin[finished] - first[finished]
    assert (gap >= (out[finished] - 1) * dt_min - eps * np.maximum(1.0, fin[finished])).all()
    assert (gap[out[finished] == 1] == 0.0).all()
    if finished.any():
        assert res.n_steps >= int(out[finished].max())

    # counters
    assert int(res.n_preemptions) == int(n_pre.sum())
    assert 0 <= res.n_disk_loads <= res.n_gpu_loads  # a disk load is always followed by a GPU load
    assert res.n_steps >= 0
    assert res.busy_s >= res.n_steps * dt_min * (1 - eps)
    assert res.sched_s >= 0.0 and res.load_s >= 0.0
    assert res.busy_s >= (res.sched_s + res.load_s) * (1 - eps)
    if res.n_steps == 0:
        assert res.busy_s == 0.0 and not has_first.any()
    if not cfg.load_ms.any() and not cfg.disk_ms.any():
        assert res.load_s == 0.0
    if cfg.warm_gpu and cfg.max_loras >= cfg.n_adapters:
        assert res.n_gpu_loads == 0

    # timeline
    tl = res.timeline
    assert set(tl) == set(TIMELINE_COLUMNS)
    m = _timeline_len(duration, cfg.timeline_dt_s)
    for col in TIMELINE_COLUMNS:
        assert np.asarray(tl[col]).shape == (m,), col
    assert (np.asarray(tl["t_s"]) == np.arange(m) * cfg.timeline_dt_s).all()
    running = np.asarray(tl["num_requests_running"])
    waiting = np.asarray(tl["num_requests_waiting"])
    kv = np.asarray(tl["kv_cache_usage_perc"], dtype=np.float64)
    pre = np.asarray(tl["num_preemptions_total"])
    resident = np.asarray(tl["num_adapters_resident"])
    ad_running = np.asarray(tl["num_adapters_running"])
    assert ((0 <= running) & (running <= cfg.max_num_seqs)).all()
    assert (waiting >= 0).all() and (running + waiting <= n_inj).all()
    assert ((0.0 <= kv) & (kv <= 1.0)).all(), "KV in use exceeds capacity"
    assert (kv[running == 0] == 0.0).all()
    used_blocks = kv * cfg.kv_blocks
    assert np.allclose(used_blocks, np.round(used_blocks), rtol=0, atol=1e-6)
    assert ((0 <= resident) & (resident <= min(cfg.max_loras, cfg.n_adapters))).all()
    assert ((0 <= ad_running) & (ad_running <= np.minimum(running, cfg.max_loras))).all()
    assert ((ad_running > 0) == (running > 0)).all()
    assert (np.diff(pre) >= 0).all() and (pre <= res.n_preemptions).all() and (pre >= 0).all()
    if m > 0:
        assert running[0] == 0 and waiting[0] == 0 and pre[0] == 0  # tau_0 = 0 is sampled before injection
        warm = min(cfg.max_loras, cfg.n_adapters) if cfg.warm_gpu else 0
        assert resident[0] == warm


def check_trace(case: Case, res: EngineResult, tr) -> None:
    """Conservation laws on the reference engine's internal state."""
    req, cfg = case.req, case.cfg
    n = len(req)
    p = req.prompt_tokens.astype(np.int64)
    o = req.output_tokens.astype(np.int64)
    status = tr.status

    # requests conserved: injected = completed + running + waiting; the rest was never injected
    n_finished = int((status == FINISHED).sum())
    assert tr.ptr == n_finished + len(tr.final_running) + len(tr.final_waiting)
    assert (status[:tr.ptr] != NOT_INJECTED).all() and (status[tr.ptr:] == NOT_INJECTED).all()
    assert sorted(tr.final_running) == np.nonzero(status == RUNNING)[0].tolist()
    assert sorted(tr.final_waiting) == np.nonzero(status == WAITING)[0].tolist()
    assert (np.isnan(res.t_sent_s) == (status == NOT_INJECTED)).all()
    assert (np.isnan(res.t_finish_s) == (status != FINISHED)).all()
    assert tr.ptr <= n and tr.held_end <= n
    if cfg.client_cap == 0:
        assert tr.held_end == 0

    # every completed request produced exactly O tokens; the others fewer
    fin = status == FINISHED
    assert (tr.out_done[fin] == o[fin]).all() and (tr.out_done[~fin] < o[~fin]).all()
    assert (tr.computed[fin] == p[fin] + o[fin] - 1).all()
    assert (np.isnan(res.t_first_s) == (tr.out_done == 0)).all()

    # token conservation: scheduled tokens = prefill + decode work (final computed) + recompute work (lost)
    assert (tr.tokens_scheduled == tr.computed + tr.tokens_lost).all()
    assert (tr.tokens_scheduled[fin] == p[fin] + o[fin] - 1 + tr.tokens_lost[fin]).all()
    assert tr.tokens_computed_total == int(tr.tokens_scheduled.sum())
    assert tr.tokens_computed_total == sum(s.n_tok for s in tr.steps)
    assert (tr.tokens_lost[res.n_preempted == 0] == 0).all()
    assert (tr.computed <= p + tr.out_done).all()

    # KV blocks: held only by running requests, exactly ceil(computed / BS) each
    bs = cfg.block_size
    assert tr.free_blocks == cfg.kv_blocks - int(tr.blocks.sum())
    assert (tr.blocks[status != RUNNING] == 0).all()
    run_idx = np.array(tr.final_running, dtype=np.int64)
    assert (tr.blocks[run_idx] == -(-tr.computed[run_idx] // bs)).all()

    # per-step records
    steps = tr.steps
    assert res.n_steps == len(steps) == tr.final_step
    assert res.n_preemptions == sum(len(s.victims) for s in steps) + tr.n_idle_preemptions
    assert res.n_gpu_loads == sum(len(s.gpu_loaded) for s in steps)
    assert res.n_disk_loads == sum(len(s.disk_loaded) for s in steps)
    busy = 0.0
    prev_end = 0.0
    for s in steps:
        assert s.t_start >= prev_end and s.t_end > s.t_start and s.t_start < cfg.duration_s
        prev_end = s.t_end
        busy += s.dt_s
        assert sum(k for _, k in s.scheduled) == s.n_tok <= cfg.max_num_batched_tokens
        assert len(s.u_step) <= cfg.max_loras
        assert not (s.victims and s.admitted)
        # all running requests but the tail are decodes, so the budget never stalls a running request
        assert s.n_running == len(s.scheduled)
    assert res.busy_s == busy
    if steps:
        assert tr.final_t_s >= steps[-1].t_end
    assert tr.final_t_s >= cfg.duration_s
    assert tr.max_running <= cfg.max_num_seqs and tr.max_u_step <= cfg.max_loras


def _check_reference_invariants_and_conservation(params) -> None:
    case = build_case(params)
    res, tr = run_reference(case.cfg, case.req, check_invariants=True, record_steps=True)
    try:
        check_trace(case, res, tr)
        check_result_properties(case, res)
    except AssertionError as e:
        raise AssertionError(f"{e}\n{describe_case(case)}") from e


@settings(max_examples=30, **SETTINGS)
@given(params=case_params())
def test_reference_invariants_and_conservation_quick(params):
    """The fast tier's sample; the 150 examples of the next test run in the slow tier."""
    _check_reference_invariants_and_conservation(params)


@pytest.mark.slow
@settings(max_examples=150, **SETTINGS)
@given(params=case_params())
def test_reference_invariants_and_conservation(params):
    _check_reference_invariants_and_conservation(params)


@pytest.mark.parametrize("case", corner_cases(), ids=lambda c: c.name)
def test_reference_invariants_corner_cases(case):
    res, tr = run_reference(case.cfg, case.req, check_invariants=True, record_steps=True)
    check_trace(case, res, tr)
    check_result_properties(case, res)


@pytest.mark.parametrize("engine", ENGINES)
@settings(max_examples=100, **SETTINGS)
@given(params=case_params())
def test_result_properties(engine, params):
    simulate = get_engine(engine)
    case = build_case(params)
    res = simulate(case.cfg, case.req)
    try:
        check_result_properties(case, res)
    except AssertionError as e:
        raise AssertionError(f"{engine}: {e}\n{describe_case(case)}") from e


def _assert_identical(a: EngineResult, b: EngineResult) -> None:
    for f in ("t_sent_s", "t_first_s", "t_finish_s", "n_preempted"):
        x, y = np.asarray(getattr(a, f)), np.asarray(getattr(b, f))
        assert x.dtype == y.dtype and x.tobytes() == y.tobytes(), f
    for f in ("n_steps", "n_preemptions", "n_gpu_loads", "n_disk_loads", "busy_s", "sched_s", "load_s"):
        assert getattr(a, f) == getattr(b, f), f
    assert set(a.timeline) == set(b.timeline)
    for col in a.timeline:
        x, y = np.asarray(a.timeline[col]), np.asarray(b.timeline[col])
        assert x.dtype == y.dtype and x.tobytes() == y.tobytes(), col


@pytest.mark.parametrize("engine", ENGINES)
@settings(max_examples=30, **SETTINGS)
@given(params=case_params())
def test_bit_identical_reruns(engine, params):
    simulate = get_engine(engine)
    first = simulate(build_case(params).cfg, build_case(params).req)
    case = build_case(params)  # fresh arrays from the same parameters
    second = simulate(case.cfg, case.req)
    third = simulate(case.cfg, case.req)
    _assert_identical(first, second)
    _assert_identical(second, third)


@pytest.mark.parametrize("engine", ENGINES)
def test_engine_does_not_modify_inputs(engine):
    simulate = get_engine(engine)
    for case in corner_cases()[:6]:
        before = [x.copy() for x in (case.req.t_arr_s, case.req.adapter, case.req.prompt_tokens,
                                     case.req.output_tokens, case.cfg.load_ms, case.cfg.disk_ms,
                                     case.cfg.step_coef)]
        simulate(case.cfg, case.req)
        after = (case.req.t_arr_s, case.req.adapter, case.req.prompt_tokens, case.req.output_tokens,
                 case.cfg.load_ms, case.cfg.disk_ms, case.cfg.step_coef)
        for x, y in zip(before, after, strict=True):
            np.testing.assert_array_equal(x, y)
