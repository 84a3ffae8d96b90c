"""``lorapack evaluate``: trace-derived scenarios, every placement method, replay through the twin."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from ..errors import SpecError
from .common import (
    JsonOpt,
    VllmVersionOpt,
    apply_vllm_version,
    check_output_dir,
    check_workers,
    console,
    fmt,
    print_json,
)


def check_out_dir(out: Path) -> Path:
    """Fail before any work when ``out`` cannot be used as an output directory (``lorapack.checks``)."""
    return check_output_dir(out, "--out")


def _methods_option(text: str | None) -> tuple[str, ...] | None:
    if text is None:
        return None
    names = tuple(m.strip() for m in text.split(",") if m.strip())
    if not names:
        raise SpecError("--methods: expected a comma list of method names")
    return names


def evaluate(
    scenarios: Annotated[list[Path], typer.Argument(help="Scenario YAML file(s) (see docs/evaluation.md).")],
    methods: Annotated[str | None, typer.Option(
        "--methods", help="Comma list of placement methods (default: the files' lists, else all).")] = None,
    out: Annotated[Path | None, typer.Option(
        "--out", help="Write results.json, report.md, figures/ and plans/ here.")] = None,
    budget_s: Annotated[float | None, typer.Option(
        "--budget-s", help="Stop starting new work after T seconds; the report lists what was skipped.")] = None,
    objective: Annotated[str | None, typer.Option(
        "--objective", help="Override the files' objective: default (latency objective) | throughput.")] = None,
    workers: Annotated[int, typer.Option(
        help="Processes for twin runs inside one scenario: GPU replays, verification (0 = all cores).")] = 1,
    jobs: Annotated[int, typer.Option(
        help="Scenario groups (scenarios sharing a workload) evaluated in parallel processes.")] = 1,
    max_pack: Annotated[bool, typer.Option("--max-pack/--no-max-pack",
                                           help="Single-GPU Max_pack curves (where the files ask for them).")] = True,
    vllm_version: VllmVersionOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Derive workloads from a trace, place them with every method (smallest pool and fixed pool), replay
    the plans through the twin per GPU, and report GPUs, lower bound, starvation, OOM, throughput, latency."""
    from dataclasses import replace

    from ..evaluate.parallel import ExecutorMapper, replay_executor
    from ..evaluate.placers import check_methods, default_placer
    from ..evaluate.report import contract_json, write_outputs, write_results
    from ..evaluate.runner import Budget, evaluate_scenarios
    from ..evaluate.scenario import OBJECTIVE_NAMES, load_scenarios

    if budget_s is not None and (not math.isfinite(budget_s) or budget_s <= 0):
        raise SpecError(f"--budget-s {budget_s}: expected a positive number of seconds")
    if jobs < 1:
        raise SpecError(f"--jobs {jobs}: expected an integer >= 1")
    check_workers(workers)
    if objective is not None and objective not in OBJECTIVE_NAMES:
        raise SpecError(f"--objective {objective}: expected one of {', '.join(OBJECTIVE_NAMES)}")
    if out is not None:
        out = check_out_dir(out)
    workers_n = workers or (os.cpu_count() or 1)
    placer = default_placer(workers_n)
    meths = _methods_option(methods)
    if meths is not None:
        check_methods(meths, placer)
    scs = []
    for path in scenarios:
        scs.extend(load_scenarios(path))
    if objective is not None:
        seen: set[tuple] = set()
        merged = []
        for s in scs:
            s2 = replace(s, objective=objective, objective_limits=None)
            key = (s2.workload_key(), s2.methods, s2.fixed_pool)
            if key not in seen:  # the objective axis collapses onto the override
                seen.add(key)
                merged.append(s2)
        scs = merged
    if not max_pack:
        scs = [replace(s, max_pack=False) for s in scs]
    if vllm_version is not None:  # checked (and warned about) once per distinct profile, before any work
        from ..evaluate.runner import load_scenario_profile

        for key in {(s.model, s.gpu, s.profile_file) for s in scs}:
            sc = next(s for s in scs if (s.model, s.gpu, s.profile_file) == key)
            apply_vllm_version(load_scenario_profile(sc), vllm_version)
        scs = [replace(s, vllm_version=vllm_version) for s in scs]
    # drift scenarios (a 'drift' block) run after the others, one at a time (lorapack.evaluate.drift)
    drift_scs = [s for s in scs if s.drift is not None]
    scs = [s for s in scs if s.drift is None]
    if drift_scs and meths is not None:
        if len(meths) != 1:
            raise SpecError(f"--methods {methods}: a drift scenario plans every policy with one method; expected one")
        drift_scs = [replace(s, methods=meths) for s in drift_scs]
    names = [s.name for s in scs + drift_scs]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise SpecError(f"two scenarios are named {dup!r}; give the scenario files distinct 'name' fields")

    from ..evaluate.drift import DriftRun, drift_units, evaluate_drift

    n_units = sum(len(meths or s.methods or placer.methods()) for s in scs) + sum(drift_units(s) for s in drift_scs)
    from ..twin.engine import warm_up

    warm_up()
    partial: dict = {"scenarios": []}

    def on_scenario(entry: dict) -> None:  # results.json grows as scenarios finish
        partial["scenarios"].append({k: v for k, v in entry.items() if k != "plans"})
        if out is not None:
            write_results(partial, out)

    from contextlib import nullcontext

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    bar = (nullcontext() if json_out else
           Progress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), console=console, transient=True))
    with bar:
        task = bar.add_task("evaluate", total=n_units) if not json_out else None

        def on_step(text: str, done: int) -> None:
            if task is not None:
                bar.update(task, description=text, advance=done)

        if not scs:
            from ..evaluate.runner import RESULTS_FORMAT, SMALLEST_POOL_PROTOCOL

            doc = {"format": RESULTS_FORMAT, "smallest_pool_protocol": SMALLEST_POOL_PROTOCOL, "scenarios": [],
                   "max_pack": [], "skipped": [], "budget_s": budget_s, "wall_s": 0.0}
        elif jobs > 1:
            from ..evaluate.jobs import evaluate_parallel

            def on_group(d: dict) -> None:
                for entry in d["scenarios"]:
                    on_scenario(entry)
                    on_step(f"{entry['name']} done", len(entry["methods"]))
                for k in d["skipped"]:
                    on_step(f"skipped {k['scenario']}", len(k["methods"]) if k["what"] != "max_pack" else 0)

            doc = evaluate_parallel(scs, meths, budget_s, jobs, workers_n, keep_plans=out is not None,
                                    on_group=on_group)
        else:
            with replay_executor(workers_n) as ex:
                doc = evaluate_scenarios(scs, placer, meths, Budget(budget_s), ExecutorMapper(ex), on_step=on_step,
                                         on_scenario=on_scenario, keep_plans=out is not None)
        if drift_scs:
            import time

            t_drift = time.perf_counter()
            partial["drift"] = []

            def on_drift(entry: dict) -> None:
                partial["drift"].append({k: v for k, v in entry.items() if k != "plans"})
                if out is not None:
                    write_results(partial, out)

            with replay_executor(workers_n) as ex:
                doc["drift"] = evaluate_drift(drift_scs, DriftRun(workers=workers_n, mapper=ExecutorMapper(ex),
                                                                  on_step=on_step, keep_plans=out is not None),
                                              on_drift)
            doc["wall_s"] = doc.get("wall_s", 0.0) + time.perf_counter() - t_drift
    files = write_outputs(doc, out) if out is not None else {}
    if json_out:
        payload = contract_json(doc)
        if files:
            payload["files"] = files
        print_json(payload)
        return
    _print_tables(doc)
    if doc["skipped"]:
        console.print(f"[yellow]--budget-s {budget_s:g} spent:[/yellow] skipped "
                      + ", ".join(f"{s['scenario']} ({s['what']}"
                                  + (f": {', '.join(s['methods'])}" if s["what"] == "method" else "") + ")"
                                  for s in doc["skipped"]))
    if files:
        console.print(f"Report: {files['report']}  (results.json, figures/ and plans/ beside it)", markup=False)


