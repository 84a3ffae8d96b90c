"""Run scenarios: derive the workload, place it with every method under both protocols, replay the plans.

Per (scenario, method):

* **smallest pool** -- a method that opens GPUs itself (``proposed*``) is placed once on an unbounded pool;
  its GPU count is its answer (it passed twin verification on the estimation window), replayed as is. A method
  that places onto a given number of GPUs gets the same test (the *fair* protocol): starting from the count
  its own search returns (``gpus = None``), the evaluation finds the smallest pool whose plan passes the
  verification the greedy methods' plans must pass (``Placer.verify``: the estimation window's rates and
  arrival law, the same seeds, hour and headroom -- nothing of the replay window); ``gpus_used`` is the GPUs
  that plan uses, replayed as is (like a greedy method's, it may then fail the replay). Without a verifier
  (``verify: false``, or a placer that has none) the fair pool is the method's own count.
  The **best case** is the old protocol, kept beside it: the smallest pool whose *replay* is clean (no GPU
  refused, no GPU or adapter starved, every GPU within the latency objective), searched on the replay window
  itself, which no planner can see: ``gpus_used_best_case`` (None for the greedy methods, which are not searched).
  Both searches: one pool smaller if the start passes (then bisection down to the lower bound), else doubling
  steps up to a cap and bisection back;
* **fixed pool** -- where the scenario has ``fixed_pool`` and the lower bound fits in it, every method is
  placed on that pool (the paper's protocol) and replayed as is: ``gpus_used_fixed_pool`` is what it used.

The derived workload and the GPU replay cache are shared by the scenarios of one workload (they differ only
in objective or methods), so a baseline whose plans do not depend on the objective replays once.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..errors import LorapackError
from ..monotone import bisect_smallest, first_true
from ..objective import Objective
from ..placement.plan import Plan
from ..profile import Profile
from ..spec import Workload
from ..workload.derive import DerivedWorkload, DeriveOptions, derive_workload, profile_lengths
from .methods import Bounds, Placer, PlaceRequest
from .replay import FleetReplay, Mapper, Replayer
from .scenario import Scenario

NAN = float("nan")
# 2: the pool methods' smallest pool is the verified one (issue 26, item 7); 1: it was the replay-searched pool
# (now ``gpus_used_best_case``). The docs script labels results of format 1 as the old protocol.
RESULTS_FORMAT = 2
SMALLEST_POOL_PROTOCOL = "verified"  # results.json's name for format 2's smallest-pool protocol
# per-method keys of the --json contract (issue 9); every method result carries them (None when unknown)
CONTRACT_KEYS = ("gpus_used", "gpus_used_fixed_pool", "lower_bound_gpus", "starved_gpus", "oom_gpus",
                 "throughput_tok_s", "itl_mean_ms", "ttft_mean_s", "ttft_p99_s", "placement_ms",
                 "gpus_used_best_case")


def with_vllm_version(prof: Profile, version: str | None) -> Profile:
    """``prof`` whose behaviour follows vLLM ``version``'s rule set (None: as it is)."""
    return prof if version is None or version == prof.vllm_version else prof.model_copy(
        update={"vllm_version": version})


def load_scenario_profile(sc: Scenario) -> Profile:
    from ..profile import find_profile, load_profile_file

    prof = load_profile_file(sc.profile_file) if sc.profile_file else find_profile(sc.model, sc.gpu)
    return with_vllm_version(prof, sc.vllm_version)


def derive_for(sc: Scenario, profile: Profile) -> DerivedWorkload:
    from ..workload.trace import load_trace

    cv = profile.runs_lengths.cv if profile.runs_lengths is not None else None
    opts = DeriveOptions(n_adapters=sc.n_adapters, weights=sc.weights, load_scale=sc.load_scale,
                         rank_set=sc.ranks, protocol=sc.protocol, trace_lengths=sc.trace_lengths,
                         profile_lengths=profile_lengths(cv), split_s=sc.split_s, jitter_s=sc.jitter_s)
    return derive_workload(load_trace(sc.trace_path), opts, sc.seed)


