"""``lorapack demo``: what ``make demo`` runs."""

from __future__ import annotations

import time
from typing import Annotated

import typer
from rich.table import Table

from .common import (
    JsonOpt,
    console,
    fmt,
    print_json,
)


def demo(
    model: Annotated[str, typer.Option("--model", "-m", help="Model key.")] = "llama-3.1-8b-instruct",
    json_out: JsonOpt = False,
) -> None:
    """Simulate the shipped example workload at several --max-loras values and show which are safe."""
    from ..profile import find_profile
    from ..spec import example_workload, load_workload
    from ..twin.engine import warm_up
    from ..twin.run import ServerFlags
    from ..twin.run import simulate as run_sim

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
                    "results": [r.to_dict() for r in results]})
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
        srv = r.server
        if r.oom:
            t.add_row(str(srv.max_loras), "[red]no[/red]", fmt(r.kv_cache_tokens), *["-"] * 8)
            continue
        t.add_row(str(srv.max_loras), "yes", fmt(r.kv_cache_tokens), fmt(r.throughput_tok_s),
                  fmt(r.incoming_tok_s), fmt(r.throughput_ratio, 3),
                  "[red]yes[/red]" if r.starved else "[green]no[/green]", fmt(r.n_adapters_starved),
                  fmt(r.itl_mean_ms), fmt(r.ttft_mean_ms, 0), fmt(r.n_adapter_loads))
    console.print(t)
    ok = [r for r in results if not r.oom and not r.starved and not r.adapter_starved]
    if ok:
        best = min(ok, key=lambda r: r.ttft_mean_ms)
        console.print("Safe = server starts, throughput >= 0.9 x incoming, and no adapter starved "
                      "(each adapter >= 90 % of its tokens served, none waiting > 5 min).")
        console.print(f"Smallest safe --max-loras: [bold]{ok[0].server.max_loras}[/bold]; lowest TTFT at "
                      f"--max-loras {best.server.max_loras}. "
                      f"({len(results)} simulated hours in {wall:.2f} s; one-off compile {compile_s:.1f} s.)")
    else:
        console.print("[red]No --max-loras value serves this workload on one GPU without starvation.[/red]")
