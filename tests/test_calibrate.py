"""``lorapack calibrate`` (issue 3): priors-only profile, refinement smoke test, report, bad input -> exit 2.

Data-dependent tests use the ``data_dir`` fixture (skips without ``../shared/data``) and never copy the data:
bad inputs are built in a scratch directory of symlinks with one rewritten file.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from data_helpers import mirror_data_dir, rewrite_csv, run_main
from lorapack.calibrate.command import CalibrateOptions, RefinementOptions, calibrate
from lorapack.calibrate.priors import CALIBRATION_CSV
from lorapack.cli import app
from lorapack.profile import find_profile, load_profile_file
from lorapack.realruns import RunPrediction, score_runs
from lorapack.server import ServerConfig
from lorapack.twin.run import step_model
from lorapack.twin.steptime import StepModel, compute_ms

LLAMA = "llama-3.1-8b-instruct"
runner = CliRunner()


@pytest.fixture(autouse=True)
def _no_debug_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LORAPACK_DEBUG", raising=False)


# ---- the step-time form (no data needed) ---------------------------------------------------------------


def test_lora_term_splits_decode_and_prefill_tokens() -> None:
    sm = StepModel(c0_ms=10.0, c1_ms_per_req=0.1, p1_ms_per_prefill_token=0.02, e0_ms=3.0, e1_ms_per_token=0.01,
                   e1p_ms_per_prefill_token=0.002, e2_ms_per_adapter=0.5, e3_ms_per_kreq_adapter=2.0, rank_scale=2.0)
    coef = sm.to_array()
    b, n_pf, n_tok, lv = 101, 500, 600, 7  # 100 decodes + one 500-token chunk
    base = 10.0 + 0.1 * b + 0.02 * n_pf
    lora = 3.0 + 2.0 * (0.01 * 100 + 0.002 * 500 + 0.5 * lv + 2.0 * b * lv / 1000)
    assert compute_ms(coef, b, n_pf, n_tok, 0.0, lv) == pytest.approx(base + lora)
    assert compute_ms(coef, b, n_pf, n_tok, 0.0, 0) == pytest.approx(base)  # no adapter in the batch
    # e1p defaults to e1: the original form e1 * n_tok
    old = StepModel(c0_ms=10.0, c1_ms_per_req=0.1, e1_ms_per_token=0.01).to_array()
    assert compute_ms(old, b, n_pf, n_tok, 0.0, 1) == pytest.approx(10.0 + 0.1 * b + 0.01 * n_tok)


def test_slot_grid_term_folds_into_per_token_costs() -> None:
    p = find_profile(LLAMA)
    st = p.steptime.model_copy(update={"e1_ms_per_token": 0.01, "e1p_ms_per_prefill_token": 0.003,
                                       "e4_ms_per_ktok_slot": 0.2, "gamma": 1.0, "gamma_token": None,
                                       "gamma_adapter": None})
    p = p.model_copy(update={"steptime": st})
    srv = ServerConfig(max_loras=100, max_lora_rank=16, max_cpu_loras=200, max_num_batched_tokens=2048,
                       max_num_seqs=2048, max_model_len=p.max_model_len)
    sm = step_model(p, srv)
    assert sm.e1_ms_per_token == pytest.approx(0.01 + 0.2 * 100 / 1000)
    assert sm.e1p_ms_per_prefill_token == pytest.approx(0.003 + 0.2 * 100 / 1000)
    assert sm.rank_scale == pytest.approx(2.0)  # (16 / 8) ** 1


def test_score_runs_confusion_and_conventions() -> None:
    rows = [{"status": "ok", "throughput_tok_s": "100", "itl_mean_ms": "20", "ttft_mean_ms": "50", "starved": "0",
             "throughput_ratio": "0.99"},
            {"status": "ok", "throughput_tok_s": "100", "itl_mean_ms": "20", "ttft_mean_ms": "50", "starved": "1",
             "throughput_ratio": "0.90"},
            {"status": "oom"}]
    preds = [RunPrediction(oom=False, throughput_tok_s=110.0, itl_mean_ms=20.0, ttft_mean_ms=50.0, starved=False),
             RunPrediction(oom=False, throughput_tok_s=100.0, itl_mean_ms=20.0, ttft_mean_ms=50.0, starved=False),
             RunPrediction(oom=True)]
    s = score_runs(rows, preds)
    assert s["smape_throughput"] == pytest.approx(100 * 0.5 * 10 / 210)
    assert s["smape_throughput_2x"] == pytest.approx(2 * s["smape_throughput"])
    assert s["starved_agreement"] == 0.5 and s["starved_agreement_clear"] == 1.0  # the miss is a noisy label
    assert s["starvation_confusion"]["real_starved_pred_healthy"] == 1
    assert s["oom_agreement"] == 1.0 and s["oom_false_accept"] == 0


def _close(a, b, rel: float = 1e-9) -> bool:
    """Nested dicts/lists equal, floats within ``rel``."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_close(a[k], b[k], rel) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(_close(x, y, rel) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and isinstance(b, float):
        return a == pytest.approx(b, rel=rel)
    return a == b


