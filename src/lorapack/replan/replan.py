"""Re-planning with a churn cap (issue 25, item 2): ``lorapack place NEW --previous plan.json [--max-moves K]``.

Adapters stay on the GPU they were on. A *move* is one adapter loaded on, or unloaded from, one server (so an
adapter relocated from GPU x to GPU y is two moves); a *restart* is a server that keeps running adapters of the
previous window but whose flags change. The steps, each asking the method's oracle (the twin at the search's
settings for the pool methods) the same TEST the greedy asks:

1. carry over: every GPU keeps its adapters still in the workload (the others are unloaded: ``gone``); GPU
   indices are kept (a GPU's index is its port), a GPU left without adapters is released (an empty GPU in the
   plan, not started by ``serve.sh``);
2. needed moves: a GPU whose adapters' planned rates rose (or whose rates the previous plan did not record) is
   tested with its ``--max-loras`` (no restart), else with the other slot values (a restart); a GPU that fails
   with all of them sheds its hottest adapters, the fewest that make it pass (bisection);
3. homes: new adapters and shed ones (hottest first) go to a running GPU that passes with them -- the one whose
   prediction is farthest from failing (``Objective.margin_use``: latency limits and starvation), then the
   least loaded -- without a restart (rank within its ``--max-lora-rank``) and never onto a GPU they left in
   this window or the previous one (no bouncing: ``replan.moved_from`` in plan.json); what no GPU takes opens
   new GPUs (the greedy driver), first at the indices of released GPUs;
4. optional moves: while the plan has more GPUs than a from-scratch plan of the same method for the same rates,
   the GPU cheapest to empty (two moves per adapter it hosts) is emptied onto the others, if all of its adapters
   find a home as in step 3 (failing that, with hosts that may restart with another ``--max-loras``) and the
   optional moves stay within ``--max-moves``; when no GPU empties alone, the fewest moves onto one GPU fewer
   with no GPU heavier than the from-scratch plan's heaviest (``_balance``, scipy's MILP), else the adapters of
   two or three of the least loaded GPUs placed again by the greedy driver, if that needs one GPU fewer
   (``_repack``);
5. verification (``--verify``): the twin verifies every GPU; when some fail, first the fewest moves that take
   load off the failing GPUs onto the running ones (``_balance_verified``, judged by the twin), else repair
   (``verify.repair``), which cuts adapters off the failing GPUs and may open new ones; these moves are always
   made (``verification`` moves), bouncing or not.

A GPU whose adapters' rates did not rise and which gained no adapter is not re-tested in step 2: it passed for
heavier or equal rates (the oracle's and the twin's answers are taken as monotone in the load); verification,
when on, judges it anyway. A kept server keeps its ``--max-cpu-loras`` when it gains adapters without a restart:
vLLM's CPU cache of adapters is LRU, the adapters beyond it reload from disk when evicted.

The plan reports the moves, restarts and GPUs (``Plan.replan``), and the same for the from-scratch plan, whose
GPUs are first matched to the previous ones with the fewest moves (``scipy.optimize.linear_sum_assignment``).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from ..errors import SpecError
from ..monotone import first_true
from ..oracle import GpuCandidate, Oracle, default_slot_rank
from ..placement.config import PlaceConfig
from ..placement.greedy import GpuFill, Infeasible, MemoryRule, choose, greedy_fill, slot_candidates
from ..placement.plan import PLAN_FLAGS, GpuPlan, Plan, plan_from_dict
from ..placement.problem import Instance, predicted_ok
from ..profile import Profile
from ..server import ServerConfig

# a planned rate counts as risen above this relative margin (float noise of a YAML round trip is not a rise)
RATE_RISE = 1e-9
REASONS = ("gone", "new", "needed", "optional", "verification")

Progress = Callable[[str], None]


@dataclass(frozen=True)
class Previous:
    """The plan a re-plan starts from, and what its own re-plan moved (``moved_from``: adapter -> the GPUs the
    previous window unloaded it from when it relocated it: it does not go back there unless verification needs
    it)."""

    plan: Plan
    path: str
    moved_from: dict[str, frozenset[int]] = field(default_factory=dict)


def load_previous(path: Path) -> Previous:
    """The plan of ``--previous PATH`` (a plan.json, or the directory holding one); ``SpecError`` naming it."""
    path = Path(path)
    file = path / "plan.json" if path.is_dir() else path
    try:
        plan = plan_from_dict(json.loads(file.read_text(encoding="utf-8")))
    except OSError as exc:
        raise SpecError(f"--previous {path}: cannot read it ({exc.strerror or exc})") from None
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError) as exc:
        why = " ".join(str(exc).split())[:120]
        raise SpecError(f"--previous {path}: expected a plan.json written by lorapack place ({why})") from None
    if plan.infeasible:
        raise SpecError(f"--previous {path}: the plan is infeasible (it placed nothing): re-plan from scratch")
    moved = (plan.replan or {}).get("moved_from") or {}
    try:
        moved_from = {str(a): frozenset(int(g) for g in gs) for a, gs in moved.items()}
    except (TypeError, ValueError, AttributeError):
        raise SpecError(f"--previous {path}: replan.moved_from: expected adapter -> [GPU index, ...]") from None
    return Previous(plan=plan, path=str(file), moved_from=moved_from)


# ---------------------------------------------------------------------------------------------------------
# churn between two lists of GPUs


def gpu_sets(plan: Plan) -> list[set[str]]:
    return [set(g.adapters) for g in plan.gpus]


def needs_restart(old: ServerConfig, new: ServerConfig, n_adapters: int) -> bool:
    """A server running in both windows with ``n_adapters`` adapters now restarts when a flag changes; not for
    a ``--max-cpu-loras`` alone (the CPU cache is LRU), a ``--max-lora-rank`` that already covers the new one,
    nor ``--max-loras`` values equal once clipped to the adapters (slots beyond them are never used)."""
    for k in PLAN_FLAGS:
        a, b = getattr(old, k), getattr(new, k)
        if k == "max_cpu_loras" or (k == "max_lora_rank" and a is not None and b is not None and b <= a):
            continue
        if k == "max_loras":
            a, b = min(int(a), n_adapters), min(int(b), n_adapters)
        if a != b:
            return True
    return False


def churn(previous: Plan, plan: Plan, matching: Sequence[tuple[int | None, int | None]]) -> dict:
    """Moves and restarts from ``previous`` to ``plan`` for a matching of their GPUs (pairs ``(previous GPU,
    plan GPU)``; None on one side: a GPU started or released)."""
    moves = restarts = started = released = 0
    for p, n in matching:
        before = set(previous.gpus[p].adapters) if p is not None else set()
        after = set(plan.gpus[n].adapters) if n is not None else set()
        moves += len(before ^ after)
        if before and after and needs_restart(previous.gpus[p].server, plan.gpus[n].server,  # type: ignore[index]
                                              len(after)):
            restarts += 1
        started += bool(after and not before)
        released += bool(before and not after)
    return {"moves": moves, "restarts": restarts, "gpus_started": started, "gpus_released": released}


def best_matching(previous: Plan, plan: Plan) -> list[tuple[int | None, int | None]]:
    """``plan``'s GPUs matched to ``previous``'s with the fewest moves (symmetric differences of the adapter
    sets; a GPU matched to nothing loads or unloads all of its adapters).

    Over square (padded) matchings ``Σ |a ^ b| = Σ |a| + Σ |b| - 2 Σ |a ∩ b|``, so the fewest moves are the
    largest total overlap. A greedy matching by overlap is tried first and kept when it reaches the
    assignment's upper bound (every row, or every column, at its largest overlap): then it is optimal, which
    is the usual case of a re-plan (most GPUs keep most adapters), and the command needs no
    ``scipy.optimize`` import (about 0.3 s cold). Otherwise ``linear_sum_assignment`` solves it."""
    before, after = gpu_sets(previous), gpu_sets(plan)
    n = max(len(before), len(after))
    overlap = np.zeros((n, n), dtype=np.int64)
    for i, b in enumerate(before):
        for j, a in enumerate(after):
            overlap[i, j] = len(a & b)
    pairs = _greedy_pairs(overlap)
    total = sum(int(overlap[i, j]) for i, j in pairs)
    if n and total < min(int(overlap.max(axis=1).sum()), int(overlap.max(axis=0).sum())):
        from scipy.optimize import linear_sum_assignment

        rows, cols = linear_sum_assignment(overlap, maximize=True)
        pairs = list(zip(rows.tolist(), cols.tolist(), strict=True))
    out = []
    for i, j in sorted(pairs):
        p = i if i < len(before) and before[i] else None
        q = j if j < len(after) and after[j] else None
        if p is not None or q is not None:
            out.append((p, q))
    return out


def _greedy_pairs(overlap: np.ndarray) -> list[tuple[int, int]]:
    """A perfect matching of the square ``overlap`` matrix, largest overlaps first (ties: lowest indices)."""
    n = overlap.shape[0]
    order = np.lexsort((np.tile(np.arange(n), n), np.repeat(np.arange(n), n), -overlap.ravel()))
    row_free, col_free = np.ones(n, dtype=bool), np.ones(n, dtype=bool)
    pairs = []
    for flat in order.tolist():
        i, j = divmod(flat, n)
        if row_free[i] and col_free[j]:
            row_free[i] = col_free[j] = False
            pairs.append((i, j))
            if len(pairs) == n:
                break
    return pairs


def identity_matching(previous: Plan, plan: Plan) -> list[tuple[int | None, int | None]]:
    """A re-plan keeps GPU indices: GPU g of the previous plan is GPU g of the new one."""
    n = max(len(previous.gpus), len(plan.gpus))
    out = []
    for g in range(n):
        p = g if g < len(previous.gpus) and previous.gpus[g].adapters else None
        q = g if g < len(plan.gpus) and plan.gpus[g].adapters else None
        if p is not None or q is not None:
            out.append((p, q))
    return out


# ---------------------------------------------------------------------------------------------------------
# the re-plan


@dataclass
class _Gpu:
    """One GPU during the re-plan: its entries (registration order) and its server's flags so far."""

    entries: list[int]
    max_loras: int
    server: ServerConfig | None  # the previous window's server (None: started in this window)
    tested: bool = False


