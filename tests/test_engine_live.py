"""The live engine (``Engine.live``): requests added while it runs, finished ones leaving the arrays.

* for the same arrivals, a live run (each request added just before the engine passes its arrival time, arrays
  compacted as they fill) gives bit-identical per-request results and run counters to the batch run;
* memory stays bounded over a long run whose results are drained;
* ``abort`` keeps the engine's books: blocks, queue, running list, adapters (and the rest still finishes);
* misuse is a one-line ``SpecError``.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from engine_cases import build_case, case_params, describe_case
from lorapack.errors import SpecError
from lorapack.twin.engine import FINISHED, RUNNING, WAITING, Engine, simulate_fast
from lorapack.twin.steptime import StepModel
from lorapack.twin.types import EngineConfig, RequestArrays

SETTINGS = dict(derandomize=True, deadline=None, database=None, print_blob=False,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
RESULT_COLUMNS = ("t_sent_s", "t_first_s", "t_finish_s", "n_preempted")


def _live_run(cfg: EngineConfig, req: RequestArrays, until_s: float, capacity: int = 4,
              drain_every: int = 3) -> tuple[Engine, dict[int, tuple]]:
    """Add each request with t_arr < until_s right before the engine passes it (as a server does), draining now
    and then; returns the engine after ``advance_to(until_s)`` and every request's results by id."""
    eng = Engine.live(cfg, capacity=capacity)
    results: dict[int, tuple] = {}

    def drain() -> None:
        d = eng.drain_finished()
        for j, rid in enumerate(d["id"]):
            results[int(rid)] = tuple(d[c][j] for c in RESULT_COLUMNS)

    for i in np.flatnonzero(req.t_arr_s < until_s):
        eng.advance_to(req.t_arr_s[i])
        rid = eng.add_request(req.t_arr_s[i], int(req.adapter[i]), int(req.prompt_tokens[i]),
                              int(req.output_tokens[i]))
        assert rid == i
        if i % drain_every == 0:
            drain()
    eng.advance_to(until_s)
    drain()
    # the requests still in flight: read in place
    n = int(eng.counters["n_known"])
    for k in range(n):
        rid = int(eng._live.ids[k])
        if rid not in results:
            results[rid] = tuple(getattr(eng.state.requests, c)[k] for c in RESULT_COLUMNS)
    return eng, results


def _assert_same(res, results: dict[int, tuple], n_added: int, what: str) -> None:
    assert len(results) == n_added
    for i in range(n_added):
        for c, v in zip(RESULT_COLUMNS, results[i], strict=True):
            want = getattr(res, c)[i]
            assert (np.isnan(want) and np.isnan(v)) if c != "n_preempted" and np.isnan(want) else want == v, \
                f"{what}: request {i} {c}: live {v!r}, batch {want!r}"


@settings(max_examples=60, **SETTINGS)
@given(case_params(max_requests=200))
def test_live_equals_batch(params) -> None:
    case = build_case(params)
    cfg, req = case.cfg, case.req
    res = simulate_fast(cfg, req)
    eng, results = _live_run(cfg, req, cfg.duration_s)
    n_added = int((req.t_arr_s < cfg.duration_s).sum())
    what = describe_case(case)
    _assert_same(res, results, n_added, what)
    # the requests arriving at or after the end were never sent in the batch run
    assert np.isnan(res.t_sent_s[n_added:]).all()
    c = eng.counters
    assert (int(c["step"]), int(c["n_preemptions"]), int(c["n_gpu_loads"]), int(c["n_disk_loads"])) == \
        (res.n_steps, res.n_preemptions, res.n_gpu_loads, res.n_disk_loads), what
    assert float(c["busy_s"]) == res.busy_s, what


def _config(n_adapters: int = 8, kv_blocks: int = 300, **kw) -> EngineConfig:
    rng = np.random.default_rng(7)
    return EngineConfig(load_ms=rng.uniform(1, 20, n_adapters), disk_ms=rng.uniform(5, 50, n_adapters), max_loras=2,
                        max_cpu_loras=4, kv_blocks=kv_blocks,
                        step_coef=StepModel(c0_ms=10.0, c1_ms_per_req=0.05).to_array(), max_num_seqs=16,
                        max_num_batched_tokens=256, warm_gpu=False, warm_cpu=False, **kw)


