"""``lorapack measure``: probe a live vLLM server into profiling data; the work is in ``lorapack.measure.run``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from .common import console, err_console, print_json


def measure(
    adapters: Annotated[Path, typer.Option("--adapters", help="CSV adapter_id,rank[,path]: the adapters to measure "
                                           "(served by the server, or loaded from path when it allows runtime "
                                           "loading; those are unloaded at the end).")],
    out: Annotated[Path, typer.Option("--out", help="Measurement directory to write (or to resume).")],
    url: Annotated[str | None, typer.Option("--url", help="The vLLM server's base address, e.g. "
                                            "http://127.0.0.1:8000 (measure sends traffic to nothing else).")] = None,
    budget_min: Annotated[float, typer.Option("--budget-min", help="Wall-time budget in minutes; the experiments "
                                              "scale their repetitions to it.")] = 20.0,
    log: Annotated[Path | None, typer.Option("--log", help="The server's start-up log: its flags, KV cache and "
                                             "device.")] = None,
    server_args: Annotated[str | None, typer.Option("--server-args", help="The vllm serve flags the server was "
                                                    "started with, when no --log is given, e.g. '--max-loras 8 "
                                                    "--max-num-seqs 256 --max-num-batched-tokens 2048'.")] = None,
    api_key: Annotated[str | None, typer.Option("--api-key", envvar="LORAPACK_API_KEY",
                                                help="Sent as a bearer token.")] = None,
    max_concurrency: Annotated[int, typer.Option("--max-concurrency", help="Most requests in flight at once "
                                                 "(closed-loop experiments).")] = 64,
    max_rate: Annotated[float, typer.Option("--max-rate", help="Most requests per second (runs).")] = 50.0,
    max_prompt_tokens: Annotated[int, typer.Option("--max-prompt-tokens", help="Longest prompt sent.")] = 4096,
    max_output_tokens: Annotated[int, typer.Option("--max-output-tokens", help="Longest output asked for "
                                                   "(closed-loop experiments).")] = 256,
    mean_input_tokens: Annotated[float, typer.Option("--mean-input-tokens", help="Mean prompt length of the "
                                                     "runs.")] = 128.0,
    mean_output_tokens: Annotated[float, typer.Option("--mean-output-tokens", help="Mean output length of the "
                                                      "runs.")] = 128.0,
    runs: Annotated[int | None, typer.Option("--runs", help="Number of end-to-end runs (default: as many as the "
                                             "budget allows, at least 3).")] = None,
    seed: Annotated[int, typer.Option(help="Seed of every prompt, length and arrival drawn.")] = 0,
    force: Annotated[bool, typer.Option("--force", help="Measure a server that is busy with other requests "
                                        "(its numbers will be off).")] = False,
    fresh: Annotated[bool, typer.Option("--fresh", help="Start over instead of resuming --out.")] = False,
    launch: Annotated[str | None, typer.Option("--launch", help="Instead of --url: a vllm serve command that "
                                               "lorapack starts on 127.0.0.1 (and stops, with every process "
                                               "it started); {flags} marks where host, port and grid flags "
                                               "go (default: the end).")] = None,
    grid_max_loras: Annotated[str, typer.Option("--grid-max-loras", help="With --launch: --max-loras values of "
                                                "the start-up grid ('' = no grid).")] = "",
    grid_max_lora_rank: Annotated[str, typer.Option("--grid-max-lora-rank", help="With --launch: "
                                                    "--max-lora-rank values of the start-up grid.")] = "8,16,32",
    start_timeout: Annotated[float, typer.Option("--start-timeout-s", help="With --launch: seconds a start may "
                                                 "take.")] = 900.0,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object at the end.")] = False,
) -> None:
    """Measure a running vLLM server from the outside (designed experiments through /v1/completions and
    /metrics) and write profiling data for ``lorapack calibrate --profiling DIR --runs DIR/runs.csv``."""
    from ..measure.experiments import Caps
    from ..measure.launch import parse_grid
    from ..measure.run import MeasureOptions, MeasureTarget
    from ..measure.run import measure as run_measure

    def say(text: str) -> None:
        err_console.print(text, highlight=False, markup=False, soft_wrap=True)

    def progress(name: str, i: int, n: int) -> None:
        err_console.print(f"  {name}: {i}/{n}", highlight=False, markup=False)

    grid = parse_grid(grid_max_loras, grid_max_lora_rank) if grid_max_loras.strip() else []
    target = MeasureTarget(url=url, launch=launch, grid=tuple(grid), start_timeout_s=start_timeout, log=log,
                           server_args=server_args, api_key=api_key)
    options = MeasureOptions(budget_min=budget_min, seed=seed,
                             caps=Caps(max_concurrency=max_concurrency, max_rate_rps=max_rate,
                                       max_prompt_tokens=max_prompt_tokens, max_output_tokens=max_output_tokens),
                             mean_input_tokens=mean_input_tokens, mean_output_tokens=mean_output_tokens, n_runs=runs,
                             force=force, fresh=fresh)
    summary = run_measure(target, adapters, out, options, say=say, progress=progress)
    if json_out:
        print_json(summary)
    else:
        console.print(f"wrote {summary['out']}\nnext: {summary['calibrate']}", markup=False, highlight=False,
                      soft_wrap=True)
