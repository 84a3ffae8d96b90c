"""``lorapack calibrate``: fit a profile from profiling data, refine it against end-to-end runs, report.

1. closed-form priors from the profiling directory (``priors.fit_priors_from``, docs/calibration.md);
2. with ``--runs``: simulation-based refinement of the free step-time constants (``refine.refine``), in two
   stages (every third run, then all runs), each run to convergence under a shared wall-time cap; then the
   API server's TTFT overhead (``profile.frontend``) from the runs without queueing, and a final validation
   on all runs (``realruns.score_runs``);
3. the profile YAML (priors section + refined values + provenance), written atomically, and optionally the
   fit-report plots (``report.write_report``).

Every input problem raises a ``DataError`` (one line, exit code 2 in the CLI) before anything is written.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from .. import __version__
from ..benchjson import BenchOptions, is_bench_json
from ..checks import check_output_dir, check_output_file, check_workers
from ..errors import DataError
from ..profile import FrontendModel, Priors, Profile, save_profile
from ..realruns import (
    GUARD_STRIDE,
    RunComparison,
    breakdown,
    compare_runs,
    guard_subset,
    metrics_poller_s,
    run_group,
    score_runs,
)
from .apiserver import REGISTRY_FIT, fit_api_server
from .priors import fit_priors_from, lora_overhead_points, plain_scalars
from .refine import (
    DEFAULT_FREE,
    FREE_PARAMS,
    GROUP_BIAS_WEIGHT,
    Evaluator,
    FitOptions,
    param_value,
    refine,
    with_values,
)

# measured columns a runs CSV needs for the refinement (besides validate.REQUIRED)
RUNS_MEASURED = ("throughput_tok_s", "itl_mean_ms")
RUNS_OPTIONAL = ("ttft_mean_ms", "throughput_ratio", "starved")
MIN_OK_RUNS = 3
# the refinement's two stages: a search on every SUBSET_STRIDE-th run, then a polish on all runs
SUBSET_STRIDE = 3
# a measured profile: c0, c1 come from the decode ladder; one slot rank (no gamma), the runs' length law known
MEASURED_FREE = ("e0", "e1", "e1p", "e2", "e3", "a3", "p1")
DEFAULT_MAX_EVALS = (40, 20)  # least-squares evaluations of the two stages (each adds a Jacobian)
DEFAULT_MAX_WALL_S = 900.0  # per model, both stages: a tolerance normally ends the fit well before
FRONTEND_MAX_TTFT_MS = 1000.0  # runs whose real mean TTFT is below this one fit the TTFT overhead


def default_profile_name(model: str, gpu: str, vllm_version: str) -> str:
    return f"{gpu}__vllm-{vllm_version}__{model}.yaml"


def _sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def load_runs(path: Path | Sequence[Path], model: str, bench: BenchOptions | None = None,
              log: Callable[[str], None] | None = None) -> list[dict]:
    """The rows of ``model`` in a runs CSV, or in several runs files (CSVs and/or ``vllm bench serve`` result
    JSONs, ``lorapack.benchjson``; ``bench`` holds what those do not record), checked for what the refinement
    needs (DataError otherwise). A JSON run of another model is an error (a CSV's are skipped)."""
    from ..benchjson import check_options_used, read_runs_file, runs_label
    from ..realruns import check_row

    paths = [path] if isinstance(path, str | Path) else list(path)
    label = runs_label(path)
    check_options_used(paths, bench)
    if bench is not None and bench.model is None:
        bench = dataclasses.replace(bench, model=model)
    mine: list[dict] = []
    ok = []
    for p in paths:
        rows = read_runs_file(p, bench, log)
        cols = set(rows[0]) if rows else set()
        missing = [c for c in RUNS_MEASURED if c not in cols]
        if missing:
            raise DataError(f"{p}: missing column(s) {', '.join(missing)}; expected the real-runs schema "
                            f"(shared/data/README.md §4)")
        json_file = is_bench_json(p)
        for line, r in enumerate(rows, start=2):
            where = (r.get("source") or str(p)) if json_file else f"{p}:{line}"
            if (r.get("model") or "").strip() != model:
                if json_file:
                    raise DataError(f"{where}: a run of model {r.get('model')!r}, not of --model {model} (give "
                                    f"--metadata model=KEY if its model_id is not a known Hugging Face id)")
                continue
            check_row(r, where, measured=RUNS_MEASURED, need_counts=True)
            mine.append(r)
            if (r.get("status") or "").strip() == "ok":
                ok.append(r)
    if len(ok) < MIN_OK_RUNS:
        raise DataError(f"{label}: {len(ok)} ok run(s) of {model}, need at least {MIN_OK_RUNS} to refine")
    return mine


def _runs_digest(paths: Sequence[Path]) -> tuple[str, str | dict[str, str]]:
    """The runs files' names and SHA-256 for the provenance: one file as before, several as a mapping."""
    if len(paths) == 1:
        return paths[0].name, _sha256(paths[0])
    return ", ".join(p.name for p in paths), {str(p): _sha256(p) for p in paths}


def _stage_rows(rows: list[dict], stride: int) -> list[dict]:
    """Every ``stride``-th ok run in (group, A, N) order: a cheap but representative search subset."""
    ok = sorted((r for r in rows if (r.get("status") or "").strip() == "ok"),
                key=lambda r: (run_group(r["run_id"]), int(float(r["max_loras"])), int(float(r["n_adapters"])),
                               r["run_id"]))
    return ok[::stride] if len(ok) >= 3 * stride * MIN_OK_RUNS else ok


@dataclass(frozen=True)
class RefinementOptions:
    """How ``calibrate`` refines a profile's step-time constants against end-to-end runs and validates it:
    ``seeds`` simulations per run, the ``lengths`` law the runs are rebuilt with (lognormal|fixed), ``workers``
    processes (0 = all cores); the ``free`` constants; ``max_evals``: the least-squares evaluations of the two
    stages (subset, all runs); ``max_wall_s``: the wall-time cap of both stages together; ``itl_weight``,
    ``group_weight``, ``ttft_weight``: weights of the ITL, group-bias and queueing-TTFT residuals
    (``refine.data_residuals``; the last 0 = none); ``start``: a
    profile whose free constants start the search instead of the priors (which stay the regularisation), e.g.
    the shipped profile when re-fitting after a change of the model. Invalid values raise ``DataError`` naming
    the flag."""

    seeds: int = 1
    lengths: str = "lognormal"
    workers: int = 0
    free: tuple[str, ...] = DEFAULT_FREE
    max_evals: tuple[int, int] = DEFAULT_MAX_EVALS
    max_wall_s: float = DEFAULT_MAX_WALL_S
    itl_weight: float = 1.0
    group_weight: float = GROUP_BIAS_WEIGHT
    ttft_weight: float = 0.0
    start: Profile | None = None
    # fit the API server's loop (``calibrate.apiserver``, docs/trust-under-load.md) instead of the constant TTFT
    # share alone, on runs made under a /metrics poller (``realruns.metrics_poller_s``): ~18 more simulations of
    # every run
    api_server: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "free", tuple(self.free))
        object.__setattr__(self, "max_evals", tuple(self.max_evals))
        if isinstance(self.seeds, bool) or not isinstance(self.seeds, int) or self.seeds < 1:
            raise DataError(f"--seeds {self.seeds}: expected an integer >= 1")
        if self.lengths not in ("fixed", "lognormal"):
            raise DataError(f"--lengths {self.lengths}: expected fixed or lognormal")
        check_workers(self.workers)
        for name, w in (("--itl-weight", self.itl_weight), ("--group-weight", self.group_weight),
                        ("--ttft-weight", self.ttft_weight)):
            if not (isinstance(w, int | float) and w >= 0 and w < float("inf")):
                raise DataError(f"{name} {w}: expected a finite number >= 0")
        bad = [n for n in self.free if n not in FREE_PARAMS]
        if bad:
            raise DataError(f"--free {','.join(bad)}: unknown; expected names among {', '.join(FREE_PARAMS)}")
        ev = self.max_evals
        if len(ev) != 2 or any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in ev):
            raise DataError(f"--max-evals {','.join(map(str, ev))}: expected two integers >= 0, e.g. 40,20")
        w = self.max_wall_s
        if isinstance(w, bool) or not isinstance(w, int | float) or not (math.isfinite(w) and w > 0):
            raise DataError(f"max_wall_s {w}: expected a positive number of seconds (--max-minutes x 60)")
        if self.start is not None and not isinstance(self.start, Profile):
            raise DataError(f"start {self.start!r}: expected a lorapack.profile.Profile")


