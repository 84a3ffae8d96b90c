"""Evaluation over time (issue 25): policies compared on the same consecutive windows of a drifting workload.

**The drift model** (``simulate_drift``, every draw from its own seeded stream):

* *load*: the trace's own curve. The trace is load-scaled ×k as ``derive`` does (``scaled_trace``, the
  scenario's ``seed``) and cut into ``windows`` consecutive windows of ``window_s`` from ``start_s``; window w
  replays the scaled trace's requests of its stretch, shifted to 0. Its total changes from window to window as
  the trace's does;
* *popularity*: each adapter has a log-popularity, initially the log of the scenario's ``weights`` (e.g.
  Dirichlet(0.5)) over ``n_adapters``; from one window to the next every active adapter's takes a Gaussian step
  of std ``sigma`` (a random walk); an adapter's share of a window's requests is the softmax of the active
  adapters' log-popularities;
* *arrivals and departures*: at the start of each window after the first, every active adapter leaves with
  probability ``departures`` (at least one stays) and Poisson(``arrivals`` × ``n_adapters``) new adapters
  arrive, each with the initial log-popularity of a random adapter of the first window (a newcomer is as popular
  as a random adapter was). Ranks: round-robin over the rank set, then shuffled, over every adapter that ever
  appears;
* *labels*: each request of window w goes to an active adapter drawn with its share (``drift.seed``);
* *what a planner gets* for window w: every active adapter with its expected rate, share × the window's
  requests / ``window_s`` (at least one request per hour, ``lorapack rates``' floor), the window's mean lengths
  and, under ``verify_arrivals: estimation``, the window's per-minute load profile for the verifier: the
  forecast is right on average; the replay differs by the labels' draws and the arrivals' burstiness.

**The policies**, each planning every window with the scenario's method, headroom, objective and verification
(``lorapack.placement.place`` with a ``PlaceConfig``; one twin verifier per window shared by the policies, so
a GPU two policies both verify is simulated once):

* ``peak``: one plan for the whole horizon, made before window 0: every adapter that ever appears at its
  largest rate over the windows (the verifier follows the busiest window's load profile). It knows the future
  set of adapters: a contrast, not a policy one could run as is. No moves after window 0;
* ``scratch``: a from-scratch plan each window; its moves and restarts are counted after the best matching of
  its GPUs to the previous window's (``replan.best_matching`` and ``replan.churn``);
* ``replan:K`` (``replan`` = no cap): window 0 is the from-scratch plan, then each window
  ``place(..., PlaceConfig(previous=<the last plan.json>, max_moves=K))``; moves and restarts as the re-plan
  reports them (``Plan.replan``).

Moves and restarts count from window 1 (window 0 is every policy's first deployment). Each window's plan is
replayed through the twin on that window's requests (``evaluate.replay``); a window is *unclean* when its
replay is not clean (a GPU refused or starved, an adapter starved, a GPU over the latency objective) or the
policy had no plan for it (``infeasible``: it keeps the previous window's plan, whose new adapters have no
GPU). Reported per policy: GPU-windows (Σ GPUs over the windows), moves, restarts, unclean windows, and
per window.
"""

from __future__ import annotations

import json
import math
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import SpecError
from ..oracle import CandidateArrivals
from ..placement import DEFAULT_HEADROOM, OracleOverrides, PlaceConfig, place
from ..placement.plan import Plan
from ..profile import Profile
from ..spec import Adapter, LengthsSpec, ModulatedArrivals, Workload
from ..twin.types import RequestArrays
from ..workload.derive import (
    RATE_PROFILE_PERIOD_S,
    DerivedWorkload,
    load_profile,
    profile_lengths,
    trace_span_s,
)
from ..workload.lengths import sample_lengths
from ..workload.trace import Trace, assignment_weights, scaled_trace
from .drift_spec import DriftSpec, parse_policy
from .replay import FleetReplay, Mapper, Replayer
from .scenario import Scenario

DRIFT_KEY = 0x6472696674  # "drift": keeps these streams apart from derive's and generate's
_S_SCALE, _S_LENGTHS, _S_WEIGHTS, _S_WALK, _S_LEAVE, _S_ARRIVE, _S_NEWCOMER, _S_LABELS, _S_RANKS = range(1, 10)
FLOOR_RPS = 1.0 / 3600.0  # lorapack rates' default floor: one request per hour
# acceptance of issue 25 for a churn-capped re-plan against re-planning from scratch
GPU_WINDOWS_MAX_RATIO, MOVES_MAX_RATIO = 1.05, 0.20