@dataclass
class _State:
    inst: Instance
    profile: Profile
    oracle: Oracle
    config: PlaceConfig
    gpus: list[_Gpu]
    home: dict[int, int]  # entry -> GPU it was on in the previous window
    forbidden: dict[int, set[int]]  # entry -> GPUs it may not be placed on (no bouncing)
    why: dict[int, str] = field(default_factory=dict)  # entry -> why it left home (or arrived: "new")
    mem: MemoryRule | None = None
    calls: int = 0
    # the twin, when ``oracle`` is a learned model: fills a new GPU on which the model commits nothing, as the
    # from-scratch greedy does (``greedy_fill``'s ``confirm``): a model wrong about a hot adapter alone on a GPU
    # must not make the re-plan infeasible where the from-scratch plan is not
    confirm: Oracle | None = None

    def __post_init__(self) -> None:
        self.mem = MemoryRule(self.profile)

    def load(self, g: int) -> float:
        return float(self.inst.rates_rps[self.gpus[g].entries].sum()) if self.gpus[g].entries else 0.0

    def used(self) -> list[int]:
        """The running GPUs (with adapters), by index."""
        return [g for g, gpu in enumerate(self.gpus) if gpu.entries]

    def snapshot(self) -> tuple:
        """Every GPU's entries and ``--max-loras``, and the moves' reasons and bars: what ``restore`` puts back
        when a tried change is not taken."""
        return ([(list(gpu.entries), gpu.max_loras) for gpu in self.gpus], dict(self.why),
                {e: set(f) for e, f in self.forbidden.items()})

    def restore(self, snap: tuple) -> None:
        for gpu, (entries, a) in zip(self.gpus, snap[0], strict=True):
            gpu.entries, gpu.max_loras = entries, a
        self.why, self.forbidden = dict(snap[1]), {e: set(f) for e, f in snap[2].items()}

    def rank_cap(self, g: int) -> int:
        srv = self.gpus[g].server
        return int(srv.max_lora_rank) if srv is not None and srv.max_lora_rank is not None else 0

    def candidate(self, entries: Sequence[int], a: int) -> GpuCandidate:
        ix = np.asarray(entries, dtype=np.int64)
        inst = self.inst
        return GpuCandidate.prevalidated(self.profile, inst.ranks[ix], inst.rates_rps[ix], max(1, min(a, len(ix))),
                                         inst.mean_input_tokens, inst.mean_output_tokens, inst.lengths)

    def passes(self, sets: Sequence[tuple[Sequence[int], int]]) -> list[bool]:
        """The TEST for each ``(entries, A)``, one oracle batch."""
        return [ok for ok, _ in self.tested(sets)]

    def tested(self, sets: Sequence[tuple[Sequence[int], int]]) -> list[tuple[bool, float]]:
        """The TEST for each ``(entries, A)`` and how close the prediction comes to failing it
        (``Objective.margin_use``), one oracle batch."""
        if not sets:
            return []
        self.calls += 1
        preds = self.oracle.predict([self.candidate(e, a) for e, a in sets])
        obj = self.config.objective
        return [(predicted_ok(obj, p), obj.margin_use(p)) for p in preds]

    def settle(self, groups: Sequence[tuple[Sequence[int], int | None]]) -> list[int | None]:
        """Each GPU's ``--max-loras``: ``current`` when it passes with it (no restart), else the TEST's choice
        among the slot values that start (None: none passes). One oracle batch for all of them."""
        assert self.mem is not None
        keys, cands = [], []
        for k, (entries, current) in enumerate(groups):
            s = default_slot_rank(int(self.inst.ranks[list(entries)].max()))
            values = slot_candidates(len(entries), s, self.mem)
            if current is not None:
                values = [current, *[a for a in values if a != current]]
            for a in values:
                keys.append((k, a))
                cands.append(self.candidate(entries, a))
        self.calls += 1
        preds = self.oracle.predict(cands) if cands else []
        by: dict[int, list] = {}
        for (k, a), p in zip(keys, preds, strict=True):
            by.setdefault(k, []).append((a, p))
        out: list[int | None] = []
        for k, (entries, current) in enumerate(groups):
            rows = by.get(k, [])
            if current is not None and rows and rows[0][0] == current and predicted_ok(self.config.objective,
                                                                                       rows[0][1]):
                out.append(current)
                continue
            a, _p, _why = choose([a for a, _ in rows], [p for _, p in rows], self.config.objective, len(entries),
                                 _options(self.config))
            out.append(a)
        return out

    def targets(self, e: int, exclude: set[int]) -> list[int]:
        """Running GPUs entry ``e`` may join without a restart, least loaded first."""
        inst = self.inst
        rank = default_slot_rank(int(inst.ranks[e]))
        n_max = _options(self.config).n_max
        out = []
        for g, gpu in enumerate(self.gpus):
            if not gpu.entries or g in exclude or g in self.forbidden.get(e, ()) or len(gpu.entries) >= n_max:
                continue
            if gpu.server is not None and rank > self.rank_cap(g):
                continue
            out.append(g)
        return sorted(out, key=lambda g: (self.load(g), g))

    def find_home(self, e: int, exclude: set[int], restart: bool = False) -> tuple[int, int] | None:
        """``(GPU, its A)``: among ``targets`` that pass the TEST with ``e`` added -- with its ``A`` for a running
        server (no restart; with ``restart``, another slot value when its own fails), with any slot value for
        one started in this window (it has no flags yet) -- the one whose prediction is farthest from failing
        (``Objective.margin_use``), then the least loaded. By margin, not only by load: a GPU filled up to the
        objective passes its verification and then misses it on a replay's own draws, and one the learned oracle
        passes near its starvation border the twin's verification fails and repair splits onto new GPUs
        (docs/replan.md, "Evaluation over time")."""
        gs = self.targets(e, exclude)
        fresh = [g for g in gs if restart or self.gpus[g].server is None]
        slots = dict(zip(fresh, self.settle([(self.gpus[g].entries + [e], self.gpus[g].max_loras) for g in fresh])
                         if fresh else [], strict=True))
        homes = {g: (slots.get(g) if g in slots else self.gpus[g].max_loras) for g in gs}
        homes = {g: a for g, a in homes.items() if a is not None}
        order = [g for g in gs if g in homes]
        verdicts = dict(zip(order, self.tested([(self.gpus[g].entries + [e], int(homes[g])) for g in order]),
                            strict=True))
        ok = [g for g in order if verdicts[g][0]]
        if not ok:
            return None
        rank = {g: i for i, g in enumerate(gs)}  # least loaded first
        best = min(ok, key=lambda g: (verdicts[g][1], rank[g]))
        return best, int(homes[best])

    def put(self, e: int, home: tuple[int, int]) -> None:
        g, a = home
        self.gpus[g].entries.append(e)
        self.gpus[g].max_loras = a


