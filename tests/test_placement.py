"""Placement (issue 9): the greedy driver, the baselines, the lower bound and plan invariants (placement.md §7).

Toy oracles (``placement_helpers.ToyOracle``: starved iff Σλ > c) make every expected plan computable by hand;
the twin appears only in the few end-to-end tests at the bottom."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lorapack.errors import SpecError
from lorapack.oracle import default_slot_rank
from lorapack.placement import Objective, PlaceConfig, lower_bound, method_names, zigzag_order
from lorapack.placement.baselines import dlora, hamilton, least_adapters, loraserve
from lorapack.placement.greedy import GreedyOptions, Infeasible, greedy_fill
from lorapack.server import ServerConfig
from placement_helpers import LLAMA, TAU, ToyOracle, instance, run_place, toy_capacity, toy_kwargs

THR = Objective.throughput()


def fill(inst, oracle, **kw):
    return greedy_fill(inst, LLAMA, oracle, kw.pop("objective", THR), **kw)


# ---------------------------------------------------------------------------------------------------------
# ordering


def test_zigzag_alternates_largest_and_smallest_within_descending_rank_groups() -> None:
    assert zigzag_order(np.full(5, 8), np.array([1.0, 2, 3, 4, 5]), list("abcde")).tolist() == [4, 0, 3, 1, 2]
    # ties broken by id, not by position
    order = zigzag_order(np.full(4, 8), np.ones(4), ["d", "b", "c", "a"])
    assert order.tolist() == [0, 3, 2, 1]  # ascending by id: a(3) b(1) c(2) d(0); zig-zag: d a c b
    # rank groups in descending rank, each zig-zagged on its own
    ranks = np.array([8, 32, 8, 16, 32])
    order = zigzag_order(ranks, np.array([1.0, 1.0, 2.0, 1.0, 3.0]), list("abcde"))
    assert order.tolist() == [4, 1, 3, 2, 0]


# ---------------------------------------------------------------------------------------------------------
# the greedy driver with a toy oracle: hand-computed plans


def test_failure_at_a_testing_point_closes_the_gpu_and_the_last_one_is_padded() -> None:
    # 20 adapters at 1 req/s, a GPU serves 12 req/s: 8 pass, 16 fail -> 8, 8, then 4 padded to 8 (Σ 8) pass
    inst = instance(np.ones(20))
    gpus = fill(inst, ToyOracle(12.0))
    order = zigzag_order(inst.ranks, inst.rates_rps, inst.adapter_ids).tolist()
    assert [g.entries for g in gpus] == [order[0:8], order[8:16], order[16:20]]
    assert [g.max_loras for g in gpus] == [8, 8, 4]  # A clipped to the adapter count
    assert [g.binding for g in gpus] == ["slots", "slots", "none"]


def test_give_back_keeps_the_original_order_and_the_padded_test_counts_to_the_testing_point() -> None:
    # rates 1..12, c = 60: the first 8 (52 req/s) pass; 12 padded to 16 with the mean 6.5 -> 104 fail; the 4
    # given back (rates 8, 5, 7, 6, in that order) padded to 8: 26 + 4 x 6.5 = 52 pass on the next GPU
    inst = instance(np.arange(1.0, 13.0))
    toy = ToyOracle(60.0, cheap=False)
    gpus = fill(inst, toy)
    assert [g.entries for g in gpus] == [[11, 0, 10, 1, 9, 2, 8, 3], [7, 4, 6, 5]]
    assert (16, 8, pytest.approx(104.0)) in toy.asked  # exactly T entries (the paper's code over-pads)
    assert (8, 8, pytest.approx(52.0)) in toy.asked[-2:]


def test_max_loras_moves_one_grid_step_per_testing_point_and_follows_the_throughput() -> None:
    # the toy prefers A = 16 by 5 % (beyond the 2 % tie tolerance): 8 -> 16, then stays at 16
    inst = instance(np.full(40, 0.1))
    toy = ToyOracle(100.0, prefer_a=16, cheap=False)
    gpus = fill(inst, toy)
    assert len(gpus) == 1 and gpus[0].max_loras == 16
    assert [(n, a) for n, a, _ in toy.asked] == [(8, 8), (16, 8), (16, 16), (32, 16), (32, 32), (64, 16), (64, 32)]


def test_ties_take_the_larger_max_loras() -> None:
    gpus = fill(instance(np.full(40, 0.1)), ToyOracle(100.0))
    assert gpus[0].max_loras == 40  # 8 -> 16 -> 32 -> 64 (padded test), clipped to the 40 adapters


def test_lookahead_and_lazy_questions_give_the_same_plan() -> None:
    rng = np.random.default_rng(3)
    for _ in range(5):
        inst = instance(np.minimum(rng.lognormal(-1, 1, 200), 8.0), rng.choice([8, 16, 32], 200))
        a = fill(inst, ToyOracle(9.0, prefer_a=32, cheap=True))
        b = fill(inst, ToyOracle(9.0, prefer_a=32, cheap=False))
        assert [(g.entries, g.max_loras) for g in a] == [(g.entries, g.max_loras) for g in b]


def test_pool_exhaustion_and_the_guard() -> None:
    inst = instance(np.ones(20))
    with pytest.raises(Infeasible, match="pool of 2 GPUs is exhausted") as e:
        fill(inst, ToyOracle(12.0), pool=2)
    assert e.value.gpus_needed == 3
    # an adapter hotter than a GPU fails the first test with nothing committed: raise, never loop
    hot = instance([20.0] + [0.1] * 10)
    with pytest.raises(Infeasible, match="split-hot") as e:
        fill(hot, ToyOracle(12.0))
    assert e.value.hot == ("a000",)


def test_memory_rule_caps_max_loras_for_rank_32() -> None:
    # rank 32 on the llama profile: A <= 119 starts, so the grid stops at 96 however many adapters
    inst = instance(np.full(300, 0.01), np.full(300, 32))
    toy = ToyOracle(100.0, cheap=False)
    gpus = fill(inst, toy)
    assert max(a for _, a, _ in toy.asked) == 96
    assert all(g.max_loras <= 96 for g in gpus) and LLAMA.startup(96, 32)[0] and not LLAMA.startup(128, 32)[0]


def test_testing_points_stop_at_n_max() -> None:
    gpus = fill(instance(np.full(500, 0.001)), ToyOracle(100.0), options=GreedyOptions(n_max=128))
    assert [len(g.entries) for g in gpus] == [128, 128, 128, 116]
    assert gpus[0].binding == "adapters"


def test_the_greedy_never_loses_to_a_balanced_plan_its_oracle_accepts() -> None:
    # first-fit leaves 8, 8, 4; dealt evenly, 10 + 10 fit two GPUs: the plan takes the balanced one
    plan = run_place(instance(np.ones(20)), LLAMA, "proposed", objective=THR, **toy_kwargs(12.0))
    assert plan.gpus_used == 2 and plan.diagnostics["plan_origin"] in ("round-robin", "balanced")
    assert plan.diagnostics["greedy_gpus"] == 3
    # the same on a fixed pool of 2, where first-fit alone runs out of GPUs
    plan = run_place(instance(np.ones(20)), LLAMA, "proposed", gpus=2, objective=THR, **toy_kwargs(12.0))
    assert not plan.infeasible and plan.gpus_used == 2


# ---------------------------------------------------------------------------------------------------------
# baselines


def test_hamilton_apportionment() -> None:
    assert hamilton({32: 0.5, 16: 1.2, 8: 2.3}, 4) == {32: 1, 16: 1, 8: 2}
    assert hamilton({32: 1.5, 16: 1.5}, 3) == {32: 2, 16: 1}  # tie: larger rank first
    assert hamilton({32: 0.0, 8: 3.0}, 3) == {32: 0, 8: 3}
    rng = np.random.default_rng(0)
    for _ in range(50):
        w = rng.dirichlet(np.ones(3))
        g = int(rng.integers(1, 20))
        out = hamilton(dict(zip((8, 16, 32), w * g, strict=True)), g)
        assert sum(out.values()) == g and all(abs(out[k] - v) < 1 for k, v in zip((8, 16, 32), w * g, strict=True))


def test_loraserve_loads_stay_within_capacity_except_leftovers() -> None:
    rng = np.random.default_rng(1)
    inst = instance(rng.lognormal(-1, 1.2, 120), rng.choice([8, 16, 32], 120))
    op = {8: 15000.0, 16: 14700.0, 32: 14500.0}
    a = loraserve(inst, 4, op)
    target = a.extra["target_util"]
    for f in a.gpus:
        shares = f.extra.get("shares") or [1.0] * len(f.entries)
        load = float(np.sum(inst.demand_tok_s[f.entries] * np.asarray(shares)))
        rank = default_slot_rank(int(inst.ranks[f.entries].max()))
        if a.extra["leftovers"] == 0:
            assert load <= target * op[rank] * (1 + 1e-9)
    total: dict[int, float] = {}
    for f in a.gpus:
        for e, s in zip(f.entries, f.extra.get("shares") or [1.0] * len(f.entries), strict=True):
            total[e] = total.get(e, 0.0) + s
    assert sorted(total) == list(range(inst.n)) and all(v == pytest.approx(1.0) for v in total.values())


def test_dlora_terminates_with_enough_replicas_on_every_adapter() -> None:
    rng = np.random.default_rng(2)
    for m, g in ((30, 4), (7, 3), (200, 8), (1, 2)):
        inst = instance(rng.lognormal(-2, 1, m))
        a = dlora(inst, LLAMA, g)
        seen = [e for f in a.gpus for e in f.entries]
        assert set(seen) == set(range(m))
        assert a.extra["replicas"] == len(seen) >= min(g + m - 1, g * m)
        for f in a.gpus:
            assert len(set(f.entries)) == len(f.entries)  # at most one replica per GPU


def test_least_adapters_balances_the_adapter_count() -> None:
    a = least_adapters(instance(np.ones(10)), 3)
    assert [f.entries for f in a.gpus] == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]
    assert [f.max_loras for f in a.gpus] == [4, 3, 3]


# ---------------------------------------------------------------------------------------------------------
# lower bound


def _brute_force_gpus(demand: list[float], slot: list[int], k: dict[int, float], n_max: int) -> float:
    """Fewest groups such that each group's demand <= K(its largest slot rank) and size <= n_max."""
    n = len(demand)
    best = math.inf  # no plan at all when one adapter alone exceeds every capacity
    for labels in itertools.product(range(n), repeat=n):
        if any(labels[i] > max(labels[:i], default=-1) + 1 for i in range(n)):
            continue  # canonical labelling only
        groups = [[i for i in range(n) if labels[i] == g] for g in range(max(labels) + 1)]
        if all(len(gr) <= n_max and sum(demand[i] for i in gr) <= k[max(slot[i] for i in gr)] + 1e-9
               for gr in groups):
            best = min(best, len(groups))
    return best


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.floats(0.5, 9.0), st.sampled_from([8, 16])), min_size=1, max_size=6),
       st.integers(1, 4))
