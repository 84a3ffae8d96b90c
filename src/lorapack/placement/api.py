"""``place()``: one call from adapters to a verified plan, for every method (the API ``lorapack place`` and
``lorapack evaluate`` use).

Order of work: validate the adapters (``Instance``) -> lower bound (and hot adapters: report, or split with
``split_hot``) -> the method (timed: ``placement_ms``) -> twin verification and repair (timed:
``verification_ms``) -> ``Plan``. A method that cannot place the workload returns a plan with
``infeasible=True`` and the reason; bad input raises ``SpecError`` before any work.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..errors import SpecError
from ..monotone import bisect_smallest
from ..objective import Objective
from ..oracle import (
    CandidateArrivals,
    GpuCandidate,
    Oracle,
    Prediction,
    default_slot_rank,
    length_law_problem,
    lengths_outside_training,
)
from ..profile import Profile
from ..server import ServerConfig
from .baselines import Assignment, shares_of
from .bound import (
    CapacityFn,
    LowerBound,
    ObjectiveUnreachable,
    VerifierRuns,
    latency_capacity,
    lower_bound,
    twin_capacity,
)
from .config import DEFAULT_VERIFY_SEEDS, PlaceConfig
from .estimate import SPLIT_TARGET, VERIFY_DURATION_S, asks_the_twin, guard_placement, objective_flags
from .greedy import (
    N_MAX,
    GpuFill,
    GreedyOptions,
    Infeasible,
    balanced_plan,
    deal_balanced,
    deal_round_robin,
    fit_slots_lazy,
    greedy_fill,
    rebalance,
)
from .oracles import ParallelTwinOracle, default_workers, exact_oracle, learned_oracle
from .plan import GpuMetrics, GpuPlan, Plan
from .problem import Instance, check_assumed_lengths, instance_from_workload, split_entries
from .registry import Method, get_method
from .verify import Judges, RepairLog, Verdict, fill_candidate, repair, verify_fills

if TYPE_CHECKING:
    from ..spec import Workload

# a verified greedy plan spreads its load when its worst GPU's mean TTFT exceeds this multiple of its lightest
# GPU's (``_spread``), and takes an arrangement whose worst GPU waits at least SPREAD_GAIN less
SPREAD_RATIO = 2.0
SPREAD_GAIN = 0.2
MAX_SPLIT_ROUNDS = 6

Progress = Callable[[str], None]


@dataclass(frozen=True)
class OracleOverrides:
    """What replaces an oracle ``place()`` would build: toy oracles in tests, a benchmark's warm oracle,
    ``evaluate``'s verifier shared by its methods. ``oracle``: the method's own; ``search_oracle``: the twin
    of the smallest-pool search, round-robin's ``A`` and the repair probes; ``verify_oracle``: the verifier;
    ``capacity`` / ``latency_capacity``: the bound's ``C(S)`` / ``L(S)`` (a toy ``capacity`` without a
    ``latency_capacity`` drops the latency row, which only the twin can simulate)."""

    oracle: Oracle | None = None
    search_oracle: Oracle | None = None
    verify_oracle: Oracle | None = None
    capacity: CapacityFn | None = None
    latency_capacity: CapacityFn | None = None


@dataclass
class Context:
    """Everything a method run needs; oracles are built on first use (a learned one may not exist)."""

    profile: Profile
    objective: Objective
    seed: int = 0
    workers: int = 1
    models_dir: Path | None = None
    oracle: Oracle | None = None  # overrides the method's own oracle
    search_oracle: Oracle | None = None  # validates G in the smallest-pool search, picks round-robin's A
    verify_oracle: Oracle | None = None
    verify_arrivals: CandidateArrivals | None = None  # the arrival law the verifier simulates (None: Poisson)
    capacity: CapacityFn | None = None
    options: GreedyOptions = field(default_factory=GreedyOptions)
    progress: Progress | None = None
    # a GPU of the workload (its length law): a learned oracle whose training does not cover that law gives way
    # to the twin (``oracle_of``), and ``fallbacks`` says why, per oracle kind
    lengths_probe: GpuCandidate | None = None
    fallbacks: dict[str, str] = field(default_factory=dict)
    _cache: dict = field(default_factory=dict)

    def say(self, msg: str) -> None:
        if self.progress is not None:
            self.progress(msg)

    @classmethod
    def of(cls, profile: Profile, config: PlaceConfig, overrides: OracleOverrides,
           verify_arrivals: CandidateArrivals | None, progress: Progress | None = None) -> Context:
        """The context of one ``place()`` / ``verify_plan()`` call."""
        n_max = N_MAX if config.n_max is None else config.n_max
        return cls(profile=profile, objective=config.objective, seed=int(config.seed),
                   workers=config.worker_count(), models_dir=config.models_dir, oracle=overrides.oracle,
                   search_oracle=overrides.search_oracle, verify_oracle=overrides.verify_oracle,
                   verify_arrivals=verify_arrivals, capacity=overrides.capacity,
                   options=GreedyOptions(n_max=n_max), progress=progress)

    def oracle_of(self, kind: str) -> Oracle:
        """The oracle of ``kind`` (``registry.ORACLE_KINDS``) unless ``oracle`` overrides the method's own."""
        if self.oracle is not None:
            return self.oracle
        if kind == "twin":
            return self.twin()
        if kind not in self._cache:
            probe = self.lengths_probe
            # the law's shape is known without the models (none was trained on another): they are not loaded
            why = length_law_problem(probe) if probe is not None else ""
            oracle = None
            if not why:
                oracle = learned_oracle(self.profile, kind, self.models_dir)
                why = lengths_outside_training(oracle, probe) if probe is not None else ""
            if oracle is None or why:  # its answers would extrapolate to requests it never saw: the twin answers
                self.fallbacks[kind] = why
                self.say(f"the {kind} models were not trained on these lengths ({why}): the twin answers")
                oracle = self.twin()
            self._cache[kind] = oracle
        return self._cache[kind]

    def confirmer(self, oracle: Oracle) -> Oracle | None:
        """What double-checks ``oracle`` where it would commit nothing to an empty GPU (``greedy_fill``'s
        ``confirm``): the twin for a learned model (wrong outside its data), nothing for the twin itself."""
        return self.twin() if getattr(oracle, "learned", False) else None

    def twin(self) -> Oracle:
        """The twin at ``proposed-exact``'s settings (shared: its cache serves the search and repair too)."""
        if self.search_oracle is not None:
            return self.search_oracle
        if "twin" not in self._cache:
            self._cache["twin"] = exact_oracle(seed=self.seed, workers=self.workers)
        return self._cache["twin"]

    def verifier(self, seeds: int) -> Oracle:
        if self.verify_oracle is not None:
            return self.verify_oracle
        return twin_verifier(self.seed, seeds, self.workers, self.verify_arrivals)

    def cap(self, inst: Instance) -> CapacityFn:
        if self.capacity is None:
            self.capacity = twin_capacity(self.profile, inst.mean_input_tokens, inst.mean_output_tokens,
                                          lengths=inst.lengths)
        return self.capacity

    def lat_cap(self, inst: Instance, seeds: int) -> CapacityFn:
        """The bound's latency row ``L(S)``, simulated as the verifier would (its seeds, hour and arrivals)."""
        row = verification_latency_row(self.profile, inst, self.objective, self.verify_arrivals, self.seed, seeds,
                                       self.cap(inst))

        def with_progress(slot_rank: int) -> float:  # the first call per rank class simulates (~10 s)
            self.say(f"lower bound: the latency capacity of one GPU at --max-lora-rank {slot_rank}")
            return row(slot_rank)

        return with_progress