def _arrivals(n: int, rate_rps: float, n_adapters: int, seed: int) -> RequestArrays:
    rng = np.random.default_rng(seed)
    return RequestArrays(np.cumsum(rng.exponential(1 / rate_rps, n)), rng.integers(0, n_adapters, n),
                         rng.integers(1, 400, n), rng.integers(1, 120, n))


def test_live_equals_batch_under_preemption_and_starvation() -> None:
    """An overloaded server (preemptions, a growing queue, few slots) with one request at a time, arrays
    compacting and growing: still the batch run, bit for bit."""
    cfg = _config(kv_blocks=60, duration_s=500.0)
    req = _arrivals(3000, 12.0, 8, seed=3)
    res = simulate_fast(cfg, req)
    assert res.n_preemptions > 100
    _eng, results = _live_run(cfg, req, cfg.duration_s, capacity=2, drain_every=1)
    _assert_same(res, results, int((req.t_arr_s < cfg.duration_s).sum()), "overload")


def test_memory_stays_bounded_when_results_are_drained() -> None:
    cfg = _config()
    req = _arrivals(20_000, 4.0, 8, seed=5)  # healthy: a few requests in flight at a time
    eng, results = _live_run(cfg, req, float(req.t_arr_s[-1]) + 100.0, capacity=8, drain_every=1)
    assert len(results) == len(req)
    assert eng.capacity <= 256, eng.capacity
    finished = np.array([results[i][2] for i in range(len(req))])
    assert np.isfinite(finished).all()


def _check_books(eng: Engine) -> None:
    """Blocks, queue and running list agree with the per-request status."""
    st, c = eng.state, eng.counters
    n = int(c["n_known"])
    status = st.requests.status[:n]
    lo, n_run = int(c["running_lo"]), int(c["n_running"])
    running = st.running.request[lo:lo + n_run]
    assert sorted(running.tolist()) == np.flatnonzero(status == RUNNING).tolist()
    assert int(c["n_waiting"]) == int((status == WAITING).sum())
    assert int(c["free_kv_blocks"]) + int(st.running.kv_blocks[lo:lo + n_run].sum()) == eng.cfg.kv_blocks
    queued = []
    for a in range(eng.cfg.n_adapters):
        r = int(st.queue.head[a])
        while r >= 0:
            queued.append(r)
            r = int(st.queue.next[r])
    assert sorted(queued) == np.flatnonzero(status == WAITING).tolist()
    per_adapter = np.bincount(st.running.adapter[lo:lo + n_run].astype(np.int64), minlength=eng.cfg.n_adapters)
    assert per_adapter.tolist() == st.adapters.n_running.tolist()
    assert int(c["n_active_adapters"]) == int((per_adapter > 0).sum())


@pytest.mark.parametrize("seed", range(4))
def test_abort_keeps_the_books(seed: int) -> None:
    cfg = _config(kv_blocks=80)
    req = _arrivals(600, 10.0, 8, seed=seed)
    rng = np.random.default_rng(seed)
    eng = Engine.live(cfg, capacity=4)
    aborted = set()
    finished: dict[int, float] = {}
    for i in range(len(req)):
        eng.advance_to(req.t_arr_s[i])
        eng.add_request(req.t_arr_s[i], int(req.adapter[i]), int(req.prompt_tokens[i]), int(req.output_tokens[i]))
        if rng.random() < 0.15:  # abort a random request in flight (or just added: not injected yet)
            ids, _produced, status = eng.outputs()
            live = ids[status != FINISHED]
            if len(live):
                victim = int(rng.choice(live))
                assert eng.abort(victim)
                aborted.add(victim)
        _check_books(eng)
        d = eng.drain_finished()
        finished.update(zip(d["id"].tolist(), d["t_finish_s"].tolist(), strict=True))
    eng.advance_to(float(req.t_arr_s[-1]) + 10_000.0)
    _check_books(eng)
    d = eng.drain_finished()
    finished.update(zip(d["id"].tolist(), d["t_finish_s"].tolist(), strict=True))
    assert set(finished) == set(range(len(req)))
    assert all(np.isnan(finished[i]) for i in aborted)
    assert all(np.isfinite(finished[i]) for i in range(len(req)) if i not in aborted)
    assert int(eng.counters["free_kv_blocks"]) == cfg.kv_blocks
    assert not eng.abort(0)  # finished (or aborted) already


