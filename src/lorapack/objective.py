"""What every GPU of a plan must achieve: the one ``Objective`` that ``place`` plans for, its verification
checks, ``evaluate``'s scenario files name and its replay judges.

Besides starting and not starving (the paper's label, always), a GPU meets the latency limits that are set:
mean and p99 time to first token, mean and p99 inter-token latency (``None`` = no limit). ``Objective()`` is
the default latency objective (mean TTFT <= 2 s); ``Objective.throughput()`` the paper's criterion alone.

A leaf module (no numpy, no twin): scenario files are checked with it before anything heavy is imported, and
the oracle takes its starvation threshold from here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, Protocol

from .errors import SpecError

# The default latency objective (documented in docs/placement.md and `lorapack place --help`): the mean
# time to first token of every GPU at most 2 s. An interactive chat service notices waits beyond a couple of
# seconds; in the twin a GPU is either well below this (0.05-0.3 s: no queue) or far above (tens of seconds:
# a queue builds), so the exact value between 1 and 10 s moves few plans.
DEFAULT_MAX_TTFT_S = 2.0
# The paper's starvation label: a GPU is starved when it completes < 90 % of the offered tokens.
STARVATION_RATIO = 0.9
# a candidate whose predicted probability of starving reaches this is not served (``Prediction.serves``)
STARVED_PROBABILITY = 0.5
OBJECTIVE_KINDS = ("latency", "throughput")


class Prediction(Protocol):
    """What the objective reads of a GPU's prediction (``lorapack.oracle.Prediction``; NaN = not predicted)."""

    fits: bool
    starved: float  # probability (an oracle) or share of seeds (the twin)
    adapter_starved: float
    ttft_s: float
    itl_ms: float
    ttft_p99_s: float
    itl_p99_ms: float


def _limit(help_text: str) -> Any:
    return field(default=None, metadata={"help": help_text})