def twin_verifier(seed: int = 0, seeds: int = DEFAULT_VERIFY_SEEDS, workers: int | None = None,
                  arrivals: CandidateArrivals | None = None) -> ParallelTwinOracle:
    """The twin as ``place()``'s verifier: ``seeds`` seeds derived from the placement ``seed``, the full hour, no
    early termination, ``arrivals`` (None: Poisson). Its answers are cached by candidate, so one verifier passed
    as ``verify_oracle`` to several ``place`` / ``verify_plan`` calls on the same settings simulates a GPU
    (same adapters in the same order, same flags) once -- what ``lorapack evaluate`` does across its methods and
    protocols. Only simulation is shared: each call judges the answers by its own objective."""
    return ParallelTwinOracle(seeds=tuple(verify_seeds_of(seed, seeds)), duration_s=VERIFY_DURATION_S,
                              early_stop=False, workers=default_workers() if workers is None else int(workers),
                              arrivals=arrivals, name="twin-verify")


def verify_seeds_of(seed: int, n: int) -> list[int]:
    """The verifier's seeds for a placement seed (apart from the method's own and the searches')."""
    return [seed + 1000 + i for i in range(n)]


def verification_latency_row(profile: Profile, inst: Instance, objective: Objective,
                             arrivals: CandidateArrivals | None, seed: int, verify_seeds: int,
                             capacity: CapacityFn | None = None) -> CapacityFn:
    """The bound's latency row ``L(S)`` for ``inst`` as ``place``'s verification simulates (``bound`` module)."""
    if capacity is None:
        capacity = twin_capacity(profile, inst.mean_input_tokens, inst.mean_output_tokens, lengths=inst.lengths)
    runs = VerifierRuns(arrivals=arrivals, seeds=tuple(verify_seeds_of(seed, verify_seeds)),
                        duration_s=VERIFY_DURATION_S, lengths=inst.lengths)
    return latency_capacity(profile, inst.mean_input_tokens, inst.mean_output_tokens, objective, capacity, runs)


# ---------------------------------------------------------------------------------------------------------
# the methods on a fixed pool, and the smallest-pool search


def assign(method: str, inst: Instance, ctx: Context, gpus: int) -> Assignment:
    """One run of a pool method on ``gpus`` GPUs (no verification)."""
    m = get_method(method)
    if m.run is None:
        raise SpecError(f"{method} opens GPUs itself; it is not a fixed-pool method")
    return m.run(inst, ctx, gpus)


def gpus_pass(inst: Instance, ctx: Context, a: Assignment, oracle: Oracle) -> bool:
    """Every GPU of the assignment meets the objective according to ``oracle`` (one batch)."""
    from .verify import fill_candidate

    preds = oracle.predict([fill_candidate(inst, ctx.profile, f) for f in a.gpus])
    for f, p in zip(a.gpus, preds, strict=True):
        f.prediction = p
    return all(ctx.objective.check(p) is None for p in preds)


