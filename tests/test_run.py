"""The high-level twin API (twin/run.py): server flags and their defaults, step-model packing, determinism."""

from __future__ import annotations

import json

import numpy as np
import pytest

from lorapack.errors import LorapackError, LorapackWarning, SpecError
from lorapack.profile import find_profile
from lorapack.server import ServerConfig
from lorapack.spec import Adapter, LengthsSpec, Workload
from lorapack.twin.run import (
    DEFAULT_DURATION_S,
    engine_config,
    resolve_server,
    simulate,
    simulate_requests,
    step_model,
)
from lorapack.twin.steptime import RANK_SCALE, SWA
from lorapack.twin.types import RequestArrays

LLAMA, QWEN = "llama-3.1-8b-instruct", "qwen-2.5-7b-instruct"


@pytest.fixture(scope="module")
def llama():
    return find_profile(LLAMA)


def _workload(n: int = 12, ranks=(8, 16), rate: float = 0.5, duration_s: float | None = None) -> Workload:
    return Workload(adapters=[Adapter(adapter_id=f"a{i}", rank=ranks[i % len(ranks)], rate_rps=rate)
                              for i in range(n)],
                    lengths=LengthsSpec(kind="fixed"), duration_s=duration_s)


# ---- resolve_server ---------------------------------------------------------------------------------


def test_resolve_defaults(llama) -> None:
    ranks = np.array([8, 16, 8])
    srv = resolve_server(llama, ranks, ServerConfig(max_loras=2))
    assert srv.max_lora_rank == 16  # S = largest served rank
    assert srv.max_cpu_loras == 3  # N_cpu = max(N, A)
    assert (srv.max_num_batched_tokens, srv.max_num_seqs) == (2048, 2048)
    assert srv.max_model_len == 131_072
    assert srv.starts and srv.error_type is None
    assert (srv.starts, srv.kv_cache_tokens, srv.error_type) == llama.startup(2, 16)
    # more slots than adapters: N_cpu follows A (vLLM requires max_cpu_loras >= max_loras)
    assert resolve_server(llama, ranks, ServerConfig(max_loras=5)).max_cpu_loras == 5


def test_resolve_explicit_flags(llama) -> None:
    srv = resolve_server(llama, np.array([8, 16]), ServerConfig(
        max_loras=2, max_lora_rank=32, max_cpu_loras=7, max_num_batched_tokens=512, max_num_seqs=64,
        max_model_len=4096))
    assert (srv.max_lora_rank, srv.max_cpu_loras, srv.max_num_batched_tokens, srv.max_num_seqs,
            srv.max_model_len) == (32, 7, 512, 64, 4096)
    assert srv.kv_cache_tokens == llama.startup(2, 32, 4096)[1]


def test_resolve_oom(llama) -> None:
    srv = resolve_server(llama, np.full(300, 16), ServerConfig(max_loras=256))
    assert not srv.starts and srv.error_type == "kv_cache_insufficient"
    assert srv.kv_cache_tokens < llama.max_model_len


@pytest.mark.parametrize("ranks, flags, match", [
    ([], ServerConfig(max_loras=1), "no adapters"),
    ([8], ServerConfig(max_loras=0), "--max-loras 0"),
    ([8], ServerConfig(max_loras=-3), "--max-loras -3"),
    ([8, 32], ServerConfig(max_loras=1, max_lora_rank=16), "--max-lora-rank 16 is below .* 32"),
    ([8] * 10, ServerConfig(max_loras=4, max_cpu_loras=3), "--max-cpu-loras 3 is below --max-loras 4"),
    ([8], ServerConfig(max_loras=1, max_model_len=0), "--max-model-len 0"),
    ([8], ServerConfig(max_loras=1, max_model_len=-5), "--max-model-len -5"),
    ([8], ServerConfig(max_loras=1, max_model_len=10**6), "--max-model-len 1000000"),
    ([8], ServerConfig(max_loras=1, max_num_seqs=0), "--max-num-seqs 0"),
    ([8], ServerConfig(max_loras=1, max_num_batched_tokens=-1), "--max-num-batched-tokens -1"),
    ([8], ServerConfig(max_loras=1, client_cap=-1), "--client-cap -1"),
])
def test_resolve_errors(llama, ranks, flags, match) -> None:
    with pytest.raises(SpecError, match=match):
        resolve_server(llama, np.array(ranks, dtype=int), flags)


# ---- step model and engine config ------------------------------------------------------------------


