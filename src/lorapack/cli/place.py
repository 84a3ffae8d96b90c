"""``lorapack place``: a workload's adapters onto the fewest GPUs; writes plan.json, serve.sh, routes.json."""

from __future__ import annotations

import dataclasses
import inspect
import typing
from collections.abc import Callable
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich import box
from rich.table import Table

from ..errors import LorapackError
from ..objective import OBJECTIVE_KINDS, Objective
from ..placement.config import PlaceConfig
from .common import (
    GpuOpt,
    JsonOpt,
    ModelOpt,
    ProfileOpt,
    VllmVersionOpt,
    apply_vllm_version,
    console,
    err_console,
    fmt,
    load_profile,
    print_json,
)

ObjectiveKind = StrEnum("ObjectiveKind", {k: k for k in OBJECTIVE_KINDS})


def _options(
    workload: Annotated[Path, typer.Argument(
        help="Workload spec: YAML, or a CSV adapter_id,rank,rate_rps[,path] (the forecast rates).")],
    model: ModelOpt = None,
    gpu: GpuOpt = None,
    profile: ProfileOpt = None,
    out: Annotated[Path, typer.Option("--out", help="Output directory for plan.json, serve.sh, routes.json and "
                                                    "the router configs litellm.yaml, vllm-router.sh.")
                   ] = Path("plan"),
    base_port: Annotated[int, typer.Option(help="Port of device 0 on each node (device d: base + d).")] = 8000,
    gpus_per_node: Annotated[int, typer.Option(help="GPUs per node in serve.sh and routes.json.")] = 8,
    host_pattern: Annotated[str | None, typer.Option(
        help="Host of each node in routes.json, e.g. 'gpu-node-{node}' (default: localhost on one node).")
    ] = None,
    vllm_version: VllmVersionOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """The options of ``lorapack place`` that are not placement settings (its signature only: see
    ``place_command``); the placement settings come from ``PlaceConfig``'s fields."""


def _flag(name: str, metadata: typing.Mapping[str, Any]) -> str:
    return metadata.get("flag") or f"--{name.replace('_', '-')}"


def _option(name: str, annotation: Any, default: Any, metadata: typing.Mapping[str, Any]) -> inspect.Parameter:
    text = metadata["help"]
    option = typer.Option(_flag(name, metadata), help=text() if callable(text) else text,
                          metavar=metadata.get("metavar"))
    return inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default,
                             annotation=Annotated[annotation, option])


def config_options() -> list[inspect.Parameter]:
    """One option per ``PlaceConfig`` field (``objective``: ``--objective`` and one per ``Objective`` limit),
    with the field's default, type and help; ``--method``'s help lists the registered methods."""
    hints = typing.get_type_hints(PlaceConfig)
    params = []
    for f in dataclasses.fields(PlaceConfig):
        if f.name == "objective":
            params.append(_option("objective", ObjectiveKind, ObjectiveKind("latency"), f.metadata))
            params += [_option(g.name, float | None, None, g.metadata) for g in dataclasses.fields(Objective)]
        else:
            params.append(_option(f.name, f.metadata.get("cli_type", hints[f.name]), f.default, f.metadata))
    return params


def config_from_options(values: dict[str, Any]) -> PlaceConfig:
    """The ``PlaceConfig`` of the options ``config_options`` made (removed from ``values``)."""
    limits = {k: values.pop(k) for k in Objective.keys()}
    objective = Objective.of(str(values.pop("objective")), **limits)
    return PlaceConfig(objective=objective, **{f.name: values.pop(f.name) for f in dataclasses.fields(PlaceConfig)
                                               if f.name != "objective"})


def place_command() -> Callable[..., None]:
    """``lorapack place``: its options are ``_options``'s with the placement settings inserted after
    ``--profile`` (generated from ``PlaceConfig``, so a new setting or method shows up here by itself)."""
    own = list(inspect.signature(_options, eval_str=True).parameters.values())
    params = [*own[:4], *config_options(), *own[4:]]

    def place(**values: Any) -> None:
        """Place WORKLOAD's adapters on the fewest GPUs: which adapter where, each GPU's --max-loras, verified by
        the twin, with the commands to launch it (plan.json, serve.sh, routes.json in --out)."""
        _place(values)

    place.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    place.__annotations__ = {p.name: p.annotation for p in params}
    return place


