"""Cold-start latency of ``lorapack place``: 1,280 adapters, ``--no-verify``, each run a fresh process.

Targets (issue 26, item 5): with the numba cache warm, median of 5 fresh processes on 2 idle cores, the command
takes <= 1.0 s of wall time and its ``placement_ms`` is <= 50 ms (``placement_ms`` excludes loading the
learned models, reported as ``load_ms``). Before the issue: 3.2-3.6 s wall, ``placement_ms`` 721-1,039 ms.

What is run: ``lorapack place WORKLOAD -m MODEL --no-verify --json --out DIR`` (the console script of this
environment), WORKLOAD the instance of ``bench/placement_speed.py`` (1,280 adapters, ranks 8 / 16 at random,
rates a Dirichlet(0.5) split of 20 req/s, seed 2026) written as a CSV (the profile's lengths). One unmeasured
run first warms the numba cache (and the capacity cache of the lower bound); then ``--reps`` measured runs.
Per run: the wall time around the process (``time.perf_counter``), and ``placement_ms`` / ``load_ms`` from its
JSON. The floors printed beside it: a bare interpreter (``python -c pass``) and ``import lorapack.cli``
(median of ``--reps`` fresh processes each). The load average at the start and end is recorded: the
figures of a loaded machine are slower than the targets' "idle" (``idle`` false when the 1-minute load
average was above a quarter of the CPUs at the start).

The compiled reference (``--no-reference`` to skip): the same command with numba answering every tree walk and
feature row (the numpy paths' budgets set to 0 in the process: what ``place`` did before it avoided numba),
run in turn with the measured runs (A R A R ...), so a machine whose speed drifts moves both. Reported as
``reference`` medians and the per-pair ratio of wall times (``wall_ratio``).

Results go to ``bench/results/cli_latency.json``.

Usage: ``python bench/cli_latency.py [--model M] [--reps 5] [--no-reference] [--out FILE]``
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

N_ADAPTERS, TOTAL_RPS, SEED = 1280, 20.0, 2026
TARGET_WALL_S, TARGET_PLACEMENT_MS = 1.0, 50.0
BEFORE = {"wall_s": [3.2, 3.6], "placement_ms": [721.0, 1039.0]}  # issue 26, measured before the fixes


def write_workload(path: Path) -> Path:
    """bench/placement_speed.py's 1,280-adapter instance as a workload CSV."""
    import numpy as np

    rng = np.random.default_rng(SEED)
    ranks = rng.choice([8, 16], N_ADAPTERS)
    rates = np.maximum(rng.dirichlet(np.full(N_ADAPTERS, 0.5)) * TOTAL_RPS, 1e-4)  # placement needs > 0
    path.write_text("adapter_id,rank,rate_rps\n" + "".join(
        f"a{i:05d},{int(r)},{q:.6g}\n" for i, (r, q) in enumerate(zip(ranks, rates, strict=True))))
    return path


def lorapack_command() -> list[str]:
    """The console script next to this interpreter (what a user runs), else ``python -m lorapack.cli``."""
    script = Path(sys.executable).parent / "lorapack"
    return [str(script)] if script.exists() else [sys.executable, "-m", "lorapack.cli"]


def timed(cmd: list[str], env: dict[str, str]) -> tuple[float, str]:
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stderr[-2000:]}")
    return wall, p.stdout


# the console entry point with the numpy paths' budgets at 0: numba answers every tree walk and feature row
COMPILED_REFERENCE = ("import sys\nfrom lorapack import oracle\nfrom lorapack.surrogate import forest\n"
                      "forest._eval.numpy_budget = 0\noracle._features_kernel.numpy_budget = 0\n"
                      "from lorapack.cli import main\nsys.argv[0] = 'lorapack'\nmain()\n")


def place_run(workload: Path, out: Path, model: str, env: dict[str, str], compiled: bool = False) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    command = [sys.executable, "-c", COMPILED_REFERENCE] if compiled else lorapack_command()
    wall, stdout = timed([*command, "place", str(workload), "-m", model, "--no-verify", "--json",
                          "--out", str(out)], env)
    plan = json.loads(stdout)
    return {"wall_s": wall, "placement_ms": plan.get("placement_ms"), "load_ms": plan.get("load_ms"),
            "gpus_used": plan.get("gpus_used")}


