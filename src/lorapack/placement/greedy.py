"""The greedy driver of ``proposed``, ``proposed-fast`` and ``proposed-exact`` (placement.md §4.1-4.2, §4.9).

One loop over the oracle seam; the methods differ only in the oracle they pass. Adapters are ordered by rank
group (descending) and, within a group, zig-zag by rate; GPUs are filled one after the other; at each testing
point the oracle is asked about the GPU's adapters with ``--max-loras`` kept or moved one step up the slot
grid; a GPU that fails a test gives its pending adapters back and is closed.

Two ways to ask the oracle, same decisions:

* *lazy* (the twin): one batch per test (the two ``--max-loras`` candidates);
* *lookahead* (cheap learned oracles): one batch per GPU with every (testing point, slot value) pair the walk
  could reach from where the GPU starts, then the walk reads its answers. A few dozen rows per call instead of
  a call per test: the per-call overhead of a model (a forest's predict) dominates its per-row cost.

lorapack deviations from the published code (placement.md §4.1, defaults): padding to exactly the testing
point; testing points stop at ``n_max``; memory limits from the start-up rule; ``A`` clipped to the GPU's
adapter count in the plan; a test passes when *some* candidate meets the objective (the highest throughput
among those, ties within ``tie_tolerance`` -> larger ``A``), where the paper takes the highest-throughput
candidate and then checks it. After the greedy, the plan competes with balanced plans on fewer GPUs
(``rebalance``): round-robin and largest-rate-first dealing, each GPU's ``A`` chosen by the same selection,
so the greedy never needs more GPUs than a balanced plan its oracle accepts.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..errors import LorapackError
from ..monotone import first_true
from ..objective import STARVATION_RATIO, Objective
from ..oracle import GpuCandidate, Oracle, Prediction, TwinOracle, default_slot_rank
from ..profile import Profile
from .problem import Instance

TESTING_POINTS: tuple[int, ...] = (8, 16, 32, 64, 96, 128, 160, 192, 256, 320, 384)
SLOT_GRID: tuple[int, ...] = TESTING_POINTS
N_MAX = 384  # validated adapters per GPU (placement.md §1)
BALANCED_CHUNK = 8  # GPUs per oracle batch when a balanced plan is checked with a cheap oracle

# severity order of the reasons a candidate fails: the GPU's binding constraint is the mildest one among its
# candidates (a GPU that fails on latency with one A and on memory with the other is latency-bound)
_SEVERITY = ("latency", "slots", "throughput", "memory")


class Infeasible(LorapackError):
    """The method cannot place this workload (pool exhausted, an adapter no GPU can serve, ...)."""

    def __init__(self, message: str, *, gpus_needed: int | None = None, hot: Sequence[str] = (),
                 binding: str = "") -> None:
        super().__init__(message)
        self.gpus_needed = gpus_needed
        self.hot = tuple(hot)  # adapters that fail alone on an empty GPU
        self.binding = binding


@dataclass(frozen=True)
class GreedyOptions:
    testing_points: tuple[int, ...] = TESTING_POINTS
    slot_grid: tuple[int, ...] = SLOT_GRID
    n_max: int = N_MAX
    clip_amax: bool = True  # plan A = min(A, adapters on the GPU)
    require_throughput: bool = False  # also reject when predicted throughput < 0.9 x offered
    # throughputs within 2 % of the offered load are a tie (-> lower latency, then the larger A): a GPU that
    # serves its load differs between candidates only by the tokens in flight when the window ends
    tie_tolerance: float = 0.02
    latency_tolerance: float = 0.1  # latency uses within 10 % are a tie (-> the larger A)
    lookahead: bool | None = None  # None: decided by the oracle (cheap oracles look ahead)
    rebalance: bool = True  # compare with balanced plans on fewer GPUs
    # a GPU that fails its first testing point with nothing committed tries these smaller counts (all resident)
    # before the guard declares the instance infeasible: hot adapters then share a GPU with fewer others
    sub_points: tuple[int, ...] = (4, 2, 1)

    def points(self) -> tuple[int, ...]:
        return tuple(t for t in self.testing_points if t <= self.n_max)


@dataclass
class GpuFill:
    """One GPU of a method's result: entries (indices into the instance, registration order), ``A``, the
    oracle's answer for it, and the constraint that stopped it from taking more."""

    entries: list[int]
    max_loras: int
    prediction: Prediction | None = None
    binding: str = "none"
    extra: dict = field(default_factory=dict)


