"""Sweeps: generate the surrogates' training data with the twin (issue 4, placement.md §3.3).

API::

    from lorapack.sweep import load_grid, preset_grid, run_sweep, read_rows, Shortcuts, SweepOptions
    grid = preset_grid("paper-llama")            # or load_grid("grid.yaml")
    opts = SweepOptions(workers=0, limit=1000, resume=True, shortcuts=Shortcuts(prune=True))
    summary = run_sweep(grid, "out/", opts)
    table = read_rows("out/")                    # pyarrow.Table, one row per config
    est = estimate_sweep(grid, SweepOptions(workers=2))  # a timed sample of whole N-series -> est["projected_wall_s"]

``SweepOptions`` (backend, address, workers, limit, resume, shortcuts, limits, flush_rows, flush_s) checks itself
when made, with the CLI flags' messages.

``limit=K`` (``--limit K``) takes whole N-series, in a seeded shuffle of the series, until at least K configs.

CLI: ``lorapack sweep GRID|--preset NAME --out DIR [--backend local|ray] [--address ADDR] [--workers N]
[--limit K] [--resume] [--no-early-stop] [--no-prune] [--seed S] [--model M] [--gpu G] [--json]``, or
``lorapack sweep GRID|--preset NAME --estimate [--estimate-configs K] ...`` (nothing written).
"""

from __future__ import annotations

from ..executor import BACKENDS
from .estimate import estimate_sweep
from .grid import (
    PRESETS,
    GridSpec,
    SweepConfig,
    enumerate_configs,
    grid_yaml,
    group_series,
    limit_order,
    load_grid,
    preset_grid,
    select_configs,
    shuffled_series,
    with_overrides,
)
from .runner import SweepOptions, build_units, run_sweep
from .store import COLUMNS, SCHEMA, TIMING_COLUMNS, read_meta, read_rows
from .work import Shortcuts, WorkUnit, early_stop_available, run_unit

__all__ = [
    "BACKENDS",
    "COLUMNS",
    "PRESETS",
    "SCHEMA",
    "TIMING_COLUMNS",
    "GridSpec",
    "Shortcuts",
    "SweepConfig",
    "SweepOptions",
    "WorkUnit",
    "build_units",
    "early_stop_available",
    "enumerate_configs",
    "estimate_sweep",
    "grid_yaml",
    "group_series",
    "limit_order",
    "load_grid",
    "preset_grid",
    "read_meta",
    "read_rows",
    "run_sweep",
    "run_unit",
    "select_configs",
    "shuffled_series",
    "with_overrides",
]