@dataclass(frozen=True)
class CalibrateOptions:
    """Settings of ``calibrate``: what the profile is of and how it is refined.

    ``model``: the model key (needed for a research profiling directory; for a measurement directory of
    ``lorapack measure``, a new name for the measured model); ``gpu``, ``vllm_version``: recorded in the profile
    (default h100-64gb and 0.8.5; a measurement: its device, and the server's version, which ``vllm_version``
    must match); ``max_model_len``: the server's context limit (models lorapack does not know);
    ``refinement``: ``RefinementOptions`` (default ones: for a measurement directory the default free constants
    are ``MEASURED_FREE``)."""

    model: str | None = None
    gpu: str | None = None
    vllm_version: str | None = None
    max_model_len: int | None = None
    refinement: RefinementOptions = field(default_factory=RefinementOptions)

    def __post_init__(self) -> None:
        if not isinstance(self.refinement, RefinementOptions):
            raise DataError(f"refinement {self.refinement!r}: expected a RefinementOptions")
        mml = self.max_model_len
        if mml is not None and (isinstance(mml, bool) or not isinstance(mml, int) or mml < 1):
            raise DataError(f"--max-model-len {mml}: expected an integer >= 1")


def refine_profile(prior: Profile, rows: list[dict], anchors: Sequence[dict] = (),
                   options: RefinementOptions | None = None,
                   log: Callable[[str], None] | None = None) -> tuple[Profile, dict]:
    """Refine ``prior``'s step-time constants against ``rows`` (one model) as ``options`` says
    (``RefinementOptions``); returns (profile, provenance). ``anchors``: LoRA overhead runs of the profiling
    data (``refine.lora_anchor_residuals``).

    Stage 1 searches on every third run, stage 2 polishes on all runs; each stops at a tolerance, its
    evaluation budget (``max_evals``) or the wall-time cap (``max_wall_s`` for both stages together). The
    provenance says, per stage, how it ended; ``refined`` is False when no constant moved (e.g. a zero
    budget), and the log says so. ``options.start``: a profile whose free constants start the search (default:
    the priors)."""
    options = options or RefinementOptions()
    seeds, lengths, workers, free = list(range(options.seeds)), options.lengths, options.workers, options.free
    max_evals, max_wall_s = options.max_evals, options.max_wall_s
    itl_weight, group_weight = options.itl_weight, options.group_weight
    start = None
    if options.start is not None:
        start = with_values(prior, {n: param_value(n, options.start) for n in free})
    if options.api_server:
        # the step constants are fitted to per-chunk ITL: with an API-server loop merging chunks as the real one did
        # (fitted without it, they absorb the merges; docs/trust-under-load.md): the start's loop, else the
        # registry fit of the research (``apiserver.REGISTRY_FIT``); ``fit_api_server`` refits it afterwards
        loop = options.start.api_server if options.start is not None and options.start.api_server is not None \
            else REGISTRY_FIT
        start = (start if start is not None else prior).model_copy(update={"api_server": loop})
    import time

    model = prior.model
    stages = []
    prof = start if start is not None else prior
    t0 = time.perf_counter()
    moved = False
    for stage, (stride, nfev) in enumerate(((SUBSET_STRIDE, max_evals[0]), (1, max_evals[1])), start=1):
        if nfev <= 0:
            continue
        left = max_wall_s - (time.perf_counter() - t0)
        if left <= 0:
            if log:
                log(f"{model}: refinement stage {stage} skipped: the wall-time cap of {max_wall_s:.0f} s is spent")
            continue
        cap = left / 2 if stage == 1 and max_evals[1] > 0 else left  # stage 1 leaves half for the polish
        sub = _stage_rows(rows, stride)
        if log:
            log(f"{model}: refinement stage {stage}: {len(sub)} runs, up to {nfev} least-squares evaluations "
                f"or {cap / 60:.1f} min")
        with Evaluator(sub, seeds=seeds, lengths=lengths, workers=workers) as ev:
            fit = FitOptions(free=free, itl_weight=itl_weight, group_weight=group_weight,
                             ttft_weight=options.ttft_weight, max_nfev=nfev, max_wall_s=cap)
            res = refine({model: prof}, {model: prior}, sub, ev, fit, anchors={model: anchors}, log=log)[model]
        stages.append({"runs": len(sub), "stride": stride, "max_evaluations": nfev, "evaluations": res.n_evals,
                       "iterations": res.iterations, "converged": res.converged, "wall_s": res.wall_s,
                       "cost_start": res.cost_start, "cost_end": res.cost_end, "status": res.status,
                       "values": res.values})
        if log:
            log(f"{model}: stage {stage} {'converged' if res.converged else 'did NOT converge'} after "
                f"{res.iterations} iterations ({res.wall_s:.0f} s): {res.status}")
        moved = moved or res.moved
        prof = with_values(prof, res.values)
    if not moved and log:
        log(f"warning: {model}: the refinement changed no constant (budget {max_evals}, cap {max_wall_s:.0f} s): "
            f"the profile keeps its starting values")
    # the API server's TTFT share, from these runs simulated with the refined engine constants; runs whose TTFT
    # is the engine's own (lorapack measure with per-request metrics: queued -> first token) hold no API-server
    # time: fitted there, the "share" would only absorb the engine model's queueing error (seen: 2 ms and 74 ms
    # from two measurements of one server)
    if rows and all((r.get("ttft_source") or "") == "engine" for r in rows):
        frontend = FrontendModel(ttft_overhead_ms=0.0)
        p_front = {"method": "0: every run's TTFT is the engine's own (queued -> first token, vLLM's per-request "
                             "metrics), which holds no API-server time", "n_points": 0, "ttft_overhead_ms": 0.0}
    elif options.api_server and any(metrics_poller_s(r) is not None for r in rows):
        api, frontend, p_front = fit_api_server(prof, rows, seeds=seeds, lengths=lengths, workers=workers, log=log)
        prof = prof.model_copy(update={"api_server": api})
    else:
        _s, table = validate_profile(prof.model_copy(update={"frontend": None, "api_server": None}), rows,
                                     seeds=seeds, lengths=lengths, workers=workers)
        frontend, p_front = fit_frontend(table)
        prof = prof.model_copy(update={"api_server": None})
    prof = prof.model_copy(update={"frontend": frontend})
    if log:
        log(f"{model}: API server TTFT overhead {frontend.ttft_overhead_ms:.2f} ms (from {p_front['n_points']} "
            f"runs without queueing)")
    prov = {
        "method": "scipy least_squares (trf, soft_l1, forward-difference Jacobian) of the log errors of throughput "
                  "and ITL over the runs (a 5% error = 1 unit), priors as Gaussian regularisation "
                  f"(residual (value - prior)/sd); stage 1 on every {SUBSET_STRIDE}rd run, stage 2 on all runs; "
                  f"each to convergence (ftol/xtol 1e-3) within {max_wall_s:.0f} s for both",
        "weights": {"itl": itl_weight, "group_bias": group_weight, "queueing_ttft": options.ttft_weight},
        "refined": moved,
        "converged": bool(stages) and all(s["converged"] for s in stages),
        "frontend": p_front,
        "free": {n: {"field": FREE_PARAMS[n].field, "unit": FREE_PARAMS[n].unit, "prior_sd": FREE_PARAMS[n].sd,
                     "prior": param_value(n, prior), "refined": param_value(n, prof)} for n in free},
        "anchors": f"{len(anchors)} LoRA overhead runs of the profiling data (decode-only steps, measured "
                   "overhead = ITL - ITL of the no-LoRA run) as extra residuals",
        "seeds": list(seeds), "lengths": lengths, "stages": stages,
    }
    return prof, plain_scalars(prov)


