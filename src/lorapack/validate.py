"""``lorapack validate``: replay real benchmark runs through the twin and score it (docs/calibration.md, scores).

Rows are checked here (one line naming the row on a problem); rebuilding a run, simulating it and scoring
the predictions is ``lorapack.realruns`` (shared with the calibration's refinement).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .benchjson import BenchOptions, read_run_files, runs_label
from .checks import check_limit, check_workers
from .errors import DataError, LorapackError, ProfileError, SpecError
from .guards import Limits, check, profile_step_coef
from .profile import Profile
from .realruns import (
    VALIDATE_COLUMNS,
    RunPrediction,
    breakdown,
    build_workload,
    check_row,
    compare_runs,
    parse_counts,
    row_float,
    score_runs,
    server_flags,
    simulate_run,
    startup_prediction,
)
from .twin.metrics import RunMetrics
from .workload.cost import estimate_workload


@contextlib.contextmanager
def _progress(show: bool, total: int) -> Iterator[Callable[[], None]]:
    """A rich progress bar over ``total`` simulations (or nothing); yields the function that advances it."""
    if not show:
        yield lambda: None
        return
    from rich.progress import BarColumn, Progress, TimeRemainingColumn

    with Progress("[progress.description]{task.description}", BarColumn(), "{task.completed}/{task.total}",
                  TimeRemainingColumn(), transient=True) as bar:
        task = bar.add_task("simulating runs", total=total)
        yield lambda: bar.advance(task)


def _profiles(gpu: str, profile: Profile | None) -> tuple[dict[str, Profile], str]:
    """The profiles runs are scored with (by model), and what to say about a model without one."""
    from .profile import available_profiles, find_profile

    if profile is not None:
        return {profile.model: profile}, f"not the model of --profile ({profile.model} on {profile.gpu})"
    avail = available_profiles()
    if gpu not in {g for g, _, _ in avail}:
        raise ProfileError(f"unknown gpu '{gpu}': shipped profiles exist for "
                           f"{', '.join(sorted({g for g, _, _ in avail})) or 'none'}")
    have = sorted({m for g, m, _ in avail if g == gpu})
    return ({m: find_profile(m, gpu) for m in have},
            f"no shipped profile on {gpu} (shipped: {', '.join(have)}); calibrate one and pass --profile FILE")


ENGINES = ("twin", "surrogate", "tree")


def row_candidate(row: dict, profile: Profile):
    """The GPU of a real run as an oracle question (the features depend on the multisets, not the order)."""
    from .oracle import GpuCandidate

    return GpuCandidate(
        profile, np.array(parse_counts(row["rank_counts"], int)), np.array(parse_counts(row["rate_counts"], float)),
        server_flags(row, profile), row_float(row, "mean_input_tokens"), row_float(row, "mean_output_tokens"))


def learned_predictions(rows: list[dict], todo: list[int], profiles: dict[str, Profile], engine: str,
                        models_dir: str | Path | None) -> tuple[dict[int, RunPrediction], dict[int, str], set[int]]:
    """The learned oracle's answers (deterministic: one per run), the rows without a model (skipped, with
    the reason) and the rows whose candidate lies outside the models' training range."""
    from .surrogate import load_oracle, model_path

    preds: dict[int, RunPrediction] = {}
    skipped: dict[int, str] = {}
    out_of_range: set[int] = set()
    models = sorted({rows[i]["model"] for i in todo})
    oracles = {}
    for m in models:
        prof = profiles[m]
        if models_dir is not None and not model_path(models_dir, prof.gpu, prof.model, engine).is_file():
            continue  # --models holds other profiles only: this model's runs are skipped
        oracles[m] = load_oracle(prof, engine, models_dir)
    if models and not oracles:  # nothing to answer with: say what is missing
        load_oracle(profiles[models[0]], engine, models_dir)
    for m in models:
        idx = [i for i in todo if rows[i]["model"] == m]
        if m not in oracles:
            skipped.update({i: f"no {engine} model for {m} in {models_dir}" for i in idx})
            continue
        for i, p in zip(idx, oracles[m].predict([row_candidate(rows[i], profiles[m]) for i in idx]), strict=True):
            if not p.in_range:
                out_of_range.add(i)
            preds[i] = RunPrediction(oom=not p.fits, error_type=p.error_type, throughput_tok_s=p.throughput_tok_s,
                                     itl_mean_ms=p.itl_ms, ttft_mean_ms=p.ttft_s * 1000.0,
                                     throughput_ratio=p.throughput_ratio, starved=p.starved >= 0.5)
    return preds, skipped, out_of_range


