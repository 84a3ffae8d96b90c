"""Tree ensembles as flat arrays, evaluated by one numba loop (issue 8, Deliver 6), or by numpy for small batches.

A ``FlatForest`` holds every tree of one model in five node arrays (``feature``, ``threshold``, ``left``,
``right``, ``value``; a leaf has ``left == -1``) plus the root of each tree. A row goes left when
``x[feature] <= threshold``. The raw output is the mean (random forests, single trees) or the sum plus a
baseline (gradient boosting) of the leaf values; ``link`` maps it to the target (identity, exp, logistic).
Random forests and scikit-learn's decision trees compare float32 features (they cast their input), so
``x_float32`` rounds the features first; then the compiled evaluator reproduces ``predict`` exactly.

The numpy walk (``_eval_numpy``) gives the same bits as the compiled loop (leaf values added in tree order,
``math.exp`` for the links, which numba's scalar ``np.exp`` matches); ``predict`` takes it while the
compiled loop has not been readied in this process and the numpy walks stay within ``NUMPY_WALKS``: a
``lorapack place --no-verify`` of 1,280 adapters walks ~70,000 (row, tree) pairs (~30 ms in numpy) and
never sets numba up (0.5-1 s in a fresh process; issue 26, item 5).
``tests/test_surrogate.py::test_numpy_walk_is_the_compiled_loop_bit_for_bit`` checks the two agree bit for
bit on every family, link and shipped model.

Export: ``from_sklearn(estimator)`` for ``RandomForestRegressor/Classifier``, ``DecisionTreeRegressor/
Classifier`` and ``HistGradientBoostingRegressor/Classifier`` (binary); anything else raises.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..errors import DataError
from ..twin.jitcache import lazy_njit

LINKS = ("identity", "exp", "logistic")
AGGS = ("mean", "sum")
ARRAYS = ("feature", "threshold", "left", "right", "value", "roots")
# (row, tree) walks per process the numpy walk takes before the compiled loop is readied: numpy walks one in
# ~0.4 us, the loop in ~0.1 us once numba is set up (0.5-1 s), so ~2 M walks cost about that set-up
NUMPY_WALKS = 2_000_000


@lazy_njit(numpy_budget=NUMPY_WALKS)
def _eval(X, feature, threshold, left, right, value, roots, mean_agg, base, link, out):
    """Trees outer, rows inner: one tree's nodes stay in cache while every row walks it (a batch of 1,000
    rows is ~3x faster than rows outer). Per row the leaf values are added in tree order either way."""
    n = X.shape[0]
    n_trees = roots.shape[0]
    for i in range(n):
        out[i] = 0.0
    for t in range(n_trees):
        root = roots[t]
        for i in range(n):
            k = root
            while left[k] >= 0:
                # preorder layout: the left child is the next node; a select, not a branch the CPU mispredicts
                k = right[k] if X[i, feature[k]] > threshold[k] else k + 1
            out[i] += value[k]
    for i in range(n):
        acc = out[i]
        if mean_agg:
            acc = acc / n_trees
        acc += base
        if link == 1:
            acc = np.exp(acc)
        elif link == 2:
            acc = 1.0 / (1.0 + np.exp(-acc))
        out[i] = acc


def _exp(v: float) -> float:
    """``math.exp`` with numba's (and numpy's) overflow: inf, not an error."""
    try:
        return math.exp(v)
    except OverflowError:
        return math.inf


@dataclass
class FlatForest:
    """One exported tree model (see the module docstring)."""

    feature: np.ndarray  # int32 [nodes]
    threshold: np.ndarray  # float64 [nodes]
    left: np.ndarray  # int32 [nodes], -1 at leaves
    right: np.ndarray  # int32 [nodes]
    value: np.ndarray  # float64 [nodes] (leaf values; internal nodes unused)
    roots: np.ndarray  # int32 [trees]
    agg: str = "mean"
    base: float = 0.0
    link: str = "identity"
    x_float32: bool = False
    n_features: int = 0

    def __post_init__(self) -> None:
        self.feature = np.ascontiguousarray(self.feature, dtype=np.int32)
        self.threshold = np.ascontiguousarray(self.threshold, dtype=np.float64)
        self.left = np.ascontiguousarray(self.left, dtype=np.int32)
        self.right = np.ascontiguousarray(self.right, dtype=np.int32)
        self.value = np.ascontiguousarray(self.value, dtype=np.float64)
        self.roots = np.ascontiguousarray(self.roots, dtype=np.int32)
        self.validate()

    def validate(self) -> None:
        """Refuse arrays the compiled loop could walk out of (or loop forever in)."""
        n = len(self.feature)
        if not (len(self.threshold) == len(self.left) == len(self.right) == len(self.value) == n) or n == 0:
            raise DataError("tree arrays of unequal length or empty")
        if len(self.roots) == 0 or self.roots.min() < 0 or self.roots.max() >= n:
            raise DataError("tree roots outside the node arrays")
        if self.agg not in AGGS or self.link not in LINKS:
            raise DataError(f"unknown aggregation '{self.agg}' or link '{self.link}'")
        # elementwise masks, no gathers: a million nodes are checked in a few ms (part of every model load)
        inner = self.left >= 0
        leaf = ~inner
        if (inner & (self.right < 0)).any() or (leaf & (self.left != -1)).any():
            raise DataError("tree nodes with one child")
        # preorder (every exporter numbers nodes so): the left child is the next node, the right one further on;
        # walks end and indices stay in range, and the evaluator takes k + 1 for the left child
        nxt = np.arange(1, n + 1, dtype=np.int64)
        if (inner & ((self.left != nxt) | (self.right <= nxt))).any() or \
                (self.left.max() >= n) or (self.right.max() >= n):
            raise DataError("tree children out of order or out of range")
        if (inner & (self.feature < 0)).any() or (self.n_features and (inner & (self.feature >= self.n_features)).any()):
            raise DataError("tree split on a feature outside the feature vector")
        if (leaf & ~np.isfinite(self.value)).any() or (inner & ~np.isfinite(self.threshold)).any() \
                or not np.isfinite(self.base):
            raise DataError("non-finite tree values or thresholds")

    @property
    def n_nodes(self) -> int:
        return len(self.feature)

    @property
    def n_leaves(self) -> int:
        return int((self.left < 0).sum())

    def predict(self, X: np.ndarray) -> np.ndarray:
        X = np.ascontiguousarray(X, dtype=np.float64)
        if X.ndim != 2 or (self.n_features and X.shape[1] != self.n_features):
            raise DataError(f"feature matrix of shape {X.shape}; expected [n, {self.n_features}]")
        if self.x_float32:  # the features as the sklearn model compared them
            X = X.astype(np.float32).astype(np.float64)
        if _eval.prefer_numpy(X.shape[0] * len(self.roots)):
            return self._eval_numpy(X)
        out = np.empty(X.shape[0])
        _eval(X, self.feature, self.threshold, self.left, self.right, self.value, self.roots,
              self.agg == "mean", float(self.base), LINKS.index(self.link), out)
        return out

    def _eval_numpy(self, X: np.ndarray) -> np.ndarray:
        """``_eval`` in numpy: every (row, tree) walker steps down one level per pass, the finished ones
        dropped; then the leaf values summed in tree order (``cumsum`` adds sequentially, as the loop)."""
        n, n_trees = X.shape[0], len(self.roots)
        node = np.tile(self.roots.astype(np.intp), n)  # walker (row i, tree t) at i * n_trees + t
        row = np.repeat(np.arange(n), n_trees)
        walking = np.flatnonzero(self.left[node] >= 0)
        while walking.size:
            k = node[walking]
            k = np.where(X[row[walking], self.feature[k]] > self.threshold[k], self.right[k], k + 1)
            node[walking] = k
            walking = walking[self.left[k] >= 0]
        raw = np.cumsum(self.value[node].reshape(n, n_trees), axis=1)[:, -1] if n else np.zeros(0)
        if self.agg == "mean":
            raw = raw / n_trees
        raw = raw + float(self.base)
        if self.link == "exp":
            return np.array([_exp(v) for v in raw.tolist()], dtype=np.float64)
        if self.link == "logistic":
            return np.array([1.0 / (1.0 + _exp(-v)) for v in raw.tolist()], dtype=np.float64)
        return raw

    # ---- persistence (plain arrays + a small dict; no pickle) ----
    def arrays(self, prefix: str) -> dict[str, np.ndarray]:
        return {f"{prefix}.{k}": getattr(self, k) for k in ARRAYS}

    def header(self) -> dict:
        return {"agg": self.agg, "base": float(self.base), "link": self.link, "x_float32": bool(self.x_float32),
                "n_features": int(self.n_features), "n_nodes": self.n_nodes, "n_trees": int(len(self.roots)),
                "n_leaves": self.n_leaves}

    @classmethod
    def from_arrays(cls, prefix: str, arrays, header: dict) -> FlatForest:
        try:
            parts = {k: np.asarray(arrays[f"{prefix}.{k}"]) for k in ARRAYS}
            return cls(**parts, agg=str(header["agg"]), base=float(header["base"]), link=str(header["link"]),
                       x_float32=bool(header["x_float32"]), n_features=int(header["n_features"]))
        except KeyError as e:
            raise DataError(f"model arrays for '{prefix}' incomplete (missing {e})") from None


def _preorder(f: np.ndarray, t: np.ndarray, lft: np.ndarray, rgt: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, ...]:
    """One tree renumbered in preorder from node 0 (best-first builders number nodes in creation order): the
    left child of node k becomes k + 1, which the evaluator relies on."""
    order: list[int] = []
    stack = [0]
    while stack:
        k = stack.pop()
        order.append(k)
        if lft[k] >= 0:
            stack.append(int(rgt[k]))
            stack.append(int(lft[k]))
    old = np.asarray(order, dtype=np.int64)
    new_of = np.full(len(f), -1, dtype=np.int64)
    new_of[old] = np.arange(len(old))
    leaf = lft[old] < 0
    return (f[old], t[old], np.where(leaf, -1, new_of[np.maximum(lft[old], 0)]),
            np.where(leaf, -1, new_of[np.maximum(rgt[old], 0)]), v[old])


def _concat(trees: list[tuple[np.ndarray, ...]]) -> tuple[np.ndarray, ...]:
    """Concatenate per-tree (feature, threshold, left, right, value), each in preorder, child indices offset."""
    feats, thrs, lefts, rights, vals, roots = [], [], [], [], [], []
    off = 0
    for tree in trees:
        f, t, lft, rgt, v = _preorder(*(np.asarray(a) for a in tree))
        roots.append(off)
        feats.append(f)
        thrs.append(t)
        lefts.append(np.where(lft >= 0, lft + off, -1))
        rights.append(np.where(rgt >= 0, rgt + off, -1))
        vals.append(v)
        off += len(f)
    return (np.concatenate(feats), np.concatenate(thrs), np.concatenate(lefts), np.concatenate(rights),
            np.concatenate(vals), np.array(roots))


def _sk_tree(tree, classifier: bool) -> tuple[np.ndarray, ...]:
    t = tree.tree_
    left = t.children_left.astype(np.int64)
    leaf = left < 0
    if classifier:
        v = t.value[:, 0, :]
        tot = v.sum(axis=1)
        val = np.where(tot > 0, v[:, -1] / np.where(tot > 0, tot, 1.0), 0.0)  # P(last class = True)
    else:
        val = t.value[:, 0, 0]
    feat = np.where(leaf, 0, t.feature)
    thr = np.where(leaf, 0.0, t.threshold)
    return feat, thr, np.where(leaf, -1, left), np.where(leaf, -1, t.children_right), val


def _hgb_tree(pred) -> tuple[np.ndarray, ...]:
    nodes = pred.nodes
    leaf = nodes["is_leaf"].astype(bool)
    if (nodes["is_categorical"][~leaf] != 0).any():
        raise DataError("categorical splits are not supported by the flat evaluator")
    feat = np.where(leaf, 0, nodes["feature_idx"])
    thr = np.where(leaf, 0.0, nodes["num_threshold"])
    left = np.where(leaf, -1, nodes["left"].astype(np.int64))
    right = np.where(leaf, -1, nodes["right"].astype(np.int64))
    return feat, thr, left, right, nodes["value"].astype(np.float64)


def from_sklearn(est, n_features: int, link: str = "identity") -> FlatForest:
    """Export a fitted scikit-learn tree model (see the module docstring). ``link`` applies to regressors
    (e.g. ``exp`` for a model of a log target); classifiers give P(True)."""
    from sklearn.ensemble import (
        HistGradientBoostingClassifier,
        HistGradientBoostingRegressor,
        RandomForestClassifier,
        RandomForestRegressor,
    )
    from sklearn.tree import DecisionTreeClassifier, DecisionTreeRegressor

    if hasattr(est, "steps"):  # a Pipeline: only a bare tree model can be exported
        est = est.steps[-1][1]
    if isinstance(est, RandomForestRegressor | RandomForestClassifier | DecisionTreeRegressor | DecisionTreeClassifier):
        clf = isinstance(est, RandomForestClassifier | DecisionTreeClassifier)
        if clf and list(est.classes_) != [False, True] and list(est.classes_) != [0, 1]:
            raise DataError(f"classifier with classes {list(est.classes_)}; expected a binary False/True label")
        trees = est.estimators_ if hasattr(est, "estimators_") else [est]
        arr = _concat([_sk_tree(t, clf) for t in trees])
        return FlatForest(*arr, agg="mean", base=0.0, link="identity" if clf else link, x_float32=True,
                          n_features=n_features)
    if isinstance(est, HistGradientBoostingRegressor | HistGradientBoostingClassifier):
        clf = isinstance(est, HistGradientBoostingClassifier)
        if clf and len(est.classes_) != 2:
            raise DataError("only binary gradient-boosting classifiers are supported")
        arr = _concat([_hgb_tree(it[0]) for it in est._predictors])
        base = float(np.ravel(est._baseline_prediction)[0])
        return FlatForest(*arr, agg="sum", base=base, link="logistic" if clf else link, x_float32=False,
                          n_features=n_features)
    raise DataError(f"cannot export a {type(est).__name__}: only random forests, decision trees and histogram "
                    f"gradient boosting are compiled")
