"""``lorapack rates``: per-adapter rates of the next window from a request log (lorapack.replan.rates)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from lorapack.errors import DataError, SpecError
from lorapack.replan.rates import (
    DEFAULT_FLOOR_RPS,
    RateOptions,
    forecast_rates,
    read_registry,
    read_request_log,
    write_workload,
)
from lorapack.workload.files import load_workload


def _write_log(path: Path, rows: list[tuple], tokens: bool = True) -> Path:
    head = "arrived_at,adapter_id" + (",num_prefill_tokens,num_decode_tokens" if tokens else "")
    lines = [head] + [",".join(str(x) for x in (r if tokens else r[:2])) for r in rows]
    path.write_text("\n".join(lines) + "\n")
    return path


def _registry(path: Path, ids_ranks: list[tuple[str, int]]) -> Path:
    path.write_text("adapter_id,rank\n" + "".join(f"{a},{r}\n" for a, r in ids_ranks))
    return path


@pytest.fixture
def three_windows(tmp_path):
    """Windows of 100 s ending at 300: a has 1 / 2 / 4 requests (oldest first), b 3 / 0 / 0, c is new in the
    last window (2 requests), d is in the registry only."""
    rows = [(0, "a", 10, 5)]  # the log's start (window 2 is (0, 100])
    rows += [(t, "a", 10, 5) for t in (150, 160)] + [(t, "a", 20, 7) for t in (210, 220, 230, 300)]
    rows += [(t, "b", 30, 9) for t in (20, 40, 60)] + [(t, "c", 40, 11) for t in (250, 260)]
    log = _write_log(tmp_path / "log.csv", rows)
    reg = _registry(tmp_path / "adapters.csv", [("a", 8), ("b", 16), ("c", 32), ("d", 8)])
    return read_request_log(log), read_registry(reg)


def _by_id(fc) -> dict:
    return {a.adapter_id: a for a in fc.adapters}


def test_the_three_forecasts(three_windows) -> None:
    log, reg = three_windows
    last = _by_id(forecast_rates(log, reg, RateOptions(window_s=100, forecast="last")))
    # window 0 is (200, 300]: a has 4, c has 2; the request at t=0 is the log's start, outside (0, 300]
    assert last["a"].rate_rps == pytest.approx(0.04) and last["c"].rate_rps == pytest.approx(0.02)
    assert last["b"].rate_rps == DEFAULT_FLOOR_RPS and last["b"].status == "silent"
    assert last["d"].rate_rps == DEFAULT_FLOOR_RPS and last["d"].status == "silent" and last["d"].last_seen_s is None
    peak = _by_id(forecast_rates(log, reg, RateOptions(window_s=100, forecast="peak")))
    assert peak["a"].rate_rps == pytest.approx(0.04) and peak["b"].rate_rps == pytest.approx(0.03)
    ewma = _by_id(forecast_rates(log, reg, RateOptions(window_s=100, forecast="ewma", ewma_alpha=0.5)))
    # a: windows 0, 1, 2 = 0.04, 0.02, 0.00 (t=0 is not inside (0, 100]) with weights 1, 0.5, 0.25
    assert ewma["a"].rate_rps == pytest.approx((0.04 + 0.5 * 0.02 + 0.25 * 0.0) / 1.75)
    # c is new: only window 0 counts (it did not exist before), so its ewma is its window-0 rate
    assert ewma["c"].status == "new" and ewma["c"].rate_rps == pytest.approx(0.02)
    assert ewma["a"].status == "active"


def test_grace_boundary(three_windows) -> None:
    log, reg = three_windows
    kept = _by_id(forecast_rates(log, reg, RateOptions(window_s=100, forecast="last", grace_s=241)))
    assert kept["b"].status == "silent" and kept["b"].rate_rps == DEFAULT_FLOOR_RPS
    gone = _by_id(forecast_rates(log, reg, RateOptions(window_s=100, forecast="last", grace_s=239)))
    assert gone["b"].status == "dropped"
    assert gone["d"].status == "dropped"  # never seen: silent since the log's start (300 s)
    assert gone["a"].status == "active" and gone["c"].status == "new"
    one = read_request_log(_write_log(Path(log.path).with_name("one.csv"), [(5, "a", 1, 1)]))
    with pytest.raises(SpecError, match="every request arrives at 5 s"):
        forecast_rates(one, reg, RateOptions(window_s=100))
    with pytest.raises(SpecError, match="every adapter has been silent"):
        forecast_rates(log, reg, RateOptions(window_s=100, grace_s=0.5, end_s=1000))


def test_unknown_adapters_are_named_or_left_out(tmp_path, three_windows) -> None:
    log, _ = three_windows
    reg = read_registry(_registry(tmp_path / "few.csv", [("a", 8)]))
    with pytest.raises(SpecError, match=r"adapters not in the adapters file: b, c; expected .* --ignore-unknown"):
        forecast_rates(log, reg, RateOptions(window_s=100))
    fc = forecast_rates(log, reg, RateOptions(window_s=100, forecast="last", ignore_unknown=True))
    assert [a.adapter_id for a in fc.adapters] == ["a"] and fc.ignored_unknown == ("b", "c")
    assert fc.adapters[0].rate_rps == pytest.approx(0.04)
    assert len(fc.lengths) == 12  # the unknown adapters' lengths still count (whole log: < 50 in window 0)


def test_written_workload_loads_with_its_rates_and_lengths(tmp_path, three_windows) -> None:
    log, reg = three_windows
    fc = forecast_rates(log, reg, RateOptions(window_s=100, forecast="last"))
    yaml_path, lengths_path = write_workload(fc, tmp_path / "next.yaml")
    assert lengths_path == tmp_path / "next.lengths.csv"
    wl = load_workload(yaml_path)
    assert [(a.adapter_id, a.rank) for a in wl.adapters] == [("a", 8), ("b", 16), ("c", 32), ("d", 8)]
    assert [a.rate_rps for a in wl.adapters] == pytest.approx([0.04, DEFAULT_FLOOR_RPS, 0.02, DEFAULT_FLOOR_RPS],
                                                              rel=1e-5)
    assert wl.lengths.kind == "empirical" and Path(wl.lengths.path) == lengths_path
    pairs = np.loadtxt(lengths_path, delimiter=",", skiprows=1, dtype=int)
    assert len(pairs) == 12 and pairs[:, 0].sum() == log.prompt_tokens.sum()  # whole log: < 50 in window 0
    assert "forecast: last" in yaml_path.read_text() and wl.duration_s == 100
    first = yaml_path.read_bytes()
    write_workload(forecast_rates(log, reg, RateOptions(window_s=100, forecast="last")), tmp_path / "next.yaml")
    assert yaml_path.read_bytes() == first  # deterministic


def test_a_log_without_tokens_gives_no_length_law(tmp_path) -> None:
    log = read_request_log(_write_log(tmp_path / "log.csv", [(0, "a"), (50, "a"), (99, "a")], tokens=False))
    reg = read_registry(_registry(tmp_path / "r.csv", [("a", 8)]))
    fc = forecast_rates(log, reg, RateOptions(window_s=200, forecast="last"))
    assert fc.lengths is None and fc.windows == 1 and fc.window_span_s == 99
    assert any("less than one 200 s window" in n for n in fc.notes)
    yaml_path, lengths_path = write_workload(fc, tmp_path / "w.yaml")
    assert lengths_path is None and load_workload(yaml_path).lengths.kind == "lognormal"


@pytest.mark.parametrize("rows, message", [
    ("arrived_at,adapter_id\nx,a\n", r"log.csv:2: arrived_at: expected a number"),
    ("arrived_at,adapter_id,num_prefill_tokens,num_decode_tokens\n1,a,0,3\n", r"log.csv:2: expected token counts"),
    ("arrived_at,adapter_id,num_prefill_tokens\n1,a,3\n", r"expected both token columns"),
    ("arrived_at,adapter\n1,a\n", r"log.csv:1: expected header columns arrived_at,adapter_id"),
    ("arrived_at,adapter_id\n", r"log.csv:2: no requests"),
    ("arrived_at,adapter_id\ninf,a\n", r"expected a finite number"),
])
def test_bad_logs_name_the_line(tmp_path, rows, message) -> None:
    (tmp_path / "log.csv").write_text(rows)
    with pytest.raises(DataError, match=message):
        read_request_log(tmp_path / "log.csv")


def test_bad_options() -> None:
    for kw, message in ((dict(window_s=0), "--window-s 0"), (dict(window_s=1, forecast="mean"), "--forecast 'mean'"),
                        (dict(window_s=1, ewma_alpha=0), "--ewma-alpha 0"), (dict(window_s=1, floor_rps=0),
                                                                             "--floor-rps 0"),
                        (dict(window_s=1, grace_s=-1), "--grace-s -1")):
        with pytest.raises(SpecError, match=message):
            RateOptions(**kw)


@settings(max_examples=40, deadline=None, derandomize=True, database=None)
@given(st.lists(st.tuples(st.floats(0, 1000, allow_nan=False), st.integers(0, 5)), min_size=1, max_size=200),
       st.sampled_from(["last", "ewma", "peak"]), st.floats(10, 400))
def test_rate_invariants(tmp_path_factory, events, forecast, window_s) -> None:
    assume(len({t for t, _ in events}) > 1)  # a log at one instant has no rate (an error, tested below)
    d = tmp_path_factory.mktemp("prop")
    log = read_request_log(_write_log(d / "log.csv", [(t, f"a{k}") for t, k in events], tokens=False))
    reg = read_registry(_registry(d / "r.csv", [(f"a{k}", 8) for k in range(6)]))
    last = forecast_rates(log, reg, RateOptions(window_s=window_s, forecast="last"))
    fc = forecast_rates(log, reg, RateOptions(window_s=window_s, forecast=forecast))
    peak = forecast_rates(log, reg, RateOptions(window_s=window_s, forecast="peak"))
    end = max(t for t, _ in events)
    width = last.window_span_s
    for a_last, a, a_peak in zip(last.adapters, fc.adapters, peak.adapters, strict=True):
        assert a.rate_rps >= DEFAULT_FLOOR_RPS
        assert a_peak.rate_rps >= a.rate_rps - 1e-12  # peak bounds every forecast
        n0 = sum(1 for t, k in events if f"a{k}" == a.adapter_id and end - width < t <= end)
        assert a_last.requests_in_window == n0
        assert a_last.rate_rps == pytest.approx(max(n0 / width, DEFAULT_FLOOR_RPS))


def test_cli_writes_the_workload_and_refuses_bad_input(tmp_path, three_windows) -> None:
    log = tmp_path / "log.csv"
    reg = tmp_path / "adapters.csv"
    cmd = [sys.executable, "-m", "lorapack.cli", "rates", str(log), "--adapters", str(reg), "--window-s", "100"]
    p = subprocess.run([*cmd, "--forecast", "peak", "--out", str(tmp_path / "w.yaml")], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "adapters kept" in p.stdout and (tmp_path / "w.lengths.csv").is_file()
    bad = subprocess.run([*cmd, "--forecast", "mean", "--out", str(tmp_path / "x.yaml")], capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and "--forecast 'mean'" in bad.stderr and "Traceback" not in bad.stderr
    assert not (tmp_path / "x.yaml").exists() and not (tmp_path / "x.lengths.csv").exists()
    _registry(reg, [("a", 8)])
    bad = subprocess.run([*cmd, "--out", str(tmp_path / "y.yaml")], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "adapters not in the adapters file: b, c" in bad.stderr
    assert not (tmp_path / "y.yaml").exists()


def test_the_conversation_trace_with_adapters(tmp_path, data_dir) -> None:
    """Golden: the Azure conversation trace labelled with 40 Zipf adapters: the ``last`` rates of the final
    window add up to that window's request rate, and the lengths are its token counts."""
    trace = np.loadtxt(data_dir / "traces" / "azure-llm-2023-conv.csv", delimiter=",", skiprows=1)
    rng = np.random.default_rng(7)
    w = 1 / np.arange(1, 41)
    ad = rng.choice(40, size=len(trace), p=w / w.sum())
    rows = [(f"{t:.6f}", f"a{k}", int(p), int(o)) for (t, p, o), k in zip(trace, ad, strict=True)]
    log = read_request_log(_write_log(tmp_path / "log.csv", rows))
    reg = read_registry(_registry(tmp_path / "r.csv", [(f"a{k}", 16) for k in range(40)]))
    fc = forecast_rates(log, reg, RateOptions(window_s=600, forecast="last"))
    end = trace[-1, 0]
    window = trace[(trace[:, 0] > end - 600) & (trace[:, 0] <= end)]
    assert fc.windows == int(end // 600)
    assert sum(a.requests_in_window for a in fc.adapters) == len(window)
    # an adapter with a request in the window is rated count / 600 (> the floor of one per hour)
    assert sum(a.rate_rps for a in fc.adapters if a.requests_in_window) == pytest.approx(len(window) / 600)
    assert len(fc.lengths) == len(window) and fc.lengths[:, 0].sum() == window[:, 1].sum()
