"""Learned oracles (issue 8): compiled trees, model files, train / refine / explain, load_oracle, validate."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import numpy as np
import pytest

from lorapack.errors import DataError, LorapackError, SpecError
from lorapack.oracle import FEATURE_NAMES, GpuCandidate, Oracle, features
from lorapack.server import ServerConfig
from lorapack.surrogate import (
    KINDS,
    SHIPPED_DIR,
    FlatForest,
    from_sklearn,
    load_model,
    load_oracle,
    save_model,
)
from lorapack.surrogate.modelfile import model_path
from surrogate_helpers import LLAMA, synthetic_rows, write_sweep

SRC = Path(__file__).resolve().parents[1] / "src" / "lorapack"


# ---- the compiled evaluator ----

def test_flat_forests_reproduce_scikit_learn_exactly() -> None:
    from sklearn.ensemble import (
        HistGradientBoostingClassifier,
        HistGradientBoostingRegressor,
        RandomForestClassifier,
        RandomForestRegressor,
    )
    from sklearn.tree import DecisionTreeRegressor
    from threadpoolctl import threadpool_limits

    threadpool_limits(1)  # OpenMP barriers spin on a busy machine
    rng = np.random.default_rng(0)
    X = rng.random((800, 4)) * [400, 100, 3, 32]
    y = X[:, 0] / 100 + np.sin(X[:, 2]) + 0.01 * X[:, 3]
    yc = y > np.median(y)
    for est in (RandomForestRegressor(15, random_state=0), DecisionTreeRegressor(max_leaf_nodes=32),
                HistGradientBoostingRegressor(max_iter=50)):
        f = from_sklearn(est.fit(X, y), 4)
        assert np.abs(f.predict(X) - est.predict(X)).max() < 1e-9
    for est in (RandomForestClassifier(15, random_state=0), HistGradientBoostingClassifier(max_iter=50)):
        f = from_sklearn(est.fit(X, yc), 4)
        assert np.abs(f.predict(X) - est.predict_proba(X)[:, 1]).max() < 1e-9
    with pytest.raises(DataError, match="cannot export"):
        from sklearn.linear_model import LinearRegression

        from_sklearn(LinearRegression().fit(X, y), 4)


def _compiled(f: FlatForest, X: np.ndarray) -> np.ndarray:
    """The compiled loop's answer, whatever ``predict`` would choose in this process."""
    from lorapack.surrogate.forest import LINKS, _eval

    X = np.ascontiguousarray(X, dtype=np.float64)
    if f.x_float32:
        X = X.astype(np.float32).astype(np.float64)
    out = np.empty(X.shape[0])
    _eval(X, f.feature, f.threshold, f.left, f.right, f.value, f.roots, f.agg == "mean", float(f.base),
          LINKS.index(f.link), out)
    return out


def _numpy(f: FlatForest, X: np.ndarray) -> np.ndarray:
    X = np.ascontiguousarray(X, dtype=np.float64)
    return f._eval_numpy(X.astype(np.float32).astype(np.float64) if f.x_float32 else X)


SHIPPED = sorted((SRC / "models").glob("*/*.npz"))


def test_numpy_walk_is_the_compiled_loop_bit_for_bit() -> None:
    """``predict`` walks small batches in numpy until the compiled loop is readied (``lorapack place
    --no-verify`` never readies it): the same bits for every family, link and shipped model, inside and
    outside the training ranges."""
    from sklearn.ensemble import (
        HistGradientBoostingClassifier,
        HistGradientBoostingRegressor,
        RandomForestRegressor,
    )
    from sklearn.tree import DecisionTreeRegressor
    from threadpoolctl import threadpool_limits

    from lorapack.surrogate.modelfile import load_model

    threadpool_limits(1)
    rng = np.random.default_rng(1)
    X = rng.random((300, 4)) * [400, 100, 3, 32]
    y = X[:, 0] / 100 + np.sin(X[:, 2]) + 0.01 * X[:, 3]
    forests = [from_sklearn(est.fit(X, y), 4) for est in (
        RandomForestRegressor(12, random_state=0), DecisionTreeRegressor(max_leaf_nodes=32),
        HistGradientBoostingRegressor(max_iter=30))]
    forests.append(from_sklearn(HistGradientBoostingClassifier(max_iter=30).fit(X, y > np.median(y)), 4))
    exp_link = from_sklearn(HistGradientBoostingRegressor(max_iter=30).fit(X, np.log1p(y - y.min())), 4)
    exp_link.link = "exp"
    forests.append(exp_link)
    assert {f.link for f in forests} == {"identity", "logistic", "exp"} and {f.agg for f in forests} == {"mean", "sum"}
    Xt = rng.random((97, 4)) * [800, 200, 6, 64] - [200, 50, 1.5, 16]  # beyond the training ranges too
    for f in forests:
        assert np.array_equal(_numpy(f, Xt), _compiled(f, Xt))
        assert _numpy(f, Xt[:0]).shape == (0,)
    assert SHIPPED, "no shipped model to check"
    for path in SHIPPED:
        mf = load_model(path)
        lo = np.array([mf.ranges[n][0] for n in mf.feature_names])
        hi = np.array([mf.ranges[n][1] for n in mf.feature_names])
        Xs = lo + rng.random((64, len(lo))) * (hi - lo) * 1.2 - 0.1 * (hi - lo)
        for name, f in mf.targets.items():
            assert np.array_equal(_numpy(f, Xs), _compiled(f, Xs)), (path.parent.name, path.name, name)


