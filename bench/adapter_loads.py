"""Adapter activations: the twin against the real scheduler-overhead runs, for both LRU policies.

The profiling file ``scheduler_overhead_adapter_rates.csv`` (600 s real runs, rank 8, every adapter at the same
rate; the served model is not recorded) counts the CPU -> GPU activations after start-up
(``max_lora_loads_from_memory_corrected``). For a seeded sample of its runs with fewer slots than adapters, this
bench rebuilds each run on the Llama profile (Poisson arrivals, the profile's length law, ``--max-lora-rank 8``)
and counts the twin's activations with vLLM's adapter walk (``EngineConfig.lru_protects_batch = False``, the
default: evictions may hit an adapter of the current batch not walked yet, which is then loaded again) and with
the batch-protecting policy (``lru_protects_batch``, docs/engine-semantics.md). It prints real / twin ratios per run and their median per policy,
and writes ``bench/results/adapter_loads.json``.

Usage: ``python bench/adapter_loads.py [--runs 30] [--seed 0]``
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import time
from pathlib import Path

import numpy as np

from lorapack.calibrate import default_data_dir
from lorapack.profile import find_profile
from lorapack.server import ServerConfig
from lorapack.spec import Adapter, LengthsSpec, Workload
from lorapack.twin.engine import simulate_fast
from lorapack.twin.run import engine_config, resolve_server
from lorapack.workload import generate_requests

RESULTS = Path(__file__).parent / "results" / "adapter_loads.json"


def twin_loads(prof, a: int, n: int, rate: float, protect: bool, seed: int = 0) -> int:
    cv = prof.runs_lengths.cv if prof.runs_lengths is not None else 1.1
    wl = Workload(adapters=[Adapter(adapter_id=f"a{i}", rank=8, rate_rps=rate) for i in range(n)],
                  lengths=LengthsSpec(kind="lognormal", mean_input_tokens=223, mean_output_tokens=197, cv=cv))
    req = generate_requests(wl, 600.0, seed)
    ranks = np.full(n, 8)
    srv = resolve_server(prof, ranks, ServerConfig(max_loras=a, max_lora_rank=8))
    cfg = engine_config(prof, ranks, srv, 600.0)
    cfg.lru_protects_batch = protect
    return simulate_fast(cfg, req).n_gpu_loads


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    path = default_data_dir() / "profiling" / "scheduler_overhead_adapter_rates.csv"
    rows = [r for r in csv.DictReader(path.open()) if r["max_lora_loads_from_memory_corrected"]
            and 8 <= int(r["gpu_loras"]) < int(r["cpu_loras"]) <= 256]
    rng = np.random.default_rng(args.seed)
    sample = [rows[i] for i in sorted(rng.choice(len(rows), min(args.runs, len(rows)), replace=False))]
    prof = find_profile("llama-3.1-8b-instruct")
    out = []
    print(f"{'A':>4} {'N':>4} {'rate':>6} {'real':>6} {'vllm walk':>10} {'protected':>10}")
    for r in sample:
        a, n, rate = int(r["gpu_loras"]), int(r["cpu_loras"]), float(r["adapter_rates"])
        real = float(r["max_lora_loads_from_memory_corrected"])
        walk, prot = twin_loads(prof, a, n, rate, False), twin_loads(prof, a, n, rate, True)
        out.append({"max_loras": a, "n_adapters": n, "rate_rps": rate, "real_loads": real,
                    "twin_loads_vllm_walk": walk, "twin_loads_protected": prot})
        print(f"{a:4d} {n:4d} {rate:6.3f} {real:6.0f} {walk:10d} {prot:10d}")
    med = {k: statistics.median(o["real_loads"] / max(o[k], 1) for o in out if o["real_loads"] >= 50)
           for k in ("twin_loads_vllm_walk", "twin_loads_protected")}
    print(f"median real / twin activations (runs with >= 50 real ones): vLLM walk {med['twin_loads_vllm_walk']:.2f}, "
          f"protected batch {med['twin_loads_protected']:.2f}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "median_real_over_twin": med, "runs": out},
                                  indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
