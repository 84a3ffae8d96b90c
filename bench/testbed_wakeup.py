"""Testbed bench: how late a real-tier client wakes beside a load, with its servers in its session or in their own.

The real tier's client runs at nice -20 and its servers ``SERVER_NICE`` steps below (``lorapack.testbed.server``).
With the kernel's autogroup scheduling niceness orders tasks only within one session, so where the servers
live decides whether the client's lead holds (docs/testbed.md, "Why: niceness stops at the session"). This
bench starts, beside a client loop that sleeps 5 ms and records how late it wakes:

* ``--spinners`` busy loops at nice 0 in the client's session (another process keeping the cores busy);
* two stand-in "servers" (busy 50 ms, asleep 1 ms, as an engine stepping a loaded batch), ``SERVER_NICE`` steps
  below the client, started by ``guarded`` (their own process group, the client's session: ``session``) or in a
  session of their own (``own-session``, the guard's former way).

It prints and saves the wake-up delay's p99 and maximum and the stalls over 100 ms for each placement, in turn,
``--rounds`` times. Run it as root (or with ``CAP_SYS_NICE``) for the client's nice -20; otherwise it runs at the
niceness it has and says so. Needs no testbed.

Usage: ``python bench/testbed_wakeup.py [--seconds 40] [--rounds 2] [--out bench/results/testbed_wakeup.json]``
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from lorapack.testbed.server import CLIENT_NICE, SERVER_NICE, guarded, raise_priority, stop_tree

SPIN = "x = 0\nwhile True:\n    x += 1\n"
# an engine stepping a loaded batch: busy 50 ms, then a short wait for the next step's work
STAND_IN_SERVER = ("import time\nwhile True:\n    t = time.monotonic()\n    while time.monotonic() - t < 0.05:\n"
                   "        pass\n    time.sleep(0.001)\n")


SLEEP_S = 0.005  # the client loop's sleep: a wake-up's lateness is its interval less this


def wakeups(seconds: float, sleep_s: float = SLEEP_S) -> np.ndarray:
    """The intervals between the wake-ups of a loop that sleeps ``sleep_s``, for ``seconds``."""
    gaps = []
    end = time.monotonic() + seconds
    last = time.monotonic()
    while last < end:
        time.sleep(sleep_s)
        now = time.monotonic()
        gaps.append(now - last)
        last = now
    return np.array(gaps)


def one_round(placement: str, seconds: float, spinners: int) -> dict:
    load = [subprocess.Popen([sys.executable, "-c", SPIN], process_group=0,
                             preexec_fn=lambda: os.setpriority(os.PRIO_PROCESS, 0, 0))  # noqa: PLW1509
            for _ in range(spinners)]
    if placement == "session":
        servers = [guarded([sys.executable, "-c", STAND_IN_SERVER], nice=SERVER_NICE) for _ in range(2)]
    else:
        servers = [subprocess.Popen(["nice", "-n", str(SERVER_NICE), sys.executable, "-c", STAND_IN_SERVER],
                                    start_new_session=True) for _ in range(2)]
    try:
        time.sleep(1.0)  # all running
        gaps = wakeups(seconds)
    finally:
        for p in load:
            p.kill()
            p.wait()
        for p in servers:
            stop_tree(p)
    late_ms = (gaps - SLEEP_S) * 1000.0
    return {"placement": placement, "wakeups": int(gaps.size), "late_p50_ms": round(float(np.median(late_ms)), 2),
            "late_p99_ms": round(float(np.percentile(late_ms, 99)), 2), "late_max_ms": round(float(late_ms.max()), 1),
            "stalls_over_100ms": int((late_ms > 100).sum())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=40.0, help="measuring time per round and placement")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--spinners", type=int, default=2, help="busy loops at nice 0 in the client's session")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "testbed_wakeup.json")
    args = ap.parse_args()
    client_nice = raise_priority()
    if client_nice != CLIENT_NICE:
        print(f"running at nice {client_nice}: raising it to {CLIENT_NICE} is not permitted here", flush=True)
    autogroup = Path("/proc/sys/kernel/sched_autogroup_enabled")
    autogroup_on = autogroup.exists() and autogroup.read_text().strip() == "1"
    rows = []
    for rnd in range(args.rounds):
        for placement in ("own-session", "session"):
            row = dict(one_round(placement, args.seconds, args.spinners), round=rnd)
            rows.append(row)
            print(f"round {rnd} servers in {placement:11s}: late p50 {row['late_p50_ms']:.2f} ms, p99 "
                  f"{row['late_p99_ms']:.2f} ms, max {row['late_max_ms']:.1f} ms, stalls > 100 ms "
                  f"{row['stalls_over_100ms']} of {row['wakeups']}", flush=True)
    summary = {p: {"late_p99_ms_max": max(r["late_p99_ms"] for r in rows if r["placement"] == p),
                   "late_max_ms_max": max(r["late_max_ms"] for r in rows if r["placement"] == p)}
               for p in ("own-session", "session")}
    out = {"bench": "testbed_wakeup", "date": time.strftime("%Y-%m-%d"), "machine": platform.processor() or
           platform.machine(), "cpus": os.cpu_count(), "kernel": platform.release(), "autogroup": autogroup_on,
           "client_nice": client_nice, "server_nice_steps": SERVER_NICE, "spinners": args.spinners,
           "seconds": args.seconds, "rows": rows, "summary": summary}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(summary), f"-> {args.out}")


if __name__ == "__main__":
    main()
