"""The ``lorapack`` command line: parse, call the API, render with rich, map errors to exit code 2."""

from __future__ import annotations

import csv
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from .errors import LorapackError, SpecError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Plan multi-LoRA serving on vLLM with a fast digital twin of the server.")
# pipes and CI get 80 columns by default, too narrow for the tables
console = Console() if sys.stdout.isatty() else Console(width=140)
err_console = Console(stderr=True)
_DEBUG = {"on": False}


@app.callback()
def _main(debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks on errors.")] = False) -> None:
    _DEBUG["on"] = debug


def _json_safe(x: Any) -> Any:
    """NaN/inf become null; numpy scalars become Python numbers."""
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_json_safe(v) for v in x]
    if hasattr(x, "item") and not isinstance(x, str):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(_json_safe(obj), indent=2) + "\n")


def _load_profile(model: str | None, gpu: str, profile: Path | None):
    from .profile import find_profile, load_profile_file

    if profile is not None:
        return load_profile_file(profile)
    if not model:
        raise SpecError("--model is required (or --profile FILE); e.g. --model llama-3.1-8b-instruct")
    return find_profile(model, gpu)


def _fmt(v: Any, digits: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return "-" if not math.isfinite(v) else f"{v:,.{digits}f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def write_csv_atomic(path: Path, columns: dict[str, Any]) -> None:
    """Write columns (name -> sequence) to CSV via a temporary file: no half-written output on error."""
    path = Path(path)
    if not path.parent.exists():
        raise SpecError(f"cannot write {path}: directory {path.parent} does not exist")
    tmp = path.with_name(path.name + ".tmp")
    names = list(columns)
    n = len(columns[names[0]]) if names else 0
    try:
        with tmp.open("w", newline="") as f:
            w = csv.writer(f)
            w.writerow(names)
            for i in range(n):
                w.writerow([_json_safe(columns[c][i]) for c in names])
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _render_sim(out: dict, title: str) -> None:
    t = Table(title=title, show_header=False, title_justify="left")
    t.add_column("metric", style="bold")
    t.add_column("value", justify="right")
    if out["oom"]:
        t.add_row("server starts", f"[red]no[/red] ({out['error_type']}, KV {out['kv_cache_tokens']:,} tokens)")
        console.print(t)
        return
    rows = [
        ("throughput (tok/s)", _fmt(out["throughput_tok_s"])),
        ("incoming (tok/s)", _fmt(out["incoming_tok_s"])),
        ("throughput / incoming", _fmt(out["throughput_ratio"], 3)),
        ("starved", "[red]yes[/red]" if out["starved"] else "[green]no[/green]"),
        ("ITL mean (ms)", _fmt(out["itl_mean_ms"])),
        ("TTFT mean / median / p99 (ms)",
         f"{_fmt(out['ttft_mean_ms'])} / {_fmt(out['ttft_median_ms'])} / {_fmt(out['ttft_p99_ms'])}"),
        ("TTFT penalised mean (ms)", _fmt(out["ttft_penalised_mean_ms"])),
        ("requests arrived / completed", f"{out['n_arrived']:,} / {out['n_completed']:,}"),
        ("preemptions", _fmt(out["preemptions"])),
        ("adapter loads", _fmt(out["adapter_loads"])),
        ("adapters starved (per-adapter check)", _fmt(out["adapters_starved"])),
        ("KV cache (tokens)", _fmt(out["kv_cache_tokens"])),
        ("running mean / max", f"{_fmt(out['running_mean'])} / {_fmt(out['running_max'], 0)}"),
        ("waiting mean / max", f"{_fmt(out['waiting_mean'])} / {_fmt(out['waiting_max'], 0)}"),
        ("wall time (s)", _fmt(out.get("wall_s"), 3)),
    ]
    for k, v in rows:
        t.add_row(k, v)
    console.print(t)


ModelOpt = Annotated[str | None, typer.Option("--model", "-m", help="Model key, e.g. llama-3.1-8b-instruct.")]
GpuOpt = Annotated[str, typer.Option("--gpu", help="GPU key of the shipped profile.")]
ProfileOpt = Annotated[Path | None, typer.Option("--profile", help="Profile YAML (instead of --model/--gpu).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object instead of tables.")]


@app.command()
def simulate(
    workload: Annotated[Path, typer.Argument(help="Workload spec: YAML, or a CSV adapter_id,rank,rate_rps.")],
    max_loras: Annotated[int, typer.Option("--max-loras", "-a", help="--max-loras: GPU adapter slots (A_max).")],
    model: ModelOpt = None,
    gpu: GpuOpt = "h100-64gb",
    profile: ProfileOpt = None,
    max_lora_rank: Annotated[int | None, typer.Option(help="--max-lora-rank (default: largest rank).")] = None,
    max_cpu_loras: Annotated[int | None, typer.Option(help="--max-cpu-loras (default: adapters).")] = None,
    duration_s: Annotated[float | None, typer.Option(help="Window length in seconds (default 3600).")] = None,
    seed: Annotated[int, typer.Option(help="Random seed of the arrivals and lengths.")] = 0,
    mean_input_tokens: Annotated[float | None, typer.Option(help="Override the mean prompt tokens.")] = None,
    mean_output_tokens: Annotated[float | None, typer.Option(help="Override the mean output tokens.")] = None,
    client_cap: Annotated[int, typer.Option(help="Client-saturation cap on waiting requests (0 = off).")] = 0,
    max_model_len: Annotated[int | None, typer.Option(help="--max-model-len (default: the model's).")] = None,
    cold_start: Annotated[bool, typer.Option(help="Start with empty GPU adapter slots.")] = False,
    early_stop: Annotated[bool, typer.Option(
        help="Stop once the outcome is clear (healthy, or starving) and extrapolate the run-level metrics "
             "(needs --client-cap 0; see stop_reason / simulated_s).")] = False,
    timeline: Annotated[Path | None, typer.Option(help="Write the 2 s timeline to this CSV.")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Simulate one vLLM server serving WORKLOAD's adapters and report throughput, latency, starvation."""
    from .spec import load_workload, with_mean_lengths
    from .twin.engine import warm_up
    from .twin.run import ServerFlags
    from .twin.run import simulate as run_sim

    prof = _load_profile(model, gpu, profile)
    wl = load_workload(workload)
    if mean_input_tokens is not None or mean_output_tokens is not None:
        # validated like the spec itself (finite, >= 1, reachable lognormal target, not 'empirical')
        if getattr(wl.arrivals, "trace_lengths", False):
            raise SpecError("--mean-input-tokens/--mean-output-tokens: the workload replays the trace's own "
                            "lengths (arrivals.trace_lengths: true); set trace_lengths: false to use them")
        try:
            wl = with_mean_lengths(wl, mean_input_tokens, mean_output_tokens)
        except SpecError as e:
            raise SpecError(f"--mean-input-tokens/--mean-output-tokens: {e}") from None
    compile_s = warm_up()
    flags = ServerFlags(max_loras=max_loras, max_lora_rank=max_lora_rank, max_cpu_loras=max_cpu_loras,
                        max_model_len=max_model_len, client_cap=client_cap, warm_start=not cold_start)
    from .twin.early import EarlyStopOptions

    out, res = run_sim(prof, wl, flags, duration_s, seed, EarlyStopOptions() if early_stop else None)
    out["compile_s"] = compile_s
    if timeline is not None:
        if res is None:
            raise SpecError(f"--timeline {timeline}: no timeline, the server would not start ({out['error_type']})")
        # gauges that count things are integers (as in vLLM's /metrics), the rest stay floats
        write_csv_atomic(timeline, {k: ([int(x) for x in v] if k.startswith("num_") else v)
                                    for k, v in res.timeline.items()})
    if json_out:
        print_json(out)
    else:
        srv = out["server"]
        _render_sim(out, f"{prof.model} on {prof.gpu}: {wl.n_adapters} adapters, A={srv['max_loras']}, "
                         f"S={srv['max_lora_rank']}, {out['duration_s']:g} s, seed {seed}")


@app.command()
def validate(
    runs: Annotated[Path, typer.Argument(help="Real runs CSV (schema of shared/data/real-runs/*.csv).")],
    seeds: Annotated[int, typer.Option(help="Seeds per run; metrics are averaged.")] = 1,
    gpu: GpuOpt = "h100-64gb",
    lengths: Annotated[str, typer.Option(help="Length law around the row's pool means: fixed|lognormal.")] = "lognormal",
    workers: Annotated[int, typer.Option(help="Parallel processes (0 = all cores).")] = 0,
    limit: Annotated[int | None, typer.Option(help="Only the first K rows (quick checks).")] = None,
    out: Annotated[Path | None, typer.Option("--out", help="Write per-run measured vs predicted CSV.")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Replay real benchmark runs through the twin and score it (SMAPE, starvation and OOM agreement)."""
    from .validate import run_validation

    if out is not None and not out.parent.exists():  # fail before the (long) validation, not after it
        raise SpecError(f"cannot write {out}: directory {out.parent} does not exist")
    report = run_validation(runs, seeds=seeds, gpu=gpu, lengths=lengths, workers=workers, limit=limit,
                            progress=not json_out)
    if out is not None:
        write_csv_atomic(out, report["rows"])
    if json_out:
        print_json({"models": report["models"]})
        return
    t = Table(title=f"twin vs real runs: {runs.name} ({seeds} seed(s), {lengths} lengths)", title_justify="left")
    for c in ("model", "ok", "oom", "skipped", "SMAPE thr %", "SMAPE ITL %", "SMAPE TTFT %",
              "starved agree", "clear agree", "OOM agree"):
        t.add_column(c, justify="right" if c != "model" else "left")
    for m, s in report["models"].items():
        t.add_row(m, str(s["n_ok"]), str(s["n_oom"]), str(s["n_skipped"]), _fmt(s["smape_throughput"], 2),
                  _fmt(s["smape_itl"], 2), _fmt(s["smape_ttft"], 2), _fmt(s["starved_agreement"], 3),
                  _fmt(s["starved_agreement_clear"], 3), _fmt(s["oom_agreement"], 3))
    console.print(t)
    console.print("SMAPE without the factor 2 (0-100, twin.md §4.3); TTFT = completed-only mean.")


@app.command()
def profiles() -> None:
    """List the shipped profiles."""
    from .profile import available_profiles, load_profile_file

    t = Table(title="shipped profiles", title_justify="left")
    for c in ("gpu", "model", "vLLM", "max_model_len", "max A at S=8/16/32"):
        t.add_column(c)
    for g, m, p in available_profiles():
        prof = load_profile_file(p)
        lim = "/".join(str(prof.max_slots(s, limit=1024)) for s in (8, 16, 32))
        t.add_row(g, m, prof.vllm_version, f"{prof.max_model_len:,}", lim)
    console.print(t)


@app.command()
def demo(
    model: Annotated[str, typer.Option("--model", "-m", help="Model key.")] = "llama-3.1-8b-instruct",
    json_out: JsonOpt = False,
) -> None:
    """Simulate the shipped example workload at several --max-loras values and show which are safe."""
    from .profile import find_profile
    from .spec import example_workload, load_workload
    from .twin.engine import warm_up
    from .twin.run import ServerFlags
    from .twin.run import simulate as run_sim

    prof = find_profile(model)
    path = example_workload()
    wl = load_workload(path)
    compile_s = warm_up()
    results = []
    t0 = time.perf_counter()
    for a in (4, 8, 16, 32, 64, 128, 256):
        if a > wl.n_adapters:
            break
        out, _ = run_sim(prof, wl, ServerFlags(max_loras=a), None, 0)
        results.append(out)
    wall = time.perf_counter() - t0
    if json_out:
        print_json({"workload": str(path), "model": model, "compile_s": compile_s, "wall_s": wall,
                    "results": results})
        return
    rates = wl.rates_rps
    console.print(f"[bold]lorapack demo[/bold]: {wl.n_adapters} adapters (ranks {sorted(set(wl.ranks.tolist()))}, "
                  f"{rates.sum():.2f} req/s in total) on one {prof.gpu} serving {prof.model}, "
                  f"one simulated hour per row.")
    t = Table(title_justify="left")
    for c in ("A_max", "starts", "KV tok", "thr tok/s", "in tok/s", "ratio", "starved", "adapters starved",
              "ITL ms", "TTFT ms", "loads"):
        t.add_column(c, justify="right", overflow="fold")
    for r in results:
        srv = r["server"]
        if r["oom"]:
            t.add_row(str(srv["max_loras"]), "[red]no[/red]", _fmt(r["kv_cache_tokens"]), *["-"] * 8)
            continue
        t.add_row(str(srv["max_loras"]), "yes", _fmt(r["kv_cache_tokens"]), _fmt(r["throughput_tok_s"]),
                  _fmt(r["incoming_tok_s"]), _fmt(r["throughput_ratio"], 3),
                  "[red]yes[/red]" if r["starved"] else "[green]no[/green]", _fmt(r["adapters_starved"]),
                  _fmt(r["itl_mean_ms"]), _fmt(r["ttft_mean_ms"], 0), _fmt(r["adapter_loads"]))
    console.print(t)
    ok = [r for r in results if not r["oom"] and not r["starved"] and not r["adapter_starved"]]
    if ok:
        best = min(ok, key=lambda r: r["ttft_mean_ms"])
        console.print("Safe = server starts, throughput >= 0.9 x incoming, and no adapter starved "
                      "(each adapter >= 90 % of its tokens served, none waiting > 5 min).")
        console.print(f"Smallest safe --max-loras: [bold]{ok[0]['server']['max_loras']}[/bold]; lowest TTFT at "
                      f"--max-loras {best['server']['max_loras']}. "
                      f"({len(results)} simulated hours in {wall:.2f} s; one-off compile {compile_s:.1f} s.)")
    else:
        console.print("[red]No --max-loras value serves this workload on one GPU without starvation.[/red]")


@app.command()
def sweep(
    grid: Annotated[Path | None, typer.Argument(help="Grid spec YAML (or use --preset).")] = None,
    preset: Annotated[str | None, typer.Option(help="Built-in grid: paper-llama | paper-qwen.")] = None,
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
    model: Annotated[str | None, typer.Option("--model", "-m", help="Override the grid's model.")] = None,
    gpu: Annotated[str | None, typer.Option("--gpu", help="Override the grid's GPU.")] = None,
    print_grid: Annotated[bool, typer.Option("--print-grid", help="Print the grid as YAML and exit.")] = False,
    json_out: JsonOpt = False,
) -> None:
    """Run the twin over a grid of configurations and append one row per config to Parquet parts in --out."""
    from .sweep import Shortcuts, grid_yaml, load_grid, preset_grid, run_sweep, with_overrides

    if (grid is None) == (preset is None):
        raise SpecError("give exactly one of GRID (a YAML file) or --preset NAME (paper-llama, paper-qwen)")
    spec = with_overrides(load_grid(grid) if grid is not None else preset_grid(preset), model, gpu, seed)
    if print_grid:
        sys.stdout.write(grid_yaml(spec))
        return
    if out is None:
        raise SpecError("--out DIR is required")
    tests = {t.strip() for t in early_stop_tests.split(",") if t.strip()}
    if not tests <= {"certain", "likely", "healthy"}:
        raise SpecError(f"--early-stop-tests {early_stop_tests}: expected a comma list of certain, likely, healthy")
    shortcuts = Shortcuts(early_stop=early_stop, certain="certain" in tests, likely="likely" in tests,
                          healthy="healthy" in tests, prune=prune)
    summary = run_sweep(spec, out, backend=backend, address=address, workers=workers, limit=limit,
                        resume=resume, shortcuts=shortcuts, progress=not json_out)
    if json_out:
        print_json(summary)
        return
    console.print(f"[bold]{spec.name}[/bold]: {summary['rows']:,} rows written to {summary['out']} "
                  f"({summary['simulated']:,} simulated, {summary['early_stopped']:,} of them stopped early; "
                  f"{summary['pruned']:,} pruned; {summary['skipped_oom']:,} oom; {summary['already_done']:,} "
                  f"already there) in {summary['wall_s']:.1f} s = {summary['configs_per_s']:.1f} configs/s; "
                  f"grid size {summary['grid_size']:,}.")
    if not summary["early_stop_active"] and early_stop:
        console.print("note: this twin has no early termination; every simulated row is a full run.")


from .calibrate.cli_command import calibrate_command  # noqa: E402  (typer command defined with its module)

app.command("calibrate")(calibrate_command)


def main() -> None:
    """Console entry point: user errors -> one line on stderr, exit code 2."""
    try:
        app(standalone_mode=False)
    except LorapackError as e:
        if _DEBUG["on"] or os.environ.get("LORAPACK_DEBUG"):
            raise
        err_console.print(f"[red]error:[/red] {e}", highlight=False, soft_wrap=True)
        sys.exit(2)
    except (KeyboardInterrupt, BrokenPipeError):
        sys.exit(130)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except Exception as e:  # click usage errors and aborts
        usage, aborts = _click_exception_types()
        if isinstance(e, aborts):
            sys.exit(130)
        if isinstance(e, usage):
            e.show()
            sys.exit(2)
        raise


def _click_exception_types() -> tuple[tuple[type, ...], tuple[type, ...]]:
    """Usage-error and abort classes: typer >= 0.2x vendors click as ``typer._click``, older typer uses click."""
    import importlib

    usage: list[type] = []
    aborts: list[type] = [typer.Abort] if hasattr(typer, "Abort") else []
    for name in ("typer._click.exceptions", "click.exceptions"):
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        usage.append(mod.ClickException)
        if hasattr(mod, "Abort"):
            aborts.append(mod.Abort)
    return tuple(usage), tuple(aborts)


if __name__ == "__main__":
    main()