def validate_profile(prof: Profile, rows: list[dict], *, seeds: Sequence[int] = (0,), lengths: str = "lognormal",
                     workers: int = 0) -> tuple[dict, list[RunComparison]]:
    """Scores and per-run table of ``prof`` on ``rows`` (oom rows are scored on the start-up rule)."""
    with Evaluator(list(rows), seeds=seeds, lengths=lengths, workers=workers) as ev:
        preds = ev({prof.model: prof})
    table = compare_runs(rows, preds)
    scores = score_runs(rows, preds)
    by_group = {}
    for g in sorted({run_group(r["run_id"]) for r in rows}):
        sel = [i for i, r in enumerate(rows) if run_group(r["run_id"]) == g]
        by_group[g] = score_runs([rows[i] for i in sel], [preds[i] for i in sel])
    scores["by_group"] = by_group
    scores["by_max_lora_rank"] = breakdown(rows, preds, "max_lora_rank")
    return scores, table


def fit_frontend(table: Sequence[RunComparison], max_ttft_ms: float = FRONTEND_MAX_TTFT_MS) -> tuple[FrontendModel, dict]:
    """The API server's share of TTFT: the median of real minus twin mean TTFT over the runs without
    queueing (real mean TTFT below ``max_ttft_ms``), where the engine's part is what the twin simulates.
    ``table`` must come from a profile without a frontend overhead."""
    import numpy as np

    d = [c.measured_ttft_ms - c.predicted_ttft_ms for c in table
         if c.scored and c.measured_ttft_ms is not None and c.measured_ttft_ms < max_ttft_ms
         and np.isfinite(c.predicted_ttft_ms)]
    value = max(0.0, float(np.median(d))) if d else 0.0
    return FrontendModel(ttft_overhead_ms=value), {
        "method": f"median of (real - twin) mean TTFT over the runs with real mean TTFT < {max_ttft_ms:.0f} ms "
                  "(no queueing: the rest is the engine's, which the twin simulates)",
        "n_points": len(d), "ttft_overhead_ms": value,
        "iqr_ms": [float(np.percentile(d, 25)), float(np.percentile(d, 75))] if d else None}