def is_cheap(oracle: Oracle) -> bool:
    """Whether the oracle answers in microseconds (look ahead) or simulates (ask lazily)."""
    return bool(getattr(oracle, "cheap", not isinstance(oracle, TwinOracle)))


def zigzag_order(ranks: np.ndarray, rates_rps: np.ndarray, ids: Sequence[str]) -> np.ndarray:
    """Rank groups in descending rank; within a group ascending by (rate, id), then alternately the largest
    and the smallest remaining: rates [1, 2, 3, 4, 5] -> 5, 1, 4, 2, 3."""
    out: list[int] = []
    for r in sorted(set(int(x) for x in ranks), reverse=True):
        grp = sorted(np.flatnonzero(ranks == r).tolist(), key=lambda i: (rates_rps[i], ids[i], i))
        lo, hi = 0, len(grp) - 1
        take_hi = True
        while lo <= hi:
            if take_hi:
                out.append(grp[hi])
                hi -= 1
            else:
                out.append(grp[lo])
                lo += 1
            take_hi = not take_hi
    return np.asarray(out, dtype=np.int64)


class MemoryRule:
    """vLLM's start-up rule for ``(A, S)``, memoised for one placement."""

    def __init__(self, profile: Profile) -> None:
        self.profile = profile
        self._cache: dict[tuple[int, int], bool] = {}
        self._max: dict[int, int] = {}

    def ok(self, max_loras: int, slot_rank: int) -> bool:
        key = (int(max_loras), int(slot_rank))
        v = self._cache.get(key)
        if v is None:
            v = self._cache[key] = bool(self.profile.startup(*key)[0])
        return v

    def max_slots(self, slot_rank: int) -> int:
        if slot_rank not in self._max:
            self._max[slot_rank] = self.profile.max_slots(slot_rank)
        return self._max[slot_rank]


def choose(cands: Sequence[int], preds: Sequence[Prediction], objective: Objective, n_test: int,
           options: GreedyOptions) -> tuple[int | None, Prediction | None, str]:
    """The TEST's decision among ``--max-loras`` candidates: ``(A, prediction, "")`` for the feasible one with
    the highest throughput (ties: the lower latency use, then the larger A), else ``(None, None, binding)``."""
    ok: list[tuple[int, Prediction]] = []
    reasons: list[str] = []
    for c, p in zip(cands, preds, strict=True):
        why = objective.check(p)
        if why is None and options.require_throughput and p.throughput_tok_s < STARVATION_RATIO * p.incoming_tok_s:
            why = "throughput"
        if why is None:
            ok.append((c, p))
        else:
            # starved / slow while fewer slots than adapters: the slots bind (adapters swap in and out)
            reasons.append("slots" if why == "throughput" and c < n_test else why)
    if not ok:
        if not reasons:
            return None, None, "memory"
        return None, None, min(reasons, key=_SEVERITY.index)
    thr = [p.throughput_tok_s for _, p in ok]
    finite = [t for t in thr if math.isfinite(t)]
    top = max(finite) if finite else math.nan
    offered = max((p.incoming_tok_s for _, p in ok if math.isfinite(p.incoming_tok_s)), default=math.nan)
    scale = offered if math.isfinite(offered) and offered > 0 else top
    near = [(c, p) for (c, p), t in zip(ok, thr, strict=True)
            if not math.isfinite(t) or not math.isfinite(top) or t >= top - options.tie_tolerance * scale]
    # among throughput ties: the one furthest from the latency limits (when the objective sets any and the
    # oracle predicts them; within latency_tolerance it is a tie too), then the larger A (the paper's rule)
    use = [objective.latency_use(p) for _, p in near]
    low = min((u for u in use if math.isfinite(u)), default=math.nan)
    best = max(((c, p) for (c, p), u in zip(near, use, strict=True)
                if not math.isfinite(low) or not math.isfinite(u) or u <= low * (1.0 + options.latency_tolerance)),
               key=lambda cp: cp[0])
    return best[0], best[1], ""


