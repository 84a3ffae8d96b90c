"""Cold start (issue 26, item 5): what a fresh process imports and loads before ``lorapack place`` answers.

* ``import lorapack.cli`` (every command's start) imports no heavy module it does not need to parse a command
  line: no scipy.optimize (it cost ~1 s through ``workload/lengths.py``), scipy.special, sklearn, pandas,
  pyarrow, matplotlib, aiohttp, ray. Checked in fresh interpreters through ``sys.modules``.
* A log-normal workload's length parameters are solved once per machine (``lognormal_lengths.json`` in the
  cache directory): a second process gets them bit for bit without importing scipy.optimize.
* A learned model file is read from an uncompressed copy after its first load; a damaged copy is ignored.
* ``lorapack place --no-verify`` with the learned models never imports numba (its import and set-up cost
  0.5-1 s): the feature code and the tree walk answer in numpy, the engine is imported where a run starts.
* ``plan.json`` reports ``load_ms`` (reading the learned models) apart from ``placement_ms``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HEAVY = ("scipy.optimize", "scipy.special", "scipy.stats", "scipy.linalg", "sklearn", "pandas", "pyarrow",
         "matplotlib", "aiohttp", "ray")
SHIPPED_MODEL = Path(__file__).resolve().parents[1] / "src/lorapack/models/h100-64gb__llama-3.1-8b-instruct/surrogate.npz"


def _fresh(code: str, cache: Path) -> str:
    """Run ``code`` in a fresh interpreter with its own cache directory; its stdout."""
    env = {**os.environ, "LORAPACK_CACHE_DIR": str(cache)}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout


@pytest.mark.parametrize("module", ["lorapack.cli", "lorapack.workload"])
def test_import_pulls_no_heavy_module(module: str, tmp_path: Path) -> None:
    out = _fresh(f"import sys, json, {module}\nprint(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))",
                 tmp_path)
    assert json.loads(out) == []


def test_lognormal_lengths_solved_once_per_machine(tmp_path: Path) -> None:
    code = ("import sys, json\nfrom lorapack.workload.lengths import solve_lognormal_lengths as solve\n"
            "m = solve(311.0, 177.0, 0.9)\n"
            "print(json.dumps([m.mu_in, m.sigma_in, m.mu_out, m.sigma_out, 'scipy.optimize' in sys.modules]))")
    first = json.loads(_fresh(code, tmp_path))
    assert first[-1] is True  # solved here
    assert (tmp_path / "lognormal_lengths.json").is_file()
    second = json.loads(_fresh(code, tmp_path))
    assert second[:4] == first[:4] and second[-1] is False  # the same parameters, bit for bit, no solver


def test_a_damaged_cache_file_is_ignored(tmp_path: Path) -> None:
    (tmp_path / "lognormal_lengths.json").write_text("{not json")
    code = ("from lorapack.workload.lengths import solve_lognormal_lengths as solve\n"
            "print(solve(223.0, 197.0, 0.838944).mu_in)")
    assert float(_fresh(code, tmp_path)) > 0
    assert json.loads((tmp_path / "lognormal_lengths.json").read_text())["solutions"]  # rewritten


@pytest.mark.skipif(not SHIPPED_MODEL.is_file(), reason="no shipped learned model")
def test_model_read_from_its_uncompressed_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import numpy as np

    from lorapack.surrogate.modelfile import load_model

    monkeypatch.setenv("LORAPACK_CACHE_DIR", str(tmp_path))
    first = load_model(SHIPPED_MODEL)
    copies = list((tmp_path / "models").glob("*.npz"))
    assert len(copies) == 1
    second = load_model(SHIPPED_MODEL)  # from the copy (the checksum verified again)
    for t, f in first.targets.items():
        assert np.array_equal(f.threshold, second.targets[t].threshold)
    copies[0].write_bytes(b"damaged")
    third = load_model(SHIPPED_MODEL)  # the file itself, and a fresh copy
    assert sorted(third.targets) == sorted(first.targets)
    assert copies[0].stat().st_size > 1000


@pytest.mark.skipif(not SHIPPED_MODEL.is_file(), reason="no shipped learned model")
def test_plan_reports_load_ms_apart_from_placement_ms(tmp_path: Path, monkeypatch, capsys) -> None:
    import lorapack.surrogate.oracle as learned
    from data_helpers import run_main

    monkeypatch.setattr(learned, "_MODELS", {})  # as in a fresh process: the model is read in this call
    workload = tmp_path / "adapters.csv"
    workload.write_text("adapter_id,rank,rate_rps\n" + "".join(f"a{i},{8 if i % 2 else 16},0.05\n" for i in range(64)))
    code, out, err = run_main(monkeypatch, capsys, "place", workload, "-m", "llama-3.1-8b-instruct", "--no-verify",
                              "--json", "--out", tmp_path / "plan")
    assert code == 0, err
    plan = json.loads(out)
    assert plan["load_ms"] > 0 and plan["placement_ms"] >= 0
    assert json.loads((tmp_path / "plan" / "plan.json").read_text())["load_ms"] == plan["load_ms"]


def test_loading_a_lognormal_workload_twice_needs_no_scipy(tmp_path: Path) -> None:
    """The second process validates the lengths from the cached solution (what ``place --no-verify`` needs)."""
    csv = tmp_path / "adapters.csv"
    csv.write_text("adapter_id,rank,rate_rps\na,8,0.1\nb,16,0.2\n")
    code = (f"import sys, json\nfrom lorapack.workload import load_workload\nw = load_workload({str(csv)!r})\n"
            f"print(json.dumps([w.lengths.kind, [m for m in ('scipy.optimize', 'scipy.special') if m in sys.modules]]))")
    cache = tmp_path / "cache"
    kind, first = json.loads(_fresh(code, cache))
    assert kind == "lognormal" and first  # solved (and cached) here
    assert json.loads(_fresh(code, cache))[1] == []


def test_console_process_exits_without_teardown_but_with_its_output_and_code(tmp_path: Path) -> None:
    """``lorapack`` skips the interpreter's teardown (``cli._exit_now``): stdout still complete, codes kept."""
    csv = tmp_path / "adapters.csv"
    csv.write_text("adapter_id,rank,rate_rps\n" + "".join(f"a{i},8,0.05\n" for i in range(40)))
    cmd = [sys.executable, "-m", "lorapack.cli"]
    ok = subprocess.run([*cmd, "place", str(csv), "-m", "llama-3.1-8b-instruct", "--no-verify", "--json", "--out",
                         str(tmp_path / "plan")], capture_output=True, text=True, timeout=600)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert json.loads(ok.stdout)["gpus_used"] >= 1 and (tmp_path / "plan" / "plan.json").is_file()
    bad = subprocess.run([*cmd, "simulate", str(csv), "-m", "llama-3.1-8b-instruct", "-a", "0"], capture_output=True,
                         text=True, timeout=600)
    assert bad.returncode == 2 and bad.stderr.startswith("error: ") and len(bad.stderr.splitlines()) == 1
    helped = subprocess.run([*cmd, "--help"], capture_output=True, text=True, timeout=600)
    assert helped.returncode == 0 and "place" in helped.stdout


