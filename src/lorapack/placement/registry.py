"""The placement methods, in one registry: ``place()``, ``lorapack place --help``, ``evaluate`` (its method list
and its report's baselines) and ``lorapack demo`` all read it. A new method is one ``register(Method(...))``.

Two kinds (placement.md §4):

* **greedy** -- opens GPUs itself: the one greedy driver (``greedy.greedy_fill``, then rebalancing, twin
  verification, repair and consolidation) asks the method's ``oracle`` whether a GPU can take more adapters.
  A greedy method is its oracle: it has no function of its own.
* **pool** -- places onto a given number of GPUs (``run``: one raw run, no verification); ``place()`` without
  ``gpus`` searches the smallest pool the method accepts and the twin validates (``api.smallest_pool``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

from ..errors import SpecError
from ..objective import Objective
from ..oracle import Oracle, default_slot_rank
from ..profile import Profile
from .baselines import (
    Assignment,
    dlora,
    least_adapters,
    loraserve,
    loraserve_min_gpus,
    proposed_lat,
    round_robin,
)
from .bound import CapacityFn
from .greedy import GreedyOptions
from .problem import Instance


class MethodContext(Protocol):
    """What a pool method may use of the call it runs in (``api.Context`` implements it)."""

    profile: Profile
    objective: Objective
    options: GreedyOptions

    def twin(self) -> Oracle:
        """The search's twin (one seed, early termination), shared by the call."""
        ...

    def oracle_of(self, kind: str) -> Oracle:
        """The oracle of ``kind`` (``ORACLE_KINDS``), built once per call."""
        ...

    def cap(self, inst: Instance) -> CapacityFn:
        """The bound's ``C(S)``: the twin's saturated throughput of one GPU per slot rank."""
        ...


PoolRun = Callable[[Instance, MethodContext, int], Assignment]
# the learned models' kinds (``lorapack.surrogate.load_oracle``) and the twin
ORACLE_KINDS = ("surrogate", "tree", "twin")


@dataclass(frozen=True)
class Method:
    """One placement method. ``oracle``: what it asks (a greedy method's only ingredient; plan.json
    ``settings.oracle``); ``run``: a pool method's placement onto ``gpus`` GPUs; ``min_gpus``: the fewest GPUs
    a pool method itself can accept (where its smallest-pool search starts); ``self_validated``: a pool
    method whose acceptance already is the twin's opinion (the search does not ask the twin again)."""

    name: str
    kind: Literal["greedy", "pool"]
    summary: str  # after the name in ``lorapack place --help``
    oracle: str | None = None
    run: PoolRun | None = None
    min_gpus: Callable[[Instance, MethodContext], int] | None = None
    self_validated: bool = False
    baseline: bool = False  # someone else's (or a naive) method: evaluate's report compares `proposed` with it
    in_demo: bool = False  # placed by ``lorapack demo``
    paper_fixed_pool: bool = False  # the paper reports a fixed-pool GPU saving against it (evaluate's report)

    def __post_init__(self) -> None:
        if not self.name or any(ch.isspace() or ch == "," for ch in self.name):
            raise SpecError(f"method name {self.name!r}: expected a non-empty name without spaces or commas")
        if self.oracle is not None and self.oracle not in ORACLE_KINDS:
            raise SpecError(f"method {self.name}: oracle {self.oracle!r}: expected one of {', '.join(ORACLE_KINDS)}")
        if self.kind == "greedy" and (self.oracle is None or self.run is not None):
            raise SpecError(f"method {self.name}: a greedy method is its oracle (and has no run function)")
        if self.kind == "pool" and self.run is None:
            raise SpecError(f"method {self.name}: a pool method needs its run function")

    @property
    def greedy(self) -> bool:
        return self.kind == "greedy"


_METHODS: dict[str, Method] = {}


def register(method: Method) -> Method:
    """Add ``method`` (after the others: registration order is the order of ``--help`` and of reports)."""
    if method.name in _METHODS:
        raise SpecError(f"method {method.name} is registered already")
    _METHODS[method.name] = method
    return method


def unregister(name: str) -> None:
    """Remove a method (a test's or a plug-in's own)."""
    _METHODS.pop(name, None)


def methods(kind: Literal["greedy", "pool"] | None = None) -> tuple[Method, ...]:
    """The registered methods (of one ``kind``), in registration order."""
    return tuple(m for m in _METHODS.values() if kind is None or m.kind == kind)


def method_names(kind: Literal["greedy", "pool"] | None = None) -> tuple[str, ...]:
    return tuple(m.name for m in methods(kind))


def get_method(name: str) -> Method:
    """The method called ``name``, or a ``SpecError`` listing them."""
    if name not in _METHODS:
        raise SpecError(f"--method {name!r}: expected one of {', '.join(_METHODS)}")
    return _METHODS[name]


def methods_help() -> str:
    """``name (summary)`` for every method, as ``lorapack place --help`` lists them."""
    return ", ".join(f"{m.name} ({m.summary})" if m.summary else m.name for m in methods())


def report_baselines() -> tuple[str, ...]:
    """What evaluate's report compares ``proposed`` with: the baselines, then our own pool methods."""
    pool = methods("pool")
    return tuple(m.name for m in pool if m.baseline) + tuple(m.name for m in pool if not m.baseline)


def loraserve_operating_point(inst: Instance, ctx: MethodContext) -> dict[int, float]:
    """LoRAServe's operating point per slot rank: the twin's saturated throughput C(S) of the bound."""
    cap = ctx.cap(inst)
    return {s: cap(s) for s in sorted({default_slot_rank(int(r)) for r in inst.ranks})}


for _m in (
    Method("proposed", "greedy", "learned models", oracle="surrogate", in_demo=True),
    Method("proposed-fast", "greedy", "shallow trees", oracle="tree"),
    Method("proposed-exact", "greedy", "the twin as the oracle", oracle="twin"),
    Method("proposed-lat", "pool", "", oracle="surrogate",
           run=lambda inst, ctx, g: proposed_lat(inst, ctx.profile, g, ctx.oracle_of("surrogate"), ctx.objective)),
    Method("dlora", "pool", "", run=lambda inst, ctx, g: dlora(inst, ctx.profile, g), baseline=True, in_demo=True,
           paper_fixed_pool=True),
    Method("loraserve", "pool", "",
           run=lambda inst, ctx, g: loraserve(inst, g, loraserve_operating_point(inst, ctx)),
           min_gpus=lambda inst, ctx: loraserve_min_gpus(inst, loraserve_operating_point(inst, ctx)),
           baseline=True, in_demo=True, paper_fixed_pool=True),
    Method("least-adapters", "pool", "", run=lambda inst, ctx, g: least_adapters(inst, g), baseline=True,
           in_demo=True),
    # round-robin chooses its one --max-loras with the search's twin, yet names no oracle of its own (plan.json's
    # settings.oracle has always read "none" for it)
    Method("round-robin", "pool", "",
           run=lambda inst, ctx, g: round_robin(inst, ctx.profile, g, ctx.twin(), ctx.objective, ctx.options),
           self_validated=True, baseline=True, in_demo=True),
):
    register(_m)
