"""Real benchmark runs: read a runs CSV, rebuild a run as twin inputs, simulate it, score the twin against it.

The one place that turns a measured run (schema of ``shared/data/real-runs/*.csv``) into twin inputs, and
the one place that scores predictions against measurements; ``lorapack validate`` and the calibration's
refinement (``calibrate.refine``) both use it (docs/calibration.md).

A run is rebuilt as the real benchmark did: ``n_adapters`` adapters with ranks from ``rank_counts`` and rates
from ``rate_counts``, the rank<->rate pairing and the registration order shuffled by the seed, the row's pool
mean lengths, its window and server flags, and the client-saturation cap on (it is part of the measured
system: ``client_cap``, docs/engine-semantics.md).
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .errors import DataError, LorapackError
from .guards import Limits
from .profile import Profile
from .twin.metrics import RunMetrics

REQUIRED = ("run_id", "model", "n_adapters", "max_loras", "max_lora_rank", "rank_counts", "rate_counts",
            "status")
NOISY_RATIO = (0.85, 0.95)  # real labels with a throughput ratio in here are noise (data README §6)
DEFAULT_MEAN_INPUT_TOKENS, DEFAULT_MEAN_OUTPUT_TOKENS = 223.0, 197.0  # pool means when a row has none
GROUP_SEP = "__"
NAN = float("nan")


# ---------------------------------------------------------------------------------------------------------
# reading rows


def row_float(row: dict, key: str, default: float | None = None) -> float | None:
    """The row's value of ``key`` as a float; ``default`` when empty, missing or not a number."""
    v = (row.get(key) or "").strip()
    if v == "":
        return default
    try:
        return float(v)
    except ValueError:
        return default


def _row_int(row: dict, key: str) -> int | None:
    v = row_float(row, key)
    return int(v) if v is not None and math.isfinite(v) else None


def parse_counts(text: str, kind: type = float) -> list:
    """``"8:64 16:64"`` -> ``[8]*64 + [16]*64``; a malformed pair raises ``DataError``."""
    out: list = []
    for part in (text or "").split():
        value, sep, count = part.partition(":")
        try:
            if not sep:
                raise ValueError
            v = float(value)
            n = int(count)
            if not math.isfinite(v) or v < 0 or n < 0 or (kind is int and v != int(v)):
                raise ValueError
        except ValueError:
            what = "a non-negative integer" if kind is int else "a finite number >= 0"
            raise DataError(f"malformed count '{part}' in '{text}': expected value:count with value "
                            f"{what} and count an integer >= 0, e.g. '8:64 16:64'") from None
        out.extend([int(v) if kind is int else kind(value)] * n)
    return out


def read_runs(path: str | Path) -> list[dict]:
    from .checks import check_input_file

    path = check_input_file(path, "runs file", DataError)
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in REQUIRED if c not in (reader.fieldnames or [])]
        if missing:
            raise DataError(f"{path}: missing column(s) {', '.join(missing)}; expected the real-runs schema "
                            f"(see shared/data/README.md §4)")
        return list(reader)


def _int_field(row: dict, key: str, where: str, minimum: int = 1) -> int:
    v = row_float(row, key)
    if v is None or not math.isfinite(v) or v != int(v) or v < minimum:
        raise DataError(f"{where}: column {key} = {row.get(key)!r}; expected an integer >= {minimum}")
    return int(v)


def check_row(row: dict, where: str, measured: Sequence[str] = (), need_counts: bool = False) -> None:
    """Fail early, naming the row (``where``), on a row that cannot be rebuilt (instead of inside a worker).

    Real oom rows need only the flags of the start-up rule. ``measured``: columns an ok row must carry as
    positive numbers; ``need_counts``: an ok row must have ``rank_counts`` and ``rate_counts``."""
    status = (row.get("status") or "").strip()
    if status not in ("ok", "oom"):
        raise DataError(f"{where}: status {row.get('status')!r}; expected ok or oom")
    _int_field(row, "max_loras", where)
    _int_field(row, "max_lora_rank", where)
    if status == "oom":  # scored on the start-up rule only; oom rows carry no rates
        return
    n = _int_field(row, "n_adapters", where)
    try:
        ranks = parse_counts(row.get("rank_counts") or "", int)
        rates = parse_counts(row.get("rate_counts") or "", float)
    except DataError as e:
        raise DataError(f"{where}: {e}") from None
    if (ranks or rates) and (len(ranks) != n or len(rates) != n):
        raise DataError(f"{where}: rank_counts/rate_counts ({len(ranks)}/{len(rates)} adapters) do not add up "
                        f"to n_adapters={n}")
    if need_counts and not (ranks and rates):
        raise DataError(f"{where}: an ok run needs rank_counts and rate_counts")
    for c in measured:
        v = row_float(row, c)
        if v is None or not math.isfinite(v) or v <= 0:
            raise DataError(f"{where}: column '{c}' is empty, NaN or not positive in an ok run")


