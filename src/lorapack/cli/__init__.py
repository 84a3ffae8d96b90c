"""The ``lorapack`` command line: parse, call the API, render with rich, map errors to exit code 2.

One module per command (``simulate.py``, ``validate.py``, ...); shared helpers in ``common.py`` (a leaf).
This module only builds the typer app, registers the commands and maps errors in ``main()``.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable
from concurrent.futures.process import BrokenProcessPool
from typing import Annotated

import typer
from rich.markup import escape

from ..errors import LorapackError, LorapackWarning
from . import (
    calibrate,
    demo,
    evaluate,
    explain,
    measure,
    place,
    profiles,
    rates,
    refine_trees,
    serve,
    simulate,
    sweep,
    train,
    validate,
)
from .common import DEBUG as _DEBUG
from .common import err_console, print_json, write_csv_atomic

__all__ = ["app", "main", "print_json", "write_csv_atomic"]

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Plan multi-LoRA serving on vLLM with a fast digital twin of the server.")


@app.callback()
def _main(debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks on errors.")] = False) -> None:
    _DEBUG["on"] = debug


def _command(name: str, fn: Callable[..., None]) -> None:
    """Register ``fn`` as ``lorapack NAME``; the command list shows its docstring's first paragraph as one
    line (typer would keep the docstring's line breaks there and wrap the rest raggedly)."""
    first = (fn.__doc__ or "").strip().split("\n\n")[0]
    app.command(name, short_help=" ".join(first.split()))(fn)


for _name, _fn in (("simulate", simulate.simulate), ("validate", validate.validate), ("profiles", profiles.profiles),
                   ("demo", demo.demo), ("sweep", sweep.sweep), ("measure", measure.measure),
                   ("calibrate", calibrate.calibrate),
                   ("train", train.train), ("refine", refine_trees.refine), ("explain", explain.explain),
                   ("place", place.place), ("evaluate", evaluate.evaluate), ("rates", rates.rates)):
    _command(_name, _fn)
# vllm serve's other flags reach ``serve`` as extra arguments (a warning each: the twin ignores them)
app.command("serve", short_help=" ".join((serve.serve.__doc__ or "").strip().split("\n\n")[0].split()),
            context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(serve.serve)


def _show_warnings() -> None:
    """lorapack's warnings as one ``warning:`` line each on stderr (each distinct message once); others as usual."""
    plain = warnings.showwarning
    shown: set[str] = set()  # the "once" filter is kept per calling module (and reset when filters change)

    def show(message, category, filename, lineno, file=None, line=None):  # noqa: ANN001 - warnings' signature
        if issubclass(category, LorapackWarning):
            text = str(message)
            if text in shown:  # the same warning from another caller (e.g. every twin run of a plan): once
                return
            shown.add(text)
            err_console.print(f"[yellow]warning:[/yellow] {escape(text)}", highlight=False, soft_wrap=True)
        else:
            plain(message, category, filename, lineno, file, line)

    warnings.showwarning = show
    warnings.filterwarnings("once", category=LorapackWarning)


def _quiet_resource_tracker() -> None:
    """multiprocessing's resource tracker (its own process, started with this environment) warns at exit about
    the semaphores of worker processes that Ctrl-C stopped (a nested pool's, with evaluate --jobs); it frees them
    itself, and the warning would break "interrupted" as the one line of a Ctrl-C (seen on a slow machine)."""
    quiet = "ignore::UserWarning:multiprocessing.resource_tracker"
    if quiet not in os.environ.get("PYTHONWARNINGS", ""):
        os.environ["PYTHONWARNINGS"] = ",".join(w for w in (os.environ.get("PYTHONWARNINGS"), quiet) if w)


INTERRUPTED_EXIT = 130  # 128 + SIGINT, what a shell reports for a command stopped by Ctrl-C


def _interrupted() -> None:
    """Ctrl-C (SIGINT): stop every worker process at once (their running jobs are abandoned; outputs are
    written atomically at the end, so none is half-written), one line on stderr, exit 130. A second Ctrl-C
    while stopping is ignored: the workers are being stopped anyway."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from ..executor import stop_all_workers

    stop_all_workers()
    try:
        err_console.print("interrupted", highlight=False, soft_wrap=True)
    except (BrokenPipeError, OSError):
        pass
    sys.exit(INTERRUPTED_EXIT)


def _is_console_process() -> bool:
    """This process runs ``lorapack`` itself (the console script or ``python -m lorapack.cli``), not a caller
    of ``main()`` such as a test run."""
    top = sys.modules.get("__main__")
    spec = getattr(top, "__spec__", None)
    if spec is not None and spec.name == "lorapack.cli.__main__":
        return True
    return os.path.basename(getattr(top, "__file__", None) or "") == "lorapack"


def _exit_now(code: object) -> None:
    """End the process as ``sys.exit(code)`` would, without the interpreter's teardown: after numba has run,
    freeing its compiled code and the rest of ~1,200 modules takes 0.3-0.4 s (a third of a cold ``lorapack
    place``), for nothing the command needs. The exit handlers still run (worker pools stopped, logging
    flushed) and the standard streams are flushed; if a thread is still running after them, the normal exit
    (which waits for it) follows instead."""
    import atexit
    import threading

    atexit._run_exitfuncs()  # (they may run again in the normal exit: lorapack's are idempotent)
    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        sys.exit(code)
    if code is None:
        status = 0
    elif isinstance(code, int) and not isinstance(code, bool):
        status = code
    else:  # sys.exit("message"): printed, status 1
        sys.stderr.write(f"{code}\n")
        status = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream
            pass
    os._exit(status)


def main() -> None:
    """Console entry point: user errors -> one line on stderr, exit code 2; Ctrl-C -> one line, exit 130."""
    try:
        _main()
    except SystemExit as e:
        if not _is_console_process():
            raise
        _exit_now(e.code)
    if _is_console_process():
        _exit_now(0)


def _main() -> None:
    _show_warnings()
    _quiet_resource_tracker()
    try:
        code = app(standalone_mode=False)  # typer returns the code of an Exit (Ctrl-C: Exit(130)), else None
        if isinstance(code, int) and not isinstance(code, bool) and code != 0:
            if code == INTERRUPTED_EXIT:
                _interrupted()
            sys.exit(code)
    except LorapackError as e:
        if _DEBUG["on"] or os.environ.get("LORAPACK_DEBUG"):
            raise
        err_console.print(f"[red]error:[/red] {escape(str(e))}", highlight=False, soft_wrap=True)
        sys.exit(2)
    except MemoryError:  # past the guards' estimate (or with --force): still one line, not a traceback
        if _DEBUG["on"] or os.environ.get("LORAPACK_DEBUG"):
            raise
        err_console.print("[red]error:[/red] out of memory: this run needs more memory than is free on this "
                          "machine; use a shorter --duration-s or fewer requests", highlight=False, soft_wrap=True)
        sys.exit(2)
    except BrokenProcessPool:  # a worker was killed (e.g. by the kernel's OOM killer) or could not start
        if _DEBUG["on"] or os.environ.get("LORAPACK_DEBUG"):
            raise
        err_console.print("[red]error:[/red] a worker process died abruptly (killed, out of memory, or it could "
                          "not start); run again with --workers 1 to see the cause in this process",
                          highlight=False, soft_wrap=True)
        sys.exit(1)
    except KeyboardInterrupt:  # outside the command itself (typer turns one inside into Exit(130))
        _interrupted()
    except BrokenPipeError:
        sys.exit(130)
    except typer.Exit as e:
        if e.exit_code == INTERRUPTED_EXIT:
            _interrupted()
        sys.exit(e.exit_code)
    except Exception as e:  # click usage errors and aborts
        usage, aborts = _click_exception_types()
        if isinstance(e, aborts):  # end of input at a prompt
            sys.exit(130)
        if isinstance(e, usage):  # click's message on one line, like lorapack's own errors
            ctx = getattr(e, "ctx", None)
            where = f" (see: {ctx.command_path} --help)" if ctx is not None else ""
            message = " ".join(e.format_message().split())
            if message:  # none after `lorapack` alone: the help was shown (exit 2 as click has it)
                err_console.print(f"[red]error:[/red] {escape(message)}{where}", highlight=False, soft_wrap=True)
            sys.exit(2)
        raise


def _click_exception_types() -> tuple[tuple[type, ...], tuple[type, ...]]:
    """Usage-error and abort classes: typer >= 0.2x vendors click as ``typer._click``, older typer uses click."""
    import importlib

    usage: list[type] = []
    aborts: list[type] = [typer.Abort] if hasattr(typer, "Abort") else []
    for name in ("typer._click.exceptions", "click.exceptions"):
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        usage.append(mod.ClickException)
        if hasattr(mod, "Abort"):
            aborts.append(mod.Abort)
    return tuple(usage), tuple(aborts)