def _print_tables(doc: dict) -> None:
    from ..evaluate.drift import drift_table, per_window_table
    from ..evaluate.report import load_text, summary_markdown

    for entry in doc.get("drift", []):
        console.print(f"{entry['name']} (drift, {len(entry['windows'])} windows, method {entry['method']}, "
                      f"{entry['wall_s']:,.0f} s)", markup=False)
        console.print(drift_table(entry), markup=False)
        console.print(per_window_table(entry), markup=False)

    for sc in doc["scenarios"]:
        s, w = sc["scenario"], sc["workload"]
        t = Table(title=f"{sc['name']}: {s['n_adapters']} adapters, ×{s['load_scale']:g} ({load_text(w)}), "
                        f"ranks {s['ranks']}, {s['model']}, objective {s['objective']}; lower bound "
                        f"{sc['lower_bound_gpus']} GPUs",
                  title_justify="left")
        for c in ("method", "GPUs", "clean", "best case", "fixed pool", "starved", "OOM", "lat. viol.", "thr tok/s",
                  "ITL ms", "TTFT s", "TTFT p99 s", "place ms"):
            t.add_column(c, justify="right" if c != "method" else "left")
        for m, r in sc["methods"].items():
            if r.get("error"):
                t.add_row(m, f"[red]error[/red]: {r['error']}", *["-"] * 11)
                continue
            if r.get("infeasible"):
                t.add_row(m, "[red]infeasible[/red]", "-", "-", fmt(r.get("gpus_used_fixed_pool")), *["-"] * 7,
                          fmt(r.get("placement_ms"), 2))
                continue
            g = r.get("gpus_used")
            best = r.get("best_case")
            t.add_row(m, fmt(g) if g is not None else "[red]none[/red]",
                      "[green]yes[/green]" if r.get("replay_clean") else "[red]no[/red]",
                      "-" if best is None else fmt(best.get("gpus_used")) if best.get("gpus_used") is not None
                      else "[red]none[/red]",
                      fmt(r.get("gpus_used_fixed_pool")), fmt(r.get("starved_gpus")), fmt(r.get("oom_gpus")),
                      fmt(r.get("latency_violation_gpus")), fmt(r.get("throughput_tok_s"), 0),
                      fmt(r.get("itl_mean_ms")), fmt(r.get("ttft_mean_s"), 2), fmt(r.get("ttft_p99_s"), 1),
                      fmt(r.get("placement_ms"), 2))
        console.print(t)
    if doc["scenarios"]:
        console.print("GPUs: the fair smallest pool (a pool method's smallest pool whose plan passes the greedy methods' "
                      "verification on the estimation window); best case: a pool method's smallest pool whose replay is "
                      "clean (searched on the replay window, which no planner sees).", markup=False)
        console.print(summary_markdown(doc))
