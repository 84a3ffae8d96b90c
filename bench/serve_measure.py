"""``lorapack measure`` against a twin server gives back the profile behind it (issue "Serve", acceptance 4).

A twin server is an exactly known vLLM: measuring it must recover its profile.

1. ``lorapack serve`` with llama-3.1-8b-instruct's shipped profile and the testbed proof's server
   (``lorapack.measure.proof``: 16 adapters of ranks 8/16/32, ``--max-loras 4``, ``--max-cpu-loras 12``,
   ``--max-num-seqs 32``, a token budget of 256) at ``--time-scale 1``;
2. ``lorapack measure --url`` it (``--budget-min``, default 20) and ``lorapack calibrate`` the measurement;
3. the held-back designs of the testbed proof (21: 2-16 adapters, light to starving, Zipf rates), their
   arrivals drawn once, simulated with the shipped profile and with the measured one: throughput SMAPE
   (target <= 3 %), starvation labels (target: the same), mean TTFT SMAPE;
4. ``--launch``: ``lorapack measure --launch 'lorapack serve ...' --grid-max-loras ... --grid-max-lora-rank ...``
   starts a twin server per grid point; the KV tokens it reads (``/metrics``' ``vllm:cache_config_info``)
   against the shipped profile's ``kv_tokens(A, S)`` and start-up rule (the memory rule recovered).

Prints the figures and writes ``bench/results/serve_measure.json``. About ``--budget-min`` + 5 minutes.

Usage: ``python bench/serve_measure.py [--budget-min 20] [--grid-max-loras 1,8,32,128]``
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
MODEL = "llama-3.1-8b-instruct"
LORAPACK = [sys.executable, "-m", "lorapack.cli"]


def _serve_flags() -> list[str]:
    """The twin server's model and adapters (the testbed proof's 16, ranks in the JSON form)."""
    from lorapack.measure import proof as fd

    modules = [json.dumps({"name": n, "path": f"/adapters/{n}", "rank": r}) for n, r, _ in fd.adapter_names()]
    return ["--model", MODEL, "--enable-lora", "--lora-modules", *modules]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget-min", type=float, default=20.0)
    ap.add_argument("--window-s", type=float, default=60.0, help="window of each held-back run")
    ap.add_argument("--seeds", type=int, default=3, help="arrival draws per held-back design")
    ap.add_argument("--grid-max-loras", default="1,8,32,128")
    ap.add_argument("--grid-max-lora-rank", default="8,16,32")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "serve_measure.json")
    ap.add_argument("--only-grid", action="store_true", help="only the start-up grid, merged into --out")
    a = ap.parse_args()
    if a.only_grid:
        work = a.workdir or Path(tempfile.mkdtemp(prefix="lorapack-serve-measure-"))
        work.mkdir(parents=True, exist_ok=True)
        out = json.loads(a.out.read_text()) if a.out.is_file() else {}
        out.update(startup_grid_figures(a, work))
        a.out.write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {a.out}")
        return

    from lorapack.measure import proof as fd
    from lorapack.measure.runs import arrivals_for
    from lorapack.profile import find_profile, load_profile_file
    from lorapack.realruns import smape
    from lorapack.serve.launch import twin_process

    work = a.workdir or Path(tempfile.mkdtemp(prefix="lorapack-serve-measure-"))
    work.mkdir(parents=True, exist_ok=True)
    adapters_csv = fd.write_adapters_csv(work / "adapters.csv")
    original = find_profile(MODEL, "h100-64gb")
    flags = list(fd.SERVER_FLAGS)
    out: dict = {"date": time.strftime("%Y-%m-%d"), "machine": {"cpus": os.cpu_count(),
                                                                 "python": platform.python_version(),
                                                                 "load_avg_start": os.getloadavg()[0]},
                 "server_flags": flags, "budget_min": a.budget_min}
    with twin_process([*_serve_flags(), *flags]) as url:
        mdir = work / "measurement"
        t0 = time.monotonic()
        subprocess.run([*LORAPACK, "measure", "--url", url, "--adapters", str(adapters_csv), "--out", str(mdir),
                        "--budget-min", str(a.budget_min), "--server-args", " ".join(flags), "--fresh"], check=True)
        out["measure_wall_s"] = time.monotonic() - t0
        with urllib.request.urlopen(url + "/version", timeout=10) as r:
            out["twin_lag_during_measure"] = json.loads(r.read())["twin_lag"]
    prof_path = work / "measured.yaml"
    subprocess.run([*LORAPACK, "calibrate", "--profiling", str(mdir), "--runs", str(mdir / "runs.csv"), "--out",
                    str(prof_path), "--workers", "1"], check=True)
    measured = load_profile_file(prof_path)

    # held-back designs, simulated with both profiles on the same arrivals
    class Ident:  # the server's flags as predict_run reads them
        max_loras, max_lora_rank, max_cpu_loras = fd.MAX_LORAS, fd.MAX_LORA_RANK, fd.MAX_CPU_LORAS
        max_num_seqs, max_num_batched_tokens = 32, 256

    from lorapack.measure import experiments as ex
    from lorapack.measure.probe import Http, Identity
    from lorapack.measure.run import Store, capacity_rps

    store = Store(mdir)
    ident = Identity(**store.meta["identity"])
    ctx = ex.Context(Http(url), ident, [(n, r) for n, r, _ in fd.adapter_names()], ex.Caps(), 0, 1.0, print)

    def capacity(n: int) -> float:  # the load scale of the held-back designs: measure's own estimate
        return capacity_rps(ctx, store, n, 128.0, 128.0)

    rows = []
    for seed in range(a.seeds):
        for run in fd.held_back_runs(capacity, window_s=a.window_s):
            arrivals = arrivals_for(run.adapters, run.window_s, 128.0, 128.0, run.seed + 100 * seed)
            p0 = fd.predict_run(original, run, arrivals, Ident)
            p1 = fd.predict_run(measured, run, arrivals, Ident)
            rows.append({"run_id": run.run_id, "seed": seed, "original": p0, "measured": p1})
    tp0 = np.array([r["original"]["throughput_tok_s"] for r in rows])
    tp1 = np.array([r["measured"]["throughput_tok_s"] for r in rows])
    tt0 = np.array([r["original"]["ttft_mean_ms"] for r in rows])
    tt1 = np.array([r["measured"]["ttft_mean_ms"] for r in rows])
    st0 = np.array([r["original"]["starved"] for r in rows])
    st1 = np.array([r["measured"]["starved"] for r in rows])
    out.update({"n_runs": len(rows), "window_s": a.window_s, "smape_throughput": smape(tp1, tp0),
                "max_throughput_rel_err": float(np.max(np.abs(tp1 - tp0) / tp0)),
                "smape_ttft": smape(tt1, tt0), "same_starved": float(np.mean(st0 == st1)),
                "n_starved_original": int(st0.sum()),
                "runs": [{"run_id": r["run_id"], "seed": r["seed"],
                          **{f"{k}_{w}": r[w][k] for w in ("original", "measured")
                             for k in ("throughput_tok_s", "ttft_mean_ms", "starved")}} for r in rows]})
    print(f"measure: {out['measure_wall_s'] / 60:.1f} min (budget {a.budget_min:g}); held-back {len(rows)} runs: "
          f"throughput SMAPE {out['smape_throughput']:.2f} % (max rel. error "
          f"{100 * out['max_throughput_rel_err']:.1f} %; target <= 3 %), same starvation label "
          f"{100 * out['same_starved']:.1f} % ({out['n_starved_original']} starved), mean TTFT SMAPE "
          f"{out['smape_ttft']:.1f} %", flush=True)

    if a.grid_max_loras:
        out.update(startup_grid_figures(a, work))
    out["machine"]["load_avg_end"] = os.getloadavg()[0]
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {a.out}")


def startup_grid_figures(a: argparse.Namespace, work: Path) -> dict:
    """The memory rule: ``measure --launch`` starts a twin server per grid point (adapters of the smallest grid
    rank only, so that every point is a question of memory); its KV tokens against the shipped profile's."""
    import csv

    from lorapack.measure import proof as fd
    from lorapack.profile import find_profile

    original = find_profile(MODEL, "h100-64gb")
    low = min(int(r) for r in a.grid_max_lora_rank.split(","))
    csv_path = work / "adapters-grid.csv"
    names = [n for n, r, _ in fd.adapter_names() if r <= low]
    csv_path.write_text("adapter_id,rank\n" + "".join(f"{n},{low}\n" for n in names))
    modules = [json.dumps({"name": n, "path": f"/adapters/{n}", "rank": low}) for n in names]
    gdir = work / "grid"
    template = shlex.join([*LORAPACK, "serve", "--model", MODEL, "--enable-lora", "--max-cpu-loras", "128",
                           "--lora-modules", *modules]) + " {flags}"
    subprocess.run([*LORAPACK, "measure", "--launch", template, "--adapters", str(csv_path), "--out", str(gdir),
                    "--budget-min", "2", "--grid-max-loras", a.grid_max_loras, "--grid-max-lora-rank",
                    a.grid_max_lora_rank, "--runs", "1", "--fresh"], check=False)
    grid = []
    startup = gdir / "startup.csv"
    for row in csv.DictReader(startup.open()) if startup.is_file() else []:
        slots, rank = int(row["max_loras"]), int(row["max_lora_rank"])
        starts, kv, err = original.startup(slots, rank, None, kv_start="profile")
        got = int(float(row["kv_cache_tokens"])) if row["kv_cache_tokens"] else None
        grid.append({"max_loras": slots, "max_lora_rank": rank, "status": row["status"],
                     "error_type": row.get("error_type", ""), "kv_measured": got,
                     "kv_profile": int(kv) if starts else None, "starts_profile": bool(starts),
                     "error_type_profile": err or ""})
    agree = [g for g in grid if (g["status"] == "ok") == g["starts_profile"]
             and (g["kv_measured"] == g["kv_profile"] if g["status"] == "ok"
                  else g["error_type"] == g["error_type_profile"])]
    print(f"start-up grid: {len(grid)} points, {len(agree)} agree with the profile's memory rule (KV tokens, "
          "start or the kind of refusal)", flush=True)
    return {"startup_grid": grid, "startup_grid_agreement": len(agree) / len(grid) if grid else None}


if __name__ == "__main__":
    main()
