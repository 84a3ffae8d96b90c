"""Methods that place onto a *given* number of GPUs (placement.md §4.3-4.6): ``proposed-lat``, ``dlora``,
``loraserve``, ``least-adapters`` and ``round-robin``. The GPU count comes from the fixed pool or from the
smallest-pool search (``search.py``).

Each returns an ``Assignment``: GPUs with their entries (registration order), the share of each entry's
requests they receive (``shares``; 1.0 for single-replica methods), ``--max-loras``, and whether the method
itself accepts the result (``accepted``; e.g. LoRAServe's ``targetUtil <= 1``, ProposedLat's validation).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ..objective import Objective
from ..oracle import Oracle, default_slot_rank
from ..profile import Profile
from ..twin.jitcache import lazy_njit
from .greedy import SLOT_GRID, GpuFill, GreedyOptions, MemoryRule
from .problem import Instance

# LoRAServe's operating points of the paper (tokens/s per GPU serving one rank), a reference profile;
# lorapack derives its own from the twin (``bound.gpu_capacity``).
LORASERVE_PAPER_OP_TOK_S = {
    "llama-3.1-8b-instruct": {8: 15063.6, 16: 14731.5, 32: 14496.4},
    "qwen-2.5-7b-instruct": {8: 15633.4, 16: 15537.1, 32: 15536.1},
}


@dataclass
class Assignment:
    gpus: list[GpuFill]
    accepted: bool = True
    reason: str = ""
    extra: dict = field(default_factory=dict)


def _fills(hosts: list[list[int]], shares: list[list[float]] | None = None) -> list[GpuFill]:
    out = []
    for g, h in enumerate(hosts):
        if h:
            f = GpuFill(entries=list(h), max_loras=len(h))
            if shares is not None:
                f.extra["shares"] = list(shares[g])
            out.append(f)
    return out


def shares_of(fill: GpuFill) -> list[float]:
    return fill.extra.get("shares") or [1.0] * len(fill.entries)


# ---------------------------------------------------------------------------------------------------------
# AIBrix least-adapters (§4.6) and round-robin


def least_adapters(inst: Instance, gpus: int, fixed_max_loras: int | None = None) -> Assignment:
    """Each adapter (input order) onto the GPU with the fewest adapters (ties: lowest index); every adapter
    resident (``A = |I_g|``), or ``A = min(fixed_max_loras, |I_g|)`` for the ``fixed`` variant."""
    # the fewest-adapters GPU (ties: lowest index) cycles through the indices: entry i -> GPU i mod G
    fills = _fills([list(range(g, inst.n, gpus)) for g in range(gpus)])
    if fixed_max_loras is not None:
        for f in fills:
            f.max_loras = min(int(fixed_max_loras), len(f.entries))
    return Assignment(fills)


def round_robin(inst: Instance, profile: Profile, gpus: int, oracle: Oracle, objective: Objective,
                options: GreedyOptions = GreedyOptions()) -> Assignment:
    """Adapters dealt evenly in input order (entry i -> GPU i mod G) with ONE ``--max-loras`` for every GPU:
    the slot value (grid values up to the largest GPU's adapter count, and that count) with which every GPU
    meets the objective in ``oracle``'s opinion and the total throughput is highest (ties: larger A); when
    none does, the value with the fewest failing GPUs (not accepted)."""
    hosts = [list(range(g, inst.n, gpus)) for g in range(gpus)]
    hosts = [h for h in hosts if h]
    mem = MemoryRule(profile)
    n_top = max(len(h) for h in hosts)
    slots = [default_slot_rank(int(inst.ranks[h].max())) for h in hosts]
    avals = [a for a in sorted({x for x in options.slot_grid if x < n_top} | {n_top})
             if all(mem.ok(min(a, len(h)), s) for h, s in zip(hosts, slots, strict=True))]
    if not avals:
        return Assignment(_fills(hosts), accepted=False, reason="no uniform --max-loras starts on every GPU")
    keys, cands = [], []
    for a in avals:
        for g, h in enumerate(hosts):
            keys.append((a, g))
            cands.append(inst.candidate(profile, h, min(a, len(h))))
    preds = dict(zip(keys, oracle.predict(cands), strict=True))
    scored = []
    for a in avals:
        fails = sum(objective.check(preds[(a, g)]) is not None for g in range(len(hosts)))
        thr = sum(p.throughput_tok_s for p in (preds[(a, g)] for g in range(len(hosts)))
                  if math.isfinite(p.throughput_tok_s))
        scored.append((fails, -thr, -a, a))
    ok = [s for s in scored if s[0] == 0]
    if ok:
        # highest total throughput among the A that work, ties (within the tolerance) -> larger A
        top = -min(s[1] for s in ok)
        a_best = max(s[3] for s in ok if -s[1] >= top * (1 - options.tie_tolerance))
    else:
        a_best = min(scored)[3]
    fills = _fills(hosts)
    for g, f in enumerate(fills):
        f.max_loras = min(a_best, len(f.entries))
        f.prediction = preds[(a_best, g)]
    bad = [g for g in range(len(hosts)) if objective.check(preds[(a_best, g)]) is not None]
    return Assignment(fills, accepted=not bad, reason=f"{len(bad)} GPU(s) fail with every uniform --max-loras"
                      if bad else "", extra={"uniform_max_loras": a_best, "tried_max_loras": avals})


# ---------------------------------------------------------------------------------------------------------
# ProposedLat (§4.3)


def proposed_lat(inst: Instance, profile: Profile, gpus: int, oracle: Oracle, objective: Objective,
                 paper_rule: bool = False, lpt: bool = False) -> Assignment:
    """Balanced by rate (input order, or descending rate with ``lpt``) onto the least-loaded GPU, every
    adapter resident; accepted when every GPU starts and (lorapack's stricter rule, default) every GPU meets
    the objective in the oracle's opinion, or (``paper_rule``) the fleet's predicted throughput + 400 tok/s
    is within 10 % SMAPE of the ideal."""
    hosts: list[list[int]] = [[] for _ in range(gpus)]
    load = np.zeros(gpus)
    order = sorted(range(inst.n), key=lambda i: (-inst.rates_rps[i], i)) if lpt else range(inst.n)
    for i in order:
        g = int(np.argmin(load))
        hosts[g].append(i)
        load[g] += inst.rates_rps[i]
    fills = _fills(hosts)
    mem = MemoryRule(profile)
    for f in fills:
        s = default_slot_rank(int(inst.ranks[f.entries].max()))
        if not mem.ok(f.max_loras, s):
            return Assignment(fills, accepted=False, reason=f"--max-loras {f.max_loras} (every adapter "
                              f"resident) does not start with --max-lora-rank {s}")
    preds = oracle.predict([inst.candidate(profile, f.entries, f.max_loras) for f in fills])
    for f, p in zip(fills, preds, strict=True):
        f.prediction = p
    if paper_rule:
        pred = sum(p.throughput_tok_s for p in preds) + 400.0
        ideal = float(inst.demand_tok_s.sum())
        smape = 2 * (ideal - pred) / (ideal + pred)
        return Assignment(fills, accepted=smape <= 0.1, reason="" if smape <= 0.1 else
                          f"predicted fleet throughput {pred:,.0f} tok/s is below the ideal {ideal:,.0f}")
    bad = [(g, why) for g, p in enumerate(preds) if (why := objective.check(p)) is not None]
    return Assignment(fills, accepted=not bad,
                      reason=f"GPU {bad[0][0]} predicted to fail ({bad[0][1]})" if bad else "")


# ---------------------------------------------------------------------------------------------------------
# dLoRA proactive placement (§4.4)


def dlora_slot_weight(profile: Profile, rank: int) -> int:
    """KV tokens per adapter slot: max over the slot grid of (KV0 - T_max(A, S)) / A, KV0 the KV cache without
    LoRA (the profile's value, else its LoRA-enabled base)."""
    m = profile.memory
    kv0 = m.kv_tokens_no_lora if m.kv_tokens_no_lora is not None else m.kv_tokens_base
    s = default_slot_rank(rank)
    vals = [(kv0 - profile.kv_tokens(a, s)) / a for a in SLOT_GRID if profile.kv_tokens(a, s) > 0]
    return int(round(max(vals))) if vals else int(round(m.kv_tokens_per_slot_rank * s + m.kv_tokens_per_slot))


@lazy_njit()  # compiled at its first call; cached in the user cache directory, never the package
def _dlora_first_phase(expected: np.ndarray) -> np.ndarray:  # pragma: no cover - compiled
    """The order in which the selection rule allocates each adapter's first replica (see ``dlora``)."""
    m = len(expected)
    unalloc = np.ones(m, dtype=np.bool_)
    cur = np.zeros(m)
    order = np.empty(m, dtype=np.int64)
    u0 = 0
    r = 0.0
    for step in range(m):
        while not unalloc[u0]:
            u0 += 1
        inv = 1.0 / (r + 1e-7)
        nxt = 0
        s_nxt = cur[0] * inv - expected[0]
        for i in range(m):
            s_i = cur[i] * inv - expected[i]
            if s_i < s_nxt:
                nxt, s_nxt = i, s_i
            if not unalloc[nxt]:
                nxt, s_nxt = u0, cur[u0] * inv - expected[u0]
        order[step] = nxt
        unalloc[nxt] = False
        cur[nxt] = 1.0
        r += 1.0
    return order


def _tolerance(mem_sum: np.ndarray, expected: np.ndarray) -> np.ndarray:
    """dLoRA's burst tolerance per adapter, ``Σ mem / E_i``; an adapter expecting no requests tolerates any
    burst (+inf: it never sets the minimum)."""
    out = np.full(len(expected), np.inf)
    np.divide(mem_sum, expected, out=out, where=expected > 0)
    return out


def dlora(inst: Instance, profile: Profile, gpus: int) -> Assignment:
    """dLoRA's proactive placement as re-implemented by the paper (placement.md §4.4): replicas added while
    the burst tolerance ``min_i (Σ_{g ∋ i} mem_g) / E_i`` does not drop, then topped up to ``G + M - 1``
    replicas. Every placed adapter is resident (no memory check: too many adapters is a memory error in
    verification); requests are routed uniformly over an adapter's replicas."""
    m, g_n = inst.n, gpus
    m_ = profile.memory
    kv0 = float(m_.kv_tokens_no_lora if m_.kv_tokens_no_lora is not None else m_.kv_tokens_base)
    w = float(dlora_slot_weight(profile, int(inst.ranks.max())))
    e = inst.rates_rps * 3600.0  # expected requests per hour (>= 0: an adapter at rate 0 is placed too)
    mem = np.full(g_n, kv0)
    host = np.zeros((m, g_n), dtype=np.bool_)
    hosts: list[list[int]] = [[] for _ in range(g_n)]
    cur = np.zeros(m)
    n_rep = 0

    def add(i: int, g: int) -> None:
        nonlocal n_rep
        host[i, g] = True
        hosts[g].append(i)
        mem[g] -= w
        cur[i] += 1
        n_rep += 1

    # phase 1: while some adapter has no replica the tolerance is 0, so each allocation is accepted on the
    # GPU with the fewest adapters (stable by index)
    for step, i in enumerate(_dlora_first_phase(e)):
        add(int(i), step % g_n)  # all GPUs start empty: the fewest-adapters GPU cycles through the indices
    # phase 2: more replicas while the tolerance does not drop
    s = host.astype(np.float64) @ mem  # Σ mem over each adapter's hosts
    best = float(np.min(_tolerance(s, e)))
    while True:
        nxt = int(np.argmin(cur / (n_rep + 1e-7) - e))
        updated = False
        for g in sorted(range(g_n), key=lambda g: (len(hosts[g]), g)):
            if host[nxt, g]:
                continue
            s_new = s - w * host[:, g]
            s_new[nxt] += mem[g] - w
            bt = float(np.min(_tolerance(s_new, e)))
            if bt >= best:
                add(nxt, g)
                s, best, updated = s_new, bt, True
                break
        if not updated:
            break
    # top-up: at least G + M - 1 replicas
    eg, t = 0, 0
    while n_rep < g_n + m - 1:
        while len(hosts[eg]) == m:
            eg = (eg + 1) % g_n
        while host[t, eg]:
            t = (t + 1) % m
        add(t, eg)
        eg, t = (eg + 1) % g_n, (t + 1) % m
    shares = [[1.0 / cur[i] for i in h] for h in hosts]
    return Assignment(_fills(hosts, shares), extra={"replicas": int(n_rep), "slot_weight_kv_tokens": w})


# ---------------------------------------------------------------------------------------------------------
# LoRAServe (§4.5)


def hamilton(weights: dict[int, float], total: int) -> dict[int, int]:
    """Largest-remainder apportionment of ``total`` seats over ``weights`` (summing to ``total``): floors
    first, then +1 to the largest fractional remainders (ties: larger key first). Zero weights get 0."""
    floors = {k: int(math.floor(v + 1e-12)) for k, v in weights.items()}
    left = total - sum(floors.values())
    rem = sorted((k for k, v in weights.items() if v > 0), key=lambda k: (-(weights[k] - floors[k]), -k))
    for k in rem[:max(left, 0)]:
        floors[k] += 1
    return floors


def loraserve(inst: Instance, gpus: int, op_tok_s: dict[int, float]) -> Assignment:
    """LoRAServe's rank-aware fractional placement as re-created by the paper (placement.md §4.5, steps 1-4
    and 6; PermuteAssignment is the identity in a one-shot placement). ``op_tok_s``: tokens/s one GPU sustains
    per (slot) rank."""
    d = inst.demand_tok_s
    ranks = sorted({int(r) for r in inst.ranks}, reverse=True)
    op = {r: float(op_tok_s[default_slot_rank(r)]) for r in ranks}
    rank_util = {r: float(d[inst.ranks == r].sum()) / op[r] for r in ranks}
    u = sum(rank_util.values())
    target = u / gpus
    budget = hamilton({r: rank_util[r] / target for r in ranks}, gpus) if target > 0 else {r: 0 for r in ranks}
    # disjoint GPU groups by index, highest rank first
    groups: dict[int, list[int]] = {}
    nxt = 0
    for r in ranks:
        groups[r] = list(range(nxt, nxt + budget[r]))
        nxt += budget[r]
    load = np.zeros(gpus)
    max_rank = np.zeros(gpus, dtype=np.int64)
    frac: list[dict[int, float]] = [{} for _ in range(gpus)]  # per GPU: entry -> share (insertion order)
    leftovers: list[tuple[int, float]] = []
    for r in ranks:
        members = sorted(np.flatnonzero(inst.ranks == r).tolist(), key=lambda i: (-d[i], i))
        grp = groups[r]
        if not grp:
            leftovers.extend((i, 1.0) for i in members)
            continue
        cap = target * op[r]
        for i in members:
            if d[i] <= 0:
                g = min(grp, key=lambda g: (load[g], g))
                frac[g][i] = frac[g].get(i, 0.0) + 1.0
                max_rank[g] = max(max_rank[g], r)
                continue
            remaining = d[i]
            for g in sorted(grp, key=lambda g: load[g]):  # stable: ties by index
                room = cap - load[g]
                if room <= 1e-12:
                    continue
                take = min(room, remaining)
                load[g] += take
                frac[g][i] = frac[g].get(i, 0.0) + take / d[i]
                max_rank[g] = max(max_rank[g], r)
                remaining -= take
                if remaining <= 1e-12 * d[i]:
                    remaining = 0.0
                    break
            if remaining > 0:
                leftovers.append((i, remaining / d[i]))
    # AllocateHighestMaxRank: whole remaining fraction onto the least-loaded GPU that already serves the rank
    seen: set[int] = set()
    lo = [(i, f) for i, f in leftovers if not (i in seen or seen.add(i))]
    for i, f in sorted(lo, key=lambda t: -int(inst.ranks[t[0]])):
        r = int(inst.ranks[i])
        ok = [g for g in range(gpus) if max_rank[g] >= r]
        g = min(ok or range(gpus), key=lambda g: (load[g], g))
        load[g] += f * d[i]
        frac[g][i] = frac[g].get(i, 0.0) + f
        max_rank[g] = max(max_rank[g], r)
    hosts = [list(fr) for fr in frac]
    shares = [list(fr.values()) for fr in frac]
    return Assignment(_fills(hosts, shares), accepted=target <= 1.0 + 1e-9,
                      reason="" if target <= 1.0 + 1e-9 else
                      f"target utilisation {target:.2f} > 1: not enough GPUs for LoRAServe",
                      extra={"target_util": target, "budget": {str(r): budget[r] for r in ranks},
                             "leftovers": len(lo)})


def loraserve_min_gpus(inst: Instance, op_tok_s: dict[int, float]) -> int:
    """The smallest G LoRAServe accepts: ceil(U)."""
    d = inst.demand_tok_s
    u = sum(float(d[inst.ranks == r].sum()) / float(op_tok_s[default_slot_rank(int(r))])
            for r in {int(x) for x in inst.ranks})
    return max(1, math.ceil(u - 1e-9))
