"""A result file written by the testbed's own ``vllm bench serve`` (vLLM 0.32) is a run ``lorapack validate``
reads (docs/bench-json.md): the format is checked against the real writer, not only against fixtures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lorapack.measure import proof as fd
from lorapack.testbed.env import BenchServeLoad, client_env

pytestmark = pytest.mark.real


def test_vllm_bench_serve_result_is_a_run(testbed, servers, tmp_path: Path) -> None:
    server = servers.get(fd.server_adapters(), fd.SERVER_FLAGS)
    names = [n for n, _, _ in fd.adapter_names()][:4]
    ranks = [r for _, r, _ in fd.adapter_names()][:4]
    result = tmp_path / "bench.json"
    cmd = testbed.bench_serve_command(
        server.url, names, BenchServeLoad(input_len=64, output_len=32, num_prompts=40, request_rate=8), result,
        {"max_loras": "4", "max_lora_rank": "32", "max_cpu_loras": "12", "model": "tiny",
         "lora_ranks": " ".join(f"{r}:{ranks.count(r)}" for r in sorted(set(ranks)))})
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=client_env())
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    data = json.loads(result.read_text())
    assert data["completed"] == 40 and "input_lens" in data and "ttfts" in data
    # a profile of the tiny model (synthetic constants: this checks the reading, not the fit)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from lorapack.measure.fit import fit_measured
    from lorapack.profile import save_profile
    from test_measure import synthetic_measurement

    prof = tmp_path / "tiny.yaml"
    save_profile(fit_measured(synthetic_measurement(tmp_path / "m")), prof)
    val = subprocess.run([sys.executable, "-m", "lorapack.cli", "validate", str(result), "--profile", str(prof),
                          "--lengths", "fixed", "--workers", "1", "--json"], capture_output=True, text=True,
                         timeout=300)
    assert val.returncode == 0, val.stderr
    report = json.loads(val.stdout)
    assert "uniformly at random" in val.stderr or any("uniform" in n for n in report.get("notes", []))
    scores = report["models"]["tiny"]
    assert scores["n_runs"] == 1
