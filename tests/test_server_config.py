"""``lorapack.server``: one ServerConfig, version parsing, rule-set selection and each version rule's effect
on a tiny deterministic workload in the twin; the CLI's --vllm-version; the fingerprint's neutral fields."""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import lorapack
from data_helpers import run_main
from lorapack.errors import LorapackWarning, SpecError
from lorapack.fingerprint import twin_fingerprint
from lorapack.profile import find_profile
from lorapack.server import (
    RULE_SETS,
    VLLM_0_8_5,
    VLLM_0_32,
    VLLM_0_33,
    ServerConfig,
    VersionError,
    parse_vllm_version,
    rules_for_version,
)
from lorapack.twin.run import engine_config, resolve_server, simulate_requests, step_model
from lorapack.twin.types import RequestArrays

LLAMA = "llama-3.1-8b-instruct"
DEMO = Path(lorapack.__file__).parent / "examples" / "demo.yaml"


@pytest.fixture(scope="module")
def prof():
    return find_profile(LLAMA)


# ---- one type ----------------------------------------------------------------------------------------------
def test_older_names_are_the_one_type() -> None:
    import lorapack.twin.metrics as metrics
    import lorapack.twin.run as run

    # the older names that restated the flags are gone: ServerConfig is the one type
    assert not hasattr(run, "ServerFlags") and not hasattr(metrics, "ServerSettings")
    cfg = ServerConfig(max_loras=2, max_cpu_loras=6, max_lora_rank=8, max_num_seqs=32, max_num_batched_tokens=512,
                       max_model_len=512)  # the testbed's call shape
    assert isinstance(cfg, ServerConfig) and cfg.rules is None and cfg.vllm_version is None


@pytest.mark.parametrize("kw, match", [({"max_loras": 1.5}, "--max-loras"), ({"max_loras": 1, "max_num_seqs": "8"},
                                       "--max-num-seqs"), ({"max_loras": 1, "gpu_memory_utilization": 1.2},
                                       "--gpu-memory-utilization"), ({"max_loras": 1, "vllm_version": "main"},
                                       "--vllm-version")])
def test_server_config_checks_types(kw, match) -> None:
    with pytest.raises(SpecError, match=match):
        ServerConfig(**kw)


# ---- versions ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, rules", [("0.8.5", VLLM_0_8_5), ("0.9.2", VLLM_0_8_5), ("0.31.9", VLLM_0_8_5),
                                         ("0.32", VLLM_0_32), ("0.32.0", VLLM_0_32), ("v0.32.1", VLLM_0_32),
                                         ("0.32.0rc1", VLLM_0_32), ("0.33.0", VLLM_0_33), ("0.33.1+cpu", VLLM_0_33),
                                         ("1.0", VLLM_0_33)])
def test_newest_rule_set_at_or_below(text, rules) -> None:
    assert rules_for_version(text).name == rules.name


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(st.tuples(st.integers(0, 2), st.integers(0, 40), st.integers(0, 12)))
def test_selection_property(v) -> None:
    text = ".".join(map(str, v))
    if v < RULE_SETS[0].since:
        with pytest.raises(VersionError, match="--vllm-version"):
            rules_for_version(text)
        return
    got = rules_for_version(text)
    assert parse_vllm_version(text) == v
    assert got.since <= v and not any(got.since < r.since <= v for r in RULE_SETS)


@pytest.mark.parametrize("text", ["0.1.dev6216+g1234abc", "main", "", "0.8.5.dev1", "0.x"])
def test_unparseable_version_is_one_line_error(text) -> None:
    with pytest.raises(VersionError, match="--vllm-version") as e:
        rules_for_version(text)
    assert "\n" not in str(e.value)


def test_gpu_memory_utilization_default_follows_version() -> None:
    assert rules_for_version("0.8.5").default_gpu_memory_utilization == 0.9
    assert rules_for_version("0.21.9").default_gpu_memory_utilization == 0.9
    assert rules_for_version("0.22.0").default_gpu_memory_utilization == 0.92
    assert rules_for_version("0.32.0").default_gpu_memory_utilization == 0.92
    assert all(r.default_prefix_caching for r in RULE_SETS)  # V1 turns it on
    assert all(r.active_adapter_step_ms == 0.0 for r in RULE_SETS)  # the neutral seam


def test_resolve_server_takes_profile_version_or_override(prof) -> None:
    srv = resolve_server(prof, np.array([8, 16]), ServerConfig(max_loras=2))
    assert srv.vllm_version == "0.8.5" and srv.rules.name == "0.8.5"
    assert srv.gpu_memory_utilization == 0.9 and srv.enable_prefix_caching is False  # as measured
    srv = resolve_server(prof, np.array([8, 16]), ServerConfig(max_loras=2, vllm_version="0.33.0"))
    assert srv.rules.name == "0.33" and srv.rules.admission == "running"
    bad = prof.model_copy(update={"vllm_version": "0.1.dev6216+gabc"})
    with pytest.raises(VersionError, match="--vllm-version"):
        resolve_server(bad, np.array([8]), ServerConfig(max_loras=1))


