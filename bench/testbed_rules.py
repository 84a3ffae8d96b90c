"""Testbed bench: how often the twin orders first tokens as a real vLLM does, on the staircase workloads.

Starts one testbed server per ``--max-loras`` value (the six staircase adapters), sends each staircase design
``--reps`` times (``lorapack.testbed.staircase``), and prints and saves, per design and slot count, the
first-token order agreement with the twin over the request pairs with different adapters sent >= 20 ms apart
(the testbed issue's target: >= 95 %), with the client's largest send lag. Needs the testbed (``make testbed``).

Usage: ``python bench/testbed_rules.py [--reps 5] [--out bench/results/testbed_rules.json]``
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np

from lorapack.profile import find_profile
from lorapack.testbed.env import INSTALL_HINT, find_testbed
from lorapack.testbed.server import start_server
from lorapack.testbed.staircase import ADAPTERS, DESIGNS, run_staircase, server_flags, vllm_args


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--max-loras", default="2,3")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "testbed_rules.json")
    args = ap.parse_args()
    tb = find_testbed()
    if tb is None:
        raise SystemExit(f"testbed not installed: {INSTALL_HINT}")
    llama = find_profile("llama-3.1-8b-instruct")
    rows = []
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as logs:
        for a in (int(x) for x in args.max_loras.split(",")):
            server = start_server(tb, ADAPTERS, vllm_args(server_flags(a)), Path(logs))
            try:
                for rep in range(args.reps):
                    for name in DESIGNS:
                        run = run_staircase(server.url, llama, name, a)
                        rows.append(dict(run.summary(), rep=rep))
                        print(f"max_loras {a} {name:11s} rep {rep}: agreement {run.agreement:.3f} over "
                              f"{run.pairs} pairs (send lag {run.max_send_lag_s * 1000:.0f} ms, outside the engine "
                              f"{run.max_outside_engine_s * 1000:.0f} ms, "
                              f"attempt {run.counted} of {run.attempts})", flush=True)
            finally:
                server.stop()
    summary = {}
    for a in sorted({r["max_loras"] for r in rows}):
        for name in DESIGNS:
            shares = [r["agreement"] for r in rows if r["max_loras"] == a and r["design"] == name]
            summary[f"{name}/max_loras={a}"] = {"mean": round(float(np.mean(shares)), 4),
                                                "min": round(float(np.min(shares)), 4),
                                                "runs_at_or_above_0.95": sum(s >= 0.95 for s in shares),
                                                "runs": len(shares)}
    print(json.dumps(summary, indent=1))
    out = {"bench": "testbed_rules", "vllm": tb.vllm_version, "reps": args.reps, "summary": summary, "runs": rows,
           "wall_s": round(time.monotonic() - t0, 1), "machine": platform.machine(), "cores": os.cpu_count(),
           "load_avg_end": os.getloadavg(), "date": time.strftime("%Y-%m-%d")}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
