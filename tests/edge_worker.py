"""A long-lived subprocess for the edge-case tests: it runs one case per request, so that a crash (SIGSEGV) or
a hang takes down only this process and the test can say which input did it.

Protocol: one request per line on stdin, one JSON reply per line on stdout. A request is a base64 pickle of a
dict (test-made data only):

* ``{"kind": "cli", "argv": [...], "cwd": dir}``: ``lorapack.cli.main()`` with that command line;
* ``{"kind": "py", "code": "...", "cwd": dir}``: a Python snippet;
* ``{"kind": "api", "entry": name, ...}``: one public twin entry point on given arrays (``_api``).

The reply is ``{"code": exit code, "stdout": ..., "stderr": ...}``; an exception that is not a ValueError
leaves its traceback in ``stderr`` and code 1.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import pickle
import sys
import traceback


def encode(request: dict) -> bytes:
    return base64.b64encode(pickle.dumps(request)) + b"\n"


def _api(req: dict) -> None:
    """Feed arrays to a public entry point; a ValueError is the documented outcome for bad input."""
    import numpy as np

    from lorapack.profile import find_profile
    from lorapack.server import ServerConfig
    from lorapack.twin.engine import Engine, simulate_fast
    from lorapack.twin.run import engine_config, resolve_server, simulate_requests
    from lorapack.twin.types import RequestArrays

    t, a, p, o = req["arrays"]
    ranks = np.asarray(req["ranks"])
    prof = find_profile("llama-3.1-8b-instruct")
    entry = req["entry"]
    try:
        if entry == "sorted":
            arrays = RequestArrays.sorted(t, a, p, o)
            entry = "simulate_requests"
        else:
            arrays = RequestArrays(t, a, p, o)
        flags = ServerConfig(max_loras=req["max_loras"])
        if entry == "simulate_requests":
            m, _ = simulate_requests(prof, ranks, arrays, flags, req["duration_s"])
            print(json.dumps({k: getattr(m, k) for k in ("n_arrived", "n_completed", "oom")}))
            return
        srv = resolve_server(prof, ranks, flags)
        cfg = engine_config(prof, ranks, srv, req["duration_s"])
        if entry == "simulate_fast":
            res = simulate_fast(cfg, arrays)
        else:
            res = Engine(cfg, arrays).advance_to(req["duration_s"] / 2).advance_to(float("inf")).result()
        print(json.dumps({"n_steps": res.n_steps}))
    except ValueError as e:
        print(f"{type(e).__name__}: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def run(req: dict) -> dict:
    out, err = io.StringIO(), io.StringIO()
    code = 0
    home = os.getcwd()
    try:
        if req.get("cwd"):
            os.chdir(req["cwd"])
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                if req["kind"] == "cli":
                    from lorapack.cli import main

                    sys.argv = ["lorapack", *req["argv"]]
                    main()
                elif req["kind"] == "py":
                    exec(compile(req["code"], "<case>", "exec"), {"__name__": "__case__"})
                else:
                    _api(req)
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except BaseException:
                traceback.print_exc()
                code = 1
    finally:
        os.chdir(home)
    return {"code": code, "stdout": out.getvalue(), "stderr": err.getvalue()}


def main() -> None:
    for line in sys.stdin.buffer:
        reply = run(pickle.loads(base64.b64decode(line)))
        sys.__stdout__.write(json.dumps(reply) + "\n")
        sys.__stdout__.flush()


if __name__ == "__main__":
    main()
