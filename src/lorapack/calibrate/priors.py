"""Closed-form "prior" fits of a profile from the profiling files (docs/calibration.md).

Each estimator of the step-time model (``twin.steptime``, docs/calibration.md) is fitted with a few lines of numpy/scipy from a data directory laid out like
``../shared/data`` (schemas in its README §3). ``fit_priors`` assembles them into a ``Profile`` whose
``provenance`` records the input file hashes and, per fit, the parameters, R², RMSE and number of points.

The output is deterministic for given inputs except ``provenance.date``.
"""

from __future__ import annotations

import csv
import hashlib
import math
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
from scipy.optimize import lsq_linear

from .. import __version__
from ..errors import DataError
from ..profile import (
    DiskPoint,
    KvPoint,
    LoadingModel,
    LoadPoint,
    MemoryModel,
    Profile,
    SchedulerModel,
    StepTimeModel,
)

# Files of the data directory (relative paths: provenance must not depend on where the data lives).
MEMORY_CSV = "profiling/memory_kv_capacity.csv"
DEFAULT_CSV = "profiling/latency_default.csv"
LORA_CSV = "profiling/latency_lora_overhead.csv"
LOAD_SUMMARY_CSV = "profiling/loading_summary.csv"
LOAD_EVENTS_CSV = "profiling/loading_events.csv"
SCHED_CSVS = ("profiling/scheduler_overhead_aggregated_rate.csv",
              "profiling/scheduler_overhead_adapter_rates.csv")
CALIBRATION_CSV = "real-runs/calibration.csv"

# Model properties (not fitted constants): the default max_model_len the reference servers ran with, and the
# KV bytes per token, used only to cross-check max_model_len against the `kv_needed_gib` of refused start-ups.
MODEL_PROPERTIES: dict[str, dict[str, int]] = {
    "llama-3.1-8b-instruct": {"max_model_len": 131072, "kv_bytes_per_token": 32 * 8 * 128 * 2 * 2},
    "qwen-2.5-7b-instruct": {"max_model_len": 32768, "kv_bytes_per_token": 28 * 4 * 128 * 2 * 2},
}

# vLLM defaults of the reference setup that the data files do not record.
BLOCK_SIZE = 16
# The paper's scheduler baseline (authors' BASELINE_LATENCY, 1.9642263413907038e-4 s): the scheduler time that
# is already contained in the decode step fit c0 + c1*B, so only the excess is charged. It cannot be re-derived
# from the shared files (it came from the authors' own decode runs), hence a documented constant.
SCHED_BASELINE_MS = 0.19642263413907038
# Calibration runs with at most this many waiting requests count as "non-queueing" for the additive LoRA fit.
NON_QUEUEING_WAITING_MAX = 20.0
# Prefill runs whose tokens-per-step span at least this fraction of the token budget identify a slope; below
# that (e.g. Llama: every run at ~2,040 tokens/step) the slope is degenerate and a per-token mean is used.
PREFILL_MIN_SPREAD = 0.25


# ---------------------------------------------------------------------------------------------------------
# CSV access with one-line DataErrors


class _Csv:
    """A CSV file of the data directory, read once, with checked numeric column access."""

    def __init__(self, data_dir: Path, rel: str, required: Iterable[str]) -> None:
        self.rel = rel
        self.path = data_dir / rel
        if not self.path.is_file():
            raise DataError(f"{self.path}: required data file not found")
        raw = self.path.read_bytes()
        self.sha256 = hashlib.sha256(raw).hexdigest()
        reader = csv.DictReader(raw.decode("utf-8").splitlines())
        cols = reader.fieldnames or []
        missing = [c for c in required if c not in cols]
        if missing:
            raise DataError(f"{self.path}: missing required column(s) {', '.join(missing)}")
        self.rows: list[dict[str, str]] = list(reader)

    def select(self, what: str, pred: Callable[[dict[str, str]], bool], min_rows: int = 1
               ) -> list[dict[str, str]]:
        rows = [r for r in self.rows if pred(r)]
        if len(rows) < min_rows:
            raise DataError(f"{self.path}: {len(rows)} {what} row(s), need at least {min_rows}")
        return rows

    def num(self, rows: list[dict[str, str]], col: str, what: str, allow_missing: bool = False) -> np.ndarray:
        """Column ``col`` of ``rows`` as float64; empty/NaN cells raise unless ``allow_missing``."""
        out = np.array([_to_float(r.get(col)) for r in rows], dtype=np.float64)
        bad = int(np.count_nonzero(~np.isfinite(out)))
        if bad and not allow_missing:
            raise DataError(f"{self.path}: column '{col}' is empty or NaN in {bad} of {len(rows)} {what} rows")
        return out


