"""``lorapack calibrate``: fit a profile; the work is in ``lorapack.calibrate.command.calibrate``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from ..benchjson import BenchOptions
from ..calibrate.refine import DEFAULT_FREE, GROUP_BIAS_WEIGHT
from .common import check_workers, console, err_console, fmt, print_json
from .validate import BenchAdapterRanks, BenchMaxCpuLoras, BenchMaxLoraRank, BenchMaxLoras


def calibrate(
    profiling: Annotated[Path, typer.Option("--profiling", help="A measurement directory of lorapack measure, "
                                            "or a profiling directory laid out like shared/data/profiling (see "
                                            "its README for the columns).")],
    model: Annotated[str | None, typer.Option("--model", "-m", help="Model key, e.g. llama-3.1-8b-instruct "
                                              "(a measurement directory names its own).")] = None,
    gpu: Annotated[str | None, typer.Option("--gpu", help="GPU key recorded in the profile (default: h100-64gb; "
                                            "a measurement: its device).")] = None,
    runs: Annotated[list[Path] | None, typer.Option("--runs", metavar="<path>", help=(
        "End-to-end runs: a runs CSV (schema of real-runs/calibration.csv) or vllm bench serve result JSON "
        "files (repeat --runs; docs/bench-json.md): refine the step-time constants."))] = None,
    out: Annotated[Path | None, typer.Option("--out", help="Profile YAML to write (default: "
                                             "<gpu>__vllm-<version>__<model>.yaml here).")] = None,
    report: Annotated[Path | None, typer.Option("--report", help="Write PNG fit-report plots here.")] = None,
    vllm_version: Annotated[str | None, typer.Option("--vllm-version", help="vLLM version recorded in the "
                                                     "profile (default: 0.8.5; a measurement: the server's).")
                            ] = None,
    max_model_len: Annotated[int | None, typer.Option("--max-model-len", help="Server context limit (needed for "
                                                      "models lorapack does not know).")] = None,
    seeds: Annotated[int, typer.Option(help="Seeds per run in the refinement and validation.")] = 1,
    lengths: Annotated[str, typer.Option(help="Length law used to rebuild the runs: lognormal|fixed.")
                       ] = "lognormal",
    max_evals: Annotated[str, typer.Option("--max-evals", help="Most least-squares evaluations of the two "
                                           "refinement stages (subset, all runs); each stage normally stops "
                                           "earlier, at its tolerance.")] = "40,20",
    max_minutes: Annotated[float, typer.Option("--max-minutes", help="Wall-time cap of the refinement (both "
                                               "stages); the best point so far is kept and the output says the "
                                               "fit did not converge.")] = 15.0,
    start: Annotated[Path | None, typer.Option("--start", help="Start the refinement from this profile's "
                                               "constants instead of the priors (the priors stay the "
                                               "regularisation).")] = None,
    free: Annotated[str, typer.Option("--free", show_default=False,
                                      help="Step-time constants to refine (comma-separated); default: "
                                           + ", ".join(DEFAULT_FREE) + ".")] = ",".join(DEFAULT_FREE),
    itl_weight: Annotated[float, typer.Option("--itl-weight", help="Weight of each run's ITL residual "
                                              "relative to its throughput residual.")] = 1.0,
    group_weight: Annotated[float, typer.Option("--group-weight", help="Weight of each run group's mean "
                                                "throughput error (times sqrt(runs in the group); 0 = off).")
                            ] = GROUP_BIAS_WEIGHT,
    ttft_weight: Annotated[float, typer.Option("--ttft-weight", help="Weight of the mean-TTFT residual of each "
                                               "run whose real mean TTFT is 1-30 s (queueing, not flooded); "
                                               "0 = off.")] = 0.0,
    workers: Annotated[int, typer.Option(help="Parallel processes (0 = all cores).")] = 0,
    max_loras: BenchMaxLoras = None,
    max_lora_rank: BenchMaxLoraRank = None,
    max_cpu_loras: BenchMaxCpuLoras = None,
    adapter_ranks: BenchAdapterRanks = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of tables.")] = False,
) -> None:
    """Fit a profile from profiling data (closed-form priors), refine it against real runs, write it."""
    from ..calibrate.command import CalibrateOptions, RefinementOptions
    from ..calibrate.command import calibrate as run_calibration
    from ..errors import DataError

    check_workers(workers)  # the same rule as every command's --workers (before the fits, not after)
    try:
        evals = tuple(int(x) for x in max_evals.split(","))
        if len(evals) != 2 or min(evals) < 0:
            raise ValueError
    except ValueError:
        raise DataError(f"--max-evals {max_evals}: expected two integers >= 0, e.g. 40,20") from None
    import math

    if not math.isfinite(max_minutes) or max_minutes <= 0:
        raise DataError(f"--max-minutes {max_minutes}: expected a positive number of minutes")
    start_profile = None
    if start is not None:
        from ..profile import load_profile_file

        start_profile = load_profile_file(start)
    log = None if json_out else (lambda s: err_console.print(f"[dim]{s}[/dim]", highlight=False))
    bench = BenchOptions(max_loras=max_loras, max_lora_rank=max_lora_rank, max_cpu_loras=max_cpu_loras,
                         adapter_ranks=adapter_ranks, model=model)
    runs = runs or None  # typer gives [] for a list option not used
    if runs is None and bench.given_flags():
        raise DataError(f"{', '.join(bench.given_flags())}: these describe vllm bench serve JSON runs; give "
                        f"them with --runs FILE.json")
    refinement = RefinementOptions(seeds=seeds, lengths=lengths, workers=workers,
                                   free=tuple(f.strip() for f in free.split(",") if f.strip()),
                                   max_evals=evals, max_wall_s=max_minutes * 60.0,  # type: ignore[arg-type]
                                   itl_weight=itl_weight, group_weight=group_weight, ttft_weight=ttft_weight,
                                   start=start_profile)
    options = CalibrateOptions(model=model, gpu=gpu, vllm_version=vllm_version, max_model_len=max_model_len,
                               refinement=refinement)
    summary = run_calibration(profiling, runs, out, options, report=report, bench=bench, log=log)
    ref = summary.get("refinement")
    if ref is not None and not ref.get("refined", True):
        err_console.print("[yellow]warning:[/yellow] the refinement changed no constant: the 'refined' values "
                          "are the starting values", highlight=False)
    elif ref is not None and not ref.get("converged", True):
        err_console.print("[yellow]warning:[/yellow] the refinement did not converge (budget or --max-minutes "
                          "reached); the best point found is written", highlight=False)
    if json_out:
        print_json(summary)
        return
    render_calibration(summary, summary["model"], summary["gpu"])
    if summary.get("report"):
        console.print(f"report: {len(summary['report'])} plots in {report}", markup=False)
    console.print(f"wrote {summary['profile']}", markup=False)


def _param(k: str, v) -> str:
    if isinstance(v, dict):  # e.g. the disk load medians per rank
        return f"{k}: " + ", ".join(f"{kk}={fmt(vv, 1) if isinstance(vv, float) else vv}" for kk, vv in v.items())
    return f"{k}={fmt(v, 4) if isinstance(v, float) else v}"


def render_calibration(summary: dict, model: str, gpu: str, con: Console | None = None) -> None:
    """The fits, the refinement and the validation scores; every table fits 80 columns (one parameter per
    line, scores as rows)."""
    con = con or console
    t = Table(title=f"{model} on {gpu}:\nclosed-form fits (priors)", title_justify="left", box=box.SIMPLE_HEAD,
              show_edge=False, pad_edge=False)
    t.add_column("fit", no_wrap=True)
    t.add_column("parameters", overflow="fold")
    for c in ("R2", "rmse", "n"):
        t.add_column(c, justify="right", no_wrap=True)
    for name, f in summary["fits"].items():
        params = "\n".join(_param(k, v) for k, v in f["parameters"].items())
        t.add_row(name, params, fmt(f.get("r2"), 4), fmt(f.get("rmse"), 3), fmt(f.get("n_points")))
    con.print(t)
    if "refinement" not in summary:
        return
    t = Table(title="simulation-based refinement of the step-time constants", title_justify="left",
              box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    t.add_column("constant (profile field)", overflow="fold")
    t.add_column("unit", overflow="fold")
    for c in ("prior", "refined"):
        t.add_column(c, justify="right", no_wrap=True)
    for n, f in summary["refinement"]["free"].items():
        t.add_row(f"{n} ({f['field']})", f["unit"], fmt(f["prior"], 5), fmt(f["refined"], 5))
    con.print(t)
    v = summary["validation"]
    t = Table(title=f"validation on {v['runs']}\n({v['seeds']} seed(s), {v['lengths']} lengths)",
              title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    t.add_column("score")
    for k in ("priors", "refined"):
        t.add_column(k, justify="right", no_wrap=True)
    for label, key, digits in (("SMAPE throughput %", "smape_throughput", 2), ("SMAPE ITL %", "smape_itl", 2),
                               ("SMAPE TTFT %", "smape_ttft", 2),
                               ("bias throughput % (twin-real)", "bias_throughput_pct", 2),
                               ("bias ITL % (twin-real)", "bias_itl_pct", 2),
                               ("SMAPE throughput % (x2)", "smape_throughput_2x", 2),
                               ("SMAPE ITL % (x2)", "smape_itl_2x", 2), ("starved agreement", "starved_agreement", 3),
                               ("  on clear labels", "starved_agreement_clear", 3),
                               ("OOM agreement", "oom_agreement", 3)):
        t.add_row(label, fmt(v["priors"].get(key), digits), fmt(v["refined"].get(key), digits))
    con.print(t)