def smallest_pool(method: str, inst: Instance, ctx: Context, lo: int, hi: int | None = None,
                  validate: bool = True) -> tuple[int | None, Assignment | None, dict]:
    """§4.8's minimum-G search by bisection: the smallest G the method accepts and (``validate``) whose GPUs
    all meet the objective in the twin's opinion (``ctx.twin()``: one seed, early termination)."""
    m = get_method(method)
    if m.min_gpus is not None:
        lo = max(lo, m.min_gpus(inst, ctx))
    hi = hi if hi is not None else lo + max(inst.n, 8)
    last: dict[int, Assignment] = {}

    def feasible(g: int) -> bool:
        ctx.say(f"{method}: trying {g} GPU{'s' if g != 1 else ''}")
        a = assign(method, inst, ctx, g)
        last[g] = a
        if not a.accepted:
            a.extra["validated"] = False
            return False
        ok = True
        if validate and not m.self_validated:
            ok = gpus_pass(inst, ctx, a, ctx.twin())
        a.extra["validated"] = ok
        return ok

    g, probes = bisect_smallest(feasible, lo, hi)
    info = {"probes": [{"gpus": p, "feasible": ok, "accepted": last[p].accepted} for p, ok in probes],
            "self_accepted_gpus": min((p for p, _ in probes if last[p].accepted), default=None),
            "validated_gpus": g, "validate": validate}
    return g, (last[g] if g is not None else None), info


# ---------------------------------------------------------------------------------------------------------
# place()


def _hot_split(inst: Instance, bound: LowerBound) -> dict[int, int]:
    """Replicas per entry for ``--split-hot``: entries above SPLIT_TARGET x K(S) get ceil(d / (target K))."""
    out = {}
    for i, (d, r) in enumerate(zip(inst.demand_tok_s, inst.ranks, strict=True)):
        k_s = max(v for s, v in bound.capacity_tok_s.items() if s >= default_slot_rank(int(r)))
        k = math.ceil(float(d) / (SPLIT_TARGET * k_s))
        if k > 1:
            out[i] = k
    return out


def _normalise(inst: Instance, fills: list[GpuFill]) -> list[GpuFill]:
    """Merge entries of the same adapter on one GPU (replicas that met) into its first entry."""
    out = []
    for f in fills:
        shares = shares_of(f)
        first: dict[str, int] = {}
        entries: list[int] = []
        new_sh: list[float] = []
        for e, s in zip(f.entries, shares, strict=True):
            a = inst.adapter_ids[e]
            if a in first:
                j = first[a]
                # in units of the first entry's requests: entries of one adapter differ by weight only (rates
                # would divide by 0 for an adapter at rate 0)
                new_sh[j] += s * inst.weights[e] / inst.weights[entries[j]]
            else:
                first[a] = len(entries)
                entries.append(e)
                new_sh.append(s)
        if len(entries) != len(f.entries) or "shares" in f.extra:
            f = replace(f, entries=entries, extra={**f.extra, "shares": new_sh},
                        max_loras=min(f.max_loras, len(entries)))
            if all(abs(s - 1.0) < 1e-12 for s in new_sh):
                f.extra.pop("shares")
        out.append(f)
    return out


def _metrics(p: Prediction | None, inst: Instance, entries: list[int], verdict: Verdict | None = None,
             tested_adapters: int | None = None) -> GpuMetrics | None:
    if p is None:
        return None
    per_seed = []
    for r in p.extra.get("runs") or []:
        per_seed.append({k: r.get(k) for k in ("throughput_tok_s", "incoming_tok_s", "starved", "adapter_starved",
                                               "ttft_mean_ms", "ttft_p99_ms", "itl_mean_ms", "itl_p99_ms",
                                               "stop_reason")})
    starved_ids = sorted({inst.adapter_ids[e] for e in (verdict.starved_entries if verdict else [])} |
                         {inst.adapter_ids[entries[i]] for i in p.starved_adapters if i < len(entries)})
    return GpuMetrics(throughput_tok_s=p.throughput_tok_s, incoming_tok_s=p.incoming_tok_s, itl_ms=p.itl_ms,
                      ttft_s=p.ttft_s, ttft_p99_s=p.ttft_p99_s, itl_p99_ms=p.itl_p99_ms, starved=p.starved,
                      starved_adapters=starved_ids, fits=p.fits, seeds=p.seeds, per_seed=per_seed,
                      passed=None if verdict is None else verdict.passed,
                      detail="" if verdict is None else verdict.detail,
                      tested_adapters=tested_adapters if tested_adapters != len(entries) else None)


def build_plan(method: str, inst: Instance, profile: Profile, fills: list[GpuFill],
               verdicts: list[Verdict] | None = None) -> Plan:
    gpus = []
    for gi, f in enumerate(fills):
        shares = shares_of(f)
        idx = np.asarray(f.entries, dtype=np.int64)
        rates = inst.rates_rps[idx] * np.asarray(shares)
        a = max(1, min(int(f.max_loras), len(f.entries)))
        v = verdicts[gi] if verdicts is not None else None
        binding = f.binding
        if v is not None and not v.passed:
            binding = v.reason
        gpus.append(GpuPlan(
            adapters=[inst.adapter_ids[e] for e in f.entries],
            weights=[float(inst.weights[e] * s) for e, s in zip(f.entries, shares, strict=True)],
            server=ServerConfig(max_loras=a, max_lora_rank=default_slot_rank(int(inst.ranks[idx].max())),
                                max_cpu_loras=max(len(f.entries), a), max_num_seqs=profile.max_num_seqs,
                                max_num_batched_tokens=profile.max_num_batched_tokens,
                                max_model_len=profile.max_model_len),
            incoming_tok_s=float(rates.sum()) * inst.tokens_per_request,
            predicted=None if v is not None and f.prediction is v.prediction else _metrics(
                f.prediction, inst, f.entries, tested_adapters=f.extra.get("tested_at")),
            verified=_metrics(v.prediction, inst, f.entries, v) if v is not None else None,
            binding=binding, ranks=[int(inst.ranks[e]) for e in f.entries], rates_rps=[float(x) for x in rates]))
    return Plan(method=method, model=profile.model, gpu_type=profile.gpu, gpus=gpus)


