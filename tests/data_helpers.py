"""Test helpers: scratch copies of the shared data (symlinks, never copies into the repository) and an
in-process run of the console entry point."""

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


def run_main(monkeypatch, capsys, *args) -> tuple[int, str, str]:
    """The console entry point in-process (``sys.argv`` patched): ``(exit code, stdout, stderr)``."""
    import sys

    from lorapack.cli import main

    monkeypatch.setattr(sys, "argv", ["lorapack", *[str(a) for a in args]])
    code = 0
    try:
        main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    out, err = capsys.readouterr()
    return code, out, err
