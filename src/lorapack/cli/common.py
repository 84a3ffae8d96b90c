"""Shared by every command module: consoles, JSON output, number formatting, atomic CSV writes, option types,
and the checks every command applies the same way (re-exported from ``lorapack.checks``):

* ``check_output_file(path, "--out")`` / ``check_output_dir(path, "--out")``: call them on every output path
  *before* the work starts (a directory where a file is expected, a missing parent, a read-only place are
  one-line errors, and nothing is written); then write with ``write_csv_atomic`` / ``atomic_path``;
* ``check_workers(n)`` (>= 0, 0 = all cores), ``check_limit(k)`` (>= 1);
* ``load_profile(model, gpu, profile)``: ``--profile FILE`` or ``--model``/``--gpu`` (not both);
* ``ForceOpt`` + ``limits(force)``: the resource limits of ``lorapack.guards``, lifted by ``--force``.

A leaf module: it imports nothing from the command modules (``lorapack.cli`` registers them)."""

from __future__ import annotations

import csv
import json
import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from ..checks import atomic_path, check_limit, check_output_dir, check_output_file, check_workers
from ..errors import SpecError
from ..guards import Limits, limits_help
from ..textfiles import fmt, json_safe


def _stdout_console() -> Console:
    """A terminal: its own width (every table fits 80 columns). A pipe: ``COLUMNS`` when set, else 140
    columns (rich's default of 80 for pipes would wrap log lines that have room in a CI log)."""
    if sys.stdout.isatty() or os.environ.get("COLUMNS", "").strip().isdigit():
        return Console()
    return Console(width=140)


console = _stdout_console()
err_console = Console(stderr=True)
DEBUG = {"on": False}


def print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(json_safe(obj), indent=2) + "\n")


DEFAULT_GPU = "h100-64gb"


def load_profile(model: str | None, gpu: str | None, profile: Path | None):
    """The profile of ``--profile FILE``, or the shipped one of ``--model`` on ``--gpu`` (default h100-64gb).

    ``--profile`` names its own model and GPU, so giving ``--model`` or ``--gpu`` with it is an error."""
    from ..profile import find_profile, load_profile_file

    if profile is not None:
        given = [f"{o} {v}" for o, v in (("--model", model), ("--gpu", gpu)) if v]
        if given:
            raise SpecError(f"--profile {profile} and {' / '.join(given)}: give one or the other (the profile "
                            f"file names its own model and GPU)")
        return load_profile_file(profile)
    if not model:
        raise SpecError("--model is required (or --profile FILE); e.g. --model llama-3.1-8b-instruct")
    return find_profile(model, gpu or DEFAULT_GPU)


def apply_vllm_version(prof, version: str | None):
    """The profile whose rule set the twin follows: ``--vllm-version`` overrides the profile's version (a
    one-line warning: the timing constants were measured on the profile's); without it the profile's version
    must parse (a development build's does not: a one-line error asks for ``--vllm-version``)."""
    import warnings

    from ..errors import LorapackWarning
    from ..server import rules_for_version

    if version is None:
        rules_for_version(prof.vllm_version)
        return prof
    rules = rules_for_version(version)
    if version == prof.vllm_version:
        return prof
    warnings.warn(f"--vllm-version {version}: the twin follows vLLM {rules.name}'s rules, but {prof.model}'s timing "
                  f"constants were measured on vLLM {prof.vllm_version}", LorapackWarning, stacklevel=2)
    return prof.model_copy(update={"vllm_version": version})


def parse_int_list(text: str, option: str, minimum: int = 1) -> list[int]:
    """``"4,8,16"`` -> ``[4, 8, 16]`` (one value -> a list of one); a one-line ``SpecError`` otherwise."""
    parts = [p.strip() for p in str(text).split(",")]
    try:
        values = [int(p) for p in parts]
    except ValueError:
        raise SpecError(f"{option} {text}: expected an integer >= {minimum} or a comma list of them, e.g. "
                        f"4,8,16,32") from None
    for v in values:
        if v < minimum:
            raise SpecError(f"{option} {text}: expected integers >= {minimum} (got {v})")
    if len(set(values)) != len(values):
        raise SpecError(f"{option} {text}: expected distinct values")
    return values


def limits(force: bool) -> Limits:
    """The resource limits of one run (``lorapack.guards``); ``--force`` lifts the soft ones."""
    return Limits(force=bool(force))


def write_csv_atomic(path: Path, columns: dict[str, Any]) -> None:
    """Write columns (name -> sequence) to CSV via a temporary file: no half-written output on error."""
    path = Path(path)
    if not path.parent.exists():
        raise SpecError(f"cannot write {path}: directory {path.parent} does not exist")
    names = list(columns)
    n = len(columns[names[0]]) if names else 0
    with atomic_path(path) as tmp, tmp.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(names)
        for i in range(n):
            w.writerow([json_safe(columns[c][i]) for c in names])


ModelOpt = Annotated[str | None, typer.Option("--model", "-m", help="Model key, e.g. llama-3.1-8b-instruct.")]
GpuOpt = Annotated[str | None, typer.Option("--gpu", help=f"GPU key of the shipped profile (default: {DEFAULT_GPU}).")]
ProfileOpt = Annotated[Path | None, typer.Option("--profile", help="Profile YAML (instead of --model/--gpu).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object instead of tables.")]
ForceOpt = Annotated[bool, typer.Option("--force", help=limits_help())]
WorkersOpt = Annotated[int, typer.Option("--workers", help="Parallel processes (0 = all cores).")]
VllmVersionOpt = Annotated[str | None, typer.Option(
    "--vllm-version", help="vLLM version whose rules the twin follows (default: the profile's); the newest rule "
                           "set at or below it applies (0.8.5, 0.32, 0.33).")]

__all__ = ["DEFAULT_GPU", "ForceOpt", "GpuOpt", "JsonOpt", "ModelOpt", "ProfileOpt", "VllmVersionOpt", "WorkersOpt",
           "apply_vllm_version", "atomic_path",
           "check_limit", "check_output_dir", "check_output_file", "check_workers", "console", "err_console",
           "fmt", "json_safe", "limits", "load_profile", "parse_int_list", "print_json", "write_csv_atomic"]
