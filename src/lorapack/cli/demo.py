"""``lorapack demo``: what ``make demo`` runs -- one realistic evaluate scenario, end to end, in seconds."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from .common import JsonOpt, check_workers, console, fmt, print_json

FALLBACK_METHOD = "proposed-exact"  # stands in for the first demo method when the learned models are missing
SYNTHETIC_RATE_RPS = 5.53  # the conversation trace's mean rate
SYNTHETIC_SPAN_S = 3502.0


def _synthetic_trace(path: Path, seed: int = 0) -> Path:
    """A Poisson stand-in for the conversation trace (used only when the shared data is absent)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    t = np.cumsum(rng.exponential(1.0 / SYNTHETIC_RATE_RPS, size=int(SYNTHETIC_RATE_RPS * SYNTHETIC_SPAN_S * 1.2)))
    t = t[t < SYNTHETIC_SPAN_S]
    path.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n"
                    + "".join(f"{x:.3f},223,197\n" for x in t))
    return path


def _demo_scenario(model: str, tmp: Path) -> tuple[object, str]:
    """The shipped demo scenario (``examples/demo-scenario.yaml``) for ``model``; a synthetic trace when the
    Azure trace is not available. Returns ``(scenario, note)``."""
    from dataclasses import replace

    from ..evaluate.scenario import load_scenarios
    from ..workload import example_workload

    src = example_workload("demo-scenario.yaml")
    text = src.read_text()
    note = ""
    from ..evaluate.scenario import SHIPPED_TRACES, data_traces_dir

    if not (data_traces_dir() / SHIPPED_TRACES["azure-conv"]).is_file():
        trace = _synthetic_trace(tmp / "synthetic-conv.csv")
        text = text.replace("trace: azure-conv", f"trace: {trace}")
        note = (f"(the Azure trace is not at {data_traces_dir()}: a Poisson trace at the same mean rate stands in; "
                f"set LORAPACK_DATA to the shared data directory for the real one)")
    path = tmp / "demo-scenario.yaml"
    path.write_text(text)
    (sc,) = load_scenarios(path)
    from ..profile import find_profile

    prof = find_profile(model, sc.gpu)  # an unknown model fails here, with the shipped choices
    return replace(sc, model=prof.model, name="demo"), note


def demo(
    model: Annotated[str, typer.Option("--model", "-m", help="Model key.")] = "llama-3.1-8b-instruct",
    out: Annotated[Path, typer.Option("--out", help="Where the proposed plan is written (plan.json, serve.sh, "
                                                    "routes.json).")] = Path("lorapack-demo"),
    workers: Annotated[int, typer.Option(help="Processes for twin runs (0 = all cores).")] = 2,
    json_out: JsonOpt = False,
) -> None:
    """Place a realistic trace-derived workload with `proposed` and the baselines, verify, replay the second
    half-hour through the twin, and show GPUs used against the lower bound."""
    import tempfile

    from ..evaluate.parallel import ExecutorMapper, replay_executor
    from ..evaluate.placers import default_placer
    from ..evaluate.runner import evaluate_scenarios
    from ..placement.export import check_out_dir, write_outputs
    from ..placement.plan import plan_from_dict
    from ..placement.registry import methods as registered
    from ..twin.engine import warm_up

    t_start = time.perf_counter()
    workers = check_workers(workers) or (os.cpu_count() or 1)
    check_out_dir(out)
    compile_s = warm_up()
    placer = default_placer(workers)
    methods = [m.name for m in registered() if m.in_demo]
    proposed = methods[0]
    # the synthetic trace (no shared data) is read during the evaluation: keep its directory until then
    with tempfile.TemporaryDirectory() as tmp, replay_executor(workers) as ex:
        mapper = ExecutorMapper(ex)
        sc, note = _demo_scenario(model, Path(tmp))
        doc = evaluate_scenarios([sc], placer, tuple(methods), mapper=mapper, keep_plans=True)
        first = doc["scenarios"][0]["methods"][methods[0]]
        if first.get("error"):  # no learned models in this build: the twin is the oracle instead
            note = (note + " " if note else "") + (f"({methods[0]} is not available -- {first['error']} -- so "
                                                   f"{FALLBACK_METHOD}, the twin as the oracle, stands in)")
            methods[0] = FALLBACK_METHOD
            more = evaluate_scenarios([sc], placer, (FALLBACK_METHOD,), mapper=mapper, keep_plans=True)
            entry = doc["scenarios"][0]
            entry["methods"] = {FALLBACK_METHOD: more["scenarios"][0]["methods"][FALLBACK_METHOD],
                                **{m: r for m, r in entry["methods"].items() if m != proposed}}
            entry["plans"].update(more["scenarios"][0]["plans"])
    entry = doc["scenarios"][0]
    main = methods[0]
    written = []
    plan_d = entry["plans"].get(f"{main}/smallest")
    if plan_d is not None and not plan_d.get("infeasible"):
        written = [str(p) for p in write_outputs(plan_from_dict(plan_d), out)]
    wall = time.perf_counter() - t_start
    if json_out:
        from ..evaluate.report import contract_json

        payload = contract_json({**doc, "scenarios": [{k: v for k, v in entry.items() if k != "plans"}]})
        payload.update(files=written, wall_s=wall, compile_s=compile_s, note=note)
        print_json(payload)
        return
    _print(entry, main, written, wall, compile_s, note)


