"""Twin fidelity on the real calibration runs: in-sample and leave-one-group-out (issue 3, docs/calibration.md, scores).

Usage: python bench/fidelity.py [--data-dir DIR] [--out bench/results/fidelity.json] [--seeds 1] [--no-logo]
       [--model M] [--group GROUP]  (e.g. --group rank_32_rates_0.1_0.05_0.025: that fold only)

* **in-sample**: the shipped profiles (``lorapack/profiles``) on every run of ``real-runs/calibration.csv``,
  rebuilt as ``lorapack validate`` does;
* **leave-one-group-out**: for each model and each of the three rate/rank groups (the middle part of
  ``run_id``), the closed-form priors are re-fitted and the step-time constants refined (exactly as
  ``lorapack calibrate``, with the free constants and group-bias weight the shipped profile records, unless
  ``--free`` / ``--group-weight`` say otherwise) on the runs of the two other groups only, then scored on the
  held-out group. The pooled row scores all held-out predictions together.

Scores: SMAPE of throughput, ITL and TTFT (completed-only mean) in both conventions (``smape_*``: paper
convention, no factor 2; ``smape_*_2x``: usual), starvation agreement overall and on clear runs (real ratio
outside 0.85-0.95) with confusion matrices, OOM agreement. Writes JSON and prints a table.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import math
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

from lorapack import __version__
from lorapack.calibrate import default_data_dir
from lorapack.calibrate.command import (
    DEFAULT_MAX_EVALS,
    DEFAULT_MAX_WALL_S,
    RefinementOptions,
    refine_profile,
    validate_profile,
)
from lorapack.calibrate.priors import CALIBRATION_CSV, fit_priors_from, lora_overhead_points
from lorapack.calibrate.refine import DEFAULT_FREE, FREE_PARAMS, GROUP_BIAS_WEIGHT
from lorapack.profile import Profile, find_profile, load_profile_file
from lorapack.realruns import RunPrediction, read_runs, run_group, score_runs

MODELS = ("llama-3.1-8b-instruct", "qwen-2.5-7b-instruct")
OUT = Path(__file__).resolve().parent / "results" / "fidelity.json"
KEYS = ("smape_throughput", "smape_itl", "smape_ttft", "bias_throughput_pct", "bias_itl_pct", "smape_throughput_2x",
        "smape_itl_2x", "smape_ttft_2x", "starved_agreement", "starved_agreement_clear", "oom_agreement")


def _clean(x):
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_clean(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def _write_rows(path: Path, rows: list[dict]) -> None:
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def fit_settings(prof: Profile) -> tuple[tuple[str, ...], float]:
    """The free constants and the group-bias weight ``prof``'s refinement used (its provenance; calibrate's
    defaults for a profile that does not record them)."""
    ref = prof.provenance.get("refinement") or {}
    free = tuple(ref.get("free") or DEFAULT_FREE)
    return free, float((ref.get("weights") or {}).get("group_bias", GROUP_BIAS_WEIGHT))


def logo(data_dir: Path, model: str, rows: list[dict], seeds: list[int], max_evals: tuple[int, int],
         workers: int, max_wall_s: float = DEFAULT_MAX_WALL_S, only: list[str] | None = None,
         free: tuple[str, ...] = DEFAULT_FREE, group_weight: float = GROUP_BIAS_WEIGHT, api_server: bool = False
         ) -> dict:
    """Leave-one-group-out for one model: refine on two groups, score the third; plus the pooled scores (over
    the held-out groups run: ``only`` restricts them). ``api_server``: fit the API server's loop per fold too
    (``calibrate.apiserver``; as the shipped profile was when it has one)."""
    groups = sorted({run_group(r["run_id"]) for r in rows})
    if only:
        unknown = sorted(set(only) - set(groups))
        if unknown:
            raise SystemExit(f"--group {unknown[0]}: expected one of {', '.join(groups)}")
        groups = [g for g in groups if g in only]
    anchors = lora_overhead_points(data_dir / "profiling", model)
    held: dict[str, dict] = {}
    all_rows: list[dict] = []
    all_preds: list[RunPrediction] = []
    for g in groups:
        train = [r for r in rows if run_group(r["run_id"]) != g]
        test = [r for r in rows if run_group(r["run_id"]) == g]
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:  # priors from the training runs only (no leakage)
            runs_csv = Path(tmp) / "train.csv"
            _write_rows(runs_csv, train)
            prior = fit_priors_from(data_dir / "profiling", runs_csv, model)
        tag = f"  [held out: {g}] "
        refinement = RefinementOptions(seeds=len(seeds), workers=workers, free=free, max_evals=max_evals,
                                       max_wall_s=max_wall_s, group_weight=group_weight, api_server=api_server)
        prof, prov = refine_profile(prior, train, anchors, refinement,
                                    log=lambda s, tag=tag: print(tag + s, file=sys.stderr, flush=True))
        scores, table = validate_profile(prof, test, seeds=seeds, workers=workers)
        scores.pop("by_group", None)
        held[g] = {"train_runs": len(train), "test_runs": len(test), "scores": scores,
                   "refined": {k: v["refined"] for k, v in prov["free"].items()},
                   "ttft_overhead_ms": prov["frontend"]["ttft_overhead_ms"], "converged": prov["converged"],
                   "wall_s": time.perf_counter() - t0}
        # each fold's scores as soon as they exist: a long run cut short still reports its finished folds
        print(f"{tag}done in {held[g]['wall_s']:.0f} s: " + ", ".join(
            f"{k} {scores[k]:.3g}" for k in KEYS if isinstance(scores.get(k), int | float)), file=sys.stderr, flush=True)
        all_rows += test
        all_preds += [t.prediction for t in table]
    return {"held_out": held, "pooled": score_runs(all_rows, all_preds)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--seeds", type=int, default=1, help="seeds per run (metrics averaged)")
    ap.add_argument("--workers", type=int, default=0, help="parallel processes (0 = all cores)")
    ap.add_argument("--max-evals", default=",".join(map(str, DEFAULT_MAX_EVALS)),
                    help="least-squares evaluations of the two refinement stages in leave-one-group-out")
    ap.add_argument("--max-minutes", type=float, default=DEFAULT_MAX_WALL_S / 60,
                    help="wall-time cap of each leave-one-group-out refinement")
    ap.add_argument("--no-logo", action="store_true", help="in-sample scores only")
    ap.add_argument("--model", action="append", choices=MODELS)
    ap.add_argument("--group", action="append", help="leave-one-group-out: hold out only this group (repeatable)")
    ap.add_argument("--free", default=None,
                    help="constants the leave-one-group-out refinement fits (as lorapack calibrate --free; default: "
                         "those the shipped profile of the model was fitted with)")
    ap.add_argument("--group-weight", type=float, default=None,
                    help="weight of each run group's mean throughput error in the leave-one-group-out refinement "
                         "(as lorapack calibrate --group-weight; default: the shipped profile's)")
    ap.add_argument("--profile", type=Path, action="append", default=[],
                    help="score this profile file in-sample instead of the shipped one of its model (repeatable)")
    args = ap.parse_args(argv)
    data_dir = args.data_dir or default_data_dir()
    runs_path = data_dir / CALIBRATION_CSV
    seeds = list(range(args.seeds))
    max_evals = tuple(int(x) for x in args.max_evals.split(","))
    rows_all = read_runs(runs_path)
    free_arg = None if args.free is None else tuple(x.strip() for x in args.free.split(",") if x.strip())
    unknown = [x for x in free_arg or () if x not in FREE_PARAMS]
    if unknown:
        raise SystemExit(f"--free {unknown[0]}: expected names among {', '.join(FREE_PARAMS)}")
    given = {}
    for path in args.profile:
        prof = load_profile_file(path)
        given[prof.model] = prof
    result: dict = {
        "generated": datetime.now(UTC).replace(microsecond=0).isoformat(), "lorapack_version": __version__,
        "runs": CALIBRATION_CSV, "runs_sha256": hashlib.sha256(runs_path.read_bytes()).hexdigest(),
        "seeds": args.seeds, "lengths": "lognormal (each profile's fitted runs_lengths.cv)",
        "logo_max_evals": list(max_evals), "logo_free": {}, "logo_group_weight": {},
        "profiles": {m: str(p) for m, p in zip(given, args.profile, strict=True)},
        "conventions": "smape_*: paper convention 100*mean(|y-yhat|/(|y|+|yhat|)); smape_*_2x: usual (factor 2); "
                       "TTFT: completed-only mean; starved_agreement_clear: runs with real throughput ratio "
                       "outside 0.85-0.95; oom rows are scored on the start-up rule",
        "in_sample": {}, "leave_one_group_out": {}}
    for model in args.model or MODELS:
        rows = [r for r in rows_all if r["model"] == model]
        t0 = time.perf_counter()
        prof = given.get(model) or find_profile(model)
        scores, table = validate_profile(prof, rows, seeds=seeds, workers=args.workers)
        scores["wall_s"] = time.perf_counter() - t0
        scores["profile_date"] = prof.provenance.get("date")
        result["in_sample"][model] = scores
        if not args.no_logo:
            free, group_weight = fit_settings(find_profile(model))  # the folds are refitted as the shipped one was
            free = free_arg or free
            group_weight = group_weight if args.group_weight is None else args.group_weight  # 0 is a valid weight
            result["logo_free"][model], result["logo_group_weight"][model] = list(free), group_weight
            result["leave_one_group_out"][model] = logo(data_dir, model, rows, seeds, max_evals, args.workers,
                                                        args.max_minutes * 60.0, args.group, free,
                                                        group_weight, find_profile(model).api_server is not None)
        del table
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(_clean(result), indent=2) + "\n")
    tmp.replace(args.out)
    _print(result)
    print(f"wrote {args.out}")
    return 0


def _fmt(v) -> str:
    return "-" if v is None or (isinstance(v, float) and not math.isfinite(v)) else f"{v:.3f}"


def _print(result: dict) -> None:
    head = ["model", "scope", "n"] + [k.replace("smape_", "") for k in KEYS] + ["confusion (tp fn fp tn)"]
    print(" | ".join(head))
    for model, s in result["in_sample"].items():
        lines = [("in-sample", s)] + [(f"  {g}", gs) for g, gs in s.get("by_group", {}).items()]
        lg = result["leave_one_group_out"].get(model)
        if lg:
            lines += [("LOGO pooled", lg["pooled"])] + [(f"  LOGO {g}", h["scores"]) for g, h in lg["held_out"].items()]
        for scope, sc in lines:
            c = sc["starvation_confusion"]
            conf = " ".join(str(c[k]) for k in ("real_starved_pred_starved", "real_starved_pred_healthy",
                                                "real_healthy_pred_starved", "real_healthy_pred_healthy"))
            print(" | ".join([model.split("-")[0], scope, str(sc["n_runs"])] + [_fmt(sc[k]) for k in KEYS] + [conf]))
    # issue 27's items: TTFT by load tercile (runs < 1 s), the tails, "TTFT <= T" agreement
    print("model | scope | TTFT median signed error by running-batch tercile (runs < 1 s) | ITL p99 bias (median) | "
          "TTFT p99 SMAPE | TTFT <= 1/2/5/10 s agreement (optimistic share)")
    for model, s in result["in_sample"].items():
        lg = result["leave_one_group_out"].get(model)
        for scope, sc in [("in-sample", s)] + ([("LOGO pooled", lg["pooled"])] if lg else []):
            t = sc.get("ttft_by_load_tercile") or {}
            terc = " / ".join(f"{x['bias_median_pct']:+.1f} % (B {x['running_min']:.1f}-{x['running_max']:.1f}, "
                              f"{x['n']})" for x in t.get("terciles", []))
            agree = ", ".join(f"{a['agreement']:.3f} ({a['optimistic_share']:.3f})"
                              for a in (sc.get("ttft_objective_agreement") or {}).values())
            print(f"{model.split('-')[0]} | {scope} | {terc} | {_fmt(sc.get('bias_itl_p99_median_pct'))} | "
                  f"{_fmt(sc.get('smape_ttft_p99'))} | {agree}")


if __name__ == "__main__":
    sys.exit(main())