def test_step_model_packing(llama) -> None:
    st, sc = llama.steptime, llama.scheduler
    prof = llama.model_copy(update={"steptime": st.model_copy(update={"gamma": 0.5, "gamma_token": None,
                                                                      "gamma_adapter": None})})
    srv = resolve_server(prof, np.array([8] * 30 + [32] * 10), ServerConfig(max_loras=8))
    # separate exponents for the per-token and the per-adapter terms (an older profile's gamma fills a gap)
    split = llama.model_copy(update={"steptime": st.model_copy(update={"gamma": 0.5, "gamma_token": 0.0,
                                                                       "gamma_adapter": 1.0})})
    sm_split = step_model(split, srv)
    assert sm_split.rank_scale_token == 1.0 and sm_split.rank_scale == pytest.approx(4.0)
    assert (srv.max_lora_rank, srv.max_cpu_loras) == (32, 40)
    sm = step_model(prof, srv)
    assert sm.rank_scale == pytest.approx((32 / 8) ** 0.5) == pytest.approx(2.0)
    assert sm.sched_ms_per_waiting_slot_ratio == pytest.approx(sc.ms_per_waiting_slot_ratio * 8 / 40)
    assert (sm.c0_ms, sm.c1_ms_per_req, sm.p1_ms_per_prefill_token) == (
        st.c0_ms, st.c1_ms_per_req, st.p1_ms_per_prefill_token)
    assert (sm.sched_ms_per_running, sm.sched_const_ms, sm.sched_ms_per_waiting, sm.sched_baseline_ms) == (
        sc.ms_per_running, sc.const_ms, sc.ms_per_waiting, sc.baseline_ms)
    coef = sm.to_array()
    assert coef[RANK_SCALE] == pytest.approx(2.0)
    assert coef[SWA] == pytest.approx(sc.ms_per_waiting_slot_ratio * 0.2)
    # gamma = 0: no rank scaling whatever S is (the shipped profiles' refined gamma is fitted, see issue 3)
    flat = llama.model_copy(update={"steptime": st.model_copy(update={"gamma": 0.0, "gamma_token": None,
                                                                      "gamma_adapter": None})})
    with pytest.warns(LorapackWarning, match="outside the ranks"):  # 64: not a calibrated rank
        srv = resolve_server(flat, np.array([8, 64]), ServerConfig(max_loras=2))
    assert step_model(flat, srv).rank_scale == 1.0 and step_model(flat, srv).rank_scale_token == 1.0


def test_step_model_slot_grid_cost(llama) -> None:
    # e4: a per-token LoRA cost proportional to the number of GPU slots A (per 1000 slots)
    st = llama.steptime.model_copy(update={"e1_ms_per_token": 0.01, "e1p_ms_per_prefill_token": 0.002,
                                           "e4_ms_per_ktok_slot": 0.5})
    prof = llama.model_copy(update={"steptime": st})
    sm = step_model(prof, resolve_server(prof, np.full(300, 8), ServerConfig(max_loras=200)))
    assert sm.e1_ms_per_token == pytest.approx(0.01 + 0.5 * 200 / 1000)
    assert sm.e1p_ms_per_prefill_token == pytest.approx(0.002 + 0.5 * 200 / 1000)
    st = st.model_copy(update={"e1p_ms_per_prefill_token": None, "e4_ms_per_ktok_slot": 0.0})
    sm = step_model(prof.model_copy(update={"steptime": st}),
                    resolve_server(prof, np.full(300, 8), ServerConfig(max_loras=200)))
    assert sm.e1_ms_per_token == sm.e1p_ms_per_prefill_token == pytest.approx(0.01)


def test_step_model_shrink_grid_counts_every_slot_and_rank_block(llama) -> None:
    # e5 x (A + 1) x ceil(S / 16): the grid has a layer per slot (and the no-LoRA one), 16 rank columns a block
    prof = llama.model_copy(update={"steptime": llama.steptime.model_copy(update={"e5_ms_per_kblock_slot": 0.3})})
    for a, s, want in ((8, 8, 0.3 * 9), (128, 16, 0.3 * 129), (128, 32, 0.3 * 129 * 2)):
        sm = step_model(prof, resolve_server(prof, np.full(200, 8), ServerConfig(max_loras=a, max_lora_rank=s)))
        assert sm.shrink_grid_ms_per_kblock == pytest.approx(want), (a, s)
    assert step_model(llama, resolve_server(llama, np.full(200, 8), ServerConfig(max_loras=8))
                      ).shrink_grid_ms_per_kblock == 0.0


def test_step_model_slot_ratio_follows_cpu_cache(llama) -> None:
    ranks = np.full(100, 16)
    a = step_model(llama, resolve_server(llama, ranks, ServerConfig(max_loras=10)))
    b = step_model(llama, resolve_server(llama, ranks, ServerConfig(max_loras=10, max_cpu_loras=20)))
    assert a.sched_ms_per_waiting_slot_ratio * 100 == pytest.approx(b.sched_ms_per_waiting_slot_ratio * 20)