def run_group(run_id: str) -> str:
    """The group of a run: the middle part of ``run_id`` (``<prefix>__<model>__<group>___<suffix>``)."""
    parts = run_id.split(GROUP_SEP)
    return parts[2].rstrip("_") if len(parts) >= 3 else ""


def measured_oom(row: dict) -> bool:
    return (row.get("status") or "").strip() == "oom"


# ---------------------------------------------------------------------------------------------------------
# rebuilding a run as twin inputs


def build_workload(row: dict, seed: int, lengths: str = "lognormal", cv: float | None = None):
    """The row's workload: shuffled rank/rate assignment, pool-mean lengths, Poisson arrivals.

    ``cv``: post-filter CV of log-normal lengths (None = the spec default)."""
    from pydantic import ValidationError

    from .spec import Adapter, LengthsSpec, PoissonArrivals, Workload

    n = int(float(row["n_adapters"]))
    ranks = parse_counts(row["rank_counts"], int)
    rates = parse_counts(row["rate_counts"], float)
    if len(ranks) != n or len(rates) != n:
        raise DataError(f"run {row['run_id']}: rank_counts/rate_counts do not add up to n_adapters={n}")
    rng = np.random.default_rng([seed, 0x5EED])
    ranks = np.array(ranks)[rng.permutation(n)]
    rates = np.array(rates)[rng.permutation(n)]
    mi = row_float(row, "mean_input_tokens", DEFAULT_MEAN_INPUT_TOKENS)
    mo = row_float(row, "mean_output_tokens", DEFAULT_MEAN_OUTPUT_TOKENS)
    extra = {"cv": float(cv)} if cv is not None and lengths == "lognormal" else {}
    try:
        adapters = [Adapter(adapter_id=f"adapter-{i}", rank=int(ranks[i]), rate_rps=float(rates[i]))
                    for i in range(n)]
        return Workload(adapters=adapters, lengths=LengthsSpec(kind=lengths, mean_input_tokens=mi,
                                                               mean_output_tokens=mo, **extra),
                        arrivals=PoissonArrivals(), duration_s=row_float(row, "window_s", 3600.0))
    except ValidationError as e:  # e.g. mean_input_tokens 1e12 or window_s -5 in the runs file
        err = e.errors(include_url=False)[0]
        where = ".".join(str(x) for x in err["loc"])
        raise DataError(f"run {row.get('run_id')}: {where}: {err['msg'].removeprefix('Value error, ')} "
                        f"(got {err.get('input')!r})") from None


REAL_METRICS_SCRAPE_S = 2.0


def metrics_poller_s(row: dict) -> float | None:
    """The /metrics poller of a run: its ``metrics_scrape_s`` column when it has one (empty: none); else the
    reference harness's 2 s for the research runs CSV, and none for ``vllm bench serve`` JSON runs
    (``source``) and ``lorapack measure`` runs (``ttft_source``), whose clients poll nothing."""
    if "metrics_scrape_s" in row:
        v = row_float(row, "metrics_scrape_s")
        return v if v is not None and v > 0 else None
    return None if row.get("source") or row.get("ttft_source") else REAL_METRICS_SCRAPE_S