def _loading_ms() -> float:
    """Milliseconds this process has spent loading learned models so far (``lorapack.surrogate``)."""
    try:
        from ..surrogate.oracle import loading_ms
    except ImportError:
        return 0.0
    return loading_ms()


def place(adapters: Instance | Workload, profile: Profile, config: PlaceConfig | None = None,
          overrides: OracleOverrides | None = None, progress: Progress | None = None) -> Plan:
    """Place ``adapters`` (an ``Instance``, or a ``lorapack.spec.Workload``) as ``config`` says (default
    ``PlaceConfig()``: ``proposed``, smallest pool, mean TTFT <= 2 s, verified).

    ``config.gpus``: the pool (None = as many as needed: the greedy opens GPUs, pool methods run the
    smallest-pool search). ``config.headroom``: rates are planned x (1 + headroom) (ignored for an
    ``Instance``, which carries its own; so are the mean lengths). ``config.verify``: twin verification
    (``verify_seeds`` seeds, full hour) and repair; the verifier simulates ``config.verify_law(adapters)`` at
    the planned rates, while the searches and the method's own twin stay Poisson (their early termination
    assumes steady arrivals). ``overrides`` replace the oracles ``place`` would build (``OracleOverrides``).
    Under an objective with latency limits the bound has a latency row ``L(S)`` (``bound`` module).
    Deterministic for a given seed.

    ``config.n_max``: None (default) = soft: the greedy's testing points stop at ``N_MAX`` (384, the most
    adapters per GPU in the real runs and the learned models' training data), and after verification the
    greedy methods try plans on fewer GPUs judged by the twin (``_consolidate``), which may put more adapters
    on a GPU -- as the pool baselines may; the plan's bound is then the one without the N_max row. An integer
    is a hard cap for the greedy, the consolidation and the bound alike.
    """
    config = config if config is not None else PlaceConfig()
    overrides = overrides if overrides is not None else OracleOverrides()
    method = get_method(config.method)
    objective, verify, verify_seeds = config.objective, config.verify, config.verify_seeds
    hard_n_max = config.n_max is not None
    verify_arrivals = config.verify_law(adapters)
    inst = instance_of(adapters, profile, config)
    # before any work (the bound's latency row alone simulates for seconds): an objective no GPU can meet, and
    # a placement past the resource limits (``--force`` lifts them), are refused in milliseconds
    guard_placement(inst, profile, config, twin_oracle=overrides.oracle is None and asks_the_twin(
        method.oracle, inst, profile), pool_search=not method.greedy and config.gpus is None)
    if config.previous is not None:  # a re-plan is lorapack.replan's (through lorapack.placement.place)
        raise SpecError("--previous: this place() plans from scratch; re-plan with lorapack.placement.place")
    ctx = Context.of(profile, config, overrides, verify_arrivals, progress)
    ctx.lengths_probe = inst.candidate(profile, [0], 1)
    n_max = ctx.options.n_max
    settings = {"objective": objective.to_dict(), "headroom": inst.headroom, "seed": int(config.seed),
                "pool": config.gpus, "pool_role": "cap" if method.greedy else "size",  # what --gpus means
                "verify": verify, "verify_seeds": verify_seeds if verify else 0, "n_max": n_max,
                "n_max_hard": hard_n_max,
                "verify_arrivals": _law(verify_arrivals) if verify else None,
                "split_hot": config.split_hot, "mean_input_tokens": inst.mean_input_tokens,
                "mean_output_tokens": inst.mean_output_tokens, "lengths": lengths_record(inst, profile),
                "oracle": getattr(overrides.oracle, "name", None) or method.oracle or "none",
                "vllm_version": profile.vllm_version}  # the rule set the twin followed (place --vllm-version)
    # how a measured profile's server ran (serve.sh pins them); left out at the shipped profiles' values
    for key, value, neutral in (("measured_gpu_memory_utilization", profile.measured_gpu_memory_utilization, 0.9),
                                ("measured_prefix_caching", profile.measured_prefix_caching, False),
                                ("tensor_parallel_size", profile.tensor_parallel_size, 1)):
        if value != neutral:
            settings[key] = value

    ctx.say("lower bound")
    # the latency row needs the twin: skipped with a toy capacity unless a toy latency capacity comes with it
    lat_cap = overrides.latency_capacity if overrides.latency_capacity is not None or overrides.capacity is not None \
        or not objective.limits() else ctx.lat_cap(inst, verify_seeds)
    try:
        bound = lower_bound(inst, profile, n_max=n_max, capacity=ctx.cap(inst), latency_capacity=lat_cap)
    except ObjectiveUnreachable as e:  # said with the limits that cannot be met
        raise ObjectiveUnreachable(f"{objective_flags(objective)}: {e}") from None
    diagnostics: dict = {}
    if bound.hot_adapters and not config.split_hot:
        return _infeasible(method, profile, settings, bound, diagnostics,
                           _hot_message(bound, inst), hot=bound.hot_adapters)
    if config.split_hot:
        reps = _hot_split(inst, bound)
        if reps:
            diagnostics["split"] = {inst.adapter_ids[i]: k for i, k in reps.items()}
            inst = split_entries(inst, reps)
            bound = lower_bound(inst, profile, n_max=n_max, capacity=ctx.cap(inst), latency_capacity=lat_cap)

    loaded0 = _loading_ms()
    t0 = time.perf_counter()
    try:
        fills, info, inst = _run(method, inst, ctx, config, bound, diagnostics)
    except Infeasible as e:
        settings["gpus_needed"] = e.gpus_needed
        _record_fallbacks(ctx, settings)
        return _infeasible(method, profile, settings, bound, diagnostics, str(e), hot=e.hot,
                           placement_ms=(time.perf_counter() - t0) * 1e3)
    load_ms = _loading_ms() - loaded0  # learned models read during the method: reported apart (issue 26)
    placement_ms = (time.perf_counter() - t0) * 1e3 - load_ms
    diagnostics.update(info)
    _record_fallbacks(ctx, settings)
    fills = _normalise(inst, fills)

    verdicts = None
    verification: dict = {}
    verification_ms = math.nan
    if verify:
        t1 = time.perf_counter()
        ctx.say(f"verifying {len(fills)} GPUs ({verify_seeds} seeds x {VERIFY_DURATION_S:.0f} s)")
        verifier = ctx.verifier(verify_seeds)
        sims_before = (getattr(verifier, "n_simulations", 0), getattr(verifier, "cache_hits", 0))
        before = len(fills)
        try:
            fills, verdicts, log = repair(inst, profile, fills, objective, Judges(verifier, ctx.twin()),
                                          pool=config.gpus, options=ctx.options,
                                          on_round=lambda r, n: ctx.say(f"repairing {n} GPU(s), round {r}"))
        except Infeasible as e:
            settings["gpus_needed"] = e.gpus_needed
            return _infeasible(method, profile, settings, bound, diagnostics, str(e), hot=e.hot,
                               placement_ms=placement_ms, verification_ms=(time.perf_counter() - t1) * 1e3)
        fills = _normalise(inst, fills)
        consolidated = spread = None
        if method.greedy and ctx.options.rebalance:
            floor = bound.gpus if hard_n_max else bound.gpus_no_nmax
            limit = n_max if hard_n_max else inst.n
            fills, verdicts, consolidated = _consolidate(inst, ctx, fills, verdicts, verifier, floor, limit)
            fills, verdicts, spread = _spread(inst, ctx, fills, verdicts, verifier, limit)
        verification_ms = (time.perf_counter() - t1) * 1e3
        verification = verification_dict(verifier, verify_seeds, before, fills, verdicts, log, sims_before)
        if consolidated is not None:
            verification["consolidated"] = consolidated
        if spread is not None:
            verification["spread"] = spread

    plan = build_plan(method.name, inst, profile, fills, verdicts)
    plan.placement_ms = placement_ms
    plan.load_ms = load_ms
    plan.verification_ms = verification_ms
    plan.lower_bound_gpus = method_lower_bound(method, bound, hard_n_max)
    plan.lower_bound = bound.to_dict()
    plan.settings = settings
    plan.verification = verification
    plan.diagnostics = diagnostics
    return plan


