"""``place`` plans for the workload's own request lengths (issue 26, item 1) and keeps adapters at rate 0 (item 8).

Before: ``place`` kept only the workload's mean lengths and always simulated the profile's log-normal law (cv
0.838944), so a YAML with ``lengths: {kind: fixed, ...}`` at 400/250 or 1500/300 tokens exited 2 ("cannot reach
post-filter means ... cv 0.838944"), and a plan's GPU re-simulated with the workload's lengths missed the plan's
verified TTFT. These tests fail on that behaviour.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from data_helpers import run_main
from lorapack.errors import SpecError
from lorapack.oracle import (
    GpuCandidate,
    candidate_workload,
    lengths_outside_training,
    profile_cv,
)
from lorapack.placement import PlaceConfig, make_instance, place
from lorapack.placement.bound import _capacity_key
from lorapack.placement.oracles import candidate_key
from lorapack.placement.problem import instance_from_workload
from lorapack.profile import find_profile
from lorapack.server import ServerConfig
from lorapack.spec import Adapter, LengthsSpec, Workload

LLAMA = "llama-3.1-8b-instruct"
PROFILE = find_profile(LLAMA)


@pytest.fixture(autouse=True)
def _no_debug_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LORAPACK_DEBUG", raising=False)


def _yaml(tmp_path: Path, lengths: dict | None, n: int = 12, rate_rps: float = 0.2, name: str = "wl.yaml") -> Path:
    doc: dict = {"adapters": [{"count": n, "rank": 8, "rate_rps": rate_rps, "id_prefix": "a"}]}
    if lengths is not None:
        doc["lengths"] = lengths
    p = tmp_path / name
    p.write_text(yaml.safe_dump(doc))
    return p


def _place_json(monkeypatch, capsys, tmp_path: Path, wl: Path, *args) -> dict:
    code, out, err = run_main(monkeypatch, capsys, "place", wl, "--model", LLAMA, "--out", tmp_path / "plan",
                              "--json", *args)
    assert code == 0, err
    return json.loads(out)


@pytest.mark.parametrize("means", [(400, 250), (1500, 300)])
def test_fixed_lengths_are_placed_with_their_own_law(tmp_path, monkeypatch, capsys, means) -> None:
    wl = _yaml(tmp_path, {"kind": "fixed", "mean_input_tokens": means[0], "mean_output_tokens": means[1]})
    plan = _place_json(monkeypatch, capsys, tmp_path, wl, "--verify-seeds", "1")
    law = plan["settings"]["lengths"]
    assert law == {"kind": "fixed", "mean_input_tokens": means[0], "mean_output_tokens": means[1],
                   "assumed": False}
    # the learned models never saw fixed lengths: the twin was the oracle, and plan.json says why
    fb = plan["settings"]["oracle_fallback"]
    assert plan["settings"]["oracle"] == "twin" and fb["from"] == ["surrogate"] and "lengths fixed" in fb["reason"]
    assert all(g["verified"]["passed"] for g in plan["gpus"])


def test_verified_ttft_is_what_simulate_says_with_the_workloads_lengths(tmp_path, monkeypatch, capsys) -> None:
    """The plan's verified TTFT of a GPU equals ``lorapack simulate`` of that GPU (its adapters at the planned
    rates, its flags, the verifier's seed) with the workload's lengths -- log-normal at cv 1.1, not the
    profile's 0.839."""
    lengths = {"kind": "lognormal", "mean_input_tokens": 250, "mean_output_tokens": 150, "cv": 1.1}
    wl = _yaml(tmp_path, lengths, n=24, rate_rps=0.5)
    plan = _place_json(monkeypatch, capsys, tmp_path, wl, "--verify-seeds", "1", "--method", "proposed-exact")
    assert plan["settings"]["lengths"]["cv"] == 1.1
    g = plan["gpus"][0]
    rate = 0.5 * (1 + plan["settings"]["headroom"])
    gpu = tmp_path / "gpu0.yaml"
    gpu.write_text(yaml.safe_dump({"adapters": [{"adapter_id": a, "rank": 8, "rate_rps": rate * w}
                                                for a, w in zip(g["adapters"], g["weights"], strict=True)],
                                   "lengths": lengths}))
    seed = plan["verification"]["seeds"][0]
    code, out, err = run_main(monkeypatch, capsys, "simulate", gpu, "--model", LLAMA, "-a", g["max_loras"],
                              "--max-lora-rank", g["max_lora_rank"], "--seed", seed, "--json")
    assert code == 0, err
    sim = json.loads(out)
    verified = g["verified"]["per_seed"][0]
    assert sim["ttft_mean_ms"] == pytest.approx(verified["ttft_mean_ms"], rel=1e-9)
    assert sim["throughput_tok_s"] == pytest.approx(verified["throughput_tok_s"], rel=1e-9)


