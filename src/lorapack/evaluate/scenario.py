"""Scenario files of ``lorapack evaluate``: one YAML = one scenario, or a grid of them.

Every field marked *axis* takes one value or a list; the scenarios are the cross product of the lists
(in the order model, ranks, n_adapters, load_scale, weights, objective, seed). Layout and defaults::

    name: conv-llama                  # prefix of the scenario names (default: the file name)
    trace: azure-conv                 # azure-conv | azure-code (the shipped Azure 2023 traces, found in
                                      # $LORAPACK_DATA/traces or ../shared/data/traces) or a CSV path
                                      # arrived_at,num_prefill_tokens,num_decode_tokens (relative to this file)
    model: llama-3.1-8b-instruct      # axis: shipped profile keys ...
    # profile: my-gpu.yaml            # ... or one profile file (instead of model)
    gpu: h100-64gb
    n_adapters: [32, 64, 128]         # axis (required)
    weights: dirichlet:0.5            # axis: uniform | zipf:S | dirichlet:ALPHA (the paper's default)
    load_scale: [1, 5, 20]            # axis: ×k (at most 30 on the shipped traces)
    ranks: [8, 16]                    # axis: a rank set, or a list of rank sets [[8, 16], [8, 16, 32]]
    lengths: profile                  # profile (ShareGPT-like, the surrogates' distribution) | trace
    windows: E1                       # E1 (split-half) | E2 (two-hour synthesis) | E3 (Poisson), or
                                      # {protocol: E1, split_s: 1800, jitter_s: 5}
    fixed_pool: 4                     # GPUs of the fixed-pool protocol (omit: smallest pools only); run
                                      # where the lower bound fits in it
    objective: default                # axis: default | throughput | {max_ttft_s: 2, max_itl_ms: 60, ...}
    methods: [proposed, dlora]        # default: every placement method
    headroom: null                    # plan for rates × (1 + headroom) (null: the placement default)
    verify: true                      # twin verification and repair of the greedy methods (proposed*)
    verify_arrivals: estimation       # estimation: the verifier's Poisson arrivals follow the estimation
                                      # window's per-minute load profile (the trace's swings hit every
                                      # adapter at once) | poisson: steady arrivals at the planned rates
    split_hot: false                  # split adapters too hot for one GPU into weighted replicas
    seed: 0                           # axis: workload derivation seed(s)
    replay_seed: 0                    # routing draws of split adapters
    max_pack: true                    # compute the single-GPU Max_pack curve of each workload
    drift: {windows: 8, ...}          # evaluation over consecutive windows instead (``drift_spec``, ``drift``)

Errors are one line with ``file:line`` (``lorapack.spec.validate_yaml_file``).
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from ..errors import SpecError
from ..objective import Objective
from ..spec import (
    FIELD_MODELS,
    FrozenModel,
    finite_nonnegative,
    finite_positive,
    nonnegative_int,
    reject_bool,
)
from ..textfiles import validate_yaml_file
from ..workload.derive import DEFAULT_JITTER_S, DEFAULT_SPLIT_S, PROTOCOLS, AdapterWeights, parse_weights
from .drift_spec import DriftSpec

SHIPPED_TRACES = {"azure-conv": "azure-llm-2023-conv.csv", "azure-code": "azure-llm-2023-code.csv"}
SHIPPED_MAX_LOAD_SCALE = 30.0  # ×30 on the conversation trace ≈ 166 req/s, the paper's ×100 on 1.65 req/s
OBJECTIVE_NAMES = ("default", "throughput")


def _as_list(value: Any) -> Any:
    return value if isinstance(value, list) else [value]


def _distinct(values: list) -> list:
    if len({repr(v) for v in values}) != len(values):
        raise ValueError("expected distinct values")
    return values


def _distinct_where(ok: Callable[[Any], bool], message: str) -> Callable[[list], list]:
    """A validator of an axis: every value passes ``ok`` (else ``message``) and no value repeats."""
    def check(values: list) -> list:
        if not all(ok(v) for v in values):
            raise ValueError(message)
        return _distinct(values)
    return check


class WindowsSpec(FrozenModel):
    """Estimation / replay windows (``lorapack.workload.derive``)."""

    protocol: Literal["E1", "E2", "E3"] = "E1"
    split_s: float = DEFAULT_SPLIT_S
    jitter_s: float = DEFAULT_JITTER_S

    _nb = field_validator("split_s", "jitter_s", mode="before")(reject_bool)
    _sp = field_validator("split_s")(finite_positive)
    _ji = field_validator("jitter_s")(finite_nonnegative)


class ScenarioFile(FrozenModel):
    """A scenario YAML as written (see the module docstring)."""

    name: str | None = None
    trace: str = "azure-conv"
    model: list[str] = Field(default_factory=lambda: ["llama-3.1-8b-instruct"], min_length=1)
    profile: str | None = None
    gpu: str = "h100-64gb"
    n_adapters: list[int] = Field(min_length=1)
    weights: list[str] = Field(default_factory=lambda: ["dirichlet:0.5"], min_length=1)
    load_scale: list[float] = Field(default_factory=lambda: [1.0], min_length=1)
    ranks: list[list[int]] = Field(default_factory=lambda: [[8, 16]], min_length=1)
    lengths: Literal["profile", "trace"] = "profile"
    windows: WindowsSpec = WindowsSpec()
    fixed_pool: int | None = None
    objective: list[str | Objective] = Field(default_factory=lambda: ["default"], min_length=1)
    methods: list[str] | None = None
    headroom: float | None = None
    verify: bool = True
    verify_arrivals: Literal["estimation", "poisson"] = "estimation"
    split_hot: bool = False
    seed: list[int] = Field(default_factory=lambda: [0], min_length=1)
    replay_seed: int = 0
    max_pack: bool = True
    drift: DriftSpec | None = None

    _lists = field_validator("model", "n_adapters", "weights", "load_scale", "objective", "seed",
                             mode="before")(_as_list)

    @field_validator("name")
    @classmethod
    def _name(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", value):
            raise ValueError("expected a name of letters, digits, '.', '_' or '-'")
        return value

    @field_validator("windows", mode="before")
    @classmethod
    def _windows(cls, value: Any) -> Any:
        return {"protocol": value} if isinstance(value, str) else value

    @field_validator("ranks", mode="before")
    @classmethod
    def _rank_sets(cls, value: Any) -> Any:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return [[value]]
        if isinstance(value, list) and value and not any(isinstance(v, list) for v in value):
            return [value]  # one rank set
        return value

    @field_validator("n_adapters", "load_scale", "seed", "ranks", "fixed_pool", "headroom", "replay_seed",
                     mode="before")
    @classmethod
    def _no_bools(cls, value: Any) -> Any:
        for v in value if isinstance(value, list) else [value]:
            for x in v if isinstance(v, list) else [v]:
                reject_bool(x)
        return value

    _n = field_validator("n_adapters")(_distinct_where(lambda v: v >= 1, "expected integers >= 1"))
    _k = field_validator("load_scale")(_distinct_where(lambda v: math.isfinite(v) and v > 0,
                                                       "expected finite numbers > 0"))
    _sd = field_validator("seed")(_distinct_where(lambda v: v >= 0, "expected non-negative integers"))

    @field_validator("weights")
    @classmethod
    def _w(cls, value: list[str]) -> list[str]:
        return _distinct([str(parse_weights(v)) for v in value])

    @field_validator("ranks")
    @classmethod
    def _ranks(cls, value: list[list[int]]) -> list[list[int]]:
        from ..profile import VLLM_LORA_RANKS

        out = []
        for rs in value:
            if not rs:
                raise ValueError("expected a non-empty rank set")
            for r in rs:
                if r < 1 or r > VLLM_LORA_RANKS[-1]:
                    raise ValueError(f"expected ranks between 1 and {VLLM_LORA_RANKS[-1]} (got {r})")
            out.append(sorted(set(rs)))
        return _distinct(out)

    _rseed = field_validator("replay_seed")(nonnegative_int)

    @field_validator("fixed_pool")
    @classmethod
    def _pool(cls, value: int | None) -> int | None:
        if value is not None and value < 1:
            raise ValueError("expected a number of GPUs >= 1")
        return value

    @field_validator("headroom")
    @classmethod
    def _headroom(cls, value: float | None) -> float | None:
        if value is not None and (not math.isfinite(value) or value < 0):
            raise ValueError("expected a finite number >= 0 (0.2 = plan for rates × 1.2)")
        return value

    @field_validator("objective", mode="before")
    @classmethod
    def _objectives(cls, value: Any) -> Any:
        out = []
        for v in _as_list(value):
            if isinstance(v, dict):
                v = Objective.limits_only(v)  # its SpecError (a ValueError) names the key
            elif not isinstance(v, Objective) and v not in OBJECTIVE_NAMES:
                raise ValueError(f"expected {' or '.join(OBJECTIVE_NAMES)} or a mapping of "
                                 f"{', '.join(Objective.keys())} (got {v!r})")
            out.append(v)
        return _distinct(out)

    @field_validator("methods")
    @classmethod
    def _methods(cls, value: list[str] | None) -> list[str] | None:
        if value is not None:
            if not value:
                raise ValueError("expected at least one method")
            _distinct(value)
        return value

    @model_validator(mode="after")
    def _model_or_profile(self) -> ScenarioFile:
        if self.profile is not None and "model" in self.model_fields_set:
            raise ValueError("give either 'model' or 'profile', not both")
        if self.drift is not None:  # windows come from the drift block; no pool protocol, no split replicas
            unused = [k for k in ("windows", "fixed_pool", "max_pack") if k in self.model_fields_set]
            if unused:
                raise ValueError(f"drift: '{unused[0]}' is not used by a drift scenario; remove it")
            if self.split_hot:
                raise ValueError("drift: expected split_hot false (a re-plan keeps the previous plan's splits)")
            if self.methods is not None and len(self.methods) != 1:
                raise ValueError("drift: expected one method (every policy plans with it)")
        return self


@dataclass(frozen=True)
class Scenario:
    """One expanded scenario: a derived workload, the methods to place it with and how to judge them."""

    name: str
    source: str  # the scenario file
    trace_path: str
    trace_label: str
    model: str  # profile key, or the profile file's path when ``profile_file``
    gpu: str
    profile_file: str | None
    n_adapters: int
    weights: AdapterWeights
    load_scale: float
    ranks: tuple[int, ...]
    trace_lengths: bool
    protocol: str
    split_s: float
    jitter_s: float
    fixed_pool: int | None
    objective: str  # "default", "throughput" or "custom"
    objective_limits: Objective | None  # for "custom"
    methods: tuple[str, ...] | None
    headroom: float | None
    verify: bool
    split_hot: bool
    seed: int
    replay_seed: int
    max_pack: bool
    verify_arrivals: str = "estimation"
    vllm_version: str | None = None  # ``evaluate --vllm-version``: overrides the profile's (its rule set)
    drift: DriftSpec | None = None  # a drift scenario (``lorapack.evaluate.drift``)

    @property
    def objective_label(self) -> str:
        return self.objective_limits.label() if self.objective_limits is not None else self.objective

    def workload_key(self) -> tuple:
        """Scenarios with the same key share the derived workload (they differ in objective or methods)."""
        return (self.trace_path, self.model, self.gpu, self.profile_file, self.n_adapters, str(self.weights),
                self.load_scale, self.ranks, self.trace_lengths, self.protocol, self.split_s, self.jitter_s,
                self.seed)

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "source": self.source, "trace": self.trace_label, "trace_path": self.trace_path,
            "model": self.model, "gpu": self.gpu, "profile_file": self.profile_file,
            "n_adapters": self.n_adapters, "weights": str(self.weights), "load_scale": self.load_scale,
            "ranks": list(self.ranks), "lengths": "trace" if self.trace_lengths else "profile",
            "windows": {"protocol": self.protocol, "split_s": self.split_s, "jitter_s": self.jitter_s},
            "fixed_pool": self.fixed_pool, "objective": self.objective_label, "headroom": self.headroom,
            "verify": self.verify, "verify_arrivals": self.verify_arrivals, "split_hot": self.split_hot, "seed": self.seed, "replay_seed": self.replay_seed,
            **({"drift": self.drift.model_dump()} if self.drift is not None else {}),
        }


def data_traces_dir() -> Path:
    from ..calibrate import default_data_dir

    return default_data_dir() / "traces"


def _resolve_trace(spec: ScenarioFile, base: Path, file: str, line: int) -> tuple[str, str, bool]:
    """``(path, label, shipped)`` of the scenario's trace; a missing file is an error at ``line``."""
    if spec.trace in SHIPPED_TRACES:
        path = data_traces_dir() / SHIPPED_TRACES[spec.trace]
        if not path.is_file():
            from ..calibrate import DATA_ENV_VAR

            raise SpecError(f"{file}:{line}: trace: the shipped trace '{spec.trace}' is not at {path}; set "
                            f"{DATA_ENV_VAR} to the shared data directory or give a CSV path")
        return str(path.resolve()), spec.trace, True
    p = Path(spec.trace).expanduser()
    path = p if p.is_absolute() else (base / p)
    if not path.is_file():
        raise SpecError(f"{file}:{line}: trace: file not found: {path} (expected azure-conv, azure-code or a "
                        f"CSV path relative to the scenario file)")
    shipped = path.name in SHIPPED_TRACES.values()
    return str(path.resolve()), path.stem, shipped


