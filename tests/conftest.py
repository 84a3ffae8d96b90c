"""Shared pytest fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest

from lorapack.calibrate import DATA_ENV_VAR, data_dir_available, default_data_dir


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