# ---------------------------------------------------------------------------------------------------------
# the drift model


@dataclass(frozen=True)
class DriftOptions:
    """Everything but the trace and the seeds that the drift depends on."""

    n_adapters: int
    spec: DriftSpec
    weights_kind: str = "dirichlet"
    weights_param: float | None = 0.5
    load_scale: float = 1.0
    rank_set: tuple[int, ...] = (8, 16)
    trace_lengths: bool = False
    lengths: LengthsSpec = LengthsSpec()  # the length law of the requests unless trace_lengths
    jitter_s: float = 5.0
    id_prefix: str = "adapter"

    def __post_init__(self) -> None:
        if isinstance(self.n_adapters, bool) or not isinstance(self.n_adapters, int) or self.n_adapters < 1:
            raise SpecError(f"n_adapters {self.n_adapters!r}: expected an integer >= 1")
        if not isinstance(self.spec, DriftSpec):
            raise SpecError(f"spec {self.spec!r}: expected a DriftSpec")
        if not (math.isfinite(self.load_scale) and self.load_scale > 0):
            raise SpecError(f"load_scale {self.load_scale}: expected a finite number > 0")
        if not self.rank_set or min(self.rank_set) < 1:
            raise SpecError(f"ranks {list(self.rank_set)}: expected a non-empty set of ranks >= 1")
        if not (math.isfinite(self.jitter_s) and self.jitter_s >= 0):
            raise SpecError(f"jitter_s {self.jitter_s}: expected a finite number of seconds >= 0")


@dataclass
class DriftWindows:
    """The drift's windows over every adapter that ever appears (the *universe*, index order = first appearance)."""

    adapter_ids: list[str]
    ranks: np.ndarray  # int32 [U]
    active: np.ndarray  # bool [W, U]
    rates_rps: np.ndarray  # float64 [W, U]: what a planner gets (0 where inactive)
    requests: list[RequestArrays]  # per window, adapter = universe index, times from the window's start
    load_profiles: list[np.ndarray]  # per window: per-minute load / the window's mean
    mean_tokens: list[tuple[float, float]]  # per window: mean (prompt, output) tokens
    window_s: float
    lengths: LengthsSpec
    arrived: list[int]  # per window: adapters that arrived at its start
    departed: list[int]

    @property
    def n_windows(self) -> int:
        return len(self.requests)

    def peak_rates(self) -> np.ndarray:
        """Every adapter's largest rate over the windows."""
        return self.rates_rps.max(axis=0)

    def busiest(self) -> int:
        """The window with the most requests."""
        return int(np.argmax([len(r) for r in self.requests]))


def _rng(seed: int, stream: int) -> np.random.Generator:
    return np.random.default_rng([int(seed), DRIFT_KEY, stream])


def _popularity(opts: DriftOptions, seed: int) -> tuple[np.ndarray, np.ndarray, list[int], list[int]]:
    """``(log-popularity [W, U], active [W, U], arrived, departed)`` of the walk with arrivals and departures."""
    spec, n = opts.spec, opts.n_adapters
    w0 = assignment_weights(n, opts.weights_kind, opts.weights_param or 1.0, opts.weights_param or 0.5,
                            _rng(seed, _S_WEIGHTS))
    init = np.log(np.maximum(w0, 1e-300))
    walk, leave, arrive, newcomer = (_rng(seed, s) for s in (_S_WALK, _S_LEAVE, _S_ARRIVE, _S_NEWCOMER))
    logp = list(init)
    active = [True] * n
    rows_logp, rows_active, arrived, departed = [np.array(logp)], [np.array(active)], [0], [0]
    for _w in range(1, spec.windows):
        idx = [i for i, a in enumerate(active) if a]
        steps = walk.normal(0.0, spec.sigma, size=len(idx))
        for i, s in zip(idx, steps, strict=True):
            logp[i] += float(s)
        gone = leave.random(len(idx)) < spec.departures
        if gone.all():  # at least one adapter stays
            gone[int(np.argmax(np.asarray(logp)[idx]))] = False
        for i, g in zip(idx, gone, strict=True):
            if g:
                active[i] = False
        m = int(arrive.poisson(spec.arrivals * n))
        for _ in range(m):
            logp.append(float(init[int(newcomer.integers(n))]))
            active.append(True)
        arrived.append(m)
        departed.append(int(gone.sum()))
        rows_logp.append(np.array(logp))
        rows_active.append(np.array(active))
    u = len(logp)
    lp = np.full((spec.windows, u), -np.inf)
    act = np.zeros((spec.windows, u), dtype=bool)
    for w, (a, b) in enumerate(zip(rows_logp, rows_active, strict=True)):
        lp[w, :len(a)] = a
        act[w, :len(b)] = b
    return lp, act, arrived, departed


