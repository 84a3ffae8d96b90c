"""``lorapack simulate``: one server, one workload."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from ..errors import SpecError
from ..twin.metrics import RunMetrics
from .common import (
    ForceOpt,
    GpuOpt,
    JsonOpt,
    ModelOpt,
    ProfileOpt,
    VllmVersionOpt,
    apply_vllm_version,
    check_output_file,
    console,
    err_console,
    fmt,
    limits,
    load_profile,
    parse_int_list,
    print_json,
    write_csv_atomic,
)

STARVED_NAMES_SHOWN = 8  # adapter ids listed in the table; --json has them all (starved_adapter_ids)


def _starved_ids(out: RunMetrics, adapter_ids: list[str]) -> list[str]:
    return [adapter_ids[i] for i in out.starved_adapter_indices]


def _yes_no(flag: bool | None) -> str:
    return "[red]yes[/red]" if flag else "[green]no[/green]"


def render_run(out: RunMetrics, adapter_ids: list[str], title: str, con: Console | None = None) -> None:
    """One run as a two-column table: the server's flags under vLLM's names, then the metrics (80 columns)."""
    con = con or console
    t = Table(title=title, show_header=False, title_justify="left")
    t.add_column("metric", style="bold")
    t.add_column("value", justify="right", overflow="fold")
    srv = out.server
    if srv is not None:
        for flag, v in (("--max-loras", srv.max_loras), ("--max-lora-rank", srv.max_lora_rank),
                        ("--max-cpu-loras", srv.max_cpu_loras), ("--max-num-seqs", srv.max_num_seqs),
                        ("--max-num-batched-tokens", srv.max_num_batched_tokens),
                        ("--max-model-len", srv.max_model_len)):
            t.add_row(flag, fmt(v))
        t.add_section()
    if out.oom:
        t.add_row("server starts", f"[red]no[/red] ({out.error_type}, KV {out.kv_cache_tokens:,} tokens)")
        con.print(t)
        return
    names = _starved_ids(out, adapter_ids)
    more = len(names) - STARVED_NAMES_SHOWN
    shown = ", ".join(names[:STARVED_NAMES_SHOWN]) + (f", +{more}\u00a0more" if more > 0 else "")
    rows = [
        ("throughput (tok/s)", fmt(out.throughput_tok_s)),
        ("incoming (tok/s)", fmt(out.incoming_tok_s)),
        ("throughput / incoming", fmt(out.throughput_ratio, 3)),
        ("starved (< 0.9 x what could finish)", _yes_no(out.starved)),
        ("ITL mean / p99 (ms)", f"{fmt(out.itl_mean_ms)} / {fmt(out.itl_p99_ms)}"),
        ("TTFT mean / median / p99 (ms)",
         f"{fmt(out.ttft_mean_ms)} / {fmt(out.ttft_median_ms)} / {fmt(out.ttft_p99_ms)}"),
        # only where it tells something: on a healthy server the few requests in flight at the end, each
        # counted as the whole window, make it a large number of no meaning (--json always has it)
        *([("TTFT penalised mean (ms; unfinished = window)", fmt(out.ttft_penalised_mean_ms))]
          if out.starved or out.adapter_starved else []),
        ("requests arrived / completed", f"{out.n_arrived:,} / {out.n_completed:,}"),
        *([("rejected (> --max-model-len)", f"[red]{out.n_rejected:,}[/red]")] if out.n_rejected else []),
        ("preemptions", fmt(out.n_preemptions)),
        ("adapter loads", fmt(out.n_adapter_loads)),
        ("adapters starved (per adapter)", fmt(out.n_adapters_starved)),
        *([("  which (--json: starved_adapter_ids)", Text(shown, justify="left"))] if names else []),
        ("KV cache (tokens)", fmt(out.kv_cache_tokens)),
        ("running mean / max", f"{fmt(out.running_reqs_mean)} / {fmt(out.running_reqs_max, 0)}"),
        ("waiting mean / max", f"{fmt(out.waiting_reqs_mean)} / {fmt(out.waiting_reqs_max, 0)}"),
        ("wall time (s)", fmt(out.wall_s, 3)),
    ]
    for k, v in rows:
        t.add_row(k, v)
    con.print(t)


def render_scan(results: list[RunMetrics], title: str, con: Console | None = None) -> None:
    """One row per --max-loras value on the same requests, then which values are safe (fits 80 columns)."""
    con = con or console
    t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for h in ("--max-loras", "thr\ntok/s", "ratio", "starved", "adapters\nstarved", "ITL\nms", "TTFT\nms",
              "adapter\nloads"):
        t.add_column(h, justify="right", no_wrap=True)
    for r in results:
        a = str(r.server.max_loras) if r.server is not None else "-"
        if r.oom:
            t.add_row(a, "[red]oom[/red]", *["-"] * 6)
            continue
        t.add_row(a, fmt(r.throughput_tok_s), fmt(r.throughput_ratio, 3), _yes_no(r.starved),
                  fmt(r.n_adapters_starved), fmt(r.itl_mean_ms), fmt(r.ttft_mean_ms, 0), fmt(r.n_adapter_loads))
    con.print(t)
    ok = [r for r in results if not r.oom and not r.starved and not r.adapter_starved]
    con.print("safe = the server starts, throughput >= 0.9 x incoming and no adapter starved (each adapter "
              ">= 90 % of its tokens served, none waiting > 5 min); oom = vLLM would not start.", highlight=False)
    if ok:
        best = min(ok, key=lambda r: r.ttft_mean_ms)
        con.print(f"smallest safe --max-loras: [bold]{ok[0].server.max_loras}[/bold]; lowest TTFT at --max-loras "
                  f"{best.server.max_loras}.", highlight=False)
    else:
        con.print("[red]no scanned --max-loras value serves this workload without starvation.[/red]")


def simulate(
    workload: Annotated[Path, typer.Argument(help="Workload spec: YAML, or a CSV adapter_id,rank,rate_rps.")],
    max_loras: Annotated[str, typer.Option(
        "--max-loras", "-a", help="--max-loras: GPU adapter slots (A_max). A comma list (4,8,16,32) scans the "
                                  "values on the same requests: one table row (one JSON object) per value.")],
    model: ModelOpt = None,
    gpu: GpuOpt = None,
    profile: ProfileOpt = None,
    max_lora_rank: Annotated[int | None, typer.Option(help="--max-lora-rank (default: largest rank).")] = None,
    max_cpu_loras: Annotated[int | None, typer.Option(help="--max-cpu-loras (default: adapters).")] = None,
    duration_s: Annotated[float | None, typer.Option(help="Window length in seconds (default 3600).")] = None,
    seed: Annotated[int, typer.Option(help="Random seed of the arrivals and lengths.")] = 0,
    mean_input_tokens: Annotated[float | None, typer.Option(help="Override the mean prompt tokens.")] = None,
    mean_output_tokens: Annotated[float | None, typer.Option(help="Override the mean output tokens.")] = None,
    client_cap: Annotated[int, typer.Option(help="Client-saturation cap on waiting requests (0 = off).")] = 0,
    max_model_len: Annotated[int | None, typer.Option(help="--max-model-len (default: the model's).")] = None,
    max_num_seqs: Annotated[int | None, typer.Option(
        help="--max-num-seqs: most requests running at once. Default: the profile's (2048, what the "
             "benchmark runs set); vLLM 0.8.5's own `vllm serve` default is 1024 on H100/H200, 256 elsewhere.")
    ] = None,
    max_num_batched_tokens: Annotated[int | None, typer.Option(
        help="--max-num-batched-tokens: token budget of one step. Default: the profile's (2048, what the "
             "benchmark runs set); vLLM 0.8.5's own `vllm serve` default is 8192 on H100/H200, 2048 elsewhere.")
    ] = None,
    cold_start: Annotated[bool, typer.Option("--cold-start", help="Start with empty GPU adapter slots.")] = False,
    metrics_scrape_s: Annotated[float | None, typer.Option(
        "--metrics-scrape-s", help="A Prometheus poller scrapes /metrics every this many seconds: each scrape "
             "holds the API server for a time that grows with the adapters' label series (vLLM 0.8.5, "
             "docs/engine-semantics.md \"The API server\"). Default: no poller. Needs a profile with an API-server "
             "model (api_server).")] = None,
    early_stop: Annotated[bool, typer.Option(
        "--early-stop", help="Stop once the outcome is clear (healthy, or starving) and extrapolate the run-level metrics "
             "(needs --client-cap 0; see stop_reason / simulated_s).")] = False,
    timeline: Annotated[Path | None, typer.Option(help="Write the 2 s timeline to this CSV.")] = None,
    force: ForceOpt = False,
    vllm_version: VllmVersionOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Simulate one vLLM server serving WORKLOAD's adapters and report throughput, latency, starvation."""
    from ..server import ServerConfig
    from ..twin.engine import warm_up
    from ..twin.run import simulate as run_sim
    from ..workload import load_workload, with_mean_lengths

    values = parse_int_list(max_loras, "--max-loras")
    if timeline is not None:  # before any work: a bad path is an error now, not after the run
        if len(values) > 1:
            raise SpecError(f"--timeline with --max-loras {max_loras}: a timeline is written for one "
                            f"--max-loras value; scan without --timeline")
        check_output_file(timeline, "--timeline")
    if early_stop and client_cap > 0:
        raise SpecError(f"--early-stop with --client-cap {client_cap}: early termination needs the cap off "
                        f"(held-back arrivals make the extrapolation unknowable); drop one of them")
    # the server's flags, validated before any work (ServerConfig names the bad flag); one per scanned --max-loras
    server = ServerConfig(max_loras=values[0], max_lora_rank=max_lora_rank, max_cpu_loras=max_cpu_loras,
                          max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=max_num_batched_tokens, client_cap=client_cap,
                          warm_start=not cold_start, metrics_scrape_s=metrics_scrape_s)
    prof = apply_vllm_version(load_profile(model, gpu, profile), vllm_version)
    if metrics_scrape_s is not None and prof.api_server is None:
        err_console.print(f"note: --metrics-scrape-s: the profile {prof.model} has no API-server model "
                          f"(api_server): scrapes change nothing in the simulation")
    wl = load_workload(workload)
    # a workload that gives no lengths (an adapters CSV, a YAML without ``lengths:``) is simulated with the
    # profile's fitted law, as ``place`` plans it: a plan's GPU simulated here then gives its verified numbers
    assumed = "lengths" not in wl.model_fields_set and not getattr(wl.arrivals, "trace_lengths", False)
    if assumed:
        from ..oracle import profile_length_law

        wl = wl.model_copy(update={"lengths": profile_length_law(prof, wl.lengths.mean_input_tokens,
                                                                 wl.lengths.mean_output_tokens)})
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
    from ..twin.early import EarlyStopOptions

    runs = []
    for a in values:
        m, r = run_sim(prof, wl, server.replace(max_loras=a), duration_s, seed, EarlyStopOptions() if early_stop else None,
                       limits(force))
        runs.append((m, r if not runs else None))  # (the timeline needs only the first engine result)
    out, res = runs[0]
    if timeline is not None:
        if res is None:
            raise SpecError(f"--timeline {timeline}: no timeline, the server would not start ({out.error_type})")
        # gauges that count things are integers (as in vLLM's /metrics), the rest stay floats
        write_csv_atomic(timeline, {k: ([int(x) for x in v] if k.startswith("num_") else v)
                                    for k, v in res.timeline.items()})
    ids = wl.adapter_ids
    docs = [{**o.to_dict(), "starved_adapter_ids": _starved_ids(o, ids), "compile_s": compile_s} for o, _ in runs]
    if json_out:
        print_json(docs[0] if len(docs) == 1 else docs)
        return
    if assumed:
        ln = wl.lengths
        err_console.print(f"note: {workload} gives no request lengths: simulated with the profile's log-normal law "
                          f"(cv {ln.cv:.6g}) around {ln.mean_input_tokens:g} / {ln.mean_output_tokens:g} tokens, as "
                          "place assumes", highlight=False, soft_wrap=True)
    head = f"{prof.model} on {prof.gpu}: {wl.n_adapters} adapters, {out.duration_s:g} s, seed {seed}"
    if len(runs) == 1:
        render_run(out, ids, head)
    else:
        render_scan([o for o, _ in runs], head)
