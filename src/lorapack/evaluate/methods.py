"""The placement side of an evaluation: what ``lorapack evaluate`` asks ``lorapack.placement``.

``Placer`` is the narrow interface the runner uses (so tests can plug a toy placer); ``PlacementPlacer``
implements it with lorapack's placement methods.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from ..objective import Objective
from ..placement.plan import Plan
from ..profile import Profile
from ..spec import Workload


@dataclass(frozen=True)
class Bounds:
    """Lower bounds on the GPUs of any plan: with the N_max-adapters-per-GPU row and without it."""

    gpus: int
    gpus_no_nmax: int


@dataclass(frozen=True)
class PlaceRequest:
    """One placement call: a method, a pool cap (None = the smallest pool the method finds) and settings."""

    method: str
    gpus: int | None
    objective: str  # default | throughput | custom
    limits: Objective | None  # for custom objectives
    headroom: float | None
    verify: bool
    seed: int
    split_hot: bool = False


class Placer(Protocol):
    """What the evaluation needs from a placement implementation. Optional beyond these: ``new_workload()``,
    called when the runner moves on to another workload, so a placer can drop caches shared by that workload's
    calls (``PlacementPlacer``'s verifiers)."""

    def methods(self) -> tuple[str, ...]:
        """Every method name, in report order."""
        ...

    def sizes_itself(self, method: str) -> bool:
        """True when the method opens GPUs itself (its own count is its answer), False when it places onto
        a given number of GPUs (the evaluation then searches the smallest replay-clean pool)."""
        ...

    def objective(self, name: str, limits: Objective | None) -> Objective:
        """The per-GPU latency limits a replayed GPU must meet under this objective."""
        ...

    def lower_bound(self, workload: Workload, profile: Profile, req: PlaceRequest) -> Bounds:
        """The bound for the scenario's objective, headroom and seed (``req``; its method and pool unused)."""
        ...

    def method_bound(self, method: str, bounds: Bounds) -> int:
        """The bound a method is compared with (without the N_max row for methods that may exceed it)."""
        ...

    def place(self, workload: Workload, profile: Profile, req: PlaceRequest) -> Plan:
        """A plan (``infeasible`` set when the method declares the workload infeasible on the pool)."""
        ...

    def verify(self, workload: Workload, profile: Profile, req: PlaceRequest, plan: Plan) -> dict | None:
        """``plan`` (another method's) judged by the verification ``req.method``'s plans get: ``{"passed",
        "failed_gpus", "details"}``; None when the placer has no verifier."""
        ...
