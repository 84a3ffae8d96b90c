"""The docs run as written: every example command of README.md and docs/*.md, from a fresh copy of the
repository, and every figure quoted in them comes from a bench result file.

* Each line of a ```bash block that starts with ``lorapack `` runs (in order, per document) in a fresh copy of
  the repository's files whose parent directory holds ``shared/data`` (a link to the real data, so
  ``../shared/data/...`` resolves as in a clone next to it). Lines with ``...`` placeholders, and lines whose
  comment starts with ``not run``, are shown, not run. ```python blocks run as scripts in the same copy.
* Long examples are shrunk by appending the size flags of ``SHRINK`` (documented in the README's tour of the
  CLI): a shorter window for ``simulate``, ``--limit`` for ``validate`` and ``sweep``. The flags are the
  commands' own, so what runs is still the documented command.
* ``scripts/doc_figures.py --check``: the generated figure blocks match ``bench/results``.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("LORAPACK_DATA", ROOT.parent / "shared" / "data"))
DOCS = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
# appended to long examples (the commands' own flags; the last occurrence of a flag wins)
SHRINK = {
    "simulate": ["--duration-s", "120"],
    "validate": ["--limit", "4", "--workers", "1"],
    "sweep": ["--limit", "6", "--workers", "1"],
}
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def examples(doc: str) -> list[tuple[str, str]]:
    """``(kind, text)`` in document order: ``("cmd", shell line)`` or ``("python", script)``."""
    out: list[tuple[str, str]] = []
    for lang, body in FENCE.findall((ROOT / doc).read_text(encoding="utf-8")):
        if lang == "python":
            out.append(("python", body))
        elif lang in ("bash", "sh", "console"):
            for line in body.splitlines():
                words = shlex.split(line.strip().removeprefix("$ "), comments=True)
                if words[:1] == ["lorapack"] and "..." not in words and not re.search(r"#\s*not run", line):
                    out.append(("cmd", shlex.join(words)))
    return out


def fresh_copy(dst: Path) -> Path:
    """The repository's tracked and new (not ignored) files under ``dst/lorapack``; ``dst/shared/data``."""
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split("\n")
    repo = dst / "lorapack"
    for f in filter(None, files):
        src = ROOT / f
        if src.is_file():
            (repo / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, repo / f)
    if DATA.is_dir():
        (dst / "shared").mkdir()
        (dst / "shared" / "data").symlink_to(DATA)
    return repo


def _lorapack() -> list[str]:
    exe = Path(sys.executable).with_name("lorapack")
    return [str(exe)] if exe.is_file() else [sys.executable, "-m", "lorapack.cli"]


@pytest.mark.slow
@pytest.mark.parametrize("doc", DOCS)
def test_examples_run_as_written(doc: str, tmp_path: Path) -> None:
    todo = examples(doc)
    if not todo:
        pytest.skip(f"{doc} has no runnable examples")
    repo = fresh_copy(tmp_path)
    env = {**os.environ, "COLUMNS": "80"}
    env.pop("LORAPACK_DEBUG", None)
    for kind, text in todo:
        if kind == "cmd":
            if "shared/data" in text and not DATA.is_dir():
                continue
            args = shlex.split(text)[1:]  # (text is shlex.join-ed: comments are gone)
            sub = next((a for a in args if not a.startswith("-")), "")
            cmd = [*_lorapack(), *args, *SHRINK.get(sub, [])]
        else:
            cmd = [sys.executable, "-c", text]
        p = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, f"{doc}: {text}\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}"


def test_doc_figures_come_from_bench_results() -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import doc_figures
    finally:
        sys.path.pop(0)
    assert doc_figures.stale() == [], "run python scripts/doc_figures.py"


def test_examples_are_found() -> None:
    cmds = [t for k, t in examples("README.md") if k == "cmd"]
    assert any(c.startswith("lorapack simulate src/lorapack/examples/demo.yaml") for c in cmds), cmds
    assert not any("..." in c for c in cmds)


def test_the_size_flags_are_documented() -> None:
    """The README says which flags shrink its long examples here: the same as ``SHRINK``."""
    text = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    for cmd, flags in SHRINK.items():
        assert f"`{' '.join(flags)}` for `{cmd}`" in text, (cmd, flags)
