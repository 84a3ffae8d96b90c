"""``lorapack explain``: the shallow trees' rules, one line per leaf."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from .common import JsonOpt, console, print_json


def explain(
    models: Annotated[Path, typer.Argument(help="Model directory (with tree.npz files from lorapack refine).")],
    model: Annotated[str | None, typer.Option("--model", "-m", help="Only this model key.")] = None,
    target: Annotated[str | None, typer.Option(help="Only this target: throughput, starved, itl, ttft.")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Print the rules of the shallow trees (IF feature bounds THEN prediction)."""
    from ..errors import SpecError
    from ..surrogate.modelfile import TARGETS, load_model
    from ..surrogate.refine import rules
    from .refine_trees import profile_dirs

    if target is not None and target not in TARGETS:
        raise SpecError(f"--target {target}: expected one of {', '.join(TARGETS)}")
    out: dict = {}
    for path in profile_dirs(models, "tree"):
        mf = load_model(path)
        if model is not None and mf.profile["model"] != model:
            continue
        out[mf.profile["model"]] = {t: {"rules": rules(f, t), "scores": mf.target_info[t].get("scores", {})}
                                    for t, f in mf.targets.items() if target in (None, t)}
    if model is not None and not out:
        raise SpecError(f"--model {model}: no tree model for it in {models}")
    if json_out:
        print_json(out)
        return
    for m, targets in out.items():
        for t, d in targets.items():
            held = d["scores"].get("held_out", {})
            metric = "macro-F1" if t == "starved" else "SMAPE %"
            console.print(f"[bold]{m} — {t}[/bold] ({len(d['rules'])} rules; held-out {metric} "
                          f"{held.get('score', float('nan')):.3f})")
            for i, r in enumerate(d["rules"], 1):
                console.print(f"  {i:2d}. {r}", highlight=False, soft_wrap=True)
