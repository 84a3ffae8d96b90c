"""``refine``: shallow decision trees (<= 32 leaves) from the training rows of a surrogate, and their rules.

Per target a ``DecisionTreeRegressor/Classifier(max_leaf_nodes=L, min_samples_leaf=...)`` is fitted on the
training split of the surrogate (same rows, same split, so held-out scores stay honest) for
``L`` in ``LEAF_STEPS`` up to ``max_leaves``, on the labels themselves and distilled from the surrogate's
predictions. A validation split of the training series picks the candidate; the complexity penalty keeps the
smallest tree whose validation score is within ``tolerance`` of the best. Sibling leaves of a classifier that
predict the same class are merged. The trees are compiled by the same evaluator as the ensembles.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from ..errors import DataError, SpecError
from ..oracle import FEATURE_NAMES
from .dataset import TRANSFORMS, Dataset
from .forest import FlatForest
from .modelfile import TARGETS, ModelFile
from .train import _to_raw, evaluate, group_split, score

LEAF_STEPS = (4, 8, 12, 16, 24, 32)


@dataclass
class RefineOptions:
    max_leaves: int = 32
    min_samples_leaf: int = 10
    tolerance: float = 0.05  # relative (SMAPE) / absolute x 0.1 (F1) slack for a smaller tree

    def __post_init__(self) -> None:
        if not 2 <= self.max_leaves <= 256:
            raise SpecError(f"--max-leaves {self.max_leaves}: expected 2-256")
        if self.min_samples_leaf < 1:
            raise SpecError(f"--min-samples-leaf {self.min_samples_leaf}: expected an integer >= 1")


def _flat_tree(tree, classifier: bool, link: str, merge: bool) -> FlatForest:
    """Export one fitted sklearn tree in preorder, merging same-class sibling leaves (classifier)."""
    t = tree.tree_
    if classifier:
        v = t.value[:, 0, :]
        tot = v.sum(axis=1)
        val = np.where(tot > 0, v[:, -1] / np.where(tot > 0, tot, 1.0), 0.0)
    else:
        val = t.value[:, 0, 0].copy()
    w = t.weighted_n_node_samples
    left, right = t.children_left.copy(), t.children_right.copy()
    if merge and classifier:
        changed = True
        while changed:  # bottom-up until no pair of leaf siblings agrees
            changed = False
            for k in range(len(left)):
                a, b = left[k], right[k]
                if a >= 0 and left[a] < 0 and left[b] < 0 and (val[a] >= 0.5) == (val[b] >= 0.5):
                    val[k] = (val[a] * w[a] + val[b] * w[b]) / (w[a] + w[b])
                    left[k] = right[k] = -1
                    changed = True
    feat, thr, lo, hi, vals = [], [], [], [], []

    def walk(k: int) -> int:
        me = len(feat)
        feat.append(0)
        thr.append(0.0)
        lo.append(-1)
        hi.append(-1)
        vals.append(float(val[k]))
        if left[k] >= 0:
            feat[me] = int(t.feature[k])
            thr[me] = float(t.threshold[k])
            lo[me] = walk(left[k])
            hi[me] = walk(right[k])
        return me

    walk(0)
    return FlatForest(np.array(feat), np.array(thr), np.array(lo), np.array(hi), np.array(vals), np.array([0]),
                      agg="mean", base=0.0, link="identity" if classifier else link, x_float32=True,
                      n_features=len(FEATURE_NAMES))


def refine_profile(mf: ModelFile, ds: Dataset, opts: RefineOptions) -> tuple[ModelFile, dict]:
    """Shallow trees for every target of ``mf`` (trained on ``ds``); returns the tree model file and a report."""
    from sklearn.tree import DecisionTreeClassifier, DecisionTreeRegressor

    if ds.data_hash() != mf.training_data_hash:
        raise DataError(f"the rows given for {ds.model} are not the surrogate's training rows (data hash "
                        f"{ds.data_hash()} vs {mf.training_data_hash}); pass the same sweep directories")
    t_start = time.perf_counter()
    seed = int(mf.extra.get("seed", 0))
    test = group_split(ds.cols["series_id"], float(mf.extra.get("test_fraction", 0.2)), seed)
    ratio_all = ds.cols["throughput_tok_s"] / np.where(ds.cols["incoming_expected_tok_s"] > 0,
                                                       ds.cols["incoming_expected_tok_s"], np.nan)
    trees, info, rep = {}, {}, {}
    for target in TARGETS:
        if target not in mf.targets:
            continue
        ok, y = ds.target(target)
        X, g, te, ratio = ds.X[ok], ds.cols["series_id"][ok], test[ok], ratio_all[ok]
        tr = ~te
        val = group_split(g, 0.25, seed + 1) & tr
        fit = tr & ~val
        clf = target == "starved"
        surrogate = mf.targets[target].predict(X)
        teacher = {"labels": y, "distilled": _to_raw(target, surrogate)}
        best = None
        tried = []
        for leaves in [s for s in LEAF_STEPS if s <= opts.max_leaves] + (
                [opts.max_leaves] if opts.max_leaves not in LEAF_STEPS else []):
            for src, yy in teacher.items():
                if clf:
                    m = DecisionTreeClassifier(max_leaf_nodes=leaves, min_samples_leaf=opts.min_samples_leaf,
                                               random_state=seed)
                    m.fit(X[fit], yy[fit] >= 0.5)
                    p = m.predict_proba(X[val])[:, -1] if m.n_classes_ == 2 else m.predict(X[val]).astype(float)
                else:
                    m = DecisionTreeRegressor(max_leaf_nodes=leaves, min_samples_leaf=opts.min_samples_leaf,
                                              random_state=seed)
                    m.fit(X[fit], yy[fit])
                    p = m.predict(X[val])
                s = score(target, y[val], p)
                tried.append({"leaves": leaves, "teacher": src, "validation": s})
        key = (lambda r: -r["validation"]) if clf else (lambda r: r["validation"])
        top = min(tried, key=key)
        slack = opts.tolerance * 0.1 if clf else opts.tolerance * top["validation"]
        good = [r for r in tried if (r["validation"] >= top["validation"] - slack if clf
                                     else r["validation"] <= top["validation"] + slack)]
        best = min(good, key=lambda r: (r["leaves"], key(r)))
        Cls = DecisionTreeClassifier if clf else DecisionTreeRegressor
        m = Cls(max_leaf_nodes=best["leaves"], min_samples_leaf=opts.min_samples_leaf, random_state=seed)
        yy = teacher[best["teacher"]]
        m.fit(X[tr], (yy[tr] >= 0.5) if clf else yy[tr])
        if clf and m.n_classes_ != 2:
            raise DataError(f"{ds.model}: the starvation label has one class only in the training rows")
        flat = _flat_tree(m, clf, "exp" if TRANSFORMS[target] == "log_ms" else "identity", merge=True)
        trees[target] = flat
        scores = {"held_out": evaluate(target, y[te], _to_raw(target, flat.predict(X[te])), ratio[te])}
        info[target] = {**mf.target_info[target], "family": "decision_tree", "teacher": best["teacher"],
                        "params": {"max_leaf_nodes": best["leaves"], "min_samples_leaf": opts.min_samples_leaf},
                        "leaves": flat.n_leaves, "scores": scores}
        rep[target] = {"chosen": best, "leaves": flat.n_leaves, "tried": tried, "scores": scores}
    out = ModelFile(kind="tree", profile=mf.profile, twin_fingerprint=mf.twin_fingerprint,
                    training_data_hash=mf.training_data_hash, ranges=mf.ranges, targets=trees, target_info=info,
                    extra={**mf.extra, "refine_s": time.perf_counter() - t_start,
                           "refine_options": {"max_leaves": opts.max_leaves,
                                              "min_samples_leaf": opts.min_samples_leaf,
                                              "tolerance": opts.tolerance}})
    return out, {"model": ds.model, "gpu": ds.gpu, "targets": rep}


def score_extra(mf: ModelFile, name: str, ds: Dataset) -> None:
    """Add scores on another labelled set (e.g. placement-like candidates) to every target of ``mf``."""
    ratio_all = ds.cols["throughput_tok_s"] / np.where(ds.cols["incoming_expected_tok_s"] > 0,
                                                       ds.cols["incoming_expected_tok_s"], np.nan)
    for target, flat in mf.targets.items():
        ok, y = ds.target(target)
        if ok.any():
            mf.target_info[target]["scores"][name] = evaluate(target, y, _to_raw(target, flat.predict(ds.X[ok])),
                                                              ratio_all[ok])


# ---- explain ----
UNITS = {"throughput": "throughput = {v:.3f} x offered tokens", "starved": "{c} (p = {v:.2f})",
         "itl": "ITL {v:.1f} ms", "ttft": "TTFT {v:.0f} ms"}


def rules(flat: FlatForest, target: str) -> list[str]:
    """The tree as IF ... THEN ... lines (one per leaf), with each feature's tightest bounds."""
    if len(flat.roots) != 1:
        raise DataError(f"{target}: {len(flat.roots)} trees; rules exist for single trees only")
    out: list[str] = []

    def fmt_bounds(b: dict[int, list[float]]) -> str:
        parts = []
        for j in sorted(b):
            lo, hi = b[j]
            name = FEATURE_NAMES[j]
            if lo > -np.inf and hi < np.inf:
                parts.append(f"{lo:.4g} < {name} <= {hi:.4g}")
            elif hi < np.inf:
                parts.append(f"{name} <= {hi:.4g}")
            else:
                parts.append(f"{name} > {lo:.4g}")
        return " AND ".join(parts) if parts else "always"

    def value_text(v: float) -> str:
        if flat.link == "exp":
            v = float(np.exp(v))
        if target == "starved":
            return UNITS[target].format(c="STARVED" if v >= 0.5 else "serves", v=v)
        return UNITS[target].format(v=v)

    def walk(k: int, b: dict[int, list[float]]) -> None:
        if flat.left[k] < 0:
            out.append(f"IF {fmt_bounds(b)} THEN {value_text(float(flat.value[k]))}")
            return
        j, t = int(flat.feature[k]), float(flat.threshold[k])
        lb = {**b, j: [b.get(j, [-np.inf, np.inf])[0], min(b.get(j, [-np.inf, np.inf])[1], t)]}
        rb = {**b, j: [max(b.get(j, [-np.inf, np.inf])[0], t), b.get(j, [-np.inf, np.inf])[1]]}
        walk(int(flat.left[k]), lb)
        walk(int(flat.right[k]), rb)

    walk(int(flat.roots[0]), {})
    return out
