"""Learned oracles: the compiled surrogate ensemble and the shallow trees behind the ``Oracle`` seam."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ..errors import LorapackError, SpecError
from ..oracle import FEATURE_NAMES, GpuCandidate, MemoryRuleOracle, Prediction, features, length_law_problem
from ..profile import Profile
from ..server import ServerConfig
from .modelfile import KINDS, ModelFile, load_model, model_path

SHIPPED_DIR = Path(__file__).resolve().parent.parent / "models"
# lengths are not varied in training: a model answers within this relative distance of its training lengths
LENGTH_TOLERANCE = 0.10
LENGTH_FEATURES = ("mean_input_tokens", "mean_output_tokens")


class LearnedOracle(MemoryRuleOracle):
    """Answers with a model file's compiled trees; the start-up rule first, as every oracle.

    ``throughput_tok_s`` = predicted ratio x the offered tokens; ``starved`` = the classifier's probability;
    ``itl_ms``, ``ttft_s`` from the latency models (NaN if the file has none). Candidates outside the
    training range of any feature are answered but flagged (``in_range`` False, ``out_of_range`` names
    the features). ``learned`` tells placement to let the twin decide where the model gives up on a GPU."""

    learned = True

    def __init__(self, model: ModelFile, profile: Profile, name: str | None = None) -> None:
        self.model = model
        self.profile = profile
        self.name = name or ("surrogate" if model.kind == "surrogate" else "tree")
        self.stale = model.profile.get("profile_hash") != profile.file_hash()
        lo = np.array([model.ranges[f][0] for f in FEATURE_NAMES])
        hi = np.array([model.ranges[f][1] for f in FEATURE_NAMES])
        for f in LENGTH_FEATURES:
            j = FEATURE_NAMES.index(f)
            lo[j] *= 1 - LENGTH_TOLERANCE
            hi[j] *= 1 + LENGTH_TOLERANCE
        tol = 1e-9 * np.maximum(np.abs(lo), np.abs(hi))
        self._lo, self._hi = lo - tol, hi + tol

    def predict_features(self, X: np.ndarray) -> dict[str, np.ndarray]:
        """Raw model outputs for a feature matrix (``FEATURE_NAMES`` order): ``throughput_ratio``,
        ``starved`` probability, ``itl_ms``, ``ttft_s`` (NaN where the file has no model)."""
        X = np.ascontiguousarray(X, dtype=np.float64)
        if X.ndim != 2 or X.shape[1] != len(FEATURE_NAMES) or not np.isfinite(X).all():
            raise SpecError(f"feature matrix of shape {X.shape}: expected finite values, [n, {len(FEATURE_NAMES)}]")
        t = self.model.targets
        nan = np.full(len(X), np.nan)
        return {
            "throughput_ratio": np.maximum(t["throughput"].predict(X), 0.0),
            "starved": np.clip(t["starved"].predict(X), 0.0, 1.0),
            "itl_ms": t["itl"].predict(X) if "itl" in t else nan,
            "ttft_s": t["ttft"].predict(X) / 1000.0 if "ttft" in t else nan,
        }

    def out_of_range(self, X: np.ndarray) -> list[str]:
        """Per row: '' when inside the training range, else the offending features and their range."""
        low, high = X < self._lo, X > self._hi
        bad = np.flatnonzero((low | high).any(axis=1))
        out = [""] * len(X)
        for i in bad:
            parts = []
            for j in np.flatnonzero(low[i] | high[i]):
                f = FEATURE_NAMES[j]
                a, b = self.model.ranges[f]
                parts.append(f"{f}={X[i, j]:g} outside {a:g}..{b:g}")
            out[i] = "; ".join(parts)
        return out

    def _predict_fitting(self, cands: Sequence[GpuCandidate], kv_tokens: Sequence[int]) -> list[Prediction]:
        for c in cands:
            if c.profile.model != self.profile.model or c.profile.gpu != self.profile.gpu:
                raise SpecError(f"candidate for {c.profile.model} on {c.profile.gpu} asked of the {self.name} "
                                f"model of {self.profile.model} on {self.profile.gpu}")
        X = features(cands)
        p = self.predict_features(X)
        # the length law's shape is no feature: a candidate with another law is out of range too
        oor = ["; ".join(x for x in (o, length_law_problem(c)) if x)
               for o, c in zip(self.out_of_range(X), cands, strict=True)]
        inc = X[:, FEATURE_NAMES.index("incoming_expected_tok_s")]
        return [Prediction(fits=True, throughput_tok_s=float(p["throughput_ratio"][i] * inc[i]),
                           incoming_tok_s=float(inc[i]), starved=float(p["starved"][i]),
                           itl_ms=float(p["itl_ms"][i]), ttft_s=float(p["ttft_s"][i]),
                           kv_cache_tokens=int(kv), in_range=not oor[i], out_of_range=oor[i])
                for i, kv in enumerate(kv_tokens)]


_LOADING = {"ms": 0.0}  # wall time this process spent in load_oracle
_MODELS: dict[tuple, ModelFile] = {}  # read model files by (path, size, mtime): read once per process


def loading_ms() -> float:
    """Wall milliseconds this process has spent loading learned models (``load_oracle``: reading and checking
    the file, readying the compiled code its answers run). Placement reports it as ``load_ms``, apart from
    ``placement_ms``: take the difference of two readings around the placement."""
    return _LOADING["ms"]


def _read_model(path: Path) -> ModelFile:
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    mf = _MODELS.get(key)
    if mf is None:
        mf = _MODELS[key] = load_model(path)
    return mf


def warm_up(oracle: LearnedOracle) -> None:
    """Ready the compiled code an answer runs (the feature kernel and every target's tree evaluator): the
    first call of a numba function in a process loads its machine code from the cache and sets numba up
    (~0.2 s), which is loading, not answering."""
    cand = GpuCandidate(profile=oracle.profile, ranks=np.array([8]), rates_rps=np.array([0.1]),
                        server=ServerConfig(max_loras=1))
    oracle.predict_features(features([cand]))


def load_oracle(profile: Profile, kind: str = "surrogate", models_dir: str | Path | None = None) -> LearnedOracle:
    """The learned oracle of ``profile``: ``kind`` "surrogate" (the compiled ensemble, placement method
    ``proposed``) or "tree" (shallow trees, ``proposed-fast``), from ``models_dir`` (None: the models shipped
    with lorapack). A file is read once per process; its compiled code is readied here (``warm_up``), so the
    oracle's first answer costs what the others do. The time spent counts in ``loading_ms()``."""
    t0 = time.perf_counter()
    try:
        oracle = _load_oracle(profile, kind, models_dir)
        warm_up(oracle)
    finally:
        _LOADING["ms"] += (time.perf_counter() - t0) * 1e3
    return oracle


def _load_oracle(profile: Profile, kind: str, models_dir: str | Path | None) -> LearnedOracle:
    if kind not in KINDS:
        raise SpecError(f"oracle kind '{kind}': expected one of {', '.join(KINDS)}")
    base = Path(models_dir) if models_dir is not None else SHIPPED_DIR
    if models_dir is not None and not base.is_dir():
        raise SpecError(f"--models {base}: not a directory")
    path = model_path(base, profile.gpu, profile.model, kind)
    if not path.is_file():
        where = "shipped with lorapack" if models_dir is None else f"in {base}"
        raise LorapackError(f"no {kind} model for {profile.model} on {profile.gpu} {where} (expected {path}); "
                            f"train one with `make models` (lorapack sweep / train / refine) or pass --models DIR")
    mf = _read_model(path)
    if mf.kind != kind or mf.profile.get("model") != profile.model or mf.profile.get("gpu") != profile.gpu:
        raise LorapackError(f"{path}: a {mf.kind} model for {mf.profile.get('model')} on {mf.profile.get('gpu')}; "
                            f"expected a {kind} model for {profile.model} on {profile.gpu}")
    return LearnedOracle(mf, profile)