def simulate_drift(trace: Trace, opts: DriftOptions, seed: int, drift_seed: int | None = None) -> DriftWindows:
    """The windows of ``trace`` under ``opts`` (module docstring). ``seed``: the trace's scaling, the lengths and
    the ranks (the scenario's seed); ``drift_seed`` (default ``opts.spec.seed``): the walk, arrivals, departures
    and labels. The same trace, options and seeds give identical windows."""
    for name, v in (("seed", seed), ("drift seed", drift_seed)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int | np.integer) or v < 0):
            raise SpecError(f"{name} {v!r}: expected a non-negative integer")
    spec = opts.spec
    dseed = spec.seed if drift_seed is None else int(drift_seed)
    span = trace_span_s(trace)
    if spec.end_s() > span:
        raise SpecError(f"drift: {spec.windows} windows of {spec.window_s:g} s from {spec.start_s:g} s end at "
                        f"{spec.end_s():g} s, past the trace's {span:g} s")
    idx, t = scaled_trace(trace.t_s, opts.load_scale, opts.jitter_s, _rng(seed, _S_SCALE))
    t = np.minimum(t, np.nextafter(span, 0.0))
    if opts.trace_lengths:
        p_all, o_all = trace.prompt_tokens[idx].astype(np.int32), trace.output_tokens[idx].astype(np.int32)
    else:
        p_all, o_all = sample_lengths(opts.lengths, len(t), _rng(seed, _S_LENGTHS))
    lp, act, arrived, departed = _popularity(opts, dseed)
    u = lp.shape[1]
    labels = _rng(dseed, _S_LABELS)
    rates = np.zeros_like(lp)
    requests, profiles, means = [], [], []
    for w in range(spec.windows):
        lo = spec.start_s + w * spec.window_s
        sel = np.flatnonzero((t >= lo) & (t < lo + spec.window_s))
        ids = np.flatnonzero(act[w])
        share = np.exp(lp[w, ids] - lp[w, ids].max())
        share /= share.sum()
        a = ids[labels.choice(len(ids), size=len(sel), p=share)].astype(np.int32)
        tw = t[sel] - lo
        order = np.lexsort((a, tw))
        requests.append(RequestArrays(tw[order], a[order], p_all[sel][order], o_all[sel][order]))
        rates[w, ids] = np.maximum(share * len(sel) / spec.window_s, FLOOR_RPS)
        profiles.append(load_profile(tw, spec.window_s))
        means.append((float(p_all[sel].mean()) if len(sel) else float(opts.lengths.mean_input_tokens),
                      float(o_all[sel].mean()) if len(sel) else float(opts.lengths.mean_output_tokens)))
    ranks = np.resize(np.asarray(sorted(set(opts.rank_set)), dtype=np.int32), u)
    _rng(seed, _S_RANKS).shuffle(ranks)
    width = len(str(u - 1))
    return DriftWindows(adapter_ids=[f"{opts.id_prefix}-{i:0{width}d}" for i in range(u)], ranks=ranks, active=act,
                        rates_rps=rates, requests=requests, load_profiles=profiles, mean_tokens=means,
                        window_s=float(spec.window_s), lengths=opts.lengths, arrived=arrived, departed=departed)


def window_workload(dw: DriftWindows, rates_rps: np.ndarray, window: int, modulated: bool) -> Workload:
    """What a planner gets: the adapters with a rate > 0 in ``rates_rps`` (universe order), the lengths with
    ``window``'s means, and (``modulated``) its per-minute load profile as the arrival law."""
    base = dw.lengths.model_dump()
    mi, mo = dw.mean_tokens[window]
    base.update(mean_input_tokens=max(1.0, mi), mean_output_tokens=max(1.0, mo))
    adapters = [Adapter(adapter_id=a, rank=int(r), rate_rps=float(q))
                for a, r, q in zip(dw.adapter_ids, dw.ranks, rates_rps, strict=True) if q > 0]
    extra: dict[str, Any] = {}
    if modulated:
        extra["arrivals"] = ModulatedArrivals(period_s=RATE_PROFILE_PERIOD_S,
                                              multipliers=[float(m) for m in dw.load_profiles[window]])
    return Workload(adapters=adapters, lengths=LengthsSpec.model_validate(base), duration_s=dw.window_s, **extra)


