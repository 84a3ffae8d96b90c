"""Rates from traffic: a request log and the adapters' ranks become the workload of the next window.

The log is a CSV ``arrived_at,adapter_id[,num_prefill_tokens,num_decode_tokens]`` (the shipped traces'
columns plus the adapter; times in seconds, any origin). The adapters file is ``adapter_id,rank[,path]``
(``rate_rps`` may be there too, e.g. a workload CSV: it is ignored). docs/replan.md, "Rates from traffic".

Windows: the log is cut into consecutive windows of ``window_s`` ending at ``end_s`` (default: the last
arrival); window 0 is the most recent. Only whole windows inside the log count (a log shorter than one window
is rated over its span, with a note). An adapter's rate in window k is its requests there / ``window_s``.

Forecasts (the next window's rate of each adapter):

* ``last``: window 0's rate.
* ``ewma``: the windows' rates weighted ``(1 - alpha)^k`` (k = 0 most recent), normalised.
* ``peak``: the largest window rate (conservative: plans for the busiest window seen).

An adapter whose first request falls after the log's first window is *new*: the windows before it appeared
are left out of its ``ewma`` / ``peak`` (it did not exist, it was not idle). A rare adapter's first request can
look "new" by chance; the floor and the ``last`` forecast are unaffected by that choice.

Every kept adapter gets at least ``floor_rps`` (default one request per hour): an adapter with no request in
the forecast window stays in the plan (it needs a slot and memory) at the floor. An adapter silent for longer
than ``grace_s`` (its last request, or the log's start if it has none, that long before ``end_s``) is dropped
from the workload and listed as dropped; the default grace (a day) drops nothing from logs shorter than that.
Adapters in the log but not in the adapters file are an error (their rank is unknown) unless
``ignore_unknown``: then their requests are left out of the rates (their lengths still count).

Lengths: the observed ``(prompt, output)`` pairs of the forecast window (or of the whole log when that window
holds fewer than ``MIN_LENGTH_PAIRS``) as an empirical length law, which ``place`` and ``simulate`` bootstrap.
A log without token columns gives no length law (the profile's default applies).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import DataError, SpecError
from ..textfiles import iter_csv_rows

LOG_COLUMNS = ("arrived_at", "adapter_id")
LOG_TOKEN_COLUMNS = ("num_prefill_tokens", "num_decode_tokens")
REGISTRY_COLUMNS = ("adapter_id", "rank")
REGISTRY_OPTIONAL_COLUMNS = ("rate_rps", "path")
FORECASTS = ("last", "ewma", "peak")
DEFAULT_FLOOR_RPS = 1.0 / 3600.0  # one request per hour
DEFAULT_GRACE_S = 86_400.0  # a day
DEFAULT_EWMA_ALPHA = 0.5
MIN_LENGTH_PAIRS = 50  # fewer pairs in the forecast window: the whole log's
UNKNOWN_SHOWN = 5  # unknown adapter ids named in the error


@dataclass(frozen=True)
class RequestLog:
    """A request log sorted by time. ``adapter`` indexes ``adapter_ids``; token arrays are None without the
    token columns."""

    path: str
    sha256: str
    t_s: np.ndarray  # float64 [n], non-decreasing
    adapter: np.ndarray  # int64 [n]
    adapter_ids: tuple[str, ...]
    prompt_tokens: np.ndarray | None  # int64 [n]
    output_tokens: np.ndarray | None

    def __len__(self) -> int:
        return len(self.t_s)


@dataclass(frozen=True)
class RegistryAdapter:
    adapter_id: str
    rank: int
    path: str | None = None


@dataclass(frozen=True)
class RateOptions:
    """How the next window's rates are forecast (module docstring)."""

    window_s: float
    forecast: str = "ewma"
    end_s: float | None = None  # None: the log's last arrival
    ewma_alpha: float = DEFAULT_EWMA_ALPHA
    floor_rps: float = DEFAULT_FLOOR_RPS
    grace_s: float = DEFAULT_GRACE_S
    ignore_unknown: bool = False

    def __post_init__(self) -> None:
        if not (math.isfinite(self.window_s) and self.window_s > 0):
            raise SpecError(f"--window-s {self.window_s}: expected a number of seconds > 0")
        if self.forecast not in FORECASTS:
            raise SpecError(f"--forecast {self.forecast!r}: expected one of {', '.join(FORECASTS)}")
        if self.end_s is not None and not math.isfinite(self.end_s):
            raise SpecError(f"--end-s {self.end_s}: expected a finite time in the log's seconds")
        if not (math.isfinite(self.ewma_alpha) and 0 < self.ewma_alpha <= 1):
            raise SpecError(f"--ewma-alpha {self.ewma_alpha}: expected a number in (0, 1]")
        if not (math.isfinite(self.floor_rps) and self.floor_rps > 0):
            raise SpecError(f"--floor-rps {self.floor_rps}: expected a rate > 0 (requests/s)")
        if not (self.grace_s > 0):  # inf allowed: never drop
            raise SpecError(f"--grace-s {self.grace_s}: expected a number of seconds > 0")