def server_flags(row: dict, profile: Profile, client_cap: int | None = None):
    """The row's vLLM flags (``lorapack.server.ServerConfig``); the client cap defaults to the real benchmark's."""
    from .server import ServerConfig
    from .twin.run import REAL_CLIENT_CAP

    # every reference run had the harness's /metrics poller (concurrent_metrics_checker.py: GET, parse, sleep 2 s;
    # ../shared/data README, "2-second Prometheus samples"): ``metrics_poller_s``
    return ServerConfig(metrics_scrape_s=metrics_poller_s(row),
        max_loras=int(float(row["max_loras"])), max_lora_rank=int(float(row["max_lora_rank"])),
        max_cpu_loras=int(row_float(row, "max_cpu_loras", float(row["n_adapters"]))),
        max_num_batched_tokens=int(row_float(row, "max_num_batched_tokens", profile.max_num_batched_tokens)),
        max_num_seqs=int(row_float(row, "max_num_seqs", profile.max_num_seqs)),
        client_cap=REAL_CLIENT_CAP if client_cap is None else int(client_cap))


@functools.lru_cache(maxsize=4096)
def feasible_cv(mean_input: float, mean_output: float, cv: float) -> float:
    """``cv``, or the largest CV below it that the truncated log-normal law can reach for these post-filter
    means (high CVs are unreachable under the ShareGPT filter: P <= 1024, P + O <= 2048). Lets the refinement
    try any CV: beyond the reachable range the response is flat and the prior pulls it back."""
    from .errors import SpecError
    from .workload.lengths import solve_lognormal_lengths

    def ok(c: float) -> bool:
        try:
            solve_lognormal_lengths(mean_input, mean_output, c)
        except SpecError:
            return False
        return True

    if ok(cv):
        return cv
    lo, hi = min(cv, 0.05), cv
    if not ok(lo):
        return cv  # nothing reachable: let the workload raise its own message
    for _ in range(20):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def simulate_run(profile: Profile, row: dict, seed: int = 0, lengths: str = "lognormal", cv: float | None = None,
                 client_cap: int | None = None, limits: Limits | None = None) -> RunMetrics:
    """Rebuild one real run and simulate it with ``profile``.

    ``cv`` overrides the profile's fitted length CV (``profile.runs_lengths``); a CV the log-normal law cannot
    reach for the row's pool means is clamped (``feasible_cv``). Errors name the run."""
    from .twin.run import simulate

    try:
        if cv is None and profile.runs_lengths is not None:
            cv = profile.runs_lengths.cv
        if cv is not None and lengths == "lognormal":
            cv = feasible_cv(row_float(row, "mean_input_tokens", DEFAULT_MEAN_INPUT_TOKENS),
                             row_float(row, "mean_output_tokens", DEFAULT_MEAN_OUTPUT_TOKENS), cv)
        wl = build_workload(row, seed, lengths, cv)
        out, _ = simulate(profile, wl, server_flags(row, profile, client_cap), wl.duration_s, seed, limits=limits)
    except LorapackError as e:  # name the run: the error may surface from a worker process
        raise DataError(f"run {row.get('run_id')}: {e}") from None
    return out


# ---------------------------------------------------------------------------------------------------------
# predictions


def _mean(vals: Sequence[Any]) -> float:
    xs = [float(v) for v in vals if v is not None and math.isfinite(float(v))]
    return float(np.mean(xs)) if xs else NAN