@dataclass
class Budget:
    """Wall-time budget: work not started once it is spent is skipped and listed."""

    seconds: float | None
    t0: float = field(default_factory=time.monotonic)  # system-wide clock: shared by worker processes
    skipped: list[dict] = field(default_factory=list)

    def spent(self) -> bool:
        return self.seconds is not None and time.monotonic() - self.t0 > self.seconds

    def elapsed_s(self) -> float:
        return time.monotonic() - self.t0


def _metrics(rep: FleetReplay) -> dict[str, Any]:
    s = rep.summary()
    out = {k: s[k] for k in ("oom_gpus", "starved_gpus", "starved_adapters", "latency_violation_gpus",
                             "replay_clean", "throughput_tok_s", "incoming_tok_s", "throughput_ratio",
                             "itl_mean_ms", "ttft_mean_s", "ttft_p99_s", "ttft_penalised_s")}
    out["per_gpu"] = [{k: g[k] for k in PER_GPU_KEYS} for g in rep.per_gpu()]
    return out


def _verification_added(plan: Plan) -> int | None:
    added = getattr(plan, "verification", {}).get("gpus_added")
    return None if added is None else int(added)


@dataclass
class Context:
    """What the methods of one workload share."""

    profile: Profile
    derived: DerivedWorkload
    replayer: Replayer
    bounds: Bounds = Bounds(gpus=1, gpus_no_nmax=1)  # the current scenario's (from bound_cache)
    bound_cache: dict[tuple, Bounds] = field(default_factory=dict)
    plans: dict[str, Plan] = field(default_factory=dict)  # kept for --out (key: scenario/method/protocol)


def _request(sc: Scenario, method: str, gpus: int | None) -> PlaceRequest:
    return PlaceRequest(method=method, gpus=gpus, objective=sc.objective, limits=sc.objective_limits, headroom=sc.headroom,
                        verify=sc.verify, seed=sc.seed, split_hot=sc.split_hot)


def _workload(ctx: Context, sc: Scenario) -> Workload:
    # the verifier's arrivals follow the estimation window's load swings (scenario verify_arrivals)
    return ctx.derived.workload(rate_profile=sc.verify_arrivals == "estimation")


def _place(placer: Placer, ctx: Context, sc: Scenario, method: str, gpus: int | None) -> Plan:
    return placer.place(_workload(ctx, sc), ctx.profile, _request(sc, method, gpus))


def search_cap(lower_bound: int, start: int, n_adapters: int) -> int:
    """Largest pool the smallest-pool search tries."""
    return max(start, min(n_adapters, max(4 * max(lower_bound, 1), lower_bound + 16, 2 * start)))


def smallest_clean_pool(place: Callable[[int], Plan], accept: Callable[[Plan], bool], start: int,
                        lower: int, cap: int) -> tuple[int | None, list[dict]]:
    """The smallest pool size whose plan ``accept`` passes (assumed monotone in the pool), and the probes.

    ``place(G)`` places on G GPUs; ``accept(plan)`` judges it (the verification of the fair protocol, or a clean
    replay for the best case). Returns ``(None, probes)`` when no pool up to ``cap`` passes or the method
    declares every tried pool infeasible.
    """
    probes: list[dict] = []
    seen: dict[int, bool] = {}

    def ok(g: int) -> bool:
        if g not in seen:
            plan = place(g)
            passed = (not plan.infeasible) and accept(plan)
            seen[g] = passed
            probes.append({"pool": g, "gpus_used": plan.gpus_used, "infeasible": plan.infeasible, "passed": passed})
        return seen[g]

    lower = max(1, lower)
    start = max(lower, start)
    if ok(start):
        if start == lower or not ok(start - 1):
            return start, probes
        return first_true(ok, lower - 1, start - 1), probes
    best, _ = bisect_smallest(ok, start + 1, cap)  # galloping up from the start, then bisection
    return best, probes


_NO_METRICS = ("oom_gpus", "starved_gpus", "throughput_tok_s", "itl_mean_ms", "ttft_mean_s", "ttft_p99_s")


