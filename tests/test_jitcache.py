"""Compiled code is cached in the user cache directory, keyed by the engine's sources, never in the package."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "lorapack"

PROBE = """
import sys
from lorapack.twin.jitcache import cache_dir_for, cached_njit

@cached_njit()
def add(a, b):
    return a + b

assert add(2, 3) == 5
print(cache_dir_for(__file__))
"""


def test_every_cached_function_goes_through_cached_njit() -> None:
    """numba's own cache=True writes next to the source file (and cannot import from a read-only install)."""
    bad = [f"{p.relative_to(SRC.parent)}:{i}" for p in SRC.rglob("*.py") if p.name != "jitcache.py"
           for i, line in enumerate(p.read_text().splitlines(), 1) if re.search(r"\bcache\s*=\s*True", line)]
    assert not bad, "use twin.jitcache.cached_njit instead of cache=True: " + ", ".join(bad)


def _probe(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    module = tmp_path / "probe_mod.py"
    module.write_text(textwrap.dedent(PROBE))
    full_env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", **env}
    return subprocess.run([sys.executable, str(module)], env=full_env, capture_output=True, text=True,
                          cwd=tmp_path, timeout=300)


def test_cache_goes_to_lorapack_cache_dir_under_the_source_hash(tmp_path: Path) -> None:
    """The engine's functions under the hash of the engine's sources, any other under its own file's hash."""
    import hashlib

    from lorapack.twin import engine
    from lorapack.twin.jitcache import cache_dir_for, source_hash

    cache = tmp_path / "cache"
    out = _probe(tmp_path, LORAPACK_CACHE_DIR=str(cache))
    assert out.returncode == 0, out.stderr[-2000:]
    where = Path(out.stdout.strip().splitlines()[-1])
    assert where == cache / "numba" / f"probe_mod-{hashlib.sha256(PROBE.encode()).hexdigest()[:16]}"
    assert Path(cache_dir_for(engine.__file__)).name == f"twin-{source_hash()}"
    assert list(where.rglob("*.nbi")), "nothing was cached"
    assert not list(tmp_path.glob("__pycache__/*.nbi")), "numba wrote next to the source file"


def test_no_writable_cache_directory_compiles_without_caching(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache directory would go")
    out = _probe(tmp_path, LORAPACK_CACHE_DIR=str(blocker))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "None"
    assert not list(tmp_path.glob("__pycache__/*.nbi"))
