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
