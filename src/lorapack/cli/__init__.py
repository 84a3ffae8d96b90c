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
    refine_trees,
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
                   ("place", place.place), ("evaluate", evaluate.evaluate)):
    _command(_name, _fn)


def _show_warnings() -> None:
    """lorapack's warnings as one ``warning:`` line each on stderr (each distinct message once); others as usual."""
    plain = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):  # noqa: ANN001 - warnings' signature
        if issubclass(category, LorapackWarning):
            err_console.print(f"[yellow]warning:[/yellow] {escape(str(message))}", highlight=False, soft_wrap=True)
        else:
            plain(message, category, filename, lineno, file, line)

    warnings.showwarning = show
    warnings.filterwarnings("once", category=LorapackWarning)


def main() -> None:
    """Console entry point: user errors -> one line on stderr, exit code 2."""
    _show_warnings()
    try:
        app(standalone_mode=False)
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
    except (KeyboardInterrupt, BrokenPipeError):
        sys.exit(130)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except Exception as e:  # click usage errors and aborts
        usage, aborts = _click_exception_types()
        if isinstance(e, aborts):
            sys.exit(130)
        if isinstance(e, usage):  # click's message on one line, like lorapack's own errors
            ctx = getattr(e, "ctx", None)
            where = f" (see: {ctx.command_path} --help)" if ctx is not None else ""
            err_console.print(f"[red]error:[/red] {escape(' '.join(e.format_message().split()))}{where}",
                              highlight=False, soft_wrap=True)
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