def _options(config: PlaceConfig):
    from ..placement.greedy import N_MAX, GreedyOptions

    return GreedyOptions(n_max=N_MAX if config.n_max is None else config.n_max)


def _carry_splits(inst: Instance, previous: Plan) -> Instance:
    """The new instance with each adapter the previous plan split over several GPUs as the same replicas
    (one entry per previous GPU, its weight): a re-plan keeps splits as they were."""
    shares: dict[str, list[float]] = {}
    for g in previous.gpus:
        for a, w in zip(g.adapters, g.weights, strict=True):
            shares.setdefault(a, []).append(float(w))
    split = {a: ws for a, ws in shares.items() if len(ws) > 1}
    if not any(a in split for a in inst.adapter_ids):
        return inst
    idx: list[int] = []
    weights: list[float] = []
    for i, a in enumerate(inst.adapter_ids):
        ws = split.get(a, [1.0])
        tot = sum(ws) or 1.0
        idx += [i] * len(ws)
        weights += [w / tot for w in ws]
    ix = np.asarray(idx, dtype=np.int64)
    wa = np.asarray(weights)
    return replace(inst, adapter_ids=tuple(inst.adapter_ids[i] for i in ix), ranks=inst.ranks[ix],
                   rates_rps=inst.rates_rps[ix] * wa, weights=wa)


def _initial_state(inst: Instance, profile: Profile, oracle: Oracle, config: PlaceConfig, previous: Previous
                   ) -> _State:
    """Step 1: every GPU with its adapters still in the workload, in registration order."""
    slots: dict[str, list[int]] = {}
    for i, a in enumerate(inst.adapter_ids):
        slots.setdefault(a, []).append(i)
    gpus, home = [], {}
    for gi, g in enumerate(previous.plan.gpus):
        entries = []
        for a in g.adapters:
            free = slots.get(a)
            if free:
                e = free.pop(0)
                entries.append(e)
                home[e] = gi
        gpus.append(_Gpu(entries=entries, max_loras=int(g.max_loras), server=g.server if g.adapters else None))
    forbidden = {e: set(previous.moved_from.get(inst.adapter_ids[e], ())) for e in range(inst.n)}
    st = _State(inst=inst, profile=profile, oracle=oracle, config=config, gpus=gpus, home=home, forbidden=forbidden)
    for e in range(inst.n):
        if e not in home:
            st.why[e] = "new"
    return st


def _risen(st: _State, previous: Plan, g: int) -> bool:
    """Whether GPU ``g``'s load may have grown: an adapter's planned rate rose, or the plan has no rates."""
    old = previous.gpus[g]
    if not old.rates_rps:
        return True
    rate = dict(zip(old.adapters, old.rates_rps, strict=True))
    return any(st.inst.rates_rps[e] > rate[st.inst.adapter_ids[e]] * (1 + RATE_RISE) + 1e-12
               for e in st.gpus[g].entries)