def test_lower_bound_never_exceeds_the_brute_force_optimum(adapters, n_max) -> None:
    rates = [r for r, _ in adapters]
    ranks = [k for _, k in adapters]
    inst = instance(rates, ranks)
    cap = {8: 10.0, 16: 8.0}  # req/s a GPU of that slot rank serves
    b = lower_bound(inst, capacity=lambda s: 0.9 * cap[s] * TAU, n_max=n_max)
    opt = _brute_force_gpus([r * TAU for r in rates], ranks, {s: c * TAU for s, c in cap.items()}, n_max)
    assert b.gpus <= opt and b.gpus_no_nmax <= b.gpus
    assert bool(b.hot_adapters) == (opt == math.inf)
    assert b.count_bound <= b.gpus and b.throughput_bound <= b.gpus_no_nmax


def test_lower_bound_reports_hot_adapters() -> None:
    b = lower_bound(instance([30.0, 1.0]), capacity=toy_capacity(12.0))
    assert b.hot_adapters == ["a000"]
    plan = run_place(instance([30.0, 1.0]), LLAMA, "proposed", **toy_kwargs(12.0))
    assert plan.infeasible and "split-hot" in plan.reason and "a000" in plan.reason
    split = run_place(instance([30.0, 1.0]), LLAMA, "proposed", split_hot=True, **toy_kwargs(12.0))
    assert not split.infeasible
    routes = split.routes()
    assert len(routes["a000"]) >= 3 and sum(w for _, w in routes["a000"]) == pytest.approx(1.0)


