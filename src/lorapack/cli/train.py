"""``lorapack train``: learned oracles (surrogate ensembles) from sweep rows."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ..errors import SpecError
from .common import JsonOpt, console, err_console, fmt, print_json


def _families(text: str) -> tuple[str, ...]:
    return tuple(f.strip() for f in text.split(",") if f.strip())


def train(
    datasets: Annotated[list[Path], typer.Argument(help="Sweep directories (lorapack sweep --out); rows are "
                                                        "grouped by profile.")],
    out: Annotated[Path, typer.Option("--out", help="Model directory to write (one sub-directory per profile).")],
    families: Annotated[str, typer.Option(help="Comma list of hgb, rf, knn, svm (knn/svm: report only).")] =
    "hgb,rf,knn,svm",
    budget_s: Annotated[float | None, typer.Option("--budget-s", help="Soft time budget per profile: report-only "
                                                                      "families are skipped once it is spent.")] = None,
    placement_like: Annotated[list[Path] | None, typer.Option(
        "--placement-like", help="Sweep directory of placement-like candidates to score on as well.")] = None,
    seed: Annotated[int, typer.Option(help="Seed of the split and of every model.")] = 0,
    jobs: Annotated[int, typer.Option(help="Parallel processes of the search.")] = 1,
    max_rows: Annotated[int | None, typer.Option(help="Subsample the training rows (quick runs).")] = None,
    quick: Annotated[bool, typer.Option("--quick", help="Two candidates per family, 3 folds: a first look, "
                                                        "not for shipping.")] = False,
    json_out: JsonOpt = False,
) -> None:
    """Train the throughput regressor, starvation classifier and ITL / TTFT regressors of every profile in the
    sweep rows; write compiled, pickle-free model files and a training report."""
    from ..fingerprint import twin_fingerprint
    from ..profile import find_profile
    from ..surrogate.dataset import read_datasets
    from ..surrogate.modelfile import model_path, save_model
    from ..surrogate.train import TrainOptions, train_profile, write_report

    opts = TrainOptions(families=_families(families), budget_s=budget_s, seed=seed, n_jobs=jobs, max_rows=max_rows,
                        quick=quick)
    if jobs < 1:
        raise SpecError(f"--jobs {jobs}: expected an integer >= 1")
    if max_rows is not None and max_rows < 200:
        raise SpecError(f"--max-rows {max_rows}: expected an integer >= 200")
    if out.exists() and not out.is_dir():
        raise SpecError(f"--out {out}: exists and is not a directory")
    data = read_datasets(datasets)
    extra = read_datasets(placement_like) if placement_like else {}
    for key, ds in extra.items():
        if key in data and ds.fingerprint != data[key].fingerprint:
            raise SpecError(f"--placement-like rows for {key[1]} come from another twin (fingerprint "
                            f"{ds.fingerprint} vs {data[key].fingerprint}); re-run them with the same lorapack")
    results = []
    with err_console.status("training") as status:
        for key, ds in sorted(data.items()):
            current = twin_fingerprint(find_profile(ds.model, ds.gpu))
            if current != ds.fingerprint:
                err_console.print(f"warning: the rows for {ds.model} come from twin {ds.fingerprint}; the current "
                                  f"twin is {current}: the models will be stale (re-run the sweep)")
            sets = {"placement_like": extra[key]} if key in extra else {}
            mf, rep = train_profile(ds, opts, sets, progress=lambda msg: status.update(f"training {msg}"))
            results.append((mf, rep))
    _stop_workers()
    out.mkdir(parents=True, exist_ok=True)
    files = [save_model(mf, model_path(out, mf.profile["gpu"], mf.profile["model"], "surrogate"))
             for mf, _ in results]
    files += write_report([rep for _, rep in results], out)
    summary = {"out": str(out), "files": [str(f) for f in files], "profiles": {}}
    for mf, _rep in results:
        summary["profiles"][mf.profile["model"]] = {
            t: {"family": i["family"], "metric": i["metric"], **{k: v["score"] if isinstance(v, dict) else v
                                                                 for k, v in i["scores"].items()}}
            for t, i in mf.target_info.items()}
    if json_out:
        print_json(summary)
        return
    for model, targets in summary["profiles"].items():
        parts = [f"{t} {v['family']} {v['metric']} held-out {fmt(v['held_out'], 3)}" for t, v in targets.items()]
        console.print(f"[bold]{model}[/bold]: " + "; ".join(parts))
    console.print(f"wrote {len(files)} files to {out} (<gpu>__<model>/train_report.md has every family's scores)",
                  markup=False)


def _stop_workers() -> None:
    """Stop joblib's worker processes now that the search is over. Left to the interpreter's exit, the idle
    workers of its reusable executor sometimes outlived the command by minutes (make models, 2026-11-28: the
    train stage sat ~3 min at 0 % CPU in ``wait4`` on a worker that was waiting for work)."""
    from joblib.externals.loky import reusable_executor

    executor = reusable_executor._executor  # None when the search ran in-process (--jobs 1)
    if executor is not None:
        executor.shutdown(wait=True, kill_workers=True)