@dataclass(frozen=True)
class AdapterRate:
    """One adapter of the forecast. ``status``: ``active`` (requests in the forecast window), ``new`` (its
    first request after the log's first window), ``silent`` (none in the forecast window: at least the floor),
    ``dropped`` (silent for longer than the grace: not in the workload)."""

    adapter_id: str
    rank: int
    path: str | None
    rate_rps: float
    status: str
    requests_in_window: int
    last_seen_s: float | None  # None: no request in the log


@dataclass(frozen=True)
class Forecast:
    options: RateOptions
    log_path: str
    log_sha256: str
    start_s: float
    end_s: float
    windows: int  # whole windows used (1 with a short log)
    window_span_s: float  # the length each window's count is divided by (window_s, or the short log's span)
    adapters: tuple[AdapterRate, ...]  # registry order
    ignored_unknown: tuple[str, ...] = ()
    lengths: np.ndarray | None = None  # int64 [n, 2] (prompt, output); None: no token columns
    lengths_from: str = ""  # "forecast window" / "whole log" / ""
    notes: tuple[str, ...] = field(default_factory=tuple)

    def kept(self) -> list[AdapterRate]:
        return [a for a in self.adapters if a.status != "dropped"]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def read_request_log(path: str | Path) -> RequestLog:
    """Read and check a request log (module docstring); errors name the file and line."""
    p = Path(path)
    t: list[float] = []
    ids: list[str] = []
    prompt: list[int] = []
    output: list[int] = []
    has_tokens: bool | None = None
    for line, row in iter_csv_rows(p, LOG_COLUMNS, LOG_TOKEN_COLUMNS, error=DataError):
        if has_tokens is None:
            has_tokens = all(c in row for c in LOG_TOKEN_COLUMNS)
            if not has_tokens and any(c in row for c in LOG_TOKEN_COLUMNS):
                raise DataError(f"{p}:{line - 1}: expected both token columns {','.join(LOG_TOKEN_COLUMNS)} or "
                                "neither")
        try:
            t_s = float(row["arrived_at"])
        except ValueError:
            raise DataError(f"{p}:{line}: arrived_at: expected a number of seconds, got {row['arrived_at']!r}") from None
        if not math.isfinite(t_s):
            raise DataError(f"{p}:{line}: arrived_at: expected a finite number of seconds, got {row['arrived_at']!r}")
        a = row["adapter_id"]
        if not a:
            raise DataError(f"{p}:{line}: adapter_id: expected an adapter id, got an empty field")
        if has_tokens:
            try:
                pt, ot = int(row["num_prefill_tokens"]), int(row["num_decode_tokens"])
            except ValueError:
                raise DataError(f"{p}:{line}: expected two integer token counts, got "
                                f"{row['num_prefill_tokens']!r},{row['num_decode_tokens']!r}") from None
            if pt < 1 or ot < 1:
                raise DataError(f"{p}:{line}: expected token counts >= 1, got {pt},{ot}")
            prompt.append(pt)
            output.append(ot)
        t.append(t_s)
        ids.append(a)
    if not t:
        raise DataError(f"{p}:2: no requests; expected at least one row after the header")
    names = tuple(dict.fromkeys(ids))
    index = {a: i for i, a in enumerate(names)}
    t_arr = np.asarray(t, dtype=np.float64)
    order = np.argsort(t_arr, kind="stable")  # logs from several servers need not be sorted
    adapter = np.fromiter((index[a] for a in ids), dtype=np.int64, count=len(ids))[order]
    tok = (np.asarray(prompt, dtype=np.int64)[order], np.asarray(output, dtype=np.int64)[order]) if has_tokens \
        else (None, None)
    return RequestLog(str(p), _sha256(p), t_arr[order], adapter, names, tok[0], tok[1])


