"""Twin verification and repair of a plan (issue 9, Deliver 3; placement.md §4.9).

Every GPU of a plan is simulated by the twin for the full hour with several seeds (in worker processes). A GPU
passes when vLLM starts, no seed is starved (run level or any adapter) and every latency limit of the
objective holds in every seed. A failing GPU is repaired: if vLLM refuses to start, ``--max-loras`` drops to
the largest value that starts; if its adapters starved while swapping (binding ``slots``), the largest
``--max-loras`` that starts is tried first (judged by the verifier); then the GPU keeps the longest prefix of its registration order that passes
(bisection) and the rest — its last-added adapters — moves to the least-loaded passing GPU that takes it,
else onto new GPUs filled by the greedy driver with the twin as the oracle. New and changed GPUs are verified
again, until every GPU passes or the pool forbids another GPU. The repair's questions go to the twin at the
search settings (the probe) until the probe passes a GPU the verifier failed; from then on the verifier answers
them (otherwise each round would move one adapter and fail again).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..monotone import first_true
from ..objective import STARVED_PROBABILITY, Objective
from ..oracle import GpuCandidate, Oracle, Prediction, default_slot_rank
from ..profile import Profile
from ..server import ServerConfig
from .greedy import GpuFill, GreedyOptions, Infeasible, MemoryRule, fit_slots, greedy_fill, slot_candidates
from .problem import Instance

MAX_REPAIR_ROUNDS = 8


def fill_candidate(inst: Instance, profile: Profile, f: GpuFill) -> GpuCandidate:
    shares = np.asarray(f.extra.get("shares") or np.ones(len(f.entries)))
    idx = np.asarray(f.entries, dtype=np.int64)
    return GpuCandidate(profile=profile, ranks=inst.ranks[idx], rates_rps=inst.rates_rps[idx] * shares,
                        server=ServerConfig(max_loras=f.max_loras), mean_input_tokens=inst.mean_input_tokens,
                        mean_output_tokens=inst.mean_output_tokens, lengths=inst.lengths)


@dataclass
class Verdict:
    """What the twin measured for one GPU and whether it passes."""

    passed: bool
    reason: str  # "" or the binding constraint of the failure: memory, throughput, slots, latency
    prediction: Prediction
    starved_entries: list[int] = field(default_factory=list)  # instance entries starved in some seed
    detail: str = ""


def judge(objective: Objective, cand: GpuCandidate, entries: list[int], p: Prediction) -> Verdict:
    """Strict, per seed: any starved seed, any starved adapter or any seed over a latency limit fails."""
    if not p.fits:
        return Verdict(False, "memory", p, detail=f"vLLM does not start ({p.error_type})")
    runs = p.extra.get("runs") or []
    starved = sorted({entries[i] for r in runs for i in (r.get("starved_adapter_indices") or [])})
    if any(bool(r.get("starved")) for r in runs) or p.starved >= STARVED_PROBABILITY:
        n = sum(bool(r.get("starved")) for r in runs)
        return Verdict(False, _starved_why(cand), p, starved, f"starved in {n} of {len(runs)} seeds")
    if starved or p.adapter_starved > 0:
        return Verdict(False, _starved_why(cand), p, starved, f"{len(starved)} adapter(s) starved")
    for r in runs or [None]:
        vals = (p.ttft_s, p.itl_ms, p.ttft_p99_s, p.itl_p99_ms) if r is None else (
            _f(r.get("ttft_mean_ms")) / 1e3, _f(r.get("itl_mean_ms")), _f(r.get("ttft_p99_ms")) / 1e3,
            _f(r.get("itl_p99_ms")))
        bad = objective.latency_violations(*vals)
        if bad:
            return Verdict(False, "latency", p, starved, f"{bad[0]} exceeded")
    return Verdict(True, "", p, starved)


def _starved_why(cand: GpuCandidate) -> str:
    """Starved with every adapter resident: throughput; with fewer slots than adapters: slots, or memory when
    vLLM would not start with enough slots for all of them."""
    if cand.max_loras >= cand.n_adapters:
        return "throughput"
    return "memory" if not cand.profile.startup(cand.n_adapters, cand.slot_rank)[0] else "slots"


def _f(x) -> float:
    return float(x) if x is not None else math.nan


@dataclass
class RepairLog:
    rounds: int = 0
    cut_gpus: int = 0  # GPUs that gave adapters away
    moved_entries: int = 0
    added_gpus: int = 0
    max_loras_lowered: int = 0
    max_loras_raised: int = 0  # GPUs whose adapters starved while swapping, fixed by more slots
    events: list[str] = field(default_factory=list)


def verify_fills(inst: Instance, profile: Profile, fills: list[GpuFill], objective: Objective,
                 verifier: Oracle) -> list[Verdict]:
    cands = [fill_candidate(inst, profile, f) for f in fills]
    preds = verifier.predict(cands)
    return [judge(objective, c, f.entries, p) for c, f, p in zip(cands, fills, preds, strict=True)]


def _with(f: GpuFill, entries: list[int], shares: list[float], max_loras: int) -> GpuFill:
    g = GpuFill(entries=list(entries), max_loras=max(1, min(max_loras, len(entries))), binding=f.binding,
                extra={k: v for k, v in f.extra.items() if k != "shares"})
    if any(s != 1.0 for s in shares):
        g.extra["shares"] = list(shares)
    return g


@dataclass(frozen=True)
class Judges:
    """Who judges a plan under repair: ``verifier`` (verification's own runs: its verdicts stand) and ``probe``
    (a cheaper twin answering the repair's own questions -- prefix bisection, new GPUs -- until it passes a GPU
    the verifier failed; the verifier answers from then on)."""

    verifier: Oracle
    probe: Oracle


def repair(inst: Instance, profile: Profile, fills: list[GpuFill], objective: Objective, judges: Judges, *,
           pool: int | None = None, options: GreedyOptions = GreedyOptions(),
           on_round: Callable[[int, int], None] | None = None) -> tuple[list[GpuFill], list[Verdict], RepairLog]:
    """Verify ``fills`` with ``judges.verifier`` and repair failing GPUs (see the module docstring). Raises
    ``Infeasible`` (with ``gpus_needed``) when the plan needs more GPUs than ``pool``."""
    verifier, probe = judges.verifier, judges.probe
    log = RepairLog()
    mem = MemoryRule(profile)
    fills = list(fills)
    verdicts = verify_fills(inst, profile, fills, objective, verifier)
    failed: set[int] = set()  # GPUs that failed verification once: never hosts of moved adapters (no ping-pong)
    while not all(v.passed for v in verdicts):
        failed |= {i for i, v in enumerate(verdicts) if not v.passed}
        if log.rounds >= MAX_REPAIR_ROUNDS:
            bad = [i for i, v in enumerate(verdicts) if not v.passed]
            raise Infeasible(f"verification could not repair GPU(s) {', '.join(map(str, bad))} in "
                             f"{MAX_REPAIR_ROUNDS} rounds ({verdicts[bad[0]].detail})")
        log.rounds += 1
        if on_round is not None:
            on_round(log.rounds, sum(not v.passed for v in verdicts))
        moved: list[tuple[int, float]] = []
        changed: set[int] = set()
        for gi, (f, v) in enumerate(zip(fills, verdicts, strict=True)):
            if v.passed:
                continue
            shares = list(f.extra.get("shares") or [1.0] * len(f.entries))
            s = default_slot_rank(int(inst.ranks[f.entries].max()))
            a = f.max_loras
            if not mem.ok(a, s):
                a = max(1, min(a, mem.max_slots(s)))
                log.max_loras_lowered += 1
                log.events.append(f"GPU {gi}: --max-loras {f.max_loras} does not start; lowered to {a}")
            elif v.reason == "slots":
                # adapters starved while swapping in and out: more slots (all resident if vLLM starts so) may be
                # the whole fix; the verifier judges it, since per-adapter starvation is what failed
                up = [x for x in slot_candidates(len(f.entries), s, mem, options.slot_grid) if x > a]
                if up and _passes(inst, profile, f, shares, len(f.entries), up[-1], objective, verifier):
                    fills[gi] = _with(f, f.entries, shares, up[-1])
                    fills[gi].binding = f.binding
                    log.max_loras_raised += 1
                    log.events.append(f"GPU {gi}: --max-loras {a} -> {up[-1]} ({v.detail} while swapping)")
                    changed.add(gi)
                    continue
            if probe is not verifier and a == f.max_loras and \
                    _passes(inst, profile, f, shares, len(f.entries), a, objective, probe):
                # the probe passes a GPU the verifier failed (a per-adapter starvation its shorter window does
                # not see, a seed it did not run): it cannot guide this repair; the verifier answers from here on
                probe = verifier
                log.events.append(f"GPU {gi}: the probe passes what verification failed; the verifier answers "
                                  f"the repair's questions from here on")
            keep = _longest_passing_prefix(inst, profile, f, shares, a, objective, probe)
            if keep == 0:
                first = inst.adapter_ids[f.entries[0]]
                raise Infeasible(f"adapter '{first}' fails alone on a GPU ({v.detail}); split it over several "
                                 f"GPUs with --split-hot", hot=[first])
            moved.extend(zip(f.entries[keep:], shares[keep:], strict=True))
            if keep < len(f.entries):
                log.cut_gpus += 1
                log.events.append(f"GPU {gi}: kept {keep} of {len(f.entries)} adapters ({v.reason}: {v.detail})")
            fills[gi] = _with(f, f.entries[:keep], shares[:keep], a)
            fills[gi].binding = v.reason or f.binding
            changed.add(gi)
        log.moved_entries += len(moved)
        if moved:
            fills, new = _rehome(inst, profile, fills, verdicts, changed, moved, objective, probe, pool, options,
                                 exclude=failed)
            log.added_gpus += new
            changed |= set(range(len(fills) - new, len(fills)))
        # verify the changed and new GPUs, keep the others' verdicts
        idx = sorted(changed)
        fresh = verify_fills(inst, profile, [fills[i] for i in idx], objective, verifier)
        verdicts = [verdicts[i] if i < len(verdicts) else None for i in range(len(fills))]  # type: ignore[misc]
        for i, v in zip(idx, fresh, strict=True):
            verdicts[i] = v
    return fills, verdicts, log


def _passes(inst: Instance, profile: Profile, f: GpuFill, shares: list[float], p: int, a: int,
            objective: Objective, oracle: Oracle) -> bool:
    """Whether the first ``p`` entries of ``f`` with ``--max-loras a`` pass ``oracle``."""
    g = _with(f, f.entries[:p], shares[:p], a)
    c = fill_candidate(inst, profile, g)
    return judge(objective, c, g.entries, oracle.predict([c])[0]).passed


def _longest_passing_prefix(inst: Instance, profile: Profile, f: GpuFill, shares: list[float], a: int,
                            objective: Objective, probe: Oracle) -> int:
    """Largest p such that the first p entries pass ``probe`` (bisection; p = 0 if even one fails)."""
    def ok(p: int) -> bool:
        return _passes(inst, profile, f, shares, p, a, objective, probe)

    lo, hi = 0, len(f.entries)  # ok(lo) assumed (empty), ok(hi) known to fail with the old --max-loras
    if a != f.max_loras and ok(hi):  # a lower --max-loras was the whole fix
        return hi
    if hi > 1 and ok(hi - 1):  # the common case: one adapter too many (cheap first probe)
        return hi - 1
    return first_true(lambda p: not ok(p), lo, hi - 1) - 1  # the first prefix that fails, minus one


def _rehome(inst: Instance, profile: Profile, fills: list[GpuFill], verdicts: list[Verdict], changed: set[int],
            moved: list[tuple[int, float]], objective: Objective, probe: Oracle, pool: int | None,
            options: GreedyOptions, exclude: set[int] | frozenset[int] = frozenset()) -> tuple[list[GpuFill], int]:
    """Put moved entries on a passing GPU that takes them all (least loaded first; every passing GPU when the
    pool is full, else only the least loaded; never one in ``changed`` or ``exclude``), else on new GPUs from the
    greedy driver. ``changed`` gets the host."""
    load = [float((inst.rates_rps[f.entries] * np.asarray(f.extra.get("shares") or np.ones(len(f.entries)))).sum())
            for f in fills]
    hosts = sorted((i for i, v in enumerate(verdicts) if v.passed and i not in changed and i not in exclude),
                   key=lambda i: (load[i], i))
    full = pool is not None and len(fills) >= pool
    for gi in hosts if full else hosts[:1]:
        f = fills[gi]
        shares = list(f.extra.get("shares") or [1.0] * len(f.entries))
        entries = f.entries + [e for e, _ in moved]
        if len(set(entries)) > options.n_max and not inst.is_split:
            continue
        merged = _with(f, entries, shares + [s for _, s in moved], f.max_loras)
        fit = fit_slots(_share_instance(inst, merged), profile, probe, objective, [list(range(len(entries)))],
                        options, top=2)
        if fit is not None:
            merged.max_loras = fit[0].max_loras
            fills[gi] = merged
            changed.add(gi)
            return fills, 0
    sub = inst.subset([e for e, _ in moved])
    sub = _scaled(sub, [s for _, s in moved])
    room = None if pool is None else pool - len(fills)
    try:
        new = greedy_fill(sub, profile, probe, objective, pool=room, options=options)
    except Infeasible as e:
        if e.gpus_needed is not None and pool is not None:
            need = len(fills) + _count_needed(sub, profile, probe, objective, options)
            raise Infeasible(f"verification: the plan needs at least {need} GPUs, {pool} given (repair moved "
                             f"{len(moved)} adapter(s) off failing GPUs)", gpus_needed=need) from None
        raise
    ids = [e for e, _ in moved]
    sh = [s for _, s in moved]
    for g in new:
        g2 = _with(g, [ids[j] for j in g.entries], [sh[j] for j in g.entries], g.max_loras)
        g2.binding = g.binding
        fills.append(g2)
    return fills, len(new)


def _count_needed(sub: Instance, profile: Profile, probe: Oracle, objective: Objective, options: GreedyOptions) -> int:
    try:
        return len(greedy_fill(sub, profile, probe, objective, options=options))
    except Infeasible:
        return 1


def _scaled(inst: Instance, shares: list[float]) -> Instance:
    from dataclasses import replace

    s = np.asarray(shares, dtype=np.float64)
    return replace(inst, rates_rps=inst.rates_rps * s, weights=inst.weights * s)


def _share_instance(inst: Instance, f: GpuFill) -> Instance:
    return _scaled(inst.subset(f.entries), list(f.extra.get("shares") or [1.0] * len(f.entries)))
