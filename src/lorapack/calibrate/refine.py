"""Simulation-based refinement of the step-time constants against real end-to-end runs (docs/calibration.md).

Every real run (schema of ``shared/data/real-runs/calibration.csv``) is rebuilt and simulated with a candidate
profile by ``lorapack.realruns`` (as ``lorapack validate`` does: same adapters, rates, pool-mean lengths, window,
flags and client-saturation cap). ``refine`` chooses the free step-time constants that minimise the log errors of
throughput and ITL over the runs (robust ``soft_l1`` least squares, finite-difference Jacobian, scipy
``least_squares``), with the closed-form priors as Gaussian regularisation. Scores (both SMAPE conventions,
starvation and OOM agreement) are ``realruns.score_runs``, the same as ``lorapack validate``'s.

Everything is a pure function of (profile, runs, seeds): re-running reproduces the same constants.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import DataError
from ..executor import Executor
from ..profile import Profile, RunsLengths
from ..realruns import RunPrediction, row_float, simulate_run, startup_prediction
from ..twin.metrics import RunMetrics

# The free constants the refinement may move: profile field, prior sd (the regularisation scale), bounds.
# Priors that the profiling data does not inform (e1p, e3, e4, gamma) are centred on the neutral value of the
# closed-form model (e1p = e1, the others 0) with a wide sd: the runs decide.


@dataclass(frozen=True)
class FreeParam:
    name: str  # short name used in reports
    field: str  # StepTimeModel field, or "runs_lengths.cv"
    sd: float  # prior standard deviation (regularisation scale)
    lower: float
    upper: float
    unit: str


FREE_PARAMS: dict[str, FreeParam] = {p.name: p for p in (
    FreeParam("e0", "e0_ms", 3.0, 0.0, 40.0, "ms"),
    FreeParam("e1", "e1_ms_per_token", 0.02, 0.0, 0.5, "ms/decode token"),
    FreeParam("e1p", "e1p_ms_per_prefill_token", 0.03, 0.0, 0.5, "ms/prefill token"),
    FreeParam("e2", "e2_ms_per_adapter", 0.3, 0.0, 5.0, "ms/adapter"),
    FreeParam("e3", "e3_ms_per_kreq_adapter", 1.0, 0.0, 20.0, "ms per 1000 request-adapters (B*L)"),
    FreeParam("e4", "e4_ms_per_ktok_slot", 0.2, 0.0, 5.0, "ms per 1000 token-slots (n_tok*A)"),
    FreeParam("e5", "e5_ms_per_kblock_slot", 0.5, 0.0, 5.0, "ms per 1000 shrink-grid blocks per slot"),
    FreeParam("a3", "a3_ms_per_kctx", 0.05, 0.0, 1.0, "ms per 1000 context tokens"),
    FreeParam("p1", "p1_ms_per_prefill_token", 0.005, 0.0, 0.2, "ms/prefill token"),
    FreeParam("gamma", "gamma", 0.5, -2.0, 3.0, "exponent of (S/8) of every LoRA term (older profiles)"),
    # a larger slot rank never makes a LoRA term cheaper: the exponents are >= 0
    FreeParam("gamma_token", "gamma_token", 0.5, 0.0, 3.0, "exponent of (S/8) of the per-token LoRA terms"),
    FreeParam("gamma_adapter", "gamma_adapter", 0.5, 0.0, 3.0, "exponent of (S/8) of the per-adapter LoRA terms"),
    FreeParam("cv", "runs_lengths.cv", 0.3, 0.4, 1.6, "post-filter CV of the log-normal lengths of the runs"),
    # (a CV the log-normal law cannot reach for a run's pool means is clamped per run, see feasible_cv)
)}
DEFAULT_FREE = ("e0", "e1", "e1p", "e2", "e3", "e4", "gamma_token", "gamma_adapter", "a3", "cv")
CV_FIELD = "runs_lengths.cv"
DEFAULT_CV = 1.1  # the spec default (``workload.lengths``): the prior of the fitted CV

# Residual scale: a 5 % log error is one unit; soft_l1 is quadratic below that and linear above (like SMAPE).
RESIDUAL_SCALE = 0.05


def param_value(name: str, profile: Profile) -> float:
    """Current value of free constant ``name`` in ``profile`` (e1p inherits e1; cv defaults to 1.1)."""
    p = FREE_PARAMS[name]
    if p.field == CV_FIELD:
        return float(profile.runs_lengths.cv) if profile.runs_lengths is not None else DEFAULT_CV
    v = getattr(profile.steptime, p.field)
    if v is None and name == "e1p":
        v = profile.steptime.e1_ms_per_token
    if v is None and name in ("gamma_token", "gamma_adapter"):  # older profiles: one exponent
        v = profile.steptime.gamma
    return float(v)


def with_values(profile: Profile, values: dict[str, float]) -> Profile:
    """``profile`` with the named free constants replaced."""
    upd = {FREE_PARAMS[k].field: float(v) for k, v in values.items() if FREE_PARAMS[k].field != CV_FIELD}
    out = profile.model_copy(update={"steptime": profile.steptime.model_copy(update=upd)})
    if "cv" in values:
        out = out.model_copy(update={"runs_lengths": RunsLengths(cv=float(values["cv"]))})
    return out


# ---------------------------------------------------------------------------------------------------------
# simulating the real runs (rebuilt by ``lorapack.realruns``, as ``lorapack validate`` does)


@dataclass
class Evaluator:
    """Predicts a fixed list of runs for candidate profiles, simulating them in parallel (``lorapack.executor``;
    inside ``with`` the worker processes are kept between calls).

    ``evaluator(profiles)`` predicts the rows of the models in ``profiles`` (``None`` for other rows);
    ``evaluator.many([profiles, ...])`` does several candidates in one parallel batch (better balance).
    """

    rows: list[dict]
    seeds: Sequence[int] = (0,)
    lengths: str = "lognormal"
    cv: float | None = None
    workers: int = 0  # 0 = all cores
    n_evals: int = 0
    n_sims: int = 0
    wall_s: float = 0.0
    _executor: Executor | None = field(default=None, repr=False)

    def __enter__(self) -> Evaluator:
        self._executor = Executor(self.workers)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._executor is not None:
            self._executor.close()
            self._executor = None

    def __call__(self, profiles: dict[str, Profile]) -> list[RunPrediction | None]:
        return self.many([profiles])[0]

    def many(self, candidates: Sequence[dict[str, Profile]]) -> list[list[RunPrediction | None]]:
        t0 = time.perf_counter()
        preds: list[list[RunPrediction | None]] = [[None] * len(self.rows) for _ in candidates]
        todo = []
        for c, profiles in enumerate(candidates):
            for i, r in enumerate(self.rows):
                prof = profiles.get(r["model"])
                if prof is None:
                    continue
                preds[c][i] = startup_prediction(prof, r)
                if preds[c][i] is None:
                    todo.extend((c, i, s) for s in self.seeds)
        # heaviest runs first (most adapters x highest rates) for a better balance over the workers
        todo.sort(key=lambda t: -_load_key(self.rows[t[1]]))
        jobs = [(candidates[c][self.rows[i]["model"]], self.rows[i], s, self.lengths, self.cv) for c, i, s in todo]
        if self._executor is not None:
            outs = self._executor.map(simulate_run, jobs)
        else:
            with Executor(self.workers) as ex:
                outs = ex.map(simulate_run, jobs)
        by_row: dict[tuple[int, int], list[RunMetrics]] = {}
        for (c, i, _s), o in zip(todo, outs, strict=True):
            by_row.setdefault((c, i), []).append(o)
        for (c, i), runs in by_row.items():
            preds[c][i] = RunPrediction.from_runs(runs)
        self.n_evals += len(candidates)
        self.n_sims += len(todo)
        self.wall_s += time.perf_counter() - t0
        return preds


def _load_key(row: dict) -> float:
    rates = row_float(row, "incoming_req_s", None)
    return (rates or 1.0) * float(row.get("n_adapters") or 1)


# ---------------------------------------------------------------------------------------------------------
# the fit


def _log_err(pred: float | None, real: float | None) -> float:
    if pred is None or real is None or not (pred > 0 and real > 0):
        return math.nan
    return math.log(pred / real)


GROUP_BIAS_WEIGHT = 2.0  # x sqrt(runs in the group): a group's mean throughput error is a residual too
# the runs whose real mean TTFT is in this range (ms) are queueing but not flooded: their TTFT is the engine's
# queue (e.g. adapter swaps when max_loras < adapters), which throughput and ITL do not pin down
# (docs/trust-under-load.md 7.6); below it TTFT is the API server's (fitted afterwards), above it the backlog
QUEUEING_TTFT_MS = (1_000.0, 30_000.0)


def data_residuals(rows: Sequence[dict], preds: Sequence[RunPrediction], itl_weight: float = 1.0,
                   group_weight: float = GROUP_BIAS_WEIGHT, ttft_weight: float = 0.0) -> np.ndarray:
    """Per scored run: log throughput error and (weighted) log ITL error, in units of RESIDUAL_SCALE; then per
    run group (``realruns.run_group``: rank x load in the reference data) the mean log throughput error times
    ``group_weight * sqrt(runs)``: per-run errors alone leave a group biased (e.g. the saturated high-rate
    runs ~1.5 % high while the light ones are ~1 % low), and a bias is what costs or wastes GPUs. With
    ``ttft_weight`` > 0, also the log mean-TTFT error of each run whose real mean TTFT is in
    ``QUEUEING_TTFT_MS`` (times ``ttft_weight``): which runs carry one depends on the real data only, so the
    residual vector keeps its length from candidate to candidate."""
    from ..realruns import run_group

    res = []
    by_group: dict[str, list[float]] = {}
    for r, p in zip(rows, preds, strict=True):
        if (r.get("status") or "").strip() != "ok" or p.oom:
            continue
        et = _log_err(p.throughput_tok_s, row_float(r, "throughput_tok_s"))
        ei = _log_err(p.itl_mean_ms, row_float(r, "itl_mean_ms"))
        # a run the candidate cannot score (e.g. nothing completed) gets a large, finite penalty
        res.append(et if math.isfinite(et) else 1.0)
        res.append(itl_weight * (ei if math.isfinite(ei) else 1.0))
        by_group.setdefault(run_group(r.get("run_id") or ""), []).append(res[-2])
        real_ttft = row_float(r, "ttft_mean_ms", None) if ttft_weight > 0 else None
        if real_ttft is not None and QUEUEING_TTFT_MS[0] <= real_ttft < QUEUEING_TTFT_MS[1]:
            eq = _log_err(p.ttft_mean_ms, real_ttft)
            res.append(ttft_weight * (eq if math.isfinite(eq) else 1.0))
    if group_weight > 0:
        res.extend(group_weight * math.sqrt(len(e)) * float(np.mean(e)) for _g, e in sorted(by_group.items()))
    return np.asarray(res, float) / RESIDUAL_SCALE


@dataclass
class RefineResult:
    values: dict[str, float]  # refined free constants (by short name)
    start: dict[str, float]
    priors: dict[str, float]
    cost_start: float
    cost_end: float
    n_evals: int  # candidate profiles simulated (residual evaluations + Jacobian columns)
    wall_s: float
    status: str
    history: list[dict] = field(default_factory=list)
    iterations: int = 0  # Jacobians evaluated (trust-region iterations)
    converged: bool = False  # a tolerance (ftol / xtol / gtol) ended the fit, not a budget

    @property
    def moved(self) -> bool:
        """Did the fit change any constant (False: the refined values are the starting values)?"""
        return any(abs(self.values[k] - self.start[k]) > 1e-12 * max(1.0, abs(self.start[k])) for k in self.values)


class _OutOfTime(Exception):
    """The refinement's wall-time cap was reached (the best point so far is kept)."""