def _model_label(model: str) -> str:
    return model.split("-")[0] if model.count("-") else model


def _fmt_num(x: float) -> str:
    return f"{x:g}"


def load_scenarios(path: str | Path) -> list[Scenario]:
    """Load and expand a scenario file (every problem: one-line ``SpecError`` with ``file:line``)."""
    from ..profile import available_profiles, load_profile_file
    from ..workload.trace import load_trace

    path = Path(path)
    if not path.exists():
        raise SpecError(f"{path}: file not found")
    if not path.is_file():
        raise SpecError(f"{path}: not a file")
    if path.suffix.lower() not in (".yaml", ".yml"):
        raise SpecError(f"{path}: expected a scenario .yaml/.yml file")
    file = str(path)
    spec, lines = validate_yaml_file(path, ScenarioFile, "n_adapters (and optional trace, model, weights, "
                                                         "load_scale, ranks, windows, fixed_pool, objective, ...)",
                                     {**FIELD_MODELS, "drift": DriftSpec})

    def at(key: str) -> str:
        return f"{file}:{lines.get((key,), 1)}: {key}"

    base = path.parent
    trace_path, trace_label, shipped = _resolve_trace(spec, base, file, lines.get(("trace",), 1))
    load_trace(trace_path)  # a malformed trace fails now, with its own file:line
    if shipped:
        over = [k for k in spec.load_scale if k > SHIPPED_MAX_LOAD_SCALE]
        if over:
            raise SpecError(f"{at('load_scale')}: ×{over[0]:g} is above ×{SHIPPED_MAX_LOAD_SCALE:g}, the largest "
                            f"factor used on the shipped traces (×30 on the conversation trace ≈ 166 req/s, the "
                            f"paper's ×100)")

    profile_file = None
    models = spec.model
    if spec.profile is not None:
        p = Path(spec.profile).expanduser()
        p = p if p.is_absolute() else base / p
        try:
            prof = load_profile_file(p)
        except Exception as exc:  # ProfileError: name the scenario line too
            raise SpecError(f"{at('profile')}: {exc}") from None
        profile_file = str(p.resolve())
        models = [prof.model]
    else:
        known = {(g, m) for g, m, _ in available_profiles()}
        for m in models:
            if (spec.gpu, m) not in known:
                choices = sorted(mm for g, mm in known if g == spec.gpu)
                where = at("model") if ("model",) in lines else at("gpu")
                raise SpecError(f"{where}: no shipped profile for model '{m}' on '{spec.gpu}'; expected one of: "
                                f"{', '.join(choices) or '(none on this gpu)'}")

    if spec.methods is not None:
        from .placers import check_methods

        try:
            check_methods(spec.methods)
        except SpecError as exc:
            raise SpecError(f"{at('methods')}: {exc}") from None

    if spec.drift is not None:
        from ..workload.derive import trace_span_s

        span = trace_span_s(load_trace(trace_path))
        if spec.drift.end_s() > span:
            raise SpecError(f"{at('drift')}: {spec.drift.windows} windows of {spec.drift.window_s:g} s from "
                            f"{spec.drift.start_s:g} s end at {spec.drift.end_s():g} s, past the trace's {span:g} s; "
                            f"expected fewer or shorter windows")
    elif spec.windows.protocol == "E1":
        from ..workload.derive import trace_span_s

        span = trace_span_s(load_trace(trace_path))
        if spec.windows.split_s >= span:
            raise SpecError(f"{at('windows')}: split_s {spec.windows.split_s:g} is not inside the trace's "
                            f"{span:g} s; expected a split that leaves a replay window")

    name = spec.name or path.stem
    axes = {
        "model": models, "ranks": spec.ranks, "n_adapters": spec.n_adapters, "load_scale": spec.load_scale,
        "weights": spec.weights, "objective": spec.objective, "seed": spec.seed,
    }
    out: list[Scenario] = []
    for model, ranks, n, k, w, obj, seed in itertools.product(*axes.values()):
        parts = [name]
        if len(models) > 1:
            parts.append(_model_label(model))
        parts += [f"r{'-'.join(map(str, ranks))}", f"n{n}", f"x{_fmt_num(k)}"]
        if len(spec.weights) > 1:
            parts.append(w.replace(":", ""))
        limits = obj if isinstance(obj, Objective) else None
        obj_name = "custom" if limits is not None else obj
        if len(spec.objective) > 1:
            parts.append(limits.label() if limits is not None else obj_name)
        if len(spec.seed) > 1:
            parts.append(f"s{seed}")
        out.append(Scenario(
            name="-".join(parts), source=file, trace_path=trace_path, trace_label=trace_label, model=model,
            gpu=spec.gpu, profile_file=profile_file, n_adapters=n, weights=parse_weights(w), load_scale=k,
            ranks=tuple(ranks), trace_lengths=spec.lengths == "trace", protocol=spec.windows.protocol,
            split_s=spec.windows.split_s, jitter_s=spec.windows.jitter_s, fixed_pool=spec.fixed_pool,
            objective=obj_name, objective_limits=limits,
            methods=tuple(spec.methods) if spec.methods is not None else None, headroom=spec.headroom,
            verify=spec.verify, split_hot=spec.split_hot, seed=seed, replay_seed=spec.replay_seed,
            max_pack=spec.max_pack and spec.drift is None, verify_arrivals=spec.verify_arrivals, drift=spec.drift))
    assert all(p in PROTOCOLS for p in (s.protocol for s in out))
    return out