def window_replay_workload(dw: DriftWindows, window: int) -> DerivedWorkload:
    """``window``'s requests as the replay of a derived workload over the universe (``evaluate.replay``)."""
    req = dw.requests[window]
    counts = np.bincount(req.adapter, minlength=len(dw.adapter_ids)).astype(np.int64)
    mi, mo = dw.mean_tokens[window]
    rates = dw.rates_rps[window]
    return DerivedWorkload(
        adapter_ids=list(dw.adapter_ids), ranks=dw.ranks, weights=rates / max(rates.sum(), 1e-300),
        rates_rps=rates, estimation_counts=counts, estimation_window_s=dw.window_s, mean_input_tokens=mi,
        mean_output_tokens=mo, replay=req, replay_window_s=dw.window_s, protocol="drift",
        trace_requests=len(req), trace_span_s=dw.window_s, lengths=dw.lengths,
        rate_profile=dw.load_profiles[window])


# ---------------------------------------------------------------------------------------------------------
# the policies


OverridesFn = Callable[[CandidateArrivals | None], OracleOverrides]  # a window's verifier law -> oracles
ProgressFn = Callable[[str, int], None]


@dataclass(frozen=True)
class DriftRun:
    """How ``run_drift`` runs: twin processes, the replays' mapper, the oracles (``overrides(law)`` per window;
    default: one shared twin verifier for the window's law), progress and whether the plans are kept."""

    workers: int = 1
    mapper: Mapper | None = None
    overrides: OverridesFn | None = None
    on_step: ProgressFn | None = None
    keep_plans: bool = False

    def __post_init__(self) -> None:
        from ..checks import check_workers

        check_workers(self.workers)


def scenario_drift_options(sc: Scenario, profile: Profile) -> DriftOptions:
    """The drift options of a drift scenario (its ``drift`` block and the workload fields it shares with derive)."""
    if sc.drift is None:
        raise SpecError(f"scenario {sc.name!r}: expected a drift scenario (a 'drift' block)")
    cv = profile.runs_lengths.cv if profile.runs_lengths is not None else None
    w = sc.weights
    return DriftOptions(n_adapters=sc.n_adapters, spec=sc.drift, weights_kind=w.kind, weights_param=w.param,
                        load_scale=sc.load_scale, rank_set=sc.ranks, trace_lengths=sc.trace_lengths,
                        lengths=profile_lengths(cv), jitter_s=sc.jitter_s)


def _method(sc: Scenario) -> str:
    return sc.methods[0] if sc.methods else "proposed"


def _config(sc: Scenario, workers: int) -> PlaceConfig:
    from .placement_api import placement_objective

    return PlaceConfig(method=_method(sc), objective=placement_objective(sc.objective, sc.objective_limits),
                       headroom=DEFAULT_HEADROOM if sc.headroom is None else sc.headroom, verify=sc.verify,
                       seed=sc.seed, workers=workers)


def _default_overrides(sc: Scenario, workers: int) -> OverridesFn:
    from ..placement.api import twin_verifier
    from ..placement.config import DEFAULT_VERIFY_SEEDS

    def make(law: CandidateArrivals | None) -> OracleOverrides:
        if not sc.verify:
            return OracleOverrides()
        return OracleOverrides(verify_oracle=twin_verifier(sc.seed, DEFAULT_VERIFY_SEEDS, workers, law))
    return make


def _law(workload: Workload) -> CandidateArrivals | None:
    from ..placement.config import workload_verify_law

    return workload_verify_law(workload)


@dataclass
class _Track:
    """One policy's state over the windows."""

    name: str
    kind: str
    k: int | None
    plan: Plan | None = None
    path: Path | None = None  # the last plan's plan.json (re-plans read it)
    rows: list[dict] = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        self.rows = []


def _plan_file(policy: str, window: int) -> str:
    """The name of a policy's plan of a window: its file under ``plans/<scenario>/`` of ``evaluate --out``."""
    return f"{policy.replace(':', '_')}-window{window}.json"