def lora_anchor_residuals(profile: Profile, anchors: Sequence[dict]) -> np.ndarray:
    """Log errors (in RESIDUAL_SCALE units) of the LoRA step overhead predicted by ``profile``'s step-time model
    against directly measured overheads (``anchors``: max_loras, max_lora_rank, batch, n_lora, overhead_ms)."""
    from ..server import ServerConfig
    from ..twin.run import step_model
    from ..twin.steptime import compute_ms

    out = []
    for a in anchors:
        srv = ServerConfig(max_loras=int(a["max_loras"]), max_lora_rank=int(a["max_lora_rank"]),
                           max_cpu_loras=int(a["max_loras"]), max_num_batched_tokens=profile.max_num_batched_tokens,
                           max_num_seqs=profile.max_num_seqs, max_model_len=profile.max_model_len)
        coef = step_model(profile, srv).to_array()
        b = int(round(a["batch"]))
        lv = max(1, int(round(a["n_lora"])))
        pred = compute_ms(coef, b, 0, b, 0.0, lv) - compute_ms(coef, b, 0, b, 0.0, 0)
        out.append(_log_err(pred, a["overhead_ms"]))
    r = np.asarray(out, float)
    return np.where(np.isfinite(r), r, 1.0) / RESIDUAL_SCALE