def _shed(st: _State, g: int) -> list[int]:
    """Step 2 for a GPU that fails with every slot value: the fewest of its hottest adapters whose removal lets
    it pass with its ``A`` or another (bisection); returns the entries shed."""
    gpu = st.gpus[g]
    order = sorted(gpu.entries, key=lambda e: (-st.inst.rates_rps[e], st.inst.adapter_ids[e]))

    def passes_without(k: int) -> bool:
        if k >= len(order):
            return True
        drop = set(order[:k])
        return st.settle([([e for e in gpu.entries if e not in drop], gpu.max_loras)])[0] is not None

    k = first_true(passes_without, 0, len(order))
    drop = set(order[:k])
    gpu.entries = [e for e in gpu.entries if e not in drop]
    if gpu.entries:
        a = st.settle([(gpu.entries, gpu.max_loras)])[0]
        gpu.max_loras = int(a) if a is not None else gpu.max_loras
    shed = [e for e in order[:k]]
    for e in shed:
        st.why.setdefault(e, "needed")
        st.forbidden.setdefault(e, set()).add(g)
    return shed


def _open_gpus(st: _State, homeless: list[int], pool: int | None) -> None:
    """What no running GPU takes goes onto new GPUs filled by the greedy driver, at released indices first."""
    if not homeless:
        return
    ix = np.asarray(sorted(homeless), dtype=np.int64)
    sub = st.inst.subset(ix)
    fills = greedy_fill(sub, st.profile, st.oracle, st.config.objective, options=_options(st.config),
                        confirm=st.confirm)
    for f in fills:
        entries = [int(ix[i]) for i in f.entries]
        a = max(1, min(int(f.max_loras), len(entries)))
        # a released index first, unless one of these adapters left that GPU (it would be a move back there)
        barred = set().union(*(st.forbidden.get(e, set()) for e in entries))
        free = [g for g, gpu in enumerate(st.gpus) if not gpu.entries and g not in barred]
        gpu = _Gpu(entries=entries, max_loras=a, server=None, tested=True)
        if free:
            st.gpus[free[0]] = gpu
        else:
            st.gpus.append(gpu)
    used = sum(1 for gpu in st.gpus if gpu.entries)
    if pool is not None and used > pool:
        raise Infeasible(f"the re-plan needs {used} GPUs, --gpus {pool} given", gpus_needed=used)


def _place_homeless(st: _State, homeless: list[int], pool: int | None) -> None:
    """Step 3: hottest first onto the running GPU farthest from failing that passes with it (``find_home``);
    the rest onto new GPUs."""
    left = []
    for e in sorted(homeless, key=lambda x: (-st.inst.rates_rps[x], st.inst.adapter_ids[x])):
        home = st.find_home(e, set())
        if home is None:
            left.append(e)
        else:
            st.put(e, home)
    _open_gpus(st, left, pool)


def _consolidate(st: _State, target: int | None, budget: float, caps: Caps | None = None) -> int:
    """Step 4: empty the GPUs cheapest to empty while the plan has more GPUs than ``target`` and the optional
    moves fit in ``budget``; when no GPU empties onto the others as they run, once more letting the hosts
    restart with another ``--max-loras`` (a GPU saved for a restart); then the fewest moves onto one GPU fewer
    with no GPU beyond ``caps`` nor beyond its present load (``_balance``); then a repack of a few GPUs.
    Returns the optional moves made."""
    spent = 0
    if target is None:
        return 0

    def cost(g: int) -> int:  # entries at home on g move twice (off g, onto another); arrivals only re-aim
        return 2 * sum(1 for e in st.gpus[g].entries if st.home.get(e) == g)

    def empty(g: int, restart: bool) -> bool:
        saved = st.snapshot()
        moving = sorted(st.gpus[g].entries, key=lambda x: (-st.inst.rates_rps[x], st.inst.adapter_ids[x]))
        st.gpus[g].entries = []
        for e in moving:
            home = st.find_home(e, {g}, restart=restart)
            if home is None:
                st.restore(saved)
                return False
            st.put(e, home)
        for e in moving:
            if st.home.get(e) == g:
                st.why[e] = "optional"
            st.forbidden.setdefault(e, set()).add(g)
        return True

    while sum(1 for gpu in st.gpus if gpu.entries) > target:
        order = sorted((g for g, gpu in enumerate(st.gpus) if gpu.entries), key=lambda g: (cost(g), st.load(g), g))
        price = {g: cost(g) for g in order}  # before emptying: afterwards g holds nothing
        affordable = [g for g in order if spent + price[g] <= budget]
        g_done = next((g for restart in (False, True) for g in affordable if empty(g, restart)), None)
        if g_done is not None:
            spent += price[g_done]
            continue
        used = len(st.used())
        paid = None
        if caps is not None and affordable:  # one GPU fewer empties one GPU: at least its price in moves
            load_cap, n_cap = _caps_for(st, caps)
            paid = _balance(st, used - 1, load_cap, n_cap, budget - spent, "optional")
        if paid is None:
            paid = _repack(st, budget - spent)
        if paid is None:
            break
        spent += paid
    return spent


# step 4's repack: GPU sets of these sizes, drawn from this many least-loaded GPUs (C(5,2) + C(5,3) = 20 greedy
# runs at most per GPU saved; the greedy on a few dozen adapters asks a learned oracle in milliseconds)
REPACK_SIZES = (2, 3)
REPACK_POOL = 5