def macro_f1(confusion: dict[str, int]) -> float:
    """Macro-averaged F1 of the starvation label from ``score_runs``' confusion counts (a class absent from
    both sides counts 1)."""
    tp, fn = confusion["real_starved_pred_starved"], confusion["real_starved_pred_healthy"]
    fp, tn = confusion["real_healthy_pred_starved"], confusion["real_healthy_pred_healthy"]
    if tp + fn + fp + tn == 0:
        return float("nan")

    def f1(t: int, a: int, b: int) -> float:
        return 1.0 if t + a + b == 0 else 2 * t / (2 * t + a + b)

    return (f1(tp, fp, fn) + f1(tn, fn, fp)) / 2


@dataclass(frozen=True)
class ValidateOptions:
    """How ``run_validation`` scores runs: ``seeds`` simulations per run (averaged), the length law around a
    row's pool means (``lengths``), worker processes (0 = all cores), the first ``limit`` rows only, the
    resource ``limits`` every row is costed against (``guards``); the shipped profiles of ``gpu``, or
    ``profile`` for its model's runs (the other rows are skipped); ``engine``: ``twin`` simulates, ``surrogate``
    or ``tree`` asks the learned oracle (``models_dir``, default: the shipped models). Invalid values raise
    ``SpecError`` naming the flag."""

    seeds: int = 1
    gpu: str = "h100-64gb"
    lengths: str = "lognormal"
    workers: int = 0
    limit: int | None = None
    limits: Limits | None = None
    profile: Profile | None = None
    engine: str = "twin"
    models_dir: str | Path | None = None

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise SpecError(f"--engine {self.engine}: expected one of {', '.join(ENGINES)}")
        if self.models_dir is not None and self.engine == "twin":
            raise SpecError("--models applies to --engine surrogate or tree")
        if isinstance(self.seeds, bool) or not isinstance(self.seeds, int) or self.seeds < 1:
            raise SpecError(f"--seeds {self.seeds}: expected an integer >= 1")
        if self.lengths not in ("fixed", "lognormal"):
            raise SpecError(f"--lengths {self.lengths}: expected fixed or lognormal")
        check_limit(self.limit)
        check_workers(self.workers)


