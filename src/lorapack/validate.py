"""``lorapack validate``: replay real benchmark runs through the twin and score it (twin.md §8.2).

Rows are checked here (one line naming the row on a problem); rebuilding a run, simulating it and scoring
the predictions is ``lorapack.realruns`` (shared with the calibration's refinement).
"""

from __future__ import annotations

from pathlib import Path

from .errors import LorapackError, ProfileError
from .realruns import (
    VALIDATE_COLUMNS,
    RunPrediction,
    check_row,
    compare_runs,
    read_runs,
    score_runs,
    simulate_run,
    startup_prediction,
)
from .twin.metrics import RunMetrics


def run_validation(runs_path: str | Path, seeds: int = 1, gpu: str = "h100-64gb", lengths: str = "lognormal",
                   workers: int = 0, limit: int | None = None, progress: bool = True) -> dict:
    """Simulate every row (x seeds) and compare. Returns ``{"models": {...}, "rows": {column: list}}``:
    per model the row counts plus ``realruns.score_runs``; per row ``realruns.VALIDATE_COLUMNS``."""
    from .profile import available_profiles, find_profile

    if seeds < 1:
        raise LorapackError(f"--seeds {seeds}: expected an integer >= 1")
    if lengths not in ("fixed", "lognormal"):
        raise LorapackError(f"--lengths {lengths}: expected fixed or lognormal")
    if limit is not None and limit < 0:
        raise LorapackError(f"--limit {limit}: expected an integer >= 0")
    rows = read_runs(runs_path)
    if limit is not None:
        rows = rows[:limit]
    avail = available_profiles()
    if gpu not in {g for g, _, _ in avail}:
        raise ProfileError(f"unknown gpu '{gpu}': shipped profiles exist for "
                           f"{', '.join(sorted({g for g, _, _ in avail})) or 'none'}")
    have = {m for g, m, _ in avail if g == gpu}
    profiles = {m: find_profile(m, gpu) for m in have}
    preds: dict[int, RunPrediction] = {}
    todo = []
    for i, r in enumerate(rows):
        r["model"] = (r.get("model") or "").strip()
        if r["model"] not in have:
            continue
        check_row(r, f"{runs_path}: row {i + 1} (run {r.get('run_id')})")
        pred = startup_prediction(profiles[r["model"]], r)
        if pred is not None:
            preds[i] = pred
        elif (r.get("rate_counts") or "").strip() and (r.get("rank_counts") or "").strip():
            todo.extend((i, s) for s in range(seeds))

    from joblib import Parallel, delayed

    n_jobs = workers if workers > 0 else -1
    tasks = (delayed(simulate_run)(profiles[rows[i]["model"]], rows[i], s, lengths) for i, s in todo)
    gen = Parallel(n_jobs=n_jobs, return_as="generator")(tasks)
    sims: dict[int, list[RunMetrics]] = {}
    if progress and todo:
        from rich.progress import BarColumn, Progress, TimeRemainingColumn

        with Progress("[progress.description]{task.description}", BarColumn(),
                      "{task.completed}/{task.total}", TimeRemainingColumn(), transient=True) as bar:
            task = bar.add_task("simulating runs", total=len(todo))
            for (i, _s), out in zip(todo, gen, strict=True):
                sims.setdefault(i, []).append(out)
                bar.advance(task)
    else:
        for (i, _s), out in zip(todo, gen, strict=True):
            sims.setdefault(i, []).append(out)
    preds.update({i: RunPrediction.from_runs(outs) for i, outs in sims.items()})

    done = sorted(preds)
    table = compare_runs([rows[i] for i in done], [preds[i] for i in done])
    summary: dict[str, dict] = {}
    for i, r in enumerate(rows):  # every model met, in order of appearance (also those without a profile)
        st = summary.setdefault(r["model"], {"n_ok": 0, "n_oom": 0, "n_skipped": 0})
        if i not in preds:
            st["n_skipped"] += 1
        else:
            st["n_oom" if r["status"].strip() == "oom" else "n_ok"] += 1
    for m, st in summary.items():
        sel = [i for i in done if rows[i]["model"] == m]
        st.update(score_runs([rows[i] for i in sel], [preds[i] for i in sel]))
    return {"models": summary, "rows": {c: [getattr(t, c) for t in table] for c in VALIDATE_COLUMNS}}
