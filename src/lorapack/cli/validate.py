"""``lorapack validate``: the twin against real benchmark runs."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from .common import (
    DEFAULT_GPU,
    ForceOpt,
    GpuOpt,
    JsonOpt,
    check_limit,
    check_output_file,
    check_workers,
    console,
    fmt,
    limits,
    print_json,
    write_csv_atomic,
)


def validate(
    runs: Annotated[Path, typer.Argument(help="Real runs CSV (schema of shared/data/real-runs/*.csv).")],
    seeds: Annotated[int, typer.Option(help="Seeds per run; metrics are averaged.")] = 1,
    gpu: GpuOpt = None,
    lengths: Annotated[str, typer.Option(help="Length law around the row's pool means: fixed|lognormal.")] = "lognormal",
    workers: Annotated[int, typer.Option(help="Parallel processes (0 = all cores).")] = 0,
    limit: Annotated[int | None, typer.Option(help="Only the first K rows (quick checks).")] = None,
    out: Annotated[Path | None, typer.Option("--out", help="Write per-run measured vs predicted CSV.")] = None,
    force: ForceOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Replay real benchmark runs through the twin and score it (SMAPE, starvation and OOM agreement)."""
    from ..validate import run_validation

    check_limit(limit)
    check_workers(workers)
    if out is not None:  # fail before the (long) validation, not after it
        check_output_file(out, "--out")
    report = run_validation(runs, seeds=seeds, gpu=gpu or DEFAULT_GPU, lengths=lengths, workers=workers,
                            limit=limit, progress=not json_out, limits=limits(force))
    if out is not None:
        write_csv_atomic(out, report["rows"])
    if json_out:
        print_json({"models": report["models"], "skipped": report["skipped"]})
        return
    t = Table(title=f"twin vs real runs: {runs.name} ({seeds} seed(s), {lengths} lengths)", title_justify="left")
    for c in ("model", "ok", "oom", "skipped", "SMAPE thr %", "SMAPE ITL %", "SMAPE TTFT %",
              "starved agree", "clear agree", "OOM agree"):
        t.add_column(c, justify="right" if c != "model" else "left")
    for m, s in report["models"].items():
        t.add_row(m, str(s["n_ok"]), str(s["n_oom"]), str(s["n_skipped"]), fmt(s["smape_throughput"], 2),
                  fmt(s["smape_itl"], 2), fmt(s["smape_ttft"], 2), fmt(s["starved_agreement"], 3),
                  fmt(s["starved_agreement_clear"], 3), fmt(s["oom_agreement"], 3))
    console.print(t)
    console.print("SMAPE without the factor 2 (0-100, twin.md §4.3); TTFT = completed-only mean.")
    for m, s in report["models"].items():
        for why, n in s.get("skip_reasons", {}).items():
            console.print(f"skipped {n} run(s) of {m}: {why}", highlight=False)
