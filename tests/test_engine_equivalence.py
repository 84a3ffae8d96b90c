"""The fast engine must reproduce the literal reference engine.

Per request: ``t_sent``, ``t_first``, ``t_finish`` equal within 1e-9 relative (NaN positions identical) and
``n_preempted`` identical; counters identical; ``busy_s`` / ``sched_s`` / ``load_s`` within 1e-9 relative;
every timeline column equal within 1e-9 relative. A failure prints the case (reproducible with
``engine_cases.build_case``) and the first differing request.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from engine_cases import (
    assert_engines_agree,
    build_case,
    case_params,
    compare_results,
    corner_cases,
    describe_case,
    random_params,
)
from lorapack.twin.engine import simulate_fast  # required: a missing engine or numba fails the suite
from lorapack.twin.reference import simulate_reference

SETTINGS = dict(derandomize=True, deadline=None, database=None, print_blob=False,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


assert_equivalent = assert_engines_agree


@pytest.mark.parametrize("case", corner_cases(), ids=lambda c: c.name)
def test_corner_cases(case):
    assert_equivalent(case)


@settings(max_examples=40, **SETTINGS)
@given(params=case_params())
def test_random_small_configs_quick(params):
    """The fast tier's sample of random small configurations; the 250 of the next test run in the slow tier."""
    assert_equivalent(build_case(params))


@pytest.mark.slow
@settings(max_examples=250, **SETTINGS)
@given(params=case_params())
def test_random_small_configs(params):
    assert_equivalent(build_case(params))


@pytest.mark.slow
def test_many_seeded_configs():
    """1,000 more cases from a seeded generator; reports every failing case, not only the first."""
    rng = np.random.default_rng(20260101)
    failures = []
    for _ in range(1000):
        case = build_case(random_params(rng))
        ref = simulate_reference(case.cfg, case.req)
        problems = compare_results(case, ref, simulate_fast(case.cfg, case.req))
        if problems:
            failures.append(describe_case(case) + "\n" + "\n".join(problems))
    assert not failures, f"{len(failures)} / 1000 cases differ; first ones:\n\n" + "\n\n".join(failures[:3])


@pytest.mark.slow
@settings(max_examples=60, **SETTINGS)
@given(params=case_params(max_requests=120))
def test_uncompiled_path(params):
    assert_equivalent(build_case(params), compiled=False)


def _with_admission(case, admission: str):
    return dataclasses.replace(case, cfg=dataclasses.replace(case.cfg, admission=admission),
                               name=f"{case.name} admission={admission}")


@settings(max_examples=25, **SETTINGS)
@given(params=case_params(max_requests=200))
def test_admission_option_both_values(params):
    """The max_loras admission rule (``EngineConfig.admission``, ``lorapack.server.VllmRules``) is the same in
    both engines for both values; and, as docs/engine-semantics.md argues, the two values give the same run
    (the waiting pass runs only after the running pass scheduled every running request)."""
    case = build_case(params)
    results = {}
    for admission in ("scheduled", "running"):
        c = _with_admission(case, admission)
        assert_equivalent(c)
        results[admission] = simulate_fast(c.cfg, c.req)
    assert not compare_results(case, results["scheduled"], results["running"], rtol=0.0)
