"""Learned feasibility oracles (issue 8): training, compiled tree ensembles, shallow trees.

API::

    from lorapack.surrogate import load_oracle
    oracle = load_oracle(profile, "surrogate")      # or "tree"; models_dir=None -> the shipped models
    preds = oracle.predict([GpuCandidate(...), ...])

Pipeline (``make models``): ``lorapack sweep`` -> ``lorapack train`` (this package's ``train``) ->
``lorapack refine`` (``refine``); ``lorapack explain`` prints the shallow trees' rules.
"""

from __future__ import annotations

from .forest import FlatForest, from_sklearn
from .modelfile import KINDS, TARGETS, ModelFile, load_model, model_path, save_model
from .oracle import SHIPPED_DIR, LearnedOracle, load_oracle

__all__ = ["KINDS", "SHIPPED_DIR", "TARGETS", "FlatForest", "LearnedOracle", "ModelFile", "from_sklearn",
           "load_model", "load_oracle", "model_path", "save_model"]
