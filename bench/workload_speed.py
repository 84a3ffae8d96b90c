"""Request generation speed: 1.3 M Poisson arrivals over 384 adapters for one hour (fixed lengths), the load of
the largest evaluate scenarios. Target: well under 0.3 s on an idle core (best of 3 seeds).

Prints the figures and writes ``bench/results/workload_speed.json``. (Was a timed assertion in
``tests/test_workload.py``; performance is measured here, not in tests.)

Usage: ``python bench/workload_speed.py``
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

from lorapack.spec import Adapter, LengthsSpec, Workload
from lorapack.workload import generate_requests

HERE = Path(__file__).resolve().parent
TARGET_S = 0.3


def main() -> None:
    rate_rps = 1.3e6 / 3600 / 384
    w = Workload(adapters=[Adapter(adapter_id=f"a{k}", rank=8, rate_rps=rate_rps) for k in range(384)],
                 lengths=LengthsSpec(kind="fixed"))
    generate_requests(w, 3600.0, 0)  # warm caches
    times = []
    for seed in range(3):
        t0 = time.perf_counter()
        req = generate_requests(w, 3600.0, seed)
        times.append(time.perf_counter() - t0)
    out = {"requests": len(req), "adapters": 384, "best_s": min(times), "times_s": times, "target_s": TARGET_S,
           "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "load_avg": os.getloadavg()[0]}}
    print(f"{len(req):,} requests over 384 adapters: best {min(times):.3f} s of {[round(t, 3) for t in times]} "
          f"(target {TARGET_S} s; load {out['machine']['load_avg']:.1f})")
    path = HERE / "results" / "workload_speed.json"
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