def test_the_latency_row_caps_each_gpus_capacity() -> None:
    inst = instance([2.0] * 10)  # 20 req/s
    free = lower_bound(inst, capacity=toy_capacity(12.0))
    tight = lower_bound(inst, capacity=toy_capacity(12.0), latency_capacity=lambda s: 5.0 * TAU)
    assert free.gpus == 2 and not free.latency_capacity_tok_s
    assert tight.gpus == 4 and tight.capacity_tok_s[8] == pytest.approx(5.0 * TAU)  # K = min(C / 0.9, L)
    loose = lower_bound(inst, capacity=toy_capacity(12.0), latency_capacity=lambda s: 1e9)
    assert loose.gpus == free.gpus and loose.capacity_tok_s == free.capacity_tok_s
    # place() uses a given latency row; with a toy capacity and none given it has none (no twin runs)
    plan = run_place(inst, LLAMA, "proposed-exact", latency_capacity=lambda s: 5.0 * TAU, **toy_kwargs(12.0))
    assert plan.lower_bound_gpus == 4 and plan.lower_bound["latency_capacity_tok_s"] == {"8": round(5.0 * TAU, 1)}
    assert run_place(inst, LLAMA, "proposed-exact", **toy_kwargs(12.0)).lower_bound["latency_capacity_tok_s"] == {}


def test_the_latency_capacity_is_where_one_adapter_stops_meeting_the_objective() -> None:
    from lorapack.oracle import GpuCandidate, TwinOracle
    from lorapack.placement.bound import VerifierRuns, simulate_latency_capacity_tok_s, twin_capacity

    obj = Objective(max_ttft_s=1.0)
    top = twin_capacity(LLAMA, 223, 197)(8) / 0.9
    lat = simulate_latency_capacity_tok_s(LLAMA, 8, 223, 197, obj, top, VerifierRuns(seeds=(5,), duration_s=900.0))
    assert 0.5 * top < lat < top  # a 1 s mean TTFT binds before saturation

    def check(tok_s: float) -> str | None:
        c = GpuCandidate(profile=LLAMA, ranks=np.array([8]), rates_rps=np.array([tok_s / 420]),
                         server=ServerConfig(max_loras=1, max_lora_rank=8), mean_input_tokens=223, mean_output_tokens=197)
        return obj.check(TwinOracle(seeds=(5,), duration_s=900.0, early_stop=False).predict([c])[0])

    assert check(0.9 * lat) is None and check(lat) is not None  # L is the smallest load seen failing


# ---------------------------------------------------------------------------------------------------------
# invariants of every method on random instances


@st.composite
def instances(draw):
    n = draw(st.integers(1, 80))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    rates = np.minimum(rng.lognormal(-1.5, 1.2, n), 8.0)
    ranks = rng.choice([8, 16, 32], n)
    return instance(rates, ranks)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instances(), st.sampled_from(method_names()), st.sampled_from([None, 3]))
def test_invariants_of_every_method(inst, method, pool) -> None:
    plan = run_place(inst, LLAMA, method, gpus=pool, objective=THR, **toy_kwargs(10.0))
    if plan.infeasible:
        assert pool is not None and plan.reason
        return
    routes = plan.routes()
    assert sorted(routes) == sorted(set(inst.adapter_ids))  # every adapter placed
    for lst in routes.values():
        assert sum(w for _, w in lst) == pytest.approx(1.0)
        assert len({g for g, _ in lst}) == len(lst)
    rank = dict(zip(inst.adapter_ids, inst.ranks.tolist(), strict=True))
    for g in plan.gpus:
        assert g.adapters and 1 <= g.max_loras <= len(g.adapters) and g.max_cpu_loras >= g.max_loras
        assert g.max_lora_rank >= max(rank[a] for a in g.adapters)
        assert g.verified is not None and g.verified.passed  # verification (toy) passed
        if method.startswith("proposed"):
            assert LLAMA.startup(g.max_loras, g.max_lora_rank)[0]
            assert len(g.adapters) <= 384
    # the bound never exceeds a verified plan's GPU count
    assert plan.lower_bound_gpus is not None and plan.lower_bound_gpus <= plan.gpus_used
    if pool is not None:
        assert plan.gpus_used <= pool


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instances(), st.booleans())
def test_proposed_never_uses_more_gpus_than_round_robin(inst, cheap) -> None:
    # cheap: the batched path of learned oracles; not cheap: the twin's lazy path
    rr = run_place(inst, LLAMA, "round-robin", objective=THR, verify=False, **toy_kwargs(10.0, cheap=cheap))
    pr = run_place(inst, LLAMA, "proposed", objective=THR, verify=False, **toy_kwargs(10.0, cheap=cheap))
    assert not pr.infeasible
    assert rr.infeasible or pr.gpus_used <= rr.gpus_used