@dataclass(frozen=True)
class RunPrediction:
    """The twin's prediction of one real run: metrics averaged over seeds, ``starved`` by majority.

    ``oom``: the server would not start (start-up rule); its metrics are NaN and ``starved`` is None.
    A real oom run that the profile would start is not simulated (it carries no rates): ``oom`` False,
    metrics NaN."""

    oom: bool
    error_type: str | None = None
    throughput_tok_s: float = NAN
    itl_mean_ms: float = NAN
    ttft_mean_ms: float = NAN
    throughput_ratio: float = NAN
    starved: bool | None = None
    ttft_median_ms: float = NAN
    ttft_p99_ms: float = NAN
    itl_p99_ms: float = NAN
    running_reqs_mean: float = NAN
    waiting_reqs_max: float = NAN
    n_preemptions: float = NAN  # mean over seeds
    n_adapter_loads: float = NAN
    wall_s: float = NAN
    n_seeds: int = 0

    @classmethod
    def from_runs(cls, runs: Sequence[RunMetrics]) -> RunPrediction:
        """Average the simulations of one run over its seeds."""
        return cls(
            oom=False, throughput_tok_s=_mean([r.throughput_tok_s for r in runs]),
            itl_mean_ms=_mean([r.itl_mean_ms for r in runs]), ttft_mean_ms=_mean([r.ttft_mean_ms for r in runs]),
            throughput_ratio=_mean([r.throughput_ratio for r in runs]),
            starved=bool(np.mean([bool(r.starved) for r in runs]) >= 0.5),
            ttft_median_ms=_mean([r.ttft_median_ms for r in runs]), ttft_p99_ms=_mean([r.ttft_p99_ms for r in runs]),
            itl_p99_ms=_mean([r.itl_p99_ms for r in runs]),
            running_reqs_mean=_mean([r.running_reqs_mean for r in runs]),
            waiting_reqs_max=_mean([r.waiting_reqs_max for r in runs]),
            n_preemptions=_mean([r.n_preemptions for r in runs]),
            n_adapter_loads=_mean([r.n_adapter_loads for r in runs]), wall_s=_mean([r.wall_s for r in runs]),
            n_seeds=len(runs))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def startup_prediction(profile: Profile, row: dict) -> RunPrediction | None:
    """The prediction of a row that needs no simulation, else None (simulate it).

    The start-up rule decides alone when the server would not start, and for real oom rows (they carry no
    rates): those are scored on the start-up rule only."""
    starts, _kv, err = profile.startup(int(float(row["max_loras"])), int(float(row["max_lora_rank"])))
    if not starts:
        return RunPrediction(oom=True, error_type=err)
    if measured_oom(row):
        return RunPrediction(oom=False)
    return None


# ---------------------------------------------------------------------------------------------------------
# measured vs predicted


@dataclass(frozen=True)
class RunComparison:
    """One real run next to its prediction (for tables, plots and the ``validate --out`` CSV)."""

    run_id: str
    model: str
    group: str
    status: str
    max_loras: int | None
    n_adapters: int | None
    max_lora_rank: int | None
    measured_oom: bool
    measured_throughput_tok_s: float | None
    measured_itl_ms: float | None
    measured_ttft_ms: float | None
    measured_throughput_ratio: float | None
    measured_starved: bool | None
    measured_running_mean: float | None
    prediction: RunPrediction
    measured_ttft_median_ms: float | None = None
    measured_ttft_p99_ms: float | None = None
    measured_itl_p99_ms: float | None = None

    @classmethod
    def of(cls, row: dict, pred: RunPrediction) -> RunComparison:
        starved = row_float(row, "starved")
        run_id = row.get("run_id") or ""
        return cls(run_id=run_id, model=row.get("model") or "", group=run_group(run_id),
                   status=(row.get("status") or "").strip(), max_loras=_row_int(row, "max_loras"),
                   n_adapters=_row_int(row, "n_adapters"), max_lora_rank=_row_int(row, "max_lora_rank"),
                   measured_oom=measured_oom(row), measured_throughput_tok_s=row_float(row, "throughput_tok_s"),
                   measured_itl_ms=row_float(row, "itl_mean_ms"), measured_ttft_ms=row_float(row, "ttft_mean_ms"),
                   measured_throughput_ratio=row_float(row, "throughput_ratio"),
                   measured_starved=None if starved is None else bool(starved),
                   measured_running_mean=row_float(row, "running_mean"), prediction=pred,
                   measured_ttft_median_ms=row_float(row, "ttft_median_ms"),
                   measured_ttft_p99_ms=row_float(row, "ttft_p99_ms"), measured_itl_p99_ms=row_float(row, "itl_p99_ms"))

    @property
    def scored(self) -> bool:
        """Both sides ran: real and predicted server started (oom rows are scored on the start-up rule)."""
        return not self.measured_oom and not self.prediction.oom

    def _predicted(self, value: Any) -> Any:
        return value if self.scored else NAN

    @property
    def predicted_oom(self) -> bool:
        return self.prediction.oom

    @property
    def predicted_throughput_tok_s(self) -> float:
        return self._predicted(self.prediction.throughput_tok_s)

    @property
    def predicted_itl_ms(self) -> float:
        return self._predicted(self.prediction.itl_mean_ms)

    @property
    def predicted_ttft_ms(self) -> float:
        return self._predicted(self.prediction.ttft_mean_ms)

    @property
    def predicted_throughput_ratio(self) -> float:
        return self._predicted(self.prediction.throughput_ratio)

    @property
    def predicted_starved(self) -> bool | None:
        return self.prediction.starved if self.scored else None

    @property
    def predicted_running_mean(self) -> float:
        return self._predicted(self.prediction.running_reqs_mean)

    @property
    def predicted_ttft_median_ms(self) -> float:
        return self._predicted(self.prediction.ttft_median_ms)

    @property
    def predicted_ttft_p99_ms(self) -> float:
        return self._predicted(self.prediction.ttft_p99_ms)

    @property
    def predicted_itl_p99_ms(self) -> float:
        return self._predicted(self.prediction.itl_p99_ms)


