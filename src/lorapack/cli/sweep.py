"""``lorapack sweep``: the twin over a grid, rows to Parquet."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from ..errors import SpecError
from .common import (
    ForceOpt,
    JsonOpt,
    check_limit,
    check_output_dir,
    check_workers,
    console,
    limits,
    print_json,
)


def sweep(
    grid: Annotated[Path | None, typer.Argument(help="Grid spec YAML (or use --preset).")] = None,
    preset: Annotated[str | None, typer.Option(
        help="Built-in grid: paper-llama | paper-qwen | additions-llama | additions-qwen.")] = None,
    out: Annotated[Path | None, typer.Option(
        "--out", help="Output directory (Parquet parts); not needed (and not written) with --estimate.")] = None,
    backend: Annotated[str, typer.Option(help="local (process pool) | ray.")] = "local",
    address: Annotated[str | None, typer.Option(help="Ray cluster address (default: start a local Ray).")] = None,
    workers: Annotated[int, typer.Option(help="Parallel workers (0 = all cores).")] = 0,
    limit: Annotated[int | None, typer.Option(
        help="A sample: whole N-series, in a fixed seeded shuffle of the series, until at least K configs; a "
             "larger K with --resume extends the same sample.")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue the sweep already in --out.")] = False,
    early_stop: Annotated[bool, typer.Option("--early-stop/--no-early-stop", help="Early termination.")] = True,
    early_stop_tests: Annotated[str, typer.Option(help="Early-stop tests to use.")] = "certain,likely,healthy",
    prune: Annotated[bool, typer.Option("--prune/--no-prune", help="N-series pruning.")] = True,
    seed: Annotated[int | None, typer.Option(help="Run the grid with this one seed.")] = None,
    boundary_seeds: Annotated[int | None, typer.Option(
        help="Extra seeds for configs whose throughput ratio lands in 0.85-0.95 (the 0.9 label boundary).")] = None,
    model: Annotated[str | None, typer.Option("--model", "-m", help="Override the grid's model.")] = None,
    gpu: Annotated[str | None, typer.Option("--gpu", help="Override the grid's GPU.")] = None,
    print_grid: Annotated[bool, typer.Option("--print-grid", help="Print the grid as YAML and exit.")] = False,
    estimate: Annotated[bool, typer.Option(
        "--estimate", help="Time a sample of whole N-series in a temporary directory and print the projected "
                           "wall time of this sweep (same grid, --limit, workers and shortcuts); writes nothing, "
                           "--out is not needed.")] = False,
    estimate_configs: Annotated[int | None, typer.Option(
        help="--estimate: sample size in configs (whole N-series, so a few more; default 1500: ~40 s for a "
             "paper preset on 2 idle cores, longer when other work holds them).")] = None,
    force: ForceOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Run the twin over a grid of configurations and append one row per config to Parquet parts in --out.

    --estimate instead times a sample of whole N-series (nothing written) and projects this sweep's wall time."""
    from ..sweep import Shortcuts, SweepOptions, grid_yaml, load_grid, preset_grid, run_sweep, with_overrides

    if (grid is None) == (preset is None):
        raise SpecError("give exactly one of GRID (a YAML file) or --preset NAME (paper-llama, paper-qwen)")
    spec = with_overrides(load_grid(grid) if grid is not None else preset_grid(preset), model, gpu, seed,
                          boundary_seeds)
    if print_grid:
        sys.stdout.write(grid_yaml(spec))
        return
    if estimate_configs is not None and not estimate:
        raise SpecError("--estimate-configs is only used with --estimate")
    if estimate and resume:
        raise SpecError("--estimate projects a whole sweep; it does not combine with --resume")
    if out is None and not estimate:
        raise SpecError("--out DIR is required")
    check_workers(workers)
    check_limit(limit)
    check_limit(estimate_configs, "--estimate-configs")
    if not estimate:
        check_output_dir(out, "--out")  # before any work (run_sweep checks again, for API callers)
    tests = {t.strip() for t in early_stop_tests.split(",") if t.strip()}
    if not tests <= {"certain", "likely", "healthy"}:
        raise SpecError(f"--early-stop-tests {early_stop_tests}: expected a comma list of certain, likely, healthy")
    shortcuts = Shortcuts(early_stop=early_stop, certain="certain" in tests, likely="likely" in tests,
                          healthy="healthy" in tests, prune=prune)
    options = SweepOptions(backend=backend, address=address, workers=workers, limit=limit, resume=resume,
                           shortcuts=shortcuts, limits=limits(force))
    if estimate:  # --out, if given, is left alone
        _estimate(spec, options, estimate_configs, json_out)
        return
    summary = run_sweep(spec, out, options, progress=not json_out)
    if json_out:
        print_json(summary)
        return
    console.print(f"[bold]{spec.name}[/bold]: {summary['rows']:,} rows written to {summary['out']} "
                  f"({summary['simulated']:,} simulated, {summary['early_stopped']:,} of them stopped early; "
                  f"{summary['pruned']:,} pruned; {summary['skipped_oom']:,} oom; {summary['boundary_rows']:,} boundary "
                  f"seeds; {summary['already_done']:,} "
                  f"already there) in {summary['wall_s']:.1f} s = {summary['configs_per_s']:.1f} configs/s; "
                  f"grid size {summary['grid_size']:,}.")
    if not summary["early_stop_active"] and early_stop:
        console.print("note: this twin has no early termination; every simulated row is a full run.")