def test_a_csv_assumes_the_profiles_law_and_the_output_says_so(tmp_path, monkeypatch, capsys) -> None:
    wl = tmp_path / "adapters.csv"
    wl.write_text("adapter_id,rank,rate_rps\na,8,0.1\nb,16,0.2\n")
    code, out, err = run_main(monkeypatch, capsys, "place", wl, "--model", LLAMA, "--out", tmp_path / "plan",
                              "--no-verify")
    assert code == 0, err
    assert "lengths: none in the workload file; assumed the profile's" in " ".join(out.split())
    law = json.loads((tmp_path / "plan" / "plan.json").read_text())["settings"]["lengths"]
    assert law == {"kind": "lognormal", "mean_input_tokens": 223.0, "mean_output_tokens": 197.0,
                   "cv": profile_cv(PROFILE), "assumed": True}


def test_simulate_assumes_the_same_law_for_a_workload_without_lengths(tmp_path, monkeypatch, capsys) -> None:
    """``simulate`` of a CSV (no lengths) runs the profile's law, as ``place`` plans it: the same numbers as a
    YAML that gives that law, and a note that says so."""
    csv = tmp_path / "adapters.csv"
    csv.write_text("adapter_id,rank,rate_rps\na,8,0.5\nb,16,0.7\n")
    given = tmp_path / "given.yaml"
    given.write_text(yaml.safe_dump({"adapters_csv": str(csv), "lengths": {
        "kind": "lognormal", "mean_input_tokens": 300, "mean_output_tokens": 150, "cv": profile_cv(PROFILE)}}))
    runs = []
    for wl, extra in ((csv, ["--mean-input-tokens", "300", "--mean-output-tokens", "150"]), (given, [])):
        code, out, err = run_main(monkeypatch, capsys, "simulate", wl, "--model", LLAMA, "--max-loras", "2",
                                  "--duration-s", "300", "--json", *extra)
        assert code == 0, err
        runs.append(json.loads(out))
    assert runs[0]["ttft_mean_ms"] == runs[1]["ttft_mean_ms"] and runs[0]["throughput_tok_s"] == runs[1]["throughput_tok_s"]
    code, out, err = run_main(monkeypatch, capsys, "simulate", csv, "--model", LLAMA, "-a", "2", "--duration-s", "60")
    assert code == 0 and "gives no request lengths: simulated with the profile's log-normal law" in " ".join(err.split())


@pytest.mark.parametrize("means, hint", [((400, 250), "cv 0.76 or less would"),
                                         ((1500, 300), "no log-normal law does")])
def test_unreachable_assumed_means_name_the_file_and_the_cv_that_reaches(tmp_path, monkeypatch, capsys, means,
                                                                         hint) -> None:
    wl = tmp_path / "adapters.csv"
    wl.write_text("adapter_id,rank,rate_rps\na,8,0.1\n")
    out_dir = tmp_path / "plan"
    code, out, err = run_main(monkeypatch, capsys, "place", wl, "--model", LLAMA, "--out", out_dir,
                              "--mean-input-tokens", means[0], "--mean-output-tokens", means[1])
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert f"{wl} gives no request lengths" in lines[0] and f"cv {profile_cv(PROFILE):g}" in lines[0]
    assert hint in lines[0] and not out_dir.exists()


