"""Workload spec parsing and request generation (``workload.lengths``, placement.md §6.2 / §6.5)."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy import stats

from lorapack.errors import DataError, SpecError
from lorapack.spec import (
    Adapter,
    AdapterGroup,
    LengthsSpec,
    LognormalArrivals,
    ModulatedArrivals,
    PoissonArrivals,
    TraceArrivals,
    UnpredictableArrivals,
    Workload,
    expand_adapters,
)
from lorapack.twin.types import RequestArrays
from lorapack.workload import (
    adapter_ranks,
    example_workload,
    generate_requests,
    load_trace,
    load_workload,
    sample_lengths,
    solve_lognormal_lengths,
    unpredictable_rate_multipliers,
    with_mean_lengths,
)
from lorapack.workload.cost import estimate_workload
from lorapack.workload.generate import _stable_time_order
from lorapack.workload.lengths import MAX_INPUT_TOKENS, MAX_TOTAL_TOKENS, MIN_TOKENS

FAST = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def _workload(rates, ranks=None, lengths=None, arrivals=None) -> Workload:
    ranks = ranks or [8] * len(rates)
    return Workload(
        adapters=[Adapter(adapter_id=f"a{i}", rank=r, rate_rps=q) for i, (r, q) in enumerate(zip(ranks, rates, strict=True))],
        lengths=lengths or LengthsSpec(kind="lognormal"),
        arrivals=arrivals or PoissonArrivals(),
    )


def _adapter_view(req: RequestArrays, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    m = req.adapter == i
    return req.t_arr_s[m], req.prompt_tokens[m], req.output_tokens[m]


def _write_trace(path: Path, t_s, p_tok, o_tok) -> Path:
    rows = "\n".join(f"{float(t)!r},{int(p)},{int(o)}" for t, p, o in zip(t_s, p_tok, o_tok, strict=True))
    return _write(path, "arrived_at,num_prefill_tokens,num_decode_tokens\n" + rows + "\n")


@pytest.fixture
def small_trace(tmp_path: Path) -> Path:
    rng = np.random.default_rng(7)
    t = np.round(np.cumsum(rng.exponential(0.5, 2000)), 6)
    t[10] = t[11]  # an exact tie, as real traces have
    p = rng.integers(1, 3000, 2000)
    o = rng.integers(1, 500, 2000)
    return _write_trace(tmp_path / "trace.csv", t - t[0], p, o)


@pytest.fixture
def azure_conv(data_dir: Path) -> Path:
    path = data_dir / "traces" / "azure-llm-2023-conv.csv"
    if not path.is_file():
        pytest.skip(f"Azure trace not found at {path} (set LORAPACK_DATA to the shared data directory)")
    return path


# ---------------------------------------------------------------------------------------------------------
# parsing


def test_yaml_groups_and_singles(tmp_path: Path) -> None:
    f = _write(tmp_path / "w.yaml", """\
adapters:
  - {count: 2, rank: 8, rate_rps: 0.1}
  - {adapter_id: chat, rank: 32, rate_rps: 1.5, path: /lora/chat}
  - {count: 3, rank: 16, rate_rps: 0, id_prefix: big}
  - {count: 1, rank: 8, rate_rps: 0.2}
lengths: {kind: fixed, mean_input_tokens: 100, mean_output_tokens: 50}
arrivals: lognormal
duration_s: 120
""")
    w = load_workload(f)
    assert w.adapter_ids == ["adapter-0", "adapter-1", "chat", "big-0", "big-1", "big-2", "adapter-2"]
    assert w.ranks.tolist() == [8, 8, 32, 16, 16, 16, 8]
    assert w.ranks.dtype == np.int32 and adapter_ranks(w).dtype == np.int32
    assert w.rates_rps.tolist() == [0.1, 0.1, 1.5, 0.0, 0.0, 0.0, 0.2]
    assert w.adapters[2].path == "/lora/chat"
    assert w.lengths.kind == "fixed" and w.lengths.mean_input_tokens == 100
    assert isinstance(w.arrivals, LognormalArrivals) and w.arrivals.sigma == 1.0
    assert w.duration_s == 120


def test_yaml_defaults_and_adapters_csv(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    _write(tmp_path / "sub" / "ad.csv", "adapter_id,rank,rate_rps\nx,8,1\ny,16,0.5\n")
    w = load_workload(_write(tmp_path / "w.yml", "adapters_csv: sub/ad.csv\n"))
    assert w.adapter_ids == ["x", "y"]
    assert w.lengths == LengthsSpec() and w.lengths.kind == "lognormal"
    assert (w.lengths.mean_input_tokens, w.lengths.mean_output_tokens) == (223, 197)
    assert isinstance(w.arrivals, PoissonArrivals) and w.duration_s is None


def test_csv_is_a_workload(tmp_path: Path) -> None:
    f = _write(tmp_path / "a.csv", "# a comment\nrate_rps, adapter_id ,rank,path\n0.5,a,8,/w/a\n\n1,b,16,\n")
    w = load_workload(f)
    assert w.adapter_ids == ["a", "b"] and w.ranks.tolist() == [8, 16] and w.rates_rps.tolist() == [0.5, 1.0]
    assert [a.path for a in w.adapters] == ["/w/a", None]
    assert w == Workload(adapters=w.adapters)  # defaults for the rest


def test_group_numbering_continues_per_prefix() -> None:
    out = expand_adapters([AdapterGroup(count=2, rank=8, rate_rps=1, id_prefix="p"),
                           AdapterGroup(count=2, rank=8, rate_rps=1),
                           AdapterGroup(count=1, rank=8, rate_rps=1, id_prefix="p")])
    assert [a.adapter_id for a in out] == ["p-0", "p-1", "adapter-0", "adapter-1", "p-2"]


def test_relative_data_paths_resolved(tmp_path: Path, small_trace: Path) -> None:
    _write(tmp_path / "len.csv", "input_tokens,output_tokens\n10,20\n30,40\n")
    w = load_workload(_write(tmp_path / "w.yaml", """\
