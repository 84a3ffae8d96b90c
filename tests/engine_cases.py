"""Random small engine cases shared by the engine tests (reference, properties, equivalence).

A case is fully determined by a ``CaseParams`` (a handful of scalars plus a seed for the arrays), so every
failure can be reproduced by pasting the printed ``CaseParams(...)`` into ``build_case``.

Two sources of ``CaseParams`` draw from the same distributions:

* ``case_params()``: a hypothesis strategy (shrinks the scalars, the arrays come from ``seed``);
* ``random_params(rng)``: a seeded ``numpy.random.Generator`` version, for plain loops.

The distributions are chosen to hit the corners of the semantics: tiny KV pools (preemption, and a few
pools too small for the largest first chunk), small token budgets (stalls, chunking), small
``max_num_seqs``, the client cap, cold and warm starts, ``N_cpu < N`` (disk loads), both LoRA forms,
scheduler terms that vary with ``W`` (and clip at 0), exact ties in arrival times, bursts, arrivals at
``t = 0`` and beyond the window. In *grid* cases every duration is a multiple of 2**-10 s and is
computed exactly in floating point, and arrivals lie on the same grid, so arrivals often fall exactly on
step boundaries (and timeline samples exactly on step ends).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
from hypothesis import strategies as st

from lorapack.twin.steptime import StepModel
from lorapack.twin.types import EngineConfig, EngineResult, RequestArrays

# LoRA cost per prefill token, separate from e1 (a newer StepModel field; optional here)
_HAS_E1P = "e1p_ms_per_prefill_token" in StepModel.__dataclass_fields__
_HAS_SHRINK = "shrink_grid_ms_per_kblock" in StepModel.__dataclass_fields__

GRID_S = 2.0**-10  # time grid of "grid" cases (s)
GRID_MS = 1000.0 * GRID_S  # = 0.9765625 ms, exact


@dataclass(frozen=True)
class CaseParams:
    """Scalars of one random case; ``seed`` drives the per-request and per-adapter arrays."""

    seed: int
    n_adapters: int
    max_loras: int
    max_cpu_loras: int
    grid: bool  # dyadic step-time constants and arrivals on the 2**-10 s grid
    lora_form: str
    kv_mode: str  # "starved" | "chunk" | "tight" | "small" | "roomy" (see build_case)
    kv_extra: int
    block_size: int
    max_num_batched_tokens: int
    max_num_seqs: int
    client_cap: int
    warm_gpu: bool
    warm_cpu: bool
    duration_s: float
    timeline_dt_s: float
    rate_rps: float  # total arrival rate
    max_requests: int
    len_mode: str  # "short" | "mixed" | "long"
    tie_mode: str  # "none" | "dups" | "bursts"
    zero_load_costs: bool
    snap_rounds: int  # rounds of moving arrivals exactly onto step ends of a reference run (see build_case)
    lru_mode: str = "vllm"  # "vllm" (default walk order) | "shuffled" (a drawn walk order) | "protected"


@dataclass
class Case:
    params: CaseParams | None  # None for hand-made cases
    cfg: EngineConfig
    req: RequestArrays
    step_model: StepModel
    name: str = ""


# ------------------------------------------------------------------------------------------- drawing


class _NumpyDrawer:
    def __init__(self, rng: np.random.Generator):
        self.rng = rng

    def integer(self, lo: int, hi: int) -> int:  # inclusive
        return int(self.rng.integers(lo, hi + 1))

    def real(self, lo: float, hi: float) -> float:
        return float(self.rng.uniform(lo, hi))

    def choice(self, options):
        return options[int(self.rng.integers(0, len(options)))]

    def chance(self, p: float) -> bool:
        return bool(self.rng.random() < p)


class _HypothesisDrawer:
    """Categorical choices through hypothesis (they shrink); numbers from a numpy generator seeded by
    hypothesis (hypothesis' own integer and float draws pile up on small and boundary values, which would
    make most cases trivial: a single request in a 5 s window)."""

    def __init__(self, draw):
        self.draw = draw
        self.numbers = _NumpyDrawer(np.random.default_rng(draw(st.integers(0, 2**32 - 1))))

    def integer(self, lo: int, hi: int) -> int:
        return self.numbers.integer(lo, hi)

    def real(self, lo: float, hi: float) -> float:
        return self.numbers.real(lo, hi)

    def choice(self, options):
        return self.draw(st.sampled_from(options))

    def chance(self, p: float) -> bool:
        return self.numbers.chance(p)


def _draw_params(d, max_adapters: int = 32, max_requests: int = 300) -> CaseParams:
    n_adapters = d.integer(1, max_adapters)
    if d.chance(0.4):
        max_loras = d.integer(1, min(4, n_adapters))
    else:
        max_loras = d.integer(1, n_adapters)
    if d.chance(0.5):
        max_cpu_loras = n_adapters
    else:
        max_cpu_loras = d.integer(max_loras, n_adapters)
    grid = d.chance(0.4)
    lora_form = d.choice(("additive", "additive", "multiplicative", "none"))
    kv_mode = d.choice(("starved", "chunk") + ("tight",) * 4 + ("small",) * 3 + ("roomy",))
    kv_extra = d.integer(0, 40)
    block_size = d.choice((16,) * 7 + (1, 4, 8))
    mnbt = d.choice((16, 17, 24, 31, 32, 48, 64, 100, 128, 256, 333, 512))
    mns = 2048 if d.chance(0.6) else d.integer(1, 8)
    client_cap = d.integer(1, 10) if d.chance(0.2) else 0
    warm_gpu = d.chance(0.7)
    warm_cpu = d.chance(0.7)
    if grid:
        duration_s = d.integer(5 * 1024, 60 * 1024) * GRID_S
        timeline_dt_s = d.integer(64, 4 * 1024) * GRID_S
    else:
        duration_s = d.real(5.0, 60.0)
        timeline_dt_s = d.real(0.05, 4.0)
    rate_rps = math.exp(d.real(math.log(0.1), math.log(15.0)))  # log-uniform: light to overloaded
    len_mode = d.choice(("short", "mixed", "mixed", "long"))
    tie_mode = d.choice(("none", "dups", "bursts"))
    zero_load_costs = d.chance(0.1)
    snap_rounds = d.choice((0, 1, 2, 3))
    lru_mode = d.choice(("vllm", "vllm", "shuffled", "protected"))
    seed = d.integer(0, 2**32 - 1)
    return CaseParams(
        seed=seed, n_adapters=n_adapters, max_loras=max_loras, max_cpu_loras=max_cpu_loras, grid=grid,
        lora_form=lora_form, kv_mode=kv_mode, kv_extra=kv_extra, block_size=block_size,
        max_num_batched_tokens=mnbt, max_num_seqs=mns, client_cap=client_cap, warm_gpu=warm_gpu,
        warm_cpu=warm_cpu, duration_s=duration_s, timeline_dt_s=timeline_dt_s, rate_rps=rate_rps,
        max_requests=max_requests, len_mode=len_mode, tie_mode=tie_mode, zero_load_costs=zero_load_costs,
        snap_rounds=snap_rounds, lru_mode=lru_mode)


def random_params(rng: np.random.Generator, max_adapters: int = 32, max_requests: int = 300) -> CaseParams:
    """Draw one ``CaseParams`` with a numpy generator."""
    return _draw_params(_NumpyDrawer(rng), max_adapters, max_requests)


@st.composite
def case_params(draw, max_adapters: int = 32, max_requests: int = 300) -> CaseParams:
    """Hypothesis strategy for ``CaseParams``."""
    return _draw_params(_HypothesisDrawer(draw), max_adapters, max_requests)


def cases(max_adapters: int = 32, max_requests: int = 300):
    """Hypothesis strategy for whole ``Case`` objects."""
    return case_params(max_adapters, max_requests).map(build_case)


# ------------------------------------------------------------------------------------------- building


def _step_model(p: CaseParams, rng: np.random.Generator) -> StepModel:
    extra = {}
    if p.grid:
        # every constant is a multiple of GRID_MS (or a dyadic fraction of it) so that every step time
        # is an exact multiple of a power of two in seconds and sums of step times are exact
        def g(lo: int, hi: int, frac: int = 1) -> float:
            return int(rng.integers(lo, hi + 1)) * GRID_MS / frac

        fine = rng.random() < 0.5  # per-token terms on a finer grid (fewer boundary hits, more variety)
        if _HAS_E1P and fine and rng.random() < 0.5:
            extra["e1p_ms_per_prefill_token"] = g(0, 2, 64)
        return StepModel(**extra,
            c0_ms=g(4, 40),
            c1_ms_per_req=g(0, 2),
            p1_ms_per_prefill_token=g(0, 2, 64) if fine else 0.0,
            a3_ms_per_kctx=0.0,
            lora_form=p.lora_form,
            e0_ms=g(0, 6),
            e1_ms_per_token=g(0, 2, 64) if fine else 0.0,
            e2_ms_per_adapter=g(0, 2),
            e3_ms_per_kreq_adapter=0.0,
            rank_scale=float(rng.choice([0.5, 1.0, 2.0])),
            k0_pct=float(rng.choice([100.0, 125.0, 150.0, 200.0])),
            k1_pct_per_adapter=float(rng.choice([0.0, 25.0])),
            sched_ms_per_running=g(0, 1, 4),
            sched_const_ms=g(-2, 2),
            sched_ms_per_waiting=g(0, 2, 8),
            sched_ms_per_waiting_slot_ratio=g(0, 1, 8),
            sched_baseline_ms=g(0, 3),
        )
    u = rng.uniform
    if _HAS_E1P and rng.random() < 0.5:
        extra["e1p_ms_per_prefill_token"] = u(0.0, 0.1)
    if rng.random() < 0.5:  # per-token terms with their own rank factor
        extra["rank_scale_token"] = u(0.5, 2.0)
    if _HAS_SHRINK and rng.random() < 0.5:  # the shrink kernel's grid over every slot
        extra["shrink_grid_ms_per_kblock"] = u(0.0, 2.0)
    return StepModel(**extra,
        c0_ms=u(3.0, 40.0),
        c1_ms_per_req=u(0.0, 1.5),
        p1_ms_per_prefill_token=u(0.0, 0.1),
        a3_ms_per_kctx=u(0.0, 5.0) if rng.random() < 0.5 else 0.0,
        lora_form=p.lora_form,
        e0_ms=u(0.0, 7.0),
        e1_ms_per_token=u(0.0, 0.1),
        e2_ms_per_adapter=u(0.0, 2.0),
        e3_ms_per_kreq_adapter=u(0.0, 30.0) if rng.random() < 0.5 else 0.0,
        rank_scale=u(0.5, 2.0),
        k0_pct=u(100.0, 250.0),
        k1_pct_per_adapter=u(0.0, 5.0),
        sched_ms_per_running=u(0.0, 0.3),
        sched_const_ms=u(-1.0, 1.0),
        sched_ms_per_waiting=u(0.0, 0.3),
        sched_ms_per_waiting_slot_ratio=u(0.0, 0.3),
        sched_baseline_ms=u(0.0, 1.5),
    )


def _lengths(mode: str, n: int, rng: np.random.Generator) -> np.ndarray:
    if mode == "short":
        return rng.integers(1, 21, n)
    if mode == "long":
        return rng.integers(100, 301, n)
    x = np.where(rng.random(n) < 0.3, rng.integers(1, 9, n), rng.integers(1, 301, n))
    return x


def _arrivals(p: CaseParams, rng: np.random.Generator) -> np.ndarray:
    horizon = p.duration_s * 1.15  # some arrivals fall beyond the window
    n_target = int(rng.poisson(p.rate_rps * horizon))
    n = min(max(n_target, 1), p.max_requests)
    t = np.sort(rng.uniform(0.0, horizon, n))
    if p.tie_mode == "dups" and n > 1:
        dup = rng.random(n - 1) < 0.3
        for j in np.nonzero(dup)[0] + 1:
            t[j] = t[j - 1]
    elif p.tie_mode == "bursts":
        n_bursts = int(rng.integers(1, 4))
        for _ in range(n_bursts):
            j = int(rng.integers(0, n))
            k = int(rng.integers(2, 12))
            t[j:j + k] = t[j]
        t = np.sort(t)
    if p.grid:
        t = np.floor(t / GRID_S) * GRID_S
    if rng.random() < 0.3:
        t[0] = 0.0
    if rng.random() < 0.2:
        t[rng.integers(0, n)] = p.duration_s  # an arrival exactly at the window end
    return np.sort(t)


def build_case(p: CaseParams) -> Case:
    """Build the ``EngineConfig`` and ``RequestArrays`` of ``p`` (deterministic in ``p``)."""
    rng = np.random.default_rng(p.seed)
    model = _step_model(p, rng)
    n_ad = p.n_adapters

    t = _arrivals(p, rng)
    n = len(t)
    # skewed adapter popularity: hot and cold adapters
    weights = rng.pareto(1.0, n_ad) + 0.05 if rng.random() < 0.7 else np.ones(n_ad)
    adapter = rng.choice(n_ad, size=n, p=weights / weights.sum())
    prompt = _lengths(p.len_mode, n, rng)
    output = _lengths(p.len_mode if rng.random() < 0.5 else "mixed", n, rng)
    order = np.lexsort((adapter, t))  # sorted by time, ties by adapter (RequestArrays convention)
    req = RequestArrays(t_arr_s=t[order], adapter=adapter[order], prompt_tokens=prompt[order],
                        output_tokens=output[order])

    if p.zero_load_costs:
        load_ms = np.zeros(n_ad)
        disk_ms = np.zeros(n_ad)
    elif p.grid:
        load_ms = rng.integers(0, 16, n_ad) * GRID_MS
        disk_ms = rng.integers(0, 128, n_ad) * GRID_MS
    else:
        load_ms = rng.uniform(0.0, 15.0, n_ad)
        disk_ms = rng.uniform(0.0, 150.0, n_ad)

    # KV pool: "starved" = the largest first chunk never fits; "chunk" = the largest first chunk fits but
    # the largest request may not (it then preempts itself again and again); "tight" = the largest request
    # fits alone (heavy preemption); "small" = a few requests fit; "roomy" = no KV pressure
    bs = p.block_size
    first_chunk = int(np.minimum(req.prompt_tokens, p.max_num_batched_tokens).max())
    chunk_blocks = math.ceil(first_chunk / bs)
    request_blocks = math.ceil(int((req.prompt_tokens + req.output_tokens).max()) / bs)
    if p.kv_mode == "starved" and chunk_blocks > 1:
        kv_blocks = 1 + p.kv_extra % (chunk_blocks - 1)
    elif p.kv_mode in ("chunk", "starved"):
        kv_blocks = chunk_blocks + p.kv_extra % 5
    elif p.kv_mode == "tight":
        kv_blocks = request_blocks + p.kv_extra % 5
    elif p.kv_mode == "small":
        kv_blocks = request_blocks + p.kv_extra * max(1, 16 // bs)
    else:
        kv_blocks = 100_000

    cfg = EngineConfig(
        load_ms=load_ms, disk_ms=disk_ms, max_loras=p.max_loras, max_cpu_loras=p.max_cpu_loras,
        kv_blocks=kv_blocks, step_coef=model.to_array(), duration_s=p.duration_s,
        max_num_seqs=p.max_num_seqs, max_num_batched_tokens=p.max_num_batched_tokens, block_size=bs,
        warm_gpu=p.warm_gpu, warm_cpu=p.warm_cpu, client_cap=p.client_cap, timeline_dt_s=p.timeline_dt_s,
        lru_protects_batch=p.lru_mode == "protected",
        adapter_order=rng.permutation(n_ad) if p.lru_mode == "shuffled" else None)
    for _ in range(p.snap_rounds):
        req = _snap_to_step_end(cfg, req, rng)
    return Case(params=p, cfg=cfg, req=req, step_model=model)


def _snap_to_step_end(cfg: EngineConfig, req: RequestArrays, rng: np.random.Generator) -> RequestArrays:
    """Move the first 1-3 arrivals at or after a step end ``b`` of a reference run exactly onto ``b``.

    Nothing before ``b`` changes (those arrivals came later), so ``b`` stays a step end: the moved
    arrivals land exactly on a step boundary (and tie with each other).
    """
    from lorapack.twin.reference import run_reference  # the generator needs the engine's step ends

    _, trace = run_reference(cfg, req, record_steps=True)
    ends = [s.t_end for s in trace.steps if s.t_end < cfg.duration_s]
    t = req.t_arr_s.copy()
    if not ends:
        return req
    b = ends[int(rng.integers(0, len(ends)))]
    j = int(np.searchsorted(t, b, side="left"))
    if j == len(t):
        return req
    t[j:j + int(rng.integers(1, 4))] = b
    order = np.lexsort((req.adapter, t))
    return RequestArrays(t_arr_s=t[order], adapter=req.adapter[order], prompt_tokens=req.prompt_tokens[order],
                         output_tokens=req.output_tokens[order])


# ------------------------------------------------------------------------------------------- diagnostics


def describe_case(case: Case) -> str:
    """A short, reproducible description of a case."""
    cfg, req = case.cfg, case.req
    lines = [
        f"reproduce: build_case({case.params!r})" if case.params is not None else f"corner case {case.name!r}",
        (f"N={cfg.n_adapters} A={cfg.max_loras} N_cpu={cfg.max_cpu_loras} kv_blocks={cfg.kv_blocks} "
         f"BS={cfg.block_size} MNBT={cfg.max_num_batched_tokens} MNS={cfg.max_num_seqs} "
         f"cap={cfg.client_cap} warm_gpu={cfg.warm_gpu} warm_cpu={cfg.warm_cpu} "
         f"T={cfg.duration_s!r} dt_tl={cfg.timeline_dt_s!r} n_req={len(req)}"),
        f"step model: {asdict(case.step_model)}",
    ]
    return "\n".join(lines)


def describe_request(case: Case, r: int) -> str:
    req = case.req
    return (f"request {r}: t_arr={req.t_arr_s[r]!r} adapter={int(req.adapter[r])} "
            f"P={int(req.prompt_tokens[r])} O={int(req.output_tokens[r])}")


def _rel_close(a: np.ndarray, b: np.ndarray, rtol: float) -> np.ndarray:
    """Elementwise: equal NaN positions and |a - b| <= rtol * max(|a|, |b|) (exact equality passes)."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    na, nb = np.isnan(a), np.isnan(b)
    with np.errstate(invalid="ignore"):
        close = (a == b) | (np.abs(a - b) <= rtol * np.maximum(np.abs(a), np.abs(b)))
    return np.where(na | nb, na & nb, close)