def instance_of(adapters: Instance | Workload, profile: Profile, config: PlaceConfig) -> Instance:
    """The instance ``place()`` plans: an ``Instance`` as given (it carries its headroom and lengths), a
    ``Workload`` at ``config``'s headroom and mean lengths."""
    if isinstance(adapters, Instance):
        check_assumed_lengths(adapters, profile, "the instance")
        return adapters
    return instance_from_workload(adapters, headroom=config.headroom, mean_input_tokens=config.mean_input_tokens,
                                  mean_output_tokens=config.mean_output_tokens, profile=profile)


def lengths_record(inst: Instance, profile: Profile) -> dict:
    """The request length law a plan was made for, as plan.json's ``settings.lengths`` records it: the law's
    fields and ``assumed`` (true: the workload gave no lengths and the profile's law was assumed)."""
    law = inst.length_law(profile)
    d: dict = {"kind": law.kind, "mean_input_tokens": inst.mean_input_tokens,
               "mean_output_tokens": inst.mean_output_tokens, "assumed": inst.lengths is None}
    if law.kind == "lognormal":
        d["cv"] = float(law.cv)
    if law.kind == "empirical":
        d["path"] = law.path
    return d


def _record_fallbacks(ctx: Context, settings: dict) -> None:
    """Where a learned oracle gave way to the twin (``Context.oracle_of``): plan.json says which and why."""
    if ctx.fallbacks:
        settings["oracle_fallback"] = {"from": sorted(ctx.fallbacks), "to": "twin",
                                       "reason": "; ".join(dict.fromkeys(ctx.fallbacks.values()))}
        settings["oracle"] = "twin"