class _Walker:
    """Fills GPUs from a work list with the TEST of placement.md §4.1."""

    def __init__(self, inst: Instance, profile: Profile, oracle: Oracle, objective: Objective,
                 options: GreedyOptions, order: np.ndarray) -> None:
        self.inst, self.profile, self.oracle, self.objective, self.opt = inst, profile, oracle, objective, options
        self.order = order
        self.mem = MemoryRule(profile)
        self.tps = options.points()
        self.grid = options.slot_grid
        self.lookahead = is_cheap(oracle) if options.lookahead is None else options.lookahead
        self.calls = 0
        self.rows = 0
        self.out_of_range = 0  # answers a learned oracle gave outside its training data

    def _arrays(self, start: int, n_real: int, n_test: int) -> tuple[np.ndarray, np.ndarray]:
        idx = self.order[start:start + n_real]
        rk, rt = self.inst.ranks[idx], self.inst.rates_rps[idx]
        if n_real < n_test:  # padding: mean rate, minimum rank (never raises S)
            pad = n_test - n_real
            rk = np.concatenate([rk, np.full(pad, rk.min())])
            rt = np.concatenate([rt, np.full(pad, rt.mean())])
        return rk, rt

    def _cand(self, rk: np.ndarray, rt: np.ndarray, a: int) -> GpuCandidate:
        # the instance was validated once; slices and padding of it need no re-check
        return GpuCandidate.prevalidated(self.profile, rk, rt, a, self.inst.mean_input_tokens,
                                         self.inst.mean_output_tokens, self.inst.lengths)

    def _predict(self, cands: list[GpuCandidate]) -> list[Prediction]:
        if not cands:
            return []
        self.calls += 1
        self.rows += len(cands)
        preds = self.oracle.predict(cands)
        self.out_of_range += sum(not p.in_range for p in preds)
        return preds

    def fill(self, start: int) -> GpuFill:
        """Fill one GPU from work position ``start``; returns its committed entries (possibly none)."""
        n_left = len(self.order) - start
        plan: list[tuple[int, int]] = []  # (n_real, n_test) per testing point the walk may reach
        for t in self.tps:
            plan.append((min(t, n_left), t))
            if t >= n_left:
                break
        slot_s = [default_slot_rank(int(self.inst.ranks[self.order[start:start + nr]].max())) for nr, _ in plan]
        answers: dict[tuple[int, int], Prediction] = {}
        if self.lookahead:
            keys, cands = [], []
            for k, (nr, nt) in enumerate(plan):
                rk = rt = None
                for a in self.grid[:k + 1]:
                    if a > nt or not self.mem.ok(a, slot_s[k]):
                        continue
                    if rk is None:
                        rk, rt = self._arrays(start, nr, nt)
                    keys.append((k, a))
                    cands.append(self._cand(rk, rt, a))
            answers = dict(zip(keys, self._predict(cands), strict=True))

        a_cur, g_idx, committed, last = 0, 0, 0, None
        for k, (nr, nt) in enumerate(plan):
            cands = ([a_cur] if a_cur > 0 else []) + ([self.grid[g_idx]] if g_idx < len(self.grid) else [])
            cands = [a for a in cands if self.mem.ok(a, slot_s[k])]
            if not self.lookahead and cands:
                rk, rt = self._arrays(start, nr, nt)
                for a, p in zip(cands, self._predict([self._cand(rk, rt, a) for a in cands]), strict=True):
                    answers[(k, a)] = p
            a_best, pred, why = choose(cands, [answers[(k, a)] for a in cands], self.objective, nt, self.opt)
            if why == "slots" and self.mem.max_slots(slot_s[k]) < nt:
                why = "memory"  # more slots would help, but vLLM would not start with them
            if a_best is None and k == 0:
                sub = self._sub_point(start, nr, nt, why)
                if sub is not None:
                    return sub
            if a_best is None:
                return GpuFill(entries=self.order[start:start + committed].tolist(), max_loras=a_cur,
                               prediction=last, binding=why, extra={"failed_at": nt})
            committed, last = nr, pred
            if g_idx < len(self.grid) and a_best == self.grid[g_idx]:
                g_idx += 1
            a_cur = a_best
            if nr < nt or nr == n_left:  # padded final test passed, or every adapter placed
                return GpuFill(entries=self.order[start:start + nr].tolist(), max_loras=a_cur, prediction=pred,
                               binding="none", extra={"tested_at": nt})
        return GpuFill(entries=self.order[start:start + committed].tolist(), max_loras=a_cur, prediction=last,
                       binding="adapters", extra={"tested_at": plan[-1][1]})


    def _sub_point(self, start: int, n_real: int, n_test: int, why: str) -> GpuFill | None:
        """After a failed first test (``n_real`` adapters, padded to ``n_test``): the largest of ``sub_points``
        below the testing point that passes with that many real adapters, unpadded and all resident."""
        for t in self.opt.sub_points:
            if t > n_real or t >= n_test:
                continue
            idx = self.order[start:start + t]
            s = default_slot_rank(int(self.inst.ranks[idx].max()))
            if not self.mem.ok(t, s):
                continue
            rk, rt = self._arrays(start, t, t)
            a, pred, _ = choose([t], self._predict([self._cand(rk, rt, t)]), self.objective, t, self.opt)
            if a is not None:
                return GpuFill(entries=idx.tolist(), max_loras=t, prediction=pred, binding=why,
                               extra={"tested_at": t, "sub_point": True})
        return None