def _to_float(s: str | None) -> float:
    s = (s or "").strip()
    if not s:
        return math.nan
    try:
        return float(s)
    except ValueError:
        return math.nan


def _is(col: str, value: str) -> Callable[[dict[str, str]], bool]:
    return lambda r: (r.get(col) or "").strip() == value


def fit_stats(y: np.ndarray, yhat: np.ndarray) -> dict[str, float | int]:
    res = y - yhat
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    r2 = 1.0 - float(np.sum(res**2)) / ss_tot if ss_tot > 0 else math.nan
    return {"n_points": int(len(y)), "rmse": float(np.sqrt(np.mean(res**2))), "r2": float(r2)}


def _ols(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    return coef


def plain_scalars(d: dict[str, Any]) -> dict[str, Any]:
    """Plain Python scalars (numpy scalars do not serialise with yaml.safe_dump)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out[k] = plain_scalars(v)
        elif isinstance(v, np.integer | int) and not isinstance(v, bool):
            out[k] = int(v)
        elif isinstance(v, np.floating | float):
            out[k] = float(v)
        else:
            out[k] = v
    return out


# ---------------------------------------------------------------------------------------------------------
# Individual fits


def fit_memory(mem: _Csv, default: _Csv, model: str, max_num_seqs: int) -> tuple[MemoryModel, dict]:
    """``T_max(A, S) = T0 − A·(k·S + c)`` by least squares over the ok start-ups (``Profile.startup``)."""
    rows = mem.select(f"{model}", lambda r: r["model"] == model
                      and _to_float(r["max_num_seqs"]) == max_num_seqs)
    ok = [r for r in rows if r["status"].strip() == "ok"]
    if len(ok) < 4:
        raise DataError(f"{mem.path}: {len(ok)} ok start-up rows for {model}, need at least 4 to fit T0, k, c")
    kv = mem.num(ok, "kv_cache_tokens", f"ok {model}")
    a = mem.num(ok, "max_loras", f"ok {model}")
    s = mem.num(ok, "max_lora_rank", f"ok {model}")
    x = np.column_stack([np.ones_like(a), -a * s, -a])
    t0, k, c = _ols(x, kv)
    pred = x @ np.array([t0, k, c])
    stats = fit_stats(kv, pred)
    stats["max_abs_err_tokens"] = float(np.max(np.abs(kv - pred)))
    stats["mean_rel_err"] = float(np.mean(np.abs(kv - pred) / kv))

    measured = []
    for r in rows:
        ok_row = r["status"].strip() == "ok"
        measured.append(KvPoint(
            max_loras=int(_to_float(r["max_loras"])), max_lora_rank=int(_to_float(r["max_lora_rank"])),
            kv_tokens=int(mem.num([r], "kv_cache_tokens", f"ok {model}")[0]) if ok_row else None,
            # ok rows may carry slurm_time_limit (killed after start-up): irrelevant to the start-up verdict
            error_type=None if ok_row else (r["error_type"].strip() or None)))

    # KV capacity with LoRA disabled at the same max_num_seqs, when such a no-LoRA run exists.
    no_lora_rows = [r for r in default.rows if r["model"] == model and r["status"].strip() == "ok"
                    and _to_float(r["max_num_seqs"]) == max_num_seqs and not (r.get("max_loras") or "").strip()
                    and math.isfinite(_to_float(r["kv_cache_tokens"]))]
    no_lora = float(np.median(default.num(no_lora_rows, "kv_cache_tokens", "no-LoRA"))) if no_lora_rows else None

    mm = MemoryModel(kv_tokens_base=float(t0), kv_tokens_per_slot_rank=float(k), kv_tokens_per_slot=float(c),
                     kv_tokens_no_lora=no_lora, measured=measured)
    prov = {"method": "OLS kv_cache_tokens ~ 1 + (-A*S) + (-A) over status == ok rows",
            "parameters": {"kv_tokens_base": float(t0), "kv_tokens_per_slot_rank": float(k),
                           "kv_tokens_per_slot": float(c)},
            **stats, "n_measured": len(measured),
            "kv_tokens_no_lora_source": (f"{default.rel}: median kv_cache_tokens of {len(no_lora_rows)} no-LoRA "
                                         f"runs at max_num_seqs {max_num_seqs}") if no_lora_rows else
            f"none: {default.rel} has no no-LoRA run at max_num_seqs {max_num_seqs}"}
    return mm, prov


def fit_decode(default: _Csv, model: str) -> tuple[float, float, dict]:
    """``c0 + c1·B``: OLS of ``mean_itl_ms`` on ``mean_batch_size`` over the decode runs (``twin.steptime``; docs/calibration.md)."""
    rows = default.select(f"{model} decode", lambda r: r["model"] == model and r["phase"] == "decode"
                          and r["status"].strip() == "ok", min_rows=3)
    b = default.num(rows, "mean_batch_size", f"{model} decode")
    y = default.num(rows, "mean_itl_ms", f"{model} decode")
    x = np.column_stack([np.ones_like(b), b])
    c0, c1 = _ols(x, y)
    prov = {"method": "OLS mean_itl_ms ~ 1 + mean_batch_size, phase == decode",
            "parameters": {"c0_ms": float(c0), "c1_ms_per_req": float(c1)}, **fit_stats(y, x @ [c0, c1])}
    # The alternative on the per-step log (docs/calibration.md, the step-time model), recorded for comparison only.
    logged = [r for r in rows if math.isfinite(_to_float(r["step_ms_mean"]))]
    if len(logged) >= 3:
        bl = default.num(logged, "mean_batch_size", "logged decode")
        yl = default.num(logged, "step_ms_mean", "logged decode")
        xl = np.column_stack([np.ones_like(bl), bl])
        a0, a1 = _ols(xl, yl)
        prov["alt_step_log"] = {"c0_ms": float(a0), "c1_ms_per_req": float(a1), **fit_stats(yl, xl @ [a0, a1])}
    return float(c0), float(c1), prov


def fit_prefill(default: _Csv, model: str, c0: float, budget: int) -> tuple[float, dict]:
    """Prefill cost per token ``p1`` from the flood runs with output 1 (``twin.steptime``; docs/calibration.md)."""
    rows = default.select(f"{model} prefill", lambda r: r["model"] == model and r["phase"] == "prefill"
                          and r["status"].strip() == "ok")
    step = default.num(rows, "step_ms_mean", f"{model} prefill")
    tps = default.num(rows, "total_input_tokens", f"{model} prefill") / default.num(rows, "n_steps",
                                                                                   f"{model} prefill")
    per_token = (step - c0) / tps
    spread = float((tps.max() - tps.min()) / budget)
    prov: dict[str, Any] = {"tokens_per_step_min": float(tps.min()), "tokens_per_step_max": float(tps.max()),
                            "per_token_mean": float(per_token.mean())}
    if len(rows) >= 2 and spread >= PREFILL_MIN_SPREAD:
        x = np.column_stack([np.ones_like(tps), tps])
        icpt, slope = _ols(x, step)
        prov["slope_fit"] = {"intercept_ms": float(icpt), "slope": float(slope), **fit_stats(step, x @ [icpt, slope])}
        if slope > 0:
            prov.update(method="OLS slope of step_ms_mean on tokens per step (tokens/step spread "
                               f"{spread:.2f} of the budget)", p1=float(slope), n_points=len(rows))
            return float(slope), prov
        method = "mean of (step_ms_mean - c0) / tokens_per_step (fallback: slope fit was not positive)"
    else:
        method = ("mean of (step_ms_mean - c0) / tokens_per_step (tokens/step spread "
                  f"{spread:.3f} of the budget: slope not identified)")
    p1 = float(per_token.mean())
    prov.update(method=method, p1=p1, n_points=len(rows),
                rmse=float(np.sqrt(np.mean((c0 + p1 * tps - step) ** 2))))
    return p1, prov


def _overhead_rows(lora: _Csv, model: str) -> tuple[list[dict[str, str]], np.ndarray, int]:
    """overhead_small runs and their distinct adapters per batch (server log, else the uniform expectation)."""
    rows = lora.select(f"{model} overhead_small", lambda r: r["model"] == model and r["kind"] == "overhead_small"
                       and r["status"].strip() == "ok", min_rows=3)
    logged = lora.num(rows, "unique_adapters_mean", f"{model} overhead_small", allow_missing=True)
    expected = lora.num(rows, "expected_unique_adapters_uniform", f"{model} overhead_small", allow_missing=True)
    use_log = np.isfinite(logged)
    lv = np.where(use_log, logged, expected)
    if not np.all(np.isfinite(lv)):
        raise DataError(f"{lora.path}: {model} overhead_small rows lack both unique_adapters_mean and "
                        "expected_unique_adapters_uniform")
    return rows, lv, int(use_log.sum())


def lora_overhead_points(profiling_dir: str | Path, model: str) -> list[dict]:
    """Directly measured LoRA step overheads of ``model`` (``overhead_small`` flood runs: decode-only steps).

    Per run: ``max_loras``, ``max_lora_rank``, ``batch`` (mean running), ``n_lora`` (distinct adapters per
    batch, server log else the uniform expectation) and ``overhead_ms = mean_itl_ms - baseline_itl_ms_no_lora``
    (the no-LoRA run at the same output length). The refinement uses them as anchors of the LoRA term."""
    pdir = Path(profiling_dir)
    lora = _Csv(pdir.parent, f"{pdir.name}/{Path(LORA_CSV).name}",
                ["model", "kind", "status", "mean_itl_ms", "mean_batch_size", "max_loras", "max_lora_rank",
                 "baseline_itl_ms_no_lora", "unique_adapters_mean", "expected_unique_adapters_uniform"])
    rows, lv, _ = _overhead_rows(lora, model)
    what = f"{model} overhead_small"
    over = lora.num(rows, "mean_itl_ms", what) - lora.num(rows, "baseline_itl_ms_no_lora", what)
    a = lora.num(rows, "max_loras", what)
    s = lora.num(rows, "max_lora_rank", what)
    b = lora.num(rows, "mean_batch_size", what)
    return [{"max_loras": int(a[i]), "max_lora_rank": int(s[i]), "batch": float(b[i]), "n_lora": float(lv[i]),
             "overhead_ms": float(over[i])} for i in range(len(rows)) if over[i] > 0]


def fit_lora_multiplicative(lora: _Csv, model: str) -> tuple[float, float, dict]:
    """Paper form: ``itl_pct_of_baseline = k0 + k1·L`` by OLS (``twin.steptime``; docs/calibration.md)."""
    rows, lv, n_log = _overhead_rows(lora, model)
    y = lora.num(rows, "itl_pct_of_baseline", f"{model} overhead_small")
    x = np.column_stack([np.ones_like(lv), lv])
    k0, k1 = _ols(x, y)
    prov = {"method": "OLS itl_pct_of_baseline ~ 1 + L, kind == overhead_small; L = unique_adapters_mean "
                      f"({n_log} rows) else expected_unique_adapters_uniform ({len(rows) - n_log} rows)",
            "parameters": {"k0_pct": float(k0), "k1_pct_per_adapter": float(k1)}, **fit_stats(y, x @ [k0, k1])}
    return float(k0), float(k1), prov


def fit_lora_additive(lora: _Csv, calib: _Csv | None, model: str, c0: float, c1: float
                      ) -> tuple[tuple[float, float, float], dict]:
    """Indicative joint fit of ``e0 + e1·n_tok + e2·L`` on the residual over the decode base (``twin.steptime``; docs/calibration.md).

    ``calib`` (end-to-end runs) is optional: without it only the overhead runs are used."""
    rows, lv, _ = _overhead_rows(lora, model)
    b = lora.num(rows, "mean_batch_size", f"{model} overhead_small")
    y1 = lora.num(rows, "mean_itl_ms", f"{model} overhead_small") - (c0 + c1 * b)

    # Non-queueing real runs: the batch is the running gauge, distinct adapters the uniform expectation.
    crow = [] if calib is None else calib.select(
        f"{model} ok non-queueing (waiting_max <= {NON_QUEUEING_WAITING_MAX:g})",
        lambda r: r["model"] == model and r["status"].strip() == "ok"
        and _to_float(r["waiting_max"]) <= NON_QUEUEING_WAITING_MAX, min_rows=0)
    what = f"{model} non-queueing"
    if calib is None:
        bc = n = a = y2 = np.zeros(0)
    else:
        bc = calib.num(crow, "running_mean", what)
        n = calib.num(crow, "n_adapters", what)
        a = calib.num(crow, "max_loras", what)
        y2 = calib.num(crow, "itl_mean_ms", what) - (c0 + c1 * bc)
    l2 = np.minimum(a, n * (1.0 - (1.0 - 1.0 / n) ** bc))

    x = np.vstack([np.column_stack([np.ones_like(b), b, lv]), np.column_stack([np.ones_like(bc), bc, l2])])
    y = np.concatenate([y1, y2])
    if len(y) < 4:
        src = f"{lora.path}" + (f" + {calib.path}" if calib is not None else "")
        raise DataError(f"{src}: {len(y)} points for the additive LoRA fit, need at least 4")
    coef = _ols(x, y)
    method = "OLS"
    if np.any(coef < 0):  # a negative cost is unphysical: constrain every coefficient to be >= 0
        coef = lsq_linear(x, y, bounds=(0.0, np.inf), method="bvls").x
        method = "bounded least squares (coefficients >= 0; plain OLS had a negative one)"
    e0, e1, e2 = (float(v) for v in coef)
    prov: dict[str, Any] = {
        "method": f"{method} of ITL - (c0 + c1*B) ~ 1 + n_tok + L over overhead_small rows "
                  f"({len(y1)}) and ok calibration runs with waiting_max <= {NON_QUEUEING_WAITING_MAX:g} "
                  f"({len(y2)}); n_tok = B, L = min(A, N*(1-(1-1/N)^B)) for the runs",
        "parameters": {"e0_ms": e0, "e1_ms_per_token": e1, "e2_ms_per_adapter": e2}, **fit_stats(y, x @ coef)}
    # Same fit with the runs of one --max-lora-rank only: shows the rank dependence that gamma may absorb later
    # (the overhead rows are S = 8, the calibration runs S = 16 or 32). Recorded, not used.
    s = calib.num(crow, "max_lora_rank", what) if calib is not None and crow else np.zeros(0)
    alt = {}
    for sv in sorted(set(s.tolist())):
        keep = np.concatenate([np.ones(len(y1), dtype=bool), s == sv])
        if keep.sum() >= 4:
            ca = _ols(x[keep], y[keep])
            alt[str(int(sv))] = {"e0_ms": float(ca[0]), "e1_ms_per_token": float(ca[1]),
                                 "e2_ms_per_adapter": float(ca[2]), **fit_stats(y[keep], x[keep] @ ca)}
    if alt:
        prov["alt_ols_runs_of_one_max_lora_rank"] = alt
    return (e0, e1, e2), prov


def fit_scheduler(scheds: list[_Csv], baseline_ms: float = SCHED_BASELINE_MS) -> tuple[SchedulerModel, dict]:
    """Paper scheduler form, reproducing its procedure (docs/calibration.md, the step-time model).

    Regressors B, W, W·A/N are min-max scaled to [0, 1] over the data and fitted by OLS without intercept on
    seconds per step; converting back to raw units turns the scaling offset of B into the constant term.
    """
    cols = []
    for f in scheds:
        what = "scheduler-overhead"
        rows = f.select(what, lambda r: True, min_rows=1)
        g, c = f.num(rows, "gpu_loras", what), f.num(rows, "cpu_loras", what)
        w = f.num(rows, "avg_waiting_queue", what)
        cols.append(np.column_stack([f.num(rows, "avg_batch_size", what), w, w * g / c,
                                     f.num(rows, "total_scheduling_time", what) / f.num(rows, "steps", what)]))
    data = np.vstack(cols)
    if len(data) < 10:
        raise DataError(f"{', '.join(str(f.path) for f in scheds)}: {len(data)} runs, need at least 10")
    raw, y = data[:, :3], data[:, 3]
    lo, hi = raw.min(axis=0), raw.max(axis=0)
    if np.any(hi <= lo):
        raise DataError(f"{scheds[0].path}: a scheduler regressor is constant, cannot min-max scale")
    beta = _ols((raw - lo) / (hi - lo), y)  # seconds per step, scaled units
    slope_ms = 1000.0 * beta / (hi - lo)
    const_ms = float(-1000.0 * np.sum(beta * lo / (hi - lo)))
    sm = SchedulerModel(ms_per_running=float(slope_ms[0]), const_ms=const_ms, ms_per_waiting=float(slope_ms[1]),
                        ms_per_waiting_slot_ratio=float(-slope_ms[2]), baseline_ms=float(baseline_ms))
    prov = {"method": "paper procedure: min-max scale (B, W, W*A/N), OLS without intercept on "
                      "total_scheduling_time/steps, convert to raw ms; baseline = paper BASELINE_LATENCY "
                      "(scheduler time already inside the decode fit)",
            "scaled_coefficients_s": {"avg_batch_size": float(beta[0]), "avg_waiting_queue": float(beta[1]),
                                      "avg_waiting_queue_x_gpu/cpu": float(beta[2])},
            "scaling_min": [float(v) for v in lo], "scaling_max": [float(v) for v in hi],
            "parameters": sm.model_dump(),
            **fit_stats(1000.0 * y, const_ms + raw @ slope_ms)}
    return sm, prov


def fit_loading(summary: _Csv, events: _Csv, model: str) -> tuple[LoadingModel, dict]:
    """Activation table (mean after start-up) and disk medians (event 1 has a one-off warm-up) (docs/calibration.md, the step-time model)."""
    rows = summary.select(f"{model}", lambda r: r["model"] == model)
    s = summary.num(rows, "max_lora_rank", model)
    r = summary.num(rows, "adapter_rank", model)
    ms = summary.num(rows, "memory_load_ms_mean_after_init", model)
    act = sorted((int(a), int(b), float(c)) for a, b, c in zip(s, r, ms, strict=True))
    if len({(a, b) for a, b, _ in act}) != len(act):
        raise DataError(f"{summary.path}: duplicate (max_lora_rank, adapter_rank) rows for {model}")

    ev = events.select(f"{model} disk (event_index > 1)", lambda x: x["model"] == model
                       and x["load_kind"] == "disk" and _to_float(x["event_index"]) > 1)
    er = events.num(ev, "adapter_rank", f"{model} disk")
    et = events.num(ev, "load_time_ms", f"{model} disk")
    disk = [(int(k), float(np.median(et[er == k]))) for k in sorted(set(er.tolist()))]

    lm = LoadingModel(activation=[LoadPoint(max_lora_rank=a, rank=b, ms=c) for a, b, c in act],
                      disk=[DiskPoint(rank=k, ms=v) for k, v in disk])
    prov = {"activation": {"method": "loading_summary memory_load_ms_mean_after_init per (S, r)",
                           "n_points": len(act)},
            "disk": {"method": "median of loading_events load_kind == disk, event_index > 1, per adapter rank",
                     "n_points": len(ev), "medians_ms": {str(k): v for k, v in disk}}}
    return lm, prov


# ---------------------------------------------------------------------------------------------------------


def _max_model_len(mem: _Csv, model: str) -> tuple[int, str]:
    """The model's default context limit, cross-checked against refused start-ups where possible."""
    props = MODEL_PROPERTIES.get(model)
    if props is None:
        raise DataError(f"no max_model_len known for model '{model}': pass --max-model-len "
                        f"(known: {', '.join(sorted(MODEL_PROPERTIES))})")
    mml = props["max_model_len"]
    needed = [_to_float(r.get("kv_needed_gib")) for r in mem.rows if r["model"] == model]
    needed = [v for v in needed if math.isfinite(v)]
    if not needed:
        return mml, "model property table (no kv_needed_gib in the data to cross-check)"
    implied = float(np.median(needed)) * 2**30 / props["kv_bytes_per_token"]
    if abs(implied - mml) > 0.01 * mml:
        raise DataError(f"{mem.path}: kv_needed_gib implies max_model_len {implied:.0f} for {model}, "
                        f"but the model table says {mml}")
    return mml, f"model property table, consistent with kv_needed_gib (implies {implied:.0f} tokens)"


def _single_int(f: _Csv, rows: list[dict[str, str]], col: str) -> int:
    vals = set(f.num(rows, col, "memory").tolist())
    if len(vals) != 1:
        raise DataError(f"{f.path}: column '{col}' must be the same in every row, found {sorted(vals)}")
    return int(vals.pop())


def fit_priors(data_dir: str | Path, model: str, gpu: str = "h100-64gb", vllm_version: str = "0.8.5") -> Profile:
    """Fit every estimator of ``model`` from the data directory ``data_dir`` (docs/calibration.md).

    ``data_dir`` is laid out like ``../shared/data``: ``profiling/*.csv`` and ``real-runs/calibration.csv``
    (whose non-queueing runs join the additive LoRA fit). ``gpu`` and ``vllm_version`` are labels of the
    setup the data was measured on (H100-64GB, vLLM 0.8.5).
    """
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise DataError(f"{data_dir}: data directory not found")
    return fit_priors_from(data_dir / "profiling", data_dir / CALIBRATION_CSV, model, gpu, vllm_version)


def _rel_key(path: Path, root: Path) -> tuple[Path, str]:
    """(base, relative name) of a data file for provenance: relative to ``root`` when inside it."""
    path = Path(path)
    try:
        return root, path.resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        return path.parent, path.name


def fit_priors_from(profiling_dir: str | Path, runs_csv: str | Path | None, model: str, gpu: str = "h100-64gb",
                    vllm_version: str = "0.8.5", max_model_len: int | None = None) -> Profile:
    """Like ``fit_priors`` for a profiling directory laid out like ``../shared/data/profiling`` and an
    optional runs CSV (schema of ``real-runs/calibration.csv``; None = fit the LoRA prior on the overhead runs
    only). Provenance names the files relative to the profiling directory's parent. ``max_model_len`` is
    needed for models outside ``MODEL_PROPERTIES`` (the server's context limit, for the start-up rule)."""
    pdir = Path(profiling_dir)
    if not pdir.is_dir():
        raise DataError(f"{pdir}: profiling directory not found")
    root = pdir.parent
    sub = pdir.name

    def prof_csv(name: str, required: list[str]) -> _Csv:
        return _Csv(root, f"{sub}/{Path(name).name}", required)

    mem = prof_csv(MEMORY_CSV, ["model", "max_loras", "max_lora_rank", "kv_cache_tokens", "status",
                                "error_type", "max_num_seqs", "max_num_batched_tokens"])
    default = prof_csv(DEFAULT_CSV, ["model", "phase", "status", "max_num_seqs", "max_loras",
                                     "mean_itl_ms", "mean_batch_size", "step_ms_mean", "n_steps",
                                     "total_input_tokens", "kv_cache_tokens"])
    lora = prof_csv(LORA_CSV, ["model", "kind", "status", "mean_itl_ms", "mean_batch_size",
                               "itl_pct_of_baseline", "unique_adapters_mean", "expected_unique_adapters_uniform"])
    summary = prof_csv(LOAD_SUMMARY_CSV, ["model", "adapter_rank", "max_lora_rank", "memory_load_ms_mean_after_init"])
    events = prof_csv(LOAD_EVENTS_CSV, ["model", "adapter_rank", "load_kind", "event_index", "load_time_ms"])
    sched_cols = ["gpu_loras", "cpu_loras", "avg_batch_size", "avg_waiting_queue", "total_scheduling_time", "steps"]
    scheds = [prof_csv(rel, sched_cols) for rel in SCHED_CSVS]
    calib = None
    if runs_csv is not None:
        base, rel = _rel_key(Path(runs_csv), root)
        calib = _Csv(base, rel, ["model", "status", "n_adapters", "max_loras", "max_lora_rank",
                                 "itl_mean_ms", "running_mean", "waiting_max"])
    files = [mem, default, lora, summary, events, *scheds] + ([calib] if calib is not None else [])

    model_rows = mem.select(model, lambda r: r["model"] == model)
    mns = _single_int(mem, model_rows, "max_num_seqs")
    mnbt = _single_int(mem, model_rows, "max_num_batched_tokens")
    if max_model_len is not None:
        if max_model_len < 1:
            raise DataError(f"--max-model-len {max_model_len}: expected a positive number of tokens")
        mml, mml_src = int(max_model_len), "given by the user (--max-model-len)"
    else:
        mml, mml_src = _max_model_len(mem, model)

    memory, p_mem = fit_memory(mem, default, model, mns)
    c0, c1, p_dec = fit_decode(default, model)
    p1, p_pf = fit_prefill(default, model, c0, mnbt)
    k0, k1, p_mul = fit_lora_multiplicative(lora, model)
    (e0, e1, e2), p_add = fit_lora_additive(lora, calib, model, c0, c1)
    scheduler, p_sched = fit_scheduler(scheds)
    loading, p_load = fit_loading(summary, events, model)

    steptime = StepTimeModel(c0_ms=c0, c1_ms_per_req=c1, p1_ms_per_prefill_token=p1, a3_ms_per_kctx=0.0,
                             lora_form="additive", e0_ms=e0, e1_ms_per_token=e1, e2_ms_per_adapter=e2,
                             e3_ms_per_kreq_adapter=0.0, gamma=0.0, k0_pct=k0, k1_pct_per_adapter=k1)
    provenance = plain_scalars({
        "generated_by": "lorapack.calibrate.priors.fit_priors_from",
        "stage": "priors (docs/calibration.md)",
        "lorapack_version": __version__,
        "date": datetime.now(UTC).replace(microsecond=0).isoformat(),
        "inputs": {f.rel: f.sha256 for f in files},
        "max_model_len_source": mml_src,
        "block_size_source": "vLLM default; not recorded in the data",
        "fits": {"memory": p_mem, "decode": p_dec, "prefill": p_pf, "lora_multiplicative": p_mul,
                 "lora_additive": p_add, "scheduler": p_sched, "loading": p_load},
    })
    return Profile(model=model, gpu=gpu, vllm_version=vllm_version, max_model_len=mml, block_size=BLOCK_SIZE,
                   max_num_batched_tokens=mnbt, max_num_seqs=mns, memory=memory, steptime=steptime,
                   scheduler=scheduler, loading=loading, provenance=provenance)
