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

Before/after comparison of two versions of the twin in the same run: ``--compare REV`` extracts ``src/`` of
git revision REV into a temporary directory and starts two worker processes, one importing that version and
one importing the working tree's; each config is timed on both, alternating, ``--repeats`` times (default
5 here), and the best time per config and version is kept. Prints both, the median and max over configs and
the after/before ratios; writes ``bench/results/twin_speed_compare.json``. The workers also report the CPU
time of each run (``time.thread_time``): its ratios, printed after the wall-time ones, move less when other
jobs share the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
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


REPO = Path(__file__).resolve().parents[1]


def serve() -> None:
    """Worker of ``--compare``: reads config names from stdin, prints one JSON line of wall seconds each."""
    from lorapack.profile import find_profile
    from lorapack.server import ServerConfig
    from lorapack.twin.engine import warm_up
    from lorapack.twin.run import simulate

    by_name = {c[0]: c for c in CONFIGS}
    print(json.dumps({"ready": True, "compile_s": warm_up(), "lorapack": __import__("lorapack").__file__}),
          flush=True)
    for line in sys.stdin:
        name, model, n, ranks, rates, a_max, s_max, _paper_s = by_name[line.strip()]
        prof, wl = find_profile(model), build(model, n, ranks, rates)
        flags = ServerConfig(max_loras=a_max, max_lora_rank=s_max)
        t0, c0 = time.perf_counter(), time.thread_time()
        m, _res = simulate(prof, wl, flags, 3600.0, 0)
        wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
        print(json.dumps({"config": name, "wall_s": wall, "cpu_s": cpu, "steps": int(m.n_steps)}), flush=True)


def _worker(src: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(src), "NUMBA_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--serve"], env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    hello = json.loads(proc.stdout.readline())
    print(f"worker {proc.pid}: {hello['lorapack']} (compile {hello['compile_s']:.1f} s)")
    return proc


def _time(proc: subprocess.Popen, name: str) -> tuple[float, float, int]:
    proc.stdin.write(name + "\n")
    proc.stdin.flush()
    out = json.loads(proc.stdout.readline())
    return out["wall_s"], out["cpu_s"], out["steps"]