def greedy_fill(inst: Instance, profile: Profile, oracle: Oracle, objective: Objective, *,
                pool: int | None = None, options: GreedyOptions = GreedyOptions(), stats: dict | None = None,
                confirm: Oracle | None = None) -> list[GpuFill]:
    """The paper's main loop (placement.md §4.1): GPUs in sequence until every entry is committed.

    ``confirm`` (the twin, for learned oracles): a GPU on which ``oracle`` commits nothing is filled again with
    ``confirm`` before the guard gives up -- a model that is wrong about a light adapter alone on a GPU (outside
    its data) must not make a workload infeasible. Raises ``Infeasible`` when the pool is exhausted or when a
    GPU fails with nothing committed (the guard: the same first adapters would fail on every new GPU)."""
    order = zigzag_order(inst.ranks, inst.rates_rps, inst.adapter_ids)
    w = _Walker(inst, profile, oracle, objective, options, order)
    wc: _Walker | None = None
    gpus: list[GpuFill] = []
    pos = 0
    while pos < len(order):
        if pool is not None and len(gpus) >= pool:
            raise Infeasible(f"the pool of {pool} GPU{'s' if pool != 1 else ''} is exhausted with "
                             f"{len(order) - pos} of {len(order)} adapters unplaced", gpus_needed=pool + 1)
        g = w.fill(pos)
        if not g.entries and confirm is not None:
            wc = wc or _Walker(inst, profile, confirm, objective, options, order)
            g = wc.fill(pos)
            g.extra["filled_by"] = getattr(confirm, "name", "confirm")
        if not g.entries:
            first = inst.adapter_ids[int(order[pos])]
            raise Infeasible(f"adapter '{first}' (rank {int(inst.ranks[order[pos]])}, "
                             f"{inst.rates_rps[order[pos]]:.3g} req/s) fails alone on an empty GPU under the objective "
                             f"({g.binding}); split it over several GPUs with --split-hot", hot=[first],
                             binding=g.binding)
        if options.clip_amax:
            g.max_loras = min(g.max_loras, len(g.entries))
        gpus.append(g)
        pos += len(g.entries)
    if stats is not None:
        stats.update(oracle_calls=w.calls, oracle_rows=w.rows, oracle_out_of_range=w.out_of_range,
                     lookahead=w.lookahead, confirmed_gpus=sum("filled_by" in g.extra for g in gpus),
                     confirm_calls=wc.calls if wc is not None else 0)
    return gpus


# ---------------------------------------------------------------------------------------------------------
# balanced plans on a given number of GPUs (round-robin and largest-rate-first dealing)


def deal_round_robin(n: int, gpus: int) -> list[list[int]]:
    """Entries dealt evenly in input order: entry i -> GPU i mod G."""
    return [list(range(g, n, gpus)) for g in range(gpus)]