def _repack(st: _State, budget: float) -> int | None:
    """Step 4 when no GPU empties onto the others: the adapters of a few GPUs (2 or 3 of the ``REPACK_POOL``
    least loaded) placed again from scratch by the greedy driver; taken when they need one GPU fewer. When the
    fleet shrinks by less than a GPU's worth the load is spread thin over every GPU and none empties alone, but
    two or three together free one (docs/replan.md, "Evaluation over time"). The new GPUs go to the old indices
    with the most adapters staying (never onto a GPU an adapter may not return to). Sets are tried with the
    fewest adapters first; the first whose repack saves a GPU within ``budget`` optional moves (two per adapter
    leaving its previous GPU) is applied (its hosts may restart). Returns the moves it made, None when no repack
    saves a GPU."""
    import itertools

    used = sorted((g for g, gpu in enumerate(st.gpus) if gpu.entries), key=lambda g: (st.load(g), g))
    pool = used[:REPACK_POOL]
    tried = sorted((c for k in REPACK_SIZES if k <= len(pool) for c in itertools.combinations(pool, k)),
                   key=lambda c: (sum(len(st.gpus[g].entries) for g in c), c))
    for group in tried:
        entries = sorted(e for g in group for e in st.gpus[g].entries)
        ix = np.asarray(entries, dtype=np.int64)
        try:
            fills = greedy_fill(st.inst.subset(ix), st.profile, st.oracle, st.config.objective, pool=len(group) - 1,
                                options=_options(st.config))
        except Infeasible:
            continue
        best: tuple[int, tuple[int, ...]] | None = None
        for to in itertools.permutations(group, len(fills)):  # fill j -> GPU to[j]
            placed = [(int(ix[i]), g) for f, g in zip(fills, to, strict=True) for i in f.entries]
            if any(g in st.forbidden.get(e, ()) and st.home.get(e) != g for e, g in placed):
                continue
            moves = 2 * sum(1 for e, g in placed if e in st.home and st.home[e] in group and st.home[e] != g)
            if best is None or moves < best[0]:
                best = (moves, to)
        if best is None or best[0] > budget:
            continue
        moves, to = best
        for g in group:
            st.gpus[g].entries = []
        for f, g in zip(fills, to, strict=True):
            st.gpus[g].entries = [int(ix[i]) for i in f.entries]
            st.gpus[g].max_loras = max(1, min(int(f.max_loras), len(f.entries)))
        for g in to:
            for e in st.gpus[g].entries:
                h = st.home.get(e)
                if h is not None and h in group and h != g:
                    st.why[e] = "optional"
                    st.forbidden.setdefault(e, set()).add(h)
        return moves
    return None


# step 4's balance: the MILP's time limit (HiGHS), and how the caps tighten when the TEST rejects its assignment
BALANCE_TIME_S = 0.5  # s: HiGHS returns its best assignment so far
BALANCE_TRIES = 2
BALANCE_SHRINK = 0.97


@dataclass(frozen=True)
class Caps:
    """What the heaviest GPU of the from-scratch plan for the same rates carries, after its verification: planned
    load (req/s, headroom included) and adapters. Its GPUs pass carrying that much, so a re-plan whose GPUs stay
    within both is no more loaded than GPUs known to pass (docs/replan.md, "The balance")."""

    load_rps: float
    adapters: int

    @classmethod
    def of(cls, scratch: Plan) -> Caps | None:
        used = [g for g in scratch.gpus if g.adapters and g.rates_rps]
        if scratch.infeasible or not used:
            return None
        return cls(load_rps=max(float(sum(g.rates_rps)) for g in used), adapters=max(len(g.adapters) for g in used))


def _moves(st: _State, where: dict[int, int]) -> int:
    """Loads and unloads from the previous plan of an assignment entry -> GPU (two per entry away from home)."""
    return 2 * sum(1 for e, g in where.items() if e in st.home and st.home[e] != g)


def _movable(st: _State, used: Sequence[int], gpus: int, budget: float) -> set[int]:
    """The entries ``_balance`` may move: all of them when the budget is unbounded; otherwise the entries away
    from home (their moves are paid already), every entry of a GPU the budget can empty when the balance must
    shed a GPU, and on the other GPUs the ``budget/2`` hottest and coldest at home: with ``budget`` moves at most
    ``budget/2`` entries leave home, the hottest free the most load per move, the coldest an adapter for the
    least load. On 1,280 adapters and five GPUs with 40 moves this cut HiGHS's problem from 5,147 variables,
    where it ran to its time limit, to 1,843 (``bench/replan_speed.py``, ``hot-k40``)."""
    if not math.isfinite(budget):
        return {e for g in used for e in st.gpus[g].entries}
    k = max(1, int(budget / 2))
    out: set[int] = set()
    for g in used:
        at_home = [e for e in st.gpus[g].entries if st.home.get(e) == g]
        out.update(e for e in st.gpus[g].entries if st.home.get(e) != g)
        if gpus < len(used) and 2 * len(at_home) <= budget:
            out.update(at_home)
            continue
        by_rate = sorted(at_home, key=lambda e: (st.inst.rates_rps[e], st.inst.adapter_ids[e]))
        out.update(by_rate[:k] + by_rate[-k:])
    return out


