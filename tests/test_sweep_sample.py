"""Honest samples (issue "Trust the twin", item 7): ``--limit K`` takes whole N-series, ``--estimate`` times a
sample of them and projects the full sweep without writing anything."""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import numpy as np
import pytest

from data_helpers import run_main
from lorapack.sweep import (
    SweepOptions,
    enumerate_configs,
    estimate_sweep,
    group_series,
    load_grid,
    preset_grid,
    select_configs,
    shuffled_series,
    with_overrides,
)
from lorapack.sweep.estimate import generation_s, stratified_total
from sweep_helpers import write_grid

ESTIMATE_KEYS = {"projected_wall_s", "sample_configs", "sample_series", "sample_wall_s", "total_configs",
                 "total_series"}


# ---------------------------------------------------------------------------------------------------------
# --limit: whole series


@pytest.fixture(scope="module")
def paper_series() -> dict[tuple, list[str]]:
    """paper-llama's config ids by series key."""
    every: dict[tuple, list[str]] = {}
    for c in enumerate_configs(preset_grid("paper-llama")):
        every.setdefault(c.series_key, []).append(c.config_id)
    return every


@pytest.mark.parametrize("k", [1, 49, 50, 500, 3000])
def test_limit_selects_whole_series_until_k_configs(paper_series, k):
    every = paper_series
    sel = select_configs(preset_grid("paper-llama"), k)
    series = group_series(sel)
    assert len(sel) >= k
    assert len(sel) - len(series[-1]) < k  # the shortest prefix of series that holds k configs
    for s in series:  # every selected series is complete, N increasing
        assert sorted(c.config_id for c in s) == sorted(every[s[0].series_key])
        assert [c.served_adapters for c in s] == sorted(c.served_adapters for c in s)
    # selection order: series by series (what --resume of a limited sweep relies on)
    assert [c.config_id for s in series for c in s] == [c.config_id for c in sel]


def test_limit_order_is_deterministic_and_seeded():
    g = preset_grid("paper-llama")
    ids = [s[0].series_id for s in shuffled_series(g)]
    assert len(ids) == len(set(ids)) == 120 * 7 * 11
    assert ids == [s[0].series_id for s in shuffled_series(preset_grid("paper-llama"))]
    assert ids != [s[0].series_id for s in group_series(enumerate_configs(g))]  # shuffled
    assert ids[:20] != [s[0].series_id for s in shuffled_series(with_overrides(g, seed=5))][:20]
    # a larger K only adds series
    small, large = select_configs(g, 300), select_configs(g, 900)
    assert [c.config_id for c in large[: len(small)]] == [c.config_id for c in small]


def test_limit_larger_than_the_grid_takes_everything(tmp_path):
    g = load_grid(write_grid(tmp_path))
    assert {c.config_id for c in select_configs(g, 10_000)} == {c.config_id for c in enumerate_configs(g)}


# ---------------------------------------------------------------------------------------------------------
# --estimate: the projection's parts


def test_stratified_total_is_exact_on_a_census_and_unbiased_on_samples():
    rng = np.random.default_rng(0)
    strata = np.repeat(np.arange(4), 250)
    cost = rng.gamma(2.0, 1.0 + strata)  # costs that differ by stratum
    total, se = stratified_total(cost, np.ones(len(cost), dtype=bool), strata)
    assert total == pytest.approx(cost.sum()) and se == 0.0
    errs, ses = [], []
    for _ in range(300):
        sampled = np.zeros(len(cost), dtype=bool)
        sampled[rng.choice(len(cost), 120, replace=False)] = True
        t, s = stratified_total(cost, sampled, strata)
        errs.append(t - cost.sum())
        ses.append(s)
    errs = np.array(errs)
    assert abs(errs.mean()) < 3 * errs.std() / math.sqrt(len(errs))  # no bias
    assert 0.7 < np.mean(ses) / errs.std() < 1.4  # the standard error is the spread
    # a stratum with too few samples is pooled, not dropped
    sampled = np.zeros(len(cost), dtype=bool)
    sampled[:250] = sampled[500:503] = True  # 250 of stratum 0, 3 of stratum 2, none of 1 and 3
    t, _ = stratified_total(cost, sampled, strata)
    assert t == pytest.approx(250 * cost[:250].mean() + 750 * cost[sampled & (strata > 0)].mean())