def limit_error(value: object) -> str | None:
    """Why ``value`` is not a latency limit (``None``: it is one, or it is unset)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        return "expected a finite number > 0"
    return None


@dataclass(frozen=True)
class Objective:
    """The latency limits every GPU must meet besides starting and not starving (``None`` = no limit).

    Field order is the order of ``lorapack place``'s flags and of plan.json's ``settings.objective``."""

    max_ttft_s: float | None = field(default=DEFAULT_MAX_TTFT_S, metadata={
        "help": "Mean time to first token per GPU, seconds (latency objective default: 2)."})
    max_itl_ms: float | None = _limit("Mean inter-token latency, ms.")
    max_ttft_p99_s: float | None = _limit("p99 TTFT, seconds.")
    max_itl_p99_ms: float | None = _limit("p99 of every inter-token gap, ms.")

    def __post_init__(self) -> None:
        for name in self.keys():
            v = getattr(self, name)
            if (why := limit_error(v)) is not None:
                raise SpecError(f"--{name.replace('_', '-')} {v}: {why}")

    @staticmethod
    def keys() -> tuple[str, ...]:
        return tuple(f.name for f in fields(Objective))

    @classmethod
    def throughput(cls) -> Objective:
        """The paper's criterion: throughput >= 90 % of the offered load, no latency limit."""
        return cls(max_ttft_s=None)

    @classmethod
    def of(cls, kind: str, **limits: float | None) -> Objective:
        """``lorapack place --objective KIND`` with its limit flags: ``latency`` sets mean TTFT <= 2 s unless
        ``max_ttft_s`` is given; ``throughput`` sets only the limits given."""
        if kind not in OBJECTIVE_KINDS:
            raise SpecError(f"--objective {kind}: expected {' or '.join(OBJECTIVE_KINDS)}")
        if kind == "latency" and limits.get("max_ttft_s") is None:
            limits["max_ttft_s"] = DEFAULT_MAX_TTFT_S
        return cls(**{"max_ttft_s": None, **limits})

    @classmethod
    def limits_only(cls, limits: dict[str, Any]) -> Objective:
        """The limits of a mapping and no others (a scenario file's ``objective: {max_itl_ms: 60}``): the keys
        unknown, a value not a limit or no limit at all are ``SpecError``s naming the key."""
        for k, v in limits.items():
            if k not in cls.keys():
                raise SpecError(f"unknown field '{k}'; expected {', '.join(cls.keys())}")
            if (why := limit_error(v)) is not None:
                raise SpecError(f"{k}: {why}")
        if all(limits.get(k) is None for k in cls.keys()):
            raise SpecError(f"expected at least one of {', '.join(cls.keys())}")
        return cls(**{k: limits.get(k) for k in cls.keys()})

    @property
    def name(self) -> str:
        return "latency" if self.limits() else "throughput"

    def limits(self) -> dict[str, float]:
        """The latency limits that are set, by field name."""
        return {k: v for k in self.keys() if (v := getattr(self, k)) is not None}

    def latency_violations(self, ttft_s: float, itl_ms: float, ttft_p99_s: float, itl_p99_ms: float,
                           unknown_breaks: bool = False) -> list[str]:
        """Names of the latency limits the values break. NaN (unknown) breaks nothing for a prediction (the
        oracle did not predict it) and everything for a measurement (``unknown_breaks``: nothing completed)."""
        vals = {"max_ttft_s": ttft_s, "max_itl_ms": itl_ms, "max_ttft_p99_s": ttft_p99_s,
                "max_itl_p99_ms": itl_p99_ms}
        if unknown_breaks:
            return [k for k, lim in self.limits().items() if not vals[k] <= lim]
        return [k for k, lim in self.limits().items() if vals[k] > lim]  # NaN > x is False

    def latency_use(self, p: Prediction) -> float:
        """The largest share of a latency limit the prediction uses (0.4 = 40 % of the tightest limit); NaN
        when the objective sets no limit or the oracle predicts none of the limited values."""
        vals = {"max_ttft_s": p.ttft_s, "max_itl_ms": p.itl_ms, "max_ttft_p99_s": p.ttft_p99_s,
                "max_itl_p99_ms": p.itl_p99_ms}
        uses = [vals[k] / lim for k, lim in self.limits().items() if math.isfinite(vals[k])]
        return max(uses) if uses else math.nan

    def margin_use(self, p: Prediction) -> float:
        """How close a prediction comes to failing ``check``: the larger of ``latency_use`` and the starvation
        probability as a share of ``STARVED_PROBABILITY``; 0 for what the oracle does not predict. A re-plan
        places an adapter where this is smallest (docs/replan.md: a GPU the learned oracle passes near its
        starvation border is one the twin's verification may fail)."""
        lat = self.latency_use(p)
        starved = p.starved / STARVED_PROBABILITY
        return max(lat if math.isfinite(lat) else 0.0, starved if math.isfinite(starved) else 0.0)

    def check(self, p: Prediction) -> str | None:
        """``None`` if the predicted GPU meets the objective, else the binding constraint: ``memory`` (vLLM
        does not start), ``throughput`` (starved: the paper's label or an adapter starved) or ``latency``."""
        if not p.fits:
            return "memory"
        if not p.starved < STARVED_PROBABILITY or p.adapter_starved >= STARVED_PROBABILITY:  # NaN (unknown) passes
            return "throughput"
        if self.latency_violations(p.ttft_s, p.itl_ms, p.ttft_p99_s, p.itl_p99_ms):
            return "latency"
        return None

    def to_dict(self) -> dict:
        return {"name": self.name, "min_throughput_ratio": STARVATION_RATIO, **self.limits()}

    def label(self) -> str:
        """A short name for scenario names and report keys, e.g. ``ttft_s2+itl_ms60``."""
        return "+".join(f"{k.removeprefix('max_')}{getattr(self, k):g}" for k in _LABEL_ORDER
                        if getattr(self, k) is not None)

    def describe(self) -> str:
        """The limits in words, e.g. ``mean TTFT <= 2 s, p99 ITL <= 80 ms``."""
        parts = [f"{label} <= {getattr(self, k):g}{unit}" for k, label, unit in (
            ("max_ttft_s", "mean TTFT", " s"), ("max_ttft_p99_s", "p99 TTFT", " s"),
            ("max_itl_ms", "mean ITL", " ms"), ("max_itl_p99_ms", "p99 ITL", " ms")) if getattr(self, k) is not None]
        return ", ".join(parts) if parts else "none (throughput only)"


# scenario names and their labels were made in this order before the objective was one type: kept so that
# the names of existing studies do not change
_LABEL_ORDER = ("max_ttft_s", "max_ttft_p99_s", "max_itl_ms", "max_itl_p99_ms")
