"""Grid specs: which twin runs a sweep makes (placement.md §3.3, issue 4).

A grid is the cross product

    seeds x rate tuples x rank tuples x A_max (adapter_slots) x N (served_adapters), keeping A_max <= N.

One configuration serves ``N`` adapters: rates and ranks are assigned to adapters round-robin over their
tuple (adapter ``i`` gets ``tuple[i % len(tuple)]``), then each assignment is shuffled by a permutation drawn
from the seed (rates and ranks independently; the permutation depends only on ``(seed, N)``, so every config
with the same seed and ``N`` shares it and a series over ``A_max`` replays the very same workload).
``--max-lora-rank`` S is the largest rank of the run and ``--max-cpu-loras`` is vLLM's default (``N``).
Arrivals are Poisson with common random numbers (adapter ``i``'s stream depends on ``(seed, i)`` and its rate).

YAML layout (every field but ``model``, the ranks and the N / A lists has a default)::

    name: my-grid
    model: llama-3.1-8b-instruct
    gpu: h100-64gb
    rate_pool_rps: [3.2, 1.6, 0.8, 0.4]    # every rate_tuple_size-subset of the pool ...
    rate_tuple_size: 3
    # rate_tuples: [[0.8, 0.4, 0.1]]       # ... or explicit tuples (exactly one of the two)
    rank_tuples: [[8, 8, 8], [8, 16, 32]]
    served_adapters: [8, 16, 32]
    adapter_slots: [8, 16]
    lengths: {kind: lognormal, mean_input_tokens: 223, mean_output_tokens: 197}
    duration_s: 3600
    seeds: [0]

The built-in presets ``paper-llama`` and ``paper-qwen`` reproduce the paper's dataset grid plus lorapack's
``N = 8`` / ``A = 8`` points (placement.md §3.3).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from pydantic import Field, field_validator, model_validator

from ..errors import SpecError
from ..spec import FIELD_MODELS, FrozenModel, LengthsSpec, default_lengths_kind, reject_bool
from ..textfiles import validate_yaml_file

# version of the config -> workload mapping; part of every config_id (bump it when the mapping changes)
ASSIGNMENT_SCHEME = "round-robin+seeded-shuffle/v1"
STREAM_RATE_SHUFFLE = 0x7A7E  # SeedSequence keys (non-zero; see workload.generate)
STREAM_RANK_SHUFFLE = 0x7A4C
STREAM_LIMIT_SHUFFLE = 0x11A2  # v2 shuffles whole N-series (v1, 0x11A1, shuffled single configs)
STREAM_RATE_LAW = 0x7A1A
STREAM_PLACEMENT_LIKE = 0x91AC
MIN_RATE_RPS = 1e-6
MAX_RANK = 512

PAPER_RATE_POOL_RPS = (3.2, 1.6, 0.8, 0.4, 0.1, 0.05, 0.025, 0.0125, 0.00625, 0.003125)
PAPER_RANK_TUPLES = ((8, 8, 8), (8, 8, 16), (8, 8, 32), (8, 16, 16), (8, 16, 32), (16, 16, 16), (16, 16, 32))
PAPER_SIZES = (8, 16, 32, 64, 96, 128, 160, 192, 256, 320, 384)


def _positive_ints(values: list[int]) -> list[int]:
    for v in values:
        if v < 1:
            raise ValueError(f"expected positive integers (got {v})")
    if len(set(values)) != len(values):
        raise ValueError("expected distinct values")
    return sorted(values)


def _check_rates(rates: list[float]) -> None:
    for r in rates:
        if not math.isfinite(r) or r <= 0:
            raise ValueError(f"expected finite rates > 0 (got {r})")


RATE_LAW_KINDS = ("loguniform", "dirichlet", "zipf")


class RateLaw(FrozenModel):
    """Non-tuple rate vectors (placement.md §3.3): ``draws`` vectors per (seed, N).

    * ``loguniform``: every adapter's rate log-uniform in ``[low_rps, high_rps]``;
    * ``dirichlet``: a GPU total log-uniform in ``[low_rps, high_rps]`` split by ``Dirichlet(alpha)``;
    * ``zipf``: the same total split by weights ``1 / k**exponent`` over a random order of the adapters.
    """

    kind: str
    low_rps: float
    high_rps: float
    alpha: float = 1.0
    exponent: float = 1.0
    draws: int = 1

    @field_validator("kind")
    @classmethod
    def _kind(cls, value: str) -> str:
        if value not in RATE_LAW_KINDS:
            raise ValueError(f"expected one of {', '.join(RATE_LAW_KINDS)} (got {value!r})")
        return value

    @field_validator("low_rps", "high_rps", "alpha", "exponent", "draws", mode="before")
    @classmethod
    def _not_bool(cls, value: Any) -> Any:
        return reject_bool(value)

    @model_validator(mode="after")
    def _check(self) -> RateLaw:
        _check_rates([self.low_rps, self.high_rps])
        if self.low_rps > self.high_rps:
            raise ValueError("expected low_rps <= high_rps")
        if not (math.isfinite(self.alpha) and self.alpha > 0 and math.isfinite(self.exponent) and self.exponent >= 0):
            raise ValueError("expected alpha > 0 and exponent >= 0")
        if self.draws < 1:
            raise ValueError("expected draws >= 1")
        return self

    def key(self, draw: int) -> tuple:
        """The law as a hashable config field (the draw index included)."""
        param = self.alpha if self.kind == "dirichlet" else self.exponent if self.kind == "zipf" else 0.0
        return (self.kind, float(self.low_rps), float(self.high_rps), float(param), int(draw))


def draw_rates(law: tuple, n: int, seed: int) -> np.ndarray:
    """``n`` rates of a ``RateLaw.key`` (seeded by ``(seed, n, draw)``); every rate > 0."""
    kind, lo, hi, param, draw = law
    rng = np.random.default_rng([seed, n, STREAM_RATE_LAW, draw])
    if kind == "loguniform":
        return np.exp(rng.uniform(math.log(lo), math.log(hi), n))
    total = math.exp(rng.uniform(math.log(lo), math.log(hi)))
    if kind == "dirichlet":
        w = rng.dirichlet(np.full(n, param)) if n > 1 else np.ones(1)
    else:
        w = 1.0 / np.arange(1, n + 1, dtype=float) ** param
        w = w[rng.permutation(n)] / w.sum()
    return np.maximum(total * w, MIN_RATE_RPS)


class GridSpec(FrozenModel):
    """A sweep grid as written in YAML (see the module docstring)."""

    name: str = "grid"
    model: str
    gpu: str = "h100-64gb"
    rate_pool_rps: list[float] | None = None
    rate_tuple_size: int = 3
    rate_tuples: list[list[float]] | None = None
    rank_tuples: list[list[int]] = Field(min_length=1)
    served_adapters: list[int] = Field(min_length=1)
    adapter_slots: list[int] = Field(min_length=1)
    rate_laws: list[RateLaw] = Field(default_factory=list)
    pad_fractions: list[float] = Field(default_factory=list)
    boundary_seeds: int = 0
    placement_like: int = 0  # > 0: instead of the cross product, this many placement-like candidates per seed
    lengths: LengthsSpec = LengthsSpec()
    duration_s: float = 3600.0
    seeds: list[int] = Field(default_factory=lambda: [0], min_length=1)

    _lk = field_validator("lengths", mode="before")(default_lengths_kind)

    @field_validator("pad_fractions")
    @classmethod
    def _pads(cls, value: list[float]) -> list[float]:
        for f in value:
            if not 0 < f < 1:
                raise ValueError(f"expected fractions strictly between 0 and 1 (got {f})")
        if len(set(value)) != len(value):
            raise ValueError("expected distinct fractions")
        return value

    @field_validator("boundary_seeds")
    @classmethod
    def _boundary(cls, value: int) -> int:
        if not 0 <= value <= 10:
            raise ValueError(f"expected 0-10 extra seeds (got {value})")
        return value

    @field_validator("rate_tuple_size", "duration_s", "boundary_seeds", mode="before")
    @classmethod
    def _not_bool(cls, value: Any) -> Any:
        return reject_bool(value)

    @field_validator("rate_pool_rps", "rate_tuples", "rank_tuples", "served_adapters", "adapter_slots",
                     "seeds", mode="before")
    @classmethod
    def _no_bool_items(cls, value: Any) -> Any:
        if isinstance(value, list):
            for item in value:
                for x in item if isinstance(item, list) else [item]:
                    reject_bool(x)
        return value

    @field_validator("rate_pool_rps")
    @classmethod
    def _pool(cls, value: list[float] | None) -> list[float] | None:
        if value is None:
            return None
        if not value:
            raise ValueError("expected at least one rate")
        _check_rates(value)
        if len(set(value)) != len(value):
            raise ValueError("expected distinct rates")
        return value

    @field_validator("rate_tuples")
    @classmethod
    def _tuples(cls, value: list[list[float]] | None) -> list[list[float]] | None:
        if value is None:
            return None
        if not value:
            raise ValueError("expected at least one tuple")
        for t in value:
            if not t:
                raise ValueError("expected non-empty tuples")
            _check_rates(t)
        return value

    @field_validator("rank_tuples")
    @classmethod
    def _ranks(cls, value: list[list[int]]) -> list[list[int]]:
        for t in value:
            if not t:
                raise ValueError("expected non-empty tuples")
            for r in t:
                if not 1 <= r <= MAX_RANK:
                    raise ValueError(f"expected ranks between 1 and {MAX_RANK} (got {r})")
        return value

    _sizes = field_validator("served_adapters", "adapter_slots")(_positive_ints)

    @field_validator("seeds")
    @classmethod
    def _seeds(cls, value: list[int]) -> list[int]:
        for s in value:
            if s < 0:
                raise ValueError(f"expected non-negative integers (got {s})")
        if len(set(value)) != len(value):
            raise ValueError("expected distinct seeds")
        return value

    @field_validator("duration_s")
    @classmethod
    def _duration(cls, value: float) -> float:
        if not math.isfinite(value) or value <= 0:
            raise ValueError("expected a finite number of seconds > 0")
        return value

    @field_validator("lengths")
    @classmethod
    def _lengths(cls, value: LengthsSpec) -> LengthsSpec:
        if value.kind == "empirical":
            raise ValueError("sweeps support lengths of kind 'fixed' or 'lognormal' (not 'empirical')")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> GridSpec:
        if self.rate_pool_rps is not None and self.rate_tuples is not None:
            raise ValueError("expected at most one of 'rate_pool_rps' (with rate_tuple_size) or 'rate_tuples'")
        if self.rate_pool_rps is None and self.rate_tuples is None and not self.rate_laws:
            raise ValueError("expected rate tuples ('rate_pool_rps' or 'rate_tuples') and/or 'rate_laws'")
        if self.rate_pool_rps is not None and not 1 <= self.rate_tuple_size <= len(self.rate_pool_rps):
            raise ValueError(f"rate_tuple_size {self.rate_tuple_size}: expected 1..{len(self.rate_pool_rps)} "
                             f"(the size of rate_pool_rps)")
        if min(self.adapter_slots) > max(self.served_adapters):
            raise ValueError("no (N, A) pair with adapter_slots <= served_adapters; expected at least one")
        return self

    # ---- derived ----
    def rate_tuple_list(self) -> list[tuple[float, ...]]:
        if self.rate_tuples is not None:
            return [tuple(float(r) for r in t) for t in self.rate_tuples]
        if self.rate_pool_rps is None:
            return []
        return [tuple(float(r) for r in t) for t in itertools.combinations(self.rate_pool_rps, self.rate_tuple_size)]

    def rate_sources(self) -> list[tuple[tuple[float, ...], tuple]]:
        """``(rate_tuple, rate_law)`` pairs: every tuple (law ``()``), then every law draw (tuple ``()``)."""
        out: list[tuple[tuple[float, ...], tuple]] = [(t, ()) for t in self.rate_tuple_list()]
        out += [((), law.key(d)) for law in self.rate_laws for d in range(law.draws)]
        return out

    def pads(self) -> list[float]:
        return [0.0, *(float(f) for f in self.pad_fractions)]

    def rank_tuple_list(self) -> list[tuple[int, ...]]:
        return [tuple(int(r) for r in t) for t in self.rank_tuples]

    def size_pairs(self) -> list[tuple[int, int]]:
        """``(A, N)`` pairs with ``A <= N``, by A then N."""
        return [(a, n) for a in self.adapter_slots for n in self.served_adapters if a <= n]

    @property
    def size(self) -> int:
        if self.placement_like:
            return len(self.seeds) * self.placement_like
        return (len(self.seeds) * len(self.rate_sources()) * len(self.rank_tuples) * len(self.pads())
                * len(self.size_pairs()))

    def canonical(self) -> dict:
        d = self.model_dump(mode="json")
        for k, empty in (("rate_laws", []), ("pad_fractions", []), ("boundary_seeds", 0), ("placement_like", 0)):
            if d.get(k) == empty:  # grids without the additions keep their hash
                d.pop(k)
        return d

    def grid_hash(self) -> str:
        return _hash(self.canonical())


def _hash(obj: Any) -> str:
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# ---------------------------------------------------------------------------------------------------------
# configurations


def assigned(values: tuple, n: int, seed: int, stream: int) -> np.ndarray:
    """``values`` round-robin over ``n`` adapters, then permuted by ``default_rng([seed, n, stream])``."""
    base = np.array([values[i % len(values)] for i in range(n)])
    return base[np.random.default_rng([seed, n, stream]).permutation(n)]


@dataclass(frozen=True)
class SweepConfig:
    """One twin run of a sweep. Pure data: picklable, hashable, cheap."""

    model: str
    gpu: str
    served_adapters: int  # N
    adapter_slots: int  # A_max (--max-loras)
    rate_tuple: tuple[float, ...]
    rank_tuple: tuple[int, ...]
    lengths_kind: str
    mean_input_tokens: float
    mean_output_tokens: float
    lengths_cv: float
    duration_s: float
    seed: int
    rate_law: tuple = ()  # RateLaw.key(draw) instead of a rate tuple
    pad_fraction: float = 0.0  # > 0: only this share of the N adapters is real, the rest is padding
    explicit_rates: tuple[float, ...] = ()  # placement-like candidates: the vectors themselves
    explicit_ranks: tuple[int, ...] = ()

    @property
    def n_real(self) -> int:
        """Adapters that are not padding (placement.md §4.1 pads a GPU's leftovers to the testing point N)."""
        if self.pad_fraction <= 0:
            return self.served_adapters
        return max(1, min(self.served_adapters, round(self.pad_fraction * self.served_adapters)))

    @property
    def max_lora_rank(self) -> int:
        """S = the largest rank the run serves (round-robin: the first min(N, len) tuple entries; padding uses
        the smallest rank, so it never raises S)."""
        if self.explicit_ranks:
            return int(max(self.explicit_ranks))
        return int(max(self.rank_tuple[: self.n_real]))

    def ranks(self) -> np.ndarray:
        if self.explicit_ranks:
            return np.array(self.explicit_ranks, dtype=np.int32)
        r = assigned(self.rank_tuple, self.n_real, self.seed, STREAM_RANK_SHUFFLE)
        return np.concatenate([r, np.full(self.served_adapters - self.n_real, r.min())]).astype(np.int32)

    def rates_rps(self) -> np.ndarray:
        if self.explicit_rates:
            return np.array(self.explicit_rates, dtype=np.float64)
        if self.rate_law:
            q = draw_rates(self.rate_law, self.n_real, self.seed)
        else:
            q = assigned(self.rate_tuple, self.n_real, self.seed, STREAM_RATE_SHUFFLE).astype(np.float64)
        return np.concatenate([q, np.full(self.served_adapters - self.n_real, q.mean())]).astype(np.float64)

    def lengths(self) -> LengthsSpec:
        return LengthsSpec(kind=self.lengths_kind, mean_input_tokens=self.mean_input_tokens,
                           mean_output_tokens=self.mean_output_tokens, cv=self.lengths_cv)

    def canonical(self) -> dict:
        """Everything that determines the run's inputs (the seed included), as plain JSON values."""
        return {
            "scheme": ASSIGNMENT_SCHEME, "model": self.model, "gpu": self.gpu,
            "served_adapters": self.served_adapters, "adapter_slots": self.adapter_slots,
            "max_lora_rank": self.max_lora_rank, "max_cpu_loras": self.served_adapters,
            "rate_tuple": list(self.rate_tuple), "rank_tuple": list(self.rank_tuple),
            "lengths": {"kind": self.lengths_kind, "mean_input_tokens": self.mean_input_tokens,
                        "mean_output_tokens": self.mean_output_tokens, "cv": self.lengths_cv},
            "arrivals": "poisson", "duration_s": self.duration_s, "client_cap": 0, "warm_start": True,
            "seed": self.seed,
        } | ({"rate_law": list(self.rate_law)} if self.rate_law else {}) | (
            {"pad_fraction": self.pad_fraction} if self.pad_fraction else {}) | (
            {"rates": list(self.explicit_rates), "ranks": list(self.explicit_ranks)} if self.explicit_rates else {})

    @cached_property
    def config_id(self) -> str:
        """sha256 of the canonical config (seed included), 16 hex digits; stable across runs and machines."""
        return _hash(self.canonical())

    @property
    def series_key(self) -> tuple:
        """Configs that differ only in N form one series (docs/sweep.md, N-series pruning)."""
        return (self.model, self.gpu, self.rate_tuple, self.rank_tuple, self.adapter_slots, self.lengths_kind,
                self.mean_input_tokens, self.mean_output_tokens, self.lengths_cv, self.duration_s, self.seed,
                self.rate_law, self.pad_fraction, self.explicit_rates, self.explicit_ranks)

    @property
    def series_id(self) -> str:
        c = self.canonical()
        for k in ("served_adapters", "max_cpu_loras", "max_lora_rank"):
            c.pop(k)
        return _hash(c)


def enumerate_configs(grid: GridSpec) -> list[SweepConfig]:
    """Every config of the grid in canonical order: seed, rate source (tuples, then law draws), rank tuple,
    padding, A, N."""
    lengths = grid.lengths
    if grid.placement_like:
        return [c for seed in grid.seeds for c in placement_like_configs(grid, seed)]
    out = []
    for seed in grid.seeds:
        for rates, law in grid.rate_sources():
            for ranks in grid.rank_tuple_list():
                for pad in grid.pads():
                    for a, n in grid.size_pairs():
                        out.append(SweepConfig(
                            model=grid.model, gpu=grid.gpu, served_adapters=n, adapter_slots=a, rate_tuple=rates,
                            rank_tuple=ranks, lengths_kind=lengths.kind,
                            mean_input_tokens=float(lengths.mean_input_tokens),
                            mean_output_tokens=float(lengths.mean_output_tokens), lengths_cv=float(lengths.cv),
                            duration_s=float(grid.duration_s), seed=int(seed), rate_law=law, pad_fraction=pad))
    return out


def zigzag(rates: np.ndarray) -> np.ndarray:
    """Proposed's order within a rank group (placement.md §4.1): ascending, then alternately the largest
    and the smallest remaining (rates [1, 2, 3, 4, 5] give 5, 1, 4, 2, 3); returns indices."""
    asc = list(np.argsort(rates, kind="stable"))
    out = []
    while asc:
        out.append(asc.pop())
        if asc:
            out.append(asc.pop(0))
    return np.array(out, dtype=int)


def placement_like_configs(grid: GridSpec, seed: int) -> list[SweepConfig]:
    """``grid.placement_like`` GPUs as Proposed builds them (placement.md §4.1), for scoring surrogates.

    Each candidate: a population of adapters (ranks from a random rank tuple of the grid, round-robin and
    shuffled; rates from a random rate law of the grid, or a random rate tuple), ordered like Proposed (rank
    groups in descending rank, zig-zag by rate within a group); a GPU takes a random run of consecutive
    adapters up to a testing point ``T`` (from ``served_adapters``) — in 30 % of the candidates fewer, padded
    to ``T`` with their mean rate and minimum rank — and an ``A`` from ``adapter_slots`` (<= T) that starts."""
    from ..profile import find_profile

    profile = find_profile(grid.model, grid.gpu)
    tps = sorted(grid.served_adapters)
    sources = grid.rate_sources()
    lengths = grid.lengths
    out: list[SweepConfig] = []
    seen: set[str] = set()
    for k in range(grid.placement_like):
        rng = np.random.default_rng([seed, STREAM_PLACEMENT_LIKE, k])
        j = int(rng.integers(len(tps)))
        t = tps[j]
        n_real = t if rng.random() >= 0.3 or j == 0 else int(rng.integers(tps[j - 1] + 1, t))
        pop = 3 * t
        ranks = assigned(grid.rank_tuple_list()[int(rng.integers(len(grid.rank_tuples)))], pop, seed * 7919 + k,
                         STREAM_RANK_SHUFFLE)
        rates_t, law = sources[int(rng.integers(len(sources)))]
        if law:  # a law's totals are per GPU: scale to the population
            q = draw_rates(law, pop, seed * 7919 + k)
            q = q * (t / pop) if law[0] != "loguniform" else q
        else:
            q = assigned(rates_t, pop, seed * 7919 + k, STREAM_RATE_SHUFFLE).astype(np.float64)
        order = np.concatenate([np.flatnonzero(ranks == r)[zigzag(q[ranks == r])]
                                for r in sorted(set(ranks.tolist()), reverse=True)])
        start = int(rng.integers(0, pop - n_real + 1))
        take = order[start:start + n_real]
        r_sel, q_sel = ranks[take], q[take]
        r_all = np.concatenate([r_sel, np.full(t - n_real, r_sel.min())]).astype(int)
        q_all = np.concatenate([q_sel, np.full(t - n_real, q_sel.mean())])
        s_rank = int(r_all.max())
        slots = [a for a in sorted(grid.adapter_slots) if a <= t and profile.startup(a, s_rank)[0]]
        a = int(slots[int(rng.integers(len(slots)))]) if slots else int(min(grid.adapter_slots))
        cfg = SweepConfig(
            model=grid.model, gpu=grid.gpu, served_adapters=t, adapter_slots=a, rate_tuple=(), rank_tuple=(s_rank,),
            lengths_kind=lengths.kind, mean_input_tokens=float(lengths.mean_input_tokens),
            mean_output_tokens=float(lengths.mean_output_tokens), lengths_cv=float(lengths.cv),
            duration_s=float(grid.duration_s), seed=int(seed), pad_fraction=0.0 if n_real == t else n_real / t,
            explicit_rates=tuple(float(x) for x in q_all), explicit_ranks=tuple(int(x) for x in r_all))
        if cfg.config_id not in seen:  # small testing points can draw the same GPU twice
            seen.add(cfg.config_id)
            out.append(cfg)
    return out


# throughput ratios that get extra seeds: where the 0.9 label flips between seeds (healthy runs sit at ~0.99
# and would double the sweep for nothing)
BOUNDARY_BAND = (0.85, 0.95)
BOUNDARY_SEED_STRIDE = 1000  # extra seed k of a config with seed s is s + k * stride


def boundary_configs(configs: list[SweepConfig], ratios: dict[str, float], extra_seeds: int) -> list[SweepConfig]:
    """The configs whose simulated throughput ratio lies in ``BOUNDARY_BAND``, once per extra seed."""
    from dataclasses import replace

    out = []
    for c in configs:
        r = ratios.get(c.config_id)
        if r is not None and BOUNDARY_BAND[0] <= r <= BOUNDARY_BAND[1]:
            out.extend(replace(c, seed=c.seed + k * BOUNDARY_SEED_STRIDE) for k in range(1, extra_seeds + 1))
    return out


def group_series(configs: list[SweepConfig]) -> list[list[SweepConfig]]:
    """``configs`` grouped into N-series (same ``series_key``; docs/sweep.md, N-series pruning), in order of first appearance,
    each by increasing N."""
    series: dict[tuple, list[SweepConfig]] = {}
    for c in configs:
        series.setdefault(c.series_key, []).append(c)
    return [sorted(cs, key=lambda c: c.served_adapters) for cs in series.values()]


def limit_order(grid: GridSpec, n_series: int | None = None) -> np.ndarray:
    """The fixed, seeded shuffle of the grid's N-series (indices into ``group_series(enumerate_configs(grid))``)
    that ``--limit K`` takes whole series from. ``n_series``: their number, when the caller has it."""
    if n_series is None:
        n_series = len(group_series(enumerate_configs(grid)))
    rng = np.random.default_rng([STREAM_LIMIT_SHUFFLE, *grid.seeds])
    return rng.permutation(n_series)


def shuffled_series(grid: GridSpec) -> list[list[SweepConfig]]:
    """Every N-series of the grid in ``limit_order``: what ``--limit`` and ``--estimate`` take prefixes of."""
    series = group_series(enumerate_configs(grid))
    return [series[i] for i in limit_order(grid, len(series))]


def take_series(series: list[list[SweepConfig]], limit: int) -> list[list[SweepConfig]]:
    """The shortest prefix of ``series`` holding at least ``limit`` configs (all of them if fewer)."""
    out, n = [], 0
    for s in series:
        if n >= limit:
            break
        out.append(s)
        n += len(s)
    return out


def select_configs(grid: GridSpec, limit: int | None = None) -> list[SweepConfig]:
    """All configs (canonical order), or (``limit``) whole N-series of the grid's seeded shuffle of series
    until at least ``limit`` configs are taken (series in shuffle order, each by increasing N).

    Whole series, so that N-series pruning acts on a sample as on the full grid (a sample's time per config
    is then the full sweep's); a larger ``limit`` extends the same sample (a prefix of one fixed order)."""
    if limit is None:
        return enumerate_configs(grid)
    if isinstance(limit, bool) or limit < 1:
        raise SpecError(f"--limit {limit}: expected an integer >= 1")
    return [c for s in take_series(shuffled_series(grid), limit) for c in s]


# ---------------------------------------------------------------------------------------------------------
# presets and loading


def _profile_cv(model: str, gpu: str = "h100-64gb") -> float:
    from ..profile import find_profile

    law = find_profile(model, gpu).runs_lengths
    return float(law.cv) if law is not None else float(LengthsSpec().cv)


def _paper(name: str, model: str) -> GridSpec:
    return GridSpec(
        name=name, model=model, gpu="h100-64gb", rate_pool_rps=list(PAPER_RATE_POOL_RPS), rate_tuple_size=3,
        rank_tuples=[list(t) for t in PAPER_RANK_TUPLES], served_adapters=list(PAPER_SIZES),
        adapter_slots=list(PAPER_SIZES),
        # the ShareGPT-like log-normal law of ``workload.lengths`` (post-filter means 223 / 197) with the CV the
        # profile fitted to its real runs (the oracle's queries use it too), 1.1 without a fit
        lengths=LengthsSpec(kind="lognormal", mean_input_tokens=223.0, mean_output_tokens=197.0,
                            cv=_profile_cv(model)),
        duration_s=3600.0, seeds=[0])


# placement.md §3.3's additions to the paper grid (what Proposed asks that the paper's grid lacks): rate
# vectors that are not round-robin triples, homogeneous rank groups (Proposed fills GPUs rank group by rank
# group, so all-32 GPUs are common), padded sets as Proposed builds them, extra seeds near the 0.9 boundary
ADDITION_RANK_TUPLES = ((8,), (16,), (32,), (16, 32), (8, 16, 32), (8, 8, 16))
ADDITION_RATE_LAWS = (
    {"kind": "loguniform", "low_rps": 0.003, "high_rps": 3.2, "draws": 6},
    {"kind": "dirichlet", "low_rps": 0.05, "high_rps": 60.0, "alpha": 0.5, "draws": 4},
    {"kind": "zipf", "low_rps": 0.05, "high_rps": 60.0, "exponent": 1.0, "draws": 4},
)


def _additions(name: str, model: str) -> GridSpec:
    base = _paper(name, model)
    return base.model_copy(update={
        "rate_pool_rps": None, "rate_laws": [RateLaw(**law) for law in ADDITION_RATE_LAWS],
        "rank_tuples": [list(t) for t in ADDITION_RANK_TUPLES], "pad_fractions": [0.7], "boundary_seeds": 2})


def _placement_like(name: str, model: str) -> GridSpec:
    """A held-out test set that looks like Proposed's queries (seed 7: disjoint from the training seeds)."""
    base = _additions(name, model)
    return base.model_copy(update={"rate_pool_rps": list(PAPER_RATE_POOL_RPS), "pad_fractions": [],
                                   "boundary_seeds": 0, "placement_like": 600, "seeds": [7]})


def _placement_train(name: str, model: str) -> GridSpec:
    """Training rows drawn like the placement-like test set (seed 1, 2,400 GPUs: disjoint from its seed 7): the
    GPUs Proposed asks about, so the surrogate learns the query distribution, not only the grids around it."""
    return _placement_like(name, model).model_copy(update={"placement_like": 2400, "seeds": [1]})


PRESETS = {
    "paper-llama": lambda: _paper("paper-llama", "llama-3.1-8b-instruct"),
    "paper-qwen": lambda: _paper("paper-qwen", "qwen-2.5-7b-instruct"),
    "additions-llama": lambda: _additions("additions-llama", "llama-3.1-8b-instruct"),
    "additions-qwen": lambda: _additions("additions-qwen", "qwen-2.5-7b-instruct"),
    "placement-like-llama": lambda: _placement_like("placement-like-llama", "llama-3.1-8b-instruct"),
    "placement-like-qwen": lambda: _placement_like("placement-like-qwen", "qwen-2.5-7b-instruct"),
    "placement-train-llama": lambda: _placement_train("placement-train-llama", "llama-3.1-8b-instruct"),
    "placement-train-qwen": lambda: _placement_train("placement-train-qwen", "qwen-2.5-7b-instruct"),
}


def preset_grid(name: str) -> GridSpec:
    if name not in PRESETS:
        raise SpecError(f"unknown preset '{name}'; expected one of: {', '.join(PRESETS)}")
    return PRESETS[name]()


def _profile_problem(grid: GridSpec) -> tuple[str, str] | None:
    """``(field, message)`` when no shipped profile matches the grid's model and gpu."""
    from ..profile import available_profiles

    avail = available_profiles()
    if any(g == grid.gpu and m == grid.model for g, m, _ in avail):
        return None
    models = sorted({m for g, m, _ in avail if g == grid.gpu})
    if not models:
        gpus = sorted({g for g, _, _ in avail})
        return "gpu", f"unknown gpu '{grid.gpu}'; expected one of: {', '.join(gpus)}"
    return "model", f"unknown model '{grid.model}' on {grid.gpu}; expected one of: {', '.join(models)}"


def load_grid(path: str | Path) -> GridSpec:
    """Load a grid YAML; malformed input raises ``SpecError`` as ``file:line: where: expected ...``."""
    path = Path(path)
    file = str(path)
    if not path.is_file():
        raise SpecError(f"{path}: file not found" if not path.exists() else f"{path}: not a file")
    grid, lines = validate_yaml_file(path, GridSpec, "model, rank_tuples, served_adapters, adapter_slots and "
                                                     "rate_pool_rps or rate_tuples", FIELD_MODELS)
    problem = _profile_problem(grid)
    if problem is not None:
        key, msg = problem
        raise SpecError(f"{file}:{lines.get((key,), 1)}: {key}: {msg}")
    if grid.lengths.kind == "lognormal":
        from ..workload.lengths import solve_lognormal_lengths

        try:
            solve_lognormal_lengths(grid.lengths.mean_input_tokens, grid.lengths.mean_output_tokens, grid.lengths.cv)
        except SpecError as exc:
            raise SpecError(f"{file}:{lines.get(('lengths',), 1)}: lengths: {exc}") from None
    return grid


def with_overrides(grid: GridSpec, model: str | None = None, gpu: str | None = None,
                   seed: int | None = None, boundary_seeds: int | None = None) -> GridSpec:
    """A copy of ``grid`` with the CLI's ``--model`` / ``--gpu`` / ``--seed`` / ``--boundary-seeds`` applied
    (checked)."""
    update: dict[str, Any] = {}
    if boundary_seeds is not None:
        if not 0 <= boundary_seeds <= 10:
            raise SpecError(f"--boundary-seeds {boundary_seeds}: expected 0-10")
        update["boundary_seeds"] = boundary_seeds
    if model is not None:
        update["model"] = model
    if gpu is not None:
        update["gpu"] = gpu
    if seed is not None:
        if seed < 0:
            raise SpecError(f"--seed {seed}: expected a non-negative integer")
        update["seeds"] = [seed]
    if not update:
        return grid
    out = grid.model_copy(update=update)
    problem = _profile_problem(out)
    if problem is not None:
        raise SpecError(f"--{problem[0]}: {problem[1]}")
    return out


def grid_yaml(grid: GridSpec) -> str:
    """The grid as YAML (round-trips through ``load_grid``)."""
    return yaml.safe_dump(grid.model_dump(mode="json", exclude_none=True), sort_keys=False)