@dataclass(frozen=True)
class FitOptions:
    """Settings of one least-squares fit (``refine``): the ``free`` constants it moves; the weights of the
    regularisation toward the priors (``prior_weight``), of every run's ITL residual (``itl_weight``), of each
    run group's mean throughput error (``group_weight``, see ``data_residuals``), of the queueing runs' TTFT
    (``ttft_weight``, 0: none) and of the LoRA-overhead
    anchors (``anchor_weight``); the stops: ``max_nfev`` residual evaluations, ``max_wall_s`` seconds (None: no
    cap), ``ftol`` (relative cost change) and ``xtol`` (relative step); ``diff_step``: the finite-difference step
    of the Jacobian, in prior standard deviations. Unknown free constants raise ``DataError``."""

    free: tuple[str, ...] = DEFAULT_FREE
    prior_weight: float = 1.0
    itl_weight: float = 1.0
    group_weight: float = GROUP_BIAS_WEIGHT
    ttft_weight: float = 0.0
    anchor_weight: float = 1.0
    max_nfev: int = 40
    diff_step: float = 0.1
    max_wall_s: float | None = None
    ftol: float = 1e-3
    xtol: float = 1e-3

    def __post_init__(self) -> None:
        object.__setattr__(self, "free", tuple(self.free))
        for name in self.free:
            if name not in FREE_PARAMS:
                raise DataError(f"unknown free parameter '{name}': expected one of {', '.join(FREE_PARAMS)}")