def _place(values: dict[str, Any]) -> None:
    from ..placement import place as run_place
    from ..placement.export import Endpoints, check_out_dir, write_outputs
    from ..placement.problem import instance_from_workload
    from ..workload import load_workload

    # every check before any work: settings, output directory, profile, workload
    config = config_from_options(values)
    workload, out, json_out = values["workload"], values["out"], values["json_out"]
    endpoints = Endpoints(base_port=values["base_port"], gpus_per_node=values["gpus_per_node"],
                          host_pattern=values["host_pattern"])
    check_out_dir(out)
    previous = None
    if config.previous is not None:  # read before any work; the migration from it is written beside the plan
        from ..replan.replan import load_previous

        previous = load_previous(config.previous).plan
    prof = apply_vllm_version(load_profile(values["model"], values["gpu"], values["profile"]), values["vllm_version"])
    wl = load_workload(workload)
    inst = instance_from_workload(wl, headroom=config.headroom, mean_input_tokens=config.mean_input_tokens,
                                  mean_output_tokens=config.mean_output_tokens, where=str(workload), profile=prof)
    # the verifier's law is resolved against the workload file: the instance placed carries no arrival law
    law = config.verify_law(wl)
    config = dataclasses.replace(config, verify_arrivals="poisson" if law is None else law)

    if json_out:
        plan = run_place(inst, prof, config)
    else:
        with err_console.status(f"placing {inst.n} adapters with {config.method}") as status:
            plan = run_place(inst, prof, config, progress=lambda msg: status.update(f"{config.method}: {msg}"))
    if plan.infeasible:
        raise LorapackError(plan.reason)
    extra = None
    if previous is not None:
        from ..replan.migrate import migration_files

        extra = migration_files(previous, plan, inst.paths, endpoints)
    files = write_outputs(plan, out, inst.paths, endpoints, extra)
    if json_out:
        print_json(plan.to_dict())
        return
    _render(plan, files)
    if previous is not None:
        _migration_notes(previous, plan, inst.paths, endpoints)


def _migration_notes(previous, plan, paths: dict[str, str], endpoints) -> None:
    """The steps of migrate.sh whose state is not known to pass, said where the operator looks."""
    from rich.markup import escape

    from ..replan.migrate import migration

    mig = migration(previous, plan, paths, endpoints)
    console.print(f"migrate.sh: {len(mig['steps'])} steps ({mig['loads']} loads, {mig['unloads']} unloads, "
                  f"{len(mig['restarts'])} restarts)", highlight=False)
    for s in mig["states"]:
        if s["passes"] is not True:
            console.print(f"[yellow]migrate.sh steps {s['from_step']}-{s['to_step']}: {escape(s['why'])}[/yellow]",
                          highlight=False)


place = place_command()