def test_plans_are_deterministic() -> None:
    rng = np.random.default_rng(5)
    inst = instance(rng.lognormal(-1, 1, 150), rng.choice([8, 16], 150))
    for method in method_names():
        a = run_place(inst, LLAMA, method, objective=THR, **toy_kwargs(9.0)).to_dict()
        b = run_place(inst, LLAMA, method, objective=THR, **toy_kwargs(9.0)).to_dict()
        for d in (a, b):
            d.pop("placement_ms"), d.pop("verification_ms")
            d["lower_bound"].pop("solve_ms")
        assert a == b, method


def test_the_verifier_simulates_the_workloads_own_arrival_law() -> None:
    from lorapack.placement.api import Context
    from lorapack.spec import Adapter, ModulatedArrivals, TraceArrivals, Workload

    law = ModulatedArrivals(period_s=60.0, multipliers=[0.5, 1.5, 1.0])
    adapters = [Adapter(adapter_id=f"a{i}", rank=8, rate_rps=0.2) for i in range(6)]
    for arrivals, expected in ((law, {"kind": "modulated", "period_s": 60.0, "periods": 3,
                                      "mean_multiplier": 1.0, "max_multiplier": 1.5}),
                               (None, {"kind": "poisson"})):
        wl = Workload(adapters=adapters, **({"arrivals": arrivals} if arrivals else {}))
        plan = run_place(wl, LLAMA, "proposed-exact", objective=THR, **toy_kwargs(9.0))
        assert plan.settings["verify_arrivals"] == expected
    assert run_place(Workload(adapters=adapters, arrivals=law), LLAMA, "proposed-exact", objective=THR, verify=False,
                 **toy_kwargs(9.0)).settings["verify_arrivals"] is None
    # the twin verifier gets the law (the searches stay Poisson: their early stop assumes steady arrivals)
    ctx = Context(profile=LLAMA, objective=THR, verify_arrivals=law)
    assert ctx.verifier(3).arrivals is law and ctx.twin().arrivals is None
    with pytest.raises(SpecError, match="arrivals of kind 'trace'"):
        run_place(instance([0.1]), LLAMA, "proposed-exact", verify_arrivals=TraceArrivals(path="t.csv"),
                  **toy_kwargs(9.0))


def test_bad_input_is_refused_before_any_work() -> None:
    from lorapack.placement import make_instance

    kw = dict(mean_input_tokens=223, mean_output_tokens=197)
    for ids, ranks, rates, msg in (
        ([], [], [], "no adapters"),
        (["a", "a"], [8, 8], [1.0, 1.0], "duplicate adapter_id 'a'"),
        (["a"], [0], [1.0], "rank 0"),
        (["a"], [600], [1.0], "rank 600"),
        (["a"], [8.5], [1.0], "rank 8.5"),
        (["a"], [8], [-1.0], r"rate_rps -1.0: expected a finite number >= 0"),  # the spec's words (issue 26)
        (["a"], [8], [math.nan], "rate_rps nan"),
    ):
        with pytest.raises(SpecError, match=msg):
            make_instance(ids, ranks, rates, **kw)
    with pytest.raises(SpecError, match="--headroom"):
        make_instance(["a"], [8], [1.0], headroom=-0.1, **kw)
    with pytest.raises(SpecError, match="--method"):
        run_place(instance([1.0]), LLAMA, "best-fit")
    with pytest.raises(SpecError, match="--gpus"):
        run_place(instance([1.0]), LLAMA, "proposed", gpus=0)
    with pytest.raises(SpecError, match="max-ttft-s"):
        Objective(max_ttft_s=-1)


# ---------------------------------------------------------------------------------------------------------
# verification and repair


def _repair_case(strict_cap: float, pool: int | None = None):
    # the method's oracle believes a GPU serves 12 req/s, the verifier (and the repair's probes) less: the
    # greedy places 20 adapters at 1.25 req/s as 8 + 8 + 4 (10, 10 and 5 req/s)
    strict = ToyOracle(strict_cap)
    return run_place(instance(np.full(20, 1.25)), LLAMA, "proposed", gpus=pool, objective=THR, oracle=ToyOracle(12.0),
                 search_oracle=strict, verify_oracle=strict, capacity=toy_capacity(strict_cap), workers=1)


def test_repair_moves_the_last_added_adapters_to_another_gpu() -> None:
    # verifier at 9 req/s: GPUs 0 and 1 keep their first 7 adapters, the two moved ones fit on GPU 2
    plan = _repair_case(9.0)
    order = zigzag_order(np.full(20, 8), np.full(20, 1.25), [f"a{i:03d}" for i in range(20)])
    ids = [f"a{i:03d}" for i in order]
    assert [g.adapters for g in plan.gpus] == [ids[0:7], ids[8:15], ids[16:20] + [ids[7], ids[15]]]
    v = plan.verification
    assert v["passed"] and v["gpus_added"] == 0 and v["moved_adapters"] == 2 and v["gpus_cut"] == 2
    assert all(g.verified.passed for g in plan.gpus) and plan.gpus[0].binding == "throughput"