# columns of ``lorapack validate --out`` (a contract) and of the calibration's per-run table
VALIDATE_COLUMNS = ("run_id", "model", "status", "measured_oom", "predicted_oom", "measured_throughput_tok_s",
                    "predicted_throughput_tok_s", "measured_itl_ms", "predicted_itl_ms", "measured_ttft_ms",
                    "predicted_ttft_ms", "measured_starved", "predicted_starved", "measured_throughput_ratio",
                    "predicted_throughput_ratio", "group", "max_loras", "n_adapters", "max_lora_rank",
                    "measured_ttft_median_ms", "predicted_ttft_median_ms", "measured_ttft_p99_ms",
                    "predicted_ttft_p99_ms", "measured_itl_p99_ms", "predicted_itl_p99_ms",
                    "measured_running_mean", "predicted_running_mean")


def compare_runs(rows: Sequence[dict], preds: Sequence[RunPrediction]) -> list[RunComparison]:
    return [RunComparison.of(r, p) for r, p in zip(rows, preds, strict=True)]


# ---------------------------------------------------------------------------------------------------------
# scores


def smape(y: np.ndarray, yhat: np.ndarray, factor: float = 1.0) -> float:
    """``100 * mean(factor * |y - yhat| / (|y| + |yhat|))``; factor 1 = paper convention, 2 = usual."""
    y, yhat = np.asarray(y, float), np.asarray(yhat, float)
    ok = np.isfinite(y) & np.isfinite(yhat) & ((np.abs(y) + np.abs(yhat)) > 0)
    if not ok.any():
        return NAN
    return float(100.0 * np.mean(factor * np.abs(y[ok] - yhat[ok]) / (np.abs(y[ok]) + np.abs(yhat[ok]))))


def signed_bias_pct(y: np.ndarray, yhat: np.ndarray, how: str = "mean") -> float:
    """Mean (or median) of ``100 * (yhat - y) / y`` over the pairs both sides have: > 0 = the prediction is
    high (for throughput: optimistic)."""
    y, yhat = np.asarray(y, float), np.asarray(yhat, float)
    ok = np.isfinite(y) & np.isfinite(yhat) & (y > 0)
    if not ok.any():
        return NAN
    e = 100.0 * (yhat[ok] - y[ok]) / y[ok]
    return float(np.median(e) if how == "median" else np.mean(e))


# TTFT regimes (real mean TTFT) and objectives (seconds) the scores are broken down by: placement makes a mean
# TTFT objective part of feasibility, so what matters is the short-TTFT end, where queueing is not dominant
TTFT_REGIMES_MS = (("lt_1s", 0.0, 1000.0), ("1_30s", 1000.0, 30000.0), ("gt_30s", 30000.0, math.inf))
TTFT_OBJECTIVES_S = (1, 2, 5, 10)


def ttft_regime_scores(y: np.ndarray, yhat: np.ndarray) -> dict[str, dict[str, float]]:
    """Per regime of the real mean TTFT: runs, SMAPE, median and mean signed error (% of real)."""
    out = {}
    for name, lo, hi in TTFT_REGIMES_MS:
        sel = np.isfinite(y) & np.isfinite(yhat) & (y >= lo) & (y < hi)
        out[name] = {"n": int(sel.sum()), "smape_ttft": smape(y[sel], yhat[sel]),
                     "bias_median_pct": signed_bias_pct(y[sel], yhat[sel], "median"),
                     "bias_mean_pct": signed_bias_pct(y[sel], yhat[sel])}
    return out


