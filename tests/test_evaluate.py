"""lorapack evaluate: workload derivation, scenario files, replay of plans, the runner and the JSON contract."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from evaluate_helpers import ToyPlacer, write_trace
from lorapack.errors import SpecError
from lorapack.evaluate.replay import Replayer, split_plan
from lorapack.evaluate.runner import Budget, evaluate_scenarios, smallest_clean_pool
from lorapack.evaluate.scenario import load_scenarios
from lorapack.objective import Objective
from lorapack.placement.plan import GpuPlan, Plan
from lorapack.profile import find_profile
from lorapack.server import ServerConfig
from lorapack.workload.derive import DeriveOptions, derive_workload, parse_weights
from lorapack.workload.trace import load_trace

FAST = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
CONTRACT_KEYS = {"gpus_used", "gpus_used_fixed_pool", "lower_bound_gpus", "starved_gpus", "oom_gpus",
                 "throughput_tok_s", "itl_mean_ms", "ttft_mean_s", "ttft_p99_s", "placement_ms", "gpus_used_best_case"}


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory) -> Path:
    return write_trace(tmp_path_factory.mktemp("trace") / "toy.csv")


@pytest.fixture(scope="module")
def trace(trace_file):
    return load_trace(trace_file)


@pytest.fixture(scope="module")
def profile():
    return find_profile("llama-3.1-8b-instruct")


def _derive(trace, seed=0, **kw):
    opts = dict(n_adapters=40, weights=parse_weights("dirichlet:0.5"), load_scale=1.0, split_s=300.0)
    opts.update(kw)
    return derive_workload(trace, DeriveOptions(**opts), seed)


# ---------------------------------------------------------------------------------------------------------
# derivation


def test_parse_weights():
    assert str(parse_weights("uniform")) == "uniform"
    assert parse_weights("zipf").param == 1.0 and parse_weights("dirichlet").param == 0.5
    assert parse_weights(" zipf : 1.2 ").param == 1.2
    for bad in ("pareto", "uniform:1", "zipf:x", "dirichlet:0", "zipf:-1", "dirichlet:nan"):
        with pytest.raises(ValueError):
            parse_weights(bad)


@FAST
@given(n=st.integers(1, 300), k=st.sampled_from([1.0, 2.0, 3.0, 0.5, 2.5]), seed=st.integers(0, 2**31),
       proto=st.sampled_from(["E1", "E2"]), weights=st.sampled_from(["uniform", "zipf:1.5", "dirichlet:0.1"]))
def test_every_adapter_has_a_request_and_scaling_multiplies_requests(trace, n, k, seed, proto, weights):
    d = _derive(trace, seed, n_adapters=n, load_scale=k, protocol=proto, weights=parse_weights(weights))
    if k == int(k):
        assert d.trace_requests == int(k) * len(trace)
    else:  # integer copies plus a Bernoulli-thinned one: within 6 sigma
        sd = math.sqrt(len(trace) * 0.25)
        assert abs(d.trace_requests - k * len(trace)) < 6 * sd + 1
    if proto == "E1":
        total = d.estimation_counts + np.bincount(d.replay.adapter, minlength=n)
        assert total.min() >= 1 and total.sum() == d.trace_requests
        assert d.estimation_counts.sum() + len(d.replay) == d.trace_requests
    else:  # both hours label every adapter at least once
        assert d.estimation_counts.min() >= 1
        assert np.bincount(d.replay.adapter, minlength=n).min() >= 1
        assert len(d.replay) == d.trace_requests
    assert np.all(d.rates_rps >= 1.0 / d.estimation_window_s - 1e-15)
    assert np.all(np.diff(d.replay.t_arr_s) >= 0)
    assert d.replay.t_arr_s.min() >= 0 and d.replay.t_arr_s.max() < d.replay_window_s


def test_seeds_reproduce_and_differ(trace):
    for proto in ("E1", "E2", "E3"):
        a, b, c = _derive(trace, 3, protocol=proto), _derive(trace, 3, protocol=proto), _derive(trace, 4, protocol=proto)
        for x, y in ((a.replay.t_arr_s, b.replay.t_arr_s), (a.replay.adapter, b.replay.adapter),
                     (a.replay.prompt_tokens, b.replay.prompt_tokens), (a.rates_rps, b.rates_rps), (a.ranks, b.ranks)):
            np.testing.assert_array_equal(x, y)
        assert not np.array_equal(a.rates_rps, c.rates_rps)


def test_ranks_round_robin_and_rates(trace):
    d = _derive(trace, n_adapters=41, rank_set=(8, 16, 32))
    counts = {int(r): int(c) for r, c in zip(*np.unique(d.ranks, return_counts=True), strict=True)}
    assert counts == {8: 14, 16: 14, 32: 13}
    np.testing.assert_allclose(d.rates_rps, np.maximum(d.estimation_counts, 1) / 300.0)
    wl = d.workload()
    assert wl.n_adapters == 41 and list(wl.ranks) == list(d.ranks)
    assert wl.lengths.mean_input_tokens == pytest.approx(d.mean_input_tokens)


def test_e1_split_window_and_e3_poisson_rates(trace):
    d1 = _derive(trace, protocol="E1")
    assert d1.estimation_window_s == 300.0 and d1.replay_window_s == pytest.approx(d1.trace_span_s - 300.0)
    d3 = _derive(trace, n_adapters=5, protocol="E3", weights=parse_weights("uniform"), load_scale=20.0)
    got = np.bincount(d3.replay.adapter, minlength=5) / d3.replay_window_s
    np.testing.assert_allclose(got, d3.rates_rps, rtol=0.05)


def test_trace_lengths_follow_their_requests(trace):
    d = _derive(trace, trace_lengths=True, protocol="E2")
    assert set(d.replay.prompt_tokens.tolist()) <= set(trace.prompt_tokens.tolist())
    assert d.workload().lengths.kind == "fixed"


def test_too_few_requests_is_an_error(trace):
    with pytest.raises(SpecError, match="fewer than the 10,000 adapters"):
        _derive(trace, n_adapters=10_000)


def test_load_profile_is_the_estimation_windows_swings(trace):
    from lorapack.workload.derive import RATE_PROFILE_PERIOD_S, load_profile

    # 10 arrivals in the first minute, 30 in the second, 5 in a half-minute tail: rates 10, 30, 10 per minute
    t = np.concatenate([np.linspace(0, 59, 10), np.linspace(60, 119, 30), np.linspace(120, 149, 5)])
    m = load_profile(t, 150.0, 60.0)
    assert m == pytest.approx(np.array([10, 30, 10]) / (45 / 2.5))
    assert np.dot(m, [60, 60, 30]) / 150 == pytest.approx(1.0)  # mean 1, weighted by period length
    assert load_profile(np.empty(0), 100.0).tolist() == [1.0]
    d = _derive(trace)
    assert len(d.rate_profile) == math.ceil(300.0 / RATE_PROFILE_PERIOD_S)
    assert d.rate_profile.mean() == pytest.approx(1.0)
    assert d.workload().arrivals.kind == "poisson"
    law = d.workload(rate_profile=True).arrivals
    assert law.kind == "modulated" and law.multipliers == pytest.approx(d.rate_profile.tolist())


def test_verify_arrivals_reach_the_placer(tmp_path, trace_file):
    laws = {}

    class Recording(ToyPlacer):
        def place(self, workload, profile, req):
            laws[req.method] = workload.arrivals.kind
            return super().place(workload, profile, req)

    for choice, kind in (("estimation", "modulated"), ("poisson", "poisson")):
        sc = load_scenarios(_scenario_file(tmp_path, trace_file, f"n_adapters: 16\nmax_pack: false\n"
                                                                 f"verify_arrivals: {choice}\n"))
        assert sc[0].verify_arrivals == choice and sc[0].as_dict()["verify_arrivals"] == choice
        laws.clear()
        evaluate_scenarios(sc, Recording(), methods=("toy-pack",))
        assert laws == {"toy-pack": kind}
    with pytest.raises(SpecError, match=r"sc\.yaml:4: verify_arrivals"):
        load_scenarios(_scenario_file(tmp_path, trace_file, "n_adapters: 16\nverify_arrivals: bursty\n"))


def test_shipped_trace_golden(data_dir):
    tr = load_trace(data_dir / "traces" / "azure-llm-2023-conv.csv")
    assert len(tr) == 19_366
    d = derive_workload(tr, DeriveOptions(n_adapters=64, load_scale=5.0), 0)
    assert d.trace_requests == 5 * 19_366
    assert d.estimation_window_s == 1800.0 and d.replay_window_s == pytest.approx(1702.0)
    assert 25 < d.aggregate_rate_rps < 31  # ≈ 5 × 5.5 req/s


# ---------------------------------------------------------------------------------------------------------
# replay


def _plan(d, profile, groups, weights=None, max_loras=8, rank=16):
    gpus = []
    for gi, ids in enumerate(groups):
        w = weights[gi] if weights else [1.0] * len(ids)
        gpus.append(GpuPlan(adapters=ids, weights=w,
                            server=ServerConfig(max_loras=min(max_loras, len(ids)), max_lora_rank=rank,
                                                max_cpu_loras=max(len(ids), max_loras), max_num_seqs=2048,
                                                max_num_batched_tokens=2048)))
    return Plan(method="hand", model=profile.model, gpu_type=profile.gpu, gpus=gpus)


def test_replay_conserves_requests_with_split_adapters(trace, profile):
    d = _derive(trace, n_adapters=12, rank_set=(8, 16))
    ids = d.adapter_ids
    # adapter 0 split 3:1 over GPUs 0 and 1, adapter 1 split 1:1:2 over all three
    groups = [[ids[0], ids[1], *ids[2:6]], [ids[0], ids[1], *ids[6:9]], [ids[1], *ids[9:]]]
    weights = [[0.75, 0.25] + [1.0] * 4, [0.25, 0.25] + [1.0] * 3, [0.5] + [1.0] * 3]
    plan = _plan(d, profile, groups, weights)
    tasks = split_plan(plan, d, np.random.default_rng(0).random(len(d.replay)))
    assert sum(len(t.requests) for t in tasks) == len(d.replay)
    for t in tasks:
        assert np.all(np.diff(t.requests.t_arr_s) >= 0)
        assert t.requests.adapter.max() < len(t.adapter_ids)
    n0 = [int(np.sum(t.requests.adapter == 0)) for t in tasks[:2]]
    total0 = int(np.sum(d.replay.adapter == 0))
    assert sum(n0) == total0
    if total0 >= 40:
        assert n0[0] / total0 == pytest.approx(0.75, abs=0.15)
    rep = Replayer(profile, d).replay(plan)
    assert rep.gpus_used == 3 and sum(g.n_requests for g in rep.gpus) == len(d.replay)
    assert rep.summary()["requests"] == len(d.replay)


def test_replay_flags_oom_and_missing_adapters(trace, profile):
    d = _derive(trace, n_adapters=6, rank_set=(32,))
    ids = d.adapter_ids
    ok = _plan(d, profile, [ids[:3], ids[3:]], rank=32)
    bad = _plan(d, profile, [ids[:3], ids[3:]], rank=32)
    # far beyond the rank-32 slot limit: vLLM refuses to start
    bad.gpus[1].server = bad.gpus[1].server.replace(max_loras=2000, max_cpu_loras=2000)
    r = Replayer(profile, d)
    rep_ok, rep_bad = r.replay(ok), r.replay(bad)
    assert rep_ok.oom_gpus == 0 and rep_bad.oom_gpus == 1 and not rep_bad.clean
    assert rep_bad.gpus[1].n_completed == 0 and rep_bad.gpus[1].throughput_tok_s == 0
    assert r.simulated == 3  # GPU 0 of both plans is the same GPU: replayed once
    with pytest.raises(SpecError, match="routes no GPU"):
        r.replay(_plan(d, profile, [ids[:3]]))


def test_a_starved_adapter_makes_a_replay_unclean():
    from lorapack.evaluate.replay import FleetReplay, GpuReplay

    def gpu(starved_adapters):
        return GpuReplay(n_adapters=4, max_loras=2, max_lora_rank=16, n_requests=100, oom=False, error_type=None,
                         starved=False, throughput_tok_s=1e3, incoming_tok_s=1e3, itl_mean_ms=20.0, itl_p99_ms=40.0,
                         ttft_mean_s=0.1, ttft_p99_s=0.5, ttft_penalised_s=0.1, n_completed=100,
                         starved_adapters=starved_adapters, decode_gaps=1000, decode_span_s=20.0,
                         ttft_samples_s=np.full(100, 0.1, dtype=np.float32))

    assert FleetReplay([gpu([]), gpu([])], 600.0, Objective.throughput()).clean
    # the GPU keeps up overall (not starved) while one of its adapters waits: no request may starve
    rep = FleetReplay([gpu([]), gpu(["a3"])], 600.0, Objective.throughput())
    assert rep.starved_gpus == 0 and rep.starved_adapters == 1 and not rep.clean


def test_latency_objective_and_fleet_metrics(trace, profile):
    d = _derive(trace, n_adapters=8, load_scale=3.0)
    plan = _plan(d, profile, [d.adapter_ids[:4], d.adapter_ids[4:]])
    loose = Replayer(profile, d).replay(plan, Objective(max_ttft_s=1e6))
    tight = Replayer(profile, d).replay(plan, Objective(max_ttft_s=1e-9))
    assert loose.latency_violation_gpus == 0 and tight.latency_violation_gpus == 2 and not tight.clean
    s = loose.summary()
    g0, g1 = loose.gpus
    assert s["throughput_tok_s"] == pytest.approx(g0.throughput_tok_s + g1.throughput_tok_s)
    w = g0.decode_gaps + g1.decode_gaps
    assert s["itl_mean_ms"] == pytest.approx((g0.itl_mean_ms * g0.decode_gaps + g1.itl_mean_ms * g1.decode_gaps) / w)
    n = g0.n_completed + g1.n_completed
    assert s["ttft_mean_s"] == pytest.approx((g0.ttft_mean_s * g0.n_completed + g1.ttft_mean_s * g1.n_completed) / n,
                                             rel=1e-5)


# ---------------------------------------------------------------------------------------------------------
# search and runner


@pytest.mark.parametrize("start,threshold", [(1, 5), (5, 5), (9, 5), (3, 3), (7, 2), (4, 40)])
def test_smallest_clean_pool_finds_the_threshold(start, threshold):
    class P:
        def __init__(self, g):
            self.gpus_used, self.infeasible = g, False

    best, probes = smallest_clean_pool(P, lambda p: p.gpus_used >= threshold, start, 1, 32)
    assert best == (threshold if threshold <= 32 else None)
    assert len(probes) <= 12


def _scenario_file(tmp_path: Path, trace_file: Path, body: str) -> Path:
    p = tmp_path / "sc.yaml"
    p.write_text(f"trace: {trace_file}\nwindows: {{protocol: E1, split_s: 300}}\n" + body)
    return p


def test_runner_both_protocols(tmp_path, trace_file, monkeypatch):
    sc = load_scenarios(_scenario_file(tmp_path, trace_file, "n_adapters: [16, 32]\nload_scale: 4\nfixed_pool: 4\n"
                                                             "objective: [default, throughput]\nmax_pack: false\n"))
    assert [s.name for s in sc] == ["sc-r8-16-n16-x4-default", "sc-r8-16-n16-x4-throughput",
                                    "sc-r8-16-n32-x4-default", "sc-r8-16-n32-x4-throughput"]
    placer = ToyPlacer()
    doc = evaluate_scenarios(sc, placer)
    assert len(doc["scenarios"]) == 4 and not doc["skipped"]
    for entry in doc["scenarios"]:
        assert set(entry["methods"]) == {"toy-pack", "toy-deal", "toy-none"}
        assert entry["methods"]["toy-none"]["infeasible"] is True
        deal = entry["methods"]["toy-deal"]
        assert deal["gpus_used"] is None or deal["replay_clean"]
        for r in entry["methods"].values():
            assert CONTRACT_KEYS <= set(r)
    # the throughput scenario shares the derived workload: toy-deal's plans replay from the cache
    assert doc["scenarios"][1]["replayed_gpus"] >= doc["scenarios"][0]["replayed_gpus"]


def test_budget_skips_and_says_so(tmp_path, trace_file):
    sc = load_scenarios(_scenario_file(tmp_path, trace_file, "n_adapters: [8, 16, 24]\nmax_pack: false\n"))
    doc = evaluate_scenarios(sc, ToyPlacer(), methods=("toy-deal",), budget=Budget(1e-9))
    assert doc["scenarios"] == [] and len(doc["skipped"]) == 3


# ---------------------------------------------------------------------------------------------------------
# scenario files


@pytest.mark.parametrize("body,match", [
    ("n_adapters: 8\nbogus: 1\n", r"sc\.yaml:4: unknown field 'bogus'"),
    ("n_adapters: 0\n", r"sc\.yaml:3: n_adapters.*>= 1"),
    ("n_adapters: 8\nweights: pareto\n", r"sc\.yaml:4: weights.*uniform, zipf:S or dirichlet:ALPHA"),
    ("n_adapters: 8\nload_scale: -1\n", r"sc\.yaml:4: load_scale.*> 0"),
    ("n_adapters: 8\nranks: [8, 1024]\n", r"sc\.yaml:4: ranks.*between 1 and 512"),
    ("n_adapters: 8\nmodel: gpt-9\n", r"sc\.yaml:4: model: no shipped profile for model 'gpt-9'"),
    ("n_adapters: 8\nfixed_pool: 0\n", r"sc\.yaml:4: fixed_pool.*>= 1"),
    ("n_adapters: [8, 8]\n", r"sc\.yaml:3: n_adapters.*distinct"),
    ("n_adapters: 8\nobjective: {max_ttft_s: -2}\n", r"sc\.yaml:4: objective"),
    ("n_adapters: 8\nseed: true\n", r"sc\.yaml:4: seed.*boolean"),
    ("load_scale: 2\n", r"sc\.yaml:1: missing field 'n_adapters'"),
])
def test_scenario_errors_name_file_and_line(tmp_path, trace_file, body, match):
    with pytest.raises(SpecError, match=match):
        load_scenarios(_scenario_file(tmp_path, trace_file, body))


def test_scenario_trace_problems(tmp_path, trace_file, data_dir):
    p = tmp_path / "s.yaml"
    p.write_text("trace: nope.csv\nn_adapters: 8\n")
    with pytest.raises(SpecError, match=r"s\.yaml:1: trace: file not found"):
        load_scenarios(p)
    p.write_text(f"trace: {trace_file}\nn_adapters: 8\nwindows: {{split_s: 5000}}\n")
    with pytest.raises(SpecError, match=r"s\.yaml:3: windows: split_s 5000"):
        load_scenarios(p)
    p.write_text("trace: azure-conv\nn_adapters: 8\nload_scale: 40\n")
    with pytest.raises(SpecError, match=r"s\.yaml:3: load_scale: ×40 is above ×30"):
        load_scenarios(p)
    p.write_text("trace: azure-code\nn_adapters: 8\nranks: [[8, 16], [8, 16, 32]]\nmodel: [llama-3.1-8b-instruct, "
                 "qwen-2.5-7b-instruct]\n")
    names = [s.name for s in load_scenarios(p)]
    assert names == ["s-llama-r8-16-n8-x1", "s-llama-r8-16-32-n8-x1", "s-qwen-r8-16-n8-x1", "s-qwen-r8-16-32-n8-x1"]


# ---------------------------------------------------------------------------------------------------------
# CLI and JSON contract


def test_cli_json_contract_and_outputs(tmp_path, trace_file, monkeypatch, capsys):
    import lorapack.evaluate.placers as methods
    from data_helpers import run_main

    monkeypatch.setattr(methods, "default_placer", lambda *a, **k: ToyPlacer())
    sc = _scenario_file(tmp_path, trace_file, "n_adapters: [16, 32]\nload_scale: 3\nfixed_pool: 4\nmax_pack: true\n")
    out = tmp_path / "out"
    code, stdout, stderr = run_main(monkeypatch, capsys, "evaluate", sc, "--json", "--out", out,
                                    "--methods", "toy-pack,toy-deal,toy-none")
    assert code == 0, stderr
    doc = json.loads(stdout)
    assert [s["name"] for s in doc["scenarios"]] == ["sc-r8-16-n16-x3", "sc-r8-16-n32-x3"]
    for s in doc["scenarios"]:
        assert {"name", "n_adapters", "load_scale", "methods"} <= set(s)
        for m, r in s["methods"].items():
            assert CONTRACT_KEYS <= set(r), m
        assert s["methods"]["toy-none"]["infeasible"] is True
    assert (out / "results.json").is_file() and (out / "report.md").is_file()
    assert list((out / "figures").glob("gpus-*.png")) and list((out / "figures").glob("max_pack-*.png"))
    assert list((out / "plans").glob("*/toy-pack-smallest.json"))
    report = (out / "report.md").read_text()
    assert "## Summary" in report and "toy-deal" in report


def test_cli_errors_exit_2_without_output(tmp_path, trace_file, monkeypatch, capsys):
    import lorapack.evaluate.placers as methods
    from data_helpers import run_main

    monkeypatch.setattr(methods, "default_placer", lambda *a, **k: ToyPlacer())
    sc = _scenario_file(tmp_path, trace_file, "n_adapters: 8\n")
    out = tmp_path / "never"
    for args, match in (((sc, "--methods", "nope", "--out", out), "unknown method 'nope'"),
                        ((sc, "--budget-s", "0", "--out", out), "--budget-s"),
                        ((tmp_path / "missing.yaml", "--out", out), "file not found"),
                        ((sc, "--objective", "fast", "--out", out), "--objective fast")):
        code, _, stderr = run_main(monkeypatch, capsys, "evaluate", *args)
        assert code == 2 and match in stderr and "Traceback" not in stderr
        assert not out.exists()


def test_real_placement_methods_on_a_small_scenario(tmp_path, trace_file):
    """The placement package behind the Placer interface: pool methods searched to a replay-clean pool."""
    from lorapack.evaluate.placement_api import PlacementPlacer

    sc = load_scenarios(_scenario_file(tmp_path, trace_file, "n_adapters: 24\nload_scale: 6\nfixed_pool: 2\n"
                                                             "max_pack: false\nobjective: throughput\n"))
    doc = evaluate_scenarios(sc, PlacementPlacer(), methods=("least-adapters", "loraserve"))
    entry = doc["scenarios"][0]
    for m, r in entry["methods"].items():
        assert CONTRACT_KEYS <= set(r), m
        assert r["gpus_used"] is not None and r["replay_clean"], (m, r)
        assert r["gpus_used"] >= r["lower_bound_gpus"] == entry["lower_bound_gpus_no_nmax"]
        assert r["starved_gpus"] == 0 and r["oom_gpus"] == 0


def _untimed(x):
    """A results or plan document without its wall times and simulation counts."""
    if isinstance(x, dict):
        return {k: _untimed(v) for k, v in x.items()
                if not (k.endswith("_ms") or k in ("wall_s", "simulations", "cached_gpus"))}
    if isinstance(x, list):
        return [_untimed(v) for v in x]
    return x


@pytest.mark.slow  # ~10 s: two full evaluations with twin verification
def test_the_verifier_is_shared_across_protocols_without_changing_a_verdict(tmp_path, trace_file):
    """One twin verifier per workload: the fixed-pool run of a greedy method re-verifies the same plan from the
    shared answers (0 simulations), and every result equals a run with a fresh verifier per call."""
    from lorapack.evaluate.placement_api import PlacementPlacer

    class Unshared(PlacementPlacer):
        def _verifier(self, workload, profile, seed):
            self._verifiers.clear()
            return super()._verifier(workload, profile, seed)

    sc = load_scenarios(_scenario_file(tmp_path, trace_file, "n_adapters: 24\nload_scale: 6\nfixed_pool: 4\n"
                                                             "max_pack: false\n"))
    shared = evaluate_scenarios(sc, PlacementPlacer(), methods=("proposed-exact",), keep_plans=True)
    plans = shared["scenarios"][0]["plans"]
    own, fixed = plans["proposed-exact/smallest"], plans["proposed-exact/fixed"]
    assert [g["adapters"] for g in own["gpus"]] == [g["adapters"] for g in fixed["gpus"]]
    assert own["verification"]["simulations"] > 0
    assert fixed["verification"]["simulations"] == 0 and fixed["verification"]["cached_gpus"] >= len(fixed["gpus"])
    fresh = evaluate_scenarios(sc, Unshared(), methods=("proposed-exact",), keep_plans=True)
    assert fresh["scenarios"][0]["plans"]["proposed-exact/fixed"]["verification"]["simulations"] > 0
    assert _untimed(shared["scenarios"]) == _untimed(fresh["scenarios"])


class _StrictVerifier(ToyPlacer):
    """The toy methods, with a verifier (the planners' test, as ``PlacementPlacer.verify``) that fails a GPU whose
    estimated tokens exceed ``limit`` x the toy capacity: far stricter than the twin's replay, so the fair pool
    (verified) and the best case (replay-searched) differ. It records what it was shown."""

    def __init__(self, limit: float = 0.3, **kw) -> None:
        super().__init__(**kw)
        self.limit = limit
        self.verified: list[tuple[str, int, str, tuple[float, ...]]] = []

    def gpu_loads(self, workload, plan) -> list[float]:
        rate = {a.adapter_id: a.rate_rps for a in workload.adapters}
        return [sum(rate[a] for a in gp.adapters) * self._tau(workload) for gp in plan.gpus]

    def verify(self, workload, profile, req, plan):
        self.verified.append((req.method, plan.gpus_used, workload.arrivals.kind,
                              tuple(a.rate_rps for a in workload.adapters)))
        bad = [g for g, x in enumerate(self.gpu_loads(workload, plan)) if x > self.limit * self.capacity]
        return {"passed": not bad, "failed_gpus": len(bad), "details": [f"GPU {g}: throughput" for g in bad]}


def test_pool_methods_are_sized_by_the_greedy_methods_verification_not_by_the_replay(tmp_path, trace_file):
    """Issue 26 item 7: a pool method's smallest pool is the smallest one whose plan passes the verification the
    greedy methods pass (estimation window only); the replay-searched pool is kept as ``gpus_used_best_case``.
    The old protocol reported the replay-searched pool as ``gpus_used``: this test fails on it."""
    sc = load_scenarios(_scenario_file(tmp_path, trace_file, "n_adapters: 24\nload_scale: 6\nmax_pack: false\n"
                                                             "weights: uniform\nobjective: throughput\n"))
    toy = _StrictVerifier()
    doc = evaluate_scenarios(sc, toy, methods=("toy-pack", "toy-deal"), keep_plans=True)
    assert doc["format"] == 2 and doc["smallest_pool_protocol"] == "verified"
    entry = doc["scenarios"][0]
    deal = entry["methods"]["toy-deal"]
    # what the verifier was shown: the estimation window's rates and arrival law, never the replay
    from lorapack.evaluate.runner import derive_for, load_scenario_profile

    derived = derive_for(sc[0], load_scenario_profile(sc[0]))
    assert {v[2] for v in toy.verified} == {"modulated"}
    assert {v[3] for v in toy.verified} == {tuple(derived.rates_rps.tolist())}
    # the fair pool: the smallest toy-deal pool every GPU of which passes, found by brute force here
    wl = derived.workload(rate_profile=True)
    from lorapack.evaluate.methods import PlaceRequest

    def deal_ok(g: int) -> bool:
        plan = ToyPlacer().place(wl, load_scenario_profile(sc[0]), PlaceRequest("toy-deal", g, "throughput", None,
                                                                                None, True, 0))
        return all(x <= toy.limit * toy.capacity for x in toy.gpu_loads(wl, plan))

    fair = next(g for g in range(1, 25) if deal_ok(g))
    assert deal["verified"] is True and deal["gpus_used"] == fair
    assert entry["plans"]["toy-deal/smallest"]["gpus_used"] == fair
    # the best case: the smallest pool whose replay is clean (the old protocol's answer), smaller here
    best = deal["best_case"]
    assert best["replay_clean"] is True and deal["gpus_used_best_case"] == best["gpus_used"] < fair
    assert best["passes_verification"] is False and best["failed_verification_gpus"] >= 1
    assert entry["plans"]["toy-deal/best_case"]["gpus_used"] == best["gpus_used"]
    # a greedy method is not searched: no best case; its own (verified) count is its answer
    pack = entry["methods"]["toy-pack"]
    assert pack["gpus_used_best_case"] is None and "best_case" not in pack and pack["gpus_used"] == pack["self_gpus"]
    assert CONTRACT_KEYS <= set(deal) and CONTRACT_KEYS <= set(pack)
    # without verification (the greedy methods are not verified either) the method's own count is its answer
    sc2 = load_scenarios(_scenario_file(tmp_path, trace_file, "n_adapters: 24\nload_scale: 6\nmax_pack: false\n"
                                                              "weights: uniform\nobjective: throughput\nverify: false\n"))
    toy.verified = []
    deal2 = evaluate_scenarios(sc2, toy, methods=("toy-deal",))["scenarios"][0]["methods"]["toy-deal"]
    assert toy.verified == [] and deal2["verified"] is False and deal2["gpus_used"] == deal2["self_gpus"]
    assert deal2["gpus_used_best_case"] == best["gpus_used"]


def test_no_verified_pool_up_to_the_cap_is_none_with_the_best_case_kept(tmp_path, trace_file):
    sc = load_scenarios(_scenario_file(tmp_path, trace_file, "n_adapters: 24\nload_scale: 6\nmax_pack: false\n"
                                                             "weights: uniform\nobjective: throughput\n"))
    deal = evaluate_scenarios(sc, _StrictVerifier(limit=1e-6), methods=("toy-deal",))["scenarios"][0]["methods"][
        "toy-deal"]
    assert deal["gpus_used"] is None and deal["no_verified_pool"] is True and deal["gap_gpus"] is None
    assert deal["gpus_used_best_case"] is not None and deal["best_case"]["passes_verification"] is False


def test_demo_with_a_toy_placer(tmp_path, monkeypatch, capsys, data_dir):
    import lorapack.evaluate.placers as methods
    from data_helpers import run_main

    toy = ToyPlacer(pack=("proposed", "proposed-exact"), deal=("dlora", "loraserve", "least-adapters", "round-robin"))
    monkeypatch.setattr(methods, "default_placer", lambda *a, **k: toy)
    out = tmp_path / "demo"
    code, stdout, stderr = run_main(monkeypatch, capsys, "demo", "--out", out, "--json", "--workers", "1")
    assert code == 0, stderr
    doc = json.loads(stdout)
    (sc,) = doc["scenarios"]
    assert sc["n_adapters"] == 128 and set(sc["methods"]) == {"proposed", "dlora", "loraserve", "least-adapters",
                                                              "round-robin"}
    assert doc["files"] and (out / "plan.json").is_file() and (out / "serve.sh").is_file()
    code, stdout, stderr = run_main(monkeypatch, capsys, "demo", "--out", out, "--workers", "1")
    assert code == 0 and "Lower bound" in stdout and str(out / "plan.json") in " ".join(stdout.split())


@pytest.mark.slow
def test_demo_end_to_end(tmp_path, monkeypatch, capsys, data_dir):
    from data_helpers import run_main

    out = tmp_path / "demo"
    code, stdout, stderr = run_main(monkeypatch, capsys, "demo", "--out", out, "--workers", "1")
    assert code == 0, stderr
    text = " ".join(stdout.split())
    assert "lorapack demo" in text and "Lower bound" in text and "dlora" in text
    plan = json.loads((out / "plan.json").read_text())
    assert plan["gpus_used"] >= plan["lower_bound_gpus"] >= 1


def test_evaluation_doc_script_fills_the_marked_section(tmp_path, trace_file):
    import importlib.util

    from lorapack.evaluate.report import write_outputs

    sc = load_scenarios(_scenario_file(tmp_path, trace_file, "n_adapters: [16, 32]\nload_scale: 3\nfixed_pool: 4\n"
                                                             "objective: [default, throughput]\n"))
    doc = evaluate_scenarios(sc, ToyPlacer(), methods=("toy-pack", "toy-deal"))
    write_outputs(doc, tmp_path / "res")
    md = tmp_path / "evaluation.md"
    md.write_text("# head\n<!-- results:begin -->\nold\n<!-- results:end -->\ntail\n")
    spec = importlib.util.spec_from_file_location("evaluation_doc", Path(__file__).parent.parent / "scripts" /
                                                  "evaluation_doc.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main([str(tmp_path / "res"), "--doc", str(md), "--figures", str(tmp_path / "figs")]) == 0
    text = md.read_text()
    assert text.startswith("# head\n") and text.endswith("tail\n") and "old" not in text
    assert "### GPUs used" in text and "toy-deal" in text and "figs/gpus-" in text
    assert json.loads((tmp_path / "figs" / "results.json").read_text())["scenarios"]
    assert list((tmp_path / "figs").glob("max_pack-*.png"))

    # the same study in two parts (rerun separately) gives the same tables; a scenario in both is refused
    half = len(doc["scenarios"]) // 2
    for k, part in enumerate((doc["scenarios"][:half], doc["scenarios"][half:])):
        names = {x["name"] for x in part}
        write_outputs({**doc, "scenarios": part, "max_pack": [m for m in doc["max_pack"] if m["scenario"] in names]},
                      tmp_path / f"part{k}")
    md2 = tmp_path / "evaluation2.md"
    md2.write_text("<!-- results:begin -->\n<!-- results:end -->\n")
    assert mod.main([str(tmp_path / "part0"), str(tmp_path / "part1"), "--doc", str(md2), "--figures",
                     str(tmp_path / "figs2")]) == 0
    text2 = md2.read_text()
    assert "(2 runs, merged)" in text2
    assert text2.split("\n", 2)[2].replace("figs2/", "figs/") == text.split("<!-- results:begin -->\n", 1)[1].split("\n", 1)[1].rsplit("tail", 1)[0]
    assert mod.main([str(tmp_path / "part0"), str(tmp_path / "part0"), "--doc", str(md2)]) == 2


def test_jobs_give_the_same_results(tmp_path, trace_file, monkeypatch, capsys):
    """--jobs runs workload groups in worker processes (lorapack.executor): same results as in order."""
    from data_helpers import run_main

    sc = _scenario_file(tmp_path, trace_file, "n_adapters: [16, 24]\nload_scale: 3\nmax_pack: false\n"
                                              "objective: [default, throughput]\n")
    docs = []
    for jobs in ("1", "2"):
        code, stdout, stderr = run_main(monkeypatch, capsys, "evaluate", sc, "--json", "--jobs", jobs,
                                        "--methods", "least-adapters,loraserve")
        assert code == 0, stderr
        docs.append(json.loads(stdout))
    for d in docs:
        for s in d["scenarios"]:
            for r in s["methods"].values():
                r.pop("placement_ms")
    assert docs[0]["scenarios"] == docs[1]["scenarios"] and len(docs[0]["scenarios"]) == 4


def test_the_report_holds_proposed_to_verified_baseline_pools_and_shows_the_best_case():
    from lorapack.evaluate.report import acceptance, compact_table, fair_best_rows, summary_markdown

    def sc(name: str, fair: int, best: int, passes: bool | None) -> dict:
        lora = {"gpus_used": fair, "gpus_used_fixed_pool": None, "verified": True, "replay_clean": True,
                "gpus_used_best_case": best, "best_case": {"gpus_used": best, "replay_clean": True}}
        if passes is not None:
            lora["best_case"].update(passes_verification=passes, failed_verification_gpus=0 if passes else 2)
        return {"name": name, "n_adapters": 64, "lower_bound_gpus": 3,
                "scenario": {"model": "llama-3.1-8b-instruct", "ranks": [8, 16], "n_adapters": 64, "load_scale": 1,
                             "objective": "default"},
                "methods": {"proposed": {"gpus_used": 4, "gpus_used_fixed_pool": None, "gpus_used_best_case": None},
                            "loraserve": lora}}

    # a: a verified loraserve pool of 3 < proposed's 4 (the rule broken); b: fair 4 = proposed, best case 3
    doc = {"scenarios": [sc("a", 3, 3, True), sc("b", 4, 3, False), sc("c", 5, 4, None)], "max_pack": []}
    a = acceptance(doc)
    assert [(x["scenario"], x["baseline_passes_verification"]) for x in a["vs_baselines"]["more_gpus"]] == [
        ("a", True)]
    assert [(x["scenario"], x["baseline_passes_verification"]) for x in a["vs_best_case"]["more_gpus"]] == [
        ("a", True), ("b", False)]
    text = summary_markdown(doc)
    assert "MORE GPUs than a baseline in 1 case(s), 1 of them against a plan that passes the verification" in text
    assert "b vs loraserve (4 > 3; its plan fails our verification on 2 GPU(s))" in text
    assert "passes the verification `proposed`'s plans must pass in 1 of 2" in text
    rows = fair_best_rows(doc)
    assert rows == [{"method": "loraserve", "scenarios": 3, "fair_found": 3, "best_found": 3, "gpus_fair": 12,
                     "gpus_best": 10, "fair_more": 2, "equal": 1, "fair_fewer": 0, "fair_clean": 3,
                     "best_passes": 0, "best_judged": 1}]
    table = compact_table(doc)
    assert "| 4 | 4 / 3 |" in table and "| 4 | – |" not in table
    # the rule kept: no verified baseline pool below proposed's
    ok = {"scenarios": [sc("b", 4, 3, False)], "max_pack": []}
    assert "never more GPUs than a baseline plan that passes the same verification" in summary_markdown(ok)


# ---------------------------------------------------------------------------------------------------------
# issue 26 item 8: the report's figures and headers, the demo footer, the docs' wall time


def test_gpu_figure_shows_ties_as_offset_lines_on_whole_gpu_ticks():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from lorapack.evaluate.report import TIE_OFFSET_GPUS, plot_gpu_lines

    scs = [{"n_adapters": n, "lower_bound_gpus": 1, "methods": {"a": {"gpus_used": 2}, "b": {"gpus_used": 2},
                                                                 "c": {"gpus_used": None}}} for n in (32, 64, 128)]
    fig, ax = plt.subplots()
    plot_gpu_lines(ax, scs, ["a", "b", "c"])
    ya, yb = (np.asarray(line.get_ydata(), dtype=float) for line in ax.lines[:2])
    np.testing.assert_allclose(yb - ya, TIE_OFFSET_GPUS)  # identical counts: two visible lines, not one
    assert np.all(np.abs(ya - 2) <= TIE_OFFSET_GPUS + 1e-9) and np.all(np.isnan(ax.lines[2].get_ydata()))
    fig.canvas.draw()
    ticks = [t for t in ax.get_yticks() if ax.get_ylim()[0] <= t <= ax.get_ylim()[1]]
    assert ticks and all(float(t).is_integer() for t in ticks)  # a GPU count has no fractional tick
    plt.close(fig)


def test_max_pack_curves_that_coincide_are_drawn_once_and_said_so():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from lorapack.evaluate.report import coinciding_groups, curves_coincide, plot_max_pack

    def curve(thr, starved=(False, False, False)):
        return {"n": [8, 16, 32], "throughput_tok_s": list(thr), "incoming_tok_s": [100.0, 200.0, 400.0],
                "starved": list(starved), "max_pack": 32}

    same = {"8": curve([100, 200, 400]), "32": curve([100, 200, 401]), "max": curve([100, 200, 399])}
    assert coinciding_groups(same) == [["8", "32", "max"]] and curves_coincide(same)
    mixed = {**same, "128": curve([100, 200, 300], (False, False, True))}
    assert coinciding_groups(mixed) == [["8", "32", "max"], ["128"]] and not curves_coincide(mixed)
    fig, ax = plt.subplots()
    assert plot_max_pack(ax, same) is True
    labels = [line.get_label() for line in ax.lines]
    assert labels == ["--max-loras 8, 32, max (identical)", "incoming"]
    plt.close(fig)


def test_report_header_gives_the_estimated_and_the_replayed_load():
    from lorapack.evaluate.report import load_text

    w = {"aggregate_rate_rps": 28.04, "offered_tok_s": 11800.0, "replay_rate_rps": 27.2}
    assert load_text(w) == "estimated 28.0 req/s (11,800 tok/s), replayed 27.2 req/s"


def test_demo_footer_says_what_clean_means():
    from lorapack.cli.demo import _clean_text

    assert _clean_text({"objective_limits": "mean TTFT <= 2 s"}) == (
        "Clean: every GPU starts, no GPU is starved (< 90 % of its tokens served), no adapter is starved and every "
        "GPU meets mean TTFT <= 2 s.")
    assert _clean_text({"objective_limits": "none (throughput only)"}).endswith("and no adapter is starved.")


def _evaluation_doc_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("evaluation_doc", Path(__file__).parent.parent / "scripts" /
                                                  "evaluation_doc.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_evaluation_doc_header_gives_measured_wall_times_and_labels_the_old_protocol(tmp_path):
    mod = _evaluation_doc_module()
    one = {"format": 2, "scenarios": [{"name": "a"}], "wall_s": 1754.4}
    two = {"format": 2, "scenarios": [{"name": "b"}, {"name": "c"}], "wall_s": None}
    head = mod.header([one, two], {**one, "scenarios": one["scenarios"] + two["scenarios"]}, Path("evaluation"))
    assert head.startswith("3 scenarios, wall time part 1 (1 scenarios) 29 min 14 s; part 2 (2 scenarios) not "
                           "recorded (2 runs, merged).") and "?" not in head
    assert "Old protocol" not in head
    old = {"format": 1, "scenarios": [{"name": "a"}], "wall_s": 42.0}
    assert "**Old protocol**" in mod.header([old], old, Path("evaluation"))
    for k, d in enumerate((old, one)):
        (tmp_path / f"r{k}").mkdir()
        (tmp_path / f"r{k}" / "results.json").write_text(json.dumps({**d, "max_pack": [], "skipped": []}))
    md = tmp_path / "e.md"
    md.write_text("<!-- results:begin -->\n<!-- results:end -->\n")
    assert mod.main([str(tmp_path / "r0"), str(tmp_path / "r1"), "--doc", str(md)]) == 2  # never mixed