def _write_plan(plan: Plan, tmp: Path, name: str, window: int) -> Path:
    path = tmp / _plan_file(name, window)
    path.write_text(json.dumps(plan.to_dict()), encoding="utf-8")
    return path


def _portable(plan: Plan, tmp: Path) -> dict:
    """``plan.to_dict()`` naming its previous plan by file name (as written under ``plans/``), not by the
    temporary directory the re-plan read it from: the same seeds give the same document."""
    d = plan.to_dict()
    for part in (d.get("settings") or {}, d.get("replan") or {}):
        if isinstance(part.get("previous"), str):
            part["previous"] = Path(part["previous"]).name if str(tmp) in part["previous"] else part["previous"]
    return d


def _churn_scratch(previous: Plan, plan: Plan) -> dict:
    from ..replan.replan import best_matching, churn

    return churn(previous, plan, best_matching(previous, plan))


def _plan_window(tr: _Track, w: int, ctx: dict[str, Any]) -> tuple[Plan | None, dict]:
    """The policy's plan for window ``w`` and its churn (``moves``, ``restarts``) from its previous plan."""
    profile, workload, config, ov = ctx["profile"], ctx["workload"], ctx["config"], ctx["overrides"]
    t0 = time.perf_counter()
    info: dict[str, Any] = {"moves": 0, "restarts": 0}
    if tr.kind == "peak":
        plan = ctx["peak_plan"]
    elif tr.kind == "scratch" or w == 0:
        if "scratch_plan" not in ctx:
            ctx["scratch_plan"] = place(workload, profile, config, ov)
        plan = ctx["scratch_plan"]
        if w > 0 and tr.plan is not None and not plan.infeasible:
            c = _churn_scratch(tr.plan, plan)
            info.update(moves=c["moves"], restarts=c["restarts"])
    else:
        if tr.plan is None or tr.path is None:  # no plan to start from (window 0 was infeasible): from scratch
            plan = place(workload, profile, config, ov)
        else:
            plan = place(workload, profile, replace(config, previous=tr.path, max_moves=tr.k), ov)
            if not plan.infeasible and plan.replan:
                rp = plan.replan
                info.update(moves=int(rp["moves"]["total"]), restarts=len(rp["restarts"]),
                            moves_by_reason={r: rp["moves"][r] for r in ("gone", "new", "needed", "optional",
                                                                         "verification")},
                            from_scratch={k: rp["from_scratch"].get(k) for k in ("gpus", "moves", "restarts")})
    info["plan_ms"] = (time.perf_counter() - t0) * 1e3
    return plan, info


def _replay_row(rep: FleetReplay | None, plan: Plan | None, info: dict) -> dict:
    row = dict(info)
    if rep is None:
        row.update(gpus=None if plan is None else plan.gpus_used, clean=False)
        return row
    s = rep.summary()
    row.update(gpus=plan.gpus_used if plan is not None else None, clean=bool(rep.clean),
               **{k: s[k] for k in ("oom_gpus", "starved_gpus", "starved_adapters", "latency_violation_gpus",
                                    "ttft_mean_s", "ttft_p99_s", "itl_mean_ms", "throughput_ratio")})
    return row


