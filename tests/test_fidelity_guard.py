"""The fidelity guard: the twin must keep scoring on the real runs what its shipped profile recorded.

``lorapack calibrate`` records, in each shipped profile, the validation scores on all of
``real-runs/calibration.csv`` and on a fixed quarter of it (``realruns.guard_subset``). The fast test re-scores
the quarter (about ten seconds); the slow one (CI runs it) the whole file. Either fails when any score is worse
than recorded by more than ``TOLERANCE``: a change to the engine, the estimators or the run rebuild that
costs fidelity cannot land unnoticed. A change that improves the scores passes; ``make profiles`` then
records the new level.

Tolerances (absolute, in the score's own unit): SMAPE of throughput, ITL and TTFT (paper convention,
0-100) may grow by at most 0.3 / 0.3 / 1.0 points, the signed bias of throughput and ITL move away from zero by
at most 0.5 points (percent of real), starvation and OOM agreement drop by at most 0.02. The simulations
are deterministic, so an unchanged twin reproduces the recorded scores exactly; the tolerances only absorb
numerically harmless changes.
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from lorapack.profile import find_profile
from lorapack.realruns import guard_subset, read_runs
from lorapack.validate import ValidateOptions, run_validation

LLAMA, QWEN = "llama-3.1-8b-instruct", "qwen-2.5-7b-instruct"
# score -> (how much worse it may get, "up" if larger is worse / "down" if smaller is worse / "abs")
TOLERANCE = {
    "smape_throughput": (0.3, "up"), "smape_itl": (0.3, "up"), "smape_ttft": (1.0, "up"),
    "bias_throughput_pct": (0.5, "abs"), "bias_itl_pct": (0.5, "abs"),
    "starved_agreement": (0.02, "down"), "oom_agreement": (0.02, "down"),
}


def regressions(recorded: dict, now: dict) -> list[str]:
    """The scores of ``now`` worse than ``recorded`` beyond ``TOLERANCE``."""
    bad = []
    for key, (tol, worse) in TOLERANCE.items():
        r, n = recorded.get(key), now.get(key)
        if r is None or n is None:
            bad.append(f"{key}: recorded {r}, now {n}")
            continue
        delta = {"up": n - r, "down": r - n, "abs": abs(n) - abs(r)}[worse]
        if delta > tol:
            bad.append(f"{key}: {r:.3f} recorded -> {n:.3f} now (worse by {delta:.3f} > {tol})")
    return bad


def _write(rows: list[dict], path: Path) -> Path:
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return path


def _check(model: str, runs: Path, recorded: dict, workers: int = 0) -> None:
    prof = find_profile(model)
    now = run_validation(runs, ValidateOptions(profile=prof, workers=workers), progress=False)["models"][model]
    bad = regressions(recorded, now)
    assert not bad, f"{model}: the twin lost fidelity on {runs.name}:\n  " + "\n  ".join(bad)


@pytest.mark.parametrize("model", [LLAMA, QWEN])
def test_fidelity_on_the_guard_quarter(model, calibration, tmp_path) -> None:
    guard = find_profile(model).provenance["validation"]["guard"]
    rows = [r for r in guard_subset(read_runs(calibration)) if r["model"] == model]
    assert len(rows) == guard["n_runs"]
    _check(model, _write(rows, tmp_path / "guard.csv"), guard["scores"])


@pytest.mark.slow
@pytest.mark.parametrize("model", [LLAMA, QWEN])
def test_fidelity_on_all_calibration_runs(model, calibration, calibration_sim, monkeypatch) -> None:
    monkeypatch.setattr("lorapack.validate.simulate_run", calibration_sim)  # the session's simulations (conftest)
    _check(model, calibration, find_profile(model).provenance["validation"]["refined"], workers=1)


def test_the_guard_catches_a_regression() -> None:
    recorded = {"smape_throughput": 1.2, "smape_itl": 3.0, "smape_ttft": 7.0, "bias_throughput_pct": -0.2,
                "bias_itl_pct": 0.4, "starved_agreement": 0.98, "oom_agreement": 1.0}
    assert regressions(recorded, dict(recorded)) == []
    assert regressions(recorded, {**recorded, "smape_itl": 3.2, "bias_throughput_pct": 0.25}) == []
    worse = {**recorded, "smape_itl": 3.5, "bias_throughput_pct": -0.9, "starved_agreement": 0.95}
    assert [b.split(":")[0] for b in regressions(recorded, worse)] == ["smape_itl", "bias_throughput_pct",
                                                                       "starved_agreement"]
