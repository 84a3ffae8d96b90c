"""``lorapack simulate``: one server, one workload."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from ..errors import SpecError
from ..twin.metrics import RunMetrics
from .common import (
    ForceOpt,
    GpuOpt,
    JsonOpt,
    ModelOpt,
    ProfileOpt,
    check_output_file,
    console,
    fmt,
    limits,
    load_profile,
    print_json,
    write_csv_atomic,
)


def _render_sim(out: RunMetrics, title: str) -> None:
    t = Table(title=title, show_header=False, title_justify="left")
    t.add_column("metric", style="bold")
    t.add_column("value", justify="right")
    if out.oom:
        t.add_row("server starts", f"[red]no[/red] ({out.error_type}, KV {out.kv_cache_tokens:,} tokens)")
        console.print(t)
        return
    rows = [
        ("throughput (tok/s)", fmt(out.throughput_tok_s)),
        ("incoming (tok/s)", fmt(out.incoming_tok_s)),
        ("throughput / incoming", fmt(out.throughput_ratio, 3)),
        ("starved", "[red]yes[/red]" if out.starved else "[green]no[/green]"),
        ("ITL mean (ms)", fmt(out.itl_mean_ms)),
        ("TTFT mean / median / p99 (ms)",
         f"{fmt(out.ttft_mean_ms)} / {fmt(out.ttft_median_ms)} / {fmt(out.ttft_p99_ms)}"),
        ("TTFT penalised mean (ms)", fmt(out.ttft_penalised_mean_ms)),
        ("requests arrived / completed", f"{out.n_arrived:,} / {out.n_completed:,}"),
        ("preemptions", fmt(out.n_preemptions)),
        ("adapter loads", fmt(out.n_adapter_loads)),
        ("adapters starved (per-adapter check)", fmt(out.n_adapters_starved)),
        ("KV cache (tokens)", fmt(out.kv_cache_tokens)),
        ("running mean / max", f"{fmt(out.running_reqs_mean)} / {fmt(out.running_reqs_max, 0)}"),
        ("waiting mean / max", f"{fmt(out.waiting_reqs_mean)} / {fmt(out.waiting_reqs_max, 0)}"),
        ("wall time (s)", fmt(out.wall_s, 3)),
    ]
    for k, v in rows:
        t.add_row(k, v)
    console.print(t)


def simulate(
    workload: Annotated[Path, typer.Argument(help="Workload spec: YAML, or a CSV adapter_id,rank,rate_rps.")],
    max_loras: Annotated[int, typer.Option("--max-loras", "-a", help="--max-loras: GPU adapter slots (A_max).")],
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
    cold_start: Annotated[bool, typer.Option(help="Start with empty GPU adapter slots.")] = False,
    early_stop: Annotated[bool, typer.Option(
        help="Stop once the outcome is clear (healthy, or starving) and extrapolate the run-level metrics "
             "(needs --client-cap 0; see stop_reason / simulated_s).")] = False,
    timeline: Annotated[Path | None, typer.Option(help="Write the 2 s timeline to this CSV.")] = None,
    force: ForceOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Simulate one vLLM server serving WORKLOAD's adapters and report throughput, latency, starvation."""
    from ..spec import load_workload, with_mean_lengths
    from ..twin.engine import warm_up
    from ..twin.run import ServerFlags
    from ..twin.run import simulate as run_sim

    if timeline is not None:  # before any work: a bad path is an error now, not after the run
        check_output_file(timeline, "--timeline")
    if early_stop and client_cap > 0:
        raise SpecError(f"--early-stop with --client-cap {client_cap}: early termination needs the cap off "
                        f"(held-back arrivals make the extrapolation unknowable); drop one of them")
    prof = load_profile(model, gpu, profile)
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
                        max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                        max_num_batched_tokens=max_num_batched_tokens, client_cap=client_cap,
                        warm_start=not cold_start)
    from ..twin.early import EarlyStopOptions

    out, res = run_sim(prof, wl, flags, duration_s, seed, EarlyStopOptions() if early_stop else None,
                       limits(force))
    if timeline is not None:
        if res is None:
            raise SpecError(f"--timeline {timeline}: no timeline, the server would not start ({out.error_type})")
        # gauges that count things are integers (as in vLLM's /metrics), the rest stay floats
        write_csv_atomic(timeline, {k: ([int(x) for x in v] if k.startswith("num_") else v)
                                    for k, v in res.timeline.items()})
    if json_out:
        print_json({**out.to_dict(), "compile_s": compile_s})
    else:
        srv = out.server
        _render_sim(out, f"{prof.model} on {prof.gpu}: {wl.n_adapters} adapters, A={srv.max_loras}, "
                         f"S={srv.max_lora_rank}, {out.duration_s:g} s, seed {seed}")