def test_outputs_report_streamed_tokens() -> None:
    cfg = _config()
    eng = Engine.live(cfg)
    rid = eng.add_request(0.0, 1, 40, 5)
    seen = []
    t = 0.0
    while True:
        t += 0.005
        eng.advance_to(t)  # runs the step that starts before t: the outputs are those at its end, eng.t_s
        ids, produced, status = eng.outputs()
        seen.append((int(produced[ids == rid][0]), eng.t_s))
        if status[ids == rid][0] == FINISHED:
            break
    tokens = [k for k, _t in seen]
    assert tokens == sorted(tokens) and tokens[-1] == 5 and set(tokens) == {1, 2, 3, 4, 5}
    d = eng.drain_finished()
    assert d["id"].tolist() == [rid] and np.isfinite(d["t_finish_s"]).all()
    assert len(eng.outputs()[0]) == 0


def test_live_misuse_is_a_spec_error() -> None:
    cfg = _config()
    batch = Engine(cfg, _arrivals(3, 1.0, 8, seed=0))
    with pytest.raises(SpecError, match="live engine"):
        batch.add_request(0.0, 0, 1, 1)
    eng = Engine.live(cfg)
    eng.advance_to(5.0)
    with pytest.raises(SpecError, match="t_arr_s 4.0"):
        eng.add_request(4.0, 0, 10, 10)
    with pytest.raises(SpecError, match="adapter 8"):
        eng.add_request(5.0, 8, 10, 10)
    with pytest.raises(SpecError, match="prompt_tokens 0"):
        eng.add_request(5.0, 0, 0, 10)
    with pytest.raises(SpecError, match="finite time"):
        eng.advance_to(float("inf"))
    with pytest.raises(SpecError, match="drain_finished"):
        eng.result()
    with pytest.raises(SpecError, match="capacity"):
        Engine.live(cfg, capacity=0)
    assert eng.t_s == 5.0  # an idle live engine waits at the stop time


def test_base_model_requests_use_no_adapter() -> None:
    """Requests for the base model (``base_adapter``) take no slot, load nothing and join a batch that already
    has max_loras adapters; alone, their steps cost the base model's time only."""
    cfg = _config(n_adapters=4)  # max_loras 2; adapter 0 stands for the base model
    eng = Engine.live(cfg, base_adapter=0)
    for _ in range(3):
        eng.add_request(0.0, 0, 30, 20)
    eng.advance_to(0.001)
    assert int(eng.counters["n_gpu_loads"]) == 0 and int(eng.counters["n_active_adapters"]) == 0
    assert int(eng.counters["n_running"]) == 3
    eng.advance_to(0.5)
    t = eng.t_s
    for a in (1, 2, 0, 3):  # two adapters fill max_loras; the base request is still admitted, adapter 3 waits
        eng.add_request(t, a, 30, 200)
    eng.advance_to(t + 0.001)
    c = eng.counters
    assert int(c["n_running"]) == 3 and int(c["n_waiting"]) == 1 and int(c["n_active_adapters"]) == 2
    eng.advance_to(t + 100.0)
    d = eng.drain_finished()
    assert len(d["id"]) == 7 and np.isfinite(d["t_finish_s"]).all()
    assert int(eng.state.adapters.n_running[0]) == 1  # the phantom: the base model is always "running"
    assert not eng.state.adapters.in_gpu[0]
    with pytest.raises(SpecError, match="base_adapter 4"):
        Engine.live(cfg, base_adapter=4)