def deal_balanced(rates_rps: np.ndarray, gpus: int) -> list[list[int]]:
    """Largest rate first onto the least-loaded GPU among those holding fewer than ceil(n/G) entries (ties:
    lowest index): balances both the load and the adapter count."""
    import heapq

    n = len(rates_rps)
    cap = -(-n // gpus)
    hosts: list[list[int]] = [[] for _ in range(gpus)]
    heap = [(0.0, g) for g in range(gpus)]  # (load, index) of the GPUs with room
    for i in np.argsort(-np.asarray(rates_rps), kind="stable").tolist():
        load, g = heapq.heappop(heap)
        hosts[g].append(i)
        if len(hosts[g]) < cap:
            heapq.heappush(heap, (load + float(rates_rps[i]), g))
    return hosts


def slot_candidates(n_adapters: int, slot_rank: int, mem: MemoryRule, grid: Sequence[int] = SLOT_GRID,
                    top: int | None = None) -> list[int]:
    """``--max-loras`` values worth trying for a GPU of ``n_adapters``: grid values below it and ``n`` itself
    (every adapter resident), those that start; ``top`` keeps only the largest few."""
    vals = sorted({a for a in grid if a < n_adapters} | {n_adapters})
    vals = [a for a in vals if mem.ok(a, slot_rank)]
    if not vals:
        lim = mem.max_slots(slot_rank)
        vals = [lim] if lim >= 1 else []
    return vals[-top:] if top else vals


def fit_slots(inst: Instance, profile: Profile, oracle: Oracle, objective: Objective,
              hosts: list[list[int]], options: GreedyOptions = GreedyOptions(),
              mem: MemoryRule | None = None, top: int | None = None) -> list[GpuFill] | None:
    """Give each GPU of an assignment its best ``A`` (the TEST's selection among ``slot_candidates``); ``None``
    if one of its GPUs meets the objective with none of them. One oracle batch."""
    mem = mem or MemoryRule(profile)
    keys, cands = [], []
    for g, idx in enumerate(hosts):
        if not idx:
            continue
        ix = np.asarray(idx, dtype=np.int64)
        rk, rt = inst.ranks[ix], inst.rates_rps[ix]  # sliced once for every A
        s = default_slot_rank(int(rk.max()))
        for a in slot_candidates(len(idx), s, mem, options.slot_grid, top):
            keys.append((g, a))
            cands.append(GpuCandidate.prevalidated(profile, rk, rt, a, inst.mean_input_tokens,
                                                   inst.mean_output_tokens, inst.lengths))
    preds = dict(zip(keys, oracle.predict(cands) if cands else [], strict=True))
    by_gpu: dict[int, list[int]] = {}
    for g, a in keys:
        by_gpu.setdefault(g, []).append(a)
    out: list[GpuFill] = []
    for g, idx in enumerate(hosts):
        if not idx:
            continue
        avals = by_gpu.get(g, [])
        a, p, _why = choose(avals, [preds[(g, x)] for x in avals], objective, len(idx), options)
        if a is None:
            return None
        out.append(GpuFill(entries=list(idx), max_loras=a, prediction=p, binding="none"))
    return out


def balanced_plan(inst: Instance, profile: Profile, oracle: Oracle, objective: Objective, gpus: int,
                  options: GreedyOptions = GreedyOptions()) -> tuple[list[GpuFill], str] | None:
    """A balanced plan on ``gpus`` GPUs that the oracle accepts (largest rate first onto the least-loaded GPU,
    then round-robin dealing), each GPU's ``A`` chosen by the TEST's selection; ``None`` if neither works."""
    if gpus < 1 or -(-inst.n // gpus) > options.n_max:
        return None
    cheap = is_cheap(oracle)
    for name, deal in (("balanced", deal_balanced), ("round-robin", deal_round_robin)):
        hosts = deal(inst.rates_rps, gpus) if name == "balanced" else deal(inst.n, gpus)
        if cheap:  # batches of CHUNK GPUs: a dealing that fails usually fails on its first GPUs
            fills: list[GpuFill] | None = []
            for k in range(0, len(hosts), BALANCED_CHUNK):
                part = fit_slots(inst, profile, oracle, objective, hosts[k:k + BALANCED_CHUNK], options)
                if part is None:
                    fills = None
                    break
                fills += part
        else:  # the twin: GPU by GPU, --max-loras from the largest down
            fills = fit_slots_lazy(inst, profile, oracle, objective, hosts, options)
        if fills is not None:
            return fills, name
    return None


def fit_slots_lazy(inst: Instance, profile: Profile, oracle: Oracle, objective: Objective,
                   hosts: list[list[int]], options: GreedyOptions = GreedyOptions(), batch: int = 2,
                   mem: MemoryRule | None = None) -> list[GpuFill] | None:
    """``fit_slots`` for an expensive oracle: GPU by GPU, ``--max-loras`` values from the largest down in batches
    of ``batch`` (run in parallel), stopping at the first batch with a value that meets the objective, and at
    the first GPU with none (the assignment fails: the remaining GPUs are not asked about). Every value is tried
    before a GPU is given up, so it fails exactly when ``fit_slots`` does."""
    mem = mem or MemoryRule(profile)
    out: list[GpuFill] = []
    for idx in hosts:
        if not idx:
            continue
        s = default_slot_rank(int(inst.ranks[idx].max()))
        avals = slot_candidates(len(idx), s, mem, options.slot_grid)[::-1]
        tried: list[int] = []
        preds: list[Prediction] = []
        a = None
        for k in range(0, len(avals), batch):
            part = avals[k:k + batch]
            tried += part
            preds += oracle.predict([inst.candidate(profile, idx, x) for x in part])
            a, p, _why = choose(tried, preds, objective, len(idx), options)
            if a is not None:
                break
        if a is None:
            return None
        out.append(GpuFill(entries=list(idx), max_loras=a, prediction=p, binding="none"))
    return out


def _balanced_estimate(inst: Instance, gpus: list[GpuFill], lo: int, hi: int) -> int | None:
    """The fewest GPUs whose balanced share (n/G adapters, total/G req/s) some greedy GPU with at least as many
    adapters passed with: the evidence the greedy gathered about what one GPU carries. None without evidence."""
    counts = np.array([len(g.entries) for g in gpus])
    loads = np.array([float(inst.rates_rps[g.entries].sum()) for g in gpus])
    total = float(inst.rates_rps.sum())
    for g in range(lo + 1, hi):
        m = -(-inst.n // g)
        seen = loads[counts >= m]
        if len(seen) and total / g <= seen.max():
            return g
    return None


def rebalance(inst: Instance, profile: Profile, oracle: Oracle, objective: Objective, gpus: list[GpuFill],
              options: GreedyOptions = GreedyOptions(), min_gpus: int = 1,
              on_try: Callable[[int], None] | None = None) -> tuple[list[GpuFill], str]:
    """Try balanced plans with fewer GPUs than the greedy's; return the plan with the fewest GPUs and its
    origin (``greedy``, ``round-robin`` or ``balanced``). Feasibility is taken as monotone in the GPU count.

    Probes: one GPU less first (the usual outcome is that it fails: one try); then the fewest GPUs whose balanced
    share a greedy GPU with as many adapters carried (``_balanced_estimate``); then galloping down from the
    smallest count that works (1, 2, 4, ... less) and bisection, never below ``min_gpus``."""
    best, origin = gpus, "greedy"
    lo, hi = max(min_gpus, 1) - 1, len(gpus)  # lo: taken not to work (below the bound); hi: works
    if not options.rebalance or hi - 1 <= lo:
        return best, origin

    def attempt(g: int) -> bool:
        nonlocal best, origin, lo, hi
        if on_try is not None:
            on_try(g)
        found = balanced_plan(inst, profile, oracle, objective, g, options)
        if found is None:
            lo = max(lo, g)
            return False
        (best, origin), hi = found, min(hi, g)
        return True

    if not attempt(hi - 1):
        return best, origin
    est = _balanced_estimate(inst, gpus, lo, hi)
    if est is not None:
        attempt(est)
    step = 1  # gallop down from the smallest count that works, then bisect
    while hi - step > lo and attempt(hi - step):
        step *= 2
    first_true(attempt, lo, hi)  # attempt() records the best plan and narrows lo / hi itself
    return best, origin
