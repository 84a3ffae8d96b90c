"""``lorapack calibrate``: fit a profile; the work is in ``lorapack.calibrate.command.calibrate``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ..calibrate.refine import DEFAULT_FREE
from .common import console, err_console, fmt, print_json


def calibrate(
    profiling: Annotated[Path, typer.Option("--profiling", help="Profiling directory, laid out like "
                                            "shared/data/profiling (see its README for the columns).")],
    model: Annotated[str, typer.Option("--model", "-m", help="Model key, e.g. llama-3.1-8b-instruct.")],
    gpu: Annotated[str, typer.Option("--gpu", help="GPU key recorded in the profile.")] = "h100-64gb",
    runs: Annotated[Path | None, typer.Option("--runs", help="End-to-end runs CSV (schema of shared/data/"
                                              "real-runs/calibration.csv): refine the step-time constants.")] = None,
    out: Annotated[Path | None, typer.Option("--out", help="Profile YAML to write (default: "
                                             "<gpu>__vllm-<version>__<model>.yaml here).")] = None,
    report: Annotated[Path | None, typer.Option("--report", help="Write PNG fit-report plots here.")] = None,
    vllm_version: Annotated[str, typer.Option("--vllm-version", help="vLLM version recorded in the profile.")
                            ] = "0.8.5",
    max_model_len: Annotated[int | None, typer.Option("--max-model-len", help="Server context limit (needed for "
                                                      "models lorapack does not know).")] = None,
    seeds: Annotated[int, typer.Option(help="Seeds per run in the refinement and validation.")] = 1,
    lengths: Annotated[str, typer.Option(help="Length law used to rebuild the runs: lognormal|fixed.")
                       ] = "lognormal",
    max_evals: Annotated[str, typer.Option("--max-evals", help="Least-squares evaluations of the two refinement "
                                           "stages (subset, all runs), e.g. 12,3.")] = "12,3",
    free: Annotated[str, typer.Option("--free", help="Step-time constants to refine (comma-separated).")
                    ] = ",".join(DEFAULT_FREE),
    workers: Annotated[int, typer.Option(help="Parallel processes (0 = all cores).")] = 0,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of tables.")] = False,
) -> None:
    """Fit a profile from profiling data (closed-form priors), refine it against real runs, write it."""
    from rich.table import Table

    from ..calibrate.command import calibrate as run_calibration
    from ..errors import DataError

    try:
        evals = tuple(int(x) for x in max_evals.split(","))
        if len(evals) != 2 or min(evals) < 0:
            raise ValueError
    except ValueError:
        raise DataError(f"--max-evals {max_evals}: expected two integers >= 0, e.g. 12,4") from None
    log = None if json_out else (lambda s: err_console.print(f"[dim]{s}[/dim]", highlight=False))
    summary = run_calibration(profiling, model, gpu=gpu, vllm_version=vllm_version, runs=runs, out=out, report=report,
                        seeds=seeds, lengths=lengths, workers=workers, max_evals=evals,  # type: ignore[arg-type]
                        free=[f.strip() for f in free.split(",") if f.strip()], max_model_len=max_model_len,
                        log=log)
    if json_out:
        print_json(summary)
        return
    t = Table(title=f"{model} on {gpu}: closed-form fits (priors)", title_justify="left")
    for c in ("fit", "parameters", "R2", "rmse", "n"):
        t.add_column(c)
    for name, f in summary["fits"].items():
        params = ", ".join(f"{k}={fmt(v, 4) if isinstance(v, float) else v}" for k, v in f["parameters"].items())
        t.add_row(name, params, fmt(f.get("r2"), 4), fmt(f.get("rmse"), 3), fmt(f.get("n_points")))
    console.print(t)
    if "refinement" in summary:
        t = Table(title="simulation-based refinement of the step-time constants", title_justify="left")
        for c in ("constant", "unit", "prior", "refined"):
            t.add_column(c)
        for n, f in summary["refinement"]["free"].items():
            t.add_row(f"{n} ({f['field']})", f["unit"], fmt(f["prior"], 5), fmt(f["refined"], 5))
        console.print(t)
        v = summary["validation"]
        t = Table(title=f"validation on {v['runs']} ({v['seeds']} seed(s), {v['lengths']} lengths)",
                  title_justify="left")
        for c in ("profile", "SMAPE thr %", "SMAPE ITL %", "SMAPE TTFT %", "thr 2x", "ITL 2x", "starved agree",
                  "clear agree", "OOM agree"):
            t.add_column(c, justify="right" if c != "profile" else "left")
        for k in ("priors", "refined"):
            s = v[k]
            t.add_row(k, fmt(s["smape_throughput"], 2), fmt(s["smape_itl"], 2), fmt(s["smape_ttft"], 2),
                      fmt(s["smape_throughput_2x"], 2), fmt(s["smape_itl_2x"], 2), fmt(s["starved_agreement"], 3),
                      fmt(s["starved_agreement_clear"], 3), fmt(s["oom_agreement"], 3))
        console.print(t)
    if summary.get("report"):
        console.print(f"report: {len(summary['report'])} plots in {report}")
    console.print(f"wrote {summary['profile']}")