def _clean_text(entry: dict) -> str:
    """What a clean replay means for this scenario, in one sentence (its latency limits from
    ``Objective.describe``: "mean TTFT <= 2 s", or "none (throughput only)")."""
    limits = entry.get("objective_limits") or ""
    clauses = ["every GPU starts", "no GPU is starved (< 90 % of its tokens served)", "no adapter is starved"]
    if limits and not limits.startswith("none"):
        clauses.append(f"every GPU meets {limits}")
    return "Clean: " + ", ".join(clauses[:-1]) + " and " + clauses[-1] + "."


def _print(entry: dict, main: str, written: list[str], wall: float, compile_s: float, note: str) -> None:
    s, w = entry["scenario"], entry["workload"]
    console.print(
        f"[bold]lorapack demo[/bold]: {s['n_adapters']} LoRA adapters (ranks {'/'.join(map(str, s['ranks']))}, "
        f"{s['weights']} popularity) on {s['model']}, fed by the Azure conversation trace at ×{s['load_scale']:g}. "
        f"Rates are estimated on the first half-hour ({w['aggregate_rate_rps']:.0f} req/s ≈ "
        f"{w['offered_tok_s']:,.0f} tok/s); each method places the adapters; the second half-hour "
        f"({w['replay_requests']:,} requests, {w['replay_rate_rps']:.0f} req/s) is replayed through the twin, one "
        f"simulated vLLM server per GPU.")
    if note:
        console.print(note)
    t = Table(title_justify="left")
    for c in ("method", "GPUs", "replay", "best case", "TTFT mean s", "TTFT p99 s", "ITL ms", "placement"):
        t.add_column(c, justify="left" if c in ("method", "replay") else "right")
    for m, r in entry["methods"].items():
        label = f"[bold]{m}[/bold]" if m == main else m
        if r.get("error") or r.get("infeasible"):
            t.add_row(label, "-", f"[red]{r.get('error') or r.get('reason')}[/red]", "-", "-", "-", "-", "-")
            continue
        g = r.get("gpus_used")
        if r.get("replay_clean"):
            verdict = "[green]clean[/green]"
        else:
            parts = [f"{r[k]} {lab}" for k, lab in (("starved_gpus", "starved"), ("oom_gpus", "refused"),
                                                      ("latency_violation_gpus", "over TTFT")) if r.get(k)]
            verdict = "[red]" + ", ".join(parts) + "[/red]"
        added = r.get("verification_added_gpus")
        gtxt = fmt(g) if g is not None else "[red]none[/red]"
        if added:
            gtxt += f" (+{added} by verification)"
        place_txt = f"{r['placement_ms']:,.0f} ms" if r.get("placement_ms") is not None else "-"
        best = r.get("best_case")
        best_txt = "-" if best is None else fmt(best["gpus_used"]) if best.get("gpus_used") is not None \
            else "[red]none[/red]"
        t.add_row(label, gtxt, verdict, best_txt, fmt(r.get("ttft_mean_s"), 2), fmt(r.get("ttft_p99_s"), 1),
                  fmt(r.get("itl_mean_ms")), place_txt)
    console.print(t)
    console.print(f"Lower bound: [bold]{entry['lower_bound_gpus']}[/bold] GPUs (no plan can use fewer). GPUs: "
                  f"{main}'s own count, verified by the twin on the first half-hour; for each baseline, the smallest "
                  f"pool whose plan passes that same verification. Best case: a baseline's smallest pool whose "
                  f"replay of the second half-hour is clean, which no planner can know in advance. {_clean_text(entry)}")
    if written:
        console.print(f"{main}'s plan: [bold]{escape(str(written[0]))}[/bold] (with serve.sh and routes.json beside it).")
    console.print(f"Done in {wall:.1f} s (engine compile {compile_s:.1f} s, cached after the first run). "
                  f"More: lorapack evaluate --help, docs/evaluation.md.")
