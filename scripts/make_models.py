"""``make models``: sweep -> train -> refine for every shipped profile; writes the shipped model files.

Stages (each a plain ``lorapack`` command, printed before it runs, so the pipeline can be reproduced by
hand; sweeps resume, so an interrupted run continues where it stopped):

1. per profile: ``lorapack sweep --preset paper-<m> --boundary-seeds 1`` (the paper's grid + N = 8 / A = 8,
   the profile's fitted length law, one extra seed near the 0.9 boundary) and ``lorapack sweep --preset
   additions-<m>`` (placement.md §3.3: log-uniform / Dirichlet / Zipf rate vectors, homogeneous rank groups,
   padded sets, two extra seeds near the boundary);
2. per profile: ``lorapack sweep --preset placement-train-<m>``: 2,400 GPUs as Proposed builds them (seed 1),
   trained on; ``lorapack sweep --preset placement-like-<m>``: 600 more (a held-out test set, seed 7), scored
   but never trained on;
3. ``lorapack train`` on both sweeps of both profiles -> ``src/lorapack/models/<gpu>__<model>/surrogate.npz``
   and the training report;
4. ``lorapack refine`` -> ``tree.npz`` beside each surrogate.

Timings per stage go to ``src/lorapack/models/make_models.json``. ``--limit K`` runs, of each grid, whole
N-series of its fixed seeded shuffle of series until at least K configs (``lorapack sweep --limit``: a quick,
smaller dataset in which N-series pruning acts as in the full grid); ``--workers`` is passed to the sweeps,
``--jobs`` (default 2) to the training search. ``--profiles qwen`` rebuilds that profile's models only (the
others' files stay; the refine stage runs on a staging copy of the retrained models, because ``lorapack refine``
refines every model of a directory from the sweeps recorded in it).
``lorapack sweep --preset paper-llama --boundary-seeds 1 --estimate`` projects the first stage's time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "src" / "lorapack" / "models"


def run(cmd: list[str], stages: list[dict], name: str) -> None:
    print("$ " + " ".join(shlex.quote(c) for c in cmd), flush=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True)
    stages.append({"stage": name, "command": " ".join(shlex.quote(c) for c in cmd),
                   "wall_s": time.perf_counter() - t0})


def refine(lp: list[str], out: Path, sweeps: list[str], pl_args: list[str], stages: list[dict]) -> None:
    """``lorapack refine`` on the models trained now. It refines every model of a directory from the sweeps
    recorded in it, so with ``--profiles`` a subset (the other models' sweeps may be gone) it runs on a staging
    copy of the trained models and the trees are copied back."""
    trained, others = [], []
    for report in sorted(out.glob("*__*/train_report.json")):
        datasets = json.loads(report.read_text()).get("datasets", [])
        (trained if datasets and set(datasets) <= set(sweeps) else others).append(report.parent)
    if not others:
        run([*lp, "refine", str(out), *pl_args], stages, "refine")
        return
    with tempfile.TemporaryDirectory(prefix="refine-", dir=out.parent) as tmp:
        for d in trained:
            shutil.copytree(d, Path(tmp) / d.name)
        print(f"(refining {', '.join(d.name for d in trained)} only, in {tmp}; "
              f"{', '.join(d.name for d in others)} keep their trees)", flush=True)
        run([*lp, "refine", tmp, *pl_args], stages, "refine")
        for d in trained:
            shutil.copy2(Path(tmp) / d.name / "tree.npz", d / "tree.npz")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", type=Path, default=ROOT / "build" / "models-data", help="sweep directories")
    ap.add_argument("--out", type=Path, default=MODELS, help="model directory")
    ap.add_argument("--limit", type=int, default=None,
                    help="quick run: whole N-series of each grid's fixed shuffle until at least K configs")
    ap.add_argument("--additions-limit", type=int, default=None,
                    help="the same for the additions grids (default: --limit)")
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--budget-s", type=float, default=1500.0, help="training budget per profile")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                    help="parallel processes of the training search (default: up to 2, the machine is shared)")
    ap.add_argument("--profiles", default="llama,qwen")
    args = ap.parse_args()
    lp = [str(Path(sys.executable).parent / "lorapack")]
    stages: list[dict] = []
    t_all = time.perf_counter()
    names = [p.strip() for p in args.profiles.split(",") if p.strip()]
    args.data.mkdir(parents=True, exist_ok=True)
    sweeps, plike = [], []
    for m in names:
        for preset, lim, extra in ((f"paper-{m}", args.limit, ["--boundary-seeds", "1"]),
                                   (f"additions-{m}", args.additions_limit or args.limit, [])):
            out = args.data / preset
            cmd = [*lp, "sweep", "--preset", preset, "--out", str(out), "--resume", "--workers", str(args.workers),
                   *extra, *(["--limit", str(lim)] if lim else [])]
            run(cmd, stages, f"sweep {preset}")
            sweeps.append(str(out))
        out = args.data / f"placement-train-{m}"  # training rows drawn like the queries (seed 1)
        cmd = [*lp, "sweep", "--preset", f"placement-train-{m}", "--out", str(out), "--resume", "--workers",
               str(args.workers), "--no-prune", *(["--limit", str(args.limit)] if args.limit else [])]
        run(cmd, stages, f"sweep placement-train-{m}")
        sweeps.append(str(out))
        out = args.data / f"placement-like-{m}"
        cmd = [*lp, "sweep", "--preset", f"placement-like-{m}", "--out", str(out), "--resume", "--workers",
               str(args.workers), "--no-prune"]
        run(cmd, stages, f"sweep placement-like-{m}")
        plike.append(str(out))
    pl_args = [a for p in plike for a in ("--placement-like", p)]
    run([*lp, "train", *sweeps, "--out", str(args.out), "--budget-s", str(args.budget_s), "--jobs", str(args.jobs),
         *pl_args], stages, "train")
    refine(lp, args.out, sweeps, pl_args, stages)
    total = time.perf_counter() - t_all
    for s in stages:
        s["share"] = s["wall_s"] / total
    record = {"total_s": total, "stages": stages, "limit": args.limit, "workers": args.workers,
              "machine": {"cpu_count": os.cpu_count(), "python": platform.python_version(),
                          "load_avg_at_end": os.getloadavg()}}
    (args.out / "make_models.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"make models: {total / 60:.1f} min; " + ", ".join(f"{s['stage']} {100 * s['share']:.0f} %" for s in stages))


if __name__ == "__main__":
    main()
