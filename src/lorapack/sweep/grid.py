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
STREAM_LIMIT_SHUFFLE = 0x11A1
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
    lengths: LengthsSpec = LengthsSpec()
    duration_s: float = 3600.0
    seeds: list[int] = Field(default_factory=lambda: [0], min_length=1)

    _lk = field_validator("lengths", mode="before")(default_lengths_kind)

    @field_validator("rate_tuple_size", "duration_s", mode="before")
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
        if (self.rate_pool_rps is None) == (self.rate_tuples is None):
            raise ValueError("expected exactly one of 'rate_pool_rps' (with rate_tuple_size) or 'rate_tuples'")
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
        assert self.rate_pool_rps is not None
        return [tuple(float(r) for r in t) for t in itertools.combinations(self.rate_pool_rps, self.rate_tuple_size)]

    def rank_tuple_list(self) -> list[tuple[int, ...]]:
        return [tuple(int(r) for r in t) for t in self.rank_tuples]

    def size_pairs(self) -> list[tuple[int, int]]:
        """``(A, N)`` pairs with ``A <= N``, by A then N."""
        return [(a, n) for a in self.adapter_slots for n in self.served_adapters if a <= n]

    @property
    def size(self) -> int:
        return len(self.seeds) * len(self.rate_tuple_list()) * len(self.rank_tuples) * len(self.size_pairs())

    def canonical(self) -> dict:
        return self.model_dump(mode="json")

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

    @property
    def max_lora_rank(self) -> int:
        """S = the largest rank the run serves (round-robin: the first min(N, len) tuple entries)."""
        return int(max(self.rank_tuple[: self.served_adapters]))

    def ranks(self) -> np.ndarray:
        return assigned(self.rank_tuple, self.served_adapters, self.seed, STREAM_RANK_SHUFFLE).astype(np.int32)

    def rates_rps(self) -> np.ndarray:
        return assigned(self.rate_tuple, self.served_adapters, self.seed, STREAM_RATE_SHUFFLE).astype(np.float64)

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
        }

    @cached_property
    def config_id(self) -> str:
        """sha256 of the canonical config (seed included), 16 hex digits; stable across runs and machines."""
        return _hash(self.canonical())

    @property
    def series_key(self) -> tuple:
        """Configs that differ only in N form one series (twin.md §7.5)."""
        return (self.model, self.gpu, self.rate_tuple, self.rank_tuple, self.adapter_slots, self.lengths_kind,
                self.mean_input_tokens, self.mean_output_tokens, self.lengths_cv, self.duration_s, self.seed)

    @property
    def series_id(self) -> str:
        c = self.canonical()
        for k in ("served_adapters", "max_cpu_loras", "max_lora_rank"):
            c.pop(k)
        return _hash(c)


def enumerate_configs(grid: GridSpec) -> list[SweepConfig]:
    """Every config of the grid in canonical order: seed, rate tuple, rank tuple, A, N."""
    lengths = grid.lengths
    out = []
    for seed in grid.seeds:
        for rates in grid.rate_tuple_list():
            for ranks in grid.rank_tuple_list():
                for a, n in grid.size_pairs():
                    out.append(SweepConfig(
                        model=grid.model, gpu=grid.gpu, served_adapters=n, adapter_slots=a, rate_tuple=rates,
                        rank_tuple=ranks, lengths_kind=lengths.kind,
                        mean_input_tokens=float(lengths.mean_input_tokens),
                        mean_output_tokens=float(lengths.mean_output_tokens), lengths_cv=float(lengths.cv),
                        duration_s=float(grid.duration_s), seed=int(seed)))
    return out


def limit_order(grid: GridSpec) -> np.ndarray:
    """The fixed, seeded shuffle of the grid's canonical order that ``--limit K`` takes a prefix of."""
    rng = np.random.default_rng([STREAM_LIMIT_SHUFFLE, *grid.seeds])
    return rng.permutation(grid.size)


def select_configs(grid: GridSpec, limit: int | None = None) -> list[SweepConfig]:
    """All configs (canonical order), or the first ``limit`` of the seeded shuffle (in shuffle order)."""
    configs = enumerate_configs(grid)
    if limit is None:
        return configs
    if limit < 1:
        raise SpecError(f"--limit {limit}: expected an integer >= 1")
    return [configs[i] for i in limit_order(grid)[:limit]]


# ---------------------------------------------------------------------------------------------------------
# presets and loading


def _paper(name: str, model: str) -> GridSpec:
    return GridSpec(
        name=name, model=model, gpu="h100-64gb", rate_pool_rps=list(PAPER_RATE_POOL_RPS), rate_tuple_size=3,
        rank_tuples=[list(t) for t in PAPER_RANK_TUPLES], served_adapters=list(PAPER_SIZES),
        adapter_slots=list(PAPER_SIZES),
        # the ShareGPT-like log-normal fallback of twin.md §5 (post-filter means 223 / 197, CV 1.1)
        lengths=LengthsSpec(kind="lognormal", mean_input_tokens=223.0, mean_output_tokens=197.0),
        duration_s=3600.0, seeds=[0])


PRESETS = {
    "paper-llama": lambda: _paper("paper-llama", "llama-3.1-8b-instruct"),
    "paper-qwen": lambda: _paper("paper-qwen", "qwen-2.5-7b-instruct"),
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
                   seed: int | None = None) -> GridSpec:
    """A copy of ``grid`` with the CLI's ``--model`` / ``--gpu`` / ``--seed`` applied (checked)."""
    update: dict[str, Any] = {}
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