def run_validation(runs_path: str | Path | Sequence[str | Path], options: ValidateOptions | None = None,
                   bench: BenchOptions | None = None, progress: bool = True,
                   log: Callable[[str], None] | None = None) -> dict:
    """Simulate every row (x seeds) and compare, as ``options`` says (``ValidateOptions``; default: the shipped
    profiles of h100-64gb, one seed, the twin). Returns ``{"models": {...}, "rows": {column: list},
    "skipped": [{"run_id", "model", "reason"}]}``: per model the row counts (``skip_reasons`` counts the
    skipped rows by reason) plus ``realruns.score_runs``; per row ``realruns.VALIDATE_COLUMNS``; ``"pooled"``:
    ``score_runs`` over the scored runs of every model together (None when only one model was scored).

    ``options.profile``: score the runs of its model with it (``validate --profile FILE``; the other rows are
    skipped), instead of the shipped profiles of ``options.gpu``. Every row is checked and costed (``guards``,
    ``options.limits``) before any simulation starts; a file none of whose rows can be scored is a
    ``DataError``. ``progress``: show a progress bar over the simulations.

    ``options.engine`` "surrogate" or "tree" asks the learned oracle (``options.models_dir``, default: the
    shipped models) instead of simulating; every model's scores then add ``n_out_of_range``. All engines add
    ``starved_f1``.

    ``runs_path``: a runs CSV, or several files, among them ``vllm bench serve`` result JSONs (``.json``,
    ``lorapack.benchjson``): ``bench`` holds the server flags and adapter ranks those files do not record,
    ``log`` receives their notices (e.g. the uniform adapter draw), also returned as ``"notes"``."""
    options = options or ValidateOptions()
    seeds, gpu, lengths, workers = options.seeds, options.gpu, options.lengths, options.workers
    limit, limits, profile, engine = options.limit, options.limits, options.profile, options.engine
    models_dir = options.models_dir
    notes: list[str] = []

    def note(msg: str) -> None:
        notes.append(msg)
        if log is not None:
            log(msg)

    if profile is not None and (bench is None or bench.model is None):  # a JSON run of an unknown model_id
        bench = dataclasses.replace(bench or BenchOptions(), model=profile.model)
    rows, sources = read_run_files(runs_path, bench, note)
    label = runs_label(runs_path)
    if limit is not None:
        rows, sources = rows[:limit], sources[:limit]
    profiles, no_profile = _profiles(gpu, profile)
    preds: dict[int, RunPrediction] = {}
    skipped: dict[int, str] = {}  # row -> why it is not scored (reported, never silent)
    todo = []
    for i, r in enumerate(rows):
        r["model"] = (r.get("model") or "").strip()
        where = f"{sources[i]} (run {r.get('run_id')})"
        if r["model"] not in profiles:
            skipped[i] = f"model '{r['model']}': {no_profile}"
            continue
        check_row(r, where)
        prof = profiles[r["model"]]
        pred = startup_prediction(prof, r)
        if pred is not None:
            preds[i] = pred
        elif engine != "twin" and (r.get("rate_counts") or "").strip() and (r.get("rank_counts") or "").strip():
            todo.append((i, 0))
        elif (r.get("rate_counts") or "").strip() and (r.get("rank_counts") or "").strip():
            wl = build_workload(r, 0, lengths)
            try:  # before the first simulation: a row that cannot finish fails now, naming itself
                check(estimate_workload(wl, wl.duration_s or 3600.0, profile_step_coef(prof)), limits)
            except LorapackError as e:
                raise type(e)(f"{where}: {e}") from None
            todo.extend((i, s) for s in range(seeds))
        else:
            skipped[i] = "an ok run without rank_counts/rate_counts cannot be rebuilt"
    out_of_range: set[int] = set()
    if engine != "twin":
        learned, no_model, out_of_range = learned_predictions(rows, [i for i, _s in todo], profiles, engine,
                                                                models_dir)
        preds.update(learned)
        skipped.update(no_model)
        todo = []
    if rows and len(skipped) == len(rows):
        raise DataError(f"{label}: none of its {len(rows)} run(s) can be scored: "
                        f"{'; '.join(sorted(set(skipped.values())))}")

    from .executor import Executor

    jobs = [(profiles[rows[i]["model"]], rows[i], s, lengths, None, None, limits) for i, s in todo]
    outs: list[RunMetrics | None] = [None] * len(jobs)
    with Executor(workers) as ex, _progress(progress and bool(jobs), len(jobs)) as advance:
        for k, out in ex.imap(simulate_run, jobs):
            outs[k] = out
            advance()
    sims: dict[int, list[RunMetrics]] = {}
    for (i, _s), out in zip(todo, outs, strict=True):  # in seed order: averages do not depend on timing
        sims.setdefault(i, []).append(out)
    preds.update({i: RunPrediction.from_runs(outs) for i, outs in sims.items()})

    done = sorted(preds)
    table = compare_runs([rows[i] for i in done], [preds[i] for i in done])
    summary: dict[str, dict] = {}
    for i, r in enumerate(rows):  # every model met, in order of appearance (also those without a profile)
        st = summary.setdefault(r["model"], {"n_ok": 0, "n_oom": 0, "n_skipped": 0, "skip_reasons": {}})
        if i not in preds:
            st["n_skipped"] += 1
            why = skipped.get(i, "not simulated")
            st["skip_reasons"][why] = st["skip_reasons"].get(why, 0) + 1
        else:
            st["n_oom" if r["status"].strip() == "oom" else "n_ok"] += 1
    for m, st in summary.items():
        sel = [i for i in done if rows[i]["model"] == m]
        st.update(score_runs([rows[i] for i in sel], [preds[i] for i in sel]))
        # signed errors by rank x load group and by slot rank (a bias hides in a good overall SMAPE)
        st["by_group"] = breakdown([rows[i] for i in sel], [preds[i] for i in sel], "group")
        st["by_max_lora_rank"] = breakdown([rows[i] for i in sel], [preds[i] for i in sel], "max_lora_rank")
        if "starvation_confusion" in st:
            st["starved_f1"] = macro_f1(st["starvation_confusion"])
        if engine != "twin":
            st["n_out_of_range"] = sum(i in out_of_range for i in sel)
    # every model's scored runs together (the TTFT objective targets count runs, whatever their model)
    scored_models = {rows[i]["model"] for i in done}
    pooled = score_runs([rows[i] for i in done], [preds[i] for i in done]) if len(scored_models) > 1 else None
    return {"engine": engine, "models": summary, "pooled": pooled,
            "rows": {c: [getattr(t, c) for t in table] for c in VALIDATE_COLUMNS},
            "skipped": [{"run_id": rows[i].get("run_id"), "model": rows[i]["model"], "reason": why}
                        for i, why in sorted(skipped.items())], "notes": notes}