@pytest.mark.skipif(not SHIPPED_MODEL.is_file(), reason="no shipped learned model")
def test_place_without_verification_never_imports_numba(tmp_path: Path, monkeypatch, capsys) -> None:
    """The lower bound's capacities come from the cache (filled in this process first, as any earlier
    placement on the machine does); then a fresh ``lorapack place --no-verify`` answers without numba."""
    from data_helpers import run_main

    workload = tmp_path / "adapters.csv"
    workload.write_text("adapter_id,rank,rate_rps\n" + "".join(f"a{i},{8 if i % 3 else 16},{0.01 + 0.002 * i:.3f}\n"
                                                              for i in range(300)))
    args = ["place", str(workload), "-m", "llama-3.1-8b-instruct", "--no-verify", "--json", "--out"]
    code, out, err = run_main(monkeypatch, capsys, *args, tmp_path / "warm")
    assert code == 0, err
    run = ("import sys, json\nfrom lorapack.cli import app\n"
           f"try:\n    app({[*args, str(tmp_path / 'cold')]!r}, standalone_mode=False)\nexcept SystemExit:\n    pass\n"
           "print(json.dumps(sorted(m for m in ('numba', 'llvmlite', 'lorapack.twin.engine') if m in sys.modules)))")
    p = subprocess.run([sys.executable, "-c", run], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads(p.stdout.strip().splitlines()[-1]) == []
    cold = json.loads((tmp_path / "cold" / "plan.json").read_text())
    warm = json.loads(out)
    assert cold["gpus"] == warm["gpus"], "the numpy answers placed differently from this process's"
