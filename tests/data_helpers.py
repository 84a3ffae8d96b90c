"""Scratch copies of the shared data for error-path tests: symlinks, never copies into the repository."""

from __future__ import annotations

import csv
from collections.abc import Callable
from pathlib import Path


def mirror_data_dir(src: Path, dst: Path) -> Path:
    """``dst`` with a symlink to every CSV below ``src`` (same relative paths)."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.rglob("*.csv"):
        t = dst / f.relative_to(src)
        t.parent.mkdir(parents=True, exist_ok=True)
        t.symlink_to(f)
    return dst


def rewrite_csv(path: Path, edit: Callable[[list[dict]], tuple[list[dict], list[str]]]) -> None:
    """Replace the symlink ``path`` by an edited copy of its target; ``edit(rows) -> (rows, columns)``."""
    src = path.resolve()
    path.unlink()
    with src.open(newline="") as f:
        rows = list(csv.DictReader(f))
    rows, cols = edit(rows)
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