adapters: [{count: 3, rank: 8, rate_rps: 1}]
lengths: {kind: empirical, path: len.csv}
arrivals: {kind: trace, path: trace.csv, assignment: "zipf:1.5", trace_lengths: false}
"""))
    assert Path(w.lengths.path) == (tmp_path / "len.csv").resolve()
    assert isinstance(w.arrivals, TraceArrivals) and Path(w.arrivals.path) == small_trace.resolve()
    assert w.arrivals.assignment == "zipf" and w.arrivals.zipf_s == 1.5


def test_examples_ship_and_load() -> None:
    demo = load_workload(example_workload())
    assert demo.n_adapters == 64 and set(demo.ranks.tolist()) == {8, 16}
    assert set(demo.rates_rps.tolist()) == {0.1, 0.05, 0.025}
    assert demo.lengths.kind == "fixed" and isinstance(demo.arrivals, PoissonArrivals)
    csv_w = load_workload(example_workload("adapters.csv"))
    assert csv_w.n_adapters >= 3
    with pytest.raises(SpecError, match="no shipped example"):
        example_workload("nope.yaml")


def test_with_mean_lengths() -> None:
    w = _workload([1.0])
    w2 = with_mean_lengths(w, 200, None)
    assert (w2.lengths.mean_input_tokens, w2.lengths.mean_output_tokens) == (200, 197)
    assert with_mean_lengths(w) is w
    with pytest.raises(SpecError, match="cannot reach"):
        with_mean_lengths(w, 950, None)


# every error: (file name, content, expected line, a substring of the message)
YAML_ERRORS = [
    ("neg.yaml", "adapters:\n  - {adapter_id: a, rank: 8, rate_rps: -1}\n", 2, "rate_rps: expected a finite number >= 0"),
    ("nan.yaml", "adapters:\n  - adapter_id: a\n    rank: 8\n    rate_rps: .nan\n", 4, "finite number >= 0 (got nan)"),
    ("inf.yaml", "adapters:\n  - {count: 2, rank: 8, rate_rps: .inf}\n", 2, "finite number >= 0 (got inf)"),
    ("frac.yaml", "adapters:\n  - {adapter_id: a, rank: 8.5, rate_rps: 1}\n", 2, "rank: Input should be a valid integer"),
    ("strrank.yaml", "adapters:\n  - {adapter_id: a, rank: big, rate_rps: 1}\n", 2, "valid integer"),
    ("zero.yaml", "adapters:\n  - {adapter_id: a, rank: 0, rate_rps: 1}\n", 2, "expected an integer rank 1 ... 512"),
    ("bool.yaml", "adapters:\n  - {adapter_id: a, rank: true, rate_rps: 1}\n", 2, "boolean"),
    ("count0.yaml", "adapters:\n  - {count: 0, rank: 8, rate_rps: 1}\n", 2, "count: expected a positive integer"),
    ("empty.yaml", "adapters: []\n", 1, "expected at least one adapter"),
    ("nolist.yaml", "adapters: 3\n", 1, "expected a list"),
    ("dup.yaml", "adapters:\n  - {adapter_id: a-0, rank: 8, rate_rps: 1}\n  - {count: 2, rank: 8, rate_rps: 1, id_prefix: a}\n",
     3, "duplicate adapter_id 'a-0' (first on line 2)"),
    ("missing.yaml", "adapters:\n  - {adapter_id: a, rank: 8}\n", 2, "missing field 'rate_rps'"),
    ("extra.yaml", "adapters:\n  - {adapter_id: a, rank: 8, rate_rps: 1}\nlenghts: {kind: fixed}\n", 3,
     "unknown field 'lenghts'; expected one of: adapters, adapters_csv"),
    ("extra2.yaml", "adapters:\n  - {adapter_id: a, rank: 8, rate_rps: 1}\narrivals:\n  kind: poisson\n  rate: 3\n", 5,
     "unknown field 'rate'"),
    ("kind.yaml", "adapters:\n  - {adapter_id: a, rank: 8, rate_rps: 1}\narrivals: {kind: gamma}\n", 3, "expected kind one of"),
    ("lkind.yaml", "adapters:\n  - {adapter_id: a, rank: 8, rate_rps: 1}\nlengths:\n  kind: normal\n", 4, "lengths.kind"),
    ("both.yaml", "adapters:\n  - {adapter_id: a, rank: 8, rate_rps: 1}\nadapters_csv: x.csv\n", 1, "exactly one of"),
    ("neither.yaml", "duration_s: 10\n", 1, "exactly one of"),
    ("notmap.yaml", "- 1\n- 2\n", 1, "expected a mapping"),
    ("blank.yaml", "", 1, "expected a mapping"),
    ("syntax.yaml", "adapters:\n  - {adapter_id: a, rank: 8, rate_rps: 1\nlengths: x\n", 3, "malformed YAML"),
    ("tab.yaml", "adapters:\n\t- x\n", 2, "malformed YAML"),
    ("dupkey.yaml", "adapters:\n  - {adapter_id: a, rank: 8, rate_rps: 1}\nadapters: []\n", 3, "duplicate key 'adapters'"),
    ("dur.yaml", "adapters:\n  - {adapter_id: a, rank: 8, rate_rps: 1}\nduration_s: 0\n", 3, "duration_s: expected a finite number > 0"),
    ("factor.yaml", "adapters:\n  - {adapter_id: a, rank: 8, rate_rps: 1}\narrivals:\n  kind: unpredictable\n  factor: 0.5\n", 5,
     "arrivals.factor: expected a finite number >= 1"),
    ("emp.yaml", "adapters:\n  - {adapter_id: a, rank: 8, rate_rps: 1}\nlengths: {kind: empirical}\n", 3, "expects 'path'"),
    ("trace.yaml", "adapters:\n  - {adapter_id: a, rank: 8, rate_rps: 1}\narrivals:\n  kind: trace\n  path: none.csv\n", 5,
     "arrivals.path: file not found"),
    ("csvref.yaml", "adapters_csv: none.csv\n", 1, "adapters_csv: file not found"),
    ("infeasible.yaml", "adapters:\n  - {adapter_id: a, rank: 8, rate_rps: 1}\nlengths:\n  mean_input_tokens: 900\n", 4,
     "cannot reach post-filter means"),
    ("space.yaml", "adapters:\n  - {adapter_id: a b, rank: 8, rate_rps: 1}\n", 2, "non-empty name without spaces"),
]

CSV_ERRORS = [
    ("cols.csv", "adapter_id,rank,rate\nx,8,1\n", 1, "expected header columns adapter_id,rank,rate_rps[,path]"),
    ("extra.csv", "adapter_id,rank,rate_rps,colour\nx,8,1,red\n", 1, "expected header columns"),
    ("dupcol.csv", "adapter_id,rank,rate_rps,rank\nx,8,1,8\n", 1, "expected header columns"),
    ("neg.csv", "adapter_id,rank,rate_rps\nx,8,1\ny,8,-0.5\n", 3, "rate_rps: expected a finite number >= 0"),
    ("nan.csv", "adapter_id,rank,rate_rps\nx,8,nan\n", 2, "expected a finite number >= 0 (got 'nan')"),
    ("inf.csv", "adapter_id,rank,rate_rps\n\n# c\nx,8,inf\n", 4, "expected a finite number >= 0 (got 'inf')"),
    ("rank.csv", "adapter_id,rank,rate_rps\nx,8.5,1\n", 2, "rank: Input should be a valid integer"),
    ("rank2.csv", "adapter_id,rank,rate_rps\nx,eight,1\n", 2, "rank: Input should be a valid integer"),
    ("norows.csv", "adapter_id,rank,rate_rps\n", 2, "expected at least one row"),
    ("empty.csv", "", 1, "empty file; expected header columns"),
    ("dup.csv", "adapter_id,rank,rate_rps\nx,8,1\nx,16,1\n", 3, "duplicate id 'x' (first on line 2)"),
    ("fields.csv", "adapter_id,rank,rate_rps\nx,8,1\ny,8\n", 3, "expected 3 fields"),
    ("quote.csv", 'adapter_id,rank,rate_rps\nx,8,1\ny,8,"1\n', 3, "malformed CSV"),
    ("noid.csv", "adapter_id,rank,rate_rps\n,8,1\n", 2, "adapter_id: expected a non-empty name"),
]


@pytest.mark.parametrize(("name", "text", "line", "expected"), YAML_ERRORS + CSV_ERRORS,
                         ids=[c[0] for c in YAML_ERRORS + CSV_ERRORS])
def test_spec_errors_name_file_and_line(tmp_path: Path, name: str, text: str, line: int, expected: str) -> None:
    f = _write(tmp_path / name, text)
    with pytest.raises(SpecError) as exc:
        load_workload(f)
    msg = str(exc.value)
    assert "\n" not in msg
    assert msg.startswith(f"{f}:{line}: "), msg
    assert expected in msg, msg


def test_missing_file_and_unknown_extension(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match=r"nope\.yaml: file not found"):
        load_workload(tmp_path / "nope.yaml")
    with pytest.raises(SpecError, match=r"expected \.yaml, \.yml or \.csv"):
        load_workload(_write(tmp_path / "w.json", "{}"))
    with pytest.raises(SpecError, match="not a file"):
        load_workload(tmp_path)


@pytest.mark.parametrize(("text", "line", "expected"), [
    ("arrived_at,num_prefill_tokens\n0,1\n", 1, "expected header columns"),
    ("arrived_at,num_prefill_tokens,num_decode_tokens\n0,5,5\n1,x,5\n", 3, "expected a number of seconds"),
    ("arrived_at,num_prefill_tokens,num_decode_tokens\n0,5,5\n-1,5,5\n", 3, "arrived_at: expected a finite time"),
    ("arrived_at,num_prefill_tokens,num_decode_tokens\n0,5,0\n", 2, "token counts >= 1"),
    ("arrived_at,num_prefill_tokens,num_decode_tokens\n", 2, "no requests"),
])
def test_trace_data_errors(tmp_path: Path, text: str, line: int, expected: str) -> None:
    trace = _write(tmp_path / "t.csv", text)
    spec = _write(tmp_path / "w.yaml", "adapters: [{count: 2, rank: 8, rate_rps: 1}]\narrivals: {kind: trace, path: t.csv}\n")
    with pytest.raises(DataError) as exc:
        load_workload(spec)
    assert str(exc.value).startswith(f"{trace.resolve()}:{line}: ") and expected in str(exc.value)


def test_lengths_table_errors(tmp_path: Path) -> None:
    _write(tmp_path / "l.csv", "input_tokens,output_tokens\n5,5\n5,-2\n")
    spec = _write(tmp_path / "w.yaml", "adapters: [{count: 2, rank: 8, rate_rps: 1}]\nlengths: {kind: empirical, path: l.csv}\n")
    with pytest.raises(DataError, match=r"l\.csv:3: expected token counts >= 1"):
        load_workload(spec)


def test_programmatic_validation() -> None:
    with pytest.raises(ValueError, match="duplicate adapter_id"):
        Workload(adapters=[Adapter(adapter_id="a", rank=8, rate_rps=1), Adapter(adapter_id="a", rank=8, rate_rps=1)])
    with pytest.raises(ValueError):
        Workload(adapters=[])
    for bad in (-1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="finite number >= 0"):
            Adapter(adapter_id="a", rank=8, rate_rps=bad)


adapter_rows = st.lists(
    st.tuples(st.integers(1, 512), st.floats(0, 1e3, allow_nan=False, allow_infinity=False)), min_size=1, max_size=20)


@FAST
@given(rows=adapter_rows)
def test_csv_roundtrip(tmp_path: Path, rows: list[tuple[int, float]]) -> None:
    text = "adapter_id,rank,rate_rps\n" + "".join(f"id{i},{r},{q!r}\n" for i, (r, q) in enumerate(rows))
    w = load_workload(_write(tmp_path / "rt.csv", text))
    assert w.ranks.tolist() == [r for r, _ in rows] and w.rates_rps.tolist() == [q for _, q in rows]


@FAST
@given(rows=adapter_rows, bad_row=st.integers(0, 19), bad=st.sampled_from(["-1", "nan", "inf", "-inf", "x", ""]))
def test_csv_bad_rate_reports_its_line(tmp_path: Path, rows, bad_row: int, bad: str) -> None:
    bad_row %= len(rows)
    lines = [f"id{i},{r},{q!r}" if i != bad_row else f"id{i},{r},{bad}" for i, (r, q) in enumerate(rows)]
    f = _write(tmp_path / "bad.csv", "adapter_id,rank,rate_rps\n" + "\n".join(lines) + "\n")
    with pytest.raises(SpecError, match=rf"^{re.escape(str(f))}:{bad_row + 2}: rate_rps: "):
        load_workload(f)


# ---------------------------------------------------------------------------------------------------------
# generation: basics, determinism, common random numbers


ARRIVAL_KINDS = [PoissonArrivals(), LognormalArrivals(sigma=0.8),
                 UnpredictableArrivals(period_s=50.0, factor=2.0, clip=8.0),
                 ModulatedArrivals(period_s=40.0, multipliers=[0.5, 1.8, 0.0, 1.2])]


@pytest.mark.parametrize("arrivals", ARRIVAL_KINDS, ids=lambda a: a.kind)
def test_sorted_in_window_and_typed(arrivals) -> None:
    w = _workload([0.5, 2.0, 0.0, 1.0], arrivals=arrivals)
    req = generate_requests(w, 400.0, seed=3)
    assert isinstance(req, RequestArrays) and len(req) > 0
    assert req.t_arr_s.dtype == np.float64 and req.adapter.dtype == np.int32
    assert req.prompt_tokens.dtype == np.int32 and req.output_tokens.dtype == np.int32
    assert np.all(np.diff(req.t_arr_s) >= 0)
    assert req.t_arr_s.min() >= 0 and req.t_arr_s.max() < 400.0
    assert not np.any(req.adapter == 2)  # rate 0 -> no requests
    assert set(np.unique(req.adapter).tolist()) == {0, 1, 3}
    assert req.prompt_tokens.min() >= 1 and req.output_tokens.min() >= 1


def test_ties_broken_by_adapter_index() -> None:
    t = np.array([3.0, 1.0, 2.0, 1.0, 2.0, 0.5])  # adapter order: concatenation order
    assert _stable_time_order(t).tolist() == [5, 1, 3, 2, 4, 0]
    assert _stable_time_order(np.array([2.0, 1.0])).tolist() == [1, 0]


@pytest.mark.parametrize("arrivals", ARRIVAL_KINDS, ids=lambda a: a.kind)
def test_determinism(arrivals) -> None:
    w = _workload([0.3, 1.0, 0.7], arrivals=arrivals)
    a, b, c = (generate_requests(w, 500.0, s) for s in (11, 11, 12))
    for name in ("t_arr_s", "adapter", "prompt_tokens", "output_tokens"):
        assert np.array_equal(getattr(a, name), getattr(b, name))
    assert len(a) != len(c) or not np.array_equal(a.t_arr_s, c.t_arr_s)
    assert not np.array_equal(a.prompt_tokens[:50], c.prompt_tokens[:50])


def test_bad_generation_arguments() -> None:
    w = _workload([1.0])
    for dur in (0, -1.0, math.inf, math.nan):
        with pytest.raises(SpecError, match="duration_s"):
            generate_requests(w, dur, 0)
    for seed in (-1, 1.5, "x"):
        with pytest.raises(SpecError, match="seed"):
            generate_requests(w, 10.0, seed)  # type: ignore[arg-type]


LENGTH_KINDS = ["fixed", "lognormal", "empirical"]


def _lengths(kind: str, tmp_path: Path) -> LengthsSpec:
    if kind == "empirical":
        rows = "".join(f"{p},{o}\n" for p, o in zip(range(10, 200, 7), range(300, 3, -11), strict=False))
        f = _write(tmp_path / "len.csv", "input_tokens,output_tokens\n" + rows)
        return LengthsSpec(kind="empirical", path=str(f))
    return LengthsSpec(kind=kind)


@FAST
@given(rates=st.lists(st.floats(0.0, 3.0), min_size=2, max_size=8), data=st.data(),
       seed=st.integers(0, 2**32), kind=st.sampled_from(LENGTH_KINDS),
       arrivals=st.sampled_from(ARRIVAL_KINDS))
def test_common_random_numbers(tmp_path: Path, rates, data, seed, kind, arrivals) -> None:
    """Adapter i's requests depend only on (seed, i, its rate): other rates and extra adapters do not matter."""
    lengths = _lengths(kind, tmp_path)
    i = data.draw(st.integers(0, len(rates) - 1), label="i")
    j = data.draw(st.integers(0, len(rates) - 1).filter(lambda x: x != i), label="j")
    new_rate = data.draw(st.floats(0.0, 3.0), label="new_rate_j")
    base = generate_requests(_workload(rates, lengths=lengths, arrivals=arrivals), 200.0, seed)
    rates2 = list(rates)
    rates2[j] = new_rate
    changed = generate_requests(_workload(rates2, lengths=lengths, arrivals=arrivals), 200.0, seed)
    appended = generate_requests(_workload(rates + [2.0, 0.5], lengths=lengths, arrivals=arrivals), 200.0, seed)
    ref = _adapter_view(base, i)
    for other in (changed, appended):
        got = _adapter_view(other, i)
        for x, y in zip(ref, got, strict=True):
            assert np.array_equal(x, y)