def verify_plan(plan: Plan, adapters: Instance | Workload, profile: Profile, config: PlaceConfig | None = None,
                verify_oracle: Oracle | None = None) -> list[Verdict]:
    """Any method's plan judged by ``place()``'s verification with the same settings (``config``'s seeds,
    objective, arrival law, rates x (1 + headroom)): a baseline's plan, say, compared with a proposed plan on
    equal terms. One verdict per GPU of the plan (its adapters at their routing weights, its ``--max-loras``);
    ``verify_oracle`` replaces the twin (toy oracles in tests, evaluate's shared verifier)."""
    config = config if config is not None else PlaceConfig()
    inst = adapters if isinstance(adapters, Instance) else instance_from_workload(
        adapters, headroom=config.headroom, mean_input_tokens=config.mean_input_tokens,
        mean_output_tokens=config.mean_output_tokens, profile=profile)
    entry = {a: i for i, a in enumerate(inst.adapter_ids)}
    fills = []
    for g in plan.gpus:
        missing = [a for a in g.adapters if a not in entry]
        if missing:
            raise SpecError(f"plan GPU hosts adapter '{missing[0]}' that the workload does not have")
        f = GpuFill(entries=[entry[a] for a in g.adapters], max_loras=int(g.max_loras))
        shares = [float(w) / float(inst.weights[entry[a]]) for a, w in zip(g.adapters, g.weights, strict=True)]
        if any(abs(x - 1.0) > 1e-12 for x in shares):
            f.extra["shares"] = shares
        fills.append(f)
    ctx = Context.of(profile, config, OracleOverrides(verify_oracle=verify_oracle), config.verify_law(adapters))
    return verify_fills(inst, profile, fills, config.objective, ctx.verifier(config.verify_seeds))


def _law(arrivals: CandidateArrivals | None) -> dict:
    """The verifier's arrival law as the plan records it (a long rate profile summarised)."""
    if arrivals is None:
        return {"kind": "poisson"}
    d = arrivals.model_dump()
    if arrivals.kind == "modulated":
        m = d.pop("multipliers")
        d.update(periods=len(m), mean_multiplier=float(np.mean(m)), max_multiplier=float(np.max(m)))
    return d


def method_lower_bound(method: Method, bound: LowerBound, hard_n_max: bool) -> int:
    """The bound a method's plan is held to: with the N_max row only where the method keeps that cap (the greedy
    methods with a hard ``n_max``; with the soft default the twin-verified consolidation may go beyond it, and
    the pool methods never keep it)."""
    return bound.gpus if method.greedy and hard_n_max else bound.gpus_no_nmax