def compare_results(case: Case, ref: EngineResult, other: EngineResult, rtol: float = 1e-9) -> list[str]:
    """Differences between two results of the same case (empty list = equivalent)."""
    problems: list[str] = []
    n = len(case.req)
    per_request = {}
    for name in ("t_sent_s", "t_first_s", "t_finish_s"):
        a, b = getattr(ref, name), getattr(other, name)
        if len(b) != n:
            problems.append(f"{name}: length {len(b)} != {n}")
            continue
        per_request[name] = ~_rel_close(a, b, rtol)
    b_pre = np.asarray(other.n_preempted)
    if len(b_pre) != n:
        problems.append(f"n_preempted: length {len(b_pre)} != {n}")
    else:
        per_request["n_preempted"] = np.asarray(ref.n_preempted) != b_pre
    bad = np.zeros(n, dtype=bool)
    for m in per_request.values():
        bad |= m
    if bad.any():
        r = int(np.argmax(bad))
        fields = [k for k, m in per_request.items() if m[r]]
        problems.append(
            f"{int(bad.sum())} requests differ; first: {describe_request(case, r)}; fields {fields}: "
            + ", ".join(f"{k} ref={getattr(ref, k)[r]!r} other={getattr(other, k)[r]!r}" for k in fields))
    if ref.n_merged is not None and other.n_merged is not None:
        merged = np.flatnonzero(np.asarray(ref.n_merged) != np.asarray(other.n_merged))
        if len(merged):
            problems.append(f"n_merged: {len(merged)} requests differ; first {int(merged[0])}: "
                            f"ref={int(ref.n_merged[merged[0]])} other={int(other.n_merged[merged[0]])}")
    for name in ("n_steps", "n_preemptions", "n_gpu_loads", "n_disk_loads", "held_end", "n_scrapes", "label_series"):
        if int(getattr(ref, name)) != int(getattr(other, name)):
            problems.append(f"{name}: ref={getattr(ref, name)} other={getattr(other, name)}")
    for name in ("busy_s", "sched_s", "load_s", "scrape_s"):
        if not _rel_close(np.array([getattr(ref, name)]), np.array([getattr(other, name)]), rtol)[0]:
            problems.append(f"{name}: ref={getattr(ref, name)!r} other={getattr(other, name)!r}")
    if ref.gap_hist is not None and other.gap_hist is not None:
        # every inter-token gap in the same bin (event times agree, so the gaps do)
        diff = np.flatnonzero(np.asarray(ref.gap_hist) != np.asarray(other.gap_hist))
        if len(diff):
            k = int(diff[0])
            problems.append(f"gap_hist: {len(diff)} bins differ; first bin {k}: ref={int(ref.gap_hist[k])} "
                            f"other={int(other.gap_hist[k])} (totals {int(ref.gap_hist.sum())} / "
                            f"{int(other.gap_hist.sum())})")
    elif (ref.gap_hist is None) != (other.gap_hist is None):
        problems.append("gap_hist: kept by one engine only")
    for col, a in ref.timeline.items():
        if col not in other.timeline:
            problems.append(f"timeline column {col} missing")
            continue
        b = np.asarray(other.timeline[col])
        if b.shape != a.shape:
            problems.append(f"timeline {col}: shape {b.shape} != {a.shape}")
            continue
        diff = ~_rel_close(a, b, rtol)
        if diff.any():
            k = int(np.argmax(diff))
            problems.append(f"timeline {col}: {int(diff.sum())} samples differ; first k={k} "
                            f"t={ref.timeline['t_s'][k]!r} ref={a[k]!r} other={b[k]!r}")
    return problems