@pytest.mark.parametrize("arrivals", [PoissonArrivals(), LognormalArrivals(),
                                      ModulatedArrivals(period_s=100.0, multipliers=[1.0, 0.3, 2.0])],
                         ids=lambda a: a.kind)
def test_longer_window_only_appends(arrivals) -> None:
    w = _workload([0.4, 2.5], arrivals=arrivals)
    short, long = generate_requests(w, 300.0, 5), generate_requests(w, 3000.0, 5)
    keep = long.t_arr_s < 300.0
    assert np.array_equal(short.t_arr_s, long.t_arr_s[keep])  # bit-identical, whatever the block sizes
    assert np.array_equal(short.prompt_tokens, long.prompt_tokens[keep])


def test_streams_are_independent() -> None:
    """Arrivals and lengths of an adapter use different streams (SeedSequence pads with zeros: ids are non-zero)."""
    from lorapack.workload import STREAM_ARRIVALS, STREAM_LENGTHS, STREAM_REGIME, stream_rng

    draws = {s: stream_rng(1, 2, s).random(4).tolist() for s in (STREAM_ARRIVALS, STREAM_LENGTHS, STREAM_REGIME)}
    assert len({tuple(v) for v in draws.values()}) == 3
    assert 0 not in (STREAM_ARRIVALS, STREAM_LENGTHS, STREAM_REGIME)


