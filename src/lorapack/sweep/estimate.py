"""``lorapack sweep --estimate``: time a sample of whole N-series, project the wall time of the full sweep.

The sample is what ``--limit K`` would run (whole N-series, a prefix of the grid's seeded shuffle of series),
run by ``run_sweep`` with the sweep's own options (backend, workers, shortcuts, boundary seeds) into a
temporary directory that is removed afterwards. Whole series, because N-series pruning skips most of a
starving series: single random configs would miss that and overstate a full sweep several-fold.

Projection (every rate measured on the sample, none assumed):

* **simulation**: each sampled series costs ``b`` busy seconds in the workers (its rows' ``wall_s`` without
  the arrivals generation; boundary-seed reruns included); the full selection's total is a post-stratified
  mean over the series' startable configs (``A_max`` and the start-up rule set how many configs a series can
  simulate) and their mean adapter rate, ``STRATA_PER_AXIS`` quantile bins each;
* **arrivals**: a full sweep generates each arrival set ``(seed, rates, N, lengths, window)`` once per batch
  holding it (``runner.build_batches``: one batch per arrivals group, or a share of a large one) and reuses it
  for every rank tuple and ``A_max``, a sample of scattered series hardly ever: the generation is timed apart
  (seconds per request) and charged per arrival set of the full selection, times the batches that need it;
* **phases**: an executor run takes ``S + busy / p``: ``S`` is the workers' start (spawn, engine warm-up: the
  first completion minus its busy time), ``p`` the effective parallelism of the rest (measured), so the full
  run takes ``S + (phases - S) * busy_full / busy_sample``;
* **set-up** before the workers start: the sample's, plus what only the full grid costs: selecting and
  costing its configs (timed here) and its OOM rows (at the sample's seconds per OOM row).

The standard error comes from the strata's variances (finite-population corrected); it covers the sampling
only: a machine busier or quieter than during the sample moves the real time as well. So the projection is
also given for idle cores (``projected_idle_wall_s``): the workers' busy time at the CPU share they got
during the sample (CPU / elapsed seconds of their units), divided among the workers.
"""

from __future__ import annotations

import math
import os
import resource
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from ..errors import SpecError
from ..executor import default_workers
from ..guards import Limits
from ..profile import Profile, find_profile
from .grid import BOUNDARY_SEED_STRIDE, GridSpec, SweepConfig, shuffled_series, take_series
from .runner import SweepOptions, build_batches, build_units, check_resources, run_sweep
from .work import REQUEST_CACHE_BUDGET, Shortcuts, WorkUnit, arrivals_group, arrivals_key, oom_row

# 1,500 configs of paper-llama (~260 whole series) take ~35 s on 2 idle cores, ~90 s on 2 busy ones; the
# stratified per-series cost leaves a sampling error of ~4 % (docs/sweep.md, "Samples and estimates")
DEFAULT_SAMPLE_CONFIGS = 1500
STRATA_PER_AXIS = 3
MIN_PER_STRATUM = 5  # strata with fewer sampled series are pooled (a mean of 1-4 series is noise)


def _bins(values: np.ndarray, n_bins: int) -> np.ndarray:
    """Quantile bin of every value (ties share a bin; fewer bins when values repeat)."""
    edges = np.unique(np.quantile(values, np.arange(1, n_bins) / n_bins))
    return np.searchsorted(edges, values, side="left")


def stratified_total(cost_s: np.ndarray, sampled: np.ndarray, strata: np.ndarray) -> tuple[float, float]:
    """Post-stratified estimate of ``sum(cost_s)`` over the population from the ``sampled`` entries.

    ``cost_s``: per-unit cost (only entries where ``sampled`` is True are read); ``strata``: stratum label per
    unit. Strata with fewer than ``MIN_PER_STRATUM`` sampled units are pooled. Returns ``(total, standard
    error)``; the standard error is 0 when every unit was sampled."""
    labels = np.asarray(strata).copy()
    pooled = int(labels.min()) - 1
    for h in np.unique(strata):
        if np.count_nonzero(sampled & (strata == h)) < MIN_PER_STRATUM:
            labels[strata == h] = pooled
    total, var = 0.0, 0.0
    all_costs = cost_s[sampled]
    if len(all_costs) == 0:
        raise ValueError("stratified_total: nothing sampled")
    for h in np.unique(labels):
        in_h = labels == h
        n_pop = int(np.count_nonzero(in_h))
        c = cost_s[in_h & sampled]
        if len(c) == 0:  # a pooled remainder without samples: the overall sample stands in
            c = all_costs
        total += n_pop * float(c.mean())
        if len(c) > 1:
            fpc = max(0.0, 1.0 - len(c) / n_pop)
            var += n_pop ** 2 * fpc * float(c.var(ddof=1)) / len(c)
    return total, math.sqrt(var)