def _consolidation_candidates(inst: Instance, ctx: Context, gpus: int, options: GreedyOptions
                              ) -> Iterator[tuple[str, list[GpuFill]]]:
    """Plans on ``gpus`` GPUs that the search twin (one seed, early termination) accepts, cheapest first: the
    balanced and round-robin dealings with each GPU's ``A`` chosen by the TEST (as ``rebalance``), then what the
    LoRAServe and dLoRA baselines would deploy on that pool (their fractional replicas / all adapters resident)."""
    if -(-inst.n // gpus) <= options.n_max:
        hosts_by = (("balanced", deal_balanced(inst.rates_rps, gpus)), ("round-robin", deal_round_robin(inst.n, gpus)))
        for name, hosts in hosts_by:
            fills = fit_slots_lazy(inst, ctx.profile, ctx.twin(), ctx.objective, hosts, options)
            if fills is not None:
                yield name, fills
    for name in ("loraserve", "dlora"):
        a = assign(name, inst, ctx, gpus)
        if a.accepted and max(len(f.entries) for f in a.gpus) <= options.n_max and \
                gpus_pass(inst, ctx, a, ctx.twin()):
            yield name, a.gpus


def _plan_key(fills: list[GpuFill]) -> frozenset:
    """A plan up to the order of its GPUs. The adapters' order on a GPU stays in the key: it is the registration
    order (which adapters start resident) and the order of the verifier's random streams, so two dealings of
    the same adapters onto one GPU are two plans, each deployable, each verified on its own."""
    return frozenset((tuple(zip(f.entries, [round(x, 9) for x in shares_of(f)], strict=True)), f.max_loras)
                     for f in fills)


def _verify_until_failure(inst: Instance, ctx: Context, fills: list[GpuFill], verifier: Oracle
                          ) -> list[Verdict] | None:
    """``verify_fills`` for a consolidation candidate, or None as soon as one GPU fails: one failing GPU rejects
    the candidate, so the others are not simulated. GPUs go heaviest first (the likeliest to fail), ``workers``
    at a time; every GPU's seeds are its own, so the verdicts of a passing candidate equal ``verify_fills``'s."""
    load = [float(fill_candidate(inst, ctx.profile, f).rates_rps.sum()) for f in fills]  # req/s, shares applied
    order = sorted(range(len(fills)), key=lambda i: -load[i])
    chunk = max(1, ctx.workers)
    verdicts: dict[int, Verdict] = {}
    for k in range(0, len(order), chunk):
        part = order[k:k + chunk]
        for i, v in zip(part, verify_fills(inst, ctx.profile, [fills[i] for i in part], ctx.objective, verifier),
                        strict=True):
            if not v.passed:
                return None
            verdicts[i] = v
    return [verdicts[i] for i in range(len(fills))]


def _consolidate(inst: Instance, ctx: Context, fills: list[GpuFill], verdicts: list[Verdict], verifier: Oracle,
                 floor: int, n_max: int) -> tuple[list[GpuFill], list[Verdict], dict]:
    """After a greedy plan passed verification: plans on fewer GPUs (one less at a time, never below ``floor``),
    each candidate screened by the search twin and kept only if it passes the same verification. The greedy
    commits GPU by GPU on its oracle's word and repair adds a GPU where verification disagrees; a different
    arrangement of the same adapters on fewer GPUs -- balanced, or a baseline's -- may pass where the greedy's
    did not, and a plan then never needs more GPUs than one a baseline would deploy and our verifier accepts.
    ``n_max``: the most adapters a candidate may put on one GPU."""
    info: dict = {"gpus_before": len(fills), "gpus_after": len(fills), "accepted": False, "tried": []}
    options = replace(ctx.options, n_max=n_max)
    seen: set = set()
    while len(fills) > max(1, floor):
        g = len(fills) - 1
        ctx.say(f"trying to consolidate onto {g} GPU{'s' if g != 1 else ''} (verified by the twin)")
        found = None
        for origin, cand in _consolidation_candidates(inst, ctx, g, options):
            cand = _normalise(inst, cand)
            key = _plan_key(cand)
            if key in seen:  # e.g. dLoRA's and the round-robin dealing of the adapters in input order, all resident
                continue
            seen.add(key)
            fresh = _verify_until_failure(inst, ctx, cand, verifier)
            info["tried"].append({"gpus": g, "origin": origin, "passed": fresh is not None})
            if fresh is not None:
                found = (cand, fresh, origin)
                break
        if found is None:
            break
        fills, verdicts, info["origin"] = found
        info.update(gpus_after=len(fills), accepted=True)
    if info["accepted"]:
        info["beyond_n_max"] = [i for i, f in enumerate(fills) if len(f.entries) > N_MAX]
    return fills, verdicts, info


def _worst_ttft_s(verdicts: list[Verdict]) -> float:
    """The plan's worst GPU: the largest verified mean TTFT (NaN when a GPU completed nothing)."""
    return max(v.prediction.ttft_s for v in verdicts)


def _spread(inst: Instance, ctx: Context, fills: list[GpuFill], verdicts: list[Verdict], verifier: Oracle,
            n_max: int) -> tuple[list[GpuFill], list[Verdict], dict | None]:
    """After a greedy plan passed verification with slack -- its worst GPU's mean TTFT above ``SPREAD_RATIO``
    times its lightest GPU's: the greedy fills GPUs one after another, so the last ones may be light while the
    first wait long -- the same adapters on the same number of GPUs, arranged as the consolidation's candidates
    (balanced dealing first), each verified like the plan; the first one whose worst GPU waits at least
    ``SPREAD_GAIN`` less replaces it. Returns ``info`` None when the plan had no slack to spread."""
    ttft_s = [v.prediction.ttft_s for v in verdicts]
    if len(fills) < 2 or not all(math.isfinite(t) for t in ttft_s) or max(ttft_s) <= SPREAD_RATIO * min(ttft_s):
        return fills, verdicts, None
    worst = max(ttft_s)
    info: dict = {"worst_ttft_s_before": worst, "accepted": False, "tried": []}
    ctx.say(f"spreading the load of {len(fills)} GPUs (the worst waits {worst:.2f} s; verified by the twin)")
    key = _plan_key(fills)
    for origin, cand in _consolidation_candidates(inst, ctx, len(fills), replace(ctx.options, n_max=n_max)):
        cand = _normalise(inst, cand)
        if _plan_key(cand) == key:
            continue
        fresh = _verify_until_failure(inst, ctx, cand, verifier)
        cand_worst = _worst_ttft_s(fresh) if fresh is not None else math.nan
        info["tried"].append({"origin": origin, "passed": fresh is not None, "worst_ttft_s": cand_worst})
        if fresh is not None and cand_worst <= (1.0 - SPREAD_GAIN) * worst:
            info.update(accepted=True, origin=origin, worst_ttft_s_after=cand_worst)
            return cand, fresh, info
    return fills, verdicts, info


def _hot_message(bound: LowerBound, inst: Instance) -> str:
    d: dict[str, float] = {}
    for a, x in zip(inst.adapter_ids, inst.demand_tok_s, strict=True):
        d[a] = d.get(a, 0.0) + float(x)
    names = ", ".join(f"'{a}' ({d[a]:,.0f} tok/s)" for a in bound.hot_adapters[:3])
    more = f" and {len(bound.hot_adapters) - 3} more" if len(bound.hot_adapters) > 3 else ""
    k = max(bound.capacity_tok_s.values())
    return (f"adapter(s) {names}{more} demand more than one GPU can serve (at most {k:,.0f} tok/s); "
            f"split them over several GPUs with --split-hot")


def _infeasible(method: Method, profile: Profile, settings: dict, bound: LowerBound, diagnostics: dict, reason: str,
                hot=(), placement_ms: float = math.nan, verification_ms: float = math.nan) -> Plan:
    return Plan(method=method.name, model=profile.model, gpu_type=profile.gpu, gpus=[], infeasible=True,
                reason=reason,
                lower_bound_gpus=method_lower_bound(method, bound, settings.get("n_max_hard", True)),
                lower_bound=bound.to_dict(), settings=settings,
                diagnostics={**diagnostics, "hot_adapters": list(hot)}, placement_ms=placement_ms,
                verification_ms=verification_ms)


def verification_dict(verifier: Oracle, seeds: int, before: int, fills: list[GpuFill], verdicts: list[Verdict],
                       log: RepairLog, counts_before: tuple[int, int] = (0, 0)) -> dict:
    # a verifier shared by several calls (``twin_verifier``) counts for all of them: this call's share
    sims = getattr(verifier, "n_simulations", None)
    hits = getattr(verifier, "cache_hits", None)
    return {"seeds": list(getattr(verifier, "seeds", ())) or seeds,
            "duration_s": getattr(verifier, "duration_s", VERIFY_DURATION_S),
            "passed": all(v.passed for v in verdicts), "gpus_before": before, "gpus_after": len(fills),
            "gpus_added": log.added_gpus, "repair_rounds": log.rounds, "gpus_cut": log.cut_gpus,
            "moved_adapters": log.moved_entries, "max_loras_lowered": log.max_loras_lowered,
            "max_loras_raised": log.max_loras_raised,
            "events": log.events[:50], "simulations": None if sims is None else sims - counts_before[0],
            "cached_gpus": None if hits is None else hits - counts_before[1]}


def _refused_not_hot(inst: Instance, e: Infeasible, bound: LowerBound, oracle_name: str) -> Infeasible | None:
    """When the oracle refuses an adapter alone whose demand one GPU can serve (at most SPLIT_TARGET x K(S)):
    the error says that the oracle's predictions do not fit the workload (splitting would not help)."""
    if not e.hot:
        return None
    a = e.hot[0]
    idx = [i for i, x in enumerate(inst.adapter_ids) if x == a]
    d = float(inst.demand_tok_s[idx].sum())
    s = default_slot_rank(int(inst.ranks[idx[0]]))
    k = max(v for x, v in bound.capacity_tok_s.items() if x >= s)
    if d > SPLIT_TARGET * k:
        return None
    return Infeasible(f"the {oracle_name} oracle refuses adapter '{a}' even alone on a GPU ({e.binding or 'fails'}) "
                      f"although it asks {d:,.0f} tok/s of the {k:,.0f} one GPU can take: its predictions do not "
                      f"cover this workload under this objective; try --method proposed-exact (the twin as the "
                      f"oracle) or a looser objective", hot=e.hot, binding=e.binding)


def _needed(inst: Instance, ctx: Context, oracle: Oracle, pool: int) -> int:
    """GPUs the greedy needs without a pool cap (for the "needs at least X GPUs" message)."""
    try:
        fills = greedy_fill(inst, ctx.profile, oracle, ctx.objective, options=ctx.options)
    except Infeasible:
        return pool + 1
    fills, _ = rebalance(inst, ctx.profile, oracle, ctx.objective, fills, ctx.options, min_gpus=pool + 1)
    return len(fills)


def _run(m: Method, inst: Instance, ctx: Context, config: PlaceConfig, bound: LowerBound, diagnostics: dict
         ) -> tuple[list[GpuFill], dict, Instance]:
    """The method itself (timed by the caller)."""
    info: dict = {}
    method, gpus, split_hot = m.name, config.gpus, config.split_hot
    if m.greedy:
        assert m.oracle is not None  # a greedy method is its oracle (``registry.Method``)
        oracle = ctx.oracle_of(m.oracle)
        # a learned method's own model is double-checked by the twin where it would give up on an empty GPU
        confirm = ctx.confirmer(oracle)
        origin = "greedy"
        for attempt in range(MAX_SPLIT_ROUNDS + 1):
            stats: dict = {}
            try:
                ctx.say(f"{method}: filling GPUs")
                fills = greedy_fill(inst, ctx.profile, oracle, ctx.objective, pool=gpus, options=ctx.options,
                                    stats=stats, confirm=confirm)
                break
            except Infeasible as e:
                if gpus is not None and e.gpus_needed is not None:
                    # pool exhausted: a balanced plan on the whole pool may still fit
                    found = balanced_plan(inst, ctx.profile, oracle, ctx.objective, gpus, ctx.options)
                    if found is None:
                        need = _needed(inst, ctx, oracle, gpus)
                        raise Infeasible(f"{method} needs at least {need} GPUs, {gpus} given ({e})",
                                         gpus_needed=need) from None
                    fills, origin = found
                    break
                # the guard names the adapter that fails on an empty GPU: with --split-hot, split it further --
                # unless one GPU can serve it by the bound, then the oracle is the problem, not the adapter
                refused = _refused_not_hot(inst, e, bound, getattr(oracle, "name", "method's"))
                if refused is not None:
                    raise refused from None
                if not (split_hot and e.hot and attempt < MAX_SPLIT_ROUNDS):
                    raise
                idx = [i for i, a in enumerate(inst.adapter_ids) if a in set(e.hot)]
                inst = split_entries(inst, {i: 2 for i in idx})
                diagnostics["split_rounds"] = diagnostics.get("split_rounds", 0) + 1
                for a in e.hot:
                    diagnostics.setdefault("split", {})[a] = sum(x == a for x in inst.adapter_ids)
        n_greedy = len(fills)
        if origin == "greedy":
            fills, origin = rebalance(inst, ctx.profile, oracle, ctx.objective, fills, ctx.options,
                                      min_gpus=bound.gpus,
                                      on_try=lambda g: ctx.say(f"{method}: trying a balanced plan on {g} GPUs"))
        info.update(greedy_gpus=n_greedy, plan_origin=origin, oracle_calls=stats.get("oracle_calls"),
                    oracle_rows=stats.get("oracle_rows"), oracle_out_of_range=stats.get("oracle_out_of_range"),
                    lookahead=stats.get("lookahead"), confirmed_gpus=stats.get("confirmed_gpus"),
                    confirm_calls=stats.get("confirm_calls"))
        return fills, info, inst
    if gpus is not None:
        a = assign(method, inst, ctx, gpus)
        if not a.accepted:
            raise Infeasible(f"{method} declares the workload infeasible on {gpus} GPUs: {a.reason}")
        info.update({k: v for k, v in a.extra.items() if k != "validated"})
        return a.gpus, info, inst
    g, a, search = smallest_pool(method, inst, ctx, lo=bound.gpus_no_nmax, validate=True)
    info["search"] = search
    if g is None or a is None:
        raise Infeasible(f"{method} found no pool size that works (tried {len(search['probes'])})")
    info.update({k: v for k, v in a.extra.items() if k != "validated"})
    return a.gpus, info, inst
