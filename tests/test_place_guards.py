"""``place`` estimates its cost before any work and refuses what cannot finish (issue 26, item 3).

Before: ``place --split-hot`` with one adapter at ``rate_rps`` 1e9 ran 666 s, reached 11.5 GB and produced
nothing; at 3,000 req/s ``proposed-exact`` had not finished after 120 s; ``--max-itl-ms 1`` advised
``--split-hot``. Now each stops with one line, exit 2, nothing written, in well under a second.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from data_helpers import run_main
from lorapack.errors import ResourceLimitError, SpecError
from lorapack.guards import DEFAULT_MAX_PLACE_ENTRIES, Limits
from lorapack.objective import Objective
from lorapack.placement import PlaceConfig, make_instance, place
from lorapack.placement.bound import ObjectiveUnreachable, lower_bound
from lorapack.placement.estimate import check_estimate, estimate_placement, twin_seconds
from lorapack.profile import find_profile

LLAMA = "llama-3.1-8b-instruct"
PROFILE = find_profile(LLAMA)
SRC = Path(__file__).resolve().parent.parent / "src" / "lorapack"


@pytest.fixture(autouse=True)
def _no_debug_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LORAPACK_DEBUG", raising=False)


def _one_hot(tmp_path: Path, rate_rps: float) -> Path:
    p = tmp_path / "hot.csv"
    p.write_text(f"adapter_id,rank,rate_rps\nhot,8,{rate_rps}\n")
    return p


def _refused(monkeypatch, capsys, tmp_path: Path, *args) -> str:
    out = tmp_path / "plan"
    code, stdout, err = run_main(monkeypatch, capsys, "place", *args, "--model", LLAMA, "--out", out)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (stdout, err)
    assert "Traceback" not in err and not out.exists()
    return lines[0]


def _hot(rate_rps: float):
    return make_instance(["hot"], [8], [rate_rps], mean_input_tokens=223, mean_output_tokens=197)


def test_split_hot_at_1e9_req_s_is_refused_at_once(tmp_path, monkeypatch, capsys) -> None:
    line = _refused(monkeypatch, capsys, tmp_path, _one_hot(tmp_path, 1e9), "--split-hot")
    assert re.search(r"--split-hot makes at least [\d,]+ replicas", line) and "'hot' at 1e+09 req/s" in line
    assert "GPUs" in line and "memory" in line
    t0 = time.perf_counter()
    with pytest.raises(ResourceLimitError, match="replicas"):
        place(_hot(1e9), PROFILE, PlaceConfig(split_hot=True))
    assert time.perf_counter() - t0 < 0.5


def test_proposed_exact_at_3000_req_s_is_refused_and_force_lifts_it(tmp_path, monkeypatch, capsys) -> None:
    line = _refused(monkeypatch, capsys, tmp_path, _one_hot(tmp_path, 3000), "--split-hot", "--method",
                    "proposed-exact")
    assert "the twin would simulate about" in line and "--force lifts it" in line and "verification" in line
    t0 = time.perf_counter()
    with pytest.raises(ResourceLimitError, match="the twin would simulate"):
        place(_hot(3000), PROFILE, PlaceConfig(split_hot=True, method="proposed-exact"))
    assert time.perf_counter() - t0 < 0.5
    # --force lifts the soft limit (the run itself would take minutes: the estimate is checked, not run)
    secs, how = twin_seconds(verify=True, verify_seeds=3, twin_oracle=True, pool_search=False)
    est = estimate_placement(_hot(3000), PROFILE, secs, split_hot=True)
    assert est.entries > 60 and est.gpus > 30
    check_estimate(est, Limits(force=True), how)
    with pytest.raises(ResourceLimitError):
        check_estimate(est, Limits(), how)


def test_a_learned_method_without_verification_costs_the_twin_nothing(tmp_path, monkeypatch, capsys) -> None:
    code, _out, err = run_main(monkeypatch, capsys, "place", _one_hot(tmp_path, 3000), "--model", LLAMA,
                               "--split-hot", "--no-verify", "--out", tmp_path / "plan", "--json")
    assert code == 0, err


def test_too_many_adapters_are_refused_unless_forced() -> None:
    n = DEFAULT_MAX_PLACE_ENTRIES + 1
    inst = make_instance([f"a{i}" for i in range(n)], [8] * n, [1e-4] * n, mean_input_tokens=223,
                         mean_output_tokens=197)
    with pytest.raises(ResourceLimitError, match=f"{n:,} adapters and replicas to place; the limit is "
                                                 f"{DEFAULT_MAX_PLACE_ENTRIES:,}"):
        place(inst, PROFILE, PlaceConfig(verify=False))
    est = estimate_placement(inst, PROFILE, 0.0, split_hot=False)
    check_estimate(est, Limits(force=True), "")
    with pytest.raises(SpecError, match="force"):
        PlaceConfig(force="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize("flag, value", [("--max-itl-ms", "1"), ("--max-itl-p99-ms", "5"),
                                         ("--max-ttft-s", "0.001")])
def test_an_objective_below_one_engine_step_says_no_gpu_can_meet_it(tmp_path, monkeypatch, capsys, flag,
                                                                     value) -> None:
    wl = tmp_path / "a.csv"
    wl.write_text("adapter_id,rank,rate_rps\na,8,0.1\nb,8,50\n")  # b is hot for any tiny latency capacity
    t0 = time.perf_counter()
    line = _refused(monkeypatch, capsys, tmp_path, wl, flag, value)
    assert time.perf_counter() - t0 < 5.0  # no simulation (the process-level figure: well under a second)
    assert f"{flag} {value}: no GPU can meet it, even with one adapter" in line and "split" not in line


def test_latency_limits_no_simulated_load_meets_are_said_so() -> None:
    """The bound's latency row is 0 when not even the lightest load tried met the limits: place says the
    objective cannot be met (before: that load became the capacity, and every adapter was 'too hot')."""
    inst = make_instance(["a"], [8], [1.0], mean_input_tokens=223, mean_output_tokens=197)
    with pytest.raises(ObjectiveUnreachable, match="no GPU meets the latency limits even with one adapter"):
        lower_bound(inst, PROFILE, capacity=lambda s: 10_000.0, latency_capacity=lambda s: 0.0)
    assert Objective(max_itl_ms=11).limits()  # (a reachable-looking limit is left to the simulated row)


def test_the_estimate_is_made_in_one_place() -> None:
    calls = [p for p in SRC.rglob("*.py") for line in p.read_text().splitlines()
             if "guard_placement(" in line and not line.lstrip().startswith("def ")]
    assert [p.relative_to(SRC).as_posix() for p in calls] == ["placement/api.py"]