def series_strata(series: list[list[SweepConfig]], profile: Profile) -> np.ndarray:
    """Stratum of every series: quantile bins of its startable configs x its mean adapter rate (rps)."""
    startable = np.array([sum(profile.startup(c.adapter_slots, c.max_lora_rank)[0] for c in s) for s in series],
                         dtype=float)
    mean_rate_rps = np.array([float(s[0].rates_rps().mean()) for s in series])
    return _bins(startable, STRATA_PER_AXIS) * STRATA_PER_AXIS + _bins(mean_rate_rps, STRATA_PER_AXIS)


def arrival_sets(configs: list[SweepConfig], profile: Profile) -> dict[tuple, list]:
    """Per arrival set (``work.arrivals_key``) of the startable configs: ``[expected requests, configs]``."""
    out: dict[tuple, list] = {}
    for c in configs:
        if not profile.startup(c.adapter_slots, c.max_lora_rank)[0]:
            continue
        k = arrivals_key(c)
        if k not in out:
            out[k] = [float(c.rates_rps().sum()) * c.duration_s, 0]
        out[k][1] += 1
    return out


def generation_s(sets: dict[tuple, list], s_per_request: float, simulated_share: float,
                 shares: dict[tuple, int] | None = None) -> float:
    """Seconds a sweep spends generating the arrival sets ``sets``: each once per batch that runs one of its
    configs (``simulated_share`` of the startable ones run; the rest are pruned); ``shares``: batches per
    arrivals group (``work.arrivals_group`` of the set's configs; 1 when missing), every time when the set is
    too large for a worker's cache."""
    total = 0.0
    for key, (requests, n_configs) in sets.items():
        users = n_configs * simulated_share
        if requests > REQUEST_CACHE_BUDGET:
            times = users
        else:  # expected batches among the group's shares that run one of the set's configs
            k = (shares or {}).get(key[:1] + key[2:], 1)
            times = k * (1.0 - (1.0 - 1.0 / k) ** users) if k > 1 else min(1.0, users)
        total += requests * times
    return total * s_per_request