def read_registry(path: str | Path) -> list[RegistryAdapter]:
    """The adapters to serve: ``adapter_id,rank[,path]`` (a ``rate_rps`` column is allowed and ignored); the
    same id and rank rules as a workload's adapters."""
    from ..workload.files import read_adapter_table

    table = read_adapter_table(path, REGISTRY_COLUMNS, REGISTRY_OPTIONAL_COLUMNS, fill={"rate_rps": 1.0})
    return [RegistryAdapter(a.adapter_id, a.rank, a.path) for a in table]


def _window_counts(log: RequestLog, keep: np.ndarray, start_s: float, end_s: float, window_s: float
                   ) -> tuple[np.ndarray, int, float]:
    """Counts ``[adapter, window]`` (window 0 most recent) of the requests in whole windows, the number of
    windows, and the span each count is divided by."""
    span = end_s - start_s
    n_win = int(math.floor(span / window_s + 1e-9))
    if n_win >= 1:
        width = window_s
    else:  # a log shorter than one window: rated over its span
        n_win, width = 1, max(span, 1e-9)
    lo = end_s - n_win * width
    t = log.t_s
    inside = keep & (t > lo) & (t <= end_s)  # (lo, end]: the last arrival is in window 0
    k = np.minimum(((end_s - t[inside]) // width).astype(np.int64), n_win - 1)
    counts = np.zeros((len(log.adapter_ids), n_win), dtype=np.int64)
    np.add.at(counts, (log.adapter[inside], k), 1)
    return counts, n_win, width


def forecast_rates(log: RequestLog, registry: list[RegistryAdapter], options: RateOptions) -> Forecast:
    """The next window's workload from the log (module docstring)."""
    o = options
    known = {a.adapter_id for a in registry}
    unknown = [a for a in log.adapter_ids if a not in known]
    if unknown and not o.ignore_unknown:
        shown = ", ".join(unknown[:UNKNOWN_SHOWN]) + (f" (and {len(unknown) - UNKNOWN_SHOWN} more)"
                                                       if len(unknown) > UNKNOWN_SHOWN else "")
        raise SpecError(f"{log.path}: adapters not in the adapters file: {shown}; expected each adapter of the log "
                        "with its rank in --adapters (or --ignore-unknown to leave their requests out)")
    start_s = float(log.t_s[0])
    end_s = float(log.t_s[-1]) if o.end_s is None else float(o.end_s)
    if o.end_s is None and end_s <= start_s:
        raise SpecError(f"{log.path}: every request arrives at {start_s:g} s; expected a log that spans some time")
    if end_s <= start_s:
        raise SpecError(f"--end-s {end_s:g}: expected a time after the log's first arrival ({start_s:g} s)")
    notes: list[str] = []
    log_idx = {a: i for i, a in enumerate(log.adapter_ids)}
    keep = np.isin(log.adapter, [log_idx[a] for a in log.adapter_ids if a in known])
    counts, n_win, width = _window_counts(log, keep, start_s, end_s, o.window_s)
    if end_s - start_s < o.window_s:
        notes.append(f"the log spans {end_s - start_s:.0f} s, less than one {o.window_s:g} s window: rates are "
                     "over its whole span")
    rates = counts / width  # [adapter, window]
    first_window_lo = end_s - n_win * width
    weights = (1.0 - o.ewma_alpha) ** np.arange(n_win)  # alpha 1: [1, 0, 0, ...] (0.0 ** 0 == 1)
    out: list[AdapterRate] = []
    before_end = log.t_s <= end_s
    for reg in registry:
        i = log_idx.get(reg.adapter_id)
        mine = (log.adapter == i) & before_end if i is not None else None
        seen = log.t_s[mine] if mine is not None else np.empty(0)
        last_seen = float(seen[-1]) if len(seen) else None
        first_seen = float(seen[0]) if len(seen) else None
        r = rates[i] if i is not None else np.zeros(n_win)
        # windows wholly before a new adapter's first request are left out (it did not exist yet)
        n_alive = n_win
        is_new = first_seen is not None and n_win > 1 and first_seen > first_window_lo + width
        if is_new:
            n_alive = int(min(n_win, (end_s - first_seen) // width + 1))
        r_alive = r[:n_alive]
        if o.forecast == "last":
            rate = float(r[0])
        elif o.forecast == "peak":
            rate = float(r_alive.max())
        else:
            w = weights[:n_alive]
            rate = float((w * r_alive).sum() / w.sum())
        in_window = int(counts[i, 0]) if i is not None else 0
        silent_for = end_s - (last_seen if last_seen is not None else start_s)
        if silent_for > o.grace_s:
            status = "dropped"
        elif in_window == 0:
            status = "silent"
        elif is_new:
            status = "new"
        else:
            status = "active"
        out.append(AdapterRate(reg.adapter_id, reg.rank, reg.path, max(rate, o.floor_rps), status, in_window,
                               last_seen))
    if all(a.status == "dropped" for a in out):
        raise SpecError(f"--grace-s {o.grace_s:g}: every adapter has been silent for longer; expected a grace that "
                        "keeps at least one")
    lengths, lengths_from = None, ""
    if log.prompt_tokens is not None and log.output_tokens is not None:
        in_w0 = (log.t_s > end_s - width) & before_end
        if int(in_w0.sum()) >= MIN_LENGTH_PAIRS:
            sel, lengths_from = in_w0, "the forecast window"
        else:
            sel, lengths_from = before_end, "the whole log"
            notes.append(f"fewer than {MIN_LENGTH_PAIRS} requests in the forecast window: lengths from the whole log")
        lengths = np.stack([log.prompt_tokens[sel], log.output_tokens[sel]], axis=1)
    else:
        notes.append("the log has no token columns: no length law (the profile's default applies)")
    ignored = tuple(unknown) if unknown else ()
    if ignored:
        notes.append(f"{len(ignored)} adapter(s) of the log not in the adapters file: their requests left out")
    return Forecast(o, log.path, log.sha256, start_s, end_s, n_win, width, tuple(out), ignored, lengths,
                    lengths_from, tuple(notes))


def workload_text(forecast: Forecast, lengths_file: str | None) -> str:
    """The workload YAML of a forecast (``lengths_file``: the empirical lengths CSV, relative to the YAML)."""
    import yaml

    f, o = forecast, forecast.options
    dropped = [a.adapter_id for a in f.adapters if a.status == "dropped"]
    head = [
        "# written by lorapack rates: the next window's workload from observed traffic (docs/replan.md)",
        f"# log: {Path(f.log_path).name} (sha256 {f.log_sha256[:16]}), {f.start_s:g} .. {f.end_s:g} s",
        f"# forecast: {o.forecast}" + (f" (alpha {o.ewma_alpha:g})" if o.forecast == "ewma" else "")
        + f" over {f.windows} window(s) of {f.window_span_s:g} s; floor {o.floor_rps:.6g} req/s; grace {o.grace_s:g} s",
    ]
    if dropped:
        head.append(f"# dropped (silent longer than the grace): {', '.join(dropped)}")
    for note in f.notes:
        head.append(f"# note: {note}")
    adapters = []
    for a in f.kept():
        entry: dict = {"adapter_id": a.adapter_id, "rank": a.rank, "rate_rps": float(f"{a.rate_rps:.6g}")}
        if a.path:
            entry["path"] = a.path
        adapters.append(entry)
    body: dict = {"adapters": adapters}
    if lengths_file is not None:
        body["lengths"] = {"kind": "empirical", "path": lengths_file}
    body["arrivals"] = {"kind": "poisson"}
    body["duration_s"] = float(o.window_s)
    return "\n".join(head) + "\n" + yaml.safe_dump(body, sort_keys=False, default_flow_style=None, width=120)


def write_workload(forecast: Forecast, out: str | Path) -> tuple[Path, Path | None]:
    """Write the workload YAML (and its lengths CSV beside it, ``<stem>.lengths.csv``) atomically: both or
    neither. Returns their paths."""
    from ..checks import atomic_path

    out = Path(out)
    lengths_path = out.with_name(out.stem + ".lengths.csv") if forecast.lengths is not None else None
    text = workload_text(forecast, lengths_path.name if lengths_path is not None else None)
    if lengths_path is None:
        with atomic_path(out) as tmp:
            tmp.write_text(text, encoding="utf-8")
        return out, None
    rows = "".join(f"{p},{q}\n" for p, q in forecast.lengths.tolist())
    with atomic_path(out) as tmp_w, atomic_path(lengths_path) as tmp_l:  # the lengths land first
        tmp_l.write_text("input_tokens,output_tokens\n" + rows, encoding="utf-8")
        tmp_w.write_text(text, encoding="utf-8")
    return out, lengths_path
