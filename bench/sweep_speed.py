"""Sweep speed: time a random sample of a preset on this machine and extrapolate the whole preset.

Three samplings, all of whole N-series (so that N-series pruning acts as in a full sweep):

* ``estimate`` (default): exactly ``lorapack sweep --preset P --estimate`` (``lorapack.sweep.estimate``):
  ``--configs`` configs in whole series of the grid's seeded shuffle of series (what ``--limit`` runs), a
  stratified per-series projection with the arrivals generation charged as a full sweep reuses it and the
  workers' start-up counted once. The two older samplings below scale the sample's whole wall time
  (start-up included) by configs, and ``series`` reuses arrivals less than a full sweep; both overstate;
* ``blocks``: the rate tuples sorted by total rate are cut into ``--blocks`` equal strata (default
  6 of 120 tuples -> 5 % of the grid) and one random tuple is drawn per stratum, with every (rank tuple,
  A_max, N) of it. Configs that share arrivals stay together as in the full sweep, so the workers' request
  cache sees the same reuse; unbiased, but the per-block cost varies with the load;
* ``series``: for every (rank tuple, A_max), ``--rate-tuples`` random rate tuples (default 3 -> 2.5 %) --
  lower variance, but little arrival reuse, so it over-estimates a full sweep (conservative).
 The sample runs through ``lorapack.sweep.run_sweep`` exactly as ``lorapack sweep``
would (local process pool, all cores, default shortcuts unless switched off) into a temporary directory;
``blocks`` and ``series`` project ``wall x grid_size / sample_size``. OOM configs are part of the sample.

Target (issue 28): each full paper preset in <= 15 min on this machine's 2 cores, idle (issue 4: 30 min). The
estimate sampling judges its idle-cores projection; run it on an idle machine (load average < 0.5).

Usage: ``python bench/sweep_speed.py [--preset paper-llama] [--sampling estimate|blocks|series] [--configs 1500]
[--blocks 6] [--rate-tuples 3] [--workers 0] [--boundary-seeds 0] [--no-prune]
[--no-early-stop] [--seed 0] [--out FILE]``
"""

from __future__ import annotations

import argparse
import collections
import datetime as dt
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("NUMBA_NUM_THREADS", "1")

TARGET_S = 15 * 60


def block_sample(grid, blocks: int, seed: int):
    """Whole rate blocks: the rate tuples sorted by total rate, cut into ``blocks`` equal strata, one random
    tuple per stratum, with every (rank tuple, A_max, N) of it. Configs sharing arrivals stay together, as
    in a full sweep (the workers' request cache sees the same reuse)."""
    import numpy as np

    from lorapack.sweep import enumerate_configs

    rates = sorted(grid.rate_tuple_list(), key=lambda t: (sum(t), t))
    rng = np.random.default_rng([seed, 0xB10C])
    strata = np.array_split(np.arange(len(rates)), blocks)
    chosen = {rates[int(rng.choice(s))] for s in strata}
    return [c for c in enumerate_configs(grid) if c.rate_tuple in chosen]


def stratified_sample(grid, rate_tuples_per_stratum: int, seed: int):
    import numpy as np

    from lorapack.sweep import enumerate_configs

    configs = enumerate_configs(grid)
    rates = grid.rate_tuple_list()
    rng = np.random.default_rng([seed, 0x5A3])
    chosen = {}
    for ranks in grid.rank_tuple_list():
        for a in grid.adapter_slots:
            idx = rng.choice(len(rates), size=min(rate_tuples_per_stratum, len(rates)), replace=False)
            chosen[(ranks, a)] = {rates[i] for i in idx}
    return [c for c in configs if c.rate_tuple in chosen[(c.rank_tuple, c.adapter_slots)]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="paper-llama")
    ap.add_argument("--sampling", choices=("estimate", "blocks", "series"), default="estimate")
    ap.add_argument("--configs", type=int, default=None, help="estimate sampling: sample size (configs)")
    ap.add_argument("--boundary-seeds", type=int, default=None, help="estimate sampling: as in lorapack sweep")
    ap.add_argument("--blocks", type=int, default=6, help="blocks sampling: number of rate strata")
    ap.add_argument("--rate-tuples", type=int, default=3, help="series sampling: tuples per (ranks, A)")
    ap.add_argument("--workers", type=int, default=0, help="0 = all cores")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed")
    ap.add_argument("--no-prune", action="store_true")
    ap.add_argument("--no-early-stop", action="store_true")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    from lorapack import __version__
    from lorapack.sweep import (
        Shortcuts,
        SweepOptions,
        early_stop_available,
        preset_grid,
        read_rows,
        run_sweep,
    )

    grid = preset_grid(args.preset)
    shortcuts = Shortcuts(early_stop=not args.no_early_stop, prune=not args.no_prune)
    if args.sampling == "estimate":
        estimate(args, grid, shortcuts)
        return
    if args.sampling == "blocks":
        sample = block_sample(grid, args.blocks, args.seed)
        sampling = f"blocks: {args.blocks} rate tuples, one per stratum of total rate, seed {args.seed}"
    else:
        sample = stratified_sample(grid, args.rate_tuples, args.seed)
        sampling = f"series: {args.rate_tuples} random rate tuples per (rank tuple, A_max), seed {args.seed}"
    frac = len(sample) / grid.size
    print(f"{args.preset}: grid size {grid.size:,}; sample {len(sample):,} configs ({100 * frac:.2f} %), "
          f"early stop {'on' if shortcuts.early_stop and early_stop_available() else 'off'}, "
          f"pruning {'on' if shortcuts.prune else 'off'}, {args.workers or os.cpu_count()} workers")
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        summary = run_sweep(grid, Path(tmp) / "sweep", SweepOptions(workers=args.workers, shortcuts=shortcuts),
                            configs=sample, progress=True)
        wall = time.perf_counter() - t0
        rows = read_rows(Path(tmp) / "sweep").to_pylist()
    obtained = collections.Counter(r["obtained"] for r in rows)
    sim_walls = [r["wall_s"] for r in rows if r["obtained"] not in ("oom", "pruned")]
    projection_s = wall * grid.size / len(sample)
    cps = len(sample) / wall
    print(f"wall {wall:.1f} s for {len(sample):,} configs = {cps:.1f} configs/s "
          f"({summary['simulated']:,} simulated, {summary['pruned']:,} pruned, {summary['skipped_oom']:,} oom)")
    print(f"rows by how obtained: {dict(obtained)}")
    if sim_walls:
        print(f"per simulated row: mean {statistics.mean(sim_walls):.3f} s, median {statistics.median(sim_walls):.3f} s, "
              f"max {max(sim_walls):.2f} s (one core, under load)")
    print(f"projection for the full {args.preset} ({grid.size:,} configs): {projection_s / 60:.1f} min "
          f"(target <= {TARGET_S / 60:.0f} min: {'met' if projection_s <= TARGET_S else 'NOT met'})")

    result = {
        "bench": "sweep_speed", "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "twin_version": __version__,
        "machine": {"python": platform.python_version(), "cpu_count": os.cpu_count(),
                    "processor": platform.machine()},
        "preset": args.preset, "grid_size": grid.size, "sample_configs": len(sample), "sample_fraction": frac,
        "sampling": sampling, "rate_tuples_sampled": sorted({c.rate_tuple for c in sample}),
        "workers": summary["workers"], "shortcuts": shortcuts.as_dict(),
        "early_stop_active": summary["early_stop_active"], "wall_s": wall, "configs_per_s": cps,
        "simulated": summary["simulated"], "pruned": summary["pruned"], "skipped_oom": summary["skipped_oom"],
        "obtained": dict(obtained),
        "simulated_row_wall_s": {"mean": statistics.mean(sim_walls) if sim_walls else None,
                                 "median": statistics.median(sim_walls) if sim_walls else None,
                                 "max": max(sim_walls) if sim_walls else None},
        "projection_full_s": projection_s, "projection_full_min": projection_s / 60,
        "target_s": TARGET_S, "meets_target": projection_s <= TARGET_S,
    }
    _write(args, result)


