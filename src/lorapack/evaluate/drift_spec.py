"""The ``drift:`` block of a scenario file: evaluation over several consecutive windows (``lorapack.evaluate.drift``).

Apart from ``drift`` (which imports the scenario module) so that ``scenario`` can validate the block::

    drift:
      windows: 8                 # consecutive windows of the trace
      window_s: 420              # each window's length (s); windows start at start_s: window w replays the
      start_s: 0                 # trace's [start_s + w window_s, start_s + (w + 1) window_s), load-scaled
      sigma: 0.3                 # per-window step (std) of every adapter's log-popularity random walk
      arrivals: 0.05             # new adapters per window: Poisson with mean arrivals x n_adapters
      departures: 0.05           # probability that an active adapter leaves at the start of a window
      seed: 0                    # the drift's own streams (walk, arrivals, departures, request labels)
      policies: [peak, scratch, "replan:8", "replan:32", replan]   # replan = no cap (--max-moves unset)
"""

from __future__ import annotations

import math
import re
from typing import Any

from pydantic import Field, field_validator

from ..spec import FrozenModel, finite_nonnegative, finite_positive, nonnegative_int, reject_bool

POLICY_RE = re.compile(r"^(peak|scratch|replan)(?::(\d+))?$")
DEFAULT_POLICIES = ("peak", "scratch", "replan:8", "replan:32", "replan")


def parse_policy(text: str) -> tuple[str, int | None]:
    """``peak`` | ``scratch`` | ``replan`` | ``replan:K`` -> ``(kind, K)`` (ValueError if malformed)."""
    m = POLICY_RE.match(str(text).strip())
    if m is None or (m.group(2) is not None and m.group(1) != "replan"):
        raise ValueError(f"expected peak, scratch, replan or replan:K with K an integer >= 0 (got {text!r})")
    return m.group(1), None if m.group(2) is None else int(m.group(2))


class DriftSpec(FrozenModel):
    """The drift model and the policies compared on its windows (module docstring)."""

    windows: int = 8
    window_s: float = 420.0
    start_s: float = 0.0
    sigma: float = 0.3
    arrivals: float = 0.05
    departures: float = 0.05
    seed: int = 0
    policies: list[str] = Field(default_factory=lambda: list(DEFAULT_POLICIES), min_length=1)

    _nb = field_validator("windows", "window_s", "start_s", "sigma", "arrivals", "departures", "seed",
                          mode="before")(reject_bool)
    _ws = field_validator("window_s")(finite_positive)
    _nn = field_validator("start_s", "sigma", "arrivals")(finite_nonnegative)

    @field_validator("windows")
    @classmethod
    def _windows(cls, value: int) -> int:
        if value < 2:
            raise ValueError("expected at least 2 windows (one window has nothing to re-plan)")
        return value

    @field_validator("departures")
    @classmethod
    def _departures(cls, value: float) -> float:
        if not (math.isfinite(value) and 0 <= value < 1):
            raise ValueError("expected a probability in [0, 1)")
        return value

    _seed = field_validator("seed")(nonnegative_int)

    @field_validator("policies", mode="before")
    @classmethod
    def _policies(cls, value: Any) -> Any:
        value = value if isinstance(value, list) else [value]
        out = []
        for v in value:
            kind, k = parse_policy(v)
            out.append(kind if k is None else f"{kind}:{k}")
        if len(set(out)) != len(out):
            raise ValueError("expected distinct policies")
        return out

    def end_s(self) -> float:
        """Where the last window ends on the trace's clock."""
        return self.start_s + self.windows * self.window_s