# ---------------------------------------------------------------------------------------------------------
# generation: statistics


def test_poisson_counts_plausible() -> None:
    rates = np.resize([0.1, 0.5, 2.0], 300)
    w = _workload(rates.tolist(), lengths=LengthsSpec(kind="fixed"))
    duration_s = 3600.0
    req = generate_requests(w, duration_s, seed=1)
    expected = rates.sum() * duration_s
    assert abs(len(req) - expected) < 5 * math.sqrt(expected)
    counts = np.bincount(req.adapter, minlength=len(rates))
    for r in (0.1, 0.5, 2.0):  # per-rate class: mean and Poisson dispersion (variance = mean)
        c = counts[rates == r]
        mu = r * duration_s
        assert abs(c.mean() - mu) < 5 * math.sqrt(mu / len(c))
        assert 0.6 < c.var(ddof=1) / mu < 1.5
    gaps = np.diff(req.t_arr_s[req.adapter == 7])
    assert stats.kstest(gaps, "expon", args=(0, 1 / rates[7])).pvalue > 1e-3


def test_lognormal_arrivals_keep_mean_rate() -> None:
    w = _workload([2.0] * 20, arrivals=LognormalArrivals(sigma=1.0), lengths=LengthsSpec(kind="fixed"))
    req = generate_requests(w, 3600.0, seed=4)
    expected = 2.0 * 3600.0 * 20
    # the renewal count has variance ~ mean * CV^2 with CV^2 = e - 1
    assert abs(len(req) - expected) < 5 * math.sqrt(expected * (math.e - 1))
    gaps = np.diff(req.t_arr_s[req.adapter == 0])
    assert abs(gaps.mean() - 0.5) < 0.03
    assert abs(np.log(gaps).std() - 1.0) < 0.03  # sigma = 1
    assert abs(np.log(gaps).mean() - (-math.log(2.0) - 0.5)) < 0.03  # mu = -ln(rate) - sigma^2 / 2


