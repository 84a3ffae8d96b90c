"""``lorapack rates``: a request log and the adapters' ranks -> the workload of the next window."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from ..errors import SpecError
from .common import JsonOpt, check_output_file, console, err_console, print_json

STATUSES = ("active", "new", "silent", "dropped")
LARGEST_SHOWN = 5  # the busiest adapters listed in the table


def rates(
    log: Annotated[Path, typer.Argument(help="Request log CSV with columns arrived_at, adapter_id and "
                                        "optionally num_prefill_tokens, num_decode_tokens (the shipped traces' "
                                        "columns plus the adapter).")],
    adapters: Annotated[Path, typer.Option("--adapters", help="The adapters to serve: a CSV with columns "
                                           "adapter_id, rank and optionally path (a rate_rps column is "
                                           "ignored).")],
    window_s: Annotated[float, typer.Option("--window-s", help="Window length (s): the log is cut into windows "
                                            "of this length ending at --end-s; the forecast is for the next "
                                            "one.")],
    out: Annotated[Path, typer.Option("--out", help="Workload YAML to write (its empirical lengths go to "
                                      "<stem>.lengths.csv beside it).")],
    forecast: Annotated[str, typer.Option("--forecast", help="last: the last window's rate; ewma: the windows' "
                                          "rates weighted (1-alpha)^k, most recent first; peak: the busiest "
                                          "window's.")] = "ewma",
    end_s: Annotated[float | None, typer.Option("--end-s", help="End of the last window, in the log's seconds "
                                                "(default: its last arrival).")] = None,
    ewma_alpha: Annotated[float, typer.Option("--ewma-alpha", help="Weight of the most recent window in "
                                              "ewma (0 < alpha <= 1).")] = 0.5,
    floor_rps: Annotated[float, typer.Option("--floor-rps", help="Least rate of a kept adapter (req/s; "
                                             "default one per hour): a silent adapter stays in the plan at "
                                             "it.")] = 1.0 / 3600.0,
    grace_s: Annotated[float, typer.Option("--grace-s", help="An adapter silent for longer than this (s) is "
                                           "dropped from the workload (default: a day).")] = 86_400.0,
    ignore_unknown: Annotated[bool, typer.Option("--ignore-unknown", help="Leave out the requests of adapters "
                                                 "that are not in --adapters (default: an error).")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Forecast the next window's per-adapter rates from a request log: writes a workload for place.

    Rates per window of --window-s, combined by --forecast; every kept adapter gets at least --floor-rps; an
    adapter silent for longer than --grace-s is dropped; lengths are the observed pairs (an empirical law).
    docs/replan.md."""
    from ..replan.rates import RateOptions, forecast_rates, read_registry, read_request_log, write_workload

    opts = RateOptions(window_s=window_s, forecast=forecast, end_s=end_s, ewma_alpha=ewma_alpha,
                       floor_rps=floor_rps, grace_s=grace_s, ignore_unknown=ignore_unknown)
    out = check_output_file(out, "--out")
    if out.suffix.lower() not in (".yaml", ".yml"):
        raise SpecError(f"--out {out}: expected a .yaml file (the workload)")
    registry = read_registry(adapters)
    fc = forecast_rates(read_request_log(log), registry, opts)
    check_output_file(out.with_name(out.stem + ".lengths.csv"), "--out's lengths file")
    yaml_path, lengths_path = write_workload(fc, out)
    kept = fc.kept()
    counts = {s: sum(a.status == s for a in fc.adapters) for s in STATUSES}
    total = sum(a.rate_rps for a in kept)
    if as_json:
        print_json({"workload": str(yaml_path), "lengths": str(lengths_path) if lengths_path else None,
                    "forecast": opts.forecast, "windows": fc.windows, "window_s": fc.window_span_s,
                    "start_s": fc.start_s, "end_s": fc.end_s, "adapters": counts, "total_rate_rps": total,
                    "lengths_from": fc.lengths_from or None, "notes": list(fc.notes),
                    "ignored_unknown": list(fc.ignored_unknown),
                    "rates": [{"adapter_id": a.adapter_id, "rank": a.rank, "rate_rps": a.rate_rps, "status": a.status,
                               "requests_in_window": a.requests_in_window} for a in fc.adapters]})
        return
    t = Table(title=f"Next window's workload ({opts.forecast} over {fc.windows} window(s) of {fc.window_span_s:g} s)",
              show_header=False, title_justify="left")
    t.add_column("what", style="bold")
    t.add_column("value", overflow="fold")
    t.add_row("adapters kept", f"{len(kept)} (active {counts['active']}, new {counts['new']}, silent at >= floor "
              f"{counts['silent']})")
    if counts["dropped"]:
        names = [a.adapter_id for a in fc.adapters if a.status == "dropped"]
        t.add_row("dropped", f"{counts['dropped']} silent > {opts.grace_s:g} s: {', '.join(names[:LARGEST_SHOWN])}"
                  + (" …" if len(names) > LARGEST_SHOWN else ""))
    t.add_row("total rate", f"{total:.3f} req/s")
    busiest = sorted(kept, key=lambda a: -a.rate_rps)[:LARGEST_SHOWN]
    t.add_row("busiest", ", ".join(f"{a.adapter_id} {a.rate_rps:.3g}" for a in busiest))
    if fc.lengths is not None:
        p, o = fc.lengths.mean(axis=0)
        t.add_row("lengths", f"empirical, {len(fc.lengths):,} pairs from {fc.lengths_from} (mean {p:.0f} in / "
                  f"{o:.0f} out tokens)")
    else:
        t.add_row("lengths", "none in the log: the profile's default")
    t.add_row("wrote", f"{yaml_path}" + (f", {lengths_path}" if lengths_path else ""))
    console.print(t)
    for note in fc.notes:
        err_console.print(f"note: {note}", highlight=False, soft_wrap=True)