def test_predict_walks_in_numpy_only_within_its_budget(monkeypatch) -> None:
    """A small batch in a process whose loop is not compiled: numpy; past the budget, or once compiled:
    the loop (which then stays)."""
    from lorapack.surrogate import forest
    from lorapack.twin.jitcache import LazyKernel

    f = FlatForest(feature=np.array([0, 0, 0]), threshold=np.array([0.5, 0, 0]), left=np.array([1, -1, -1]),
                   right=np.array([2, -1, -1]), value=np.array([0.0, 1.0, 2.0]), roots=np.array([0]), n_features=1)
    lazy = LazyKernel(forest._eval.py_func, numpy_budget=5, options={})
    monkeypatch.setattr(forest, "_eval", lazy)
    X = np.array([[0.0], [1.0], [0.2]])
    assert f.predict(X).tolist() == [1.0, 2.0, 1.0] and lazy.numpy_work == 3 and not lazy.compiled
    assert f.predict(X).tolist() == [1.0, 2.0, 1.0] and lazy.numpy_work == 3 and lazy.compiled  # 6 > 5
    assert f.predict(X[:1]).tolist() == [1.0] and lazy.numpy_work == 3  # compiled: the loop from now on


@pytest.mark.parametrize("breakage, match", [
    ({"left": [1, -1, 5], "right": [2, -1, -1]}, "one child|out of order|out of range"),
    ({"left": [-1, 0, -1], "right": [-1, 0, -1]}, "one child|out of order"),
    ({"roots": [3]}, "roots"),
    ({"feature": [7, 0, 0]}, "feature"),
    ({"value": [0.0, np.nan, 1.0]}, "non-finite"),
])
def test_flat_forest_refuses_arrays_the_loop_could_run_away_in(breakage, match) -> None:
    good = {"feature": [0, 0, 0], "threshold": [0.5, 0, 0], "left": [1, -1, -1], "right": [2, -1, -1],
            "value": [0.0, 1.0, 2.0], "roots": [0]}
    FlatForest(**{k: np.array(v) for k, v in good.items()}, n_features=2)
    with pytest.raises(DataError, match=match):
        FlatForest(**{k: np.array(v) for k, v in {**good, **breakage}.items()}, n_features=2)


# ---- train -> refine -> explain on synthetic rows ----

@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    from typer.testing import CliRunner

    from lorapack.cli import app

    tmp = tmp_path_factory.mktemp("surrogate")
    data = write_sweep(tmp / "sweep", synthetic_rows(40))
    models = tmp / "models"
    r = CliRunner().invoke(app, ["train", str(data), "--out", str(models), "--families", "hgb,rf,knn", "--quick",
                                 "--json"])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(app, ["refine", str(models), "--json"])
    assert r.exit_code == 0, r.output
    return models


def test_train_writes_models_reports_and_every_family(trained: Path) -> None:
    sub = trained / f"{LLAMA.gpu}__{LLAMA.model}"
    rep = json.loads((sub / "train_report.json").read_text())
    for t in ("throughput", "starved", "itl", "ttft"):
        fams = rep["targets"][t]["families"]
        assert set(fams) == {"hgb", "rf", "knn"} and rep["targets"][t]["chosen"] in ("hgb", "rf")
        assert all(np.isfinite(f["held_out"]["score"]) for f in fams.values())
    assert (sub / "pred_vs_actual.png").stat().st_size > 1000 and "| throughput" in (sub / "train_report.md").read_text()
    mf = load_model(model_path(trained, LLAMA.gpu, LLAMA.model, "surrogate"))
    assert mf.feature_names == FEATURE_NAMES and mf.twin_fingerprint == "f" * 16
    assert mf.target_info["throughput"]["scores"]["held_out"]["score"] < 5.0
    assert mf.target_info["starved"]["scores"]["held_out"]["score"] > 0.8
    tree = load_model(model_path(trained, LLAMA.gpu, LLAMA.model, "tree"))
    assert all(f.n_leaves <= 32 and len(f.roots) == 1 for f in tree.targets.values())
    assert tree.training_data_hash == mf.training_data_hash


