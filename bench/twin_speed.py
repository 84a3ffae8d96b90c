"""Twin speed: wall seconds per simulated hour on one core, workload generation included.

Runs a fixed, documented set of one-hour configurations (both models; low and high load; small and large
A_max; starving and healthy) with the compiled engine, and prints per config the wall time, the
simulated/real-time ratio and, for the four configurations the paper's published twin was timed on, the
speed-up. The one-off JIT compile time is reported separately. Results go to
``bench/results/twin_speed.json``.

Targets (issue #2): >= 20x faster than the paper's twin on each timed config; median <= 0.15 s and
max <= 1 s per simulated hour over the whole set.

Every config: Poisson arrivals, fixed lengths 223 prompt / 197 output tokens, ranks and rates assigned to
adapters round-robin in the order listed, seed 0, T = 3600 s, shipped profile, client cap off.

Usage: ``python bench/twin_speed.py [--repeats 3] [--out FILE]``
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

os.environ.setdefault("NUMBA_NUM_THREADS", "1")

LLAMA, QWEN = "llama-3.1-8b-instruct", "qwen-2.5-7b-instruct"
LOW, HIGH = (0.1, 0.05, 0.025), (1.6, 0.8, 0.4)

# name, model, adapters, ranks, rates, A_max, S_max, paper's twin seconds (None = not timed)
CONFIGS = [
    ("llama-light", LLAMA, 32, (8, 16), LOW, 32, 16, 1.3),
    ("llama-healthy", LLAMA, 128, (8, 16), LOW, 64, 16, 2.7),
    ("llama-starving", LLAMA, 384, (8, 16), LOW, 128, 16, 10.7),
    ("llama-overload", LLAMA, 384, (8, 16, 32), HIGH, 64, 32, 82.0),
    ("llama-few-slots-starving", LLAMA, 384, (8, 16), LOW, 8, 16, None),
    ("llama-high-rate-few-adapters", LLAMA, 16, (8, 16), HIGH, 16, 16, None),
    ("llama-many-slots-rank8", LLAMA, 192, (8,), LOW, 192, 8, None),
    ("qwen-light", QWEN, 32, (8, 16), LOW, 32, 16, None),
    ("qwen-healthy", QWEN, 128, (8, 16), LOW, 64, 16, None),
    ("qwen-few-slots-starving", QWEN, 384, (8, 16), LOW, 8, 16, None),
    ("qwen-all-slots", QWEN, 384, (8, 16), LOW, 384, 16, None),
    ("qwen-overload", QWEN, 384, (8, 16, 32), HIGH, 64, 32, None),
    ("qwen-single-slot", QWEN, 64, (16,), LOW, 1, 16, None),
]


def build(model: str, n: int, ranks: tuple, rates: tuple):
    from lorapack.spec import Adapter, LengthsSpec, PoissonArrivals, Workload

    adapters = [Adapter(adapter_id=f"a{i}", rank=ranks[i % len(ranks)], rate_rps=rates[i % len(rates)])
                for i in range(n)]
    return Workload(adapters=adapters, lengths=LengthsSpec(kind="fixed", mean_input_tokens=223,
                                                           mean_output_tokens=197),
                    arrivals=PoissonArrivals())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats per config (median is reported)")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "twin_speed.json")
    args = ap.parse_args()

    from lorapack.profile import find_profile
    from lorapack.twin.engine import warm_up
    from lorapack.twin.run import ServerFlags, simulate

    compile_s = warm_up()
    rows = []
    print(f"{'config':32s} {'wall s/h':>9s} {'sim/real':>9s} {'paper s':>8s} {'speed-up':>9s} "
          f"{'arrivals':>9s} {'starved':>7s} {'thr tok/s':>10s}")
    for name, model, n, ranks, rates, a_max, s_max, paper_s in CONFIGS:
        prof = find_profile(model)
        wl = build(model, n, ranks, rates)
        flags = ServerFlags(max_loras=a_max, max_lora_rank=s_max)
        walls = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            out, _res = simulate(prof, wl, flags, 3600.0, 0)
            walls.append(time.perf_counter() - t0)
        wall = statistics.median(walls)
        row = {"config": name, "model": model, "adapters": n, "ranks": list(ranks), "rates_rps": list(rates),
               "max_loras": a_max, "max_lora_rank": s_max, "wall_s": wall, "walls_s": walls,
               "sim_over_real": 3600.0 / wall, "paper_twin_s": paper_s,
               "speedup_vs_paper": (paper_s / wall) if paper_s else None, "n_generated": out.n_generated,
               "oom": out.oom, "starved": out.starved, "throughput_tok_s": out.throughput_tok_s,
               "steps": out.n_steps}
        rows.append(row)
        sp = f"{row['speedup_vs_paper']:.0f}x" if paper_s else "-"
        print(f"{name:32s} {wall:9.3f} {3600.0 / wall:9.0f} {paper_s or '-':>8} {sp:>9s} "
              f"{out.n_generated:9d} {str(out.starved):>7s} {out.throughput_tok_s:10.1f}")
    walls = [r["wall_s"] for r in rows]
    timed = [r for r in rows if r["paper_twin_s"]]
    summary = {
        "median_wall_s": statistics.median(walls), "max_wall_s": max(walls), "compile_s": compile_s,
        "min_speedup_vs_paper": min(r["speedup_vs_paper"] for r in timed),
        "targets": {"median_wall_s": 0.15, "max_wall_s": 1.0, "min_speedup_vs_paper": 20.0},
    }
    summary["meets_targets"] = (summary["median_wall_s"] <= 0.15 and summary["max_wall_s"] <= 1.0
                                and summary["min_speedup_vs_paper"] >= 20.0)
    print(f"\nmedian {summary['median_wall_s']:.3f} s, max {summary['max_wall_s']:.3f} s per simulated hour; "
          f"min speed-up vs paper {summary['min_speedup_vs_paper']:.0f}x; one-off compile {compile_s:.1f} s; "
          f"targets met: {summary['meets_targets']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"bench": "twin_speed", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "machine": {"python": platform.python_version(), "cpu_count": os.cpu_count(),
                           "processor": platform.processor() or platform.machine()},
               "summary": summary, "configs": rows}
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload, indent=2))
    tmp.replace(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