def _cpu_s() -> float:
    """CPU seconds of this process and of its reaped children (the local pool's workers once closed)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _prep_s(configs: list[SweepConfig], profile: Profile, shortcuts: Shortcuts, limits: Limits | None,
            workers: int) -> tuple[float, list[SweepConfig], dict[tuple, int]]:
    """Seconds ``run_sweep`` spends costing ``configs``, finding the OOM ones and building units and batches;
    the OOM ones; the batches per arrivals group."""
    t0 = time.perf_counter()
    check_resources(configs, profile, limits)
    oom = [c for c in configs if not profile.startup(c.adapter_slots, c.max_lora_rank)[0]]
    ids = {c.config_id for c in oom}
    batches = build_batches(build_units([c for c in configs if c.config_id not in ids], shortcuts.prune, limits),
                            workers)
    shares: dict[tuple, int] = {}
    for b in batches:
        g = arrivals_group(b.units[0].configs[0])
        shares[g] = shares.get(g, 0) + 1
    return time.perf_counter() - t0, oom, shares


def _seconds_per_oom_row(configs: list[SweepConfig], profile: Profile) -> float:
    if not configs:
        return 0.0
    t0 = time.perf_counter()
    for c in configs:
        oom_row(c, profile)
    return (time.perf_counter() - t0) / len(configs)


def estimate_sweep(grid: GridSpec, options: SweepOptions = SweepOptions(),
                   sample_configs: int = DEFAULT_SAMPLE_CONFIGS, progress: bool = False) -> dict:
    """Run a sample of whole N-series of ``grid`` (``sample_configs`` configs or a few more) as ``run_sweep``
    would, in a temporary directory, and project the wall time of the sweep with the same ``options``
    (``SweepOptions``; ``limit``: of that limited sweep; ``resume`` is refused: the projection is of a whole
    sweep). Returns a dict (``lorapack sweep --estimate --json``); writes nothing."""
    t_start = time.perf_counter()
    if isinstance(sample_configs, bool) or not isinstance(sample_configs, int) or sample_configs < 1:
        raise SpecError(f"--estimate-configs {sample_configs}: expected an integer >= 1")
    if options.resume:
        raise SpecError("--estimate projects a whole sweep; it does not combine with --resume")
    backend, workers, limit, shortcuts, limits = (options.backend, options.workers, options.limit, options.shortcuts,
                                                  options.limits)
    profile = find_profile(grid.model, grid.gpu)

    # the full selection as run_sweep makes it (with --limit: its prefix of whole series)
    t0 = time.perf_counter()
    order = shuffled_series(grid)
    full = take_series(order, limit) if limit is not None else order
    select_s = time.perf_counter() - t0
    full_configs = [c for s in full for c in s]
    n_workers_expected = default_workers() if workers == 0 else workers
    prep_full_s, oom_full, shares_full = _prep_s(full_configs, profile, shortcuts, limits,  # refuses what the
                                                 n_workers_expected)  # sweep refuses
    sample = take_series(full, sample_configs)  # a prefix of a random order: a random sample of the series
    sample_cfgs = [c for s in sample for c in s]
    prep_sample_s, oom_sample, _shares = _prep_s(sample_cfgs, profile, shortcuts, limits, n_workers_expected)

    # per sampled series: busy seconds without arrivals generation (a boundary-seed rerun counts, whole, for
    # the series of its config: its arrivals are its own in a full sweep too)
    series_of = {c.config_id: i for i, s in enumerate(sample) for c in s}
    boundary_ids = set()
    for c in sample_cfgs:
        for k in range(1, grid.boundary_seeds + 1):
            cid = replace(c, seed=c.seed + k * BOUNDARY_SEED_STRIDE).config_id
            series_of[cid] = series_of[c.config_id]
            boundary_ids.add(cid)
    sim_s = np.zeros(len(sample))
    gen = {"s": 0.0, "requests": 0, "simulated": 0}
    worker = {"busy_s": 0.0, "cpu_s": 0.0}  # elapsed vs CPU seconds of the workers: what the machine gave
    first_done: dict[int, tuple[float, float]] = {}  # phase -> (first completion, busy of that unit)
    timings: dict = {}

    def on_unit(unit: WorkUnit, rows: list[dict]) -> None:
        unit_busy = sum(float(r["wall_s"]) for r in rows)
        worker["busy_s"] += unit_busy
        worker["cpu_s"] += sum(float(r.get("cpu_s", 0.0)) for r in rows)
        for r in rows:
            busy = float(r["wall_s"])
            if r["config_id"] not in boundary_ids:
                busy -= float(r.get("arrivals_s", 0.0))
                gen["s"] += float(r.get("arrivals_s", 0.0))
                gen["requests"] += int(r.get("arrivals_requests", 0))
                gen["simulated"] += r["obtained"] not in ("oom", "pruned")
            sim_s[series_of[r["config_id"]]] += max(0.0, busy)
        phase = len(timings.get("phases", []))
        first_done.setdefault(phase, (time.perf_counter() - t_run, unit_busy))

    cpu0 = _cpu_s()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="lorapack-estimate-") as tmp:
        t_run = time.perf_counter()
        summary = run_sweep(grid, Path(tmp) / "sample", options, configs=sample_cfgs, progress=progress,
                            on_unit=on_unit, timings=timings, timed=True)
    sample_cpu_s = _cpu_s() - cpu0 if backend == "local" else None  # Ray's workers are not our children
    load_after = os.getloadavg()
    sample_wall_s = summary["wall_s"]
    n_workers = int(summary["workers"])

    # busy seconds of the full selection: simulation (post-stratified) + arrivals generation (modelled)
    strata = series_strata(full, profile)
    cost = np.zeros(len(full))
    cost[: len(sample)] = sim_s
    sampled = np.zeros(len(full), dtype=bool)
    sampled[: len(sample)] = True
    sim_full_s, sim_full_se = stratified_total(cost, sampled, strata)
    startable_sample = len(sample_cfgs) - len(oom_sample)
    share = gen["simulated"] / startable_sample if startable_sample else 1.0
    s_per_request = gen["s"] / gen["requests"] if gen["requests"] else 0.0
    gen_full_s = generation_s(arrival_sets(full_configs, profile), s_per_request, share, shares_full)
    busy_sample_s = float(sim_s.sum()) + gen["s"]
    busy_full_s = sim_full_s + gen_full_s

    # executor phases: the workers' start once per phase, the rest scales with the busy time
    phases = timings.get("phases", [])
    phases_s = sum(end - start for start, end in phases)
    start_s = 0.0
    for k, (begin, _end) in enumerate(phases):
        if k in first_done:
            done_at, unit_busy = first_done[k]
            start_s += max(0.0, done_at - begin - unit_busy)
    start_s = min(start_s, phases_s)
    ratio = busy_full_s / busy_sample_s if busy_sample_s > 0 else 1.0
    phases_full_s = start_s + (phases_s - start_s) * ratio
    parallelism = busy_sample_s / (phases_s - start_s) if phases_s > start_s else float(n_workers)

    # set-up: the sample's, plus selecting and costing the full grid and its further OOM rows
    oom_rows_s = timings.get("oom_rows_s", 0.0)
    per_oom_s = oom_rows_s / len(oom_sample) if oom_sample else _seconds_per_oom_row(oom_full[:20], profile)
    setup_full_s = (timings.get("setup_s", 0.0) + select_s + max(0.0, prep_full_s - prep_sample_s)
                    + per_oom_s * (len(oom_full) - len(oom_sample)))
    last_end = phases[-1][1] if phases else timings.get("setup_s", 0.0)
    tail_s = max(0.0, sample_wall_s - last_end)
    # between the grid and its boundary seeds the sweep reads back its rows: that scales with the configs
    gaps_s = sum(max(0.0, nxt[0] - prev[1]) for prev, nxt in zip(phases, phases[1:], strict=False))
    tail_s += gaps_s * len(full_configs) / max(1, len(sample_cfgs))
    projected = setup_full_s + phases_full_s + tail_s
    se = sim_full_se / parallelism if parallelism > 0 else 0.0
    # on a machine whose other work left the workers whole cores: the busy time at the CPU share they got
    # (rows' wall_s are elapsed; under contention a worker gets less than a core)
    cpu_share = min(1.0, worker["cpu_s"] / worker["busy_s"]) if worker["busy_s"] > 0 else 1.0
    idle = setup_full_s + start_s + busy_full_s * cpu_share / max(1, n_workers) + tail_s
    return {
        "grid": grid.name, "limit": limit, "backend": backend, "workers": summary["workers"],
        "shortcuts": shortcuts.as_dict(), "early_stop_active": summary["early_stop_active"],
        "boundary_seeds": grid.boundary_seeds,
        "total_configs": len(full_configs), "total_series": len(full), "total_oom": len(oom_full),
        "sample_configs": len(sample_cfgs), "sample_series": len(sample),
        "sample_fraction": len(sample_cfgs) / len(full_configs) if full_configs else 1.0,
        "sample_rows": summary["rows"], "sample_simulated": summary["simulated"], "sample_pruned": summary["pruned"],
        "sample_oom": summary["skipped_oom"], "sample_boundary_rows": summary["boundary_rows"],
        "sample_wall_s": sample_wall_s, "sample_cpu_s": sample_cpu_s, "sample_busy_s": busy_sample_s,
        "sample_arrivals_s": gen["s"], "sample_setup_s": timings.get("setup_s", 0.0),
        "sample_worker_start_s": start_s, "parallelism": parallelism, "strata": int(len(np.unique(strata))),
        "projected_busy_s": busy_full_s, "projected_arrivals_s": gen_full_s, "projected_setup_s": setup_full_s,
        "projected_wall_s": projected, "projected_wall_s_se": se, "worker_cpu_share": cpu_share,
        "projected_idle_wall_s": idle, "load_avg_before": list(load_before), "load_avg_after": list(load_after),
        "projected_configs_per_s": len(full_configs) / projected if projected > 0 else 0.0,
        "estimate_wall_s": time.perf_counter() - t_start,
    }


__all__ = ["DEFAULT_SAMPLE_CONFIGS", "estimate_sweep", "generation_s", "stratified_total"]
