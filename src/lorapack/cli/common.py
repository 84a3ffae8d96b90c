"""Shared by every command module: consoles, JSON output, number formatting, atomic CSV writes, option types.

A leaf module: it imports nothing from the command modules (``lorapack.cli`` registers them)."""

from __future__ import annotations

import csv
import json
import math
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from ..errors import SpecError

# pipes and CI get 80 columns by default, too narrow for the tables
console = Console() if sys.stdout.isatty() else Console(width=140)
err_console = Console(stderr=True)
DEBUG = {"on": False}


def json_safe(x: Any) -> Any:
    """NaN/inf become null; numpy scalars become Python numbers."""
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [json_safe(v) for v in x]
    if hasattr(x, "item") and not isinstance(x, str):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(json_safe(obj), indent=2) + "\n")


def load_profile(model: str | None, gpu: str, profile: Path | None):
    from ..profile import find_profile, load_profile_file

    if profile is not None:
        return load_profile_file(profile)
    if not model:
        raise SpecError("--model is required (or --profile FILE); e.g. --model llama-3.1-8b-instruct")
    return find_profile(model, gpu)


def fmt(v: Any, digits: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return "-" if not math.isfinite(v) else f"{v:,.{digits}f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def write_csv_atomic(path: Path, columns: dict[str, Any]) -> None:
    """Write columns (name -> sequence) to CSV via a temporary file: no half-written output on error."""
    path = Path(path)
    if not path.parent.exists():
        raise SpecError(f"cannot write {path}: directory {path.parent} does not exist")
    tmp = path.with_name(path.name + ".tmp")
    names = list(columns)
    n = len(columns[names[0]]) if names else 0
    try:
        with tmp.open("w", newline="") as f:
            w = csv.writer(f)
            w.writerow(names)
            for i in range(n):
                w.writerow([json_safe(columns[c][i]) for c in names])
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


ModelOpt = Annotated[str | None, typer.Option("--model", "-m", help="Model key, e.g. llama-3.1-8b-instruct.")]
GpuOpt = Annotated[str, typer.Option("--gpu", help="GPU key of the shipped profile.")]
ProfileOpt = Annotated[Path | None, typer.Option("--profile", help="Profile YAML (instead of --model/--gpu).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object instead of tables.")]
