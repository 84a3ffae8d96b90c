"""Trace replay (placement.md §6.2): exact times and lengths, load scaling, adapter assignment."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import DataError
from ..spec import iter_csv_rows
from .lengths import call_cached_by_file

TRACE_COLUMNS = ("arrived_at", "num_prefill_tokens", "num_decode_tokens")


@dataclass(frozen=True)
class Trace:
    """A request trace sorted by time. Arrays are read-only (they are cached and shared)."""

    t_s: np.ndarray  # float64 [n], >= 0, non-decreasing
    prompt_tokens: np.ndarray  # int32 [n], >= 1
    output_tokens: np.ndarray  # int32 [n], >= 1

    def __len__(self) -> int:
        return len(self.t_s)


@functools.lru_cache(maxsize=8)
def _load_trace_cached(path: str, mtime_ns: int, size: int) -> Trace:
    t: list[float] = []
    p: list[int] = []
    o: list[int] = []
    for line, row in iter_csv_rows(Path(path), TRACE_COLUMNS, error=DataError):
        try:
            t_s = float(row["arrived_at"])
            p_tok, o_tok = int(row["num_prefill_tokens"]), int(row["num_decode_tokens"])
        except ValueError:
            raise DataError(f"{path}:{line}: expected a number of seconds and two integer token counts, got "
                            f"{','.join(row.values())}") from None
        if not math.isfinite(t_s) or t_s < 0:
            raise DataError(f"{path}:{line}: arrived_at: expected a finite time >= 0 s, got {row['arrived_at']}")
        # the engine needs >= 1 token each; a zero count is a malformed row, not something to clip silently
        if p_tok < 1 or o_tok < 1:
            raise DataError(f"{path}:{line}: expected token counts >= 1, got {p_tok},{o_tok}")
        t.append(t_s)
        p.append(p_tok)
        o.append(o_tok)
    if not t:
        raise DataError(f"{path}:2: no requests; expected at least one row after the header")
    t_arr = np.asarray(t, dtype=np.float64)
    order = np.argsort(t_arr, kind="stable")  # the Azure traces are sorted; tolerate others
    trace = Trace(t_arr[order], np.asarray(p, dtype=np.int32)[order], np.asarray(o, dtype=np.int32)[order])
    for a in (trace.t_s, trace.prompt_tokens, trace.output_tokens):
        a.setflags(write=False)
    return trace


def load_trace(path: str | Path) -> Trace:
    """Read a trace CSV ``arrived_at,num_prefill_tokens,num_decode_tokens`` (cached by path and mtime)."""
    return call_cached_by_file(_load_trace_cached, path)


def scaled_trace(
    t_s: np.ndarray, load_scale: float, jitter_s: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """``(index, time)`` of the load-scaled trace, sorted by time (stable: ties keep copy order).

    Copy 0 is the trace itself (untouched, so k = 1 replays exactly); copies 1 .. ceil(k)-1 get uniform
    ``±jitter_s`` jitter, clipped at 0; when k is not an integer the last copy is kept per request with
    probability ``frac(k)`` (for k < 1 this thins the original). ``index`` points into the trace, so lengths
    follow their request.
    """
    n = len(t_s)
    n_copies = max(1, math.ceil(load_scale - 1e-12))
    frac = load_scale - math.floor(load_scale + 1e-12)
    t0 = np.asarray(t_s, dtype=np.float64)
    base = np.arange(n, dtype=np.int64)
    # copies 1.. drawn in one call: the same stream as one draw of n per copy, without a Python loop per copy
    jit = rng.uniform(-jitter_s, jitter_s, size=(n_copies - 1, n))
    t_copies = np.maximum(t0 + jit, 0.0)
    del jit
    idx = np.tile(base, n_copies)
    t = np.concatenate([t0, t_copies.ravel()])
    del t_copies
    if frac > 1e-12:  # keep each request of the last copy with probability frac(k)
        keep = np.ones(len(t), dtype=bool)
        keep[(n_copies - 1) * n:] = rng.random(n) < frac
        idx, t = idx[keep], t[keep]
    if n_copies > 1:
        order = np.argsort(t, kind="stable")
        idx, t = idx[order], t[order]
    return idx, t


def assignment_weights(
    n_adapters: int, kind: str, zipf_s: float, dirichlet_alpha: float, rng: np.random.Generator
) -> np.ndarray:
    """Adapter weights (sum 1): uniform, Zipf over a seeded permutation, or Dirichlet(alpha)."""
    if kind == "uniform":
        return np.full(n_adapters, 1.0 / n_adapters)
    if kind == "zipf":
        w = np.empty(n_adapters)
        # the j-th adapter of a random permutation gets weight j^-s, so popularity is not tied to index
        w[rng.permutation(n_adapters)] = np.arange(1, n_adapters + 1, dtype=np.float64) ** -zipf_s
    elif kind == "dirichlet":
        w = rng.dirichlet(np.full(n_adapters, dirichlet_alpha))
        if not np.all(np.isfinite(w)) or w.sum() <= 0:  # tiny alpha can underflow every gamma draw
            w = np.zeros(n_adapters)
            w[rng.integers(n_adapters)] = 1.0
    else:
        raise ValueError(f"unknown assignment {kind!r}")
    return w / w.sum()


def assign_adapters(n_requests: int, weights: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Adapter of each request (int32): one per adapter first if possible, the rest multinomial, shuffled.

    With fewer requests than adapters every request is drawn from the weights (some adapters get none).
    """
    n_adapters = len(weights)
    if n_requests >= n_adapters:
        rest = rng.choice(n_adapters, size=n_requests - n_adapters, p=weights)
        labels = np.concatenate([np.arange(n_adapters), rest])
    else:
        labels = rng.choice(n_adapters, size=n_requests, p=weights)
    rng.shuffle(labels)
    return labels.astype(np.int32)