def test_repair_never_moves_adapters_onto_a_gpu_that_failed() -> None:
    """No ping-pong: adapters cut off one failing GPU do not land on another GPU that failed earlier (two GPUs at
    the edge passed each other's spill-over back and forth until the round limit: qwen-thr-r8-16-n512-x5)."""
    from lorapack.placement.greedy import GpuFill
    from lorapack.placement.verify import _rehome, verify_fills

    inst = instance([1.0] * 12)
    toy = ToyOracle(9.0)
    fills = [GpuFill(entries=list(range(0, 4)), max_loras=4), GpuFill(entries=list(range(4, 8)), max_loras=4)]
    verdicts = verify_fills(inst, LLAMA, fills, THR, toy)
    assert all(v.passed for v in verdicts)
    moved = [(8, 1.0), (9, 1.0)]
    out, new = _rehome(inst, LLAMA, list(fills), verdicts, set(), moved, THR, toy, None, GreedyOptions())
    assert new == 0 and out[0].entries == [0, 1, 2, 3, 8, 9]  # the least-loaded passing GPU takes them
    changed: set[int] = set()
    out, new = _rehome(inst, LLAMA, list(fills), verdicts, changed, moved, THR, toy, None, GreedyOptions(),
                       exclude={0})
    assert new == 0 and out[1].entries == [4, 5, 6, 7, 8, 9] and changed == {1}  # GPU 0 failed once: not a host
    out, new = _rehome(inst, LLAMA, list(fills), verdicts, set(), moved, THR, toy, None, GreedyOptions(),
                       exclude={0, 1})
    assert new == 1 and sorted(out[2].entries) == [8, 9]  # a new GPU (the greedy orders them itself)


def test_repair_bisects_with_the_verifier_where_the_probe_cannot_tell() -> None:
    # the probe (search oracle) is as lenient as the method's model (12 req/s), the verifier strict (6): the
    # probe passes every GPU the verifier fails, so the verifier decides the prefixes -- 4 adapters stay per
    # GPU in the first round, instead of one adapter moved per round until the rounds run out
    strict = ToyOracle(6.0)
    plan = run_place(instance(np.full(20, 1.25)), LLAMA, "proposed", objective=THR, oracle=ToyOracle(12.0),
                 search_oracle=ToyOracle(12.0), verify_oracle=strict, capacity=toy_capacity(6.0), workers=1)
    v = plan.verification
    assert v["passed"] and v["repair_rounds"] <= 2, v["events"]
    assert all(len(g.adapters) <= 4 for g in plan.gpus) and plan.gpus_used == 5


class _SlotToy(ToyOracle):
    """Starved whenever fewer slots than adapters (adapters swapping starve), else as ``ToyOracle``."""

    def predict(self, cands):
        out = super().predict(cands)
        return [replace(p, starved=1.0, throughput_tok_s=0.5 * p.incoming_tok_s)
                if c.max_loras < c.n_adapters and p.fits else p for c, p in zip(cands, out, strict=True)]


def test_repair_raises_max_loras_where_adapters_starve_while_swapping() -> None:
    # the model prefers --max-loras 8 (16 adapters at 0.5 req/s on GPU 0); the verifier starves any GPU with
    # fewer slots than adapters: the repair gives GPU 0 all 16 slots instead of moving adapters away
    plan = run_place(instance(np.full(20, 0.5)), LLAMA, "proposed", objective=THR, oracle=ToyOracle(12.0, prefer_a=8),
                 search_oracle=ToyOracle(12.0), verify_oracle=_SlotToy(12.0), capacity=toy_capacity(12.0),
                 workers=1)
    v = plan.verification
    assert v["passed"] and v["max_loras_raised"] >= 1 and v["moved_adapters"] == 0, v["events"]
    assert all(g.max_loras == len(g.adapters) for g in plan.gpus)


def test_repair_opens_new_gpus_or_says_how_many_the_pool_lacks() -> None:
    # verifier at 6 req/s: 4 adapters per GPU; the 8 moved ones need two new GPUs (the bound is 5 too)
    plan = _repair_case(6.0)
    assert plan.verification["passed"] and plan.verification["gpus_added"] == 2
    assert plan.gpus_used == 5 == plan.lower_bound_gpus
    assert sorted(plan.routes()) == [f"a{i:03d}" for i in range(20)]
    plan = _repair_case(6.0, pool=3)
    assert plan.infeasible and "needs at least 5 GPUs, 3 given" in plan.reason
    assert plan.settings["gpus_needed"] == 5


def test_repair_lowers_max_loras_that_vllm_refuses() -> None:
    # dlora keeps every adapter resident: 300 rank-16 adapters on one GPU exceed the slots vLLM can start
    inst = instance(np.full(300, 0.01), np.full(300, 16))
    plan = run_place(inst, LLAMA, "dlora", gpus=1, objective=THR, **toy_kwargs(50.0))
    g = plan.gpus[0]
    assert not plan.infeasible and LLAMA.startup(g.max_loras, g.max_lora_rank)[0] and g.max_loras < 300
    assert plan.verification["max_loras_lowered"] == 1 and len(g.adapters) == 300
    raw = run_place(inst, LLAMA, "dlora", gpus=1, objective=THR, verify=False, **toy_kwargs(50.0))
    assert raw.gpus[0].max_loras == 300 and not raw.verification