def _write(args: argparse.Namespace, result: dict) -> None:
    out = args.out or Path(__file__).parent / "results" / f"sweep_speed_{args.preset}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


def estimate(args: argparse.Namespace, grid, shortcuts) -> None:
    """``lorapack sweep --estimate`` on the preset; the result keeps the keys of the other samplings."""
    from lorapack import __version__
    from lorapack.sweep import SweepOptions, estimate_sweep, with_overrides
    from lorapack.sweep.estimate import DEFAULT_SAMPLE_CONFIGS

    grid = with_overrides(grid, boundary_seeds=args.boundary_seeds)
    k = args.configs or DEFAULT_SAMPLE_CONFIGS
    load_before = os.getloadavg()
    est = estimate_sweep(grid, SweepOptions(workers=args.workers, shortcuts=shortcuts), sample_configs=k,
                         progress=True)
    projection_s = est["projected_wall_s"]
    print(f"{args.preset}: {est['sample_configs']:,} configs in {est['sample_series']:,} whole series in "
          f"{est['sample_wall_s']:.1f} s ({est['sample_simulated']:,} simulated, {est['sample_pruned']:,} pruned, "
          f"{est['sample_oom']:,} oom); the estimate took {est['estimate_wall_s']:.1f} s")
    idle_s = est["projected_idle_wall_s"]
    print(f"projection for the full {args.preset} ({est['total_configs']:,} configs): {projection_s / 60:.1f} min "
          f"± {est['projected_wall_s_se'] / 60:.1f} at this load, {idle_s / 60:.1f} min on idle cores (target <= "
          f"{TARGET_S / 60:.0f} min on idle cores: {'met' if idle_s <= TARGET_S else 'NOT met'}); load average "
          f"{load_before[0]:.1f} before, {os.getloadavg()[0]:.1f} after")
    _write(args, {
        "bench": "sweep_speed", "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "twin_version": __version__,
        "machine": {"python": platform.python_version(), "cpu_count": os.cpu_count(),
                    "processor": platform.machine(), "load_avg_before": load_before,
                    "load_avg_after": os.getloadavg()},
        "preset": args.preset, "grid_size": est["total_configs"], "sample_configs": est["sample_configs"],
        "sample_fraction": est["sample_fraction"],
        "sampling": f"estimate: whole N-series of the seeded shuffle until >= {k} configs (lorapack sweep --estimate)",
        "workers": est["workers"], "shortcuts": shortcuts.as_dict(), "early_stop_active": est["early_stop_active"],
        "wall_s": est["sample_wall_s"], "configs_per_s": est["projected_configs_per_s"],
        "simulated": est["sample_simulated"], "pruned": est["sample_pruned"], "skipped_oom": est["sample_oom"],
        "projection_full_s": projection_s, "projection_full_min": projection_s / 60,
        "projection_idle_min": est["projected_idle_wall_s"] / 60,
        "target_s": TARGET_S, "meets_target": idle_s <= TARGET_S, "target_on": "projection_idle_min", "estimate": est,
    })


if __name__ == "__main__":
    main()
