"""Closed-form priors of a profile from what ``lorapack measure`` wrote (the measured counterpart of
``calibrate.priors.fit_priors_from``, which reads the research profiling format).

* decode: ``itl = c0 + c1*B + a3*B*ctx/1000`` by least squares (coefficients >= 0) over the ladder
  (``decode.csv``; ``ctx`` = the mean context of a request);
* prefill: ``ttft = chunks*(c0 + c1) + p1*P`` -> ``p1`` = slope of ``ttft - chunks*(c0+c1)`` on ``P``
  (``prefill.csv``, medians per prompt length);
* LoRA: ``overhead = e0 + e1*B + e2*L`` (coefficients >= 0) over ``lora.csv``, measured at the server's one
  slot rank ``S`` (``gamma`` 0: every slot is padded to S, so the compute cost does not follow the adapter rank);
* loading: activation per (S, r) = median of (evicted from the GPU - warm) TTFT; disk per r = median of
  (evicted from the CPU cache - evicted from the GPU), clamped at 0 (``loading.csv``);
* memory: the KV capacity the server reported, at its (A, S) (a start-up grid, ``startup.csv``, fits
  ``T0 - A*(k*S + c)`` as ``fit_memory`` does);
* scheduler: zero (its time is inside the measured intervals).
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
from scipy.optimize import lsq_linear

from .. import __version__
from ..calibrate.priors import fit_stats, plain_scalars
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

MEASURE_JSON = "measure.json"
FORMAT = "lorapack-measure"


def is_measure_dir(path: str | Path) -> bool:
    return (Path(path) / MEASURE_JSON).is_file()


def read_meta(mdir: Path) -> dict:
    try:
        meta = json.loads((mdir / MEASURE_JSON).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise DataError(f"{mdir / MEASURE_JSON}: not a readable measurement ({e.__class__.__name__})") from None
    if meta.get("format") != FORMAT:
        raise DataError(f"{mdir / MEASURE_JSON}: format {meta.get('format')!r}; expected {FORMAT!r}")
    return meta


def read_rows(mdir: Path, name: str, required: bool = True) -> list[dict]:
    path = mdir / name
    if not path.is_file():
        if required:
            raise DataError(f"{path}: missing; run lorapack measure (it writes {name}) or resume it")
        return []
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def _f(rows: list[dict], col: str) -> np.ndarray:
    out = []
    for r in rows:
        try:
            out.append(float(r.get(col) or "nan"))
        except ValueError:
            out.append(math.nan)
    return np.array(out, dtype=np.float64)


def _nonneg_lsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    return lsq_linear(x, y, bounds=(0.0, np.inf), method="bvls").x


def fit_decode(rows: list[dict]) -> tuple[float, float, float, dict]:
    b, y, ctx = _f(rows, "concurrency"), _f(rows, "itl_mean_ms"), _f(rows, "context_tokens_mean")
    ok = np.isfinite(b) & np.isfinite(y) & np.isfinite(ctx)
    if ok.sum() < 3:
        raise DataError(f"decode.csv: {int(ok.sum())} usable ladder point(s), need at least 3")
    b, y, ctx = b[ok], y[ok], ctx[ok]
    x = np.column_stack([np.ones_like(b), b, b * ctx / 1000.0])
    coef = _nonneg_lsq(x, y)
    c0, c1, a3 = (float(v) for v in coef)
    return c0, c1, a3, {"method": "least squares (>= 0) of itl_mean_ms ~ 1 + B + B*ctx/1000 over decode.csv",
                        "parameters": {"c0_ms": c0, "c1_ms_per_req": c1, "a3_ms_per_kctx": a3},
                        **fit_stats(y, x @ coef)}


def decode_itl_ms(c0: float, c1: float, a3: float, concurrency: float, context_tokens: float) -> float:
    """The decode fit's inter-token interval (ms) at ``concurrency`` requests of ``context_tokens`` each."""
    return c0 + c1 * concurrency + a3 * concurrency * context_tokens / 1000.0


def fit_prefill(rows: list[dict], c0: float, c1: float) -> tuple[float, dict]:
    p, ch, t = _f(rows, "prompt_tokens"), _f(rows, "chunks"), _f(rows, "ttft_ms")
    ok = np.isfinite(p) & np.isfinite(t) & np.isfinite(ch)
    lengths = sorted(set(p[ok].tolist()))
    if len(lengths) < 2:
        raise DataError(f"prefill.csv: {len(lengths)} prompt length(s), need at least 2")
    med = np.array([np.median(t[ok & (p == v)]) for v in lengths])
    chunks = np.array([ch[ok & (p == v)][0] for v in lengths])
    pv = np.array(lengths)
    y = med - chunks * (c0 + c1)
    slope = float(_nonneg_lsq(pv[:, None], y)[0])
    return slope, {"method": "least squares (>= 0, no intercept) of median ttft - chunks*(c0 + c1) on prompt "
                             "tokens over prefill.csv", "p1": slope, **fit_stats(y, slope * pv)}