# ---- shipped profiles ------------------------------------------------------------------------------------


@pytest.mark.parametrize("model", [LLAMA, "qwen-2.5-7b-instruct"])
def test_shipped_profile_is_refined_with_provenance(model: str) -> None:
    p = find_profile(model)
    assert p.priors is not None and p.runs_lengths is not None
    prov = p.provenance
    assert {"inputs", "fits", "date", "lorapack_version", "refinement", "validation"} <= set(prov)
    assert all(len(h) == 64 for h in prov["inputs"].values())
    for name in ("memory", "decode", "lora_additive", "scheduler"):
        assert prov["fits"][name]["n_points"] > 0 and math.isfinite(prov["fits"][name]["r2"])
    v = prov["validation"]["refined"]
    # issue 3 acceptance, as recorded when the profile was fitted (bench/fidelity.py re-measures them)
    assert v["smape_throughput"] <= 3.0 and v["smape_itl"] <= 7.0
    assert v["starved_agreement"] >= 0.95 and v["starved_agreement_clear"] >= 0.98
    assert v["oom_agreement"] == 1.0 and v["oom_false_accept"] == 0
    # the refinement only moves the free step-time constants
    for f in ("c0_ms", "c1_ms_per_req", "p1_ms_per_prefill_token", "k0_pct", "k1_pct_per_adapter"):
        assert getattr(p.steptime, f) == getattr(p.priors.steptime, f)


# ---- the command on the real profiling data -------------------------------------------------------------