def test_a_yaml_log_normal_target_out_of_reach_names_its_line_and_a_cv(tmp_path, monkeypatch, capsys) -> None:
    wl = _yaml(tmp_path, {"kind": "lognormal", "mean_input_tokens": 400, "mean_output_tokens": 250, "cv": 0.9})
    code, _out, err = run_main(monkeypatch, capsys, "place", wl, "--model", LLAMA, "--out", tmp_path / "plan")
    assert code == 2 and f"{wl}:" in err and "cv 0.76 or less reaches them" in err, err


def test_mean_overrides_keep_the_workloads_law(tmp_path) -> None:
    fixed = Workload(adapters=[Adapter(adapter_id="a", rank=8, rate_rps=0.1)],
                     lengths=LengthsSpec(kind="fixed", mean_input_tokens=100, mean_output_tokens=50))
    inst = instance_from_workload(fixed, mean_input_tokens=900, profile=PROFILE)
    assert inst.lengths.kind == "fixed" and (inst.mean_input_tokens, inst.mean_output_tokens) == (900, 50)
    table = tmp_path / "lengths.csv"
    table.write_text("input_tokens,output_tokens\n100,10\n300,30\n")
    emp = Workload(adapters=fixed.adapters, lengths=LengthsSpec(kind="empirical", path=str(table)))
    inst = instance_from_workload(emp, profile=PROFILE)
    assert inst.lengths.kind == "empirical" and (inst.mean_input_tokens, inst.mean_output_tokens) == (200, 20)
    with pytest.raises(SpecError, match="'empirical'"):
        instance_from_workload(emp, mean_input_tokens=500)
    # no law given: the profile's is assumed (None), at the overridden means
    bare = Workload(adapters=fixed.adapters)
    inst = instance_from_workload(bare, mean_output_tokens=150, profile=PROFILE)
    assert inst.lengths is None and (inst.mean_input_tokens, inst.mean_output_tokens) == (223, 150)


def test_the_twin_and_its_caches_follow_the_candidates_law() -> None:
    kw = dict(profile=PROFILE, ranks=np.array([8, 8]), rates_rps=np.array([0.5, 0.5]),
              server=ServerConfig(max_loras=2), mean_input_tokens=400.0, mean_output_tokens=250.0)
    fixed = GpuCandidate(**kw, lengths=LengthsSpec(kind="fixed"))
    assumed = GpuCandidate(**{**kw, "mean_input_tokens": 223.0, "mean_output_tokens": 197.0})
    same_as_profile = GpuCandidate(**{**kw, "mean_input_tokens": 223.0, "mean_output_tokens": 197.0},
                                   lengths=LengthsSpec(cv=profile_cv(PROFILE)))
    law = candidate_workload(fixed, 60.0).lengths
    assert (law.kind, law.mean_input_tokens, law.mean_output_tokens) == ("fixed", 400.0, 250.0)
    law = candidate_workload(assumed, 60.0).lengths
    assert (law.kind, law.cv) == ("lognormal", profile_cv(PROFILE))
    # the profile's own law keys as before (older caches stay valid); another law keys apart
    assert candidate_key(assumed) == candidate_key(same_as_profile)
    assert candidate_key(fixed) != candidate_key(GpuCandidate(**kw))
    assert _capacity_key(PROFILE, 8, 400, 250, LengthsSpec(kind="fixed")) != _capacity_key(PROFILE, 8, 400, 250)
    assert _capacity_key(PROFILE, 8, 223, 197, same_as_profile.lengths) == _capacity_key(PROFILE, 8, 223, 197)
    with pytest.raises(SpecError, match="LengthsSpec"):
        GpuCandidate(**kw, lengths={"kind": "fixed"})


