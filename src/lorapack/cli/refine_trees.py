"""``lorapack refine``: shallow trees (<= 32 leaves) from a model directory's surrogates."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ..errors import SpecError
from .common import JsonOpt, console, err_console, fmt, print_json


def profile_dirs(models: Path, kind: str) -> list[Path]:
    """Model files of ``kind`` in a model directory (one sub-directory per profile)."""
    if not models.is_dir():
        raise SpecError(f"{models}: not a directory; expected the --out of lorapack train")
    files = sorted(models.glob(f"*__*/{kind}.npz"))
    if not files:
        raise SpecError(f"{models}: no */{kind}.npz; expected a model directory written by lorapack "
                        f"{'train' if kind == 'surrogate' else 'refine'}")
    return files


def refine(
    models: Annotated[Path, typer.Argument(help="Model directory (lorapack train --out).")],
    data: Annotated[list[Path] | None, typer.Option("--data", help="Sweep directories the surrogates were trained "
                                                                   "on (default: the paths recorded in them).")] = None,
    placement_like: Annotated[list[Path] | None, typer.Option(
        "--placement-like", help="Sweep directory of placement-like candidates to score on as well.")] = None,
    max_leaves: Annotated[int, typer.Option(help="Largest number of leaves (rules) per tree.")] = 32,
    min_samples_leaf: Annotated[int, typer.Option(help="Fewest training rows per leaf.")] = 10,
    json_out: JsonOpt = False,
) -> None:
    """Derive shallow decision trees from the surrogates' training rows; write tree.npz beside each surrogate."""
    from ..surrogate.dataset import read_datasets
    from ..surrogate.modelfile import load_model, model_path, save_model
    from ..surrogate.refine import RefineOptions, refine_profile, score_extra

    opts = RefineOptions(max_leaves=max_leaves, min_samples_leaf=min_samples_leaf)
    extra = read_datasets(placement_like) if placement_like else {}
    written, summary = [], {}
    with err_console.status("refining") as status:
        for path in profile_dirs(models, "surrogate"):
            mf = load_model(path)
            key = (mf.profile["gpu"], mf.profile["model"])
            srcs = data or [Path(p) for p in mf.extra.get("datasets", [])]
            if not srcs:
                raise SpecError(f"{path}: records no training data; pass --data DIR")
            ds = read_datasets(srcs).get(key)
            if ds is None:
                raise SpecError(f"no rows for {key[1]} on {key[0]} in {', '.join(map(str, srcs))}")
            status.update(f"refining {key[1]}")
            tree, _rep = refine_profile(mf, ds, opts)
            if key in extra:
                score_extra(tree, "placement_like", extra[key])
            written.append(save_model(tree, model_path(models, key[0], key[1], "tree")))
            summary[key[1]] = {t: {"leaves": i["leaves"], "teacher": i["teacher"],
                                   **{k: v["score"] for k, v in i["scores"].items()}}
                               for t, i in tree.target_info.items()}
    if json_out:
        print_json({"files": [str(p) for p in written], "profiles": summary})
        return
    for model, targets in summary.items():
        parts = [f"{t} {v['leaves']} leaves held-out {fmt(v['held_out'], 3)}" for t, v in targets.items()]
        console.print(f"[bold]{model}[/bold]: " + "; ".join(parts))
    console.print(f"wrote {', '.join(map(str, written))}", markup=False)