# ------------------------------------------------------------------------------------------- corner cases


# adapters 1 and 2 start resident (warm) and in the batch; walked 2 before 1, so 2 is older; when 1's request
# ends and 0's joins, walking 0 first evicts 2 (in the batch, not walked yet), which is loaded again at its turn
CASCADE_ROWS = [(0.0, 1, 1, 2), (0.0, 2, 1, 10), (1.5 / 64.0, 0, 1, 2)]


def corner_cases() -> list[Case]:
    """Hand-made cases around the corners of the semantics (all with 1/64 s steps unless noted)."""
    unit = StepModel(c0_ms=15.625, c1_ms_per_req=0.0, lora_form="none")
    dt = 1.0 / 64.0

    def case(name, rows, n_adapters=1, model=unit, **kw) -> Case:
        t, a, p, o = zip(*rows, strict=True)
        req = RequestArrays(t_arr_s=np.array(t), adapter=np.array(a), prompt_tokens=np.array(p),
                            output_tokens=np.array(o))
        base = dict(load_ms=np.zeros(n_adapters), disk_ms=np.zeros(n_adapters), max_loras=1,
                    max_cpu_loras=n_adapters, kv_blocks=1000, duration_s=4.0, timeline_dt_s=dt)
        base.update(kw)
        cfg = EngineConfig(step_coef=model.to_array(), **base)
        return Case(params=None, cfg=cfg, req=req, step_model=model, name=name)

    lru = dict(n_adapters=5, max_loras=2, max_cpu_loras=3, load_ms=np.array([1.0, 2, 4, 8, 16]),
               disk_ms=np.array([100.0, 200, 400, 800, 1600]))
    lru_rows = [(0.0, 4, 1, 1), (0.25, 2, 1, 1), (0.5, 0, 1, 1), (0.75, 3, 1, 2), (0.75, 1, 1, 1)]
    return [
        case("max_loras skip", [(0.0, 0, 4, 10), (0.0, 1, 4, 3), (dt, 0, 4, 3)], n_adapters=2),
        case("big non-allowed head", [(0.0, 0, 16, 40), (0.0, 1, 150, 1), (dt, 0, 16, 2)], n_adapters=2,
             kv_blocks=10),
        case("big allowed head", [(0.0, 0, 16, 40), (0.0, 0, 150, 1), (dt, 0, 16, 2)], n_adapters=2,
             kv_blocks=10),
        case("three victims", [(0.0, 0, 16, 20), (0.0, 0, 16, 30), (0.0, 0, 16, 25)], kv_blocks=3),
        case("preempt without admission", [(0.0, 0, 16, 30), (0.0, 0, 48, 30)], kv_blocks=4,
             max_num_batched_tokens=17),
        case("self preemption then idle", [(0.0, 0, 16, 3), (1.0, 0, 1, 1)], kv_blocks=1, duration_s=3.0),
        case("block boundary fits", [(0.0, 0, 10, 23)], kv_blocks=2),
        case("block boundary preempts", [(0.0, 0, 10, 24)], kv_blocks=2),
        case("first chunk too big", [(0.0, 0, 33, 1), (0.5, 0, 1, 1)], kv_blocks=2),
        case("budget chunks", [(0.0, 0, 1, 20), (0.0, 0, 1, 20), (0.0, 0, 10, 5), (0.0, 0, 1, 3)],
             max_num_batched_tokens=4),
        case("max_num_seqs 1", [(0.0, 0, 1, 5), (0.0, 0, 1, 1)], max_num_seqs=1),
        case("arrival on step boundary", [(0.0, 0, 1, 3), (0.0, 0, 1, 3), (dt, 0, 1, 1),
                                          (dt + 2.0**-20, 0, 1, 1)], max_num_batched_tokens=2),
        case("client cap", [(0.0, 0, 1, 10), (0.0, 1, 1, 1), (dt / 2, 0, 1, 1), (20 * dt, 0, 1, 1)],
             n_adapters=2, client_cap=1, duration_s=1.0),
        case("client cap never sent", [(0.0, 0, 1, 1000), (0.0, 1, 1, 1), (0.1, 0, 1, 1)], n_adapters=2,
             client_cap=1, duration_s=0.5),
        case("window end mid-step", [(0.0, 0, 1, 65), (1.0 + dt / 4, 0, 1, 1), (1.0 + dt / 2, 0, 1, 1)],
             duration_s=1.0 + dt / 2),
        case("idle gap", [(0.0, 0, 1, 2), (5.0, 0, 1, 2)], duration_s=10.0, timeline_dt_s=0.5),
        case("lru warm", lru_rows, **lru),
        case("lru cold", lru_rows, warm_gpu=False, warm_cpu=False, **lru),
        case("lru warm gpu only", lru_rows, warm_gpu=True, warm_cpu=False, **lru),
        case("lru warm cpu only", lru_rows, warm_gpu=False, warm_cpu=True, **lru),
        case("cpu eviction leaves gpu", [(0.0, 0, 1, 1), (1.0, 1, 1, 1), (1.5, 2, 3, 3)], n_adapters=3,
             max_loras=2, max_cpu_loras=2, load_ms=np.array([5.0, 6, 7]), disk_ms=np.array([100.0, 200, 300])),
        case("cpu lru ties", [(0.0, 0, 1, 1), (0.0, 1, 1, 1), (1.0, 2, 1, 1), (2.0, 0, 1, 1), (2.5, 1, 1, 1)],
             n_adapters=3, max_loras=2, max_cpu_loras=2, warm_gpu=False, warm_cpu=False,
             load_ms=np.array([1.0, 2, 4]), disk_ms=np.array([10.0, 20, 40])),
        case("gpu lru ties", [(0.0, 0, 1, 1), (0.0, 1, 1, 1), (1.0, 2, 1, 1), (2.0, 3, 1, 1)], n_adapters=4,
             max_loras=3, warm_gpu=False),
        case("more slots than adapters", [(0.0, 0, 1, 1), (0.0, 1, 1, 1), (0.0, 2, 1, 1)], n_adapters=3,
             max_loras=5, max_cpu_loras=5),
        *[case(f"lru eviction cascade{suffix}", CASCADE_ROWS, n_adapters=3, max_loras=2, max_cpu_loras=3,
               adapter_order=np.array([0, 2, 1]), load_ms=np.array([1.0, 2, 4]), lru_protects_batch=protect)
          for suffix, protect in (("", False), (" (protected batch)", True))],
        case("no requests in window", [(4.0, 0, 1, 1), (5.0, 0, 1, 1)]),
        case("timeline dt larger than window", [(0.0, 0, 5, 5)], timeline_dt_s=10.0),
    ]


def assert_engines_agree(case: Case, **fast_options) -> None:
    """The fast engine (``simulate_fast(..., **fast_options)``) reproduces the reference engine on ``case``
    (``compare_results``, 1e-9 relative); a failure prints the case and what differs."""
    import pytest

    from lorapack.twin.engine import simulate_fast
    from lorapack.twin.reference import simulate_reference

    problems = compare_results(case, simulate_reference(case.cfg, case.req),
                               simulate_fast(case.cfg, case.req, **fast_options), rtol=1e-9)
    if problems:
        pytest.fail("fast engine differs from the reference engine\n" + describe_case(case) + "\n"
                    + "\n".join(problems), pytrace=False)