def test_calibrate_priors_only_writes_valid_profile(data_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "p.yaml"
    res = runner.invoke(app, ["calibrate", "--profiling", str(data_dir / "profiling"), "--model", LLAMA,
                              "--out", str(out), "--json"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    assert summary["profile"] == str(out) and "refinement" not in summary
    p = load_profile_file(out)
    assert p.model == LLAMA and p.priors is not None and p.priors.steptime == p.steptime
    assert p.runs_lengths is None
    prov = p.provenance
    assert set(prov["inputs"]) == {f"profiling/{n}.csv" for n in (
        "memory_kv_capacity", "latency_default", "latency_lora_overhead", "loading_summary", "loading_events",
        "scheduler_overhead_aggregated_rate", "scheduler_overhead_adapter_rates")}
    assert all(len(h) == 64 for h in prov["inputs"].values())
    assert summary["fits"]["memory"]["n_points"] == 28 and summary["fits"]["memory"]["r2"] > 0.999
    # the same start-up behaviour as the shipped profile (memory is never refined)
    # (to 1e-9 relative: the last digit of a least-squares fit moves with the numpy/BLAS build)
    shipped = find_profile(LLAMA)
    for section in ("memory", "scheduler", "loading"):
        assert _close(getattr(p, section).model_dump(), getattr(shipped, section).model_dump()), section
    assert not list(tmp_path.glob("*.tmp"))


def test_calibrate_report_plots(data_dir: Path, tmp_path: Path) -> None:
    rep = tmp_path / "report"
    s = calibrate(data_dir / "profiling", out=tmp_path / "p.yaml", options=CalibrateOptions(model=LLAMA), report=rep)
    names = set(s["report"])
    assert {"memory.png", "decode_step.png", "prefill.png", "lora_overhead.png", "loading.png",
            "scheduler.png"} <= names
    for n in names:
        assert (rep / n).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_calibrate_refinement_smoke(data_dir: Path, tmp_path: Path) -> None:
    """A tiny refinement (a few light runs, one constant, one iteration per stage) end to end."""
    with (data_dir / CALIBRATION_CSV).open(newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["model"] == LLAMA]
    light = [r for r in rows if r["status"] == "ok" and r["run_id"].endswith(("___8_8_16_", "___16_16_16_"))]
    oom = [r for r in rows if r["status"] == "oom"][:2]
    runs = tmp_path / "runs.csv"
    with runs.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(light + oom)
    assert len(light) >= 3
    out = tmp_path / "refined.yaml"
    refinement = RefinementOptions(max_evals=(0, 2), free=("e0", "cv"), workers=1)
    s = calibrate(data_dir / "profiling", runs, out, CalibrateOptions(model=LLAMA, refinement=refinement))
    p = load_profile_file(out)
    ref = p.provenance["refinement"]
    assert set(ref["free"]) == {"e0", "cv"} and p.runs_lengths is not None
    assert p.steptime.e0_ms == pytest.approx(ref["free"]["e0"]["refined"])
    val = p.provenance["validation"]
    assert val["refined"]["n_runs"] == len(light) + len(oom) and val["refined"]["oom_agreement"] == 1.0
    assert val["runs_sha256"] == s["validation"]["runs_sha256"]
    # the refinement keeps the best point it saw: its objective never gets worse than at the start
    (stage,) = ref["stages"]
    assert stage["runs"] == len(light) and stage["cost_end"] <= stage["cost_start"]
    assert np.isfinite(val["refined"]["smape_throughput"]) and np.isfinite(val["refined"]["smape_itl"])
    assert stage["iterations"] >= 1 and isinstance(stage["converged"], bool) and stage["status"]
    assert ref["refined"] is True and "frontend" in ref and p.frontend is not None
    assert p.frontend.ttft_overhead_ms == pytest.approx(ref["frontend"]["ttft_overhead_ms"])
    assert val["guard"]["n_runs"] >= 1 and "smape_throughput" in val["guard"]["scores"]


def _light_runs_csv(data_dir: Path, tmp_path: Path) -> Path:
    """The light Llama runs (A = N = 8 and 16) of the calibration CSV as their own runs file."""
    with (data_dir / CALIBRATION_CSV).open(newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["model"] == LLAMA]
    light = [r for r in rows if r["status"] == "ok" and r["run_id"].endswith(("___8_8_16_", "___16_16_16_"))]
    runs = tmp_path / "runs.csv"
    with runs.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(light)
    return runs


def test_calibrate_says_when_nothing_was_refined(data_dir: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    """``--max-evals 0,0`` writes the starting constants: the profile and the output say they are not refined."""
    runs = _light_runs_csv(data_dir, tmp_path)
    out = tmp_path / "p.yaml"
    code, _out, err = run_main(monkeypatch, capsys, "calibrate", "--profiling", str(data_dir / "profiling"), "-m",
                               LLAMA, "--runs", str(runs), "--out", str(out), "--max-evals", "0,0", "--workers", "1")
    assert code == 0, err
    assert "changed no constant" in err
    ref = load_profile_file(out).provenance["refinement"]
    assert ref["refined"] is False and ref["stages"] == []


# ---- bad input: one line, exit 2, no profile written -----------------------------------------------------


def _drop_col(col: str):
    return lambda rows: (rows, [c for c in rows[0] if c != col])


def _keep_decode_rows(n: int):
    def edit(rows):
        kept, seen = [], 0
        for r in rows:
            if r["model"] == LLAMA and r["phase"] == "decode":
                seen += 1
                if seen > n:
                    continue
            kept.append(r)
        return kept, list(rows[0])
    return edit


def _blank(col: str, pred):
    def edit(rows):
        for r in rows:
            if pred(r):
                r[col] = "nan"
        return rows, list(rows[0])
    return edit


@pytest.mark.parametrize("fname, edit, message", [
    ("memory_kv_capacity.csv", _drop_col("kv_cache_tokens"), "missing required column"),
    ("latency_default.csv", _keep_decode_rows(2), "need at least 3"),
    ("latency_default.csv", _blank("mean_itl_ms", lambda r: r["model"] == LLAMA and r["phase"] == "decode"),
     "empty or NaN"),
    ("loading_summary.csv", _drop_col("memory_load_ms_mean_after_init"), "missing required column"),
], ids=["missing-column", "too-few-points", "nan-values", "missing-loading-column"])
def test_bad_profiling_input(data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                             capsys: pytest.CaptureFixture, fname: str, edit, message: str) -> None:
    prof_dir = mirror_data_dir(data_dir / "profiling", tmp_path / "profiling")
    rewrite_csv(prof_dir / fname, edit)
    out = tmp_path / "out" / "p.yaml"
    out.parent.mkdir()
    code, stdout, stderr = run_main(monkeypatch, capsys, "calibrate", "--profiling", prof_dir, "--model", LLAMA,
                                    "--out", out)
    assert code == 2
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and fname in lines[0], stderr
    assert not list(out.parent.iterdir())  # no profile, no temporary file


def test_bad_runs_input(data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                        capsys: pytest.CaptureFixture) -> None:
    runs = tmp_path / "runs.csv"
    runs.symlink_to(data_dir / CALIBRATION_CSV)
    rewrite_csv(runs, _drop_col("itl_mean_ms"))
    out = tmp_path / "out" / "p.yaml"
    out.parent.mkdir()
    code, _, stderr = run_main(monkeypatch, capsys, "calibrate", "--profiling", data_dir / "profiling",
                               "--model", LLAMA, "--runs", runs, "--out", out)
    assert code == 2 and len(stderr.strip().splitlines()) == 1 and "itl_mean_ms" in stderr
    assert not list(out.parent.iterdir())

    runs.unlink()
    runs.symlink_to(data_dir / CALIBRATION_CSV)
    rewrite_csv(runs, _blank("throughput_tok_s", lambda r: r["model"] == LLAMA and r["status"] == "ok"))
    code, _, stderr = run_main(monkeypatch, capsys, "calibrate", "--profiling", data_dir / "profiling",
                               "--model", LLAMA, "--runs", runs, "--out", out)
    assert code == 2 and "throughput_tok_s" in stderr and "NaN" in stderr
    assert not list(out.parent.iterdir())


def test_missing_profiling_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "p.yaml"
    code, _, stderr = run_main(monkeypatch, capsys, "calibrate", "--profiling", tmp_path / "nowhere",
                               "--model", LLAMA, "--out", out)
    assert code == 2 and "profiling directory not found" in stderr and not out.exists()


# ---- residual weights of the refinement (no data needed) -------------------------------------------------


def _weight_rows() -> tuple[list[dict], list[RunPrediction]]:
    rows, preds = [], []
    for g, n in (("grp_a", 3), ("grp_b", 2)):
        for i in range(n):
            rows.append({"run_id": f"x__{LLAMA}__{g}___{i}_{i}_16_", "model": LLAMA, "status": "ok",
                         "throughput_tok_s": "1000", "itl_mean_ms": "20"})
            preds.append(RunPrediction(oom=False, throughput_tok_s=1000 * math.exp(0.01 * (i + 1)),
                                       itl_mean_ms=20 * math.exp(-0.02 * (i + 1))))
    return rows, preds


def test_data_residuals_weights() -> None:
    """``itl_weight`` scales the ITL residuals, ``group_weight`` the per-group throughput bias (0 = none);
    the defaults are the weights the shipped profiles were fitted with."""
    from lorapack.calibrate.refine import GROUP_BIAS_WEIGHT, RESIDUAL_SCALE, data_residuals

    rows, preds = _weight_rows()
    base = data_residuals(rows, preds)
    assert len(base) == 2 * len(rows) + 2  # two groups
    assert np.allclose(base, data_residuals(rows, preds, itl_weight=1.0, group_weight=GROUP_BIAS_WEIGHT))
    heavy = data_residuals(rows, preds, itl_weight=3.0, group_weight=2 * GROUP_BIAS_WEIGHT)
    n = 2 * len(rows)
    assert np.allclose(heavy[0:n:2], base[0:n:2])  # throughput residuals unchanged
    assert np.allclose(heavy[1:n:2], 3.0 * base[1:n:2])
    assert np.allclose(heavy[n:], 2.0 * base[n:])
    # group a: 3 runs, mean log error 0.02 -> GROUP_BIAS_WEIGHT * sqrt(3) * 0.02 / RESIDUAL_SCALE
    assert base[n] == pytest.approx(GROUP_BIAS_WEIGHT * math.sqrt(3) * 0.02 / RESIDUAL_SCALE)
    assert len(data_residuals(rows, preds, group_weight=0.0)) == n


def test_data_residuals_queueing_ttft() -> None:
    """``ttft_weight`` adds the log mean-TTFT error of the runs whose *real* TTFT is in QUEUEING_TTFT_MS (so the
    vector's length does not depend on the candidate), weighted; a candidate without a TTFT gets the penalty."""
    from lorapack.calibrate.refine import QUEUEING_TTFT_MS, RESIDUAL_SCALE, data_residuals

    rows, preds = _weight_rows()
    real_ttft = [50.0, QUEUEING_TTFT_MS[0], 4_000.0, QUEUEING_TTFT_MS[1], 90_000.0]  # 2 queueing runs
    for r, t in zip(rows, real_ttft, strict=True):
        r["ttft_mean_ms"] = str(t)
    preds = [dataclasses.replace(p, ttft_mean_ms=t * 0.5) for p, t in zip(preds, real_ttft, strict=True)]
    base = data_residuals(rows, preds)
    assert len(data_residuals(rows, preds, ttft_weight=0.0)) == len(base)
    with_ttft = data_residuals(rows, preds, ttft_weight=0.25)
    n = 2 * len(rows)
    assert len(with_ttft) == len(base) + 2
    # the TTFT residual follows its run's two residuals
    assert with_ttft[4] == pytest.approx(0.25 * math.log(0.5) / RESIDUAL_SCALE)
    assert with_ttft[7] == pytest.approx(0.25 * math.log(0.5) / RESIDUAL_SCALE)
    assert np.allclose(np.delete(with_ttft, [4, 7])[:n], base[:n])
    preds[1] = dataclasses.replace(preds[1], ttft_mean_ms=math.nan)
    assert data_residuals(rows, preds, ttft_weight=0.25)[4] == pytest.approx(0.25 / RESIDUAL_SCALE)


def test_refine_passes_residual_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """``refine`` (and ``calibrate``'s ``--itl-weight`` / ``--group-weight``) reach the residuals."""
    import lorapack.calibrate.refine as rf

    rows, preds = _weight_rows()
    seen: list[tuple[float, float, float]] = []
    real = rf.data_residuals

    def spy(r, p, itl_weight=1.0, group_weight=rf.GROUP_BIAS_WEIGHT, ttft_weight=0.0):
        seen.append((itl_weight, group_weight, ttft_weight))
        return real(r, p, itl_weight, group_weight, ttft_weight)

    monkeypatch.setattr(rf, "data_residuals", spy)
    prof = find_profile(LLAMA)
    for kw, want in (({}, (1.0, rf.GROUP_BIAS_WEIGHT, 0.0)),
                     ({"itl_weight": 2.5, "group_weight": 6.0, "ttft_weight": 0.5}, (2.5, 6.0, 0.5))):
        seen.clear()
        rf.refine({LLAMA: prof}, {LLAMA: prof}, rows, lambda _p: list(preds),
                  rf.FitOptions(free=("e0",), max_nfev=1, **kw))
        assert seen and set(seen) == {want}


@pytest.mark.parametrize("opt, value", [("--itl-weight", "-1"), ("--group-weight", "nan"),
                                        ("--ttft-weight", "-0.5")])
def test_bad_residual_weight(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture,
                             opt: str, value: str) -> None:
    out = tmp_path / "p.yaml"
    code, _, stderr = run_main(monkeypatch, capsys, "calibrate", "--profiling", tmp_path / "nowhere",
                               "--model", LLAMA, "--out", out, opt, value)
    assert code == 2 and opt in stderr and "expected a finite number >= 0" in stderr and not out.exists()


def test_calibrate_fits_the_api_server_loop(data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``RefinementOptions.api_server`` and runs made under a /metrics poller (the research CSV), calibrate
    refines with a loop and then fits it (``calibrate.apiserver``; a shrunken search here: one kappa, three
    points): the profile gets ``api_server`` and the TTFT constant of the best point, the provenance every point."""
    from lorapack.calibrate import apiserver

    monkeypatch.setattr(apiserver, "KAPPA_GRID", (0.1,))
    monkeypatch.setattr(apiserver, "GOLDEN_STEPS", 3)
    runs = _light_runs_csv(data_dir, tmp_path)
    out = tmp_path / "refined.yaml"
    refinement = RefinementOptions(max_evals=(0, 1), free=("e0",), workers=1, api_server=True)
    said: list[str] = []
    calibrate(data_dir / "profiling", runs, out, CalibrateOptions(model=LLAMA, refinement=refinement), log=said.append)
    assert any("API loop kappa 0.100 ms" in s for s in said) and any("TTFT overhead" in s for s in said)
    p = load_profile_file(out)
    front = p.provenance["refinement"]["frontend"]
    assert p.api_server is not None and p.api_server.ms_per_output == 0.1
    assert len(front["tried"]) == 3 and front["best"] == min(front["tried"], key=lambda t: t["cost"])
    assert p.frontend.ttft_overhead_ms == pytest.approx(front["ttft_overhead_ms"])
    assert p.api_server.scrape_us_per_series == pytest.approx(
        apiserver.REGISTRY_FIT.scrape_us_per_series * front["best"]["scale"])