def test_modulated_arrivals_follow_the_shared_profile() -> None:
    """Every adapter's rate is rate x multipliers[j] in period j, the profile repeating past its end."""
    spec = ModulatedArrivals(period_s=60.0, multipliers=[2.0, 0.0, 1.0])
    rates = [1.5, 0.5, 3.0]
    req = generate_requests(_workload(rates, arrivals=spec, lengths=LengthsSpec(kind="fixed")), 3600.0, seed=2)
    period = (req.t_arr_s // 60.0).astype(int)
    counts = np.bincount(period, minlength=60)
    assert counts[1::3].sum() == 0  # multiplier 0: no arrival, in every repetition of the profile
    total = sum(rates)
    for phase, m in ((0, 2.0), (2, 1.0)):
        expected = total * m * 60.0 * 20  # 20 periods of each phase in the hour
        assert abs(counts[phase::3].sum() - expected) < 5 * math.sqrt(expected)
    assert spec.mean_multiplier == 1.0
    est = estimate_workload(_workload(rates, arrivals=spec), 3600.0)
    assert est.requests == pytest.approx(total * 3600.0)  # x the profile's mean multiplier (1 here)
    est2 = estimate_workload(_workload(rates, arrivals=ModulatedArrivals(multipliers=[3.0])), 3600.0)
    assert est2.requests == pytest.approx(3 * total * 3600.0)


@pytest.mark.parametrize("bad, match", [([], "at least 1"), ([1.0, -0.5], "multiplier 1 is -0.5"),
                                        ([0.0, 0.0], "every multiplier is 0"), ([1.0, math.nan], "multiplier 1"),
                                        ([True, 1.0], "not true/false")])
def test_modulated_arrivals_validation(bad, match) -> None:
    with pytest.raises(ValueError, match=match):
        ModulatedArrivals(multipliers=bad)
    with pytest.raises(ValueError, match="period_s"):
        ModulatedArrivals(period_s=0.0, multipliers=[1.0])


def test_unpredictable_multipliers_within_clip() -> None:
    spec = UnpredictableArrivals(period_s=300.0, factor=2.0, clip=8.0)
    w = _workload([1.0] * 50, arrivals=spec, lengths=LengthsSpec(kind="fixed"))
    m = unpredictable_rate_multipliers(w, 36000.0, seed=2)
    assert m.shape == (50, 120)
    assert np.all(m[:, 0] == 1.0)  # the first period runs at the nominal rate
    assert m.min() >= 1 / 8 and m.max() <= 8
    assert m.min() == 1 / 8 and m.max() == 8  # a 120-step walk reaches both clips
    steps = np.log2(m[:, 1:] / m[:, :-1])
    assert set(np.unique(np.round(steps, 12)).tolist()) <= {-1.0, 0.0, 1.0}  # x2, /2, or held at the clip
    # per period, the arrivals follow the period's multiplier (aggregated over adapters)
    req = generate_requests(w, 36000.0, seed=2)
    counts = np.zeros((50, 120))
    np.add.at(counts, (req.adapter, (req.t_arr_s // 300.0).astype(int)), 1)
    expected = 300.0 * m.sum(axis=0)
    assert np.all(np.abs(counts.sum(axis=0) - expected) < 6 * np.sqrt(3 * expected) + 5)


def test_unpredictable_uses_both_laws() -> None:
    from lorapack.workload.arrivals import unpredictable_multipliers

    u = np.random.default_rng(0).random((1000, 2))
    lognormal, mult = unpredictable_multipliers(u, UnpredictableArrivals(factor=1.5, clip=7.5))
    assert 400 < lognormal.sum() < 600
    assert mult.min() >= 1 / 7.5 - 1e-12 and mult.max() <= 7.5 + 1e-12


# ---------------------------------------------------------------------------------------------------------
# lengths


@pytest.mark.parametrize(("mean_in", "mean_out"), [(223.0, 197.0), (223.0, 196.0), (223.4, 200.0), (100.0, 300.0)])
def test_lognormal_lengths_match_targets(mean_in: float, mean_out: float) -> None:
    model = solve_lognormal_lengths(mean_in, mean_out, 1.1)
    mp, cp, mo, co = model.moments()
    assert mp == pytest.approx(mean_in, rel=1e-6) and mo == pytest.approx(mean_out, rel=1e-6)
    assert cp == pytest.approx(1.1, abs=1e-6) and co == pytest.approx(1.1, abs=1e-6)
    assert solve_lognormal_lengths(mean_in, mean_out, 1.1) is model  # cached
    p, o = sample_lengths(LengthsSpec(kind="lognormal", mean_input_tokens=mean_in, mean_output_tokens=mean_out),
                          400_000, np.random.default_rng(1))
    assert p.mean() == pytest.approx(mean_in, rel=0.01) and o.mean() == pytest.approx(mean_out, rel=0.01)
    assert p.std() / p.mean() == pytest.approx(1.1, abs=0.05) and o.std() / o.mean() == pytest.approx(1.1, abs=0.05)
    assert p.min() >= MIN_TOKENS and o.min() >= MIN_TOKENS
    assert p.max() <= MAX_INPUT_TOKENS and (p + o).max() <= MAX_TOTAL_TOKENS


@FAST
@given(mean_in=st.floats(20, 300), mean_out=st.floats(20, 400), cv=st.floats(0.3, 1.2))
def test_lognormal_solver_property(mean_in: float, mean_out: float, cv: float) -> None:
    try:
        model = solve_lognormal_lengths(mean_in, mean_out, cv)
    except SpecError:
        return  # an unreachable target must say so, never return wrong parameters
    mp, cp, mo, co = model.moments()
    assert mp == pytest.approx(mean_in, rel=1e-5) and mo == pytest.approx(mean_out, rel=1e-5)
    assert cp == pytest.approx(cv, abs=1e-5) and co == pytest.approx(cv, abs=1e-5)


def test_fixed_and_empirical_lengths(tmp_path: Path) -> None:
    p, o = sample_lengths(LengthsSpec(kind="fixed", mean_input_tokens=99.6, mean_output_tokens=10), 5,
                          np.random.default_rng(0))
    assert p.tolist() == [100] * 5 and o.tolist() == [10] * 5
    spec = _lengths("empirical", tmp_path)
    table = {(p_, o_) for p_, o_ in zip(range(10, 200, 7), range(300, 3, -11), strict=False)}
    p, o = sample_lengths(spec, 20_000, np.random.default_rng(0))
    pairs = set(zip(p.tolist(), o.tolist(), strict=True))
    assert pairs == table  # pairs kept together; all rows drawn (with replacement)


# ---------------------------------------------------------------------------------------------------------
# trace replay


def _trace_workload(path: Path, n_adapters: int = 16, **kw) -> Workload:
    return _workload([1.0] * n_adapters, arrivals=TraceArrivals(path=str(path), **kw))


def test_trace_replay_exact(small_trace: Path) -> None:
    trace = load_trace(small_trace)
    w = _trace_workload(small_trace, 16)
    duration_s = float(trace.t_s[1500])
    req = generate_requests(w, duration_s, seed=0)
    n = int(np.searchsorted(trace.t_s, duration_s))
    assert len(req) == n == 1500
    assert np.array_equal(req.t_arr_s, trace.t_s[:n])
    key = np.lexsort((req.output_tokens, req.prompt_tokens, req.t_arr_s))
    ref = np.lexsort((trace.output_tokens[:n], trace.prompt_tokens[:n], trace.t_s[:n]))
    assert np.array_equal(req.prompt_tokens[key], trace.prompt_tokens[:n][ref])
    assert np.array_equal(req.output_tokens[key], trace.output_tokens[:n][ref])
    assert np.bincount(req.adapter, minlength=16).min() >= 1  # one request per adapter at least
    tie = np.flatnonzero(np.diff(req.t_arr_s) == 0)
    assert len(tie) and np.all(req.adapter[tie] <= req.adapter[tie + 1])  # ties in adapter order
    # rates are ignored in trace mode
    w2 = _workload(np.linspace(0, 5, 16).tolist(), arrivals=w.arrivals)
    assert np.array_equal(generate_requests(w2, duration_s, seed=0).adapter, req.adapter)
    assert not np.array_equal(generate_requests(w, duration_s, seed=1).adapter, req.adapter)


def test_trace_start_shift(small_trace: Path) -> None:
    trace = load_trace(small_trace)
    start = float(trace.t_s[500])
    req = generate_requests(_trace_workload(small_trace, start_s=start), 1e6, seed=0)
    assert len(req) == len(trace) - 500
    assert np.array_equal(req.t_arr_s, trace.t_s[500:] - start)


@pytest.mark.parametrize("k", [0.3, 1.0, 2.0, 2.5, 7.25])
def test_trace_load_scale(small_trace: Path, k: float) -> None:
    trace = load_trace(small_trace)
    window = float(trace.t_s[-1]) + 10.0  # beyond the jitter, so only scaling changes the count
    req = generate_requests(_trace_workload(small_trace, 16, load_scale=k), window, seed=3)
    n = len(trace)
    frac = k - math.floor(k)
    assert abs(len(req) - k * n) <= 5 * math.sqrt(n * frac * (1 - frac)) + 1e-9
    assert np.all(np.diff(req.t_arr_s) >= 0) and req.t_arr_s.min() >= 0
    if k >= 1:  # copy 0 is the untouched trace
        assert np.isin(trace.t_s, req.t_arr_s).all()
    if k > 1:  # extra copies are jittered by at most 5 s (and clipped at 0)
        j = np.clip(np.searchsorted(trace.t_s, req.t_arr_s), 1, n - 1)
        nearest = np.minimum(np.abs(req.t_arr_s - trace.t_s[j - 1]), np.abs(req.t_arr_s - trace.t_s[j]))
        assert nearest.max() <= 5.0 + 1e-9


@pytest.mark.parametrize("assignment", ["uniform", "zipf", "dirichlet"])
def test_trace_assignment(small_trace: Path, assignment: str) -> None:
    req = generate_requests(_trace_workload(small_trace, 40, assignment=assignment, zipf_s=1.2), 1e6, seed=9)
    counts = np.bincount(req.adapter, minlength=40)
    assert counts.min() >= 1 and counts.sum() == len(req)
    share = np.sort(counts)[::-1] / counts.sum()
    if assignment == "uniform":
        assert share[0] < 0.06
    elif assignment == "zipf":
        h = np.sum(np.arange(1, 41) ** -1.2)
        assert share[0] == pytest.approx(1 / h, abs=0.05)
    else:
        assert share[0] > 0.06  # Dirichlet(0.5) is far from uniform


def test_zipf_weights_follow_a_random_permutation() -> None:
    from lorapack.workload.trace import assignment_weights

    tops = set()
    for seed in range(5):
        w = assignment_weights(30, "zipf", 1.0, 0.5, np.random.default_rng(seed))
        assert np.allclose(np.sort(w)[::-1], (1 / np.arange(1, 31)) / np.sum(1 / np.arange(1, 31)))
        tops.add(int(np.argmax(w)))
    assert len(tops) > 1  # popularity is not tied to the registration index
    w = assignment_weights(30, "dirichlet", 1.0, 1e-9, np.random.default_rng(0))
    assert np.isfinite(w).all() and w.sum() == pytest.approx(1.0)


def test_trace_fewer_requests_than_adapters(small_trace: Path) -> None:
    trace = load_trace(small_trace)
    req = generate_requests(_trace_workload(small_trace, 64), float(trace.t_s[20]), seed=0)
    assert len(req) == 20 and req.adapter.max() < 64


def test_trace_synthetic_lengths(small_trace: Path) -> None:
    req = generate_requests(_trace_workload(small_trace, 8, trace_lengths=False), 1e6, seed=0)
    assert req.prompt_tokens.max() <= MAX_INPUT_TOKENS and req.prompt_tokens.min() >= MIN_TOKENS
    assert np.array_equal(req.t_arr_s, load_trace(small_trace).t_s)


def test_azure_conv_replay(azure_conv: Path) -> None:
    trace = load_trace(azure_conv)
    assert len(trace) == 19_366
    w = _trace_workload(azure_conv, 384, assignment="dirichlet")
    req = generate_requests(w, 3600.0, seed=1)
    assert len(req) == 19_366
    assert np.array_equal(req.t_arr_s, trace.t_s)
    assert np.bincount(req.adapter, minlength=384).min() >= 1
    assert req.prompt_tokens.sum() == trace.prompt_tokens.sum()
    assert req.output_tokens.sum() == trace.output_tokens.sum()
    scaled = generate_requests(_trace_workload(azure_conv, 384, load_scale=3.5), 3600.0, seed=1)
    assert abs(len(scaled) - 3.5 * 19_366) < 5 * math.sqrt(19_366 * 0.25) + 30  # + requests jittered past the end
    half = generate_requests(_trace_workload(azure_conv, 384, start_s=1800.0), 1800.0, seed=1)
    assert len(half) == 9_258  # data/README.md §5: 9,258 requests after 1,800 s


# ---------------------------------------------------------------------------------------------------------
# speed


@pytest.mark.slow
def test_generation_at_the_largest_scale() -> None:
    """1.3 M Poisson arrivals over 384 adapters: the count (its speed is measured by bench/workload_speed.py,
    not asserted here: no test may depend on the machine being idle)."""
    rate_rps = 1.3e6 / 3600 / 384
    w = _workload([rate_rps] * 384, lengths=LengthsSpec(kind="fixed"))
    req = generate_requests(w, 3600.0, 0)
    assert abs(len(req) - 1.3e6) < 6000


# ---- issue 26 item 8: a rank vLLM cannot serve is a workload error with its file and line ---------------


def test_rank_beyond_what_vllm_serves_names_the_line(tmp_path: Path) -> None:
    from lorapack.server import RULE_SETS
    from lorapack.spec import MAX_LORA_RANK
    from lorapack.workload import load_workload

    assert MAX_LORA_RANK == max(max(r.lora_ranks) for r in RULE_SETS)
    yml = tmp_path / "w.yaml"
    yml.write_text("adapters:\n  - {count: 2, rank: 8, rate_rps: 0.1}\n  - {count: 1, rank: 1000, rate_rps: 0.1}\n")
    with pytest.raises(SpecError, match=r"w\.yaml:3: adapters\[1\]\.rank: expected an integer rank 1 \.\.\. 512"):
        load_workload(yml)
    csv = tmp_path / "w.csv"
    csv.write_text("adapter_id,rank,rate_rps\na,8,0.1\nb,1000,0.1\n")
    with pytest.raises(SpecError, match=r"w\.csv:3: rank: expected an integer rank 1 \.\.\. 512"):
        load_workload(csv)
    csv.write_text("adapter_id,rank,rate_rps\na,512,0.1\n")
    assert load_workload(csv).adapters[0].rank == 512