class _PoolRuns:
    """One pool method's raw runs on each pool size (cached: both searches and the best-case check share them)
    and the shared verifier's verdicts on them."""

    def __init__(self, placer: Placer, ctx: Context, sc: Scenario, method: str) -> None:
        self.placer, self.ctx, self.sc, self.method = placer, ctx, sc, method
        self.plans: dict[int, Plan] = {}  # by pool size
        self.verdicts: dict[int, dict | None] = {}  # by id() of a plan in ``plans`` (kept alive there)

    def place(self, g: int) -> Plan:
        if g not in self.plans:
            self.plans[g] = _place(self.placer, self.ctx, self.sc, self.method, g)
        return self.plans[g]

    def verdict(self, plan: Plan) -> dict | None:
        """``plan`` judged by the verification the greedy methods' plans get; None without a verifier."""
        if not any(p is plan for p in self.plans.values()):  # not one of the cached runs: not cached either
            return self._verify(plan)
        if id(plan) not in self.verdicts:
            self.verdicts[id(plan)] = self._verify(plan)
        return self.verdicts[id(plan)]

    def _verify(self, plan: Plan) -> dict | None:
        if not self.sc.verify:  # the greedy methods are not verified either: no common test
            return None
        return self.placer.verify(_workload(self.ctx, self.sc), self.ctx.profile,
                                  _request(self.sc, self.method, None), plan)

    def passes(self, plan: Plan) -> bool:
        v = self.verdict(plan)
        return bool(v and v["passed"])


def _best_case(runs: _PoolRuns, replay: Callable[[Plan], FleetReplay], start: int, lb: int, cap: int,
               fair: int | None) -> dict[str, Any]:
    """The old smallest-pool protocol, kept as the pool methods' best case: the smallest pool whose replay is
    clean (searched on the replay window, which no planner sees), its replay and whether it passes verification
    (asked only where it is not larger than the verified pool: a larger one says nothing about the comparison)."""
    best, probes = smallest_clean_pool(runs.place, lambda p: replay(p).clean, start, lb, cap)
    out: dict[str, Any] = {"pool": best, "search": probes, "gpus_used": None}
    if best is None:
        out["no_clean_pool"] = True
        return out
    plan = runs.plans[best]
    runs.ctx.plans[f"{runs.method}/best_case"] = plan
    rep = replay(plan)
    out.update(gpus_used=plan.gpus_used, **{k: v for k, v in _metrics(rep).items() if k != "per_gpu"})
    if fair is None or best <= fair:  # the verified plan itself when equal (its verdict is cached)
        v = runs.verdict(plan)
        out["passes_verification"] = None if v is None else bool(v["passed"])
        if v is not None:
            out["failed_verification_gpus"] = v["failed_gpus"]
    return out


def _smallest_pool_method(placer: Placer, ctx: Context, sc: Scenario, method: str, own: Plan,
                          replay: Callable[[Plan], FleetReplay], lb: int) -> dict[str, Any]:
    """A pool method under the fair protocol (verified pool) and its best case (replay-searched pool)."""
    # raw runs on each pool size (the plan at placement's own size is the same assignment, but its
    # placement_ms includes placement's search): placement time = one run of the method, as published
    out: dict[str, Any] = {"search_ms": own.placement_ms}
    runs = _PoolRuns(placer, ctx, sc, method)
    cap = search_cap(lb, own.gpus_used, sc.n_adapters)
    # ``own`` is the assignment of the raw run on its count: its GPUs are the shared verifier's cached answers
    # when the search asks again
    if runs.verdict(own) is None:  # no verifier: the method's own count is its answer
        fair: int | None = own.gpus_used
        probes: list[dict] = []
        out["verified"] = False
    else:
        fair, probes = smallest_clean_pool(runs.place, runs.passes, own.gpus_used, lb, cap)
        out["verified"] = True
    final = own if fair is None else runs.place(fair)
    if fair is None:
        out["no_verified_pool"] = True
    else:
        ctx.plans[f"{method}/smallest"] = final
    best = _best_case(runs, replay, own.gpus_used, lb, cap, fair)
    rep = replay(final)
    out.update(gpus_used=None if fair is None else final.gpus_used, plan_gpus=final.gpus_used,
               placement_ms=final.placement_ms, verification_ms=final.verification_ms, search=probes,
               gpus_used_best_case=best["gpus_used"], best_case=best, **_metrics(rep))
    return out


