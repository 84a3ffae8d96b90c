"""Re-planning speed: ``place(..., PlaceConfig(previous=...))`` on 1,280 adapters with 10 % of the rates changed.

Target (issue 25): <= 1 s without verification. The previous plan is ``proposed``'s for the instance of
``bench/placement_speed.py`` (1,280 adapters, ranks 8 / 16, Dirichlet(0.5) rates summing to 20 req/s, seed 2026);
the next window draws 10 % of the adapters (seeded) and multiplies their rates by a log-normal factor (median 1,
sigma ``--sigma``, default 0.7: about half of them rise, some by 2x and more). Scenarios:

* ``unchanged``: the same rates (must move nothing);
* ``changed``: 10 % changed, no cap on the optional moves; ``changed-k0``: the same with ``--max-moves 0``;
* ``hot``: 10 % of the rates x 6 (GPUs fail: needed moves, and a GPU to save afterwards); ``hot-k40``: the same
  with ``--max-moves 40``.

Timed: the whole ``place()`` call (the re-plan and the from-scratch plan it reports against), the re-plan alone
(``placement_ms``), the from-scratch plan (``diagnostics.from_scratch_ms``); learned models loaded beforehand
(the first, cold call is reported apart). Median of ``--reps``. Results: ``bench/results/replan_speed.json``.

Usage: ``python bench/replan_speed.py [--reps 5] [--sigma 0.7]``
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("NUMBA_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from placement_speed import make  # noqa: E402  (the bench directory is not a package)

TARGET_MS = 1000.0
N, TOTAL_RPS, CHANGED = 1280, 20.0, 0.10


def _changed(inst, factor, seed: int):
    import numpy as np

    from lorapack.placement import make_instance

    rng = np.random.default_rng(seed)
    rates = inst.rates_rps.copy()
    idx = rng.choice(inst.n, int(CHANGED * inst.n), replace=False)
    rates[idx] *= factor(rng, len(idx))
    return make_instance(list(inst.adapter_ids), inst.ranks, rates, mean_input_tokens=223, mean_output_tokens=197,
                         headroom=0.0)


def _cli(inst, tmp: Path, reps: int) -> dict:
    """``lorapack place NEW.csv --previous w0 --no-verify`` in fresh processes: what an operator waits for
    (imports, the learned models' loading, the from-scratch plan, writing every file)."""
    import subprocess

    csv = tmp / "new.csv"
    csv.write_text("adapter_id,rank,rate_rps\n" + "".join(
        f"{a},{int(r)},{float(x)!r}\n" for a, r, x in zip(inst.adapter_ids, inst.ranks, inst.rates_rps, strict=True)))
    exe = Path(sys.executable).with_name("lorapack")
    walls, last = [], {}
    for k in range(reps):
        t = time.perf_counter()
        p = subprocess.run([str(exe), "place", str(csv), "-m", "llama-3.1-8b-instruct", "--previous", str(tmp / "w0"),
                            "--no-verify", "--headroom", "0", "--out", str(tmp / f"cli{k}"), "--json"],
                           capture_output=True, text=True, check=True)
        walls.append(time.perf_counter() - t)
        last = json.loads(p.stdout)
    return {"wall_s": statistics.median(walls), "walls_s": walls, "replan_ms": last["placement_ms"],
            "from_scratch_ms": last["diagnostics"]["from_scratch_ms"], "load_ms": last["load_ms"],
            "moves": last["replan"]["moves"]["total"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--sigma", type=float, default=0.7)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "replan_speed.json")
    args = ap.parse_args()

    from lorapack.placement import PlaceConfig, place
    from lorapack.placement.export import write_outputs
    from lorapack.profile import find_profile

    load_start = os.getloadavg()
    prof = find_profile("llama-3.1-8b-instruct", "h100-64gb")
    inst = make(N, TOTAL_RPS)
    t = time.perf_counter()
    first = place(inst, prof, PlaceConfig(verify=False))
    cold_first_ms = (time.perf_counter() - t) * 1e3
    tmp = Path(tempfile.mkdtemp(prefix="replan-bench-"))
    write_outputs(first, tmp / "w0")
    scenarios = {
        "unchanged": (inst, None),
        "changed": (_changed(inst, lambda rng, k: rng.lognormal(0.0, args.sigma, k), 1), None),
        "changed-k0": (_changed(inst, lambda rng, k: rng.lognormal(0.0, args.sigma, k), 1), 0),
        "hot": (_changed(inst, lambda rng, k: 6.0, 2), None),
        "hot-k40": (_changed(inst, lambda rng, k: 6.0, 2), 40),
    }
    out: dict = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                 "machine": platform.platform(), "cpus": os.cpu_count(), "loadavg_start": list(load_start),
                 "n_adapters": N, "total_rps": TOTAL_RPS, "changed_share": CHANGED, "sigma": args.sigma,
                 "reps": args.reps, "target_ms": TARGET_MS, "previous_gpus": first.gpus_used,
                 "first_place_cold_ms": cold_first_ms, "scenarios": {}}
    print(f"previous plan: {first.gpus_used} GPUs for {N} adapters (cold place() {cold_first_ms:,.0f} ms)")
    for name, (new, k) in scenarios.items():
        cfg = PlaceConfig(verify=False, previous=tmp / "w0", max_moves=k)
        totals, own, scratch = [], [], []
        for _ in range(args.reps):
            t = time.perf_counter()
            plan = place(new, prof, cfg)
            totals.append((time.perf_counter() - t) * 1e3)
            own.append(plan.placement_ms)
            scratch.append(plan.diagnostics["from_scratch_ms"])
        r = plan.replan
        row = {"total_ms": statistics.median(totals), "times_ms": totals, "replan_ms": statistics.median(own),
               "from_scratch_ms": statistics.median(scratch), "max_moves": k, "gpus": r["gpus"],
               "moves": r["moves"], "restarts": len(r["restarts"]),
               "from_scratch": {x: v for x, v in r["from_scratch"].items() if x != "matching"},
               "target_met": statistics.median(totals) <= TARGET_MS}
        out["scenarios"][name] = row
        m = r["moves"]
        fs = row["from_scratch"]
        print(f"{name:>11}: place --previous {row['total_ms']:7.1f} ms (re-plan {row['replan_ms']:6.1f} ms + from "
              f"scratch {row['from_scratch_ms']:6.1f} ms; target {TARGET_MS:.0f} ms: "
              f"{'met' if row['target_met'] else 'MISSED'}); GPUs {r['gpus']['previous']} -> {r['gpus']['now']}, "
              f"{m['total']} moves ({m['needed']} needed, {m['optional']} optional, {m['new']} new, {m['gone']} gone), "
              f"{row['restarts']} restarts; from scratch: {fs.get('gpus')} GPUs, {fs.get('moves')} moves, "
              f"{fs.get('restarts')} restarts")
    out["cli"] = _cli(scenarios["changed"][0], tmp, args.reps)
    print(f"lorapack place --previous (a fresh process, {N} adapters, 10 % changed, --no-verify): "
          f"{out['cli']['wall_s']:.2f} s wall (median of {args.reps}); inside it: re-plan "
          f"{out['cli']['replan_ms']:.0f} ms, from-scratch plan {out['cli']['from_scratch_ms']:.0f} ms, loading the "
          f"models {out['cli']['load_ms']:.0f} ms")
    out["loadavg_end"] = list(os.getloadavg())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"load average {out['loadavg_start'][0]:.2f} -> {out['loadavg_end'][0]:.2f}; wrote {args.out}")


if __name__ == "__main__":
    main()
