"""Where the sweep's time goes: the same sample of N-series swept by two or more source trees, side by side.

Each tree (``--src NAME=PATH`` to a ``src`` directory holding ``lorapack``; a git worktree of an old commit)
sweeps the same whole N-series of a preset — chosen by this tree's ``select_configs(grid, K)`` and matched in
every tree by (seed, rate tuple, rank tuple, A_max), so a tree whose grid gives configs other ids still runs
the same questions — in its own process with one in-process worker, all trees at the same time (so they
share the machine's load). Per tree it counts what is load-insensitive and times what is not:

* configs simulated / pruned / OOM, the ``obtained`` and ``stop_reason`` counts;
* simulated seconds (total, per simulated config), engine steps (total, per simulated second);
* CPU seconds of the simulated configs (``time.process_time`` around each ``simulate_config``, without the
  arrivals generation, which is counted apart wherever a tree calls it), CPU per simulated hour and per
  engine step; the same in wall seconds;
* the whole sweep's wall and CPU (selection, rows, Parquet and the per-config work).

The machine's load average is recorded before and after. Usage::

    git worktree add /tmp/old 4ad0d9b
    .venv/bin/python bench/sweep_compare.py --src old=/tmp/old/src --src now=src [--configs 1500] [--preset P]
    git worktree remove /tmp/old

Writes ``bench/results/sweep_compare_<preset>.json`` (``--out`` to change).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("NUMBA_NUM_THREADS", "1")

SIM_HOUR_S = 3600.0


def series_keys(preset: str, configs: int) -> list[list]:
    """(seed, rate tuple, rank tuple, A_max) of the whole series ``select_configs`` takes (this tree's)."""
    from lorapack.sweep import preset_grid
    from lorapack.sweep.grid import select_configs

    keys: dict[tuple, None] = {}
    for c in select_configs(preset_grid(preset), configs):
        keys.setdefault((c.seed, tuple(c.rate_tuple), tuple(c.rank_tuple), c.adapter_slots), None)
    return [[k[0], list(k[1]), list(k[2]), k[3]] for k in keys]


def _child(src: str, preset: str, keys_file: str, out_file: str) -> None:
    """Sweep the keyed series with the tree at ``src`` (one worker, in this process) and write the figures."""
    sys.path.insert(0, src)
    import lorapack
    import lorapack.sweep.work as work
    from lorapack.sweep import Shortcuts, enumerate_configs, preset_grid, read_rows, run_sweep

    try:  # trees since issue 26 take the sweep's options as one record, older ones as keywords
        from lorapack.sweep import SweepOptions as options_record
    except ImportError:
        options_record = None

    assert Path(lorapack.__file__).resolve().is_relative_to(Path(src).resolve()), lorapack.__file__
    # the engine class of the tree (same name in every tree so far): count steps of every config's last result
    from lorapack.twin import engine as eng_mod

    last_steps = {"n": 0}
    orig_result = eng_mod.Engine.result

    def result(self):  # steps only grow during a run: the last result() of a config has its step count
        res = orig_result(self)
        last_steps["n"] = int(res.n_steps)
        return res

    eng_mod.Engine.result = result
    per_cfg: dict[str, dict] = {}
    orig_sim = work.simulate_config

    def simulate_config(cfg, *args, **kwargs):
        c0, w0, a0 = time.process_time(), time.perf_counter(), arrivals["cpu_s"]
        row = orig_sim(cfg, *args, **kwargs)
        gen_s = arrivals["cpu_s"] - a0  # arrivals generated inside (older trees): counted apart
        per_cfg[cfg.config_id] = {"cpu_s": time.process_time() - c0 - gen_s,
                                  "wall_s": time.perf_counter() - w0 - gen_s, "steps": last_steps["n"]}
        return row

    work.simulate_config = simulate_config
    # arrivals generation, wherever a tree calls it (inside simulate_config, or before it in a batch)
    arrivals = {"cpu_s": 0.0}
    orig_requests = work.config_requests

    def config_requests(cfg, *args, **kwargs):
        c0 = time.process_time()
        try:
            return orig_requests(cfg, *args, **kwargs)
        finally:
            arrivals["cpu_s"] += time.process_time() - c0

    work.config_requests = config_requests
    keys = {(k[0], tuple(k[1]), tuple(k[2]), k[3]) for k in json.loads(Path(keys_file).read_text())}
    grid = preset_grid(preset)
    configs = [c for c in enumerate_configs(grid)
               if (c.seed, tuple(c.rate_tuple), tuple(c.rank_tuple), c.adapter_slots) in keys]
    eng_mod.warm_up()  # compile / load the engine before anything is timed
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        c0, w0 = time.process_time(), time.perf_counter()
        if options_record is not None:
            run_sweep(grid, Path(tmp) / "s", options_record(workers=1, shortcuts=Shortcuts()), configs=configs)
        else:
            run_sweep(grid, Path(tmp) / "s", configs=configs, workers=1, shortcuts=Shortcuts())
        cpu_total, wall_total = time.process_time() - c0, time.perf_counter() - w0
        rows = read_rows(Path(tmp) / "s").to_pylist()
    sim = [r for r in rows if r["obtained"] not in ("oom", "pruned")]
    obtained: dict[str, int] = {}
    for r in rows:
        obtained[r["obtained"]] = obtained.get(r["obtained"], 0) + 1
    sim_s = sum(float(r["simulated_s"]) for r in sim)
    cpu_sim = sum(per_cfg[r["config_id"]]["cpu_s"] for r in sim)
    wall_sim = sum(per_cfg[r["config_id"]]["wall_s"] for r in sim)
    steps = sum(per_cfg[r["config_id"]]["steps"] for r in sim)
    by_reason: dict[str, dict] = {}
    for r in sim:
        e = by_reason.setdefault(r["obtained"], {"rows": 0, "simulated_s": 0.0, "cpu_s": 0.0, "steps": 0})
        e["rows"] += 1
        e["simulated_s"] += float(r["simulated_s"])
        e["cpu_s"] += per_cfg[r["config_id"]]["cpu_s"]
        e["steps"] += per_cfg[r["config_id"]]["steps"]
    out = {
        "src": src, "configs": len(rows), "series": len(keys), "simulated": len(sim),
        "pruned": obtained.get("pruned", 0), "oom": obtained.get("oom", 0), "obtained": obtained,
        "by_obtained": by_reason,
        "simulated_s": sim_s, "simulated_s_per_simulated_config": sim_s / max(len(sim), 1),
        "steps": steps, "steps_per_simulated_s": steps / sim_s if sim_s else None,
        "cpu_simulated_s": cpu_sim, "wall_simulated_s": wall_sim, "cpu_arrivals_s": arrivals["cpu_s"],
        "cpu_s_per_simulated_hour": cpu_sim / (sim_s / SIM_HOUR_S) if sim_s else None,
        "wall_s_per_simulated_hour": wall_sim / (sim_s / SIM_HOUR_S) if sim_s else None,
        "cpu_us_per_step": 1e6 * cpu_sim / steps if steps else None,
        "cpu_total_s": cpu_total, "wall_total_s": wall_total,
        "cpu_s_per_config": cpu_total / max(len(rows), 1),
        "load_avg_before": load_before, "load_avg_after": os.getloadavg(),
    }
    Path(out_file).write_text(json.dumps(out, indent=2) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--src", action="append", default=[], help="NAME=PATH of a src directory (repeat)")
    ap.add_argument("--preset", default="paper-llama")
    ap.add_argument("--configs", type=int, default=1500, help="whole series until at least this many configs")
    ap.add_argument("--sequential", action="store_true", help="one tree after the other (default: all at once)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--child", nargs=4, metavar=("SRC", "PRESET", "KEYS", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(*args.child)
        return
    if len(args.src) < 1:
        ap.error("give at least one --src NAME=PATH")
    trees = dict(s.split("=", 1) for s in args.src)
    keys = series_keys(args.preset, args.configs)
    load_before = os.getloadavg()
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        kf = Path(tmp) / "keys.json"
        kf.write_text(json.dumps(keys))
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        procs = {}
        for name, src in trees.items():
            cmd = [sys.executable, __file__, "--child", str(Path(src).resolve()), args.preset, str(kf),
                   str(Path(tmp) / f"{name}.json")]
            procs[name] = subprocess.Popen(cmd, env=env)
            if args.sequential:
                procs[name].wait()
        for name, p in procs.items():
            if p.wait() != 0:
                raise SystemExit(f"{name}: the child failed (exit {p.returncode})")
            results[name] = json.loads((Path(tmp) / f"{name}.json").read_text())
    load_after = os.getloadavg()
    print(f"{args.preset}: {len(keys)} whole series; load average {load_before[0]:.2f} before, "
          f"{load_after[0]:.2f} after; {'sequential' if args.sequential else 'all trees at once'}, 1 worker each")
    cols = ("configs", "simulated", "pruned", "oom", "simulated_s_per_simulated_config", "steps_per_simulated_s",
            "cpu_us_per_step", "cpu_s_per_simulated_hour", "wall_s_per_simulated_hour", "cpu_simulated_s",
            "cpu_arrivals_s", "cpu_total_s", "wall_total_s")
    print(f"{'':36s}" + "".join(f"{n:>14s}" for n in results))
    for c in cols:
        print(f"{c:36s}" + "".join(f"{r[c]:14.4g}" if isinstance(r[c], float) else f"{r[c]:14}"
                                  for r in results.values()))
    kinds = sorted({k for r in results.values() for k in r["obtained"]})
    for k in kinds:
        print(f"  {k:34s}" + "".join(f"{r['obtained'].get(k, 0):14}" for r in results.values()))
    out = args.out or Path(__file__).parent / "results" / f"sweep_compare_{args.preset}.json"
    out.write_text(json.dumps({
        "bench": "sweep_compare", "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": {"python": platform.python_version(), "cpu_count": os.cpu_count(),
                    "processor": platform.machine(), "load_avg_before": load_before, "load_avg_after": load_after},
        "preset": args.preset, "sample_configs_min": args.configs, "series": len(keys),
        "mode": "sequential" if args.sequential else "concurrent", "trees": trees, "results": results,
    }, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
