"""Every dependency the CI suite needs is installed: its absence fails here, it never skips tests elsewhere.

The suite runs in the environment ``make setup`` builds: lorapack with the ``test`` and ``ray`` extras. Tests
import numba, hypothesis and ray directly (no ``importorskip``), so a missing one fails them too; this file
names the culprit in one place.
"""

from __future__ import annotations

import re
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
EXTRAS_IN_CI = ("test", "ray")  # what `make setup` installs


def _requirements() -> list[str]:
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in EXTRAS_IN_CI:
        reqs += project["optional-dependencies"][extra]
    return [re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0] for r in reqs]


@pytest.mark.parametrize("name", _requirements())
def test_required_distribution_is_installed(name: str) -> None:
    try:
        metadata.distribution(name)
    except metadata.PackageNotFoundError:
        pytest.fail(f"{name} is not installed; `make setup` installs lorapack[{','.join(EXTRAS_IN_CI)}]")


def test_the_list_covers_the_engine_and_property_test_dependencies() -> None:
    assert {"numba", "hypothesis", "ray"} <= set(_requirements())


def test_ci_has_the_shared_data() -> None:
    """Data is a dependency too: the golden tests against ``../shared/data`` skip (with a reason) where it is
    absent, which is fine on a laptop but would let CI pass without them. In CI (``CI`` set, as ``.ci/run``
    runs) a missing data directory fails here."""
    import os

    from lorapack.calibrate import DATA_ENV_VAR, data_dir_available, default_data_dir

    if os.environ.get("CI", "").lower() in ("", "0", "false"):
        return
    assert data_dir_available(), (f"CI without the shared data: {default_data_dir()} has no profiling/ "
                                  f"(set {DATA_ENV_VAR} or put shared/ beside the clone)")