def compare(rev: str, repeats: int, out: Path, only: list[str] | None = None) -> None:
    """Time revision ``rev`` (before) and the working tree (after) in one run, interleaved, best of N."""
    configs = [c for c in CONFIGS if only is None or c[0] in only]
    with tempfile.TemporaryDirectory(prefix="twin-speed-") as tmp:
        archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "src"], check=True, capture_output=True)
        subprocess.run(["tar", "-x", "-C", tmp], input=archive.stdout, check=True)
        versions = {"before": Path(tmp) / "src", "after": REPO / "src"}
        procs = {k: _worker(v) for k, v in versions.items()}
        best = {k: {c[0]: float("inf") for c in configs} for k in versions}
        best_cpu = {k: {c[0]: float("inf") for c in configs} for k in versions}
        steps: dict[str, dict[str, int]] = {k: {} for k in versions}  # engine steps: what each version simulates
        try:
            for rep in range(repeats):
                for name, *_ in configs:
                    order = ("before", "after") if rep % 2 == 0 else ("after", "before")
                    for k in order:
                        wall, cpu, steps[k][name] = _time(procs[k], name)
                        best[k][name] = min(best[k][name], wall)
                        best_cpu[k][name] = min(best_cpu[k][name], cpu)
                print(f"repeat {rep + 1}/{repeats} done", flush=True)
        finally:
            for p in procs.values():
                p.stdin.close()
                p.wait()
    # wall per step separates implementation speed from behaviour changes (e.g. more adapter loads or steps)
    print(f"\n{'config':30s} {'before s':>9s} {'after s':>8s} {'ratio':>6s} {'steps ratio':>11s} {'per step':>8s}")
    for name, *_ in configs:
        b, a = best["before"][name], best["after"][name]
        sr = steps["after"][name] / steps["before"][name]
        print(f"{name:30s} {b:9.4f} {a:8.4f} {a / b:6.3f} {sr:11.3f} {a / b / sr:8.3f}")
    summary = {}
    for k in versions:
        walls = list(best[k].values())
        summary[k] = {"median_wall_s": statistics.median(walls), "max_wall_s": max(walls)}
    ratios = {m: summary["after"][m] / summary["before"][m] for m in ("median_wall_s", "max_wall_s")}
    print(f"\nbefore ({rev}): median {summary['before']['median_wall_s']:.4f} s, max "
          f"{summary['before']['max_wall_s']:.4f} s per simulated hour")
    print(f"after (working tree): median {summary['after']['median_wall_s']:.4f} s, max "
          f"{summary['after']['max_wall_s']:.4f} s per simulated hour")
    print(f"after/before: median {ratios['median_wall_s']:.3f}, max {ratios['max_wall_s']:.3f} "
          f"(best of {repeats}, interleaved; load average {os.getloadavg()[0]:.1f} at the end)")
    per_step = {k: {n: best[k][n] / steps[k][n] for n in best[k]} for k in versions}
    ratios["median_wall_per_step"] = statistics.median(per_step["after"][n] / per_step["before"][n] for n in best["after"])
    print(f"wall per engine step, after/before: median {ratios['median_wall_per_step']:.3f}")
    cpu = {k: {"median_cpu_s": statistics.median(best_cpu[k].values()), "max_cpu_s": max(best_cpu[k].values())}
           for k in versions}
    for m in ("median_cpu_s", "max_cpu_s"):
        ratios[m] = cpu["after"][m] / cpu["before"][m]
    ratios["median_cpu_per_step"] = statistics.median(
        best_cpu["after"][n] / steps["after"][n] / (best_cpu["before"][n] / steps["before"][n]) for n in best_cpu["after"])
    print(f"CPU time (thread), after/before: median {ratios['median_cpu_s']:.3f}, max {ratios['max_cpu_s']:.3f}; "
          f"per engine step: median {ratios['median_cpu_per_step']:.3f}")
    payload = {"bench": "twin_speed_compare", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "before": rev, "repeats": repeats, "load_average_1min_end": os.getloadavg()[0],
               "summary": summary, "ratios": ratios, "configs": best, "steps": steps,
               "cpu_summary": cpu, "configs_cpu": best_cpu}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=2))
    print(f"wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=None,
                    help="timed repeats per config (median reported; with --compare the best; default 3 / 5)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--compare", metavar="REV", default=None,
                    help="also time git revision REV, interleaved with the working tree (best of --repeats)")
    ap.add_argument("--only", default=None, help="with --compare: comma-separated config names (default: all)")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    results = Path(__file__).parent / "results"
    if args.serve:
        return serve()
    if args.compare:
        only = args.only.split(",") if args.only else None
        unknown = sorted(set(only or ()) - {c[0] for c in CONFIGS})
        if unknown:
            ap.error(f"--only: unknown config(s) {', '.join(unknown)}; expected names from CONFIGS")
        return compare(args.compare, args.repeats or 5, args.out or results / "twin_speed_compare.json", only)
    args.repeats = args.repeats or 3
    args.out = args.out or results / "twin_speed.json"

    from lorapack.profile import find_profile
    from lorapack.server import ServerConfig
    from lorapack.twin.engine import warm_up
    from lorapack.twin.run import simulate

    compile_s = warm_up()
    rows = []
    print(f"{'config':32s} {'wall s/h':>9s} {'sim/real':>9s} {'paper s':>8s} {'speed-up':>9s} "
          f"{'arrivals':>9s} {'starved':>7s} {'thr tok/s':>10s}")
    for name, model, n, ranks, rates, a_max, s_max, paper_s in CONFIGS:
        prof = find_profile(model)
        wl = build(model, n, ranks, rates)
        flags = ServerConfig(max_loras=a_max, max_lora_rank=s_max)
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
