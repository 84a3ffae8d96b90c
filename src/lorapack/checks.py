"""Checks every command shares: input files, output paths (checked before the work starts), atomic writes,
and the option values that mean the same in every command (``--workers``, ``--limit``).

Conventions (the same in every command):

* an input that should be a file but is a directory says so (not "file not found");
* an output file's directory must exist and be writable, and the path must not be a directory; an output
  directory is created when missing (its parent must exist: lorapack never creates missing parents);
* outputs are written through a temporary file in the same directory and renamed into place, so a failed
  command leaves neither a half-written output nor a ``.tmp`` file;
* ``--workers N``: N >= 0, 0 = all cores; ``--limit K``: K >= 1.

All problems raise ``SpecError`` (one line, exit code 2 in the CLI).
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .errors import SpecError


def _why(exc: OSError) -> str:
    return exc.strerror or type(exc).__name__


# ---------------------------------------------------------------------------------------------------------
# inputs


def input_file_problem(path: str | Path) -> str | None:
    """None when ``path`` is a readable regular file, else what is wrong with it (for a message)."""
    p = Path(path)
    if p.is_file():
        return None if os.access(p, os.R_OK) else "file is not readable"
    if p.is_dir():
        return "is a directory; expected a file"
    if p.exists():
        return "not a regular file"
    return "file not found"


def check_input_file(path: str | Path, what: str = "", error: type[Exception] = SpecError) -> Path:
    """``path`` as a Path if it is a readable file, else ``error``: ``"<what> not found: <path>"`` or
    ``"<what> <path>: <problem>"`` (e.g. ``profile p.yaml: is a directory; expected a file``)."""
    problem = input_file_problem(path)
    if problem == "file not found" and what:
        raise error(f"{what} not found: {path}")
    if problem is not None:
        raise error(f"{what + ' ' if what else ''}{path}: {problem}")
    return Path(path)


# ---------------------------------------------------------------------------------------------------------
# outputs


def _probe(directory: Path, option: str, target: Path) -> None:
    """Create and remove a file in ``directory``: the only test that also sees read-only mounts and ACLs."""
    name = directory / f".lorapack-probe-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:
        raise SpecError(f"{option} {target}: cannot write in {directory} ({_why(exc)})") from None
    os.close(fd)
    os.unlink(name)


def _label(option: str, path: Path) -> str:
    return f"{option} {path}" if option else str(path)


def check_output_file(path: str | Path, option: str = "") -> Path:
    """Check, before any work, that ``path`` can be written as a file; returns it as a Path.

    Refused: an existing directory, an existing non-regular file, a missing or non-directory parent, a
    parent this process cannot write in, an existing file it cannot replace."""
    p = Path(path).expanduser()
    label = _label(option, p)
    if p.is_dir():
        raise SpecError(f"{label}: is a directory; expected a file path")
    if p.exists() and not p.is_file():
        raise SpecError(f"{label}: exists and is not a regular file")
    parent = p.parent
    if not parent.exists():
        raise SpecError(f"{label}: directory {parent} does not exist")
    if not parent.is_dir():
        raise SpecError(f"{label}: {parent} is not a directory")
    _probe(parent, option, p)
    return p


def check_output_dir(path: str | Path, option: str = "", create: bool = False) -> Path:
    """Check, before any work, that ``path`` is (or can become) a writable directory; returns it as a Path.

    A missing directory is fine when its parent exists and is writable (``create=True`` makes it now; by
    default the command makes it when it first writes, so a failure before that leaves nothing)."""
    p = Path(path).expanduser()
    label = _label(option, p)
    if p.exists():
        if not p.is_dir():
            raise SpecError(f"{label}: exists and is not a directory")
        _probe(p, option, p)
        return p
    parent = p.parent
    if not parent.exists():
        raise SpecError(f"{label}: directory {parent} does not exist (lorapack creates {p.name}/ but not its "
                        f"parents)")
    if not parent.is_dir():
        raise SpecError(f"{label}: {parent} is not a directory")
    _probe(parent, option, p)
    if create:
        p.mkdir()
    return p


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A fresh temporary path next to ``path``, renamed over ``path`` when the block succeeds and removed
    when it fails (whatever the error), so readers never see a half-written file and nothing is left over.

    Permissions are those of a normally created file (the umask applies)."""
    p = Path(path)
    tmp = p.with_name(f".{p.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    try:
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    except OSError as exc:
        raise SpecError(f"cannot write {p}: {_why(exc)}") from None
    try:
        yield tmp
        os.replace(tmp, p)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise SpecError(f"cannot write {p}: {_why(exc)}") from None
        raise


def write_text_atomic(path: str | Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def fill_marked_section(path: str | Path, begin: str, end: str, body: str) -> None:
    """Replace the text between the markers ``begin`` and ``end`` of the file at ``path`` with ``body`` (the
    markers and the text around them kept; written atomically). ``SpecError`` when a marker is missing."""
    p = Path(path)
    text = p.read_text(encoding="utf-8")
    if begin not in text or end not in text:
        raise SpecError(f"{p} has no {begin} ... {end} section")
    before, rest = text.split(begin, 1)
    _, after = rest.split(end, 1)
    write_text_atomic(p, f"{before}{begin}\n{body}\n{end}{after}")


# ---------------------------------------------------------------------------------------------------------
# option values shared by several commands


def check_workers(workers: int, option: str = "--workers") -> int:
    """Parallel workers: an integer >= 0, 0 = all cores."""
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
        raise SpecError(f"{option} {workers}: expected an integer >= 0 (0 = all cores)")
    return workers


def check_limit(limit: int | None, option: str = "--limit") -> int | None:
    """Only the first K items: an integer >= 1 (None = all)."""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise SpecError(f"{option} {limit}: expected an integer >= 1")
    return limit