def median_of(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return statistics.median(vals) if vals else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama-3.1-8b-instruct")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--no-reference", dest="reference", action="store_false",
                    help="skip the compiled reference runs")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "cli_latency.json")
    args = ap.parse_args()
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "0"}
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="cli-latency-") as tmp:
        workload = write_workload(Path(tmp) / "adapters.csv")
        out = Path(tmp) / "plan"
        warm = place_run(workload, out, args.model, env)  # numba and capacity caches, .pyc files
        print(f"warm-up run (not counted): {warm['wall_s']:.2f} s wall")
        floors = {
            "python_s": [timed([sys.executable, "-c", "pass"], env)[0] for _ in range(args.reps)],
            "import_cli_s": [timed([sys.executable, "-c", "import lorapack.cli"], env)[0] for _ in range(args.reps)],
        }
        if args.reference:
            place_run(workload, out, args.model, env, compiled=True)  # its numba cache
        runs, reference = [], []
        for _ in range(args.reps):
            runs.append(place_run(workload, out, args.model, env))
            if args.reference:
                reference.append(place_run(workload, out, args.model, env, compiled=True))
    load1 = os.getloadavg()
    cpus = os.cpu_count() or 1
    med = {k: median_of(runs, k) for k in ("wall_s", "placement_ms", "load_ms")}
    med.update({k: statistics.median(v) for k, v in floors.items()})
    results = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": platform.platform(), "python": platform.python_version(), "cpus": cpus,
        "loadavg_start": load0, "loadavg_end": load1, "idle": load0[0] <= cpus / 4,
        "command": f"lorapack place <{N_ADAPTERS} adapters>.csv -m {args.model} --no-verify --json --out DIR",
        "instance": {"n_adapters": N_ADAPTERS, "total_rps": TOTAL_RPS, "seed": SEED},
        "reps": args.reps, "runs": runs, "floors": floors, "median": med,
        "targets": {"wall_s": TARGET_WALL_S, "placement_ms": TARGET_PLACEMENT_MS},
        "met": {"wall_s": med["wall_s"] is not None and med["wall_s"] <= TARGET_WALL_S,
                "placement_ms": med["placement_ms"] is not None and med["placement_ms"] <= TARGET_PLACEMENT_MS},
        "before": BEFORE,
    }
    if reference:
        results["reference"] = {
            "what": "the same command, numba answering every tree walk and feature row (numpy budgets 0)",
            "runs": reference, "median": {k: median_of(reference, k) for k in ("wall_s", "placement_ms", "load_ms")},
            "wall_ratio": statistics.median(a["wall_s"] / b["wall_s"] for a, b in zip(runs, reference, strict=True))}
    print(f"{'run':>4s} {'wall s':>8s} {'placement ms':>13s} {'load ms':>9s} {'GPUs':>5s}")
    for i, r in enumerate(runs, 1):
        print(f"{i:4d} {r['wall_s']:8.2f} {r['placement_ms'] or float('nan'):13.1f} "
              f"{r['load_ms'] if r['load_ms'] is not None else float('nan'):9.1f} {r['gpus_used']!s:>5s}")
    lm = med["load_ms"]
    print(f"median: {med['wall_s']:.2f} s wall (target {TARGET_WALL_S:g} s), placement_ms "
          f"{med['placement_ms']:.1f} (target {TARGET_PLACEMENT_MS:g}), load_ms "
          f"{lm if lm is not None else float('nan'):.1f}")
    if reference:
        rm = results["reference"]["median"]
        print(f"compiled reference (numba for every walk), in turn with the runs: {rm['wall_s']:.2f} s wall, "
              f"placement_ms {rm['placement_ms']:.1f}, load_ms {rm['load_ms']:.1f}; wall ratio (pairs) "
              f"{results['reference']['wall_ratio']:.2f}")
    print(f"floors: python -c pass {med['python_s']:.2f} s, import lorapack.cli {med['import_cli_s']:.2f} s")
    print(f"load average {load0[0]:.1f} -> {load1[0]:.1f} on {cpus} CPUs"
          + ("" if results["idle"] else " (NOT idle: the targets are for 2 idle cores)"))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