def ttft_load_terciles(y_ms: np.ndarray, yhat_ms: np.ndarray, load: np.ndarray,
                       max_ttft_ms: float = 1000.0) -> dict[str, Any]:
    """Issue 27's view of the short-TTFT end: over the runs with real mean TTFT below ``max_ttft_ms``, the
    terciles of the real running batch (``running_mean``), each with its runs, batch range and median signed
    TTFT error (% of real; > 0 = the prediction is slow)."""
    sel = np.isfinite(y_ms) & np.isfinite(yhat_ms) & np.isfinite(load) & (y_ms < max_ttft_ms)
    y, yhat, b = y_ms[sel], yhat_ms[sel], load[sel]
    if len(b) < 3:
        return {"n": int(len(b)), "cuts": None, "terciles": []}
    cuts = [float(x) for x in np.quantile(b, [1 / 3, 2 / 3])]
    out = []
    for lo, hi in ((-math.inf, cuts[0]), (cuts[0], cuts[1]), (cuts[1], math.inf)):
        m = (b > lo) & (b <= hi)
        out.append({"n": int(m.sum()), "running_min": float(b[m].min()) if m.any() else NAN,
                    "running_max": float(b[m].max()) if m.any() else NAN,
                    "bias_median_pct": signed_bias_pct(y[m], yhat[m], "median")})
    return {"n": int(len(b)), "max_ttft_ms": max_ttft_ms, "cuts": cuts, "terciles": out}


def ttft_objective_agreement(y_ms: np.ndarray, yhat_ms: np.ndarray) -> dict[str, dict[str, float]]:
    """For each objective T: does the prediction agree on "mean TTFT <= T"? ``optimistic`` counts the runs
    the prediction says meet T while the real run does not (the misses that would make placement pack a GPU
    that fails its objective), ``pessimistic`` the reverse."""
    sel = np.isfinite(y_ms) & np.isfinite(yhat_ms)
    y, yhat = y_ms[sel], yhat_ms[sel]
    out = {}
    for t in TTFT_OBJECTIVES_S:
        real_ok, pred_ok = y <= t * 1000.0, yhat <= t * 1000.0
        n = int(sel.sum())
        opt = int((pred_ok & ~real_ok).sum())
        out[str(t)] = {"n": n, "agreement": float(np.mean(real_ok == pred_ok)) if n else NAN,
                       "optimistic": opt, "pessimistic": int((~pred_ok & real_ok).sum()),
                       "optimistic_share": opt / n if n else NAN}
    return out


def _confusion_dict(c: dict[str, int]) -> dict[str, int]:
    return {"real_starved_pred_starved": c["tp"], "real_starved_pred_healthy": c["fn"],
            "real_healthy_pred_starved": c["fp"], "real_healthy_pred_healthy": c["tn"]}