# ---- rules in the twin -------------------------------------------------------------------------------------
def _one(prompt: int, output: int) -> RequestArrays:
    return RequestArrays(np.array([0.0]), np.array([0]), np.array([prompt]), np.array([output]))


def _run(prof, req, version: str, mml: int = 256):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        m, res = simulate_requests(prof, np.array([8]), req, ServerConfig(max_loras=1, max_model_len=mml,
                                                                          vllm_version=version), 30.0)
    return m, res, [str(x.message) for x in w if issubclass(x.category, LorapackWarning)]


def test_over_long_0_8_5_refuses_the_sum(prof) -> None:
    m, res, warned = _run(prof, _one(200, 100), "0.8.5")
    assert m.n_rejected == 1 and m.n_completed == 0 and np.isnan(res.t_sent_s[0])
    assert any("vLLM rejects them" in w for w in warned)


def test_over_long_0_32_cuts_the_output(prof) -> None:
    """Measured on vLLM 0.32: prompt 200 + max_tokens 100 with --max-model-len 256 -> 200 OK, 56 tokens."""
    m, res, warned = _run(prof, _one(200, 100), "0.32")
    assert m.n_rejected == 0 and m.n_completed == 1
    assert m.output_tok_s * 30.0 == pytest.approx(56)
    assert any("output cut" in w for w in warned)
    short, _, _ = _run(prof, _one(200, 56), "0.32")  # the same run as asking for 56 tokens
    assert (short.throughput_tok_s, short.ttft_mean_ms) == (m.throughput_tok_s, m.ttft_mean_ms)


@pytest.mark.parametrize("prompt, output", [(256, 10), (300, 1), (10, 300)])
def test_over_long_0_32_refusals(prof, prompt, output) -> None:
    """prompt >= max_model_len ("max_tokens must be at least 1, got 0") or max_tokens > max_model_len: 400."""
    m, _res, _ = _run(prof, _one(prompt, output), "0.32")
    assert m.n_rejected == 1 and m.n_completed == 0


def test_max_lora_rank_choices(prof) -> None:
    ranks = np.array([1, 1])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LorapackWarning)  # rank 1 is outside the calibrated ranks
        with pytest.raises(SpecError, match="--max-lora-rank 1: vLLM accepts only 8, 16"):
            resolve_server(prof, ranks, ServerConfig(max_loras=1, max_lora_rank=1))
        assert resolve_server(prof, ranks, ServerConfig(max_loras=1)).max_lora_rank == 8
        for v in ("0.32", "0.33.0"):
            assert resolve_server(prof, ranks, ServerConfig(max_loras=1, max_lora_rank=1, vllm_version=v)).max_lora_rank == 1
            assert resolve_server(prof, ranks, ServerConfig(max_loras=1, vllm_version=v)).max_lora_rank == 1


def test_kv_start_rule_0_32(prof) -> None:
    """vLLM 0.32 starts iff one max_model_len sequence fits in the KV cache minus one block."""
    a, s = 3, 16  # not a measured point: the memory model's KV cache
    kv = prof.kv_tokens(a, s)
    bs = prof.block_size
    assert prof.startup(a, s, kv - bs, kv_start="one_sequence_minus_null_block") == (True, kv, None)
    assert prof.startup(a, s, kv - bs + 1, kv_start="one_sequence_minus_null_block")[:1] == (False,)
    assert prof.startup(a, s, kv - bs)[0] is False  # 0.8.5's rule (with its margin) refuses it
    # the testbed's numbers: 16,384 blocks of 128 tokens start with 2,097,024 and refuse 2,097,025
    tb = prof.model_copy(update={"block_size": 128, "memory": prof.memory.model_copy(update={
        "kv_tokens_base": 16384 * 128.0, "kv_tokens_per_slot_rank": 0.0, "kv_tokens_per_slot": 0.0,
        "measured": []})})
    assert tb.startup(2, 8, 2_097_024, kv_start="one_sequence_minus_null_block")[0] is True
    assert tb.startup(2, 8, 2_097_025, kv_start="one_sequence_minus_null_block")[0] is False


def test_kv_start_rule_reaches_resolve_server(prof) -> None:
    for v, rule in (("0.8.5", "profile"), ("0.32", "one_sequence_minus_null_block")):
        srv = resolve_server(prof, np.full(300, 16), ServerConfig(max_loras=256, vllm_version=v))
        assert (srv.starts, srv.kv_cache_tokens, srv.error_type) == prof.startup(256, 16, kv_start=rule)