# ---------------------------------------------------------------------------------------------------------
# with the twin (slow)


@pytest.mark.slow
def test_capacity_is_an_upper_bound_on_a_saturated_multi_adapter_gpu() -> None:
    # §5's monotonicity assumption on the twin's estimators: more adapters and slots only cost throughput
    from lorapack.oracle import GpuCandidate, TwinOracle
    from lorapack.placement.bound import simulate_capacity_tok_s

    c8 = simulate_capacity_tok_s(LLAMA, 8, 223, 197)
    c16 = simulate_capacity_tok_s(LLAMA, 16, 223, 197)
    assert c16 <= c8
    twin = TwinOracle(seeds=(0,), duration_s=1800, early_stop=False)
    for n, a in ((8, 8), (64, 32), (128, 128)):
        cand = GpuCandidate(profile=LLAMA, ranks=np.full(n, 8), rates_rps=np.full(n, 80.0 / n),
                             server=ServerConfig(max_loras=a))
        assert twin.predict([cand])[0].throughput_tok_s <= c8


@pytest.mark.slow
def test_twin_plans_respect_the_bound_and_pass_verification() -> None:
    rng = np.random.default_rng(11)
    inst = instance(rng.dirichlet(np.full(96, 0.5)) * 40.0 + 1e-3, rng.choice([8, 16], 96))
    for method in ("proposed-exact", "least-adapters"):
        plan = run_place(inst, LLAMA, method, workers=1)
        assert not plan.infeasible, plan.reason
        assert plan.verification["passed"] and all(g.verified.passed for g in plan.gpus)
        assert plan.lower_bound_gpus <= plan.gpus_used
        assert all(g.verified.ttft_s <= 2.0 for g in plan.gpus)
        assert sorted(plan.routes()) == sorted(inst.adapter_ids)


@pytest.mark.slow
def test_proposed_exact_does_not_lose_to_round_robin_where_first_fit_needs_a_gpu_more() -> None:
    # 300 equal adapters: first-fit closes GPUs at testing points (3 GPUs); dealt evenly, 2 GPUs serve them
    inst = instance(np.full(300, 0.1), headroom=0.2)
    exact = run_place(inst, LLAMA, "proposed-exact", verify=False, workers=1)
    rr = run_place(inst, LLAMA, "round-robin", verify=False, workers=1)
    assert exact.diagnostics["greedy_gpus"] == 3 and exact.diagnostics["plan_origin"] != "greedy"
    assert exact.gpus_used <= rr.gpus_used == 2


def test_throughput_ties_go_to_the_lower_latency_then_the_larger_max_loras() -> None:
    from lorapack.oracle import Prediction
    from lorapack.placement.greedy import choose

    def pred(thr: float, ttft: float) -> Prediction:
        return Prediction(fits=True, throughput_tok_s=thr, incoming_tok_s=1000.0, starved=0.0, itl_ms=math.nan,
                          ttft_s=ttft)

    opts = GreedyOptions()
    lat = Objective(max_ttft_s=2.0)
    # throughputs within 2 % of the offered 1,000 tok/s: the lower TTFT wins (0.2 s vs 0.5 s), unless within
    # 10 % (-> larger A)
    assert choose([32, 64], [pred(1000, 0.2), pred(985, 0.5)], lat, 64, opts)[0] == 32
    assert choose([32, 64], [pred(1000, 0.2), pred(985, 0.21)], lat, 64, opts)[0] == 64
    # the paper's criterion (no latency limit): the larger A; a clearly higher throughput wins anyway
    assert choose([32, 64], [pred(1000, 0.2), pred(985, 0.5)], THR, 64, opts)[0] == 64
    assert choose([32, 64], [pred(1000, 0.2), pred(950, 0.1)], lat, 64, opts)[0] == 32
    # infeasible candidates never win: over the TTFT limit
    assert choose([32, 64], [pred(1000, 2.5), pred(900, 0.5)], lat, 64, opts)[0] == 64
    assert choose([32, 64], [pred(1000, 2.5), pred(900, 3.0)], lat, 64, opts) == (None, None, "latency")


def test_an_oracle_that_refuses_a_light_adapter_alone_is_named_not_the_adapter() -> None:
    # a toy with a TTFT prediction above the limit everywhere (as a coarse learned model may have)
    plan = run_place(instance(np.full(10, 0.1)), LLAMA, "proposed", objective=Objective(max_ttft_s=2.0),
                 **toy_kwargs(10.0, ttft_s=2.5))
    assert plan.infeasible and "oracle refuses adapter" in plan.reason and "proposed-exact" in plan.reason
    assert "split-hot" not in plan.reason


class _LearnedToy(ToyOracle):
    learned = True  # placement treats it as a learned model: the twin (search_oracle) confirms its refusals