def _balance(st: _State, gpus: int, load_cap: dict[int, float], n_cap: int, budget: float, reason: str
             ) -> int | None:
    """The entries on at most ``gpus`` of the running GPUs with the fewest moves such that each GPU ``g`` kept
    carries at most ``load_cap[g]`` req/s and ``n_cap`` adapters (scipy's MILP, HiGHS): ``x[e, g]`` = entry ``e``
    on GPU ``g`` (only where it may go without a restart and without bouncing, or where it is now), ``y[g]`` =
    GPU ``g`` kept; the moves beyond the present ones within ``budget``. The TEST then picks each changed GPU's
    ``--max-loras``; when it rejects one, the load caps tighten by ``BALANCE_SHRINK`` (``BALANCE_TRIES`` times at
    most). Applied only when the TEST passes every GPU; entries that leave their previous GPU are moves of
    ``reason``. Returns the moves it added (0 or more), None when no assignment within the caps was found."""
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_array

    used = st.used()
    cur = {e: g for g in used for e in st.gpus[g].entries}
    entries = sorted(cur)
    rank = {e: default_slot_rank(int(st.inst.ranks[e])) for e in entries}
    movable = _movable(st, used, gpus, budget)
    pairs = [(e, g) for e in entries for g in used
             if g == cur[e] or (e in movable and g not in st.forbidden.get(e, ()) and
                                (st.gpus[g].server is None or rank[e] <= st.rank_cap(g)))]
    n_x, n_y = len(pairs), len(used)
    away = np.array([2.0 if e in st.home and st.home[e] != g else 0.0 for e, g in pairs])
    # two moves away from home; a hair more for leaving where it is now (the fewest changes among equals)
    cost = np.concatenate([away + np.array([1e-3 if g != cur[e] else 0.0 for e, g in pairs]), np.zeros(n_y)])
    before = _moves(st, cur)
    row_of = {e: k for k, e in enumerate(entries)}
    gpu_of = {g: k for k, g in enumerate(used)}
    rates = st.inst.rates_rps
    # rows: each entry on one GPU; per GPU its load and its adapters (minus the caps times y); the GPUs kept;
    # the moves within the budget
    r0, r1 = len(entries), len(entries) + 2 * n_y
    rows = [row_of[e] for e, _g in pairs] + [r0 + 2 * gpu_of[g] for _e, g in pairs] + \
        [r0 + 2 * gpu_of[g] + 1 for _e, g in pairs] + [r0 + 2 * k for k in range(n_y)] + \
        [r0 + 2 * k + 1 for k in range(n_y)] + [r1] * n_y
    cols = [*range(n_x), *range(n_x), *range(n_x), *range(n_x, n_x + n_y), *range(n_x, n_x + n_y),
            *range(n_x, n_x + n_y)]
    lo = [1.0] * len(entries) + [-np.inf] * (2 * n_y) + [-np.inf]
    hi = [1.0] * len(entries) + [0.0] * (2 * n_y) + [float(gpus)]
    if math.isfinite(budget):
        rows += [r1 + 1] * n_x
        cols += list(range(n_x))
        lo.append(-np.inf)
        hi.append(before + budget)
    scale = 1.0
    for _ in range(BALANCE_TRIES):
        vals = [1.0] * n_x + [float(rates[e]) for e, _g in pairs] + [1.0] * n_x + \
            [-load_cap[g] * scale for g in used] + [-float(n_cap)] * n_y + [1.0] * n_y
        if math.isfinite(budget):
            vals += away.tolist()
        a = coo_array((vals, (rows, cols)), shape=(len(hi), n_x + n_y)).tocsr()
        constraints = LinearConstraint(a, lo, hi)
        # the LP relaxation first: it proves most hopeless cases (a budget too small) in milliseconds, where the
        # MILP would search up to its time limit
        if milp(cost, constraints=constraints, bounds=Bounds(0, 1)).x is None:
            return None
        res = milp(cost, constraints=constraints, integrality=np.ones(n_x + n_y), bounds=Bounds(0, 1),
                   options={"time_limit": BALANCE_TIME_S})
        if res.x is None:
            return None
        where = {e: g for (e, g), v in zip(pairs, res.x[:n_x], strict=True) if v > 0.5}
        if len(where) != len(entries):
            return None
        # registration order: the entries that stay first, in their order; the arrivals after them, hottest first
        new = {g: [e for e in st.gpus[g].entries if where[e] == g] for g in used}
        for e in sorted(entries, key=lambda x: (-rates[x], st.inst.adapter_ids[x])):
            if where[e] != cur[e]:
                new[where[e]].append(e)
        changed = [g for g in used if new[g] != st.gpus[g].entries and new[g]]
        slots = st.settle([(new[g], st.gpus[g].max_loras) for g in changed])
        if all(x is not None for x in slots):
            for g in used:
                st.gpus[g].entries = new[g]
            for g, x in zip(changed, slots, strict=True):
                st.gpus[g].max_loras = int(x)  # type: ignore[arg-type]
            for e in entries:
                if where[e] != cur[e] and st.home.get(e) == cur[e]:
                    st.why.setdefault(e, reason)
                    st.forbidden.setdefault(e, set()).add(cur[e])
            return max(0, _moves(st, where) - before)
        scale *= BALANCE_SHRINK
    return None


def _caps_for(st: _State, caps: Caps) -> tuple[dict[int, float], int]:
    """Per running GPU the load cap of ``caps``, or its present load when higher (a GPU the TEST passed as it
    is may stay so); the adapter cap: ``caps``' or the most any running GPU holds now, the larger."""
    used = st.used()
    return ({g: max(caps.load_rps, st.load(g)) for g in used},
            max([caps.adapters, *(len(st.gpus[g].entries) for g in used)]))


# the balance that answers a failed verification: a failing GPU's load cap, as a share of its load
VERIFY_BALANCE_SHARE = 0.985
VERIFY_BALANCE_ROUNDS = 4


def _balance_verified(st: _State, caps: Caps, verify: Callable[[list[int]], list[bool]]) -> str:
    """Step 5 before repair: when the twin fails some GPUs, the fewest moves that bring each failing GPU's load
    under ``VERIFY_BALANCE_SHARE`` of its present load on the GPUs running now (``_balance``; the others within
    ``_caps_for`` or the heaviest GPU that passed so far, the larger; adapters within ``_caps_for``), judged by
    ``verify`` (the GPUs -> passed); again with the GPUs that still fail, or fail now (``VERIFY_BALANCE_ROUNDS``
    rounds at most): the twin's verdict near a GPU's limit moves with its adapters' mix, so a few rounds find
    an arrangement that passes where one cut would not. Kept when every GPU passes; otherwise ``st`` is as before
    and repair takes over. The moves are ``verification`` moves (needed to pass verification). Returns what
    happened: ``passed`` (nothing to balance), ``balanced``, ``repaired`` (left to repair)."""
    saved = st.snapshot()
    used = st.used()
    ok = dict(zip(used, verify(used), strict=True))
    if all(ok.values()):
        return "passed"
    cap, n_cap = _caps_for(st, caps)
    passing, failed = 0.0, set()
    for _ in range(VERIFY_BALANCE_ROUNDS):
        # a GPU that never failed may carry what the heaviest GPU that passed carries (the twin's word, not only
        # the from-scratch plan's); one that failed gets less than it had, each time it fails
        passing = max([passing, *(st.load(g) for g, passed in ok.items() if passed)])
        failed |= {g for g, passed in ok.items() if not passed}
        for g, passed in ok.items():
            cap[g] = min(cap[g], VERIFY_BALANCE_SHARE * st.load(g)) if not passed else \
                cap[g] if g in failed else max(cap[g], passing)
        before = [list(gpu.entries) for gpu in st.gpus]
        if _balance(st, len(used), cap, n_cap, math.inf, "verification") is None:
            break
        used = st.used()
        changed = [g for g in used if st.gpus[g].entries != before[g]]
        ok.update(zip(changed, verify(changed), strict=True))
        ok = {g: ok[g] for g in used}
        if all(ok.values()):
            return "balanced"
    st.restore(saved)
    return "repaired"


def _fill(gpu: _Gpu) -> GpuFill:
    return GpuFill(entries=list(gpu.entries), max_loras=max(1, min(gpu.max_loras, len(gpu.entries))))


def _fills(st: _State) -> tuple[list[GpuFill], list[int]]:
    """The running GPUs as the verifier takes them, and their indices."""
    index = st.used()
    return [_fill(st.gpus[g]) for g in index], index