def test_model_file_round_trip(trained: Path, tmp_path: Path) -> None:
    for kind in KINDS:
        mf = load_model(model_path(trained, LLAMA.gpu, LLAMA.model, kind))
        again = load_model(save_model(mf, tmp_path / f"{kind}.npz"))
        assert again.header() == mf.header()
        X = features([GpuCandidate(profile=LLAMA, ranks=np.full(n, 16), rates_rps=np.full(n, 0.05),
                                    server=ServerConfig(max_loras=8))
                      for n in (8, 32, 96)])
        for t in mf.targets:
            assert np.array_equal(again.targets[t].predict(X), mf.targets[t].predict(X))


def _run_cli(args: list[str]):
    import subprocess
    import sys

    return subprocess.run([str(Path(sys.executable).parent / "lorapack"), *args], capture_output=True, text=True)


def test_tampered_and_foreign_files_are_refused(trained: Path, tmp_path: Path) -> None:
    import shutil

    bad = tmp_path / "models"
    shutil.copytree(trained, bad)
    tree = model_path(bad, LLAMA.gpu, LLAMA.model, "tree")
    with np.load(tree, allow_pickle=False) as z:
        arrays = {k: z[k].copy() for k in z.files}
    arrays["throughput.value"][0] += 1.0  # change a leaf, keep the header and its checksum
    np.savez_compressed(tree, **arrays)
    with pytest.raises(DataError, match="checksum"):
        load_model(tree)
    r = _run_cli(["explain", str(bad)])
    assert r.returncode == 2 and "checksum" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    # foreign files: text, a plain npz, an npz with a pickled object (never unpickled)
    for content in (b"hello", None, "pickle"):
        if content is None:
            np.savez(tree, a=np.arange(3))
        elif content == "pickle":
            np.savez(tree, a=np.array([{"x": 1}], dtype=object))
        else:
            tree.write_bytes(content)
        with pytest.raises(DataError, match="not a lorapack model file"):
            load_model(tree)
    r = _run_cli(["validate", "/nonexistent.csv", "--engine", "tree", "--models", str(bad)])
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_explain_prints_one_rule_per_leaf(trained: Path) -> None:
    from typer.testing import CliRunner

    from lorapack.cli import app

    r = CliRunner().invoke(app, ["explain", str(trained), "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)[LLAMA.model]
    tree = load_model(model_path(trained, LLAMA.gpu, LLAMA.model, "tree"))
    for t, d in out.items():
        assert len(d["rules"]) == tree.targets[t].n_leaves
        assert all(x.startswith("IF ") and " THEN " in x for x in d["rules"])


def test_train_refuses_rows_of_different_twins(tmp_path: Path) -> None:
    from lorapack.surrogate.dataset import read_datasets

    a = write_sweep(tmp_path / "a", synthetic_rows(10, fingerprint="a" * 16))
    b = write_sweep(tmp_path / "b", synthetic_rows(10, seed=1, fingerprint="b" * 16))
    with pytest.raises(DataError, match="different fingerprints"):
        read_datasets([a, b])
    r = _run_cli(["train", str(a), str(b), "--out", str(tmp_path / "m")])
    assert r.returncode == 2 and "different fingerprints" in r.stderr and not (tmp_path / "m").exists()


# ---- the oracle ----

def test_learned_oracle_answers_and_flags_out_of_range(trained: Path) -> None:
    for kind in KINDS:
        o = load_oracle(LLAMA, kind, trained)
        assert isinstance(o, Oracle) and o.name == kind
        inside = GpuCandidate(profile=LLAMA, ranks=np.full(32, 16), server=ServerConfig(max_loras=16),
                              rates_rps=0.05 * (1 + 0.3 * np.sin(np.arange(32))))
        huge = GpuCandidate(profile=LLAMA, ranks=np.full(300, 8), rates_rps=np.full(300, 0.05),
                            server=ServerConfig(max_loras=16))
        refused = GpuCandidate(profile=LLAMA, ranks=np.full(300, 32), rates_rps=np.full(300, 0.05),
                               server=ServerConfig(max_loras=300))
        p_in, p_out, p_oom = o.predict([inside, huge, refused])
        assert p_in.fits and p_in.in_range and p_in.out_of_range == ""
        assert p_in.throughput_tok_s > 0 and 0 <= p_in.starved <= 1 and p_in.itl_ms > 0 and p_in.ttft_s > 0
        assert not p_out.in_range and "served_adapters=300" in p_out.out_of_range
        assert not p_oom.fits and p_oom.error_type


def test_load_oracle_errors(trained: Path, tmp_path: Path) -> None:
    qwen = __import__("lorapack.profile", fromlist=["x"]).find_profile("qwen-2.5-7b-instruct")
    with pytest.raises(LorapackError, match="no surrogate model for qwen"):
        load_oracle(qwen, "surrogate", trained)
    with pytest.raises(SpecError, match="oracle kind"):
        load_oracle(LLAMA, "forest", trained)
    with pytest.raises(SpecError, match="not a directory"):
        load_oracle(LLAMA, "tree", tmp_path / "nowhere")


def test_validate_with_learned_engines(trained: Path, calibration: Path) -> None:
    data = calibration
    from lorapack.validate import ValidateOptions, run_validation

    for engine in ("surrogate", "tree"):
        rep = run_validation(data, ValidateOptions(engine=engine, models_dir=trained), progress=False)
        m = rep["models"][LLAMA.model]
        assert {"smape_throughput", "starved_agreement", "starved_f1", "n_out_of_range"} <= set(m)
        assert 0 <= m["starved_f1"] <= 1 and m["n_ok"] > 0
        other = rep["models"]["qwen-2.5-7b-instruct"]  # no model for it in this directory: skipped
        assert other["n_skipped"] > 0


# ---- shipped models ----

def _shipped() -> list[Path]:
    return sorted(SHIPPED_DIR.glob("*__*/*.npz"))


def test_shipped_models_match_the_current_twin() -> None:
    """A twin behaviour change (engine, metrics, early stop, generator, profile) needs ``make models``."""
    from lorapack.fingerprint import twin_fingerprint
    from lorapack.profile import available_profiles

    files = _shipped()
    assert files, "no shipped models: run `make models`"
    shipped = {(p.parent.name, p.stem) for p in files}
    for gpu, model, _ in available_profiles():
        for kind in KINDS:
            assert (f"{gpu}__{model}", kind) in shipped, f"no shipped {kind} model for {model}"
    for f in files:
        mf = load_model(f)
        prof = __import__("lorapack.profile", fromlist=["x"]).find_profile(mf.profile["model"], mf.profile["gpu"])
        assert mf.twin_fingerprint == twin_fingerprint(prof), (
            f"{f}: trained on twin {mf.twin_fingerprint}, the current twin is {twin_fingerprint(prof)}; "
            f"the twin's behaviour changed: run `make models`")
    assert sum(f.stat().st_size for f in files) <= 25 * 2**20


DERIVED = ("sum_rate", "std_rate", "max_size", "mean_size", "std_size", "max_rate", "incoming_expected_tok_s")


def test_features_is_the_only_feature_code() -> None:
    """No module but oracle.py computes a spread (std) or writes a derived feature (one computed from the
    adapters, not a flag or an input like N, A, S or the lengths) by its literal name."""
    offenders = []
    for path in SRC.rglob("*.py"):
        if path.name == "oracle.py" and path.parent == SRC:
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in (
                    "std", "pstdev", "nanstd"):
                offenders.append(f"{path.name}:{node.lineno} calls .{node.func.attr}")
            keys = []
            if isinstance(node, ast.Dict):
                keys = node.keys
            elif isinstance(node, ast.Assign):
                keys = [t.slice for t in node.targets if isinstance(t, ast.Subscript)]
            for k in keys:
                if isinstance(k, ast.Constant) and k.value in DERIVED:
                    offenders.append(f"{path.name}:{node.lineno} sets feature '{k.value}'")
    assert not offenders, offenders
    assert set(DERIVED) <= set(FEATURE_NAMES)


def test_each_target_trains_on_the_rows_that_carry_its_label() -> None:
    """Throughput / starved: every simulated row; ITL and TTFT: full runs and healthy early stops only (a
    starved stop's latency still drifts; healthy stops are the light GPUs' only latency labels)."""
    from lorapack.oracle import FEATURE_NAMES
    from lorapack.surrogate.dataset import Dataset

    kinds = np.array(["full", "early_healthy_converged", "early_certain_starved", "early_likely_starved"])
    n = len(kinds)
    cols = {"obtained": kinds, "throughput_tok_s": np.full(n, 900.0), "incoming_expected_tok_s": np.full(n, 1000.0),
            "starved": np.array([False, False, True, True]), "itl_mean_ms": np.full(n, 20.0),
            "ttft_mean_ms": np.full(n, 150.0)}
    ds = Dataset(model="m", gpu="g", X=np.zeros((n, len(FEATURE_NAMES))), cols=cols, sources=[])
    rows = {t: kinds[ds.target(t)[0]].tolist() for t in ("throughput", "starved", "itl", "ttft")}
    assert rows["throughput"] == rows["starved"] == kinds.tolist()
    assert rows["itl"] == rows["ttft"] == ["full", "early_healthy_converged"]
    ok, y = ds.target("ttft")
    assert np.allclose(np.exp(y), 150.0)


def test_the_smaller_family_ships_on_a_near_tie_and_the_better_one_otherwise() -> None:
    """``train._ship``: within ``SHIP_TIE_SHARE`` of the best CV score the model with fewer tree nodes ships first
    (the shipped models are held to 25 MB); a clear win ships first whatever its size (``_within_budget`` may
    still take the smaller one)."""
    from sklearn.ensemble import RandomForestRegressor
    from sklearn.tree import DecisionTreeRegressor

    from lorapack.surrogate.train import SHIP_TIE_SHARE, FamilyResult, _ship

    rng = np.random.default_rng(0)
    X = rng.random((400, len(FEATURE_NAMES)))
    y = X[:, 0] + 0.1 * rng.random(400)
    big = RandomForestRegressor(n_estimators=5, random_state=0).fit(X, y)
    small = RandomForestRegressor(n_estimators=1, max_depth=3, random_state=0).fit(X, y)
    assert isinstance(small.estimators_[0], DecisionTreeRegressor)

    def results(cv_big: float, cv_small: float) -> list[FamilyResult]:
        return [FamilyResult("rf", {}, cv_big, {}, 0.0, big), FamilyResult("hgb", {}, cv_small, {}, 0.0, small)]

    near = 2.0 * (1 + SHIP_TIE_SHARE) - 1e-9
    assert _ship("throughput", results(2.0, near), "identity")[0][0].family == "hgb"
    assert _ship("throughput", results(2.0, 2.0 * (1 + 2 * SHIP_TIE_SHARE)), "identity")[0][0].family == "rf"
    # macro-F1 (greater is better): the tie is measured on the gap to 1
    assert _ship("starved", results(0.90, 0.90 - 0.1 * SHIP_TIE_SHARE + 1e-9), "identity")[0][0].family == "hgb"
    assert _ship("starved", results(0.90, 0.80), "identity")[0][0].family == "rf"
    with pytest.raises(SpecError, match="no exportable"):
        _ship("itl", [], "exp")


def test_a_profile_over_its_node_budget_ships_the_smaller_family_that_costs_least() -> None:
    """``train._within_budget``: while one profile's forests exceed the node budget, the target whose smaller
    family loses the least CV score (relative) switches; nothing smaller left: shipped, and said."""
    from sklearn.ensemble import RandomForestRegressor

    from lorapack.surrogate.train import FamilyResult, _ship, _within_budget

    rng = np.random.default_rng(0)
    X = rng.random((400, len(FEATURE_NAMES)))
    y = X[:, 0] + 0.1 * rng.random(400)
    big = RandomForestRegressor(n_estimators=8, random_state=0).fit(X, y)
    small = RandomForestRegressor(n_estimators=1, max_depth=3, random_state=0).fit(X, y)

    def fams(cv_big: float, cv_small: float) -> list[FamilyResult]:
        return [FamilyResult("rf", {}, cv_big, {}, 0.0, big), FamilyResult("hgb", {}, cv_small, {}, 0.0, small)]

    options = {"throughput": _ship("throughput", fams(2.0, 2.2), "identity"),  # hgb 10 % worse
               "itl": _ship("itl", fams(4.0, 6.0), "exp")}  # hgb 50 % worse
    assert options["throughput"][0][0].family == options["itl"][0][0].family == "rf"
    n_big, n_small = options["itl"][0][1].n_nodes, options["itl"][1][1].n_nodes
    chosen, note = _within_budget(options, 2 * n_big)
    assert {t: r.family for t, (r, _) in chosen.items()} == {"throughput": "rf", "itl": "rf"} and note == ""
    chosen, note = _within_budget(options, n_big + n_small)  # one switch: the cheaper one
    assert {t: r.family for t, (r, _) in chosen.items()} == {"throughput": "hgb", "itl": "rf"}
    assert note.startswith("throughput: hgb") and "instead of rf" in note
    chosen, note = _within_budget(options, n_small)  # both switch, still over: said
    assert {r.family for r, _ in chosen.values()} == {"hgb"} and "no smaller family left" in note
