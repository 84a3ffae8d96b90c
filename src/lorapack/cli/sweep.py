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
    out: Annotated[Path | None, typer.Option("--out", help="Output directory (Parquet parts).")] = None,
    backend: Annotated[str, typer.Option(help="local (process pool) | ray.")] = "local",
    address: Annotated[str | None, typer.Option(help="Ray cluster address (default: start a local Ray).")] = None,
    workers: Annotated[int, typer.Option(help="Parallel workers (0 = all cores).")] = 0,
    limit: Annotated[int | None, typer.Option(help="Only the first K configs of a fixed seeded shuffle.")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue the sweep already in --out.")] = False,
    early_stop: Annotated[bool, typer.Option("--early-stop/--no-early-stop", help="Early termination.")] = True,
    early_stop_tests: Annotated[str, typer.Option(help="Early-stop tests to use.")] = "certain,likely,healthy",
    prune: Annotated[bool, typer.Option("--prune/--no-prune", help="N-series pruning.")] = True,
    seed: Annotated[int | None, typer.Option(help="Run the grid with this one seed.")] = None,
    boundary_seeds: Annotated[int | None, typer.Option(
        help="Extra seeds for configs whose throughput ratio lands in 0.8-1.0 (the 0.9 label boundary).")] = None,
    model: Annotated[str | None, typer.Option("--model", "-m", help="Override the grid's model.")] = None,
    gpu: Annotated[str | None, typer.Option("--gpu", help="Override the grid's GPU.")] = None,
    print_grid: Annotated[bool, typer.Option("--print-grid", help="Print the grid as YAML and exit.")] = False,
    force: ForceOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Run the twin over a grid of configurations and append one row per config to Parquet parts in --out."""
    from ..sweep import Shortcuts, grid_yaml, load_grid, preset_grid, run_sweep, with_overrides

    if (grid is None) == (preset is None):
        raise SpecError("give exactly one of GRID (a YAML file) or --preset NAME (paper-llama, paper-qwen)")
    spec = with_overrides(load_grid(grid) if grid is not None else preset_grid(preset), model, gpu, seed,
                          boundary_seeds)
    if print_grid:
        sys.stdout.write(grid_yaml(spec))
        return
    if out is None:
        raise SpecError("--out DIR is required")
    check_workers(workers)
    check_limit(limit)
    check_output_dir(out, "--out")  # before any work (run_sweep checks again, for API callers)
    tests = {t.strip() for t in early_stop_tests.split(",") if t.strip()}
    if not tests <= {"certain", "likely", "healthy"}:
        raise SpecError(f"--early-stop-tests {early_stop_tests}: expected a comma list of certain, likely, healthy")
    shortcuts = Shortcuts(early_stop=early_stop, certain="certain" in tests, likely="likely" in tests,
                          healthy="healthy" in tests, prune=prune)
    summary = run_sweep(spec, out, backend=backend, address=address, workers=workers, limit=limit,
                        resume=resume, shortcuts=shortcuts, progress=not json_out, limits=limits(force))
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
