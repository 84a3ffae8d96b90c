"""Calibration: fit profile constants from a profiling data directory (docs/calibration.md).

The data directory (laid out like ``../shared/data``) is never shipped with lorapack; it is located with
``default_data_dir()``: the ``LORAPACK_DATA`` environment variable, else ``<repo>/../shared/data``.
"""

from __future__ import annotations

import os
from pathlib import Path

DATA_ENV_VAR = "LORAPACK_DATA"


def _repo_root() -> Path:
    """Root of a source checkout (src layout), else the current directory."""
    here = Path(__file__).resolve()
    for parent in here.parents:
        if (parent / "pyproject.toml").is_file() and (parent / "src" / "lorapack").is_dir():
            return parent
    return Path.cwd()


def default_data_dir() -> Path:
    """Where the calibration data is expected: ``$LORAPACK_DATA`` or ``<repo>/../shared/data``.

    The path is returned even when it does not exist; use ``data_dir_available`` to check.
    """
    env = os.environ.get(DATA_ENV_VAR)
    if env:
        return Path(env).expanduser()
    return (_repo_root().parent / "shared" / "data").resolve()


def data_dir_available(path: str | Path | None = None) -> bool:
    """True when ``path`` (default: ``default_data_dir()``) looks like a data directory."""
    p = default_data_dir() if path is None else Path(path)
    return (p / "profiling").is_dir()


def __getattr__(name: str) -> object:
    # ``fit_priors`` on first use: priors imports scipy.optimize, which every CLI command would pay for
    # (``lorapack.cli`` reaches this package for the calibrate command's defaults)
    if name == "fit_priors":
        from .priors import fit_priors

        return fit_priors
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["DATA_ENV_VAR", "data_dir_available", "default_data_dir", "fit_priors"]
