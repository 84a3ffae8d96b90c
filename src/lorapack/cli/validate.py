"""``lorapack validate``: the twin against real benchmark runs."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from ..errors import SpecError
from .common import (
    GpuOpt,
    JsonOpt,
    console,
    fmt,
    print_json,
    write_csv_atomic,
)


def validate(
    runs: Annotated[Path, typer.Argument(help="Real runs CSV (schema of shared/data/real-runs/*.csv).")],
    seeds: Annotated[int, typer.Option(help="Seeds per run; metrics are averaged.")] = 1,
    gpu: GpuOpt = "h100-64gb",
    lengths: Annotated[str, typer.Option(help="Length law around the row's pool means: fixed|lognormal.")] = "lognormal",
    workers: Annotated[int, typer.Option(help="Parallel processes (0 = all cores).")] = 0,
    limit: Annotated[int | None, typer.Option(help="Only the first K rows (quick checks).")] = None,
    out: Annotated[Path | None, typer.Option("--out", help="Write per-run measured vs predicted CSV.")] = None,
    engine: Annotated[str, typer.Option(help="Who predicts: twin (simulation) | surrogate | tree (learned).")] = "twin",
    models: Annotated[Path | None, typer.Option("--models", help="Model directory for --engine surrogate/tree "
                                                                 "(default: the shipped models).")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Replay real benchmark runs through the twin (or ask a learned oracle) and score it (SMAPE, starvation
    agreement and macro-F1, OOM agreement)."""
    from ..validate import run_validation

    if out is not None and not out.parent.exists():  # fail before the (long) validation, not after it
        raise SpecError(f"cannot write {out}: directory {out.parent} does not exist")
    report = run_validation(runs, seeds=seeds, gpu=gpu, lengths=lengths, workers=workers, limit=limit,
                            progress=not json_out, engine=engine, models_dir=models)
    if out is not None:
        write_csv_atomic(out, report["rows"])
    if json_out:
        print_json({"models": report["models"]})
        return
    how = f"{seeds} seed(s), {lengths} lengths" if engine == "twin" else f"{engine} models"
    t = Table(title=f"{engine} vs real runs: {runs.name} ({how})", title_justify="left")
    for c in ("model", "ok", "oom", "skipped", "SMAPE thr %", "SMAPE ITL %", "SMAPE TTFT %",
              "starved agree", "clear agree", "starved F1", "OOM agree"):
        t.add_column(c, justify="right" if c != "model" else "left")
    for m, s in report["models"].items():
        t.add_row(m, str(s["n_ok"]), str(s["n_oom"]), str(s["n_skipped"]), fmt(s["smape_throughput"], 2),
                  fmt(s["smape_itl"], 2), fmt(s["smape_ttft"], 2), fmt(s["starved_agreement"], 3),
                  fmt(s["starved_agreement_clear"], 3), fmt(s["starved_f1"], 3), fmt(s["oom_agreement"], 3))
    console.print(t)
    console.print("SMAPE without the factor 2 (0-100, twin.md §4.3); TTFT = completed-only mean.")
    n_oor = sum(s.get("n_out_of_range", 0) for s in report["models"].values())
    if n_oor:
        console.print(f"{n_oor} run(s) outside the models' training range (answered, flagged in --out's "
                      f"predicted_in_range).")
