"""Shared pytest fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from lorapack.calibrate import DATA_ENV_VAR, data_dir_available, default_data_dir

# No test may depend on the machine being idle: hypothesis' per-example deadline (200 ms) and its "too slow"
# health checks are wall-clock rules, so they are off for every test (a test's own settings still apply).
settings.register_profile("lorapack", deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("lorapack")


@pytest.fixture(scope="session")
def data_dir() -> Path:
    """The calibration data directory (``$LORAPACK_DATA`` or ``<repo>/../shared/data``); skips when absent."""
    d = default_data_dir()
    if not data_dir_available(d):
        pytest.skip(f"calibration data not found at {d} (set {DATA_ENV_VAR} to the shared data directory)")
    return d


@pytest.fixture(scope="session")
def calibration(data_dir: Path) -> Path:
    """The real runs of ``real-runs/calibration.csv`` (skips when absent)."""
    p = data_dir / "real-runs" / "calibration.csv"
    if not p.is_file():
        pytest.skip(f"{p} not found")
    return p


@pytest.fixture(scope="session")
def calibration_sim(calibration: Path):
    """``realruns.simulate_run``, memoized for the session and pre-filled with every simulable run of
    ``real-runs/calibration.csv`` (seed 0, the default lengths, the shipped profile of its model), simulated
    once on all cores. The slow tests that re-score the whole file (test_validate, test_fidelity_guard,
    test_twin_trust) share it instead of simulating the file three times; ``run_validation`` still does all
    of its own reading, checking and scoring (patch ``lorapack.validate.simulate_run`` with it and pass
    ``workers=1``: the in-process path calls the patched name).

    A call is answered from the memo only when its profile, row and every other argument equal those of the
    memoized simulation (the simulations are deterministic); any other call simulates."""
    from lorapack.executor import Executor
    from lorapack.profile import available_profiles, find_profile
    from lorapack.realruns import read_runs, simulate_run, startup_prediction

    memo: dict[tuple, object] = {}

    def key(profile, row: dict, seed: int = 0, lengths: str = "lognormal", cv=None, client_cap=None,
            limits=None) -> tuple:
        return (profile.model_dump_json(), tuple(sorted(row.items())), seed, lengths, cv, client_cap,
                None if limits is None else repr(limits))

    def sim(*args, **kwargs):
        k = key(*args, **kwargs)
        if k not in memo:
            memo[k] = simulate_run(*args, **kwargs)
        return memo[k]

    shipped = {m for g, m, _ in available_profiles() if g == "h100-64gb"}
    profiles = {m: find_profile(m) for m in shipped}
    jobs = [(profiles[r["model"]], r, 0) for r in read_runs(calibration)
            if r["model"] in profiles and startup_prediction(profiles[r["model"]], r) is None
            and r["rate_counts"].strip() and r["rank_counts"].strip()]
    with Executor(0) as ex:
        for i, out in ex.imap(simulate_run, jobs):
            memo[key(*jobs[i])] = out
    return sim
