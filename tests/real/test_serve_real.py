"""vLLM's own benchmark client (``vllm bench serve`` from the testbed) against a twin server; its result file,
read back by ``lorapack validate``, scores the twin against itself (the full-length figure, 2,400 prompts:
``bench/serve_vllm_bench.py``; this is the short form: 400 prompts)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lorapack.testbed.env import BenchServeLoad, client_env
from serve_helpers import LLAMA, twin_server

pytestmark = pytest.mark.real


def test_vllm_bench_serve_against_a_twin_server(testbed, tmp_path: Path) -> None:
    model_dir = str(testbed.model_dir)
    names = [f"a{k}" for k in range(4)]
    flags = ("--model", LLAMA, "--served-model-name", model_dir, "--tokenizer", model_dir, "--enable-lora",
             "--max-loras", "4", "--max-lora-rank", "16", "--lora-modules", *[f"{n}=/adapters/{n}" for n in names])
    result = tmp_path / "bench.json"
    with twin_server(*flags, log=tmp_path / "serve.log") as url:
        cmd = testbed.bench_serve_command(
            url, names, BenchServeLoad(input_len=256, output_len=64, num_prompts=400, request_rate=12), result,
            {"max_loras": "4", "max_lora_rank": "16", "model": LLAMA, "lora_ranks": "16:4"})
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=client_env())
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    bench = json.loads(result.read_text())
    assert bench["completed"] == 400 and bench["failed"] == 0
    # the prompt lengths the twin counted (its --tokenizer) are the ones the client sent
    assert abs(bench["total_input_tokens"] / 400 - 256) < 2
    val = subprocess.run([sys.executable, "-m", "lorapack.cli", "validate", str(result), "--lengths", "fixed",
                          "--seeds", "5", "--workers", "1", "--json"], capture_output=True, text=True, timeout=900)
    assert val.returncode == 0, val.stderr
    scores = json.loads(val.stdout)["models"][LLAMA]
    # a 33 s run: the window's drain and the rebuild's own Poisson draw leave a few per cent (docs/bench-json.md)
    assert scores["smape_throughput"] < 5.0, scores
    assert scores["smape_itl"] < 5.0, scores
    assert scores["starved_agreement"] == 1.0
