"""``lorapack ARGS`` as a foreground job would run it, plus a readiness line for ``test_interrupt.py``.

The command's work is untouched; the hook only writes ``READY`` on stderr once the command is busy: after
the first result of an ``Executor`` batch (worker processes running, in the middle of their jobs) or when
the first twin run starts (``lorapack simulate``, in this process). Then the test sends SIGINT.

SIGINT gets Python's default handler back first: a job started in the background by a non-interactive shell
(how CI may start pytest) ignores SIGINT, and the command would inherit that.
"""

from __future__ import annotations

import signal
import sys


def say_ready() -> None:
    sys.stderr.write("READY\n")
    sys.stderr.flush()


def install_hooks() -> None:
    import lorapack.executor as executor
    import lorapack.twin.run as run

    imap = executor.Executor.imap

    def imap_then_ready(self, fn, jobs):  # noqa: ANN001, ANN202 - a test hook
        first = True
        for item in imap(self, fn, jobs):
            if first:
                say_ready()
                first = False
            yield item

    simulate = run.simulate

    def simulate_after_ready(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - a test hook
        say_ready()
        return simulate(*args, **kwargs)

    executor.Executor.imap = imap_then_ready
    run.simulate = simulate_after_ready


if __name__ == "__main__":  # spawned workers import this file as their __main__: no hooks, no command there
    signal.signal(signal.SIGINT, signal.default_int_handler)
    install_hooks()
    from lorapack.cli import main

    sys.argv = ["lorapack", *sys.argv[1:]]
    main()
