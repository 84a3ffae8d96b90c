"""``lorapack validate``: the twin against real benchmark runs."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from ..benchjson import BenchOptions
from ..errors import SpecError
from .common import (
    DEFAULT_GPU,
    ForceOpt,
    GpuOpt,
    JsonOpt,
    check_limit,
    check_output_file,
    check_workers,
    console,
    err_console,
    fmt,
    limits,
    print_json,
    write_csv_atomic,
)

# server flags and adapters of vllm bench serve JSON runs (what the result file does not record); the same
# options on `validate` and `calibrate`
_JSON = "JSON runs: "
BenchMaxLoras = Annotated[int | None, typer.Option(
    "--max-loras", help=_JSON + "the server's --max-loras (else --metadata max_loras=A).", show_default=False)]
BenchMaxLoraRank = Annotated[int | None, typer.Option(
    "--max-lora-rank", help=_JSON + "the server's --max-lora-rank (else --metadata max_lora_rank=S).",
    show_default=False)]
BenchMaxCpuLoras = Annotated[int | None, typer.Option(
    "--max-cpu-loras", help=_JSON + "the server's --max-cpu-loras (default: vLLM's, = --max-loras).",
    show_default=False)]
BenchMaxNumSeqs = Annotated[int | None, typer.Option(
    "--max-num-seqs", help=_JSON + "the server's --max-num-seqs (default: the profile's).", show_default=False)]
BenchMaxNumBatchedTokens = Annotated[int | None, typer.Option(
    "--max-num-batched-tokens", help=_JSON + "the server's --max-num-batched-tokens (default: the profile's).",
    show_default=False)]
BenchAdapterRanks = Annotated[str | None, typer.Option(
    "--adapter-ranks", help=_JSON + "ranks of the adapters of --lora-modules as rank:count pairs, e.g. "
                            "'8:4 16:4' (else --metadata lora_ranks=...).", show_default=False)]


def _nested(scores: dict, keys: tuple):
    for k in keys:
        if not isinstance(scores, dict) or k not in scores:
            return None
        scores = scores[k]
    return scores


def validate(
    runs: Annotated[list[Path], typer.Argument(
        help="Real runs: a CSV (schema of shared/data/real-runs/*.csv) and/or vllm bench serve result "
             "JSON files (docs/bench-json.md).", show_default=False)],
    seeds: Annotated[int, typer.Option(help="Seeds per run; metrics are averaged.")] = 1,
    gpu: GpuOpt = None,
    profile: Annotated[Path | None, typer.Option(
        "--profile", help="Score the runs of this profile's model with it (e.g. one you calibrated) instead of "
                          "the shipped profiles; runs of other models are skipped.")] = None,
    lengths: Annotated[str, typer.Option(help="Length law around the row's pool means: fixed|lognormal.")] = "lognormal",
    workers: Annotated[int, typer.Option(help="Parallel processes (0 = all cores).")] = 0,
    limit: Annotated[int | None, typer.Option(help="Only the first K rows (quick checks).")] = None,
    out: Annotated[Path | None, typer.Option("--out", help="Write per-run measured vs predicted CSV.")] = None,
    engine: Annotated[str, typer.Option(help="Who predicts: twin (simulation) | surrogate | tree (learned).")] = "twin",
    models: Annotated[Path | None, typer.Option("--models", help="Model directory for --engine surrogate/tree "
                                                                 "(default: the shipped models).")] = None,
    max_loras: BenchMaxLoras = None,
    max_lora_rank: BenchMaxLoraRank = None,
    max_cpu_loras: BenchMaxCpuLoras = None,
    max_num_seqs: BenchMaxNumSeqs = None,
    max_num_batched_tokens: BenchMaxNumBatchedTokens = None,
    adapter_ranks: BenchAdapterRanks = None,
    force: ForceOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Replay real benchmark runs through the twin (or ask a learned oracle) and score it (SMAPE, starvation
    agreement and macro-F1, OOM agreement)."""
    from ..validate import ValidateOptions, run_validation

    check_limit(limit)
    check_workers(workers)
    if out is not None:  # fail before the (long) validation, not after it
        check_output_file(out, "--out")
    prof = None
    if profile is not None:
        if gpu:
            raise SpecError(f"--profile {profile} and --gpu {gpu}: give one or the other (the profile file "
                            f"names its own GPU)")
        from ..profile import load_profile_file

        prof = load_profile_file(profile)
    bench = BenchOptions(max_loras=max_loras, max_lora_rank=max_lora_rank, max_cpu_loras=max_cpu_loras,
                         max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                         adapter_ranks=adapter_ranks)
    log = None if json_out else (lambda s: err_console.print(f"[dim]{escape(s)}[/dim]", highlight=False))
    options = ValidateOptions(seeds=seeds, gpu=gpu or DEFAULT_GPU, lengths=lengths, workers=workers, limit=limit,
                              limits=limits(force), profile=prof, engine=engine, models_dir=models)
    report = run_validation(runs, options, bench=bench, progress=not json_out, log=log)
    if out is not None:
        write_csv_atomic(out, report["rows"])
    if json_out:
        print_json({"models": report["models"], "skipped": report["skipped"],
                    **({"pooled": report["pooled"]} if report["pooled"] else {}),
                    **({"notes": report["notes"]} if report.get("notes") else {})})
        return
    # one column per model, one row per score: fits 80 columns for the usual one to three models
    how = f"{seeds} seed(s), {lengths} lengths" if engine == "twin" else f"{engine} models, no simulation"
    names = runs[0].name if len(runs) == 1 else f"{len(runs)} files"
    t = Table(title=f"{engine} vs real runs: {names}\n({how}"
                    f"{f', --profile {profile.name}' if profile is not None else ''})", title_justify="left")
    t.add_column("")
    models = report["models"]
    for m in models:
        t.add_column(m, justify="right", no_wrap=True)
    for label, key, digits in (("runs ok / oom / skipped", None, 0), ("SMAPE throughput %", "smape_throughput", 2),
                               ("SMAPE ITL %", "smape_itl", 2), ("SMAPE TTFT %", "smape_ttft", 2),
                               ("bias throughput % (twin-real)", "bias_throughput_pct", 2),
                               ("bias ITL % (twin-real)", "bias_itl_pct", 2),
                               ("SMAPE TTFT p99 / ITL p99 %", ("smape_ttft_p99", "smape_itl_p99"), 1),
                               ("TTFT < 1 s: median error %", ("ttft_regimes", "lt_1s", "bias_median_pct"), 1),
                               ("TTFT 1-30 s: median error %", ("ttft_regimes", "1_30s", "bias_median_pct"), 1),
                               ("mean TTFT <= 2 s agreement", ("ttft_objective_agreement", "2", "agreement"), 3),
                               ("  optimistic misses", ("ttft_objective_agreement", "2", "optimistic"), 0),
                               ("starved agreement", "starved_agreement", 3),
                               ("  on clear labels", "starved_agreement_clear", 3),
                               ("starved macro-F1", "starved_f1", 3),
                               ("OOM agreement", "oom_agreement", 3),
                               *((("outside training range", "n_out_of_range", 0),) if engine != "twin" else ())):
        if key is None:
            t.add_row(label, *(f"{s['n_ok']} / {s['n_oom']} / {s['n_skipped']}" for s in models.values()))
        elif isinstance(key, tuple) and len(key) == 2:  # two scores in one cell
            t.add_row(label, *(f"{fmt(s.get(key[0]), digits)} / {fmt(s.get(key[1]), digits)}" for s in models.values()))
        elif isinstance(key, tuple):  # a nested score
            t.add_row(label, *(fmt(_nested(s, key), digits) for s in models.values()))
        else:
            t.add_row(label, *(fmt(s.get(key), digits) for s in models.values()))
    console.print(t)
    console.print("SMAPE without the factor 2 (0-100; lorapack.realruns.smape); TTFT = completed-only mean; --json adds the "
                  "breakdowns by group and by --max-lora-rank, every TTFT regime and objective (1, 2, 5, 10 s).")
    if report["pooled"]:
        ag = report["pooled"]["ttft_objective_agreement"]
        console.print("all models, mean TTFT <= T agreement (optimistic misses / runs):\n  " + ", ".join(
            f"{t} s {fmt(a['agreement'], 3)} ({a['optimistic']}/{a['n']})" for t, a in ag.items()), highlight=False)
    for m, s in report["models"].items():
        for why, n in s.get("skip_reasons", {}).items():
            console.print(f"skipped {n} run(s) of {m}: {why}", highlight=False)