def test_the_twin_fills_a_gpu_where_a_learned_oracle_gives_up() -> None:
    # the "learned" toy predicts TTFT 2.5 s everywhere; the "twin" (search oracle) 0.1 s: every GPU of the greedy
    # is filled by the twin (8 + 8 + 8 + 6: 16 adapters at 1 req/s exceed its 10 req/s) as the twin's own greedy
    # fills them; the learned model's balanced plans accept none, the twin's consolidation after verification
    # then finds the 3-GPU plan the toy-only placement finds
    learned, twin = _LearnedToy(10.0, ttft_s=2.5), ToyOracle(10.0)
    inst = instance(np.full(30, 1.0))
    plan = run_place(inst, LLAMA, "proposed", objective=Objective(max_ttft_s=2.0), oracle=learned, search_oracle=twin,
                 verify_oracle=twin, capacity=toy_capacity(10.0), workers=1)
    ref = run_place(inst, LLAMA, "proposed", objective=Objective(max_ttft_s=2.0), **toy_kwargs(10.0))
    assert not plan.infeasible and plan.diagnostics["greedy_gpus"] == ref.diagnostics["greedy_gpus"] == 4
    assert plan.diagnostics["plan_origin"] == "greedy" and ref.gpus_used == 3  # the toy's rebalance: 10 per GPU
    assert plan.gpus_used == 3 and plan.verification["consolidated"]["gpus_before"] == 4
    assert plan.diagnostics["confirmed_gpus"] == 4 and plan.diagnostics["confirm_calls"] > 0
    assert all(g.verified.passed for g in plan.gpus)
    # an oracle that is not learned is taken at its word (the guard's message above)
    plain = run_place(inst, LLAMA, "proposed", objective=Objective(max_ttft_s=2.0), oracle=ToyOracle(10.0, ttft_s=2.5),
                  search_oracle=twin, verify_oracle=twin, capacity=toy_capacity(10.0), workers=1)
    assert plain.infeasible


def test_verification_consolidates_a_pessimistic_learned_plan_with_the_twin() -> None:
    # the learned toy believes 8 req/s per GPU (8 + 8 + 8 + 6 adapters at 1 req/s), the twin 10: verification
    # passes the 4 GPUs, then a balanced plan on 3 GPUs (10 req/s each) passes the twin and replaces it
    learned, twin = _LearnedToy(8.0), ToyOracle(10.0)
    inst = instance(np.full(30, 1.0))
    plan = run_place(inst, LLAMA, "proposed", objective=THR, oracle=learned, search_oracle=twin, verify_oracle=twin,
                 capacity=toy_capacity(10.0), workers=1)
    c = plan.verification["consolidated"]
    assert (c["gpus_before"], c["gpus_after"], c["accepted"]) == (4, 3, True)
    assert plan.gpus_used == 3 and plan.verification["passed"] and all(g.verified.passed for g in plan.gpus)
    assert sorted(a for g in plan.gpus for a in g.adapters) == sorted(inst.adapter_ids)
    # a twin that agrees with the model keeps the plan (one probe on 3 GPUs fails)
    same = run_place(inst, LLAMA, "proposed", objective=THR, oracle=_LearnedToy(8.0), search_oracle=ToyOracle(8.0),
                 verify_oracle=ToyOracle(8.0), capacity=toy_capacity(10.0), workers=1)
    assert same.gpus_used == 4 and not same.verification["consolidated"]["accepted"]


def test_consolidation_goes_beyond_n_max_only_when_n_max_is_soft() -> None:
    # 500 light adapters: the greedy's testing points stop at 384 (2 GPUs); the verified consolidation deals all
    # 500 onto one GPU, as round-robin would, and the plan is held to the bound without the N_max row
    inst = instance(np.full(500, 0.01))
    soft = run_place(inst, LLAMA, "proposed", objective=THR, **toy_kwargs(100.0))
    assert soft.diagnostics["greedy_gpus"] == 2 and soft.gpus_used == 1 and len(soft.gpus[0].adapters) == 500
    c = soft.verification["consolidated"]
    assert c["accepted"] and (c["gpus_before"], c["gpus_after"]) == (2, 1) and c["beyond_n_max"] == [0]
    assert soft.lower_bound_gpus == soft.lower_bound["gpus_no_nmax"] == 1 and not soft.settings["n_max_hard"]
    # a given n_max is a hard cap for the greedy, the consolidation and the bound
    hard = run_place(inst, LLAMA, "proposed", objective=THR, n_max=384, **toy_kwargs(100.0))
    assert hard.gpus_used == 2 and max(len(g.adapters) for g in hard.gpus) <= 384
    assert hard.lower_bound_gpus == hard.lower_bound["gpus"] == 2 and hard.settings["n_max_hard"]
    # without verification there is no consolidation: the greedy's plan
    raw = run_place(inst, LLAMA, "proposed", objective=THR, verify=False, **toy_kwargs(100.0))
    assert raw.gpus_used == 2 and raw.lower_bound_gpus == 1


class _Picky(ToyOracle):
    """A verifier that fails any GPU hosting both a000 and a001 (a pair the greedy keeps together)."""

    def predict(self, cands):
        import dataclasses

        return [dataclasses.replace(p, starved=1.0) if {0.61, 0.62} <= {round(float(x), 2) for x in c.rates_rps}
                else p for c, p in zip(cands, super().predict(cands), strict=True)]