def refine(profiles: dict[str, Profile], priors: dict[str, Profile], rows: Sequence[dict],
           evaluator: Callable[[dict[str, Profile]], list[RunPrediction | None]], fit: FitOptions | None = None,
           start: dict[str, dict[str, float]] | None = None, anchors: dict[str, Sequence[dict]] | None = None,
           log: Callable[[str], None] | None = None) -> dict[str, RefineResult]:
    """Fit the ``fit.free`` constants of every model in ``profiles`` to ``rows`` (one independent fit per model;
    ``fit``: ``FitOptions``, default ``FitOptions()``).

    Residuals per model: log throughput and ITL errors of every ok run (5 % = 1 unit, ``soft_l1`` loss; ITL
    times ``fit.itl_weight``), each run group's mean log throughput error (times ``fit.group_weight``, see
    ``data_residuals``), the log errors of the directly measured LoRA overheads ``anchors`` (per model;
    profiling runs, no simulation needed; times ``fit.anchor_weight``), and ``(value - prior) / sd`` for every
    free constant (times ``fit.prior_weight``), the prior being its value in ``priors[model]``. ``evaluator``
    simulates rows for a dict of profiles (see ``Evaluator``). ``start`` (per model) overrides the starting point
    (default: the values in ``profiles``).

    The fit runs until a tolerance is met (``fit.ftol``: relative cost change; ``fit.xtol``: relative step;
    scipy's trust-region reflective method), ``fit.max_nfev`` residual evaluations were spent, or
    ``fit.max_wall_s`` seconds passed; ``RefineResult.converged`` and ``status`` say which, ``iterations`` how
    many Jacobians it took. Whatever ends it, each model keeps the best point seen.
    """
    from scipy.optimize import least_squares

    fit = fit or FitOptions()
    free, prior_weight, itl_weight, group_weight = fit.free, fit.prior_weight, fit.itl_weight, fit.group_weight
    anchor_weight, max_nfev, diff_step, max_wall_s = fit.anchor_weight, fit.max_nfev, fit.diff_step, fit.max_wall_s
    models = sorted(profiles)
    idx = {m: [i for i, r in enumerate(rows) if r["model"] == m] for m in models}
    for m in models:
        if not any((rows[i].get("status") or "").strip() == "ok" for i in idx[m]):
            raise DataError(f"no successful runs of {m} to refine against")
    fp = [FREE_PARAMS[n] for n in free]
    scale = np.array([p.sd for p in fp])
    lo = np.array([p.lower for p in fp]) / scale
    hi = np.array([p.upper for p in fp]) / scale
    mu = {m: np.array([param_value(n, priors[m]) for n in free]) for m in models}
    anchors = anchors or {}

    def current(m: str) -> np.ndarray:
        s = (start or {}).get(m, {})
        return np.array([float(s.get(n, param_value(n, profiles[m]))) for n in free])

    # All models are fitted in one joint vector (their residuals are independent, so this equals separate
    # fits): every finite-difference column perturbs one model's constants, and all the columns of a
    # Jacobian are simulated in one parallel batch. Predictions are cached per (model, constants).
    x0 = np.concatenate([np.clip(current(m) / scale, lo, hi) for m in models])
    k = len(free)
    lo, hi = np.tile(lo, len(models)), np.tile(hi, len(models))
    cache: dict[tuple[str, bytes], list[RunPrediction | None]] = {}
    hist: list[dict] = []

    def unpack(x: np.ndarray) -> dict[str, dict[str, float]]:
        return {m: {n: float(v) for n, v in zip(free, x[j * k:(j + 1) * k] * scale, strict=True)}
                for j, m in enumerate(models)}

    def key(x: np.ndarray, j: int) -> tuple[str, bytes]:
        return models[j], np.round(x[j * k:(j + 1) * k], 10).tobytes()

    def ensure(xs: Sequence[np.ndarray]) -> None:
        need: dict[tuple[str, bytes], dict[str, float]] = {}
        for x in xs:
            vals = unpack(x)
            for j, m in enumerate(models):
                kk = key(x, j)
                if kk not in cache and kk not in need:
                    need[kk] = vals[m]
        if not need:
            return
        cands = [{kk[0]: with_values(profiles[kk[0]], v)} for kk, v in need.items()]
        many = getattr(evaluator, "many", None)
        results = many(cands) if many is not None else [evaluator(c) for c in cands]
        for kk, preds in zip(need, results, strict=True):
            cache[kk] = preds

    t_start = time.perf_counter()
    n_jac = [0]

    def over_budget() -> None:
        if max_wall_s is not None and time.perf_counter() - t_start > max_wall_s and hist:
            raise _OutOfTime

    def residuals(x: np.ndarray, record: bool = True) -> np.ndarray:
        if record:
            over_budget()
        ensure([x])
        parts = []
        for j, m in enumerate(models):
            preds = cache[key(x, j)]
            d = data_residuals([rows[i] for i in idx[m]], [preds[i] for i in idx[m]], itl_weight, group_weight,
                               fit.ttft_weight)
            if anchors.get(m):
                cand = with_values(profiles[m], unpack(x)[m])
                d = np.concatenate([d, anchor_weight * lora_anchor_residuals(cand, anchors[m])])
            reg = prior_weight * (x[j * k:(j + 1) * k] - mu[m] / scale)
            parts.extend([d, reg])
        r = np.concatenate(parts)
        if record:
            by_model = {m: float(np.sum(_soft_l1(parts[2 * j]))) + float(np.sum(_soft_l1(parts[2 * j + 1])))
                        for j, m in enumerate(models)}
            hist.append({"values": unpack(x), "cost": float(np.sum(_soft_l1(r))), "cost_by_model": by_model})
            if log is not None:
                log(f"step {len(hist)}: cost {hist[-1]['cost']:.2f}  " + "; ".join(
                    f"{m.split('-')[0]} " + " ".join(f"{n}={v:.4g}" for n, v in vals.items())
                    for m, vals in unpack(x).items()))
        return r

    def jac(x: np.ndarray, *args: Any) -> np.ndarray:
        over_budget()
        n_jac[0] += 1
        xs = []
        for j in range(len(x)):
            h = diff_step if x[j] + diff_step <= hi[j] else -diff_step
            xj = x.copy()
            xj[j] = min(max(x[j] + h, lo[j]), hi[j])
            xs.append(xj)
        ensure([x, *xs])
        f0 = residuals(x, record=False)
        return np.column_stack([(residuals(xj, record=False) - f0) / (xj[j] - x[j]) for j, xj in enumerate(xs)])

    try:
        sol = least_squares(residuals, x0, jac=jac, bounds=(lo, hi), loss="soft_l1", f_scale=1.0, method="trf",
                            max_nfev=max_nfev, x_scale=1.0, xtol=fit.xtol, ftol=fit.ftol, gtol=1e-8)
        status, converged = str(sol.message), bool(sol.status > 0)
    except _OutOfTime:
        status, converged = f"stopped at the wall-time cap of {max_wall_s:.0f} s (best point kept)", False
    if not converged and "wall-time" not in status:
        status = f"stopped after {max_nfev} evaluations without meeting a tolerance: {status}"
    wall = time.perf_counter() - t_start
    out = {}
    vals_start = unpack(x0)
    for m in models:
        # the models are independent: keep, per model, the best point seen (trf may end on a worse one)
        best = min(hist, key=lambda h: h["cost_by_model"][m])
        out[m] = RefineResult(values=best["values"][m], start=vals_start[m],
                              priors={n: float(v) for n, v in zip(free, mu[m], strict=True)},
                              cost_start=hist[0]["cost_by_model"][m], cost_end=best["cost_by_model"][m],
                              n_evals=sum(1 for kk in cache if kk[0] == m),
                              wall_s=wall, status=status, history=hist, iterations=n_jac[0], converged=converged)
    return out


def _soft_l1(r: np.ndarray) -> np.ndarray:
    return 2.0 * (np.sqrt(1.0 + r * r) - 1.0)