def run_drift(sc: Scenario, run: DriftRun | None = None, profile: Profile | None = None) -> dict[str, Any]:
    """Every policy of a drift scenario over its windows: plans, churn, replays (module docstring). Returns the
    scenario's results entry (``policies``: per policy the totals and per-window rows; ``acceptance``)."""
    from ..workload.trace import load_trace
    from .placement_api import placement_objective
    from .runner import load_scenario_profile

    if not isinstance(sc, Scenario) or sc.drift is None:
        raise SpecError("run_drift: expected a drift scenario (a Scenario with a 'drift' block)")
    run = run if run is not None else DriftRun()
    if not isinstance(run, DriftRun):
        raise SpecError(f"run_drift: expected a DriftRun (got {type(run).__name__})")
    t_start = time.perf_counter()
    profile = profile if profile is not None else load_scenario_profile(sc)
    dw = simulate_drift(load_trace(sc.trace_path), scenario_drift_options(sc, profile), sc.seed)
    config = _config(sc, run.workers)
    objective = placement_objective(sc.objective, sc.objective_limits)
    make_overrides = run.overrides or _default_overrides(sc, run.workers)
    modulated = sc.verify_arrivals == "estimation"
    tracks = [_Track(name=p, kind=parse_policy(p)[0], k=parse_policy(p)[1]) for p in sc.drift.policies]
    say = run.on_step or (lambda _t, _n: None)
    peak_plan = None
    if any(t.kind == "peak" for t in tracks):
        say(f"{sc.name}: peak plan", 0)
        peak_wl = window_workload(dw, dw.peak_rates(), dw.busiest(), modulated)
        peak_plan = place(peak_wl, profile, config, make_overrides(_law(peak_wl)))
    windows: list[dict] = []
    plans: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="lorapack-drift-") as tmp_dir:
        tmp = Path(tmp_dir)
        for w in range(dw.n_windows):
            workload = window_workload(dw, dw.rates_rps[w], w, modulated)
            ctx: dict[str, Any] = {"profile": profile, "workload": workload, "config": config,
                                   "overrides": make_overrides(_law(workload)), "peak_plan": peak_plan}
            chosen: list[tuple[_Track, Plan | None, dict]] = []
            for tr in tracks:
                say(f"{sc.name}: window {w + 1}/{dw.n_windows}: {tr.name}", 0)
                plan, info = _plan_window(tr, w, ctx)
                if plan is None or plan.infeasible:
                    info["infeasible"] = True
                    info["reason"] = None if plan is None else str(plan.reason).replace(f"{tmp}/", "")
                    plan = tr.plan  # the servers keep running the previous window's plan
                    info.update(moves=0, restarts=0)
                chosen.append((tr, plan, info))
            replayer = Replayer(profile, window_replay_workload(dw, w), sc.replay_seed, run.mapper)
            ids = {dw.adapter_ids[i] for i in np.flatnonzero(dw.active[w])}
            todo = []
            for k, (_, p, info) in enumerate(chosen):
                if p is None or info.get("infeasible"):
                    continue
                unrouted = ids - set(p.routes())
                if unrouted:  # not expected: every policy places every active adapter
                    info["unrouted_adapters"] = len(unrouted)
                    continue
                todo.append((k, p))
            reps = dict(zip([k for k, _ in todo], replayer.replay_many([p for _, p in todo], objective, partial=True),
                            strict=True))
            for k, (tr, plan, info) in enumerate(chosen):
                row = _replay_row(reps.get(k), plan, info)
                row["window"] = w
                tr.rows.append(row)
                if plan is not None and not info.get("infeasible"):
                    if tr.plan is not plan or tr.path is None:
                        tr.path = _write_plan(plan, tmp, tr.name, w)
                    tr.plan = plan
                    if run.keep_plans:
                        plans[f"{tr.name}/window{w}"] = _portable(plan, tmp)
                say(f"{sc.name}: window {w + 1}/{dw.n_windows}: {tr.name}", 1)
            windows.append({"window": w, "start_s": sc.drift.start_s + w * dw.window_s,
                            "requests": len(dw.requests[w]), "planned_rate_rps": float(dw.rates_rps[w].sum()),
                            "replay_rate_rps": len(dw.requests[w]) / dw.window_s,
                            "adapters": int(dw.active[w].sum()), "arrived": dw.arrived[w],
                            "departed": dw.departed[w], "replayed_gpus": replayer.simulated})
    policies = {tr.name: _totals(tr) for tr in tracks}
    entry: dict[str, Any] = {
        "name": sc.name, "kind": "drift", "scenario": sc.as_dict(), "method": _method(sc),
        "objective_limits": objective.describe(), "n_adapters_ever": len(dw.adapter_ids), "windows": windows,
        "policies": policies, "acceptance": drift_acceptance(policies),
        "wall_s": time.perf_counter() - t_start}
    if peak_plan is not None:
        entry["peak_plan_gpus"] = None if peak_plan.infeasible else peak_plan.gpus_used
    if run.keep_plans:
        entry["plans"] = plans
    return entry


def _totals(tr: _Track) -> dict[str, Any]:
    rows = tr.rows
    gpus = [r.get("gpus") for r in rows]
    return {"kind": tr.kind, "max_moves": tr.k,
            "gpu_windows": None if any(g is None for g in gpus) else int(sum(gpus)),
            "moves": int(sum(r["moves"] for r in rows)), "restarts": int(sum(r["restarts"] for r in rows)),
            "unclean_windows": int(sum(not r["clean"] for r in rows)),
            "infeasible_windows": int(sum(bool(r.get("infeasible")) for r in rows)),
            "starved_adapters": int(sum(r.get("starved_adapters") or 0 for r in rows)),
            "latency_violation_windows": int(sum(bool(r.get("latency_violation_gpus")) for r in rows)),
            "per_window": rows}