def test_learned_oracles_flag_lengths_outside_their_training() -> None:
    from lorapack.surrogate import load_oracle

    oracle = load_oracle(PROFILE, kind="tree")
    kw = dict(profile=PROFILE, ranks=np.full(8, 8), rates_rps=np.full(8, 0.5), server=ServerConfig(max_loras=8))
    trained = GpuCandidate(**kw, mean_input_tokens=223.0, mean_output_tokens=197.0)
    fixed = GpuCandidate(**kw, mean_input_tokens=223.0, mean_output_tokens=197.0, lengths=LengthsSpec(kind="fixed"))
    wide = GpuCandidate(**kw, mean_input_tokens=223.0, mean_output_tokens=197.0, lengths=LengthsSpec(cv=1.1))
    longer = GpuCandidate(**kw, mean_input_tokens=400.0, mean_output_tokens=197.0)
    p = oracle.predict([trained, fixed, wide, longer])
    assert p[0].in_range and lengths_outside_training(oracle, trained) == ""
    assert not p[1].in_range and "lengths fixed" in p[1].out_of_range
    assert not p[2].in_range and "cv 1.1" in p[2].out_of_range
    assert "mean_input_tokens=400" in lengths_outside_training(oracle, longer)


def test_the_api_plans_for_a_workloads_law_and_records_it() -> None:
    wl = Workload(adapters=[Adapter(adapter_id=f"a{i}", rank=8, rate_rps=0.2) for i in range(8)],
                  lengths=LengthsSpec(kind="fixed", mean_input_tokens=600, mean_output_tokens=100))
    plan = place(wl, PROFILE, PlaceConfig(method="proposed-fast", verify=False))
    assert plan.settings["lengths"]["kind"] == "fixed" and plan.settings["oracle"] == "twin"
    assert plan.settings["oracle_fallback"]["from"] == ["tree"]
    inst = make_instance(["a"], [8], [0.1], mean_input_tokens=223, mean_output_tokens=197)
    with pytest.raises(SpecError, match="LengthsSpec"):
        inst.with_lengths({"kind": "fixed"})  # type: ignore[arg-type]
    with pytest.raises(SpecError, match="the instance gives no request lengths"):
        place(make_instance(["a"], [8], [0.1], mean_input_tokens=1500, mean_output_tokens=300), PROFILE,
              PlaceConfig(verify=False))
    law = inst.with_lengths(LengthsSpec(kind="fixed", mean_input_tokens=1500, mean_output_tokens=300))
    assert (law.mean_input_tokens, law.mean_output_tokens) == (1500, 300)


# ---------------------------------------------------------------------------------------------------------
# adapters at rate 0 (issue 26, item 8)


@pytest.mark.parametrize("method", ["proposed", "proposed-exact", "dlora", "loraserve", "least-adapters"])
def test_zero_rate_adapters_stay_in_the_plan(tmp_path, monkeypatch, capsys, method) -> None:
    """An adapter forecast at 0 req/s is still deployed: it needs a GPU (a slot of --max-cpu-loras, a rank
    class), brings no load, and is never called starved."""
    wl = tmp_path / "adapters.csv"
    wl.write_text("adapter_id,rank,rate_rps\n" + "".join(f"z{i},16,0\n" for i in range(3))
                  + "".join(f"a{i},8,0.2\n" for i in range(6)))
    plan = _place_json(monkeypatch, capsys, tmp_path, wl, "--method", method, "--verify-seeds", "1")
    placed = [a for g in plan["gpus"] for a in g["adapters"]]
    assert sorted(set(placed)) == sorted([f"z{i}" for i in range(3)] + [f"a{i}" for i in range(6)])
    assert all(g["verified"]["passed"] and not g["verified"]["starved_adapters"] for g in plan["gpus"])
    assert any(g["max_lora_rank"] == 16 for g in plan["gpus"])  # the rank-16 adapters' class counts


def test_negative_and_zero_rates_follow_one_rule(tmp_path, monkeypatch, capsys) -> None:
    wl = tmp_path / "neg.csv"
    wl.write_text("adapter_id,rank,rate_rps\na,8,-1\n")
    code, _out, err = run_main(monkeypatch, capsys, "place", wl, "--model", LLAMA, "--out", tmp_path / "p")
    assert code == 2 and f"{wl}:2: rate_rps: expected a finite number >= 0" in err, err
    with pytest.raises(SpecError, match=r"rate_rps -0.5: expected a finite number >= 0"):
        make_instance(["a"], [8], [-0.5], mean_input_tokens=223, mean_output_tokens=197)
    assert make_instance(["a"], [8], [0.0], mean_input_tokens=223, mean_output_tokens=197).rates_rps[0] == 0.0