def fit_lora(rows: list[dict]) -> tuple[tuple[float, float, float], dict]:
    b, n, y = _f(rows, "concurrency"), _f(rows, "n_adapters"), _f(rows, "overhead_ms")
    ok = np.isfinite(b) & np.isfinite(n) & np.isfinite(y)
    if ok.sum() < 3:
        raise DataError(f"lora.csv: {int(ok.sum())} usable point(s), need at least 3")
    x = np.column_stack([np.ones(ok.sum()), b[ok], n[ok]])
    coef = _nonneg_lsq(x, y[ok])
    e0, e1, e2 = (float(v) for v in coef)
    return (e0, e1, e2), {"method": "least squares (>= 0) of itl - base itl ~ 1 + B + L over lora.csv, at the "
                                    "server's slot rank (gamma 0)",
                          "parameters": {"e0_ms": e0, "e1_ms_per_token": e1, "e2_ms_per_adapter": e2},
                          **fit_stats(y[ok], x @ coef)}


def lora_anchors(mdir: Path) -> list[dict]:
    """The LoRA-cost points as the refinement's anchors (``calibrate.refine``): decode-only steps."""
    rows = read_rows(Path(mdir), "lora.csv", required=False)
    out = []
    for r in rows:
        over = float(r["overhead_ms"])
        if math.isfinite(over) and over > 0:
            out.append({"max_loras": int(float(r["max_loras"])), "max_lora_rank": int(float(r["max_lora_rank"])),
                        "batch": float(r["concurrency"]), "n_lora": float(r["n_adapters"]), "overhead_ms": over})
    return out


def fit_loading(rows: list[dict], slot_rank: int, step_ms: float) -> tuple[LoadingModel, dict]:
    if not rows:
        # not measurable (no eviction possible): one step's time, a stated placeholder the twin barely uses
        lm = LoadingModel(activation=[LoadPoint(max_lora_rank=slot_rank, rank=slot_rank, ms=step_ms)],
                          disk=[DiskPoint(rank=slot_rank, ms=step_ms)])
        what = f"not measured (no adapter could be evicted): one step, {step_ms:.3g} ms"
        return lm, {"activation": {"method": what, "n_points": 0},
                    "disk": {"method": what, "n_points": 0, "medians_ms": {}}}
    ranks = sorted({int(float(r["rank"])) for r in rows})
    act, disk = [], []
    for k in ranks:
        mine = [r for r in rows if int(float(r["rank"])) == k]
        a = _f(mine, "activation_ms")
        d = _f(mine, "disk_ms")
        a = a[np.isfinite(a)]
        d = d[np.isfinite(d)]
        act.append(LoadPoint(max_lora_rank=slot_rank, rank=k, ms=max(0.0, float(np.median(a))) if len(a) else step_ms))
        disk.append(DiskPoint(rank=k, ms=max(0.0, float(np.median(d))) if len(d) else step_ms))
    return LoadingModel(activation=act, disk=disk), {
        "activation": {"method": "median per adapter rank of (evicted from the GPU - warm) TTFT, clamped at 0",
                       "n_points": len(rows), "medians_ms": {str(p.rank): p.ms for p in act}},
        "disk": {"method": "median per adapter rank of (evicted from the CPU cache - evicted from the GPU) TTFT, "
                           "clamped at 0 (one step when no adapter could leave the CPU cache)",
                 "n_points": int(sum(np.isfinite(_f(rows, "disk_ms")))),
                 "medians_ms": {str(p.rank): p.ms for p in disk}}}


def fit_memory(ident: dict, startup_rows: list[dict]) -> tuple[MemoryModel, dict]:
    a, s, kv = int(ident["max_loras"]), int(ident["max_lora_rank"]), int(ident["kv_cache_tokens"])
    pts = {(a, s): KvPoint(max_loras=a, max_lora_rank=s, kv_tokens=kv)}
    ok = [r for r in startup_rows if (r.get("status") or "") == "ok"]
    for r in startup_rows:
        key = (int(float(r["max_loras"])), int(float(r["max_lora_rank"])))
        good = (r.get("status") or "") == "ok"
        pts[key] = KvPoint(max_loras=key[0], max_lora_rank=key[1],
                           kv_tokens=int(float(r["kv_cache_tokens"])) if good else None,
                           error_type=None if good else (r.get("error_type") or "failed"))
    if len(ok) >= 3:
        av, sv, kvv = _f(ok, "max_loras"), _f(ok, "max_lora_rank"), _f(ok, "kv_cache_tokens")
        x = np.column_stack([np.ones_like(av), -av * sv, -av])
        coef, *_ = np.linalg.lstsq(x, kvv, rcond=None)
        t0, k, c = (float(v) for v in coef)
        prov = {"method": "OLS kv_cache_tokens ~ 1 + (-A*S) + (-A) over the start-up grid (startup.csv)",
                "parameters": {"kv_tokens_base": t0, "kv_tokens_per_slot_rank": k, "kv_tokens_per_slot": c},
                **fit_stats(kvv, x @ coef)}
    else:
        t0, k, c = float(kv), 0.0, 0.0
        prov = {"method": "the KV capacity the server reported at its own --max-loras/--max-lora-rank; no start-up "
                          "grid (lorapack measure --launch): the slots' memory is not known and taken as 0",
                "parameters": {"kv_tokens_base": t0, "kv_tokens_per_slot_rank": 0.0, "kv_tokens_per_slot": 0.0}}
    return MemoryModel(kv_tokens_base=t0, kv_tokens_per_slot_rank=k, kv_tokens_per_slot=c,
                       measured=sorted(pts.values(), key=lambda p: (p.max_lora_rank, p.max_loras))), prov


