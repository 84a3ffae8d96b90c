"""Where lorapack's compiled machine code is cached: a user cache directory, never the installed package.

Every ``cache=True`` function of lorapack is declared with ``cached_njit`` (the engine, placement's compiled
helpers): numba's default would write next to the source file, and refuse to import at all on a read-only
install without a writable home directory.

numba keys a cached function by its own source file only, but the engine inlines the step-time code of
``steptime.py`` and the gap binning of ``gaps.py``: the engine's directory is therefore named after a hash of
the three files, so a change of any gets fresh machine code. Every other cached function (placement's and the
learned models' helpers) contains only its own file's code and goes to a directory named after that file
alone: an edit of the engine does not recompile them (a cold ``lorapack place`` would pay ~1 s for it).
``lazy_njit`` declares a function that is compiled at its first call, and numba imported then: the
learned models' and placement's helpers, so a command that never calls them (``lorapack place
--no-verify`` answers small batches in numpy, see ``surrogate.forest``) never pays numba's import and
set-up (0.5-1 s in a fresh process). Only the engine, whose compiled functions call each other, is
declared with ``cached_njit``.
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

    import numba  # here, not at the top: importing this module costs nothing (``lazy_njit``)
    from numba.core import config as numba_config

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


class LazyKernel:
    """A function compiled (``cached_njit``) at its first call rather than at its declaration.

    Callable from Python only: another compiled function cannot call it (the engine's helpers use
    ``cached_njit``). ``compiled`` tells whether numba has been set up for it; ``prefer_numpy(work)`` lets
    a caller with a numpy twin of the function use that instead while the kernel is not compiled yet, for
    at most ``numpy_budget`` units of work per process (beyond it, compiling once is cheaper)."""

    def __init__(self, fn: Callable, numpy_budget: int, options: dict[str, Any]) -> None:
        self.py_func = fn
        self.numpy_budget = numpy_budget
        self.numpy_work = 0  # units of work done by the numpy twin in this process
        self._options = options
        self._dispatcher: Any = None
        functools.update_wrapper(self, fn)

    @property
    def compiled(self) -> bool:
        return self._dispatcher is not None

    def prefer_numpy(self, work: int) -> bool:
        """True (and ``work`` counted) when the numpy twin should do ``work`` units: the kernel is not
        compiled and the twin's work in this process stays within its budget."""
        if self._dispatcher is not None or self.numpy_work + work > self.numpy_budget:
            return False
        self.numpy_work += work
        return True

    def __call__(self, *args: Any) -> Any:
        if self._dispatcher is None:
            self._dispatcher = cached_njit(**self._options)(self.py_func)
        return self._dispatcher(*args)


def lazy_njit(numpy_budget: int = 0, **options: Any) -> Callable[[Callable], LazyKernel]:
    """``cached_njit(**options)``, compiled at the first call (``LazyKernel``)."""

    def decorate(fn: Callable) -> LazyKernel:
        return LazyKernel(fn, numpy_budget, options)

    return decorate