def replan(inst: Instance, profile: Profile, config: PlaceConfig, previous: Previous, overrides=None,
           progress: Progress | None = None) -> Plan:
    """``place()`` with ``config.previous``: the module docstring's steps; the plan's ``replan`` says what moved
    and compares with a from-scratch plan of the same config for the same rates."""
    from ..placement.api import Context, OracleOverrides, build_plan, place

    overrides = overrides if overrides is not None else OracleOverrides()
    prev = previous.plan
    if prev.model != profile.model or prev.gpu_type != profile.gpu:
        raise SpecError(f"--previous {previous.path}: a plan for {prev.model} on {prev.gpu_type}, expected one for "
                        f"{profile.model} on {profile.gpu} (the profile of this re-plan)")
    if inst.is_split:
        raise SpecError("--previous: expected a workload without split entries (a re-plan keeps the previous "
                        "plan's splits)")
    say = progress or (lambda _m: None)
    say("planning from scratch for comparison")
    fresh = replace(config, previous=None, max_moves=None)
    t_scratch = time.perf_counter()
    scratch = place(inst, profile, fresh, overrides, progress)
    scratch_ms = (time.perf_counter() - t_scratch) * 1e3

    from ..placement.registry import get_method

    method = get_method(config.method)
    ctx = Context.of(profile, config, overrides, config.verify_law(inst), progress)
    ctx.lengths_probe = inst.candidate(profile, [0], 1)
    t0 = time.perf_counter()
    oracle = ctx.oracle_of(method.oracle) if method.greedy and method.oracle else ctx.twin()
    inst = _carry_splits(inst, prev)
    st = _initial_state(inst, profile, oracle, config, previous)
    st.confirm = ctx.confirmer(oracle)

    say("re-testing the GPUs whose load rose")
    changed = [g for g, gpu in enumerate(st.gpus) if gpu.entries and _risen(st, prev, g)]
    homeless: list[int] = []
    verdict = st.settle([(st.gpus[g].entries, st.gpus[g].max_loras) for g in changed])
    failing = [g for g, a in zip(changed, verdict, strict=True) if a is None]
    for g, a in zip(changed, verdict, strict=True):
        st.gpus[g].tested = True
        if a is not None:
            st.gpus[g].max_loras = int(a)
        else:
            homeless += _shed(st, g)
    for gpu in st.gpus:
        gpu.tested = True
    homeless += [e for e in range(inst.n) if st.why.get(e) == "new"]
    try:
        _place_homeless(st, homeless, config.gpus)
        target = None if scratch.infeasible else scratch.gpus_used
        budget = math.inf if config.max_moves is None else float(config.max_moves)
        optional = _consolidate(st, target, budget, Caps.of(scratch))
    except Infeasible as e:
        return _infeasible(scratch, config, previous, str(e))
    placement_ms = (time.perf_counter() - t0) * 1e3

    fills, index = _fills(st)
    verdicts = None
    verification: dict = {}
    verification_ms = math.nan
    balance = None
    if config.verify:
        from ..placement.api import verification_dict
        from ..placement.verify import Judges, repair, verify_fills

        t1 = time.perf_counter()
        say(f"verifying {len(fills)} GPUs")
        verifier = ctx.verifier(config.verify_seeds)
        counts = (getattr(verifier, "n_simulations", 0), getattr(verifier, "cache_hits", 0))
        caps = Caps.of(scratch)
        if caps is not None:
            def verify(gs: list[int]) -> list[bool]:
                return [v.passed for v in verify_fills(inst, profile, [_fill(st.gpus[g]) for g in gs],
                                                       config.objective, verifier)]

            balance = _balance_verified(st, caps, verify)
            fills, index = _fills(st)
    before = {g: list(st.gpus[g].entries) for g in index}
    if config.verify:
        try:
            fills, verdicts, log = repair(inst, profile, fills, config.objective, Judges(verifier, ctx.twin()),
                                          pool=config.gpus, options=ctx.options)
        except Infeasible as e:
            return _infeasible(scratch, config, previous, str(e))
        verification_ms = (time.perf_counter() - t1) * 1e3
        verification = verification_dict(verifier, config.verify_seeds, len(index), fills, verdicts, log, counts)
        free = [g for g, gpu in enumerate(st.gpus) if not gpu.entries]
        for _ in fills[len(index):]:  # GPUs repair added: released indices first
            index.append(free.pop(0) if free else len(st.gpus))
            if index[-1] == len(st.gpus):
                st.gpus.append(_Gpu(entries=[], max_loras=1, server=None))
        after: dict[int, set[int]] = {}
        for g, f in zip(index, fills, strict=True):
            for e in f.entries:
                after.setdefault(e, set()).add(g)
        where = {e: {g} for g, es in before.items() for e in es}
        for e, gs in after.items():
            if gs != where.get(e) and e not in st.why:  # repair moved an adapter the re-plan had left at home
                st.why[e] = "verification"
    built = build_plan(method.name, inst, profile, fills, verdicts)
    # released GPUs at the end stay as empty GPUs: a GPU's address may depend on the plan's GPU count (the
    # default host name: localhost on one node), and both windows must name every server alike
    n_gpus = max(max(index, default=-1) + 1, len(prev.gpus))
    gpus = [GpuPlan(adapters=[], weights=[], server=ServerConfig(max_loras=1)) for _ in range(n_gpus)]
    for g, gp in zip(index, built.gpus, strict=True):
        gp = _merge_replicas(gp)
        old = st.gpus[g].server if g < len(st.gpus) else None
        if old is not None and not needs_restart(old, gp.server, len(gp.adapters)):
            # no restart: the running server's flags stand (its --max-cpu-loras too, the CPU cache is LRU)
            gp = replace(gp, server=old)
        gpus[g] = gp
    plan = Plan(method=method.name, model=profile.model, gpu_type=profile.gpu, gpus=gpus,
                lower_bound_gpus=scratch.lower_bound_gpus, placement_ms=placement_ms,
                load_ms=scratch.load_ms, verification_ms=verification_ms, settings=dict(scratch.settings),
                lower_bound=scratch.lower_bound, verification=verification,
                diagnostics={"oracle_calls": st.calls, "from_scratch_ms": scratch_ms})
    plan.settings.update(previous=previous.path, max_moves=config.max_moves)
    plan.replan = _report(plan, scratch, previous, st, optional)
    plan.replan["failing_before"] = failing  # the previous plan's GPUs that fail under the new rates
    if balance is not None:  # verification's first answer: passed, balanced (_balance_verified) or repaired
        plan.replan["verification_balance"] = balance
    by_gpu = dict(zip(index, fills, strict=True))
    verifier = ctx.verifier(config.verify_seeds) if config.verify else None
    plan.replan["restart_hosts"] = _restart_hosts(st, plan, by_gpu, plan.replan["restarts"], verifier)
    return plan