def test_engine_config(llama) -> None:
    ranks = np.array([8, 16, 8])
    srv = resolve_server(llama, ranks, ServerConfig(max_loras=2))
    cfg = engine_config(llama, ranks, srv, 120.0, client_cap=7, warm_start=False)
    assert cfg.kv_blocks == srv.kv_cache_tokens // llama.block_size
    assert cfg.load_ms.tolist() == [llama.activation_ms(16, r) for r in (8, 16, 8)]
    assert cfg.disk_ms.tolist() == [llama.disk_ms(r) for r in (8, 16, 8)]
    assert (cfg.max_loras, cfg.max_cpu_loras, cfg.duration_s, cfg.client_cap, cfg.warm_gpu) == (
        2, 3, 120.0, 7, False)


# ---- simulate ---------------------------------------------------------------------------------------


def test_simulate_is_deterministic_given_the_seed(llama) -> None:
    wl = _workload()
    flags = ServerConfig(max_loras=4)
    a, ra = simulate(llama, wl, flags, 120.0, seed=3)
    b, rb = simulate(llama, wl, flags, 120.0, seed=3)
    c, _ = simulate(llama, wl, flags, 120.0, seed=4)
    a, b, c = (x.replace(wall_s=None) for x in (a, b, c))
    assert json.dumps(a.to_dict(), sort_keys=True, default=str) == json.dumps(b.to_dict(), sort_keys=True,
                                                                             default=str)  # NaN == NaN
    for f in ("t_sent_s", "t_first_s", "t_finish_s", "n_preempted"):
        np.testing.assert_array_equal(getattr(ra, f), getattr(rb, f))
    for k in ra.timeline:
        np.testing.assert_array_equal(ra.timeline[k], rb.timeline[k])
    assert (c.seed, a.seed) == (4, 3)
    assert c.n_arrived != a.n_arrived or c.ttft_mean_ms != a.ttft_mean_ms


def test_simulate_output(llama) -> None:
    out, res = simulate(llama, _workload(), ServerConfig(max_loras=4), 60.0, seed=0)
    assert out.oom is False and res is not None
    assert (out.duration_s, out.model, out.gpu) == (60.0, LLAMA, "h100-64gb")
    assert out.server.to_dict() == {"max_loras": 4, "max_lora_rank": 16, "max_cpu_loras": 12,
                                    "max_num_batched_tokens": 2048, "max_num_seqs": 2048, "max_model_len": 131_072,
                                    "gpu_memory_utilization": 0.9, "enable_prefix_caching": False,
                                    "vllm_version": "0.8.5", "vllm_rules": "0.8.5", "metrics_scrape_s": None}
    assert out.wall_s > 0 and out.n_arrived > 0
    assert len(res.timeline["t_s"]) == 30  # one sample every 2 s of [0, 60)


def test_simulate_duration_defaults(llama) -> None:
    assert simulate(llama, _workload(n=2, rate=0.1, duration_s=30.0), ServerConfig(max_loras=2))[0].duration_s == 30.0
    # explicit duration wins over the workload's
    assert simulate(llama, _workload(n=2, rate=0.1, duration_s=30.0), ServerConfig(max_loras=2),
                    10.0)[0].duration_s == 10.0
    assert DEFAULT_DURATION_S == 3600.0


@pytest.mark.parametrize("dur", [0.0, -5.0, float("nan"), float("inf")])
def test_simulate_rejects_bad_duration(llama, dur: float) -> None:
    # 0 is an error, not "use the default 3600 s"
    with pytest.raises(SpecError, match="--duration-s"):
        simulate(llama, _workload(), ServerConfig(max_loras=2), dur)


def test_simulate_oom_returns_no_result(llama) -> None:
    out, res = simulate(llama, _workload(n=300, ranks=(16,), rate=0.01), ServerConfig(max_loras=256), 30.0)
    assert res is None
    assert out.oom is True and out.error_type == "kv_cache_insufficient"
    assert out.n_completed == 0 and out.throughput_tok_s == 0.0 and out.starved is None
    assert out.kv_cache_tokens < llama.max_model_len


def test_simulate_requests_hand_built(llama) -> None:
    req = RequestArrays(np.array([0.0, 0.5, 1.0]), np.array([0, 1, 0]), np.array([100, 200, 50]),
                        np.array([10, 20, 5]))
    out, res = simulate_requests(llama, np.array([8, 16]), req, ServerConfig(max_loras=2), 30.0)
    assert out.n_arrived == out.n_completed == 3
    assert out.throughput_tok_s == pytest.approx((350 + 35) / 30.0)
    assert out.starved is False
    with pytest.raises(LorapackError):
        simulate_requests(llama, np.array([8, 16]), req, ServerConfig(max_loras=2), 0.0)


def test_qwen_runs_too() -> None:
    out, _ = simulate(find_profile(QWEN), _workload(), ServerConfig(max_loras=4), 30.0)
    assert out.oom is False and out.server.max_model_len == 32_768