def score_runs(rows: Sequence[dict], preds: Sequence[RunPrediction]) -> dict:
    """Scores of predictions against the measured rows: both SMAPE conventions (``realruns.smape``), starvation
    agreement (all labelled runs, and the clear ones outside ``NOISY_RATIO``), OOM agreement."""
    cmp = compare_runs(rows, preds)
    ok = [c for c in cmp if c.scored]
    conf = {"tp": 0, "fn": 0, "fp": 0, "tn": 0}
    conf_clear = dict(conf)
    for c in ok:
        if c.measured_starved is None:
            continue
        pred = bool(c.prediction.starved)
        key = ("t" if c.measured_starved == pred else "f") + ("p" if pred else "n")
        conf[key] += 1
        ratio = c.measured_throughput_ratio
        if ratio is not None and not (NOISY_RATIO[0] <= ratio <= NOISY_RATIO[1]):
            conf_clear[key] += 1

    def agree(c: dict) -> float:
        n = sum(c.values())
        return (c["tp"] + c["tn"]) / n if n else NAN

    def arr(name: str) -> np.ndarray:
        return np.array([NAN if getattr(c, name) is None else getattr(c, name) for c in ok], float)

    out: dict[str, Any] = {"n_runs": len(cmp), "n_scored": len(ok)}
    for name, unit in (("throughput", "tok_s"), ("itl", "ms"), ("ttft", "ms")):
        y, yhat = arr(f"measured_{name}_{unit}"), arr(f"predicted_{name}_{unit}")
        out[f"smape_{name}"] = smape(y, yhat)
        out[f"smape_{name}_2x"] = smape(y, yhat, 2)
        out[f"bias_{name}_pct"] = signed_bias_pct(y, yhat)
    for name in ("ttft_median_ms", "ttft_p99_ms", "itl_p99_ms"):  # distribution shape, where the runs have it
        y, yhat = arr(f"measured_{name}"), arr(f"predicted_{name}")
        key = name.removesuffix("_ms")
        out[f"smape_{key}"] = smape(y, yhat)
        out[f"bias_{key}_pct"] = signed_bias_pct(y, yhat)
    y_ttft, yhat_ttft = arr("measured_ttft_ms"), arr("predicted_ttft_ms")
    out["ttft_regimes"] = ttft_regime_scores(y_ttft, yhat_ttft)
    out["ttft_by_load_tercile"] = ttft_load_terciles(y_ttft, yhat_ttft, arr("measured_running_mean"))
    y, yhat = arr("measured_itl_p99_ms"), arr("predicted_itl_p99_ms")
    out["bias_itl_p99_median_pct"] = signed_bias_pct(y, yhat, "median")
    out["ttft_objective_agreement"] = ttft_objective_agreement(y_ttft, yhat_ttft)
    oom_agree = [c.measured_oom == c.predicted_oom for c in cmp]
    out.update(starved_agreement=agree(conf), starved_agreement_clear=agree(conf_clear),
               n_labelled=sum(conf.values()), n_clear=sum(conf_clear.values()),
               starvation_confusion=_confusion_dict(conf), starvation_confusion_clear=_confusion_dict(conf_clear),
               oom_agreement=float(np.mean(oom_agree)) if oom_agree else NAN,
               oom_false_accept=sum(c.measured_oom and not c.predicted_oom for c in cmp),
               oom_false_reject=sum(c.predicted_oom and not c.measured_oom for c in cmp))
    return out


BREAKDOWN_KEYS = ("n_scored", "smape_throughput", "smape_itl", "smape_ttft", "bias_throughput_pct", "bias_itl_pct",
                  "bias_ttft_pct", "starved_agreement")


def breakdown(rows: Sequence[dict], preds: Sequence[RunPrediction], key: str = "group") -> dict[str, dict]:
    """``score_runs``' main scores per run group (``group``: the rank x load group of the run id) or per
    ``--max-lora-rank`` (``max_lora_rank``), in sorted order of the key."""
    def of(row: dict) -> str:
        if key == "group":
            return run_group(row.get("run_id") or "")
        v = row_float(row, key)
        return str(int(v)) if v is not None and math.isfinite(v) else ""

    keys = sorted({of(r) for r in rows}, key=lambda k: (len(k), k))
    out = {}
    for k in keys:
        sel = [i for i, r in enumerate(rows) if of(r) == k]
        s = score_runs([rows[i] for i in sel], [preds[i] for i in sel])
        out[k] = {name: s[name] for name in BREAKDOWN_KEYS}
    return out


# The fidelity guard (tests/test_fidelity_guard.py): a fixed, cheap subset of the runs whose scores the
# calibration records next to the full validation, so CI can re-score the subset in seconds.
GUARD_STRIDE = 4


def guard_subset(rows: Sequence[dict]) -> list[dict]:
    """Every ``GUARD_STRIDE``-th run of each model, in run-id order (oom rows included: the start-up rule)."""
    out = []
    for m in sorted({(r.get("model") or "").strip() for r in rows}):
        mine = sorted((r for r in rows if (r.get("model") or "").strip() == m), key=lambda r: r.get("run_id") or "")
        out.extend(mine[::GUARD_STRIDE])
    return out