def drift_acceptance(policies: dict[str, dict]) -> dict[str, Any]:
    """Each ``replan:K`` against ``scratch`` (issue 25): GPU-windows within 5 %, at most 20 % of its moves, no more
    unclean windows. ``{}`` without a scratch policy."""
    s = policies.get("scratch")
    if s is None or s.get("gpu_windows") is None:
        return {}
    out: dict[str, Any] = {"gpu_windows_max_ratio": GPU_WINDOWS_MAX_RATIO, "moves_max_ratio": MOVES_MAX_RATIO,
                           "by_policy": {}}
    for name, p in policies.items():
        if p["kind"] != "replan":
            continue
        gw = p.get("gpu_windows")
        g_ratio = None if gw is None else gw / s["gpu_windows"]
        m_ratio = p["moves"] / s["moves"] if s["moves"] else (0.0 if p["moves"] == 0 else math.inf)
        ok_g = g_ratio is not None and g_ratio <= GPU_WINDOWS_MAX_RATIO + 1e-12
        ok_m = m_ratio <= MOVES_MAX_RATIO + 1e-12
        ok_u = p["unclean_windows"] <= s["unclean_windows"]
        out["by_policy"][name] = {"gpu_windows_ratio": g_ratio, "moves_ratio": m_ratio, "gpu_windows_met": ok_g,
                                  "moves_met": ok_m, "unclean_met": ok_u, "met": ok_g and ok_m and ok_u}
    return out


# ---------------------------------------------------------------------------------------------------------
# report


def _fmt_ratio(x: float | None) -> str:
    if x is None:
        return "–"
    return "inf" if math.isinf(x) else f"{x:.2f}"