def _estimate(spec, options, sample_configs: int | None, json_out: bool) -> None:
    """``--estimate``: a timed sample in a temporary directory, then the projection (``sweep.estimate``)."""
    from ..sweep.estimate import DEFAULT_SAMPLE_CONFIGS, estimate_sweep

    est = estimate_sweep(spec, options, sample_configs=sample_configs or DEFAULT_SAMPLE_CONFIGS,
                         progress=not json_out)
    if json_out:
        print_json(est)
        return
    sc = est["shortcuts"]
    opts = (f"{est['workers']} worker{'s' if est['workers'] != 1 else ''} ({est['backend']}), early stop "
            f"{'on' if est['early_stop_active'] else 'off'}, pruning {'on' if sc['prune'] else 'off'}, "
            f"boundary seeds {est['boundary_seeds']}")
    what = f"--limit {est['limit']}: " if est["limit"] is not None else ""
    load = max(est["load_avg_before"][0], est["load_avg_after"][0])
    console.print(f"[bold]{spec.name}[/bold]: projected wall time {_duration(est['projected_wall_s'])} "
                  f"(± {_duration(est['projected_wall_s_se'], est['projected_wall_s'])} sampling error) for {what}"
                  f"{est['total_configs']:,} configs in {est['total_series']:,} N-series; {opts}. That is at "
                  f"this machine's load during the sample (load average {load:.1f}, workers got "
                  f"{100 * est['worker_cpu_share']:.0f} % of a core each); on idle cores: "
                  f"{_duration(est['projected_idle_wall_s'])}.")
    cpu = f"{est['sample_cpu_s']:.1f} s CPU, " if est["sample_cpu_s"] is not None else ""
    console.print(f"measured: {est['sample_configs']:,} configs in {est['sample_series']:,} whole series "
                  f"({100 * est['sample_fraction']:.1f} %; {est['sample_simulated']:,} simulated, "
                  f"{est['sample_pruned']:,} pruned, {est['sample_oom']:,} oom) in {est['sample_wall_s']:.1f} s "
                  f"wall, {cpu}{est['sample_busy_s']:.1f} s busy in workers (parallelism "
                  f"{est['parallelism']:.2f}); the estimate took {est['estimate_wall_s']:.1f} s. "
                  f"Nothing was written.")


def _duration(seconds: float, scale_s: float | None = None) -> str:
    """``seconds`` in s, min or h, chosen by ``scale_s`` (default: ``seconds`` itself)."""
    scale_s = seconds if scale_s is None else scale_s
    if scale_s < 120:
        return f"{seconds:.0f} s"
    if scale_s < 2 * 3600:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.2f} h"
