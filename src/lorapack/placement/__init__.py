"""Placement: adapters onto the fewest GPUs, each with its ``--max-loras`` (placement.md §4-5, issue 9).

Python API (what ``lorapack place`` and ``lorapack evaluate`` call)::

    from lorapack.placement import place, make_instance, PlaceConfig, Objective, lower_bound

    inst = make_instance(ids, ranks, rates_rps, mean_input_tokens=223, mean_output_tokens=197, headroom=0.2)
    plan = place(inst, profile, PlaceConfig(method="proposed-exact"))  # smallest pool, verified and repaired
    plan = place(inst, profile, PlaceConfig(method="dlora", gpus=4, verify=False))  # the paper's fixed pool, raw
    plan.gpus_used, plan.lower_bound_gpus, plan.placement_ms, plan.routes()

* ``place(adapters, profile, config=PlaceConfig(), overrides=None, progress=None) -> Plan`` (``entry``: from
  scratch, ``api.place``, or with ``config.previous`` a re-plan, ``lorapack.replan.replan``). ``adapters``: an
  ``Instance`` (from ``make_instance``; carries its headroom) or a ``lorapack.spec.Workload``. ``PlaceConfig``
  holds every setting (one field per ``lorapack place`` flag, validated: a bad value is a ``SpecError`` naming
  the flag). ``gpus=None``: the greedy methods open GPUs as needed and the pool methods run the smallest-pool
  search (``smallest_pool``: bisection from the lower bound, each pool size accepted by the method itself and
  validated by the twin); ``gpus=G``: the fixed pool (a method that cannot fit returns
  ``Plan(infeasible=True, reason=...)``; so does verification when a repair would need more than ``G``:
  ``settings["gpus_needed"]``). ``OracleOverrides`` swap the oracles ``place`` would build (tests, benchmarks).
* The methods: ``registry`` (``methods()``, ``method_names()``, ``get_method(name)``, ``register(Method(...))``):
  ``proposed`` (learned models), ``proposed-fast`` (shallow trees), ``proposed-exact`` (the twin as the
  oracle), ``proposed-lat``, ``dlora``, ``loraserve``, ``least-adapters``, ``round-robin``.
* ``Objective(max_ttft_s=2.0, max_itl_ms=None, max_ttft_p99_s=None, max_itl_p99_ms=None)`` (``lorapack.objective``)
  -- the default is the latency objective (mean TTFT <= 2 s per GPU, not starved); ``Objective.throughput()``
  the paper's.
* ``lower_bound(inst, profile) -> LowerBound`` (``gpus``, ``gpus_no_nmax``, ``hot_adapters``, ...).
* ``assign(method, inst, Context(...), gpus)``: one raw run of a pool method on ``gpus`` GPUs;
  ``bisect_smallest(feasible, lo, hi)``: the search, for callers with their own feasibility test (replay).
* ``Plan`` / ``GpuPlan`` / ``plan_from_dict``: the plan.json contract; ``export.write_outputs`` writes
  ``plan.json``, ``serve.sh`` and ``routes.json``.

Modules: ``registry`` (the methods), ``config`` (``PlaceConfig``), ``problem`` (instance), ``greedy`` (the one
greedy driver), ``baselines`` (methods on a given pool), ``bound`` (K(S), MILP), ``verify`` (twin verification
and repair), ``oracles`` (the oracles a method asks; twin runs in worker processes), ``api`` (``place``),
``export`` (files), ``plan`` (types).
"""

from ..monotone import bisect_smallest, first_true
from ..objective import DEFAULT_MAX_TTFT_S, Objective
from .api import Context, OracleOverrides, assign, smallest_pool, verify_plan
from .bound import LowerBound, lower_bound
from .config import DEFAULT_VERIFY_SEEDS, PlaceConfig
from .entry import place
from .greedy import N_MAX, TESTING_POINTS, Infeasible, zigzag_order
from .plan import BINDING, GpuMetrics, GpuPlan, Plan, plan_from_dict
from .problem import DEFAULT_HEADROOM, Instance, instance_from_workload, make_instance
from .registry import Method, get_method, method_names, methods, register

__all__ = [
    "BINDING", "DEFAULT_HEADROOM", "DEFAULT_MAX_TTFT_S", "DEFAULT_VERIFY_SEEDS", "N_MAX", "TESTING_POINTS",
    "Context", "GpuMetrics", "GpuPlan", "Infeasible", "Instance", "LowerBound", "Method", "Objective", "OracleOverrides",
    "PlaceConfig", "Plan", "assign", "bisect_smallest", "first_true", "get_method", "instance_from_workload",
    "lower_bound", "make_instance", "method_names", "methods", "place", "plan_from_dict", "register",
    "smallest_pool", "verify_plan", "zigzag_order",
]