def test_admission_rule_reaches_the_engine_and_agrees(prof) -> None:
    """0.33 counts the adapters of all running requests; in the twin the waiting pass runs only when every
    running request was scheduled, so on this 4-adapter, 2-slot workload both rules give the same run."""
    ranks = np.array([8, 8, 8, 8])
    rng = np.random.default_rng(7)
    t = np.sort(rng.uniform(0, 20, 80))
    req = RequestArrays(t, rng.integers(0, 4, 80), rng.integers(50, 400, 80), rng.integers(20, 200, 80))
    out = {}
    for v in ("0.32", "0.33"):
        srv = resolve_server(prof, ranks, ServerConfig(max_loras=2, vllm_version=v))
        assert engine_config(prof, ranks, srv, 60.0).admission == ("running" if v == "0.33" else "scheduled")
        m, res = simulate_requests(prof, ranks, req, ServerConfig(max_loras=2, vllm_version=v), 60.0)
        out[v] = (m.throughput_tok_s, m.ttft_mean_ms, m.n_adapter_loads, res.t_first_s.tolist())
    assert out["0.32"] == out["0.33"]


def test_active_adapter_seam(prof) -> None:
    srv = resolve_server(prof, np.full(16, 8), ServerConfig(max_loras=4))
    base = step_model(prof, srv)
    assert step_model(prof, srv.config.replace(rules=VLLM_0_33)) == base  # neutral for every version
    costly = dataclasses.replace(VLLM_0_33, active_adapter_step_ms=0.5)
    assert step_model(prof, srv.config.replace(rules=costly)).e2_ms_per_adapter == base.e2_ms_per_adapter + 0.5


# ---- the fingerprint ---------------------------------------------------------------------------------------
def test_new_profile_fields_are_neutral(prof) -> None:
    """The measured-settings fields at the shipped values leave the fingerprint as it was (the shipped model
    files' fingerprints are checked against twin_fingerprint in test_surrogate)."""
    fp = twin_fingerprint(prof)
    assert "measured_gpu_memory_utilization" in prof.model_dump()
    same = prof.model_copy(update={"measured_gpu_memory_utilization": 0.9, "measured_prefix_caching": False})
    assert twin_fingerprint(same) == fp
    assert twin_fingerprint(prof.model_copy(update={"measured_prefix_caching": True})) != fp


# ---- the CLI -----------------------------------------------------------------------------------------------
def test_cli_vllm_version_warns_in_one_line(monkeypatch, capsys) -> None:
    code, _out, err = run_main(monkeypatch, capsys, "simulate", str(DEMO), "-m", LLAMA, "-a", "8", "--duration-s", "30",
                               "--vllm-version", "0.33.0", "--json")
    assert code == 0, err
    lines = [ln for ln in err.splitlines() if "--vllm-version" in ln]
    assert len(lines) == 1 and lines[0].startswith("warning:") and "measured on vLLM 0.8.5" in lines[0]


@pytest.mark.parametrize("command", ["simulate", "place", "evaluate"])
def test_cli_vllm_version_error(monkeypatch, capsys, tmp_path, command) -> None:
    args = {"simulate": [str(DEMO), "-m", LLAMA, "-a", "8"],
            "place": [str(DEMO), "-m", LLAMA, "--out", str(tmp_path / "plan")],
            "evaluate": [str(DEMO.parent / "demo-scenario.yaml"), "--out", str(tmp_path / "ev")]}[command]
    code, _out, err = run_main(monkeypatch, capsys, command, *args, "--vllm-version", "0.1.dev6216+g1234")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "--vllm-version" in err


def test_evaluate_scenarios_carry_the_version() -> None:
    from lorapack.evaluate.runner import load_scenario_profile
    from lorapack.evaluate.scenario import load_scenarios

    sc = load_scenarios(DEMO.parent / "demo-scenario.yaml")[0]
    assert load_scenario_profile(sc).vllm_version == "0.8.5"
    prof = load_scenario_profile(dataclasses.replace(sc, vllm_version="0.33.0"))
    assert prof.vllm_version == "0.33.0" and rules_for_version(prof.vllm_version).admission == "running"


def test_server_flags_of_a_candidate_and_a_plan_gpu_read_the_server_and_are_read_only(prof) -> None:
    from lorapack.oracle import GpuCandidate
    from lorapack.placement.plan import GpuPlan
    from lorapack.server import ServerFlag

    server = ServerConfig(max_loras=3, max_lora_rank=16, max_cpu_loras=4, max_num_seqs=64,
                          max_num_batched_tokens=512, max_model_len=1024)
    cand = GpuCandidate(prof, np.array([8, 16]), np.array([0.1, 0.2]), server)
    gpu = GpuPlan(adapters=["a", "b"], weights=[1.0, 1.0], server=server)
    for name in ("max_loras", "max_lora_rank", "max_cpu_loras", "max_num_seqs", "max_num_batched_tokens"):
        assert getattr(cand, name) == getattr(gpu, name) == getattr(server, name)
    assert gpu.max_model_len == 1024
    with pytest.raises(AttributeError, match="read-only"):
        gpu.max_loras = 5
    with pytest.raises((AttributeError, TypeError)):
        cand.max_loras = 5
    with pytest.raises((TypeError, RuntimeError)) as err:  # Python < 3.12 wraps __set_name__'s error
        type("Bad", (), {"nope": ServerFlag()})
    assert "not a ServerConfig flag" in str(err.value) + str(err.value.__cause__)
