"""First-token order agreement (``testbed.replay.order_agreement``), the staircase tests' measure: its
properties, the one-step tie, and that a twin without the ``--max-loras`` rule still fails it."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lorapack.profile import find_profile
from lorapack.server import ServerConfig
from lorapack.testbed.replay import order_agreement, twin_replay
from lorapack.testbed.staircase import ADAPTERS, MIN_PAIR_GAP_S, RANKS, design, server_flags

# CI of 22bfaea (2026-11-29, a machine ~3x slower than usual): the interleaved --max-loras 2 staircase, first-token
# times per adapter (its k-th request is request 6k + the adapter's position), as the failure message printed them
# (rounded to 10 ms); the twin ran at 2.72 x the profile's steps.
CI_SERVER = {"r8-0": [0.05, 0.19, 0.36, 0.52, 0.65, 0.83, 0.96, 1.11, 1.27, 1.42],
             "r8-1": [0.07, 0.22, 0.39, 0.54, 0.67, 0.85, 1.01, 1.13, 1.3, 1.45],
             "r16-0": [4.15, 4.16, 4.15, 4.14, 4.16, 4.11, 4.14, 4.15, 4.21, 4.2],
             "r16-1": [4.13, 4.15, 4.11, 4.11, 4.13, 4.14, 4.16, 4.11, 4.23, 4.23],
             "r32-0": [7.99, 7.98, 7.98, 7.98, 8.0, 8.01, 7.95, 7.98, 8.06, 8.1],
             "r32-1": [7.99, 8.0, 8.0, 8.0, 7.99, 8.0, 7.97, 8.0, 8.09, 8.08]}
CI_TWIN = {"r8-0": [0.07, 0.22, 0.39, 0.52, 0.65, 0.82, 0.95, 1.13, 1.27, 1.4],
           "r8-1": [0.13, 0.26, 0.39, 0.56, 0.69, 0.87, 1.0, 1.13, 1.31, 1.45],
           "r16-0": [4.22] * 10, "r16-1": [4.31] * 10, "r32-0": [7.14] * 10, "r32-1": [7.22] * 10}
CI_SCALE = 2.72
ONE_STEP_S = 0.04  # about one step at that pace


def _per_request(times: dict[str, list[float]]) -> np.ndarray:
    arrivals = design("interleaved")
    seen: dict[str, int] = {}
    out = []
    for a in arrivals:
        k = seen.get(a.adapter_id, 0)
        seen[a.adapter_id] = k + 1
        out.append(times[a.adapter_id][k])
    return np.array(out)


def _sent_and_adapters():
    arrivals = design("interleaved")
    return np.array([a.t_s for a in arrivals]), [a.adapter_id for a in arrivals]


def test_the_ci_staircase_agrees_once_one_step_is_a_tie() -> None:
    """The rank-16 (and rank-32) adapters were picked up in one step on the server, one step apart in the twin:
    no rule decides that, and a one-step tie leaves it out."""
    sent, ads = _sent_and_adapters()
    server, twin = _per_request(CI_SERVER), _per_request(CI_TWIN)
    share0, pairs = order_agreement(sent, ads, server, twin, MIN_PAIR_GAP_S)
    share1, pairs1 = order_agreement(sent, ads, server, twin, MIN_PAIR_GAP_S, ONE_STEP_S)
    assert pairs == pairs1 == 1500
    assert share0 == pytest.approx(0.9387, abs=1e-4) and share0 < 0.95
    assert share1 == pytest.approx(0.968, abs=1e-3) and share1 >= 0.95


@pytest.mark.parametrize("twin_slots", [3, 4, 6])
def test_a_twin_with_other_slots_still_disagrees_with_the_server(twin_slots: int) -> None:
    """The tie does not hide a wrong rule: the twin with 3, 4 or 6 slots instead of the server's 2, at the CI
    run's pace, against that run's server times, stays below the 0.95 target with the same one-step tie
    (measured 0.909, 0.863, 0.632; with 2 slots 0.968, as from the failure message)."""
    llama = find_profile("llama-3.1-8b-instruct")
    arrivals = design("interleaved")
    sent, ads = _sent_and_adapters()
    _, engine = twin_replay(llama, ADAPTERS, RANKS, arrivals, ServerConfig(**server_flags(twin_slots)), 120.0,
                            time_scale=CI_SCALE)
    share, _ = order_agreement(sent, ads, _per_request(CI_SERVER), engine.t_first_s, MIN_PAIR_GAP_S, ONE_STEP_S)
    assert share < 0.95
    _, right = twin_replay(llama, ADAPTERS, RANKS, arrivals, ServerConfig(**server_flags(2)), 120.0,
                           time_scale=CI_SCALE)
    assert order_agreement(sent, ads, _per_request(CI_SERVER), right.t_first_s, MIN_PAIR_GAP_S, ONE_STEP_S)[0] >= 0.95


def test_a_negative_tie_is_refused() -> None:
    with pytest.raises(ValueError, match="tie_s -0.1"):
        order_agreement(np.zeros(2), ["a", "b"], np.zeros(2), np.zeros(2), tie_s=-0.1)


times = st.lists(st.floats(0.0, 10.0, allow_nan=False), min_size=2, max_size=12)


@settings(max_examples=60, deadline=None)
@given(times, st.data())
def test_properties(first_a: list[float], data) -> None:
    """Agreement with itself is 1; it is symmetric; a larger tie never lowers it; a tie of 0 counts only exact
    ties; a tie longer than every gap agrees on everything."""
    n = len(first_a)
    a = np.array(first_a)
    b = np.array(data.draw(st.lists(st.floats(0.0, 10.0, allow_nan=False), min_size=n, max_size=n)))
    sent = np.arange(n) * 0.025
    ads = [f"x{i % 3}" for i in range(n)]
    share, pairs = order_agreement(sent, ads, a, a)
    assert pairs == 0 or share == 1.0
    if pairs == 0:
        return
    assert order_agreement(sent, ads, a, b) == order_agreement(sent, ads, b, a)
    ties = sorted(data.draw(st.lists(st.floats(0.0, 1.0), min_size=2, max_size=4)))
    shares = [order_agreement(sent, ads, a, b, tie_s=t)[0] for t in ties]
    assert shares == sorted(shares)
    i, j = np.triu_indices(n, k=1)
    keep = np.array(ads)[i] != np.array(ads)[j]
    i, j = i[keep], j[keep]
    exact = (np.sign(a[i] - a[j]) == np.sign(b[i] - b[j])) | (a[i] == a[j]) | (b[i] == b[j])
    assert order_agreement(sent, ads, a, b)[0] == pytest.approx(exact.mean())
    assert order_agreement(sent, ads, a, b, tie_s=11.0)[0] == 1.0