def model_label(model_id: str) -> str:
    """A profile key for a served model id (a path or an org/name): its last part, lower case."""
    parts = [p for p in Path(model_id.rstrip("/")).parts if p not in ("/", "")]
    # a local checkout is often <name>/model or <name>/main: the directory above says more
    while len(parts) > 1 and parts[-1].lower() in ("model", "models", "main", "hf", "weights"):
        parts.pop()
    label = parts[-1].lower() if parts else "model"
    return label.replace("__", "_")


def fit_measured(mdir: str | Path, model: str | None = None, gpu: str | None = None) -> Profile:
    """The priors of a profile from a measurement directory (see the module docstring)."""
    mdir = Path(mdir)
    meta = read_meta(mdir)
    ident = meta["identity"]
    files = {n: mdir / n for n in ("decode.csv", "prefill.csv", "lora.csv", "loading.csv", "startup.csv")}
    c0, c1, a3, p_dec = fit_decode(read_rows(mdir, "decode.csv"))
    p1, p_pf = fit_prefill(read_rows(mdir, "prefill.csv"), c0, c1)
    (e0, e1, e2), p_lora = fit_lora(read_rows(mdir, "lora.csv"))
    s = int(ident["max_lora_rank"])
    loading, p_load = fit_loading(read_rows(mdir, "loading.csv", required=False), s, c0 + c1)
    memory, p_mem = fit_memory(ident, read_rows(mdir, "startup.csv", required=False))
    front = _f(read_rows(mdir, "prefill.csv"), "frontend_ms")
    front = front[np.isfinite(front)]
    steptime = StepTimeModel(c0_ms=c0, c1_ms_per_req=c1, p1_ms_per_prefill_token=p1, a3_ms_per_kctx=a3,
                             lora_form="additive", e0_ms=e0, e1_ms_per_token=e1, e2_ms_per_adapter=e2,
                             e3_ms_per_kreq_adapter=0.0, gamma=0.0)
    inputs = {n: hashlib.sha256(p.read_bytes()).hexdigest() for n, p in files.items() if p.is_file()}
    provenance: dict[str, Any] = {
        "generated_by": "lorapack.measure.fit.fit_measured",
        "stage": "priors from lorapack measure (docs/profile-your-gpu.md)",
        "lorapack_version": __version__,
        "date": datetime.now(UTC).replace(microsecond=0).isoformat(),
        "measured": {"url": ident.get("url"), "started": meta.get("started"), "sources": ident.get("sources", {}),
                     "api_server_ttft_share_ms_median": float(np.median(front)) if len(front) else None},
        "inputs": inputs,
        "fits": {"memory": p_mem, "decode": p_dec, "prefill": p_pf, "lora_additive": p_lora, "loading": p_load,
                 "scheduler": {"method": "zero: measured from outside, the scheduler's time is inside every "
                                         "measured interval"}},
    }
    return Profile(
        model=model or model_label(ident["model"]), gpu=gpu or (ident.get("device") or "unknown-device"),
        vllm_version=str(ident["vllm_version"]), max_model_len=int(ident["max_model_len"]),
        block_size=int(ident["block_size"]), max_num_batched_tokens=int(ident["max_num_batched_tokens"]),
        max_num_seqs=int(ident["max_num_seqs"]), memory=memory, steptime=steptime,
        scheduler=SchedulerModel(ms_per_running=0.0, const_ms=0.0, ms_per_waiting=0.0,
                                 ms_per_waiting_slot_ratio=0.0, baseline_ms=0.0),
        loading=loading,
        measured_gpu_memory_utilization=float(ident.get("gpu_memory_utilization") or 0.9),
        measured_prefix_caching=bool(ident.get("prefix_caching")),
        device=ident.get("device"), tensor_parallel_size=int(ident.get("tensor_parallel_size") or 1),
        provenance=plain_scalars(provenance))