def calibrate(profiling: str | Path, runs: str | Path | Sequence[str | Path] | None = None,
              out: str | Path | None = None, options: CalibrateOptions | None = None,
              report: str | Path | None = None, bench: BenchOptions | None = None,
              log: Callable[[str], None] | None = None) -> dict:
    """The whole ``lorapack calibrate`` procedure; returns a summary (also recorded in the profile).

    ``options``: ``CalibrateOptions`` (the model, GPU and vLLM version the profile is of; how it is refined).
    ``out``: the profile YAML (default: ``<gpu>__vllm-<version>__<model>.yaml`` in the current directory);
    ``report``: a directory for the fit-report plots.

    ``runs``: a runs CSV, or several runs files among which ``vllm bench serve`` result JSONs (``bench``: the
    server flags and adapter ranks they do not record, ``lorapack.benchjson``). The priors' LoRA fit reads
    the gauges of a single runs CSV; JSON runs have none, so with them it uses the profiling data only.

    ``profiling`` is a research profiling directory (``shared/data/profiling`` layout: ``options.model``
    needed, ``gpu`` and ``vllm_version`` default to h100-64gb and 0.8.5) or a measurement directory of
    ``lorapack measure`` (``measure.json``: model, device and version come from the server; ``model``/``gpu``
    rename them; the default free constants are ``MEASURED_FREE``)."""
    from ..measure.fit import fit_measured, is_measure_dir, lora_anchors

    options = options or CalibrateOptions()
    model, gpu, vllm_version = options.model, options.gpu, options.vllm_version
    refinement = options.refinement
    profiling = Path(profiling)
    measured = is_measure_dir(profiling)
    rename = None
    if measured:
        measured_prior = fit_measured(profiling, gpu=gpu)
        if vllm_version is not None and vllm_version != measured_prior.vllm_version:
            raise DataError(f"--vllm-version {vllm_version}: the measured server runs vLLM "
                            f"{measured_prior.vllm_version} (the profile records what was measured)")
        if report is not None:
            raise DataError(f"--report {report}: the fit-report plots read the research profiling format; a "
                            "measurement directory has its fits in the profile's provenance")
        rename = model if model is not None and model != measured_prior.model else None
        model, gpu, vllm_version = measured_prior.model, measured_prior.gpu, measured_prior.vllm_version
        if list(refinement.free) == list(DEFAULT_FREE):
            refinement = dataclasses.replace(refinement, free=MEASURED_FREE)
    else:
        if model is None:
            raise DataError(f"--profiling {profiling}: a research profiling directory needs --model (a "
                            "measurement directory of lorapack measure names its own)")
        gpu = gpu or "h100-64gb"
        vllm_version = vllm_version or "0.8.5"
    seeds, lengths, workers, free = refinement.seeds, refinement.lengths, refinement.workers, refinement.free
    start = refinement.start
    out_path = Path(out) if out is not None else Path.cwd() / default_profile_name(rename or model, gpu, vllm_version)
    # outputs are checked before the (long) fits: a bad path is an error now, not after the work
    check_output_file(out_path, "--out")
    if report is not None:
        check_output_dir(report, "--report")
    run_paths = None if runs is None else [Path(p) for p in ([runs] if isinstance(runs, str | Path) else runs)]
    rows = load_runs(run_paths, model, bench, log) if run_paths else None
    # the priors' additive LoRA fit reads the gauges (running_mean, waiting_max) of a runs CSV
    priors_csv = run_paths[0] if run_paths and len(run_paths) == 1 and not is_bench_json(run_paths[0]) else None
    if run_paths and priors_csv is None and log:
        log(f"{model}: the runs are not one runs CSV (no running/waiting gauges): the priors' LoRA fit uses the "
            f"profiling data only")

    if measured:
        prior = measured_prior
    else:
        prior = fit_priors_from(profiling, priors_csv, model, gpu=gpu, vllm_version=vllm_version,
                                max_model_len=options.max_model_len)
    prov: dict[str, Any] = dict(prior.provenance)
    prov["generated_by"] = "lorapack calibrate (lorapack.calibrate.command.calibrate)"
    prov["stage"] = "priors (docs/calibration.md)"
    prov["date"] = datetime.now(UTC).replace(microsecond=0).isoformat()
    prov["lorapack_version"] = __version__
    summary: dict[str, Any] = {"model": rename or model, "gpu": gpu, "vllm_version": vllm_version, "profile": str(out_path),
                               "fits": _fit_summary(prov.get("fits", {}))}
    prof = prior
    table: list[RunComparison] = []
    table_prior: list[RunComparison] = []
    if rows is not None:
        seed_list = list(range(seeds))
        anchors = lora_anchors(profiling) if measured else lora_overhead_points(profiling, model)
        prof, p_ref = refine_profile(prior, rows, anchors, refinement, log=log)
        if log:
            log(f"{model}: validating on {len(rows)} runs (priors only, then refined)")
        s_prior, table_prior = validate_profile(prior, rows, seeds=seed_list, lengths=lengths, workers=workers)
        s_ref, table = validate_profile(prof, rows, seeds=seed_list, lengths=lengths, workers=workers)
        prov["stage"] = "priors + simulation-based refinement (docs/calibration.md)"
        p_ref["start"] = ("the priors" if start is None else
                          f"the constants of a profile fitted {start.provenance.get('date', '(undated)')} "
                          f"(hash {start.file_hash()}): " + ", ".join(f"{n}={param_value(n, start):.6g}" for n in free))
        prov["refinement"] = p_ref
        guard_ids = {r["run_id"] for r in guard_subset(rows)}
        guard = [c for c in table if c.run_id in guard_ids]
        s_guard = score_runs([r for r in rows if r["run_id"] in guard_ids], [c.prediction for c in guard])
        runs_name, runs_sha = _runs_digest(run_paths or [])
        prov["validation"] = plain_scalars({"runs": runs_name, "runs_sha256": runs_sha,
                                      "seeds": seeds, "lengths": lengths,
                                      "scores_note": "SMAPE without the factor 2 (paper convention); *_2x with it; "
                                                     "TTFT = completed-only mean; agreement = share of labels; "
                                                     "bias = mean signed error, twin - real, % of real",
                                      "priors": s_prior, "refined": s_ref,
                                      "guard": {"stride": GUARD_STRIDE, "n_runs": len(guard),
                                                "what": "every stride-th run in run-id order (realruns.guard_subset): "
                                                        "re-scored by the fidelity guard test",
                                                "scores": s_guard}})
        summary["refinement"] = p_ref
        summary["validation"] = prov["validation"]
    final = prof.model_copy(update={"priors": Priors(steptime=prior.steptime), "provenance": plain_scalars(prov),
                                    **({"model": rename} if rename else {})})
    Profile.model_validate(final.model_dump(mode="json"))  # what is written must load back
    if report is not None:
        from .report import write_report

        summary["report"] = write_report(Path(report), final, profiling, table, table_prior)
    save_profile(final, out_path)  # atomic (temporary file + rename)
    return summary


def _fit_summary(fits: dict) -> dict:
    """Parameters, R², error and number of points of every prior fit (for the CLI table)."""
    out = {}
    for name, f in fits.items():
        if not isinstance(f, dict):
            continue
        if name == "loading":
            out[name] = {"n_points": f["activation"]["n_points"] + f["disk"]["n_points"],
                         "parameters": {"disk_medians_ms": f["disk"]["medians_ms"]}}
            continue
        params = f.get("parameters") or {k: f[k] for k in ("p1",) if k in f}
        out[name] = {"parameters": params, "r2": f.get("r2"), "rmse": f.get("rmse"), "n_points": f.get("n_points"),
                     "mean_rel_err": f.get("mean_rel_err")}
    return out
