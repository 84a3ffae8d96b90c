"""The lower bound's exact programme (``placement.bound.min_gpus``) against the aggregated MILP it replaces,
solved by ``scipy.optimize.milp`` (HiGHS) in its original formulation: flows ``f_{r,S}``, ``m_{r,S}``."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import Bounds, LinearConstraint, milp

from lorapack.placement.bound import min_gpus

RANKS = [8, 16, 32, 64, 128]


def milp_gpus(classes: list[int], demand: dict[int, float], count: dict[int, int], k: dict[int, float],
              n_max: int | None) -> int:
    pairs = [(r, s) for r in classes for s in classes if s >= r]
    ny = len(classes)
    nv = ny + 2 * len(pairs)
    yi = {s: j for j, s in enumerate(classes)}
    fi = {p: ny + j for j, p in enumerate(pairs)}
    mi = {p: ny + len(pairs) + j for j, p in enumerate(pairs)}
    rows, lo, hi = [], [], []

    def row(coefs: dict[int, float], lb: float, ub: float) -> None:
        v = np.zeros(nv)
        for j, c in coefs.items():
            v[j] += c
        rows.append(v)
        lo.append(lb)
        hi.append(ub)

    scale = max(max(demand.values()), 1.0)
    for r in classes:
        row({fi[(r, s)]: 1.0 for s in classes if s >= r}, demand[r] / scale, demand[r] / scale)
        row({mi[(r, s)]: 1.0 for s in classes if s >= r}, count[r], count[r])
    for s in classes:
        row({**{fi[(r, s)]: 1.0 for r in classes if r <= s}, yi[s]: -k[s] / scale}, -np.inf, 0.0)
        if n_max is not None:
            row({**{mi[(r, s)]: 1.0 for r in classes if r <= s}, yi[s]: -float(n_max)}, -np.inf, 0.0)
    c = np.zeros(nv)
    c[:ny] = 1.0
    integrality = np.zeros(nv)
    integrality[:ny] = 1
    res = milp(c, constraints=LinearConstraint(np.array(rows), lo, hi), integrality=integrality,
               bounds=Bounds(0, np.inf))
    assert res.status == 0
    return int(round(float(np.sum(np.round(res.x[:ny])))))


@st.composite
def instances(draw: st.DrawFn) -> tuple:
    classes = sorted(draw(st.sets(st.sampled_from(RANKS), min_size=1, max_size=5)))
    # capacities of either trend (larger slots usually serve less, the latency row can reorder them)
    k = {s: draw(st.floats(50.0, 5000.0)) for s in classes}
    demand = {s: draw(st.one_of(st.just(0.0), st.floats(1.0, 60_000.0))) for s in classes}
    count = {s: draw(st.integers(1, 700)) for s in classes}
    n_max = draw(st.one_of(st.none(), st.integers(1, 128)))
    return classes, demand, count, k, n_max


@settings(max_examples=150)
@given(instances())
def test_min_gpus_equals_the_milp(inst: tuple) -> None:
    assert min_gpus(*inst) == milp_gpus(*inst)


def test_cheap_big_slots_serve_the_small_ranks() -> None:
    # rank 8 demand 900 tok/s; slots of 8 carry 100 each, slots of 64 carry 1000: one rank-64 GPU is enough
    classes, k = [8, 64], {8: 100.0, 64: 1000.0}
    demand, count = {8: 900.0, 64: 50.0}, {8: 10, 64: 1}
    assert min_gpus(classes, demand, count, k, None) == 1
    assert min_gpus(classes, demand, count, k, 8) == 2  # 11 adapters, 8 slots per GPU
    assert milp_gpus(classes, demand, count, k, 8) == 2


def test_exact_multiples_stay_feasible() -> None:
    assert min_gpus([16], {16: 3000.0}, {16: 3}, {16: 1000.0}, None) == 3
    assert min_gpus([16], {16: 3000.5}, {16: 3}, {16: 1000.0}, None) == 4


@pytest.mark.parametrize("n_max", [None, 4])
def test_no_demand_needs_no_gpu_but_adapters_need_slots(n_max: int | None) -> None:
    assert min_gpus([8], {8: 0.0}, {8: 9}, {8: 10.0}, n_max) == (0 if n_max is None else 3)
