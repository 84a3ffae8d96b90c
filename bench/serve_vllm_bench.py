"""vLLM's own benchmark client against a twin server, read back by ``lorapack validate`` (issue "Serve",
acceptance 3: the twin scores itself within 2 % throughput).

1. ``lorapack serve`` (llama-3.1-8b-instruct's shipped profile, 4 adapters of rank 16, ``--max-loras 4``) with
   the testbed model's tokenizer (``--tokenizer``: prompt lengths counted as the client counts them) under that
   model's name;
2. the testbed's ``vllm bench serve`` (a real client no one here wrote): ``--dataset-name random`` (fixed
   lengths), ``--request-rate`` Poisson over ``--num-prompts``, ``--save-result --save-detailed`` with the
   server's flags in ``--metadata``;
3. ``lorapack validate result.json --lengths fixed --json``: the twin simulates the run the file describes
   (docs/bench-json.md) and scores it.

Prints the benchmark's and validate's figures and writes ``bench/results/serve_vllm_bench.json``. Needs the
testbed (``make testbed``). The rebuild compares the twin's window (``requests / rate``) with the benchmark's
whole duration (sends plus drain): on a run of ``T`` seconds the drain biases the throughput by about one
request's latency / ``T``, so runs of minutes (default 2,400 prompts at 12 req/s: 200 s); and it draws its own
Poisson arrivals, whose count in the window varies by about 1 / sqrt(requests): ``--validate-seeds`` (10)
averages that out.

Usage: ``python bench/serve_vllm_bench.py [--num-prompts 2400] [--request-rate 12]``
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODEL = "llama-3.1-8b-instruct"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-prompts", type=int, default=2400)
    ap.add_argument("--request-rate", type=float, default=12.0)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--validate-seeds", type=int, default=10, help="validate --seeds: the rebuild draws its own "
                    "Poisson arrivals, whose count in the window varies by about 1/sqrt(requests); averaging seeds "
                    "takes that noise out")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "serve_vllm_bench.json")
    a = ap.parse_args()
    from lorapack.serve.launch import twin_process
    from lorapack.testbed.env import BenchServeLoad, client_env, find_testbed

    tb = find_testbed()
    if tb is None:
        sys.exit("the testbed is not installed: make testbed")
    model_dir = str(tb.model_dir)
    names = [f"a{k}" for k in range(4)]
    flags = ["--model", MODEL, "--served-model-name", model_dir, "--tokenizer", model_dir, "--enable-lora",
             "--max-loras", "4", "--max-lora-rank", "16", "--lora-modules", *[f"{n}=/adapters/{n}" for n in names]]
    with twin_process(flags) as url, tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "bench.json"
        load = BenchServeLoad(a.input_len, a.output_len, a.num_prompts, a.request_rate, a.seed)
        cmd = tb.bench_serve_command(url, names, load, result,
                                     {"max_loras": "4", "max_lora_rank": "16", "model": MODEL, "lora_ranks": "16:4"})
        t0 = time.monotonic()
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env=client_env())
        wall = time.monotonic() - t0
        if run.returncode != 0:
            sys.exit(f"vllm bench serve failed (exit {run.returncode}): {(run.stderr or run.stdout)[-1500:]}")
        bench = json.loads(result.read_text())
        val = subprocess.run([sys.executable, "-m", "lorapack.cli", "validate", str(result), "--lengths", "fixed",
                              "--seeds", str(a.validate_seeds), "--workers", "2", "--json"], capture_output=True,
                             text=True, timeout=1200)
        if val.returncode != 0:
            sys.exit(f"lorapack validate failed: {val.stderr[-1500:]}")
        scores = json.loads(val.stdout)["models"][MODEL]
        with urllib.request.urlopen(url + "/version", timeout=10) as r:
            lag = json.loads(r.read())["twin_lag"]
    keep = ("completed", "failed", "duration", "total_token_throughput", "output_throughput", "mean_ttft_ms",
            "median_ttft_ms", "mean_itl_ms", "mean_tpot_ms")
    out = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "load_avg": os.getloadavg()[0]},
           "num_prompts": a.num_prompts, "request_rate": a.request_rate, "input_len": a.input_len,
           "output_len": a.output_len, "validate_seeds": a.validate_seeds, "bench_wall_s": wall,
           "bench": {k: bench.get(k) for k in keep},
           "validate": {k: scores.get(k) for k in ("smape_throughput", "bias_throughput_pct", "smape_ttft",
                                                   "bias_ttft_pct", "smape_itl", "bias_itl_pct",
                                                   "starved_agreement")},
           "twin_lag": lag}
    v = out["validate"]
    print(f"vllm bench serve: {bench['completed']} requests in {bench['duration']:.1f} s, "
          f"{bench['total_token_throughput']:,.0f} tok/s, mean TTFT {bench['mean_ttft_ms']:.1f} ms, mean ITL "
          f"{bench['mean_itl_ms']:.1f} ms; validate: throughput SMAPE {v['smape_throughput']:.2f} % (bias "
          f"{v['bias_throughput_pct']:+.2f} %; target within 2 %), TTFT SMAPE {v['smape_ttft']:.2f} %, ITL SMAPE "
          f"{v['smape_itl']:.2f} %; server lag p99 {1000 * lag['p99_s']:.1f} ms")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
