"""``lorapack validate``: replaying real runs through the twin (docs/calibration.md, scores) and scoring it (``realruns.smape``)."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import numpy as np
import pytest

from lorapack.errors import DataError, LorapackError, ProfileError
from lorapack.profile import available_profiles, find_profile
from lorapack.realruns import build_workload, parse_counts, read_runs, smape
from lorapack.validate import ValidateOptions, run_validation

SUMMARY_KEYS = {"n_ok", "n_oom", "n_skipped", "smape_throughput", "smape_itl", "smape_ttft", "starved_agreement",
                "oom_agreement", "starved_agreement_clear", "smape_throughput_2x", "smape_itl_2x"}
ROW_COLUMNS = ["run_id", "model", "status", "measured_oom", "predicted_oom", "measured_throughput_tok_s",
               "predicted_throughput_tok_s", "measured_itl_ms", "predicted_itl_ms", "measured_ttft_ms",
               "predicted_ttft_ms", "measured_starved", "predicted_starved", "measured_throughput_ratio",
               "predicted_throughput_ratio"]
LLAMA, QWEN = "llama-3.1-8b-instruct", "qwen-2.5-7b-instruct"


def _write_rows(path: Path, fieldnames: list[str], rows: list[dict]) -> Path:
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fieldnames)
        w.writeheader()
        w.writerows(rows)
    return path


def _light(rows: list[dict]) -> list[dict]:
    """The cheapest rows: A = N = 8 at the low rates (~0.05 s per simulated hour)."""
    return [r for r in rows if r["status"] == "ok" and r["run_id"].endswith("___8_8_16_")
            and "rates_0.1_0.05_0.025" in r["run_id"]]


# ---- pure helpers (no data needed) -------------------------------------------------------------------


def test_parse_counts() -> None:
    assert parse_counts("8:64 16:64", int) == [8] * 64 + [16] * 64
    assert parse_counts("8.0:2", int) == [8, 8]
    assert parse_counts("0.025:2 0.1:1", float) == [0.025, 0.025, 0.1]
    assert parse_counts("  ", float) == [] == parse_counts("", int)
    assert all(type(x) is int for x in parse_counts("8:3 32:1", int))


@pytest.mark.parametrize("text, kind", [("8-64", int), ("8:x", int), ("a:3", float), ("8.5:2", int),
                                        ("-1:2", float), ("0.1:-2", float), ("nan:2", float)])
def test_parse_counts_malformed(text: str, kind: type) -> None:
    with pytest.raises(DataError, match="malformed count"):
        parse_counts(text, kind)


def test_smape_both_conventions() -> None:
    y, yhat = np.array([100.0, 50.0]), np.array([110.0, 50.0])
    assert smape(y, yhat) == pytest.approx(100 * (10 / 210) / 2)  # paper: no factor 2, 0-100
    assert smape(y, yhat, 2) == pytest.approx(100 * (20 / 210) / 2)  # usual: 0-200
    assert smape([1.0], [0.0]) == pytest.approx(100.0) and smape([1.0], [0.0], 2) == pytest.approx(200.0)
    assert smape([3.0, 4.0], [3.0, 4.0]) == 0.0


def test_smape_skips_missing_and_zero_pairs() -> None:
    assert smape([100.0, np.nan, 0.0, 5.0], [110.0, 3.0, 0.0, np.nan]) == pytest.approx(100 * 10 / 210)
    assert math.isnan(smape([np.nan], [1.0]))
    assert math.isnan(smape([], []))


def test_read_runs_errors(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="not found"):
        read_runs(tmp_path / "nope.csv")
    p = tmp_path / "bad.csv"
    p.write_text("run_id,model,n_adapters\nx,llama-3.1-8b-instruct,8\n")
    with pytest.raises(DataError, match="missing column.*max_loras"):
        read_runs(p)
    with pytest.raises(DataError, match="missing column"):
        run_validation(p, ValidateOptions(workers=1), progress=False)


def test_run_validation_argument_errors(tmp_path: Path) -> None:
    p = tmp_path / "x.csv"
    p.write_text("")
    with pytest.raises(LorapackError, match="--seeds 0"):
        run_validation(p, ValidateOptions(seeds=0))
    with pytest.raises(LorapackError, match="--lengths"):
        run_validation(p, ValidateOptions(lengths="gamma"))
    with pytest.raises(LorapackError, match="--limit -1"):
        run_validation(p, ValidateOptions(limit=-1))


def _row(**kw) -> dict:
    base = {"run_id": "r", "model": LLAMA, "n_adapters": "8", "max_loras": "8", "max_lora_rank": "16",
            "max_cpu_loras": "8", "rank_counts": "8:4 16:4", "rate_counts": "0.1:8", "status": "ok",
            "window_s": "60", "mean_input_tokens": "200", "mean_output_tokens": "100"}
    return {**base, **kw}


def test_build_workload_from_row() -> None:
    wl = build_workload(_row(), seed=0, lengths="fixed")
    assert wl.n_adapters == 8 and sorted(wl.ranks.tolist()) == [8] * 4 + [16] * 4
    assert wl.duration_s == 60.0 and wl.lengths.mean_input_tokens == 200.0 and wl.lengths.kind == "fixed"
    # the seed shuffles the registration order, deterministically
    orders = {tuple(build_workload(_row(), seed=s).ranks.tolist()) for s in range(6)}
    assert len(orders) > 1
    assert build_workload(_row(), 3).ranks.tolist() == build_workload(_row(), 3).ranks.tolist()
    with pytest.raises(DataError, match="do not add up"):
        build_workload(_row(rank_counts="8:3"), 0)


@pytest.mark.parametrize("bad, match", [
    ({"max_loras": "many"}, "max_loras"),
    ({"max_lora_rank": ""}, "max_lora_rank"),
    ({"n_adapters": "0"}, "n_adapters"),
    ({"rank_counts": "8/4 16/4"}, "malformed count"),
    ({"rate_counts": "0.1:7"}, "do not add up"),
    ({"status": "crashed"}, "status"),
    ({"max_cpu_loras": "4"}, "max-cpu-loras 4"),  # raised in the (worker) simulation, named by run
])
def test_malformed_rows_raise_data_error_naming_the_row(tmp_path: Path, bad: dict, match: str) -> None:
    row = _row(run_id="badrow", **bad)
    p = _write_rows(tmp_path / "runs.csv", list(row), [_row(run_id="fine"), row])
    with pytest.raises(DataError, match=match) as e:
        run_validation(p, ValidateOptions(workers=1), progress=False)
    assert "badrow" in str(e.value) and "\n" not in str(e.value)


def test_unknown_gpu(tmp_path: Path) -> None:
    p = _write_rows(tmp_path / "runs.csv", list(_row()), [_row()])
    with pytest.raises(ProfileError, match="unknown gpu 'a100'"):
        run_validation(p, ValidateOptions(gpu="a100", workers=1), progress=False)


def test_small_synthetic_rows(tmp_path: Path) -> None:
    """Without the real data: an ok row, an oom row scored on the start-up rule, an unprofiled model."""
    rows = [_row(run_id="ok", throughput_tok_s="100", itl_mean_ms="20", ttft_mean_ms="50", starved="0",
                 throughput_ratio="1.0"),
            # llama with A=256, S=16 cannot start: a real oom correctly predicted
            _row(run_id="oom-right", max_loras="256", n_adapters="256", rank_counts="16:256", rate_counts="",
                 status="oom"),
            # A=8 starts: a real oom row that the start-up rule accepts is a disagreement, not a skip
            _row(run_id="oom-wrong", rate_counts="", status="oom"),
            _row(run_id="other", model="mistral-7b")]
    names = list(rows[0])
    p = _write_rows(tmp_path / "runs.csv", names, rows)
    rep = run_validation(p, ValidateOptions(workers=1), progress=False)
    llama = rep["models"][LLAMA]
    assert (llama["n_ok"], llama["n_oom"], llama["n_skipped"]) == (1, 2, 0)
    assert llama["oom_agreement"] == pytest.approx(2 / 3)
    assert (llama["oom_false_accept"], llama["oom_false_reject"]) == (1, 0)
    assert rep["models"]["mistral-7b"] == {**rep["models"]["mistral-7b"], "n_ok": 0, "n_oom": 0, "n_skipped": 1}
    assert rep["rows"]["run_id"] == ["ok", "oom-right", "oom-wrong"]
    assert rep["rows"]["predicted_oom"] == [False, True, False]
    assert math.isfinite(rep["rows"]["predicted_throughput_tok_s"][0])
    assert all(math.isnan(x) for x in rep["rows"]["predicted_throughput_tok_s"][1:])
    assert rep["pooled"] is None  # one model scored: nothing to pool


# ---- against the real calibration runs -----------------------------------------------------------------


def test_oom_agreement_all_rows_startup_rule(calibration: Path) -> None:
    """Every calibration row, both models: the start-up rule predicts exactly the measured oom status."""
    rows = read_runs(calibration)
    profiled = {m for _, m, _ in available_profiles()}
    seen = {LLAMA: 0, QWEN: 0}
    profiles = {m: find_profile(m) for m in seen}
    for r in rows:
        assert r["model"] in profiled
        starts, _kv, err = profiles[r["model"]].startup(int(r["max_loras"]), int(r["max_lora_rank"]))
        assert starts == (r["status"] == "ok"), r["run_id"]
        if not starts:
            assert err == r["error_type"], r["run_id"]
        seen[r["model"]] += 1
    assert seen == {LLAMA: 123, QWEN: 125}


def test_end_to_end_light_rows(calibration: Path, tmp_path: Path) -> None:
    with calibration.open(newline="") as f:
        reader = csv.DictReader(f)
        names, rows = list(reader.fieldnames or []), list(reader)
    light = _light(rows)
    assert {r["model"] for r in light} == {LLAMA, QWEN}
    oom = [r for r in rows if r["status"] == "oom"][:1]
    other = {**light[0], "run_id": "unprofiled", "model": "llama-2-7b"}
    p = _write_rows(tmp_path / "runs.csv", names, light + oom + [other] + light)
    n = len(light) + 2
    rep = run_validation(p, ValidateOptions(workers=1, limit=n), progress=False)  # the trailing copies are cut by limit
    models = rep["models"]
    assert set(models) == {LLAMA, QWEN, "llama-2-7b"}
    for m in (LLAMA, QWEN):
        s = models[m]
        assert SUMMARY_KEYS <= set(s)
        assert s["n_ok"] == sum(r["model"] == m for r in light) and s["n_skipped"] == 0
        assert s["oom_agreement"] == 1.0
        for k in ("smape_throughput", "smape_itl", "smape_ttft"):
            assert 0 <= s[k] <= 100, (m, k)
            assert s[k + "_2x"] == pytest.approx(2 * s[k])
        assert 0 <= s["starved_agreement"] <= 1
    assert models[LLAMA]["n_oom"] == 1 and models[QWEN]["n_oom"] == 0
    assert models["llama-2-7b"]["n_skipped"] == 1 and models["llama-2-7b"]["n_ok"] == 0
    assert list(rep["rows"])[:len(ROW_COLUMNS)] == ROW_COLUMNS  # the contract: columns are added, never renamed
    assert len(rep["rows"]["run_id"]) == n - 1  # every row but the skipped one
    ok = [i for i, st in enumerate(rep["rows"]["status"]) if st == "ok"]
    assert all(math.isfinite(rep["rows"]["predicted_throughput_tok_s"][i]) for i in ok)


@pytest.mark.slow
def test_full_calibration_file(calibration: Path, calibration_sim, monkeypatch) -> None:
    monkeypatch.setattr("lorapack.validate.simulate_run", calibration_sim)  # the session's simulations (conftest)
    rep = run_validation(calibration, ValidateOptions(workers=1), progress=False)
    for m, n_ok, n_oom in ((LLAMA, 102, 21), (QWEN, 125, 0)):
        s = rep["models"][m]
        assert (s["n_ok"], s["n_oom"], s["n_skipped"]) == (n_ok, n_oom, 0)
        assert s["oom_agreement"] == 1.0
        assert all(math.isfinite(s[k]) for k in SUMMARY_KEYS)
    # the pooled scores count every model's runs: each objective's misses add up over the models
    for t, a in rep["pooled"]["ttft_objective_agreement"].items():
        per = [rep["models"][m]["ttft_objective_agreement"][t] for m in (LLAMA, QWEN)]
        assert a["n"] == sum(p["n"] for p in per) and a["optimistic"] == sum(p["optimistic"] for p in per)
        assert a["agreement"] * a["n"] == pytest.approx(sum(p["agreement"] * p["n"] for p in per))
    rows = rep["rows"]
    assert len(rows["run_id"]) == 248
    for i, st in enumerate(rows["status"]):
        if st == "ok":  # every ok row got a prediction
            assert rows["predicted_oom"][i] is False
            assert math.isfinite(rows["predicted_throughput_tok_s"][i]), rows["run_id"][i]
            assert math.isfinite(rows["predicted_itl_ms"][i]) and math.isfinite(rows["predicted_ttft_ms"][i])
            assert rows["predicted_starved"][i] in (True, False)


def test_ttft_by_load_tercile_splits_the_short_runs_by_their_batch() -> None:
    """Issue 27's score: runs with real mean TTFT < 1 s, terciles of the real running batch, median signed error."""
    from lorapack.realruns import ttft_load_terciles

    y = np.array([100.0, 100.0, 100.0, 200.0, 200.0, 200.0, 300.0, 300.0, 300.0, 5000.0])
    yhat = y * np.array([1.1, 1.1, 1.0, 1.0, 0.9, 0.9, 0.5, 0.5, 0.6, 1.0])
    load = np.array([1.0, 2.0, 3.0, 10.0, 11.0, 12.0, 50.0, 60.0, 70.0, 80.0])
    out = ttft_load_terciles(y, yhat, load)
    assert out["n"] == 9  # the 5 s run is not short
    assert [t["n"] for t in out["terciles"]] == [3, 3, 3]
    assert [round(t["bias_median_pct"], 6) for t in out["terciles"]] == [10.0, -10.0, -50.0]
    assert out["terciles"][2]["running_min"] == 50.0
