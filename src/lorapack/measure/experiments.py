"""The designed experiments of ``lorapack measure`` (docs/profile-your-gpu.md): each sends its traffic within its
share of the budget (``seconds``; the closed-loop points are time-boxed, prefill and loading are short fixed
designs that finish well inside theirs) and returns rows for one CSV of the measurement directory.

* ``decode``: closed-loop concurrency ladders (short prompts; then long prompts for the context term): the
  engine's inter-token interval against the running batch;
* ``prefill``: one request at a time, output 1 token, prompts around the token budget: time to first token
  against prompt tokens and chunks; streamed, so the API server's share of TTFT is measured too;
* ``lora``: the same closed-loop load spread over 1..A adapters, each point next to the base model at the same
  concurrency: LoRA cost against the batch and the distinct adapters in it;
* ``loading``: one request at a time to an adapter that is warm, evicted from the GPU slots (after requests to
  ``--max-loras`` others) and evicted from the CPU cache (after ``--max-cpu-loras`` others);
* ``runs``: Poisson arrivals over the adapters at several loads (some beyond capacity), windowed, in the runs
  schema of ``shared/data/real-runs/calibration.csv`` (``calibrate --runs``, ``validate``).

Times are the engine's own when the server sends per-request metrics (``--enable-per-request-metrics``),
else the client's (streamed: first chunk and last chunk).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from .probe import Http, Identity, MeasureError, scrape
from .runs import ttft_ms
from .traffic import ClosedLoad, closed_loop, tpot_ms


@dataclass
class Caps:
    """Limits on the traffic ``measure`` sends (flags with safe defaults)."""

    max_concurrency: int = 64
    max_rate_rps: float = 50.0
    max_prompt_tokens: int = 4096
    max_output_tokens: int = 256


@dataclass
class Context:
    http: Http
    identity: Identity
    adapters: list[tuple[str, int]]  # (adapter_id, rank) measured: ADAPTERS.csv order
    caps: Caps
    seed: int
    scale: float  # < 1 when the budget is tight: fewer repetitions everywhere
    log: Callable[[str], None]
    next_index: list[int] = field(default_factory=lambda: [1_000_000])  # request indices (distinct prompts)

    def indices(self, n: int) -> int:
        first = self.next_index[0]
        self.next_index[0] += n + 1
        return first

    @property
    def url(self) -> str:
        return self.http.url

    def concurrency_cap(self) -> int:
        return max(1, min(self.identity.max_num_seqs, self.caps.max_concurrency))


def _itl(recs) -> float:
    """Mean inter-token interval (ms) of the finished requests: the engine's when sent, else the client's."""
    vals = [r.engine_itl_ms if np.isfinite(r.engine_itl_ms) else tpot_ms(r) for r in recs if r.status == 200]
    vals = [v for v in vals if np.isfinite(v)]
    return float(np.mean(vals)) if vals else float("nan")


def _check(recs, what: str) -> None:
    bad = [r for r in recs if r.status != 200 or r.error]
    if bad:
        r = bad[0]
        raise MeasureError(f"{what}: {len(bad)} of {len(recs)} requests failed (first: HTTP {r.status} "
                           f"{r.error[:160]})")


# most requests per worker of a timed closed-loop point (its time slot normally ends it far earlier)
TIMED_MAX_PER_WORKER = 10_000


def _loop(ctx: Context, adapters: Sequence[str | None], concurrency: int, per_worker: int, prompt: int,
          output: int, what: str, duration_s: float | None = None):
    """A closed-loop point: ``per_worker`` requests per worker, or with ``duration_s`` as many as that time
    allows (no new request after it: the point overruns by at most one request)."""
    if duration_s is not None:
        per_worker = TIMED_MAX_PER_WORKER
    first = ctx.indices(concurrency * per_worker)
    before = scrape(ctx.http)
    load = ClosedLoad(tuple(adapters), concurrency, per_worker, prompt, output, first_index=first,
                      duration_s=duration_s)
    res = closed_loop(ctx.url, ctx.identity.model, load, ctx.seed, api_key=ctx.http.api_key)
    after = scrape(ctx.http)
    _check(res.records, what)
    return res, after.steps - before.steps, after.step_tokens - before.step_tokens


def base_itl_ms(ctx: Context, concurrency: int, per_worker: int, prompt: int, output: int) -> float:
    """Mean inter-token interval (ms) of one closed-loop point on the base model: ``concurrency`` workers,
    ``per_worker`` requests each (a decode-ladder point; ``proof.server_pace``)."""
    res, _, _ = _loop(ctx, [None], concurrency, per_worker, prompt, output, f"base-model point, concurrency "
                      f"{concurrency}")
    return _itl(res.records)


def warm_up(ctx: Context) -> None:
    """A few requests to the base model: first-request costs out of the way before anything is timed."""
    _loop(ctx, [None], 1, 3, 16, 32, "warm-up")


# ---------------------------------------------------------------------------------------------------------
# decode


def decode_points(ctx: Context) -> list[tuple[int, int]]:
    """(concurrency, prompt tokens): powers of two up to the cap with short prompts; three with long ones."""
    cap = ctx.concurrency_cap()
    bs = sorted({min(cap, 2**k) for k in range(0, 12) if 2**k <= cap} | {cap})
    long_p = int(min(ctx.caps.max_prompt_tokens, ctx.identity.max_model_len // 4, 2048))
    long_bs = sorted({1, max(1, cap // 4), cap})
    return [(b, 16) for b in bs] + ([(b, long_p) for b in long_bs] if long_p > 64 else [])


def _decode_output(ctx: Context) -> int:
    return int(min(128, ctx.caps.max_output_tokens))


def run_decode(ctx: Context, seconds: float, progress: Callable[[int, int], None]) -> list[dict]:
    pts = decode_points(ctx)
    out = _decode_output(ctx)
    rows = []
    t_end = time.monotonic() + seconds
    for i, (b, p) in enumerate(pts):
        # each point gets an equal share of the time left (a point overruns by at most one request)
        slot = max(1.0, (t_end - time.monotonic()) / (len(pts) - i))
        res, steps, tokens = _loop(ctx, [None], b, 0, p, out, f"decode ladder, concurrency {b}", duration_s=slot)
        recs = res.records
        rows.append({"concurrency": b, "prompt_tokens": p, "output_tokens": out, "n_requests": len(recs),
                     "itl_mean_ms": _itl(recs), "ttft_mean_ms": float(np.mean([ttft_ms(r) for r in recs])),
                     "wall_s": res.wall_s, "engine_steps": steps, "step_tokens": tokens,
                     "step_ms_mean": 1000.0 * res.wall_s / steps if steps else float("nan"),
                     "context_tokens_mean": p + out / 2.0})
        progress(i + 1, len(pts))
    return rows


# ---------------------------------------------------------------------------------------------------------
# prefill (+ the API server's share of TTFT)


def prefill_lengths(ctx: Context) -> list[int]:
    budget = ctx.identity.max_num_batched_tokens
    top = min(ctx.caps.max_prompt_tokens, ctx.identity.max_model_len - 2, 4 * budget)
    pts = sorted({16, budget // 4, budget // 2, budget, budget + budget // 2, 2 * budget, 3 * budget, 4 * budget})
    return [p for p in pts if 1 <= p <= top]


def run_prefill(ctx: Context, seconds: float, progress: Callable[[int, int], None]) -> list[dict]:
    lengths = prefill_lengths(ctx)
    budget = ctx.identity.max_num_batched_tokens
    reps = max(3, int(ctx.scale * 6))
    rows = []
    for i, p in enumerate(lengths):
        res, _, _ = _loop(ctx, [None], 1, reps, p, 1, f"prefill, {p} prompt tokens")
        for r in res.records:
            rows.append({"prompt_tokens": p, "chunks": math.ceil(p / budget), "ttft_ms": ttft_ms(r),
                         "client_ttft_ms": 1000.0 * r.ttft_s,
                         "frontend_ms": (1000.0 * r.ttft_s - ttft_ms(r)) if np.isfinite(r.queue_ms)
                         else float("nan")})
        progress(i + 1, len(lengths))
    return rows


# ---------------------------------------------------------------------------------------------------------
# LoRA compute cost


def lora_points(ctx: Context) -> list[tuple[int, int, int]]:
    """(concurrency, distinct adapters, rank)."""
    a = ctx.identity.max_loras
    cap = ctx.concurrency_cap()
    bs = sorted({max(1, cap // 4), cap})
    ranks = sorted({r for _, r in ctx.adapters})
    top = ranks[-1]
    by_rank = {r: [x for x, rr in ctx.adapters if rr == r] for r in ranks}
    ls = sorted({1, min(2, a), a} & set(range(1, len(by_rank[top]) + 1)) or {1})
    pts = [(b, L, top) for b in bs for L in ls]
    for r in ranks[:-1]:  # the other ranks at the largest spread: the cost should follow the slot rank, not r
        pts.append((cap, min(a, len(by_rank[r])), r))
    return pts


def run_lora(ctx: Context, seconds: float, progress: Callable[[int, int], None]) -> list[dict]:
    pts = lora_points(ctx)
    out = _decode_output(ctx)
    by_rank: dict[int, list[str]] = {}
    for x, r in ctx.adapters:
        by_rank.setdefault(r, []).append(x)
    rows = []
    base_cache: dict[int, float] = {}
    n_bases = len({b for b, _, _ in pts})
    t_end = time.monotonic() + seconds
    for i, (b, n, r) in enumerate(pts):
        # equal slots over the points left and the base-model points still to measure
        left = len(pts) - i + n_bases - len(base_cache)
        slot = max(1.0, (t_end - time.monotonic()) / left)
        if b not in base_cache:  # the base model at this concurrency, measured within the same experiment
            res, _, _ = _loop(ctx, [None], b, 0, 16, out, f"LoRA cost, base model at concurrency {b}", duration_s=slot)
            base_cache[b] = _itl(res.records)
        chosen = by_rank[r][:n]
        # one round first: every chosen adapter is loaded before the timed round
        _loop(ctx, chosen, len(chosen), 1, 16, 2, "LoRA cost, loading the adapters")
        res, steps, _ = _loop(ctx, chosen, b, 0, 16, out, f"LoRA cost, {n} adapter(s) of rank {r}", duration_s=slot)
        itl = _itl(res.records)
        rows.append({"concurrency": b, "n_adapters": n, "rank": r, "max_lora_rank": ctx.identity.max_lora_rank,
                     "max_loras": ctx.identity.max_loras, "output_tokens": out, "n_requests": len(res.records),
                     "itl_mean_ms": itl, "base_itl_ms": base_cache[b], "overhead_ms": itl - base_cache[b],
                     "engine_steps": steps})
        progress(i + 1, len(pts))
    return rows


# ---------------------------------------------------------------------------------------------------------
# adapter loading


def run_loading(ctx: Context, seconds: float, progress: Callable[[int, int], None]) -> list[dict]:
    ident = ctx.identity
    ids = [x for x, _ in ctx.adapters]
    rank = dict(ctx.adapters)
    # others to evict with: any served adapter (measured or not) other than the target
    pool = [x for x in ident.served_adapters if x in rank] + [x for x in ident.served_adapters if x not in rank]
    if len(pool) <= ident.max_loras:
        ctx.log(f"loading: the server serves {len(pool)} adapter(s), not more than --max-loras "
                f"{ident.max_loras}: an adapter is never evicted, load times are not measured")
        return []
    targets: list[str] = []
    for r in sorted(set(rank.values())):
        targets += [x for x in ids if rank[x] == r][:2 if ctx.scale >= 0.5 else 1]
    disk = len(pool) > ident.max_cpu_loras

    def ttft(adapter: str) -> float:
        res, _, _ = _loop(ctx, [adapter], 1, 1, 16, 1, f"loading, adapter {adapter}")
        return ttft_ms(res.records[0])

    def touch(others: list[str]) -> None:
        for x in others:
            ttft(x)

    rows = []
    for i, x in enumerate(targets):
        others = [y for y in pool if y != x]
        ttft(x)
        warm = ttft(x)
        touch(others[:ident.max_loras])  # x leaves the GPU slots (LRU), stays in the CPU cache
        gpu_cold = ttft(x) if ident.max_cpu_loras > ident.max_loras else float("nan")
        disk_cold = float("nan")
        if disk:
            touch(others[:ident.max_cpu_loras])  # x leaves the CPU cache too
            disk_cold = ttft(x)
        rows.append({"adapter_id": x, "rank": rank[x], "max_lora_rank": ident.max_lora_rank, "warm_ttft_ms": warm,
                     "gpu_cold_ttft_ms": gpu_cold, "disk_cold_ttft_ms": disk_cold,
                     "activation_ms": gpu_cold - warm, "disk_ms": disk_cold - gpu_cold})
        progress(i + 1, len(targets))
    return rows


def wait_idle(http: Http, timeout_s: float = 120.0) -> None:
    """Until the server has no request running or waiting (after a window's cancelled requests)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        s = scrape(http)
        if s.running + s.waiting == 0:
            return
        time.sleep(0.5)
    raise MeasureError(f"--url {http.url}: requests still running {timeout_s:.0f} s after the window ended")
