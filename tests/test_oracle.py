"""The feasibility seam (issue 8, Deliver 1): candidates, the one feature function, and the oracles."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lorapack.errors import SpecError
from lorapack.oracle import (
    FEATURE_NAMES,
    GpuCandidate,
    MemoryRuleOracle,
    Oracle,
    TwinOracle,
    default_slot_rank,
    feature_row,
    features,
)
from lorapack.profile import find_profile
from lorapack.server import ServerConfig

LLAMA = find_profile("llama-3.1-8b-instruct")


def cand(n: int = 16, a: int = 8, rate: float = 0.05, ranks=(8, 16), **kw) -> GpuCandidate:
    r = np.array([ranks[i % len(ranks)] for i in range(n)])
    return GpuCandidate(profile=LLAMA, ranks=r, rates_rps=np.full(n, rate), server=ServerConfig(max_loras=a), **kw)


def test_features_match_the_paper_definitions() -> None:
    c = GpuCandidate(profile=LLAMA, ranks=np.array([8, 16, 32, 8]), rates_rps=np.array([0.1, 0.2, 0.3, 0.4]),
                     server=ServerConfig(max_loras=4), mean_input_tokens=200, mean_output_tokens=100)
    f = feature_row(c)
    assert list(f) == list(FEATURE_NAMES)
    assert f["served_adapters"] == 4 and f["adapter_slots"] == 4 and f["max_size"] == 32
    assert f["sum_rate"] == pytest.approx(1.0) and f["std_rate"] == pytest.approx(np.std([0.1, 0.2, 0.3, 0.4]))
    assert f["mean_size"] == 16 and f["std_size"] == pytest.approx(np.std([8, 16, 32, 8]))
    assert f["max_lora_rank"] == 32 and f["max_rate"] == pytest.approx(0.4)
    assert f["incoming_expected_tok_s"] == pytest.approx(300.0)
    m = features([c, cand()])
    assert m.shape == (2, len(FEATURE_NAMES)) and m.dtype == np.float64


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.lists(st.sampled_from([8, 16, 32, 64, 128, 256, 320]), min_size=1, max_size=40),
                          st.floats(1e-6, 50.0), st.integers(1, 64), st.sampled_from([0, 8, 16, 64]),
                          st.floats(1.0, 4000.0), st.floats(1.0, 4000.0), st.integers(0, 2**32 - 1)),
                min_size=1, max_size=12))
def test_numpy_features_are_the_kernels_bit_for_bit(cands) -> None:
    """``features`` computes in numpy until the compiled kernel is readied (a short command never readies
    it): both must give the same bits, or a placement would depend on how long its process has run."""
    from lorapack.oracle import _SLOT_RANKS, _features_kernel, _features_numpy

    rng_rates = [np.random.default_rng(seed).random(len(ranks)) * top for ranks, top, *_, seed in cands]
    sizes = np.array([len(c[0]) for c in cands], np.int64)
    ranks = np.concatenate([np.array(c[0], np.float64) for c in cands])
    rates = np.concatenate(rng_rates) + 1e-9
    scalars = np.array([(a, s, pi, po) for _r, _t, a, s, pi, po, _seed in cands], np.float64)
    want = np.empty((len(cands), len(FEATURE_NAMES)))
    got = np.empty_like(want)
    _features_kernel(sizes, ranks, rates, scalars, _SLOT_RANKS, want)  # compiled (numba) here
    _features_numpy(sizes, ranks, rates, scalars, _SLOT_RANKS, got)
    assert np.array_equal(got, want), np.argwhere(got != want)[:5]


def test_slot_rank_is_the_smallest_value_vllm_accepts() -> None:
    assert [default_slot_rank(r) for r in (1, 8, 9, 16, 17, 33, 300, 512)] == [8, 8, 16, 16, 32, 64, 320, 512]
    with pytest.raises(SpecError):
        default_slot_rank(513)
    assert cand(ranks=(8, 12)).slot_rank == 16


@pytest.mark.parametrize("kw, match", [
    ({"ranks": np.array([8, 8]), "rates_rps": np.array([0.1])}, "one rank and one rate"),
    ({"ranks": np.array([], int), "rates_rps": np.array([])}, "at least one adapter"),
    ({"ranks": np.array([0]), "rates_rps": np.array([0.1])}, "rank 0"),
    ({"ranks": np.array([8.5]), "rates_rps": np.array([0.1])}, "integers"),
    ({"ranks": np.array([8]), "rates_rps": np.array([math.nan])}, "finite"),
    ({"ranks": np.array([8]), "rates_rps": np.array([-1.0])}, "finite"),
    ({"ranks": np.array([8]), "rates_rps": np.array([0.1]), "max_loras": 0}, "--max-loras"),
    ({"ranks": np.array([32]), "rates_rps": np.array([0.1]), "max_lora_rank": 16}, "--max-lora-rank"),
    ({"ranks": np.array([8]), "rates_rps": np.array([0.1]), "mean_input_tokens": 0.5}, "mean_input_tokens"),
])
def test_bad_candidates_are_refused(kw, match) -> None:
    kw = {"max_loras": 1, **kw}
    flags = {k: kw.pop(k) for k in ("max_loras", "max_lora_rank") if k in kw}
    with pytest.raises(SpecError, match=match):
        GpuCandidate(profile=LLAMA, server=ServerConfig(**flags), **kw)


def test_memory_rule_applies_first() -> None:
    big = cand(n=200, a=200, ranks=(32,))  # Llama cannot start 200 slots of rank 32
    ok = cand()
    assert not big.startup()[0] and ok.startup()[0]
    for oracle in (MemoryRuleOracle(), TwinOracle(duration_s=60.0)):
        assert isinstance(oracle, Oracle)
        p_big, p_ok = oracle.predict([big, ok])
        assert not p_big.fits and p_big.error_type and not p_big.serves()
        assert p_ok.fits and p_ok.kv_cache_tokens > 0


def test_twin_oracle_answers_like_the_twin() -> None:
    light, heavy = cand(n=16, a=16, rate=0.05), cand(n=64, a=8, rate=2.0)
    o = TwinOracle(seeds=(0, 1), duration_s=600.0, early_stop=False)
    p_light, p_heavy = o.predict([light, heavy])
    assert o.n_simulations == 4 and p_light.seeds == 2
    assert p_light.starved == 0.0 and p_light.serves()
    assert p_light.throughput_ratio == pytest.approx(1.0, abs=0.1)
    assert 5 < p_light.itl_ms < 100 and 0 < p_light.ttft_s < 5
    assert p_heavy.starved == 1.0 and not p_heavy.serves() and p_heavy.throughput_ratio < 0.9
    # deterministic for the same seeds
    again = TwinOracle(seeds=(0, 1), duration_s=600.0, early_stop=False).predict([light])[0]
    assert again.throughput_tok_s == p_light.throughput_tok_s and again.ttft_s == p_light.ttft_s


def test_twin_oracle_simulates_the_given_arrival_law() -> None:
    from lorapack.spec import ModulatedArrivals, TraceArrivals

    c = cand(n=16, a=16, rate=0.3)
    steady = TwinOracle(duration_s=600.0, early_stop=False)
    # the same mean rate in bursts: double for a minute, nothing the next
    bursty = TwinOracle(duration_s=600.0, early_stop=False, arrivals=ModulatedArrivals(multipliers=[2.0, 0.0]))
    p_steady, p_bursty = steady.predict([c])[0], bursty.predict([c])[0]
    assert p_bursty.incoming_tok_s == pytest.approx(p_steady.incoming_tok_s, rel=0.15)
    assert p_bursty.ttft_s > p_steady.ttft_s
    with pytest.raises(SpecError, match="arrivals of kind 'trace'.*poisson, lognormal, modulated"):
        TwinOracle(arrivals=TraceArrivals(path="x.csv"))


def test_sweep_rows_use_the_oracle_features() -> None:
    from lorapack.sweep import enumerate_configs, preset_grid
    from lorapack.sweep.store import COLUMNS
    from lorapack.sweep.work import candidate
    from lorapack.sweep.work import features as sweep_features

    assert set(FEATURE_NAMES) <= set(COLUMNS)
    cfg = enumerate_configs(preset_grid("paper-llama"))[123]
    row = sweep_features(cfg, LLAMA)
    expect = feature_row(candidate(cfg, LLAMA))
    assert {k: float(row[k]) for k in FEATURE_NAMES} == expect
