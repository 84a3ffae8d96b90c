"""Hand-computed cases for the literal reference engine (docs/engine-semantics.md).

Most cases use a step model whose only term is ``c0 = 15.625 ms``: every step then lasts exactly
``DT = 1/64 s`` and all times below are exact binary fractions, so they are compared with ``==``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from lorapack.twin import steptime
from lorapack.twin.reference import FINISHED, run_reference, simulate_reference
from lorapack.twin.steptime import StepModel
from lorapack.twin.types import TIMELINE_COLUMNS, EngineConfig, RequestArrays

DT = 1.0 / 64.0  # step time of the default step model (s), exact
C0_MS = 15.625


def coef(**kw) -> np.ndarray:
    base = {"c0_ms": C0_MS, "c1_ms_per_req": 0.0, "lora_form": "none"}
    base.update(kw)
    return StepModel(**base).to_array()


def make_cfg(n_adapters: int = 1, max_loras: int = 1, max_cpu_loras: int | None = None, kv_blocks: int = 1000,
             step_coef: np.ndarray | None = None, load_ms=None, disk_ms=None, **kw) -> EngineConfig:
    return EngineConfig(
        load_ms=np.zeros(n_adapters) if load_ms is None else np.asarray(load_ms, dtype=float),
        disk_ms=np.zeros(n_adapters) if disk_ms is None else np.asarray(disk_ms, dtype=float),
        max_loras=max_loras,
        max_cpu_loras=n_adapters if max_cpu_loras is None else max_cpu_loras,
        kv_blocks=kv_blocks,
        step_coef=coef() if step_coef is None else step_coef,
        **{"duration_s": 10.0, **kw})


def make_req(*rows: tuple[float, int, int, int]) -> RequestArrays:
    """Rows of (t_arr_s, adapter, P, O), already sorted."""
    t, a, p, o = zip(*rows, strict=True)
    return RequestArrays(t_arr_s=np.array(t), adapter=np.array(a), prompt_tokens=np.array(p),
                         output_tokens=np.array(o))


def run(cfg: EngineConfig, req: RequestArrays):
    return run_reference(cfg, req, check_invariants=True, record_steps=True)


# --------------------------------------------------------------------------------------------- step time


def test_single_request_exact_step_times_additive():
    sm = dict(c0_ms=10.0, c1_ms_per_req=0.5, p1_ms_per_prefill_token=0.02, a3_ms_per_kctx=2.0,
              lora_form="additive", e0_ms=3.0, e1_ms_per_token=0.04, e2_ms_per_adapter=0.35,
              e3_ms_per_kreq_adapter=10.0, rank_scale=1.5, sched_ms_per_running=0.1, sched_const_ms=0.2,
              sched_ms_per_waiting=0.05, sched_ms_per_waiting_slot_ratio=0.01, sched_baseline_ms=0.05)
    cfg = make_cfg(step_coef=StepModel(**sm).to_array())
    req = make_req((0.25, 0, 40, 4))
    res, tr = run(cfg, req)

    sched = 0.1 * 1 + 0.2 + 0 * (0.05 - 0.01) - 0.05  # B = 1 running, W = 0 after admission
    # prefill step: B = 1, n_pf = 40, n_tok = 40, ctx = 0, L = 1
    prefill = (10.0 + 0.5 * 1 + 0.02 * 40 + 2.0 * 0 / 1000) + 3.0 + 1.5 * (0.04 * 40 + 0.35 * 1 + 10.0 * 1 * 1 / 1000)
    t_first = 0.25 + (sched + prefill) / 1000
    t = t_first
    for ctx in (40, 41, 42):  # three decode steps: B = B_dec = 1, n_pf = 0, n_tok = 1
        decode = (10.0 + 0.5 + 0.0 + 2.0 * ctx / 1000) + 3.0 + 1.5 * (0.04 * 1 + 0.35 + 10.0 / 1000)
        t += (sched + decode) / 1000

    assert res.t_sent_s[0] == 0.25
    assert res.t_first_s[0] == pytest.approx(t_first, rel=1e-12)
    assert res.t_finish_s[0] == pytest.approx(t, rel=1e-12)
    assert res.n_steps == 4
    assert res.busy_s == pytest.approx(t - 0.25, rel=1e-12)
    assert res.sched_s == pytest.approx(4 * sched / 1000, rel=1e-12)
    assert res.load_s == 0.0 and res.n_gpu_loads == 0 and res.n_disk_loads == 0  # warm: adapter 0 resident
    assert [(s.b, s.b_dec, s.n_pf, s.n_tok, s.ctx, s.n_lora) for s in tr.steps] == [
        (1, 0, 40, 40, 0, 1), (1, 1, 0, 1, 40, 1), (1, 1, 0, 1, 41, 1), (1, 1, 0, 1, 42, 1)]


def test_rank_factors_apply_per_token_and_per_adapter():
    """rank_scale_token multiplies e1/e1p (per token), rank_scale e2/e3 (per adapter)."""
    sm = StepModel(c0_ms=10.0, c1_ms_per_req=0.0, lora_form="additive", e0_ms=1.0, e1_ms_per_token=0.04,
                   e1p_ms_per_prefill_token=0.02, e2_ms_per_adapter=0.5, e3_ms_per_kreq_adapter=10.0,
                   rank_scale=3.0, rank_scale_token=0.5)
    compute_ms = steptime.compute_ms

    coef = sm.to_array()
    # 2 decode tokens + 30 prefill tokens, 3 requests, 2 adapters
    want = 10.0 + 1.0 + 0.5 * (0.04 * 2 + 0.02 * 30) + 3.0 * (0.5 * 2 + 10.0 * 3 * 2 / 1000)
    assert compute_ms(coef, 3, 30, 32, 0.0, 2) == pytest.approx(want, rel=1e-12)
    # without a token factor both terms take rank_scale (older profiles: one gamma)
    one = StepModel(c0_ms=10.0, c1_ms_per_req=0.0, lora_form="additive", e1_ms_per_token=0.04,
                    e2_ms_per_adapter=0.5, rank_scale=3.0).to_array()
    assert compute_ms(one, 1, 0, 1, 0.0, 1) == pytest.approx(10.0 + 3.0 * (0.04 + 0.5), rel=1e-12)


@pytest.mark.parametrize("form", ["multiplicative", "none"])
def test_single_request_other_lora_forms(form):
    cfg = make_cfg(step_coef=StepModel(c0_ms=8.0, c1_ms_per_req=0.25, p1_ms_per_prefill_token=0.5,
                                       lora_form=form, k0_pct=150.0, k1_pct_per_adapter=10.0,
                                       e0_ms=99.0).to_array())
    res, _ = run(cfg, make_req((0.0, 0, 8, 2)))
    factor = (10.0 * 1 + 150.0) / 100 if form == "multiplicative" else 1.0
    prefill = (8.0 + 0.25 + 0.5 * 8) * factor
    decode = (8.0 + 0.25) * factor
    assert res.t_first_s[0] == pytest.approx(prefill / 1000, rel=1e-12)
    assert res.t_finish_s[0] == pytest.approx((prefill + decode) / 1000, rel=1e-12)


def test_scheduler_time_uses_waiting_after_the_passes_and_clips_at_zero():
    # A = 1: the request of adapter 1 is skipped and stays waiting (W = 1 after the passes)
    sm = dict(c0_ms=C0_MS, c1_ms_per_req=0.0, lora_form="none", sched_ms_per_running=0.5, sched_const_ms=0.25,
              sched_ms_per_waiting=2.0, sched_ms_per_waiting_slot_ratio=0.5, sched_baseline_ms=0.125)
    req = make_req((0.0, 0, 1, 1), (0.0, 1, 1, 1))
    res, tr = run(make_cfg(n_adapters=2, step_coef=StepModel(**sm).to_array()), req)
    assert tr.steps[0].n_running == 1 and tr.steps[0].n_waiting == 1
    assert tr.steps[0].sched_ms == 0.5 * 1 + 0.25 + 1 * (2.0 - 0.5) - 0.125
    assert tr.steps[1].sched_ms == 0.5 * 1 + 0.25 - 0.125  # second step: W = 0
    assert res.t_first_s[0] == (C0_MS + 2.125) / 1000

    sm["sched_baseline_ms"] = 10.0  # negative value clips to 0
    res, tr = run(make_cfg(n_adapters=2, step_coef=StepModel(**sm).to_array()), req)
    assert tr.steps[0].sched_ms == 0.0 and res.sched_s == 0.0
    assert res.t_first_s[0] == DT


def test_the_shrink_grid_term_follows_vllms_launch_config():
    """split-K 64 below 128 tokens and 8 from 128 on, blocks of 32 tokens: 84 tokens -> 64 x 3 blocks,
    128 -> 8 x 4, 2048 -> 8 x 64; only in steps whose batch uses adapters."""
    sm = StepModel(c0_ms=10.0, c1_ms_per_req=0.0, lora_form="additive", shrink_grid_ms_per_kblock=2.0)
    coef = sm.to_array()
    for n_tok, blocks in ((1, 64), (84, 192), (127, 256), (128, 32), (2048, 512)):
        assert steptime.compute_ms(coef, 1, 0, n_tok, 0.0, 1) == pytest.approx(10.0 + 2.0 * blocks / 1000), n_tok
    assert steptime.compute_ms(coef, 1, 0, 84, 0.0, 0) == 10.0  # no adapter in the batch: no LoRA kernel


def test_chunked_prefill_step_times():
    cfg = make_cfg(step_coef=StepModel(c0_ms=10.0, c1_ms_per_req=0.0, p1_ms_per_prefill_token=0.5,
                                       lora_form="none").to_array(),
                   max_num_batched_tokens=16)
    res, tr = run(cfg, make_req((0.0, 0, 40, 2)))
    assert [s.scheduled for s in tr.steps] == [((0, 16),), ((0, 16),), ((0, 8),), ((0, 1),)]
    assert [s.ctx for s in tr.steps] == [0, 16, 32, 40]
    steps_ms = [10.0 + 0.5 * 16, 10.0 + 0.5 * 16, 10.0 + 0.5 * 8, 10.0]
    assert res.t_first_s[0] == pytest.approx(sum(steps_ms[:3]) / 1000, rel=1e-12)
    assert res.t_finish_s[0] == pytest.approx(sum(steps_ms) / 1000, rel=1e-12)


# --------------------------------------------------------------------------------------------- KV blocks


@pytest.mark.parametrize("prompt,output,kv_blocks,preempted", [
    (10, 23, 2, False),  # max computed = P + O - 1 = 32 tokens = exactly 2 blocks
    (10, 24, 2, True),  # the last decode step needs a 33rd token slot -> 3rd block
    (32, 1, 2, False),  # a 32-token prompt needs exactly 2 blocks at admission
    (16, 2, 1, True),  # the first decode (computed 16 -> 17) needs the 2nd block
    (15, 2, 1, False),
])
def test_kv_blocks_exactly_at_block_boundaries(prompt, output, kv_blocks, preempted):
    res, _ = run(make_cfg(kv_blocks=kv_blocks), make_req((0.0, 0, prompt, output)))
    assert (res.n_preemptions > 0) == preempted
    assert np.isnan(res.t_finish_s[0]) == preempted
    if not preempted:
        assert res.t_finish_s[0] == output * DT


def test_admission_needs_blocks_of_first_chunk_only():
    res, _ = run(make_cfg(kv_blocks=2), make_req((0.0, 0, 33, 1)))  # 33 tokens = 3 blocks: never admitted
    assert res.n_steps == 0 and np.isnan(res.t_first_s[0])
    # with a 32-token budget the first chunk needs 2 blocks; the second chunk then needs the 3rd: self-preemption
    res, tr = run(make_cfg(kv_blocks=2, max_num_batched_tokens=32), make_req((0.0, 0, 33, 1)))
    assert tr.steps[0].scheduled == ((0, 32),)
    assert res.n_preemptions == 1


def test_decode_allocates_a_block_exactly_when_computed_is_a_multiple_of_block_size():
    # sample at every step end: after k steps, computed = k tokens and the request holds ceil(k / 16) blocks
    cfg = make_cfg(kv_blocks=100, timeline_dt_s=DT, duration_s=48 * DT)
    res, _ = run(cfg, make_req((0.0, 0, 1, 40)))
    usage = res.timeline["kv_cache_usage_perc"]
    assert len(usage) == 48
    expected = [0.0] + [math.ceil(k / 16) / 100 for k in range(1, 40)] + [0.0] * 8
    assert usage.tolist() == expected
    assert res.t_finish_s[0] == 40 * DT


# --------------------------------------------------------------------------------------------- waiting pass


def test_max_loras_skip_lets_a_later_request_of_a_resident_adapter_overtake():
    # A = 1, warm GPU holds adapter 1; r1 (adapter 1) is skipped while adapter 0 runs, r2 (adapter 0,
    # arriving exactly at the end of step 0) overtakes it
    cfg = make_cfg(n_adapters=2, max_loras=1)
    req = make_req((0.0, 0, 4, 10), (0.0, 1, 4, 3), (DT, 0, 4, 3))
    res, tr = run(cfg, req)
    assert tr.steps[0].admitted == (0,) and tr.steps[0].gpu_evicted == (1,)
    assert tr.steps[1].admitted == (2,)
    assert res.t_first_s.tolist() == [DT, 11 * DT, 2 * DT]
    assert res.t_finish_s.tolist() == [10 * DT, 13 * DT, 4 * DT]
    assert res.n_gpu_loads == 2  # adapter 0 at step 0, adapter 1 at step 10


@pytest.mark.parametrize("big_adapter", [1, 0])
def test_large_head_request_of_a_non_allowed_adapter_is_skipped_not_stopping(big_adapter):
    # r1 (150 tokens = 10 blocks) cannot get its blocks while r0 holds one. If its adapter is not allowed
    # (A = 1, adapter 1) it is skipped and r2 is admitted (pitfall 5); if it is allowed it stops the pass.
    cfg = make_cfg(n_adapters=2, max_loras=1, kv_blocks=10)
    req = make_req((0.0, 0, 16, 40), (0.0, big_adapter, 150, 1), (DT, 0, 16, 2))
    res, tr = run(cfg, req)
    assert res.t_finish_s[0] == 40 * DT
    if big_adapter == 1:
        assert res.t_first_s[2] == 2 * DT and res.t_finish_s[2] == 3 * DT
        assert res.t_finish_s[1] == 41 * DT  # admitted once adapter 0 has no running request
    else:
        assert tr.steps[40].admitted == (1,)
        assert res.t_finish_s[1] == 41 * DT
        assert res.t_first_s[2] == 42 * DT


def test_max_num_seqs_limits_running():
    res, tr = run(make_cfg(max_num_seqs=1), make_req((0.0, 0, 1, 5), (0.0, 0, 1, 1)))
    assert res.t_first_s.tolist() == [DT, 6 * DT]
    assert max(s.n_running for s in tr.steps) == 1


def test_fcfs_ties_and_arrival_exactly_on_a_step_boundary():
    req = make_req((0.0, 0, 1, 3), (0.0, 0, 1, 3), (DT, 0, 1, 1), (DT + 2.0**-20, 0, 1, 1))
    res, tr = run(make_cfg(max_num_batched_tokens=2), req)
    assert tr.steps[0].admitted == (0, 1)
    # r2 arrives exactly when step 0 ends; it is injected at the start of step 1 but the two decodes use
    # the whole budget, so it is admitted in step 3 (after both finished at the end of step 2)
    assert tr.steps[1].injected == (2,) and tr.steps[1].admitted == ()
    assert tr.steps[2].injected == (3,)
    assert res.t_sent_s.tolist() == req.t_arr_s.tolist()
    assert res.t_first_s.tolist() == [DT, DT, 4 * DT, 4 * DT]


# --------------------------------------------------------------------------------------------- budget


def test_budget_exhaustion_limits_chunks_and_blocks_admission():
    # MNBT = 4: two decodes leave 2 tokens for r2's prefill; r3 is not admitted while the budget is used up.
    # No running request is ever left unscheduled (all but the tail are decodes, see the property tests).
    req = make_req((0.0, 0, 1, 20), (0.0, 0, 1, 20), (0.0, 0, 10, 5), (0.0, 0, 1, 3))
    res, tr = run(make_cfg(max_num_batched_tokens=4), req)
    assert tr.steps[0].scheduled == ((0, 1), (1, 1), (2, 2))
    assert (tr.steps[0].b_dec, tr.steps[0].n_pf) == (0, 4)  # a 1-token prompt is prefill, not a decode
    for s in tr.steps[1:5]:  # r2's chunks: 2, 2, 2, 2, 2 tokens in steps 0-4
        assert s.scheduled == ((0, 1), (1, 1), (2, 2)) and s.budget_left == 0
        assert (s.b_dec, s.n_pf) == (2, 2)
    assert tr.steps[5].scheduled == ((0, 1), (1, 1), (2, 1), (3, 1))
    assert res.t_first_s[2] == 5 * DT and res.t_first_s[3] == 6 * DT
    assert all(s.n_tok <= 4 and s.n_running == len(s.scheduled) for s in tr.steps)


# --------------------------------------------------------------------------------------------- preemption


def _three_victims_case():
    # three 16-token prompts fill a 3-block pool; the first decode step needs two more blocks
    cfg = make_cfg(kv_blocks=3, duration_s=4.0)
    req = make_req((0.0, 0, 16, 20), (0.0, 0, 16, 30), (0.0, 0, 16, 25))
    return cfg, req, *run(cfg, req)


def test_preemption_order_latest_victim_first():
    _, _, res, tr = _three_victims_case()
    s1 = tr.steps[1]
    assert s1.victims == (2, 1)  # the tail of running first; r1 is the request being scheduled itself
    assert s1.scheduled == ((0, 1),) and s1.admitted == ()
    # the later victim (r1) is in front of the earlier one (r2): re-admitted first
    assert tr.steps[20].admitted == (1,)
    r2_admission = next(s for s in tr.steps[1:] if 2 in s.admitted)
    assert r2_admission.s == 49  # after r1 finished at the end of step 48
    assert res.n_preempted.tolist() == [0, 1, 1] and res.n_preemptions == 2
    assert res.t_finish_s.tolist() == [20 * DT, 49 * DT, 73 * DT]


def test_recompute_length_and_ttft_not_reset():
    _, req, res, tr = _three_victims_case()
    # re-admitted with P + out_done = 16 + 1 tokens (chunked like a prefill), then produces its next token
    assert tr.steps[20].scheduled == ((1, 17),)
    assert tr.steps[20].b_dec == 0 and tr.steps[20].n_pf == 17
    assert res.t_first_s.tolist() == [DT, DT, DT]  # TTFT is not reset by the preemption
    assert tr.tokens_lost.tolist() == [0, 16, 16]
    p, o = req.prompt_tokens, req.output_tokens
    assert (tr.tokens_scheduled == p + o - 1 + tr.tokens_lost).all()
    assert (tr.status == FINISHED).all()


def test_recompute_after_several_tokens():
    # r1 (P = 14) has produced 3 tokens when its decode needs a 2nd block (computed 16 -> 17) and none is
    # free: it preempts itself; once r0 finished it is re-admitted with P + out_done = 17 tokens
    cfg = make_cfg(kv_blocks=3)
    res, tr = run(cfg, make_req((0.0, 0, 16, 20), (0.0, 0, 14, 10)))
    assert tr.steps[3].victims == (1,) and tr.steps[3].scheduled == ((0, 1),)
    assert tr.steps[20].scheduled == ((1, 17),) and tr.steps[20].admitted == (1,)
    assert res.t_first_s.tolist() == [DT, DT]
    assert res.t_finish_s.tolist() == [20 * DT, 27 * DT]
    assert tr.tokens_lost.tolist() == [0, 16]
    assert tr.tokens_scheduled.tolist() == [16 + 19, 14 + 9 + 16]


def test_no_admission_in_a_step_that_preempted():
    # step 2: r1's chunk needs a 3rd block -> r1 (the tail) preempts itself; 16 tokens of budget and 2 free
    # blocks would allow re-admitting it, but nothing is admitted in a step that preempted (pitfall 7)
    cfg = make_cfg(kv_blocks=4, max_num_batched_tokens=17)
    res, tr = run(cfg, make_req((0.0, 0, 16, 30), (0.0, 0, 48, 30)))
    assert [s.scheduled for s in tr.steps[:4]] == [
        ((0, 16), (1, 1)), ((0, 1), (1, 16)), ((0, 1),), ((0, 1), (1, 16))]
    assert tr.steps[2].victims == (1,) and tr.steps[2].admitted == () and tr.steps[2].budget_left == 16
    assert tr.steps[3].admitted == (1,)
    assert res.n_preempted.tolist()[1] >= 1


def test_self_preemption_of_an_only_request_is_an_idle_iteration():
    # Literal semantics: a step whose running pass preempts every running request schedules nothing and
    # is idle: no time is charged and time jumps to the next arrival. (Only possible for a request that
    # does not fit the whole KV pool.)
    cfg = make_cfg(kv_blocks=1, duration_s=3.0)
    res, tr = run(cfg, make_req((0.0, 0, 16, 3), (1.0, 0, 1, 1)))
    assert res.n_steps == 1 and res.n_preemptions == 1 and res.busy_s == DT
    assert res.t_first_s[0] == DT and np.isnan(res.t_finish_s[0])
    assert np.isnan(res.t_first_s[1])  # r0 (17 tokens to recompute = 2 blocks) blocks the head forever
    assert res.t_sent_s[1] == 1.0
    assert tr.final_waiting == [0, 1] and tr.final_t_s == 3.0


# --------------------------------------------------------------------------------------------- adapters


@pytest.mark.parametrize("warm_gpu,warm_cpu,gpu_loads,disk_loads", [
    (True, True, 2, 1),
    (False, False, 3, 3),
    (True, False, 2, 2),
    (False, True, 3, 1),
])
def test_warm_and_cold_start(warm_gpu, warm_cpu, gpu_loads, disk_loads):
    # N = 5, A = 2, N_cpu = 3; warm GPU = {3, 4}, warm CPU = {2, 3, 4}; requests of adapters 4, 2, 0
    load_ms = [1.0, 2.0, 4.0, 8.0, 16.0]
    disk_ms = [100.0, 200.0, 400.0, 800.0, 1600.0]
    cfg = make_cfg(n_adapters=5, max_loras=2, max_cpu_loras=3, load_ms=load_ms, disk_ms=disk_ms,
                   warm_gpu=warm_gpu, warm_cpu=warm_cpu, timeline_dt_s=1.0, duration_s=4.0)
    res, tr = run(cfg, make_req((0.0, 4, 1, 1), (1.0, 2, 1, 1), (2.0, 0, 1, 1)))
    assert (res.n_gpu_loads, res.n_disk_loads) == (gpu_loads, disk_loads)
    assert res.timeline["num_adapters_resident"][0] == (2 if warm_gpu else 0)
    loads = [s.load_ms for s in tr.steps]
    if warm_gpu and warm_cpu:
        assert loads == [0.0, 4.0, 101.0]
        assert tr.steps[1].gpu_evicted == (3,)
        assert tr.steps[2].cpu_evicted == (3,) and tr.steps[2].gpu_evicted == (4,)
        assert res.t_first_s[0] == DT  # no load for a warm adapter
    if not warm_gpu and not warm_cpu:
        assert loads == [1616.0, 404.0, 101.0]
        assert tr.steps[2].gpu_evicted == (4,)
    assert res.load_s == pytest.approx(sum(loads) / 1000, rel=1e-12)
    assert tr.gpu_resident == [0, 2]
    for s, lm in zip(tr.steps, loads, strict=True):
        assert s.dt_s == (C0_MS + lm) / 1000


def test_warm_start_with_more_slots_than_adapters():
    cfg = make_cfg(n_adapters=3, max_loras=5, max_cpu_loras=5)
    res, _ = run(cfg, make_req((0.0, 0, 1, 1), (0.0, 1, 1, 1), (0.0, 2, 1, 1)))
    assert res.n_gpu_loads == 0 and res.timeline["num_adapters_resident"][0] == 3


def test_gpu_lru_eviction_choice():
    # warm GPU {2, 3} with stamps -2, -1: adapter 2 is the least recently used
    cfg = make_cfg(n_adapters=4, max_loras=2)
    res, tr = run(cfg, make_req((0.0, 0, 1, 1), (1.0, 3, 1, 1), (2.0, 1, 1, 1), (3.0, 2, 1, 1)))
    assert [s.gpu_evicted for s in tr.steps] == [(2,), (), (0,), (3,)]  # step 1 touches 3, so 0 goes next
    assert res.n_gpu_loads == 3 and tr.gpu_resident == [1, 2]


def test_gpu_lru_ties_evict_lowest_index():
    # the batch-protecting policy walks in increasing index (vLLM's walk order is tested by the cascade test)
    cfg = make_cfg(n_adapters=4, max_loras=3, warm_gpu=False, lru_protects_batch=True)
    _, tr = run(cfg, make_req((0.0, 0, 1, 1), (0.0, 1, 1, 1), (1.0, 2, 1, 1), (2.0, 3, 1, 1)))
    assert [s.gpu_loaded for s in tr.steps] == [(0, 1), (2,), (3,)]
    assert tr.steps[2].gpu_evicted == (0,)  # adapters 0 and 1 share stamp 0


def test_cpu_lru_ties_evict_lowest_index():
    # cold, A = N_cpu = 2: adapters 0 and 1 are loaded in the same step (same stamp 0)
    cfg = make_cfg(n_adapters=3, max_loras=2, max_cpu_loras=2, warm_gpu=False, warm_cpu=False,
                   lru_protects_batch=True)
    res, tr = run(cfg, make_req((0.0, 0, 1, 1), (0.0, 1, 1, 1), (1.0, 2, 1, 1), (2.0, 0, 1, 1)))
    assert tr.steps[1].cpu_evicted == (0,) and tr.steps[1].gpu_evicted == ()  # 0 also leaves the GPU
    assert tr.steps[2].disk_loaded == (0,) and tr.steps[2].cpu_evicted == (1,)
    assert (res.n_gpu_loads, res.n_disk_loads) == (4, 4)


def test_cpu_lru_eviction_also_leaves_the_gpu():
    # N = 3, A = N_cpu = 2, warm: GPU = CPU = {1, 2}
    cfg = make_cfg(n_adapters=3, max_loras=2, max_cpu_loras=2, load_ms=[5.0, 6.0, 7.0],
                   disk_ms=[100.0, 200.0, 300.0])
    res, tr = run(cfg, make_req((0.0, 0, 1, 1), (1.0, 1, 1, 1)))
    s0, s1 = tr.steps
    assert s0.cpu_evicted == (1,) and s0.gpu_evicted == () and s0.disk_loaded == (0,) and s0.gpu_loaded == (0,)
    assert s0.load_ms == 105.0
    assert res.t_first_s[0] == (105.0 + C0_MS) / 1000
    assert s1.cpu_evicted == (2,) and s1.gpu_evicted == () and s1.load_ms == 206.0
    assert (res.n_gpu_loads, res.n_disk_loads) == (2, 2)
    assert tr.gpu_resident == [0, 1] and tr.cpu_resident == [0, 1]


# --------------------------------------------------------------------------------------------- window, idle, client


def test_simulation_runs_to_the_window_end():
    res, tr = run(make_cfg(duration_s=1.0), make_req((0.0, 0, 1, 1_000_000)))
    assert res.n_steps == 64 and tr.final_t_s == 1.0
    assert res.t_first_s[0] == DT and np.isnan(res.t_finish_s[0])  # unfinished: excluded
    assert len(res.timeline["t_s"]) == 1 and res.timeline["t_s"][0] == 0.0  # dt = 2 s: only tau_0


def test_window_end_last_step_and_late_arrivals():
    # the step starting at 1.0 < T = 1 + DT/2 is completed (ends at 65 DT); arrivals during it are never sent
    cfg = make_cfg(duration_s=1.0 + DT / 2)
    req = make_req((0.0, 0, 1, 65), (1.0 + DT / 4, 0, 1, 1), (1.0 + DT / 2, 0, 1, 1))
    res, tr = run(cfg, req)
    assert res.n_steps == 65
    assert res.t_finish_s[0] == 65 * DT > cfg.duration_s  # recorded; not "completed" (> T)
    assert np.isnan(res.t_sent_s[1:]).all() and np.isnan(res.t_first_s[1:]).all()
    assert tr.ptr == 1


def test_idle_periods_charge_no_time():
    res, tr = run(make_cfg(duration_s=10.0), make_req((0.0, 0, 1, 2), (5.0, 0, 1, 2)))
    assert res.n_steps == 4 and res.busy_s == 4 * DT
    assert res.t_first_s.tolist() == [DT, 5.0 + DT]
    assert res.t_finish_s.tolist() == [2 * DT, 5.0 + 2 * DT]
    assert tr.n_idle == 2 and tr.final_t_s == 10.0


def test_client_cap_holds_arrivals_and_sends_them_at_injection():
    # cap = 1. At t = 0, r0 is injected and r1 held (W = 1). r1 is injected at the next step start and then
    # waits (A = 1, adapter 1 not allowed while r0 runs); r2 (arriving during step 0) is held until r1 leaves
    # the queue. r3 arrives when the queue is empty: sent at its arrival time.
    cfg = make_cfg(n_adapters=2, max_loras=1, client_cap=1, duration_s=1.0)
    req = make_req((0.0, 0, 1, 10), (0.0, 1, 1, 1), (DT / 2, 0, 1, 1), (20 * DT, 0, 1, 1))
    res, tr = run(cfg, req)
    assert res.t_sent_s.tolist() == [0.0, DT, 11 * DT, 20 * DT]
    assert res.t_first_s.tolist() == [DT, 11 * DT, 12 * DT, 21 * DT]
    assert tr.steps[1].injected == (1,) and tr.steps[11].injected == (2,)
    assert max(s.n_waiting for s in tr.steps) == 1


def test_client_cap_held_arrivals_not_sent_by_the_end():
    cfg = make_cfg(n_adapters=2, max_loras=1, client_cap=1, duration_s=0.5)
    req = make_req((0.0, 0, 1, 1000), (0.0, 1, 1, 1), (0.1, 0, 1, 1))
    res, tr = run(cfg, req)
    assert res.t_sent_s[0] == 0.0 and res.t_sent_s[1] == DT and np.isnan(res.t_sent_s[2])
    assert tr.ptr == 2 and tr.held_end == 3


# --------------------------------------------------------------------------------------------- timeline


def test_timeline_samples_state_after_the_last_step_ended():
    # P = 1, O = 10: steps end at k * DT; samples every 2 DT are taken at loop tops (before injection)
    cfg = make_cfg(kv_blocks=4, timeline_dt_s=2 * DT, duration_s=16 * DT)
    res, _ = run(cfg, make_req((0.0, 0, 1, 10)))
    tl = res.timeline
    assert set(tl) == set(TIMELINE_COLUMNS)
    assert tl["t_s"].tolist() == [2 * k * DT for k in range(8)]
    assert tl["num_requests_running"].tolist() == [0, 1, 1, 1, 1, 0, 0, 0]
    assert tl["num_requests_waiting"].tolist() == [0] * 8
    assert tl["kv_cache_usage_perc"].tolist() == [0.0, 0.25, 0.25, 0.25, 0.25, 0.0, 0.0, 0.0]
    assert tl["num_adapters_running"].tolist() == [0, 1, 1, 1, 1, 0, 0, 0]
    assert tl["num_adapters_resident"].tolist() == [1] * 8
    assert tl["num_preemptions_total"].tolist() == [0] * 8


def test_simulate_reference_matches_run_reference():
    cfg = make_cfg(n_adapters=2, max_loras=1, kv_blocks=5)
    req = make_req((0.0, 0, 30, 20), (0.0, 1, 20, 20), (0.01, 0, 40, 5))
    a = simulate_reference(cfg, req)
    b, _ = run_reference(cfg, req)
    for f in ("t_sent_s", "t_first_s", "t_finish_s", "n_preempted"):
        np.testing.assert_array_equal(getattr(a, f), getattr(b, f))
    assert a.n_steps == b.n_steps and a.busy_s == b.busy_s


def test_rejects_invalid_input():
    with pytest.raises(ValueError):
        simulate_reference(make_cfg(), make_req((1.0, 0, 1, 1), (0.5, 0, 1, 1)))
    with pytest.raises(ValueError):
        simulate_reference(make_cfg(), make_req((0.0, 1, 1, 1)))
    with pytest.raises(ValueError):
        simulate_reference(make_cfg(timeline_dt_s=0.0), make_req((0.0, 0, 1, 1)))


def test_lru_eviction_cascade_of_vllms_adapter_walk() -> None:
    """vLLM walks a batch's adapters in set order and evicts the LRU slot even when it holds an adapter of this
    batch not walked yet; the batch-protecting policy protects the batch (one load instead of two)."""
    from engine_cases import CASCADE_ROWS

    t, a, p, o = zip(*CASCADE_ROWS, strict=True)
    req = RequestArrays(np.array(t), np.array(a), np.array(p), np.array(o))
    loads = {}
    for protect in (False, True):
        cfg = make_cfg(load_ms=np.array([1.0, 2, 4]), disk_ms=np.zeros(3), max_loras=2, max_cpu_loras=3,
                       adapter_order=np.array([0, 2, 1]), lru_protects_batch=protect,
                       step_coef=StepModel(c0_ms=15.625, c1_ms_per_req=0.0, lora_form="none").to_array())
        res, tr = run(cfg, req)
        loads[protect] = [(st.gpu_loaded, st.gpu_evicted) for st in tr.steps if st.gpu_loaded]
    assert loads[False] == [((0, 2), (2, 1))]  # 0 evicts 2 (older), 2 comes back and evicts 1
    assert loads[True] == [((0,), (1,))]
