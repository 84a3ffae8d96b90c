"""Workload spec: which adapters a server registers, how requests arrive and how long they are.

The validated models only. A workload is loaded from YAML or from a bare adapters CSV by
``lorapack.workload.load_workload`` (``workload/files.py``), which turns every malformed input into a one-line
``SpecError`` naming the file, the line and what was expected, e.g.
``demo.yaml:14: adapters[2].rate_rps: expected a finite number >= 0 (got -1)``.

YAML layout (all sections but the adapters are optional)::

    adapters:                      # registration order = list order (docs/engine-semantics.md, adapters)
      - {adapter_id: chat, rank: 16, rate_rps: 0.5, path: /lora/chat}
      - {count: 32, rank: 8, rate_rps: 0.1, id_prefix: r8}   # group -> r8-0 ... r8-31
    # or:  adapters_csv: adapters.csv   (relative to this file)
    lengths:  {kind: lognormal, mean_input_tokens: 223, mean_output_tokens: 197}
    arrivals: {kind: poisson}
    duration_s: 3600

Group ids are ``<id_prefix>-<k>`` with ``k`` counting from 0 per prefix across the whole list, so several
groups may share the default prefix ``adapter``. Relative data paths (``lengths.path``, ``arrivals.path``,
``adapters_csv``) are resolved against the YAML file's directory; an adapter's own ``path`` (its weights, for
``vllm serve --lora-modules``) is passed through untouched.

In ``trace`` arrival mode the adapters' ``rate_rps`` are ignored: the trace fixes the aggregate arrivals and
the adapters only receive requests through the assignment weights (``uniform``/``zipf``/``dirichlet``).
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    field_validator,
    model_validator,
)

DEFAULT_MEAN_INPUT_TOKENS = 223.0
DEFAULT_MEAN_OUTPUT_TOKENS = 197.0
DEFAULT_LENGTHS_CV = 1.1  # post-filter CV implied by the published runs (``workload.lengths``, an inference)
MAX_TOKENS = 2**31 - 1  # token counts are int32 in the engine's inputs
# log-normal gaps keep their mean 1/rate, but their median is exp(-sigma^2/2)/rate: past sigma ~6 nearly every
# gap is ~0 and a window's count is set by a handful of huge draws (sigma 50: the run never ends)
MAX_ARRIVAL_SIGMA = 6.0
MAX_ADAPTERS = 1_000_000  # per workload; loading and generating a million adapters already takes minutes


class FrozenModel(BaseModel):
    """Immutable, and unknown fields are errors (a misspelt key must not be ignored)."""

    model_config = ConfigDict(frozen=True, extra="forbid")


def reject_bool(value: Any) -> Any:
    # pydantic's lax mode turns True into 1; a boolean rank or rate is always a typo
    if isinstance(value, bool):
        raise ValueError(f"expected a number, got a boolean ({value})")
    return value


def _positive_int(value: int) -> int:
    if value < 1:
        raise ValueError("expected a positive integer")
    return value


MAX_LORA_RANK = 512  # the largest --max-lora-rank any vLLM version accepts (server.RULE_SETS)


def _rank(value: int) -> int:
    """A LoRA rank vLLM can serve: an integer 1 ... 512 (checked here, so the error names the file and line)."""
    if value < 1 or value > MAX_LORA_RANK:
        raise ValueError(f"expected an integer rank 1 ... {MAX_LORA_RANK} (the largest --max-lora-rank vLLM "
                         f"accepts is {MAX_LORA_RANK})")
    return value


def _rate(value: float) -> float:
    if not math.isfinite(value) or value < 0:
        raise ValueError("expected a finite number >= 0")
    return value


def finite_positive(value: float) -> float:
    if not math.isfinite(value) or value <= 0:
        raise ValueError("expected a finite number > 0")
    return value


def finite_nonnegative(value: float) -> float:
    if not math.isfinite(value) or value < 0:
        raise ValueError("expected a finite number >= 0")
    return value


def nonnegative_int(value: int) -> int:
    """A seed or count field: an integer >= 0."""
    if value < 0:
        raise ValueError("expected a non-negative integer")
    return value


def _arrival_sigma(value: float) -> float:
    if not math.isfinite(value) or not 0 < value <= MAX_ARRIVAL_SIGMA:
        raise ValueError(f"expected a number in (0, {MAX_ARRIVAL_SIGMA:g}]: larger sigmas make almost every gap "
                         f"~0 s and a window's count depend on a few huge draws")
    return value


def _identifier(value: Any) -> Any:
    # YAML reads `adapter_id: 7` as an int; ids are names, so accept numbers as their text
    if isinstance(value, int | float) and not isinstance(value, bool):
        value = str(value)
    if isinstance(value, str):
        value = value.strip()
        if not value or any(ch.isspace() for ch in value):
            raise ValueError("expected a non-empty name without spaces")
    return value


# ---------------------------------------------------------------------------------------------------------
# adapters


class Adapter(FrozenModel):
    """One served adapter. Its position in ``Workload.adapters`` is its registration index."""

    adapter_id: str
    rank: int
    rate_rps: float
    path: str | None = None  # weights location, passed through to the vLLM command line

    _id = field_validator("adapter_id", mode="before")(_identifier)
    _nb = field_validator("rank", "rate_rps", mode="before")(reject_bool)
    _r = field_validator("rank")(_rank)
    _rt = field_validator("rate_rps")(_rate)

    @field_validator("path", mode="before")
    @classmethod
    def _empty_path(cls, value: Any) -> Any:
        # an empty CSV cell means "no path"
        return None if isinstance(value, str) and not value.strip() else value


class AdapterGroup(FrozenModel):
    """``count`` identical adapters, expanded to ids ``<id_prefix>-<k>`` (YAML shorthand)."""

    count: int
    rank: int
    rate_rps: float
    id_prefix: str = "adapter"

    _nb = field_validator("count", "rank", "rate_rps", mode="before")(reject_bool)
    _c = field_validator("count")(_positive_int)
    _r = field_validator("rank")(_rank)
    _rt = field_validator("rate_rps")(_rate)
    _id = field_validator("id_prefix", mode="before")(_identifier)

    @field_validator("count")
    @classmethod
    def _not_too_many(cls, value: int) -> int:
        if value > MAX_ADAPTERS:
            raise ValueError(f"expected at most {MAX_ADAPTERS:,} adapters")
        return value


def expand_adapters(entries: list[Adapter | AdapterGroup]) -> list[Adapter]:
    """Flatten groups in order; group ids count from 0 per prefix over the whole list."""
    next_k: dict[str, int] = {}
    out: list[Adapter] = []
    for entry in entries:
        if isinstance(entry, Adapter):
            out.append(entry)
            continue
        k0 = next_k.get(entry.id_prefix, 0)
        out.extend(
            Adapter(adapter_id=f"{entry.id_prefix}-{k}", rank=entry.rank, rate_rps=entry.rate_rps)
            for k in range(k0, k0 + entry.count)
        )
        next_k[entry.id_prefix] = k0 + entry.count
    return out


def _entry_kind(value: Any) -> str:
    if isinstance(value, dict) and "count" in value:
        return "group"
    if isinstance(value, AdapterGroup):
        return "group"
    return "adapter"


AdapterEntry = Annotated[
    Annotated[Adapter, Tag("adapter")] | Annotated[AdapterGroup, Tag("group")],
    Discriminator(_entry_kind),
]


# ---------------------------------------------------------------------------------------------------------
# lengths


class LengthsSpec(FrozenModel):
    """Prompt / output token counts of the requests.

    * ``fixed``: every request has ``round(mean_input_tokens)`` / ``round(mean_output_tokens)`` tokens.
    * ``lognormal``: the ShareGPT-like fallback of ``workload.lengths`` -- independent log-normals truncated by the
      ShareGPT filter (``P >= 4, O >= 4, P <= 1024, P + O <= 2048``) whose post-filter means equal the
      targets and whose post-filter CV is ``cv``. An approximation of real lengths; say so in reports.
    * ``empirical``: ``(P, O)`` pairs bootstrapped (with replacement) from a CSV ``input_tokens,output_tokens``
      at ``path``; the means are then ignored.
    """

    kind: Literal["fixed", "lognormal", "empirical"] = "lognormal"
    mean_input_tokens: float = DEFAULT_MEAN_INPUT_TOKENS
    mean_output_tokens: float = DEFAULT_MEAN_OUTPUT_TOKENS
    cv: float = DEFAULT_LENGTHS_CV
    path: str | None = None

    _nb = field_validator("mean_input_tokens", "mean_output_tokens", "cv", mode="before")(reject_bool)

    @field_validator("mean_input_tokens", "mean_output_tokens")
    @classmethod
    def _mean(cls, value: float) -> float:
        if not math.isfinite(value) or not 1 <= value <= MAX_TOKENS:
            raise ValueError(f"expected a finite number of tokens between 1 and {MAX_TOKENS:,}")
        return value

    _cv = field_validator("cv")(finite_positive)

    @model_validator(mode="after")
    def _consistent(self) -> LengthsSpec:
        if self.kind == "empirical" and not self.path:
            raise ValueError("kind 'empirical' expects 'path' (a CSV with columns input_tokens,output_tokens)")
        if self.kind != "empirical" and self.path:
            raise ValueError(f"'path' is only used by kind 'empirical', not '{self.kind}'")
        return self


# ---------------------------------------------------------------------------------------------------------
# arrivals


class PoissonArrivals(FrozenModel):
    """Each adapter: a Poisson process at ``rate_rps`` (exponential gaps)."""

    kind: Literal["poisson"] = "poisson"


class LognormalArrivals(FrozenModel):
    """Each adapter: log-normal gaps with mean ``1/rate_rps`` (``mu = -ln(rate) - sigma^2/2``)."""

    kind: Literal["lognormal"] = "lognormal"
    sigma: float = 1.0

    _s = field_validator("sigma")(_arrival_sigma)


class UnpredictableArrivals(FrozenModel):
    """The paper's perturbed process (placement.md §6.5).

    Time is cut into ``period_s`` periods. Each adapter starts at its nominal rate (multiplier 1); at every
    period start it picks Poisson or log-normal gaps with equal probability, and from the second period on it
    also multiplies or divides its multiplier by ``factor`` (equal probability), clipped to
    ``[1/clip, clip]``. A gap that crosses a period boundary is discarded and arrivals restart at the
    boundary with the new law.
    """

    kind: Literal["unpredictable"] = "unpredictable"
    period_s: float = 300.0
    factor: float = 2.0
    clip: float = 8.0
    sigma: float = 1.0

    _p = field_validator("period_s")(finite_positive)
    _s = field_validator("sigma")(_arrival_sigma)

    @field_validator("factor", "clip")
    @classmethod
    def _at_least_one(cls, value: float) -> float:
        if not math.isfinite(value) or value < 1:
            raise ValueError("expected a finite number >= 1")
        return value


class ModulatedArrivals(FrozenModel):
    """Every adapter: a Poisson process whose rate follows one shared profile, ``rate_rps x multipliers[j]``
    during period ``j`` (``period_s`` long; the profile repeats past its end).

    The load swings of a real trace hit every adapter at once: e.g. the per-minute request counts of a trace
    divided by their mean (``lorapack evaluate`` verifies plans against the estimation window's profile). The
    mean rate is ``rate_rps x mean(multipliers)``; normalise the profile to mean 1 to keep ``rate_rps``.
    """

    kind: Literal["modulated"] = "modulated"
    period_s: float = 60.0
    multipliers: list[float] = Field(min_length=1, max_length=100_000)

    _nb = field_validator("period_s", mode="before")(reject_bool)
    _p = field_validator("period_s")(finite_positive)

    @field_validator("multipliers", mode="before")
    @classmethod
    def _no_bools(cls, value: Any) -> Any:
        if isinstance(value, list | tuple) and any(isinstance(m, bool) for m in value):
            raise ValueError("expected numbers, not true/false")
        return value

    @field_validator("multipliers")
    @classmethod
    def _multipliers(cls, value: list[float]) -> list[float]:
        for j, m in enumerate(value):
            if not math.isfinite(m) or m < 0:
                raise ValueError(f"multiplier {j} is {m!r}; expected finite numbers >= 0")
        if not sum(value) > 0:
            raise ValueError("every multiplier is 0; expected at least one positive")
        return value

    @property
    def mean_multiplier(self) -> float:
        return sum(self.multipliers) / len(self.multipliers)


class TraceArrivals(FrozenModel):
    """Replay a trace CSV ``arrived_at,num_prefill_tokens,num_decode_tokens`` (data/README.md §5).

    Requests at ``arrived_at >= start_s`` are replayed shifted by ``-start_s`` with their exact times and (if
    ``trace_lengths``) their exact token counts. ``load_scale`` k: the integer part by replication (copies
    after the first get uniform ``±jitter_s`` jitter, clipped at 0, re-sorted), the fractional part by
    Bernoulli thinning of one more jittered copy (for k < 1: thinning of the original). Then each request in
    the window gets an adapter: one request per adapter first when there are at least as many requests as
    adapters, the rest multinomial over ``assignment`` weights, then shuffled. The adapters' ``rate_rps`` are
    ignored in this mode. With ``trace_lengths: false`` lengths come from the workload's ``lengths`` spec.
    A relative ``path`` is relative to the YAML file when loaded by ``load_workload``, else to the working
    directory.
    """

    kind: Literal["trace"] = "trace"
    path: str
    assignment: Literal["uniform", "zipf", "dirichlet"] = "uniform"
    zipf_s: float = 1.0  # weight of the j-th adapter of a seeded permutation ∝ j^-zipf_s
    dirichlet_alpha: float = 0.5  # weights ~ Dirichlet(alpha, ..., alpha); the paper's default
    load_scale: float = 1.0
    jitter_s: float = 5.0
    start_s: float = 0.0
    trace_lengths: bool = True

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, data: Any) -> Any:
        # placement.md writes assignments as "zipf:1.2" / "dirichlet:0.3"; accept that spelling too
        if isinstance(data, dict) and isinstance(data.get("assignment"), str) and ":" in data["assignment"]:
            name, _, param = data["assignment"].partition(":")
            key = {"zipf": "zipf_s", "dirichlet": "dirichlet_alpha"}.get(name.strip())
            if key is not None and key not in data:
                data = {**data, "assignment": name.strip(), key: param.strip()}
        return data

    _nb = field_validator("zipf_s", "dirichlet_alpha", "load_scale", "jitter_s", "start_s", mode="before")(
        reject_bool
    )
    _pos = field_validator("dirichlet_alpha", "load_scale")(finite_positive)
    _nonneg = field_validator("zipf_s", "jitter_s", "start_s")(finite_nonnegative)


ArrivalsSpec = Annotated[
    PoissonArrivals | LognormalArrivals | UnpredictableArrivals | ModulatedArrivals | TraceArrivals,
    Field(discriminator="kind"),
]


def _default_kind(value: Any, kind: str) -> Any:
    # `arrivals: poisson` is shorthand for `{kind: poisson}`; a mapping without kind gets the default
    if isinstance(value, str):
        return {"kind": value}
    if isinstance(value, dict) and "kind" not in value:
        return {"kind": kind, **value}
    return value


def default_lengths_kind(value: Any) -> Any:
    return _default_kind(value, "lognormal")


def _arrivals_kind(value: Any) -> Any:
    return _default_kind(value, "poisson")


# ---------------------------------------------------------------------------------------------------------
# workload


class Workload(FrozenModel):
    """Adapters (registration order), length and arrival laws, and an optional default window."""

    adapters: list[Adapter] = Field(min_length=1)
    lengths: LengthsSpec = LengthsSpec()
    arrivals: ArrivalsSpec = PoissonArrivals()
    duration_s: float | None = None

    _lk = field_validator("lengths", mode="before")(default_lengths_kind)
    _ak = field_validator("arrivals", mode="before")(_arrivals_kind)

    @field_validator("duration_s")
    @classmethod
    def _duration(cls, value: float | None) -> float | None:
        return None if value is None else finite_positive(value)

    @model_validator(mode="after")
    def _unique_ids(self) -> Workload:
        seen: set[str] = set()
        for i, a in enumerate(self.adapters):
            if a.adapter_id in seen:
                raise ValueError(f"duplicate adapter_id '{a.adapter_id}' (adapter {i}); expected unique ids")
            seen.add(a.adapter_id)
        return self

    @property
    def n_adapters(self) -> int:
        return len(self.adapters)

    @property
    def adapter_ids(self) -> list[str]:
        return [a.adapter_id for a in self.adapters]

    @property
    def ranks(self) -> np.ndarray:
        """int32 [n_adapters], registration order."""
        return np.fromiter((a.rank for a in self.adapters), dtype=np.int32, count=len(self.adapters))

    @property
    def rates_rps(self) -> np.ndarray:
        """float64 [n_adapters], registration order (nominal; ignored by trace arrivals)."""
        return np.fromiter((a.rate_rps for a in self.adapters), dtype=np.float64, count=len(self.adapters))


class WorkloadFile(FrozenModel):
    """The YAML file as written: adapters may be groups, or come from a CSV."""

    adapters: list[AdapterEntry] | None = None
    adapters_csv: str | None = None
    lengths: LengthsSpec = LengthsSpec()
    arrivals: ArrivalsSpec = PoissonArrivals()
    duration_s: float | None = None

    _lk = field_validator("lengths", mode="before")(default_lengths_kind)
    _ak = field_validator("arrivals", mode="before")(_arrivals_kind)
    _nb = field_validator("duration_s", mode="before")(reject_bool)

    @field_validator("adapters")
    @classmethod
    def _non_empty(cls, value: list | None) -> list | None:
        if value is not None and not value:
            raise ValueError("expected at least one adapter")
        return value

    @field_validator("duration_s")
    @classmethod
    def _duration(cls, value: float | None) -> float | None:
        return None if value is None else finite_positive(value)

    @model_validator(mode="after")
    def _one_source(self) -> WorkloadFile:
        if (self.adapters is None) == (self.adapters_csv is None):
            raise ValueError("expected exactly one of 'adapters' (a list) or 'adapters_csv' (a path)")
        n = sum(e.count if isinstance(e, AdapterGroup) else 1 for e in self.adapters or ())
        if n > MAX_ADAPTERS:
            raise ValueError(f"{n:,} adapters; expected at most {MAX_ADAPTERS:,} per workload")
        return self


# the models below the top level of a file, by key or union tag: the "expected one of: ..." hint of an
# unknown field lists the fields of the model it was found in (``textfiles.validation_error``)
FIELD_MODELS: dict[str, type[BaseModel]] = {
    "lengths": LengthsSpec, "adapter": Adapter, "group": AdapterGroup, "poisson": PoissonArrivals,
    "lognormal": LognormalArrivals, "unpredictable": UnpredictableArrivals, "modulated": ModulatedArrivals,
    "trace": TraceArrivals,
}
