"""Evaluation over time (issue 25 item 3): the drift model, the policies on its windows, the report and the CLI.

Placement runs on toy oracles (a GPU passes while its rates sum to at most ``CAP`` req/s; no simulation); the
replays are the twin's, on short windows of a small synthetic trace."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from evaluate_helpers import write_trace
from lorapack.errors import SpecError
from lorapack.evaluate.drift import (
    DriftOptions,
    DriftRun,
    drift_acceptance,
    drift_markdown,
    plot_drift,
    run_drift,
    simulate_drift,
)
from lorapack.evaluate.drift_spec import DriftSpec, parse_policy
from lorapack.evaluate.scenario import load_scenarios
from lorapack.placement import OracleOverrides
from lorapack.placement.plan import plan_from_dict
from lorapack.replan.replan import best_matching, churn
from lorapack.workload.trace import load_trace
from placement_helpers import ToyOracle, toy_capacity

CAP = 3.0  # req/s one GPU serves under the toy oracle: the toy trace's 5 req/s need a few GPUs
FAST = settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory) -> Path:
    return write_trace(tmp_path_factory.mktemp("drift") / "toy.csv", n=3000, span_s=600.0)


def _file(tmp: Path, trace_file: Path, drift: str, extra: str = "", name: str = "study.yaml") -> Path:
    path = tmp / name
    path.write_text(f"name: toy\ntrace: {trace_file}\nmodel: llama-3.1-8b-instruct\nn_adapters: 12\n"
                    f"objective: throughput\n{extra}drift:\n{drift}")
    return path


DRIFT = ("  windows: 4\n  window_s: 60\n  sigma: 0.4\n  arrivals: 0.2\n  departures: 0.15\n  seed: 3\n"
         "  policies: [peak, scratch, 'replan:0', 'replan:2', replan]\n")


def _toy(_law) -> OracleOverrides:
    toy = ToyOracle(CAP)
    return OracleOverrides(oracle=toy, search_oracle=toy, verify_oracle=toy, capacity=toy_capacity(CAP))


def _untimed(x):
    if isinstance(x, dict):
        return {k: _untimed(v) for k, v in x.items() if not (k.endswith("_ms") or k == "wall_s")}
    if isinstance(x, list):
        return [_untimed(v) for v in x]
    return x


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory, trace_file):
    tmp = tmp_path_factory.mktemp("run")
    sc = load_scenarios(_file(tmp, trace_file, DRIFT))[0]
    return sc, run_drift(sc, DriftRun(overrides=_toy, keep_plans=True))


# ---------------------------------------------------------------------------------------------------------
# the drift block


def test_policies_parse() -> None:
    assert parse_policy("replan:8") == ("replan", 8) and parse_policy("replan") == ("replan", None)
    assert parse_policy("peak") == ("peak", None)
    for bad in ("scratch:3", "replan:-1", "replan:x", "hold"):
        with pytest.raises(ValueError):
            parse_policy(bad)
    assert DriftSpec(policies=["replan:04", "peak"]).policies == ["replan:4", "peak"]


@pytest.mark.parametrize(("drift", "extra", "match"), [
    ("  windows: 1\n", "", "at least 2 windows"),
    ("  departures: 1\n", "", "probability"),
    ("  policies: [peak, hold]\n", "", "peak, scratch, replan"),
    ("  policies: [scratch, scratch]\n", "", "distinct"),
    ("  windows: 20\n  window_s: 60\n", "", "past the trace"),
    ("  windows: 2\n", "fixed_pool: 2\n", "'fixed_pool' is not used"),
    ("  windows: 2\n", "split_hot: true\n", "split_hot"),
    ("  windows: 2\n", "methods: [proposed, dlora]\n", "one method"),
    ("  windos: 2\n", "", "windos"),
])
def test_drift_file_errors_are_one_line(tmp_path, trace_file, drift, extra, match) -> None:
    with pytest.raises(SpecError, match=match) as e:
        load_scenarios(_file(tmp_path, trace_file, drift, extra))
    assert "\n" not in str(e.value) and "study.yaml:" in str(e.value)


# ---------------------------------------------------------------------------------------------------------
# the drift model


def _opts(**kw) -> DriftOptions:
    spec = {"windows": 4, "window_s": 60.0, "sigma": 0.5, "arrivals": 0.2, "departures": 0.1, "seed": 1}
    spec.update(kw.pop("spec", {}))
    return DriftOptions(n_adapters=kw.pop("n", 10), spec=DriftSpec(**spec), **kw)


def test_same_seeds_same_windows(trace_file) -> None:
    tr = load_trace(trace_file)
    a, b = simulate_drift(tr, _opts(), 0), simulate_drift(tr, _opts(), 0)
    assert a.adapter_ids == b.adapter_ids and np.array_equal(a.rates_rps, b.rates_rps)
    for x, y in zip(a.requests, b.requests, strict=True):
        assert np.array_equal(x.adapter, y.adapter) and np.array_equal(x.t_arr_s, y.t_arr_s)
    c = simulate_drift(tr, _opts(), 0, drift_seed=2)
    assert not all(np.array_equal(x.adapter, y.adapter) for x, y in zip(a.requests, c.requests, strict=True))
    # the trace's load curve does not depend on the drift seed: same arrival times per window
    assert all(np.array_equal(x.t_arr_s, y.t_arr_s) for x, y in zip(a.requests, c.requests, strict=True))


@FAST
@given(sigma=st.floats(0, 2), arrivals=st.floats(0, 1), departures=st.floats(0, 0.9), seed=st.integers(0, 50),
       n=st.integers(1, 30), k=st.sampled_from([0.5, 1.0, 2.0]))
def test_drift_properties(trace_file, sigma, arrivals, departures, seed, n, k) -> None:
    tr = load_trace(trace_file)
    dw = simulate_drift(tr, _opts(n=n, load_scale=k, spec={"sigma": sigma, "arrivals": arrivals,
                                                             "departures": departures, "seed": seed}), seed)
    assert dw.active[0].sum() == n and dw.arrived[0] == dw.departed[0] == 0
    assert len(dw.adapter_ids) == n + sum(dw.arrived) == dw.active.shape[1]
    for w in range(dw.n_windows):
        act = dw.active[w]
        assert act.any()
        # planned rates exactly where active, and they add up to the window's requests / its length
        assert np.all((dw.rates_rps[w] > 0) == act)
        floor_extra = act.sum() / 3600.0
        assert len(dw.requests[w]) / 60.0 <= dw.rates_rps[w].sum() + 1e-9 <= len(dw.requests[w]) / 60.0 + floor_extra
        req = dw.requests[w]
        assert np.all(act[req.adapter]) and np.all((req.t_arr_s >= 0) & (req.t_arr_s < 60.0))
        assert np.all(np.diff(req.t_arr_s) >= 0)
        if w:
            prev = dw.active[w - 1]
            seen = n + sum(dw.arrived[:w])  # adapters that appeared before window w (newcomers come after them)
            assert (prev & ~act).sum() == dw.departed[w]
            assert not np.any(act[:seen] & ~prev[:seen])  # an adapter that left never comes back
            assert act[seen:].sum() == dw.arrived[w] and not prev[seen:].any()
    # the trace's own load curve: window w holds the scaled trace's requests of [60 w, 60 (w + 1))
    if k == 1.0:
        counts = [int(((tr.t_s >= 60 * w) & (tr.t_s < 60 * (w + 1))).sum()) for w in range(4)]
        assert [len(r) for r in dw.requests] == counts


def test_drift_options_are_validated() -> None:
    with pytest.raises(SpecError, match="n_adapters"):
        _opts(n=0)
    with pytest.raises(SpecError, match="load_scale"):
        _opts(load_scale=float("nan"))
    with pytest.raises(SpecError, match="DriftSpec"):
        DriftOptions(n_adapters=3, spec={"windows": 2})  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------------------
# the policies


def test_policies_on_toy_oracles(toy_run) -> None:
    sc, entry = toy_run
    pol = entry["policies"]
    assert list(pol) == ["peak", "scratch", "replan:0", "replan:2", "replan"]
    for p in pol.values():
        rows = p["per_window"]
        assert len(rows) == 4 and [r["window"] for r in rows] == [0, 1, 2, 3]
        assert rows[0]["moves"] == 0 and rows[0]["restarts"] == 0  # window 0: the first deployment
        assert p["gpu_windows"] == sum(r["gpus"] for r in rows)
        assert p["moves"] == sum(r["moves"] for r in rows)
        assert p["unclean_windows"] == sum(not r["clean"] for r in rows)
    assert pol["peak"]["moves"] == 0 and len({r["gpus"] for r in pol["peak"]["per_window"]}) == 1
    # every policy starts from the same from-scratch plan
    assert len({p["per_window"][0]["gpus"] for n, p in pol.items() if n != "peak"}) == 1
    # a capped re-plan makes at most K optional moves per window
    for name, k in (("replan:0", 0), ("replan:2", 2)):
        for r in pol[name]["per_window"][1:]:
            assert r["moves_by_reason"]["optional"] <= k
    assert entry["acceptance"]["by_policy"].keys() == {"replan:0", "replan:2", "replan"}


def test_scratch_moves_are_counted_after_the_best_matching(toy_run) -> None:
    _, entry = toy_run
    plans = {k: plan_from_dict(v) for k, v in entry["plans"].items()}
    for w in range(1, 4):
        prev, now = plans[f"scratch/window{w - 1}"], plans[f"scratch/window{w}"]
        assert entry["policies"]["scratch"]["per_window"][w]["moves"] == churn(prev, now, best_matching(prev, now))["moves"]
    # a re-plan's moves are the symmetric differences of each GPU index's adapters
    for w in range(1, 4):
        prev, now = plans[f"replan/window{w - 1}"], plans[f"replan/window{w}"]
        n = max(len(prev.gpus), len(now.gpus))
        sets = [(set(prev.gpus[g].adapters) if g < len(prev.gpus) else set(),
                 set(now.gpus[g].adapters) if g < len(now.gpus) else set()) for g in range(n)]
        assert entry["policies"]["replan"]["per_window"][w]["moves"] == sum(len(a ^ b) for a, b in sets)


def test_same_seed_same_report(tmp_path, trace_file, toy_run) -> None:
    sc, entry = toy_run
    again = run_drift(sc, DriftRun(overrides=_toy, keep_plans=True))
    assert json.dumps(_untimed(again), sort_keys=True) == json.dumps(_untimed(entry), sort_keys=True)
    md = drift_markdown(entry)
    assert "| `replan:2` |" in md and "GPU-windows" in md


def test_acceptance_rule() -> None:
    def p(kind, gw, moves, unclean):
        return {"kind": kind, "gpu_windows": gw, "moves": moves, "unclean_windows": unclean}

    acc = drift_acceptance({"scratch": p("scratch", 100, 50, 1), "replan:8": p("replan", 105, 10, 1),
                            "replan:1": p("replan", 106, 2, 0), "replan": p("replan", 100, 11, 2)})
    by = acc["by_policy"]
    assert by["replan:8"]["met"] and not by["replan:1"]["gpu_windows_met"]
    assert not by["replan"]["moves_met"] and not by["replan"]["unclean_met"]
    assert drift_acceptance({"peak": p("peak", 3, 0, 0)}) == {}


def test_run_drift_validates_its_inputs(toy_run) -> None:
    sc, _ = toy_run
    from dataclasses import replace

    with pytest.raises(SpecError, match="drift scenario"):
        run_drift(replace(sc, drift=None))
    with pytest.raises(SpecError, match="DriftRun"):
        run_drift(sc, {"workers": 1})  # type: ignore[arg-type]
    with pytest.raises(SpecError):
        DriftRun(workers=-1)


# ---------------------------------------------------------------------------------------------------------
# outputs and the CLI


def test_figure_and_outputs(tmp_path, toy_run) -> None:
    from lorapack.evaluate.report import contract_json, write_outputs

    sc, entry = toy_run
    png = plot_drift(entry, tmp_path / "f" / "drift.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    doc = {"format": 2, "scenarios": [], "max_pack": [], "skipped": [], "wall_s": 1.0, "drift": [entry]}
    files = write_outputs(doc, tmp_path / "out")
    report = Path(files["report"]).read_text()
    name = entry["name"]
    assert name == "toy-r8-16-n12-x1"
    assert "## Evaluation over time (drift)" in report and f"figures/drift-{name}.png" in report
    assert (tmp_path / "out" / "figures" / f"drift-{name}.png").is_file()
    plan = json.loads((tmp_path / "out" / "plans" / name / "replan_2-window3.json").read_text())
    assert plan["settings"]["previous"] == "replan_2-window2.json"  # named as written beside it
    assert "plans" not in json.loads((tmp_path / "out" / "results.json").read_text())["drift"][0]
    payload = contract_json(doc)
    assert payload["drift"][0]["policies"]["scratch"]["gpu_windows"] == entry["policies"]["scratch"]["gpu_windows"]


def test_cli_errors_exit_2(tmp_path, trace_file, monkeypatch, capsys) -> None:
    from data_helpers import run_main

    good = _file(tmp_path, trace_file, "  windows: 2\n  window_s: 60\n")
    bad = _file(tmp_path, trace_file, "  policies: [hold]\n", name="bad.yaml")
    out = tmp_path / "never"
    for args, match in (((bad, "--out", out), "bad.yaml:"),
                        ((good, "--methods", "proposed,dlora", "--out", out), "one method")):
        code, _, stderr = run_main(monkeypatch, capsys, "evaluate", *map(str, args))
        assert code == 2 and match in stderr and "Traceback" not in stderr
        assert len(stderr.strip().splitlines()) == 1
        assert not out.exists()


def _drift_doc_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("drift_doc", Path(__file__).parent.parent / "scripts" / "drift_doc.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_drift_doc_script_fills_the_marked_section(tmp_path, toy_run, capsys) -> None:
    """``scripts/drift_doc.py`` (the second half of ``make drift``): the tables and figure between the markers,
    the text around them kept, the slim results beside the figures; one-line errors and nothing written."""
    mod = _drift_doc_module()
    _, entry = toy_run
    res = tmp_path / "res"
    res.mkdir()
    (res / "results.json").write_text(json.dumps({"format": 2, "scenarios": [], "wall_s": 125.0, "drift": [entry]}))
    doc = tmp_path / "docs" / "replan.md"
    doc.parent.mkdir()
    doc.write_text(f"# before\n\n{mod.BEGIN}\nold text\n{mod.END}\n\nafter\n")
    figs = tmp_path / "docs" / "replan"
    assert mod.main([str(res), "--doc", str(doc), "--figures", str(figs)]) == 0
    text = doc.read_text()
    name = entry["name"]
    assert text.startswith("# before\n") and text.endswith("\n\nafter\n") and "old text" not in text
    assert "1 drift scenarios, 2 min 5 s wall" in text and f"### {name} (drift)" in text
    assert f"![drift-{name}](replan/drift-{name}.png)" in text
    assert "| `replan:2` |" in text and (figs / f"drift-{name}.png").is_file()
    slim = json.loads((figs / "drift.json").read_text())
    assert "plans" not in slim["drift"][0] and slim["drift"][0]["policies"].keys() == entry["policies"].keys()
    # errors: one line, exit 2, the doc untouched
    before = doc.read_text()
    (res / "results.json").write_text(json.dumps({"format": 2, "scenarios": []}))
    assert mod.main([str(res), "--doc", str(doc), "--figures", str(figs)]) == 2
    assert mod.main([str(tmp_path / "nowhere"), "--doc", str(doc)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "no drift scenarios" in err[0] and "not found" in err[1]
    assert doc.read_text() == before