def drift_table(entry: dict[str, Any]) -> str:
    """One row per policy: GPU-windows, moves, restarts, unclean windows, and the acceptance against scratch."""
    acc = (entry.get("acceptance") or {}).get("by_policy", {})
    head = ["policy", "GPU-windows", "moves", "restarts", "unclean windows", "infeasible windows",
            "GPU-windows / scratch", "moves / scratch", "targets (≤ 1.05, ≤ 0.20, unclean ≤ scratch)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for name, p in entry["policies"].items():
        a = acc.get(name)
        verdict = "–" if a is None else ("met" if a["met"] else "missed: " + ", ".join(
            x for x, ok in (("GPUs", a["gpu_windows_met"]), ("moves", a["moves_met"]), ("unclean", a["unclean_met"]))
            if not ok))
        lines.append("| " + " | ".join([
            f"`{name}`", "–" if p["gpu_windows"] is None else str(p["gpu_windows"]), str(p["moves"]),
            str(p["restarts"]), str(p["unclean_windows"]), str(p["infeasible_windows"]),
            _fmt_ratio(None if a is None else a["gpu_windows_ratio"]), _fmt_ratio(None if a is None else a["moves_ratio"]),
            verdict]) + " |")
    return "\n".join(lines)


def per_window_table(entry: dict[str, Any]) -> str:
    """GPUs / moves per window per policy (``!`` = the window's replay is not clean)."""
    names = list(entry["policies"])
    head = ["window", "requests", "adapters (+in / −out)", *names]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for w, win in enumerate(entry["windows"]):
        cells = [str(w), f"{win['requests']:,}", f"{win['adapters']} (+{win['arrived']} / −{win['departed']})"]
        for n in names:
            r = entry["policies"][n]["per_window"][w]
            g = "–" if r.get("gpus") is None else str(r["gpus"])
            cells.append(f"{g}{'' if r['clean'] else '!'} / {r['moves']}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def drift_markdown(entry: dict[str, Any], figure: str | None = None) -> str:
    s = entry["scenario"]
    d = s["drift"]
    head = (f"### {entry['name']} (drift)\n\n{s['model']}, ranks {s['ranks']}, {s['n_adapters']} adapters at the "
            f"start ({entry['n_adapters_ever']} ever), {s['weights']}, load ×{s['load_scale']:g} of `{s['trace']}`; "
            f"{d['windows']} windows of {d['window_s']:g} s from {d['start_s']:g} s; log-popularity walk σ "
            f"{d['sigma']:g}, arrivals {d['arrivals']:g} × N per window, departures {d['departures']:g}; drift seed "
            f"{d['seed']}, seed {s['seed']}; method `{entry['method']}`, objective {s['objective']} "
            f"({entry['objective_limits']}), headroom {s['headroom'] if s['headroom'] is not None else 'default'}, "
            f"verification {'on' if s['verify'] else 'off'} ({s['verify_arrivals']}); {entry['wall_s']:,.0f} s.\n")
    parts = [head, drift_table(entry), "",
             "Per window: GPUs / moves (`!` = replay not clean; moves count from window 1).\n",
             per_window_table(entry), ""]
    if figure:
        parts.append(f"![drift-{entry['name']}]({figure})\n")
    return "\n".join(parts)


def plot_drift(entry: dict[str, Any], path: Path) -> Path:
    """GPUs and moves per window per policy (two panels; hollow markers = replay not clean)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, (ax_g, ax_m) = plt.subplots(2, 1, figsize=(7.0, 5.6), sharex=True)
    names = list(entry["policies"])
    for i, n in enumerate(names):
        rows = entry["policies"][n]["per_window"]
        xs = [r["window"] for r in rows]
        dy = (i - (len(names) - 1) / 2) * 0.04  # ties stay visible
        gs = [np.nan if r.get("gpus") is None else r["gpus"] + dy for r in rows]
        line, = ax_g.plot(xs, gs, marker="o", ms=4, lw=1.2, label=n)
        bad = [(x, g) for x, g, r in zip(xs, gs, rows, strict=True) if not r["clean"]]
        if bad:
            ax_g.scatter(*zip(*bad, strict=True), s=60, facecolors="none", edgecolors="red", lw=1.2)
        ax_m.plot(xs, [r["moves"] for r in rows], marker="o", ms=4, lw=1.2, color=line.get_color(), label=n)
    ax_g.set_ylabel("GPUs (lines 0.04 apart)")
    ax_g.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax_m.set_ylabel("moves (loads + unloads)")
    ax_m.set_xlabel("window")
    ax_m.xaxis.set_major_locator(MaxNLocator(integer=True))
    for ax in (ax_g, ax_m):
        ax.grid(alpha=0.3)
    ax_g.legend(fontsize=7, ncol=3)
    ax_g.set_title(f"{entry['name']}: GPUs and moves per window per policy (red ring = replay not clean)", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def figure_name(entry: dict[str, Any]) -> str:
    """The file name of a drift scenario's figure (its name, made safe for a path)."""
    return "drift-" + "".join(c if c.isalnum() or c in "._-" else "_" for c in entry["name"]) + ".png"


def drift_figures(doc: dict[str, Any], out_dir: Path) -> list[str]:
    """One figure per drift scenario in ``out_dir/figures``; relative paths."""
    out = []
    for entry in doc.get("drift", []):
        name = "figures/" + figure_name(entry)
        plot_drift(entry, out_dir / name)
        out.append(name)
    return out


def evaluate_drift(scenarios: list[Scenario], run: DriftRun | None = None,
                   on_scenario: Callable[[dict], None] | None = None) -> list[dict[str, Any]]:
    """``run_drift`` for each drift scenario in order; ``on_scenario(entry)`` as each ends."""
    out = []
    for sc in scenarios:
        entry = run_drift(sc, run)
        out.append(entry)
        if on_scenario:
            on_scenario(entry)
    return out


def drift_units(sc: Scenario) -> int:
    """Progress units of a drift scenario: one per policy and window."""
    return 0 if sc.drift is None else sc.drift.windows * len(sc.drift.policies)


def drift_report(doc: dict[str, Any], figures: list[str] | None = None) -> str:
    """The drift scenarios' section of report.md."""
    entries = doc.get("drift", [])
    if not entries:
        return ""
    figs = figures or [None] * len(entries)
    parts = ["## Evaluation over time (drift)\n",
             "GPU-windows = Σ GPUs over the windows; moves = adapters loaded or unloaded on a server, from window 1; "
             "restarts = servers running in two consecutive windows whose flags change; unclean = a window whose "
             "replay is not clean (GPU refused or starved, adapter starved, latency objective missed) or that had no "
             "plan. `scratch` is counted after the best matching of its GPUs to the previous window's.\n"]
    parts += [drift_markdown(e, f) for e, f in zip(entries, figs, strict=True)]
    return "\n".join(parts)