def test_generation_is_charged_once_per_batch_and_arrival_set():
    # arrival-set keys as work.arrivals_key builds them: (seed, N, rates...); the group drops N
    a, b = (0, 64, (0.1,)), (0, 8, (0.2,))
    sets = {a: [1_000_000.0, 70], b: [2_000.0, 1]}
    one = generation_s(sets, 1e-7, 1.0)
    assert one == pytest.approx((1_000_000 + 2_000) * 1e-7)  # one batch per group: each set once
    two = generation_s(sets, 1e-7, 1.0, {(0, (0.1,)): 2})
    assert two == pytest.approx((2 * 1_000_000 + 2_000) * 1e-7, rel=1e-6)  # set a's group split in two batches
    huge = generation_s({a: [1e8, 3]}, 1e-7, 1.0)
    assert huge == pytest.approx(3 * 1e8 * 1e-7)  # too large for the cache: every config generates it
    assert generation_s(sets, 1e-7, 0.0) == 0.0  # nothing simulated, nothing generated


# ---------------------------------------------------------------------------------------------------------
# --estimate: end to end


def _no_leftovers(monkeypatch, tmp_path: Path) -> Path:
    """A private temporary directory for the estimate (it must be empty afterwards)."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    return scratch


def test_estimate_cli_json_leaves_nothing_behind(tmp_path, monkeypatch, capsys):
    scratch = _no_leftovers(monkeypatch, tmp_path)
    grid = write_grid(tmp_path)
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    code, out, err = run_main(monkeypatch, capsys, "sweep", str(grid), "--estimate", "--estimate-configs", "4",
                          "--workers", "1", "--boundary-seeds", "1", "--out", str(tmp_path / "never"), "--json")
    assert code == 0, err
    est = json.loads(out)
    assert ESTIMATE_KEYS <= set(est)
    assert est["projected_wall_s"] > 0 and est["sample_wall_s"] > 0
    assert (est["total_configs"], est["total_series"]) == (20, 8)
    assert 4 <= est["sample_configs"] < 20 and 1 <= est["sample_series"] < 8
    assert est["boundary_seeds"] == 1 and est["workers"] == 1
    sample = select_configs(load_grid(grid), 4)
    assert est["sample_configs"] == len(sample) and est["sample_series"] == len(group_series(sample))
    assert not (tmp_path / "never").exists()  # --out is neither created nor written
    assert not list(scratch.iterdir()) and not list(work.iterdir())


def test_estimate_text_with_two_workers_and_a_limit(tmp_path, monkeypatch, capsys):
    scratch = _no_leftovers(monkeypatch, tmp_path)
    code, out, err = run_main(monkeypatch, capsys, "sweep", str(write_grid(tmp_path)), "--estimate", "--limit", "12",
                          "--estimate-configs", "5", "--workers", "2")
    assert code == 0, err
    assert "projected wall time" in out and "--limit 12" in out and "Nothing was written" in out
    assert f"for --limit 12: {len(select_configs(load_grid(write_grid(tmp_path)), 12))} configs" in " ".join(out.split())
    assert not list(scratch.iterdir())


def test_estimate_of_the_whole_grid_is_its_own_run(tmp_path, monkeypatch):
    _no_leftovers(monkeypatch, tmp_path)
    g = load_grid(write_grid(tmp_path))
    est = estimate_sweep(g, SweepOptions(workers=1), sample_configs=10_000)
    assert est["sample_configs"] == est["total_configs"] == g.size
    assert est["projected_wall_s_se"] == 0.0
    # a census: the projection is the measured run plus selecting the grid (well under a second here)
    assert est["sample_wall_s"] <= est["projected_wall_s"] < est["sample_wall_s"] + 1.0


@pytest.mark.parametrize(("args", "message"), [
    (("{grid}", "--estimate", "--estimate-configs", "0"), "--estimate-configs 0: expected an integer >= 1"),
    (("{grid}", "--estimate", "--estimate-configs", "-3"), "--estimate-configs -3"),
    (("{grid}", "--out", "{tmp}/x", "--estimate-configs", "5"), "--estimate-configs is only used with --estimate"),
    (("{grid}", "--estimate", "--resume"), "does not combine with --resume"),
    (("{grid}", "--estimate", "--limit", "0"), "--limit 0"),
    (("{grid}", "--estimate", "--workers", "-1"), "--workers -1"),
    (("--preset", "nope", "--estimate"), "unknown preset 'nope'"),
])
def test_estimate_errors_exit_2_with_one_line(tmp_path, monkeypatch, capsys, args, message):
    scratch = _no_leftovers(monkeypatch, tmp_path)
    argv = [a.format(tmp=tmp_path, grid=write_grid(tmp_path)) for a in args]
    code, out, err = run_main(monkeypatch, capsys, "sweep", *argv)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], err
    assert not (tmp_path / "x").exists() and not list(scratch.iterdir())
