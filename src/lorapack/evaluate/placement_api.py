"""``Placer`` over ``lorapack.placement``: which methods exist, how each is called, what the bound is.

* The greedy methods (``proposed``, ``proposed-fast``, ``proposed-exact``) open GPUs themselves and are
  verified by the twin and repaired (``verify`` of the scenario; ``verification_added_gpus`` in the results).
* The pool methods (``proposed-lat`` and the baselines) are run raw, as published: ``gpus=None`` gives the
  count of placement's own smallest-pool search (each size accepted by the method and validated by the twin
  with one seed), the evaluation then looks for the smallest pool whose *replay* is clean; ``gpus=G`` is one
  run on G GPUs (the fixed-pool protocol).
* The lower bound is ``placement.lower_bound`` on the instance the methods get (headroom applied), without the
  ``N_max`` row for every method: the greedy methods run with placement's default soft ``n_max`` (their
  twin-verified consolidation may exceed it, as the baselines may); the bound with the row is reported beside it; under a latency objective with its latency row, simulated as the greedy
  methods' verification (the scenario's verification arrivals and seeds) -- the bound ``place`` reports.
"""

from __future__ import annotations

from ..objective import Objective
from ..oracle import Oracle
from ..placement import (
    DEFAULT_HEADROOM,
    OracleOverrides,
    PlaceConfig,
    get_method,
    instance_from_workload,
    lower_bound,
    method_names,
    place,
    verify_plan,
)
from ..placement.api import twin_verifier, verification_latency_row
from ..placement.config import DEFAULT_VERIFY_SEEDS, workload_verify_law
from ..placement.plan import Plan
from ..profile import Profile
from ..spec import Workload
from .methods import Bounds, PlaceRequest


def placement_objective(name: str, limits: Objective | None) -> Objective:
    """A scenario's objective: ``throughput``, ``custom`` (its limits) or ``default`` (mean TTFT <= 2 s)."""
    if name == "throughput":
        return Objective.throughput()
    if name == "custom" and limits is not None:
        return limits
    return Objective()


def _config(req: PlaceRequest, workers: int, verify: bool) -> PlaceConfig:
    return PlaceConfig(method=req.method, gpus=req.gpus, objective=placement_objective(req.objective, req.limits),
                       headroom=DEFAULT_HEADROOM if req.headroom is None else req.headroom, verify=verify,
                       seed=req.seed, split_hot=req.split_hot, workers=workers)


class PlacementPlacer:
    """lorapack's placement methods behind the ``Placer`` interface."""

    def __init__(self, workers: int = 1) -> None:
        self.workers = workers
        self._verifiers: dict[tuple, Oracle] = {}

    def new_workload(self) -> None:
        """The runner moved on to another workload: drop the shared verifiers' answers (memory)."""
        self._verifiers.clear()

    def _verifier(self, workload: Workload, profile: Profile, seed: int) -> Oracle:
        """One verifier per (profile, seed, arrival law) for every method and protocol of a workload: the greedy
        methods' plans, their fixed-pool plans and the consolidation candidates coincide often (e.g. the same
        balanced dealing tried by all three), and each GPU is simulated once. Verdicts are unchanged (each GPU's
        runs depend on its content and seeds only); the plans' ``verification.simulations`` count this call's
        own simulations, ``cached_gpus`` the GPUs answered from the shared cache (``verification_ms`` shrinks
        accordingly)."""
        law = workload_verify_law(workload)
        key = (profile.file_hash(), seed, None if law is None else law.model_dump_json())
        if key not in self._verifiers:
            self._verifiers[key] = twin_verifier(seed, DEFAULT_VERIFY_SEEDS, self.workers, law)
        return self._verifiers[key]

    def methods(self) -> tuple[str, ...]:
        return method_names()

    def sizes_itself(self, method: str) -> bool:
        return get_method(method).greedy

    def objective(self, name: str, limits: Objective | None) -> Objective:
        return placement_objective(name, limits)

    def lower_bound(self, workload: Workload, profile: Profile, req: PlaceRequest) -> Bounds:
        inst = instance_from_workload(workload, headroom=DEFAULT_HEADROOM if req.headroom is None else req.headroom)
        objective = placement_objective(req.objective, req.limits)
        lat = None
        if objective.limits():  # the latency row, simulated as placement's verification (its law and seeds)
            lat = verification_latency_row(profile, inst, objective, workload_verify_law(workload), req.seed,
                                           DEFAULT_VERIFY_SEEDS)
        b = lower_bound(inst, profile, latency_capacity=lat)
        return Bounds(gpus=int(b.gpus), gpus_no_nmax=int(b.gpus_no_nmax))

    def method_bound(self, method: str, bounds: Bounds) -> int:
        return bounds.gpus_no_nmax  # the soft n_max of place(): see the module docstring

    def verify(self, workload: Workload, profile: Profile, req: PlaceRequest, plan: Plan) -> dict | None:
        verdicts = verify_plan(plan, workload, profile, _config(req, self.workers, True),
                               self._verifier(workload, profile, req.seed))
        bad = [(g, v) for g, v in enumerate(verdicts) if not v.passed]
        return {"passed": not bad, "failed_gpus": len(bad),
                "details": [f"GPU {g}: {v.reason}: {v.detail}" for g, v in bad]}

    def place(self, workload: Workload, profile: Profile, req: PlaceRequest) -> Plan:
        config = _config(req, self.workers, req.verify and get_method(req.method).greedy)
        shared = OracleOverrides(verify_oracle=self._verifier(workload, profile, req.seed)) if req.verify else None
        return place(workload, profile, config, shared)
