"""Where lorapack's compiled machine code is cached: a user cache directory, never the installed package.

Every ``cache=True`` function of lorapack is declared with ``cached_njit`` (the engine, placement's compiled
helpers): numba's default would write next to the source file, and refuse to import at all on a read-only
install without a writable home directory.

numba keys a cached function by its own source file only, but the engine inlines the step-time code of
``steptime.py`` and the gap binning of ``gaps.py``: the engine's directory is therefore named after a hash of
the three files, so a change of any gets fresh machine code. Every other cached function (placement's and the
learned models' helpers) contains only its own file's code and goes to a directory named after that file
alone: an edit of the engine does not recompile them (a cold ``lorapack place`` would pay ~1 s for it).
Location: ``$LORAPACK_CACHE_DIR``, else ``$XDG_CACHE_HOME/lorapack``, else ``~/.cache/lorapack``; below it
``numba/twin-<hash>`` and ``numba/<file>-<hash>``. Without a writable directory the functions are compiled
in every process (about a second for the engine) and nothing is written anywhere.
"""

from __future__ import annotations

import functools
import hashlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numba
from numba.core import config as numba_config

CACHE_ENV_VAR = "LORAPACK_CACHE_DIR"
SOURCES = ("engine.py", "steptime.py", "gaps.py")  # the files whose code the cached engine contains


def cache_root() -> Path:
    """lorapack's user cache directory (it need not exist)."""
    env = os.environ.get(CACHE_ENV_VAR)
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "lorapack"


def source_hash() -> str:
    here = Path(__file__).parent
    return hashlib.sha256(b"".join((here / f).read_bytes() for f in SOURCES)).hexdigest()[:16]


def _writable(path: Path) -> str | None:
    try:
        path.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
    except OSError:
        return None
    return str(path)


@functools.cache
def twin_cache_dir() -> str | None:
    """The writable cache directory of this version of the twin's sources, or None if there is none."""
    return _writable(cache_root() / "numba" / f"twin-{source_hash()}")


@functools.cache
def cache_dir_for(source: str) -> str | None:
    """The writable cache directory of the functions of one source file, or None if there is none: the
    twin's (``twin_cache_dir``) for the engine's files, else one named after that file's own content."""
    path = Path(source).resolve()
    if path.parent == Path(__file__).resolve().parent and path.name in SOURCES:
        return twin_cache_dir()
    try:
        digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    except OSError:  # no source file to key on (an interactive definition): numba cannot cache it anyway
        return None
    return _writable(cache_root() / "numba" / f"{path.stem}-{digest}")


def cached_njit(**options: Any) -> Callable[[Callable], Any]:
    """``numba.njit(cache=True, **options)`` with the cache in ``cache_dir_for(its file)`` (no caching without
    one).

    numba picks a function's cache location when it is decorated, from ``numba.config.CACHE_DIR``; it is set
    for that moment only, so other packages' numba caches are left alone."""

    def decorate(fn: Callable) -> Any:
        path = cache_dir_for(fn.__code__.co_filename)
        if path is None:
            return numba.njit(**options)(fn)
        before = numba_config.CACHE_DIR
        numba_config.CACHE_DIR = path
        try:
            return numba.njit(cache=True, **options)(fn)
        finally:
            numba_config.CACHE_DIR = before

    return decorate
