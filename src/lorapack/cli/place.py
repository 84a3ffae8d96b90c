"""``lorapack place``: a workload's adapters onto the fewest GPUs; writes plan.json, serve.sh, routes.json."""

from __future__ import annotations

import os
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer
from rich import box
from rich.table import Table

from ..errors import LorapackError
from .common import (
    GpuOpt,
    JsonOpt,
    ModelOpt,
    ProfileOpt,
    VllmVersionOpt,
    apply_vllm_version,
    check_workers,
    console,
    err_console,
    fmt,
    load_profile,
    print_json,
)

_METHODS_HELP = ("proposed (learned models), proposed-fast (shallow trees), proposed-exact (the twin as the "
                 "oracle), proposed-lat, dlora, loraserve, least-adapters, round-robin")


class ObjectiveKind(StrEnum):
    latency = "latency"
    throughput = "throughput"


def place(
    workload: Annotated[Path, typer.Argument(
        help="Workload spec: YAML, or a CSV adapter_id,rank,rate_rps[,path] (the forecast rates).")],
    model: ModelOpt = None,
    gpu: GpuOpt = None,
    profile: ProfileOpt = None,
    gpus: Annotated[int | None, typer.Option(
        "--gpus", help="GPU pool size (default: as many as needed). A plan that needs more exits with code 2.")
    ] = None,
    method: Annotated[str, typer.Option("--method", help=f"Placement method: {_METHODS_HELP}.")] = "proposed",
    models: Annotated[Path | None, typer.Option(
        "--models", help="Directory of learned models for proposed / proposed-fast / proposed-lat "
                         "(default: the shipped ones).")] = None,
    out: Annotated[Path, typer.Option("--out", help="Output directory for plan.json, serve.sh, routes.json.")
                   ] = Path("plan"),
    objective: Annotated[ObjectiveKind, typer.Option(
        "--objective", metavar="<kind>", help="latency (default): every GPU keeps mean TTFT <= --max-ttft-s (default 2 s) and is "
                            "not starved; throughput: the paper's criterion only (>= 90 % of the offered tokens).")
    ] = ObjectiveKind.latency,
    max_ttft_s: Annotated[float | None, typer.Option(
        "--max-ttft-s", help="Mean time to first token per GPU, seconds (latency objective default: 2).")] = None,
    max_itl_ms: Annotated[float | None, typer.Option("--max-itl-ms", help="Mean inter-token latency, ms.")] = None,
    max_ttft_p99_s: Annotated[float | None, typer.Option("--max-ttft-p99-s", help="p99 TTFT, seconds.")] = None,
    max_itl_p99_ms: Annotated[float | None, typer.Option(
        "--max-itl-p99-ms", help="p99 over requests of the mean inter-token gap, ms.")] = None,
    headroom: Annotated[float, typer.Option(
        "--headroom", help="Plan for the forecast rates x (1 + headroom): margin for forecast error. "
                           "Default 0.2 (rates x 1.2); 0 plans for the forecast itself.")] = 0.2,
    verify: Annotated[bool, typer.Option(
        "--verify/--no-verify", help="Simulate every GPU for the full hour (--verify-seeds seeds) and repair "
                                     "failing GPUs (default on).")] = True,
    verify_seeds: Annotated[int, typer.Option("--verify-seeds", help="Seeds per GPU in verification (>= 1).")
                            ] = 3,
    verify_arrivals: Annotated[str, typer.Option(
        "--verify-arrivals", metavar="LAW",
        help="Arrivals the verification simulates at the planned rates: 'workload' (default) = the workload "
             "file's law when it is lognormal or modulated, else Poisson; 'poisson'; or a trace CSV "
             "(arrived_at,...): Poisson whose rate follows the trace's per-minute load, as its swings hit "
             "every adapter at once.")] = "workload",
    split_hot: Annotated[bool, typer.Option(
        "--split-hot", help="Split adapters too hot for one GPU into weighted replicas on several GPUs.")] = False,
    seed: Annotated[int, typer.Option(help="Seed of every simulation (plans are deterministic per seed).")] = 0,
    n_max: Annotated[int | None, typer.Option(
        "--n-max", help="Hard cap on adapters per GPU for the proposed methods. Default: the greedy stops at "
                        "384 (the measured range) and only a twin-verified plan on fewer GPUs goes beyond.")
    ] = None,
    mean_input_tokens: Annotated[float | None, typer.Option(help="Override the mean prompt tokens.")] = None,
    mean_output_tokens: Annotated[float | None, typer.Option(help="Override the mean output tokens.")] = None,
    workers: Annotated[int | None, typer.Option(help="Worker processes for twin runs (0 = all cores; default: "
                                                     "up to 2).")] = None,
    base_port: Annotated[int, typer.Option(help="Port of device 0 on each node (device d: base + d).")] = 8000,
    gpus_per_node: Annotated[int, typer.Option(help="GPUs per node in serve.sh and routes.json.")] = 8,
    host_pattern: Annotated[str | None, typer.Option(
        help="Host of each node in routes.json, e.g. 'gpu-node-{node}' (default: localhost on one node).")
    ] = None,
    vllm_version: VllmVersionOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Place WORKLOAD's adapters on the fewest GPUs: which adapter where, each GPU's --max-loras, verified by the
    twin, with the commands to launch it (plan.json, serve.sh, routes.json in --out)."""
    from ..placement import Objective
    from ..placement import place as run_place
    from ..placement.api import check_method
    from ..placement.export import Endpoints, check_out_dir, write_outputs
    from ..placement.problem import instance_from_workload
    from ..workload import load_workload

    # every check before any work: method, flags, output directory, profile, workload
    check_method(method)
    if verify_seeds < 1:
        raise LorapackError(f"--verify-seeds {verify_seeds}: expected an integer >= 1")
    if n_max is not None and n_max < 1:
        raise LorapackError(f"--n-max {n_max}: expected an integer >= 1")
    limits = {"max_itl_ms": max_itl_ms, "max_ttft_p99_s": max_ttft_p99_s, "max_itl_p99_ms": max_itl_p99_ms}
    if objective is ObjectiveKind.latency:
        obj = Objective(max_ttft_s=2.0 if max_ttft_s is None else max_ttft_s, **limits)
    else:
        obj = Objective(max_ttft_s=max_ttft_s, **limits)
    endpoints = Endpoints(base_port=base_port, gpus_per_node=gpus_per_node, host_pattern=host_pattern)
    check_out_dir(out)
    if models is not None and not models.is_dir():
        raise LorapackError(f"--models {models}: not a directory")
    if workers is not None:  # the same convention as every command: >= 0, 0 = all cores
        workers = check_workers(workers) or (os.cpu_count() or 1)
    prof = apply_vllm_version(load_profile(model, gpu, profile), vllm_version)
    wl = load_workload(workload)
    law = _verify_law(verify_arrivals, wl)
    inst = instance_from_workload(wl, headroom=headroom, mean_input_tokens=mean_input_tokens,
                                  mean_output_tokens=mean_output_tokens, where=str(workload))

    if json_out:
        plan = run_place(inst, prof, method, gpus=gpus, objective=obj, verify=verify, verify_seeds=verify_seeds,
                         seed=seed, split_hot=split_hot, n_max=n_max, models_dir=models, workers=workers,
                         verify_arrivals=law)
    else:
        with err_console.status(f"placing {inst.n} adapters with {method}") as status:
            plan = run_place(inst, prof, method, gpus=gpus, objective=obj, verify=verify,
                             verify_seeds=verify_seeds, seed=seed, split_hot=split_hot, n_max=n_max,
                             models_dir=models, workers=workers, verify_arrivals=law,
                             progress=lambda msg: status.update(f"{method}: {msg}"))
    if plan.infeasible:
        raise LorapackError(plan.reason)
    files = write_outputs(plan, out, inst.paths, endpoints)
    if json_out:
        print_json(plan.to_dict())
        return
    _render(plan, files)


def _render(plan, files: list[Path]) -> None:
    from ..oracle import STARVED_PROBABILITY
    from ..placement import N_MAX

    # fits 80 columns: headers on two lines, the two vLLM flags in one column (values "A / S"), one space apart
    t = Table(title=f"{plan.method}: {plan.gpus_used} GPU(s) for {sum(len(g.adapters) for g in plan.gpus)} "
                    f"adapter placements ({plan.model} on {plan.gpu_type})", title_justify="left",
              box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 0))
    for col in ("GPU", "adapters", "--max-loras /\n--max-lora-rank", "offered\ntok/s", "verified\ntok/s",
                "TTFT\ns", "ITL\nms", "starved", "binding"):
        t.add_column(col, justify="left" if col in ("binding",) else "right", no_wrap=True)
    for gi, g in enumerate(plan.gpus):
        m = g.verified or g.predicted
        if m is None:
            starved = "-"
        else:  # verified: the share of seeds starved, any is too many; predicted: the oracle's probability
            p = m.starved or 0.0
            hit = (p > 0.0 if g.verified is not None else p >= STARVED_PROBABILITY) or bool(m.starved_adapters)
            starved = "[red]yes[/red]" if hit else "[green]no[/green]"
        t.add_row(str(gi), str(len(g.adapters)), f"{g.max_loras} / {g.max_lora_rank}", fmt(g.incoming_tok_s, 0),
                  fmt(g.verified.throughput_tok_s, 0) if g.verified else "-",
                  fmt(m.ttft_s, 2) if m else "-", fmt(m.itl_ms, 1) if m else "-", starved, g.binding)
    console.print(t)
    gap = plan.gap_gpus
    v = plan.verification
    lines = [
        f"GPUs used: [bold]{plan.gpus_used}[/bold]; lower bound {plan.lower_bound_gpus}"
        + (f" (gap {gap})" if gap is not None else ""),
        f"placement {plan.placement_ms:,.1f} ms"
        + (f"; verification {plan.verification_ms / 1e3:,.1f} s, {len(v.get('seeds', []))} seeds x "
           f"{v.get('duration_s', 0):,.0f} s per GPU, {v.get('gpus_added', 0)} GPU(s) added by repair"
           if v else "; not verified (--no-verify)"),
        f"objective: {_objective_text(plan.settings['objective'])}; planned for the forecast rates x "
        f"{1 + plan.settings['headroom']:g} (--headroom {plan.settings['headroom']:g})",
        "wrote " + ", ".join(str(f) for f in files),
    ]
    c = v.get("consolidated") if v else None
    if c and c.get("accepted"):
        lines.insert(2, f"consolidated from {c['gpus_before']} to {c['gpus_after']} GPUs ({c.get('origin')} "
                        f"arrangement, verified like the rest)")
    padded = [f"{i} ({g.predicted.tested_adapters})" for i, g in enumerate(plan.gpus) if g.verified is None
              and g.predicted is not None and (g.predicted.tested_adapters or 0) > len(g.adapters)]
    if padded:
        lines.insert(2, f"not verified: TTFT and ITL are the oracle's for the candidate it tested; GPU(s) "
                        f"{', '.join(padded)} were tested padded to that many adapters (a heavier load)")
    beyond = [i for i, g in enumerate(plan.gpus) if len(g.adapters) > N_MAX]
    if beyond:
        lines.insert(2, f"[yellow]GPU(s) {', '.join(map(str, beyond))} host more than {N_MAX} adapters, beyond the "
                        f"real runs: the twin extrapolates there (--n-max {N_MAX} forbids it)[/yellow]")
    for line in lines:
        console.print(line, highlight=False)


_LIMIT_TEXT = {"max_ttft_s": "mean TTFT <= {:g} s", "max_itl_ms": "mean ITL <= {:g} ms",
               "max_ttft_p99_s": "p99 TTFT <= {:g} s", "max_itl_p99_ms": "p99 ITL <= {:g} ms"}


def _objective_text(obj: dict) -> str:
    limits = [t.format(obj[k]) for k, t in _LIMIT_TEXT.items() if obj.get(k) is not None]
    return ", ".join(["not starved (>= 90 % of the offered tokens, every adapter served)", *limits])


def _verify_law(choice: str, wl):
    """``--verify-arrivals``: the arrival law the verifier simulates (None: Poisson)."""
    from ..placement.api import workload_verify_law
    from ..spec import ModulatedArrivals
    from ..workload import load_trace
    from ..workload.derive import RATE_PROFILE_PERIOD_S, load_profile, trace_span_s

    if choice == "poisson":
        return None
    if choice == "workload":
        return workload_verify_law(wl)
    path = Path(choice)
    if not path.is_file():
        raise LorapackError(f"--verify-arrivals {choice}: expected 'workload', 'poisson' or an existing trace CSV")
    trace = load_trace(path)
    prof = load_profile(trace.t_s, trace_span_s(trace), RATE_PROFILE_PERIOD_S)
    return ModulatedArrivals(period_s=RATE_PROFILE_PERIOD_S, multipliers=[float(m) for m in prof])