def _render(plan, files: list[Path]) -> None:
    from ..objective import STARVED_PROBABILITY
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
        + (f" (+ {plan.load_ms:,.0f} ms loading the models)" if plan.load_ms > 0 else "")
        + (f"; verification {plan.verification_ms / 1e3:,.1f} s, {len(v.get('seeds', []))} seeds x "
           f"{v.get('duration_s', 0):,.0f} s per GPU, {v.get('gpus_added', 0)} GPU(s) added by repair"
           if v else "; not verified (--no-verify)"),
        f"objective: {_objective_text(plan.settings['objective'])}; planned for the forecast rates x "
        f"{1 + plan.settings['headroom']:g} (--headroom {plan.settings['headroom']:g})",
        _lengths_text(plan.settings),
        "wrote " + ", ".join(str(f) for f in files),
    ]
    worst = plan.worst_gpu
    if worst is not None:
        lines.insert(1, f"worst GPU {worst['gpu']}: mean TTFT {fmt(worst['ttft_s'], 2)} s, p99 "
                        f"{fmt(worst['ttft_p99_s'], 2)} s ({'verified' if worst['verified'] else 'predicted'})")
    c = v.get("consolidated") if v else None
    if c and c.get("accepted"):
        lines.insert(2, f"consolidated from {c['gpus_before']} to {c['gpus_after']} GPUs ({c.get('origin')} "
                        f"arrangement, verified like the rest)")
    spread = v.get("spread") if v else None
    if spread and spread.get("accepted"):
        lines.insert(2, f"spread over the same GPUs ({spread['origin']} arrangement, verified like the rest): the "
                        f"worst GPU's mean TTFT fell from {spread['worst_ttft_s_before']:.2f} to "
                        f"{spread['worst_ttft_s_after']:.2f} s")
    padded = [f"{i} ({g.predicted.tested_adapters})" for i, g in enumerate(plan.gpus) if g.verified is None
              and g.predicted is not None and (g.predicted.tested_adapters or 0) > len(g.adapters)]
    if padded:
        lines.insert(2, f"not verified: TTFT and ITL are the oracle's for the candidate it tested; GPU(s) "
                        f"{', '.join(padded)} were tested padded to that many adapters (a heavier load)")
    beyond = [i for i, g in enumerate(plan.gpus) if len(g.adapters) > N_MAX]
    if beyond:
        lines.insert(2, f"[yellow]GPU(s) {', '.join(map(str, beyond))} host more than {N_MAX} adapters, beyond the "
                        f"real runs: the twin extrapolates there (--n-max {N_MAX} forbids it)[/yellow]")
    from rich.markup import escape

    from ..placement.export import routes
    from ..placement.routers import router_configs

    # what a router config cannot carry of the plan (a split adapter's weights), said where the operator looks
    lines += [f"[yellow]{c.file_name}: {escape(note)}[/yellow]" for c in router_configs(routes(plan))
              for note in c.unexpressed]
    if plan.replan:
        lines[1:1] = replan_lines(plan.replan)
    for line in lines:
        console.print(line, highlight=False)


def replan_lines(r: dict) -> list[str]:
    """What a re-plan (``--previous``) changed, against a from-scratch plan for the same rates."""
    m, g = r["moves"], r["gpus"]
    parts = [f"{m[k]} {k}" for k in ("gone", "new", "needed", "optional", "verification") if m.get(k)]
    cap = "no cap" if r.get("max_moves") is None else f"--max-moves {r['max_moves']}"
    lines = [f"re-plan: {m['total']} moves ({', '.join(parts) or 'none'}; optional ones: {cap}), "
             f"{len(r['restarts'])} restart(s), GPUs {g['previous']} -> {g['now']}"
             + (f" (started {g['started']}, released {g['released']})" if g["started"] or g["released"] else "")]
    s = r.get("from_scratch") or {}
    if s.get("infeasible"):
        lines.append(f"from scratch: infeasible ({s.get('reason')})")
    elif s:
        lines.append(f"from scratch (its GPUs matched to the previous ones): {s['gpus']} GPUs, {s['moves']} moves, "
                     f"{s['restarts']} restart(s)")
    return lines


def _lengths_text(settings: dict) -> str:
    """Which request lengths the plan was made for, and whether they were the workload's or assumed."""
    law = settings.get("lengths") or {}
    means = f"means {law.get('mean_input_tokens', 0):,.0f} / {law.get('mean_output_tokens', 0):,.0f} tokens"
    kind = law.get("kind")
    shape = {"fixed": "fixed", "lognormal": f"log-normal (cv {law.get('cv', 0):.3g})",
             "empirical": f"bootstrapped from {law.get('path')}"}.get(kind, str(kind))
    if law.get("assumed"):
        text = (f"[yellow]lengths: none in the workload file; assumed the profile's ShareGPT-like law, {shape}, "
                f"{means} (give lengths: in a YAML workload to plan for your own)[/yellow]")
    else:
        text = f"lengths: the workload's, {shape}, {means}"
    fb = settings.get("oracle_fallback")
    if fb:
        text += (f"\n[yellow]the learned models were not trained on these lengths ({fb['reason']}): the twin was "
                 f"the oracle instead (as --method proposed-exact)[/yellow]")
    return text


_LIMIT_TEXT = {"max_ttft_s": "mean TTFT <= {:g} s", "max_itl_ms": "mean ITL <= {:g} ms",
               "max_ttft_p99_s": "p99 TTFT <= {:g} s", "max_itl_p99_ms": "p99 ITL <= {:g} ms"}


def _objective_text(obj: dict) -> str:
    limits = [t.format(obj[k]) for k, t in _LIMIT_TEXT.items() if obj.get(k) is not None]
    return ", ".join(["not starved (>= 90 % of the offered tokens, every adapter served)", *limits])