def test_consolidation_tries_other_arrangements_than_the_greedys_and_keeps_only_verified_ones() -> None:
    # rates 0.62, 0.61 and 21 x 0.4 (9.63 req/s) on GPUs of 5 req/s: the greedy needs 3 GPUs, the verifier fails
    # the one holding 0.62 and 0.61 together and repair opens a 4th; the consolidation then tries 3 GPUs (the
    # balanced dealing passes), then 2: the dealings overload a GPU (5.02 req/s), dLoRA's replicas of the
    # hottest adapter fit and pass verification
    inst = instance(np.array([0.62, 0.61] + [0.4] * 21))
    toy, picky = ToyOracle(5.0), _Picky(5.0)
    plan = run_place(inst, LLAMA, "proposed", objective=THR, oracle=toy, search_oracle=toy, verify_oracle=picky,
                 capacity=toy_capacity(5.0), workers=1)
    c = plan.verification["consolidated"]
    assert plan.diagnostics["greedy_gpus"] == 3 and plan.verification["gpus_added"] == 1
    assert c["accepted"] and (c["gpus_before"], c["gpus_after"]) == (4, 2) and c["origin"] == "dlora"
    assert [(t["gpus"], t["origin"], t["passed"]) for t in c["tried"]][-1] == (2, "dlora", True)
    assert plan.gpus_used == 2 and all(g.verified.passed for g in plan.gpus)
    weight: dict[str, float] = {}
    for g in plan.gpus:
        for a, w in zip(g.adapters, g.weights, strict=True):
            weight[a] = weight.get(a, 0.0) + w / float(inst.weights[inst.adapter_ids.index(a)])
    assert sorted(weight) == sorted(inst.adapter_ids) and all(abs(w - 1.0) < 1e-9 for w in weight.values())
    # a verifier that agrees with the greedy: nothing added, nothing to consolidate below the bound
    calm = run_place(inst, LLAMA, "proposed", objective=THR, **toy_kwargs(5.0))
    assert calm.verification["gpus_added"] == 0 and calm.gpus_used <= 3


class _Counting(_Picky):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.simulated: list[float] = []  # each simulated GPU's total rate, in call order

    def predict(self, cands):
        self.simulated += [round(float(np.sum(c.rates_rps)), 2) for c in cands]
        return super().predict(cands)


def test_a_consolidation_candidate_is_rejected_at_its_first_failing_gpu_heaviest_first() -> None:
    from lorapack.placement.api import Context, _verify_until_failure
    from lorapack.placement.greedy import GpuFill
    from lorapack.placement.verify import verify_fills

    inst = instance(np.array([0.62, 0.61] + [0.4] * 10))
    light, heavy, other = GpuFill([2, 3, 4], 3), GpuFill([0, 1, 5, 6], 4), GpuFill([7, 8, 9, 10, 11], 5)
    for workers, simulated in ((1, [2.03]), (2, [2.03, 2.0])):
        picky = _Counting(5.0)
        ctx = Context(profile=LLAMA, objective=THR, workers=workers)
        assert _verify_until_failure(inst, ctx, [light, heavy, other], picky) is None
        assert picky.simulated == simulated  # the heaviest GPU first (and fails), the light one never simulated
    calm = _Counting(5.0)
    ok = _verify_until_failure(inst, Context(profile=LLAMA, objective=THR), [light, other], calm)
    assert calm.simulated == [2.0, 1.2]
    assert ok == verify_fills(inst, LLAMA, [light, other], THR, ToyOracle(5.0))  # in the plan's GPU order


def test_verify_plan_judges_another_methods_plan_as_place_verifies() -> None:
    from lorapack.placement.api import verify_plan

    inst = instance(np.full(24, 0.5))  # 12 req/s, GPUs of 5 req/s
    for method in ("dlora", "loraserve", "round-robin"):
        plan = run_place(inst, LLAMA, method, objective=THR, **toy_kwargs(5.0))
        verdicts = verify_plan(plan, inst, LLAMA, PlaceConfig(objective=THR), ToyOracle(5.0))
        assert len(verdicts) == plan.gpus_used and all(v.passed for v in verdicts), method
        # the same plan against a verifier that expects less of a GPU
        assert not all(v.passed for v in verify_plan(plan, inst, LLAMA, PlaceConfig(objective=THR),
                                                     ToyOracle(2.0)))
    lumped = run_place(inst, LLAMA, "least-adapters", gpus=1, objective=THR, verify=False, **toy_kwargs(5.0))
    (v,) = verify_plan(lumped, inst, LLAMA, PlaceConfig(objective=THR), ToyOracle(5.0))
    assert not v.passed and v.reason == "throughput"
    other = instance(np.full(3, 0.5), ids=["x", "y", "z"])
    with pytest.raises(SpecError, match="does not have"):
        verify_plan(lumped, other, LLAMA, verify_oracle=ToyOracle(5.0))


def test_twin_runs_on_the_kept_executor_answer_as_in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """proposed-exact's twin runs: in-process while workers would not pay for themselves, else on
    ``lorapack.executor``'s spawned workers, kept across calls; the same answers either way, in job order."""
    import json

    from lorapack.oracle import GpuCandidate
    from lorapack.placement import oracles

    cands = [GpuCandidate(profile=LLAMA, ranks=np.array([8, 16] * (n // 2)), rates_rps=np.full(n, rate),
                          server=ServerConfig(max_loras=a)) for n, a, rate in ((8, 4, 0.2), (16, 8, 0.1), (24, 8, 0.3), (32, 16, 0.05))]

    def runs(workers: int) -> str:
        preds = oracles.ParallelTwinOracle(seeds=(0, 1), duration_s=300.0, workers=workers).predict(cands)
        return json.dumps([p.extra["runs"] for p in preds], sort_keys=True)

    serial = runs(1)
    monkeypatch.setattr(oracles, "_EXECUTORS", {})
    monkeypatch.setattr(oracles, "_in_process_s", 0.0)
    try:
        assert runs(2) == serial and not oracles._EXECUTORS  # a small batch: no workers started
        monkeypatch.setattr(oracles, "WORKER_START_S", 0.0)  # workers always pay: start them
        assert runs(2) == serial
        kept = oracles._EXECUTORS[2]
        assert runs(2) == serial and oracles._EXECUTORS[2] is kept  # the same workers, kept
    finally:
        oracles.close_executors()