def run_method(placer: Placer, ctx: Context, sc: Scenario, method: str, objective: Objective
               ) -> dict[str, Any]:
    """Both protocols for one method (see the module docstring)."""
    def replay(plan: Plan) -> FleetReplay:
        return ctx.replayer.replay(plan, objective)

    lb = placer.method_bound(method, ctx.bounds)
    out: dict[str, Any] = {"lower_bound_gpus": lb, "gpus_used_best_case": None}
    own = _place(placer, ctx, sc, method, None)
    ctx.plans[f"{method}/smallest"] = own
    out["self_gpus"] = None if own.infeasible else own.gpus_used
    out["verification_added_gpus"] = _verification_added(own)
    if own.infeasible:
        out.update(infeasible=True, reason=own.reason, gpus_used=None, placement_ms=own.placement_ms,
                   **dict.fromkeys(_NO_METRICS))
    elif placer.sizes_itself(method):
        rep = replay(own)
        out.update(gpus_used=own.gpus_used, plan_gpus=own.gpus_used, placement_ms=own.placement_ms,
                   verification_ms=own.verification_ms, search=[], **_metrics(rep))
    else:
        out.update(_smallest_pool_method(placer, ctx, sc, method, own, replay, lb))
    if out.get("gpus_used") is not None:
        out["gap_gpus"] = out["gpus_used"] - lb
    elif not own.infeasible:
        out["gap_gpus"] = None
    out["gpus_used_fixed_pool"] = None
    if sc.fixed_pool is not None:
        if ctx.bounds.gpus > sc.fixed_pool:  # one rule for every method: the bound with the N_max row
            out["fixed_pool"] = {"skipped": f"lower bound {ctx.bounds.gpus} > pool {sc.fixed_pool}"}
        else:
            plan = _place(placer, ctx, sc, method, sc.fixed_pool)
            ctx.plans[f"{method}/fixed"] = plan
            fixed: dict[str, Any] = {"pool": sc.fixed_pool, "infeasible": plan.infeasible,
                                     "placement_ms": plan.placement_ms}
            if plan.infeasible:
                fixed["reason"] = plan.reason
            else:
                fixed["gpus_used"] = plan.gpus_used
                fixed.update(_metrics(replay(plan)))
                out["gpus_used_fixed_pool"] = plan.gpus_used
            out["fixed_pool"] = fixed
    return out


def _num(x: Any) -> Any:
    return None if isinstance(x, float) and not math.isfinite(x) else x


PER_GPU_KEYS = ("n_adapters", "max_loras", "max_lora_rank", "n_requests", "oom", "starved", "throughput_tok_s",
                "incoming_tok_s", "itl_mean_ms", "ttft_mean_s", "ttft_p99_s", "starved_adapters",
                "latency_violations")
ProgressFn = Callable[[str, int], None]  # (what runs now, units of scenario x method just finished)