def _merge_replicas(gp: GpuPlan) -> GpuPlan:
    """Two replicas of a split adapter that ended on one GPU (the greedy's new GPUs or the repair may put them
    together) become one adapter there with their weights and rates summed: a server registers a name once,
    and one adapter at the summed rate is no heavier than the two verified (the same Poisson load, one slot)."""
    if len(set(gp.adapters)) == len(gp.adapters):
        return gp
    at: dict[str, int] = {}
    adapters, weights, ranks, rates = [], [], [], []
    for i, a in enumerate(gp.adapters):
        if a in at:
            weights[at[a]] += gp.weights[i]
            if gp.rates_rps:
                rates[at[a]] += gp.rates_rps[i]
            continue
        at[a] = len(adapters)
        adapters.append(a)
        weights.append(gp.weights[i])
        if gp.ranks:
            ranks.append(gp.ranks[i])
        if gp.rates_rps:
            rates.append(gp.rates_rps[i])
    n = len(adapters)
    server = gp.server.replace(max_loras=min(int(gp.max_loras), n), max_cpu_loras=max(min(int(gp.max_loras), n), n))
    return replace(gp, adapters=adapters, weights=weights, ranks=ranks, rates_rps=rates, server=server)


def _restart_hosts(st: _State, plan: Plan, by_gpu: dict[int, GpuFill], restarts: Sequence[int],
                   verifier: Oracle | None) -> dict[str, dict]:
    """Where each restarting server's adapters are served while it restarts (migrate.sh loads them there
    first): hottest first onto the server that keeps running, takes the adapter's rank and passes the TEST with
    it on top of its own adapters and the others parked there, least loaded first. With ``verifier`` the hosts'
    states are verified too. Per restarting GPU: ``hosts`` (adapter -> GPU), ``passes``, ``judged_by``,
    ``failing`` (hosts whose state fails) and ``unserved`` (adapters no running server can take)."""
    inst = st.inst
    running = [g for g in by_gpu if g not in restarts]
    out: dict[str, dict] = {}
    for x in restarts:
        extra: dict[int, list[int]] = {}
        hosts: dict[str, int] = {}
        homeless: list[str] = []
        unserved: list[str] = []
        for e in sorted(by_gpu[x].entries, key=lambda i: (-inst.rates_rps[i], inst.adapter_ids[i])):
            aid = inst.adapter_ids[e]
            if any(aid in plan.gpus[g].adapters for g in running):  # its other replicas take its requests
                continue
            rank = default_slot_rank(int(inst.ranks[e]))
            cands = sorted((g for g in running if (plan.gpus[g].max_lora_rank or 0) >= rank),
                           key=lambda g: (float(inst.rates_rps[by_gpu[g].entries + extra.get(g, [])].sum()), g))
            # the host's --max-loras as its server runs it (a kept server's flag may exceed its adapters)
            ok = st.passes([(by_gpu[g].entries + extra.get(g, []) + [e], int(plan.gpus[g].max_loras)) for g in cands])
            host = next((g for g, good in zip(cands, ok, strict=True) if good), None)
            if host is None and cands:  # none passes: the least loaded carries it, and the state says it fails
                host = cands[0]
                homeless.append(aid)
            if host is None:
                unserved.append(aid)
                continue
            extra.setdefault(host, []).append(e)
            hosts[aid] = host
        failing = sorted({hosts[a] for a in homeless})
        judged = "oracle"
        if verifier is not None and extra:
            from ..placement.verify import verify_fills

            gs = sorted(extra)
            verdicts = verify_fills(inst, st.profile, [GpuFill(entries=by_gpu[g].entries + extra[g],
                                                               max_loras=int(plan.gpus[g].max_loras)) for g in gs],
                                    st.config.objective, verifier)
            failing = [g for g, v in zip(gs, verdicts, strict=True) if not v.passed]
            judged = "twin"
        out[str(x)] = {"hosts": hosts, "passes": not failing and not unserved, "judged_by": judged,
                       "failing": failing, "unserved": unserved}
    return out


def _infeasible(scratch: Plan, config: PlaceConfig, previous: Previous, reason: str) -> Plan:
    return Plan(method=scratch.method, model=scratch.model, gpu_type=scratch.gpu_type, gpus=[], infeasible=True,
                reason=f"re-plan from {previous.path}: {reason}", settings=dict(scratch.settings),
                lower_bound=scratch.lower_bound, lower_bound_gpus=scratch.lower_bound_gpus)


def _report(plan: Plan, scratch: Plan, previous: Previous, st: _State, optional: int) -> dict:
    """``Plan.replan``: every load and unload with its reason, the counts, restarts, GPUs, the from-scratch
    plan's figures after the best matching, and ``moved_from`` for the next window."""
    prev = previous.plan
    present = set(st.inst.adapter_ids)
    before_ids = {a for g in prev.gpus for a in g.adapters}
    why_of = {st.inst.adapter_ids[e]: w for e, w in st.why.items()}
    changes = []
    matching = identity_matching(prev, plan)
    for p, n in matching:
        b = set(prev.gpus[p].adapters) if p is not None else set()
        a = set(plan.gpus[n].adapters) if n is not None else set()
        g = n if n is not None else p
        for x in sorted(b - a):
            changes.append({"adapter": x, "gpu": g, "op": "unload",
                            "reason": "gone" if x not in present else why_of.get(x, "needed")})
        for x in sorted(a - b):
            changes.append({"adapter": x, "gpu": g, "op": "load",
                            "reason": "new" if x not in before_ids else why_of.get(x, "needed")})
    counts = {r: sum(c["reason"] == r for c in changes) for r in REASONS}
    moved_from: dict[str, list[int]] = {}
    for c in changes:
        if c["op"] == "unload" and c["reason"] != "gone":
            moved_from.setdefault(c["adapter"], []).append(int(c["gpu"]))
    mine = churn(prev, plan, matching)
    restarts = [n for p, n in matching if p is not None and n is not None and prev.gpus[p].adapters
                and plan.gpus[n].adapters and needs_restart(prev.gpus[p].server, plan.gpus[n].server,
                                                            len(plan.gpus[n].adapters))]
    report = {
        "previous": previous.path, "max_moves": st.config.max_moves,
        "moves": {"total": len(changes), "loads": sum(c["op"] == "load" for c in changes),
                  "unloads": sum(c["op"] == "unload" for c in changes), **counts},
        "optional_budget_spent": optional,
        "restarts": restarts,
        "gpus": {"previous": prev.gpus_used, "now": plan.gpus_used,
                 "started": [n for p, n in matching if p is None and n is not None],
                 "released": [p for p, n in matching if n is None and p is not None]},
        "changes": changes,
        "moved_from": moved_from,
        "churn": mine,
    }
    if scratch.infeasible:
        report["from_scratch"] = {"infeasible": True, "reason": scratch.reason}
    else:
        m = best_matching(prev, scratch)
        report["from_scratch"] = {"gpus": scratch.gpus_used, **churn(prev, scratch, m),
                                  "matching": [[p, n] for p, n in m]}
    return report