def evaluate_scenarios(scenarios: list[Scenario], placer: Placer, methods: tuple[str, ...] | None = None,
                       budget: Budget | None = None, mapper: Mapper | None = None,
                       on_step: ProgressFn | None = None, on_scenario: Callable[[dict], None] | None = None,
                       keep_plans: bool = False) -> dict[str, Any]:
    """Every scenario × method (``methods`` overrides the files' lists). Returns the results document.

    ``budget``: the wall time (default: none), from when it started (``Budget.t0``, shared by worker
    processes); its ``skipped`` list fills with the work it left out."""
    from .maxpack import max_pack_curve

    budget = budget if budget is not None else Budget(None)
    results: list[dict] = []
    max_packs: list[dict] = []
    contexts: dict[tuple, Context] = {}
    all_methods = placer.methods()
    for sc in scenarios:
        meths = methods or sc.methods or all_methods
        if budget.spent():
            budget.skipped.append({"scenario": sc.name, "methods": list(meths), "what": "scenario"})
            if on_step:
                on_step(f"skipped {sc.name}", len(meths))
            continue
        key = sc.workload_key()
        t0 = time.perf_counter()
        ctx = contexts.get(key)
        first_of_workload = ctx is None
        if ctx is None:
            profile = load_scenario_profile(sc)
            derived = derive_for(sc, profile)
            ctx = Context(profile=profile, derived=derived,
                          replayer=Replayer(profile, derived, sc.replay_seed, mapper))
            contexts = {key: ctx}  # one workload's cache at a time: scenarios of a workload are adjacent
            new_workload = getattr(placer, "new_workload", None)  # optional: a placer's per-workload caches
            if new_workload is not None:
                new_workload()
        ctx.plans = {}
        # the bound depends on the objective (latency row) and the verification arrivals, not on the method
        bkey = (sc.objective_label, sc.headroom, sc.verify_arrivals, sc.seed)
        if bkey not in ctx.bound_cache:
            ctx.bound_cache[bkey] = placer.lower_bound(_workload(ctx, sc), ctx.profile, _request(sc, "", None))
        ctx.bounds = ctx.bound_cache[bkey]
        objective = placer.objective(sc.objective, sc.objective_limits)
        d = ctx.derived
        entry: dict[str, Any] = {
            "name": sc.name, "n_adapters": sc.n_adapters, "load_scale": sc.load_scale,
            "scenario": sc.as_dict(), "objective_limits": objective.describe(),
            "workload": {
                "aggregate_rate_rps": d.aggregate_rate_rps, "replay_rate_rps": d.replay_rate_rps,
                "estimation_window_s": d.estimation_window_s, "replay_window_s": d.replay_window_s,
                "replay_requests": len(d.replay), "mean_input_tokens": d.mean_input_tokens,
                "mean_output_tokens": d.mean_output_tokens, "max_rate_rps": float(d.rates_rps.max()),
                "offered_tok_s": d.aggregate_rate_rps * (d.mean_input_tokens + d.mean_output_tokens)},
            "lower_bound_gpus": ctx.bounds.gpus, "lower_bound_gpus_no_nmax": ctx.bounds.gpus_no_nmax,
            "methods": {},
        }
        for m in meths:
            if budget.spent():
                budget.skipped.append({"scenario": sc.name, "methods": [m], "what": "method"})
                if on_step:
                    on_step(f"skipped {sc.name}: {m}", 1)
                continue
            if on_step:
                on_step(f"{sc.name}: {m}", 0)
            tm = time.perf_counter()
            try:
                res = run_method(placer, ctx, sc, m, objective)
            except LorapackError as exc:  # e.g. no learned models for this profile: report, go on
                res = {"error": str(exc), **dict.fromkeys(CONTRACT_KEYS)}
            res["wall_s"] = time.perf_counter() - tm
            entry["methods"][m] = res
            if on_step:
                on_step(f"{sc.name}: {m}", 1)
        if sc.max_pack and first_of_workload:
            if budget.spent():
                budget.skipped.append({"scenario": sc.name, "methods": [], "what": "max_pack"})
            else:
                if on_step:
                    on_step(f"{sc.name}: Max_pack curve", 0)
                curve = max_pack_curve(ctx.replayer, ctx.profile)
                curve["scenario"] = sc.name
                max_packs.append(curve)
                entry["max_pack"] = {str(a): c["max_pack"] for a, c in curve["by_slots"].items()}
        entry["wall_s"] = time.perf_counter() - t0
        entry["replayed_gpus"] = ctx.replayer.simulated
        if keep_plans:
            entry["plans"] = {k: p.to_dict() for k, p in ctx.plans.items()}
        results.append(entry)
        if on_scenario:
            on_scenario(entry)
    return {"format": RESULTS_FORMAT, "smallest_pool_protocol": SMALLEST_POOL_PROTOCOL, "scenarios": results,
            "max_pack": max_packs,
            "skipped": budget.skipped, "budget_s": budget.seconds, "wall_s": budget.elapsed_s()}
