"""measure -> calibrate -> predict, proven on the testbed (issue "Measure", docs/profile-your-gpu.md).

1. start one testbed vLLM server (``lorapack.testbed.fidelity``: 16 adapters of ranks 8-32, 4 slots, 12 CPU slots);
2. ``lorapack measure`` it with ``--budget-min`` (default 20) and ``lorapack calibrate`` the measurement;
3. replay held-back runs the fit never saw (21 designs: 2-16 adapters, light to starving, other seeds), and
   three of them twice more (the server's own run-to-run noise);
4. predict each held-back run with the twin on the same arrivals and score: throughput and mean-TTFT SMAPE,
   starvation-label agreement, and per run with more adapters than slots the Spearman rank correlation of the
   adapters' mean TTFTs;
5. ``--repeat-measure``: measure and calibrate a second time (another seed) and compare the two profiles'
   starvation labels on the held-back runs (reproducibility).

The twin runs at the server's pace of the moment (``measure.proof.server_pace``: a base-model decode probe before
each held-back run against the measurement's decode fit), and the server's "starved" label is judged against an
idle server of that pace: a GPU keeps its pace, this shared CPU drifts by tens of per cent over minutes
(docs/testbed.md). ``--no-pace`` predicts at the measurement's pace (the figures of 2026-11-27 were so).

Prints the figures and writes ``bench/results/testbed_fidelity.json``. Needs the testbed (``make testbed``);
about 20 + 15 min (+ 20 with ``--repeat-measure``) on a 2-core machine. SMAPE in the project's convention
(``realruns.smape``: |p - m| / (|p| + |m|), the paper's); ``*_2x`` keys give the textbook form.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budget-min", type=float, default=20.0)
    ap.add_argument("--window-s", type=float, default=30.0, help="window of each held-back run")
    ap.add_argument("--designs", type=int, default=21, help="held-back runs (the first K designs)")
    ap.add_argument("--noise-runs", type=int, default=3, help="held-back runs replayed twice more")
    ap.add_argument("--repeat-measure", action="store_true", help="measure + calibrate a second time")
    ap.add_argument("--pace", action=argparse.BooleanOptionalAction, default=True,
                    help="probe the server's pace before each held-back run and run the twin at it (default on)")
    ap.add_argument("--workdir", type=Path, default=None, help="keep the measurements and profiles here")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "testbed_fidelity.json")
    ap.add_argument("--rank-noise", default=None, metavar="K,K,...",
                    help="only this: with --workdir of an earlier run (its measurement and profile reused), replay "
                         "these held-back designs (0-based) three times each and compare the adapters' TTFT order "
                         "between the replays (the server's own rank noise) and with the twin; writes "
                         "bench/results/testbed_rank_noise.json")
    args = ap.parse_args()
    if args.rank_noise is not None:
        return rank_noise(args)

    from lorapack.calibrate.command import CalibrateOptions, RefinementOptions, calibrate
    from lorapack.measure import experiments as ex
    from lorapack.measure import proof as fd
    from lorapack.measure.probe import Http
    from lorapack.measure.run import MeasureOptions, MeasureTarget, Store, capacity_rps, idle_service, measure
    from lorapack.profile import load_profile_file
    from lorapack.realruns import smape
    from lorapack.testbed.env import INSTALL_HINT, find_testbed
    from lorapack.testbed.server import start_server

    tb = find_testbed()
    if tb is None:
        print(f"testbed not installed: {INSTALL_HINT}", file=sys.stderr)
        return 2
    work = args.workdir or Path(tempfile.mkdtemp(prefix="lorapack-fidelity-"))
    work.mkdir(parents=True, exist_ok=True)
    t_all = time.monotonic()
    server = start_server(tb, fd.server_adapters(), fd.SERVER_FLAGS, work / "logs")
    out: dict = {"date": time.strftime("%Y-%m-%d"), "machine": platform.node(), "cpus": __import__("os").cpu_count(),
                 "server_flags": list(fd.SERVER_FLAGS), "n_served_adapters": fd.N_SERVED}
    try:
        adapters_csv = fd.write_adapters_csv(work / "adapters.csv")

        def measure_and_fit(tag: str, seed: int) -> tuple[Path, object, float]:
            mdir = work / f"measure-{tag}"
            t0 = time.monotonic()
            measure(MeasureTarget(url=server.url, log=server.log), adapters_csv, mdir,
                    MeasureOptions(budget_min=args.budget_min, seed=seed, fresh=True),
                    say=lambda s: print(f"[measure {tag}] {s}", flush=True))
            wall = time.monotonic() - t0
            prof_path = work / f"profile-{tag}.yaml"
            calibrate(mdir, [mdir / "runs.csv"], prof_path, CalibrateOptions(refinement=RefinementOptions(workers=1)),
                      log=lambda s: print(f"[calibrate {tag}] {s}", flush=True))
            return mdir, load_profile_file(prof_path), wall

        mdir, prof, measure_wall = measure_and_fit("a", 0)
        out["measure_wall_s"] = measure_wall
        out["measure_budget_min"] = args.budget_min
        store = Store(mdir)
        from lorapack.measure.probe import Identity

        ident = Identity(**store.meta["identity"])
        ctx = ex.Context(Http(server.url), ident, [(n, r) for n, r, _ in fd.adapter_names()], ex.Caps(), 0, 1.0,
                         print)
        solo = idle_service(mdir, ident.max_num_batched_tokens)
        runs = fd.held_back_runs(lambda n: capacity_rps(ctx, store, n, 128.0, 128.0),
                                 fd.HELD_BACK[:args.designs], window_s=args.window_s)

        def pace_of(measured: Path, probe_ms: float | None) -> float:
            """The server's pace against the measurement ``measured`` (1 unpaced: ``probe_ms`` None)."""
            return 1.0 if probe_ms is None else fd.server_pace(ctx, measured, probe_ms)

        def probe() -> float | None:
            return fd.pace_probe_ms(ctx) if args.pace else None

        results = []
        for k, run in enumerate(runs):
            t0 = time.monotonic()
            probe_ms = probe()
            pace = pace_of(mdir, probe_ms)
            got = fd.replay_run(server.url, ident.model, run, ident, fd.paced_idle_service(solo, pace))
            ex.wait_idle(Http(server.url))
            got["pace"], got["probe_ms"] = pace, probe_ms
            got["prediction"] = fd.predict_run(prof, run, got["arrivals"], ident, time_scale=pace)
            results.append((run, got))
            r, p = got["row"], got["prediction"]
            print(f"held-back {k + 1}/{len(runs)} {run.run_id}: throughput {r['throughput_tok_s']:.0f} vs twin "
                  f"{p['throughput_tok_s']:.0f} tok/s; TTFT {r['ttft_mean_ms']:.0f} vs {p['ttft_mean_ms']:.0f} ms; "
                  f"starved {bool(r['starved'])} vs {p['starved']}; pace {pace:.2f} ({time.monotonic() - t0:.0f} s)",
                  flush=True)
        noise = []
        for run, _ in results[:args.noise_runs]:
            reps = []
            for i in (1, 2):
                pace = pace_of(mdir, probe())
                reps.append(fd.replay_run(server.url, ident.model, run, ident, fd.paced_idle_service(solo, pace), repeat=i)["row"])
                ex.wait_idle(Http(server.url))
            first = next(g["row"] for r2, g in results if r2 is run)
            tp = [first["throughput_tok_s"]] + [x["throughput_tok_s"] for x in reps]
            tt = [first["ttft_mean_ms"]] + [x["ttft_mean_ms"] for x in reps]
            noise.append({"run_id": run.run_id, "throughput_tok_s": tp, "ttft_mean_ms": tt})
            print(f"noise {run.run_id}: throughput {tp}, TTFT {tt}", flush=True)

        m_tp = [g["row"]["throughput_tok_s"] for _, g in results]
        p_tp = [g["prediction"]["throughput_tok_s"] for _, g in results]
        m_tt = [g["row"]["ttft_mean_ms"] for _, g in results]
        p_tt = [g["prediction"]["ttft_mean_ms"] for _, g in results]
        m_st = [bool(g["row"]["starved"]) for _, g in results]
        p_st = [g["prediction"]["starved"] for _, g in results]
        rhos = {}
        for run, g in results:
            if len(run.adapters) > fd.MAX_LORAS:
                rhos[run.run_id] = fd.spearman(g["adapter_ttft_ms"], g["prediction"]["adapter_ttft_ms"])

        def pairwise(vals: list[list[float]]) -> float:
            """Mean SMAPE between each replay and the mean of its run's replays (project convention)."""
            errs = [smape(np.array(v), np.full(len(v), np.mean(v))) for v in vals]
            return float(np.mean(errs))

        out.update({
            "n_runs": len(results), "window_s": args.window_s, "paced": args.pace,
            "smape_throughput": smape(np.array(m_tp), np.array(p_tp)),
            "smape_throughput_2x": smape(np.array(m_tp), np.array(p_tp), 2.0),
            "smape_ttft": smape(np.array(m_tt), np.array(p_tt)),
            "smape_ttft_2x": smape(np.array(m_tt), np.array(p_tt), 2.0),
            "starved_agreement": float(np.mean(np.array(m_st) == np.array(p_st))),
            "n_starved_measured": int(sum(m_st)),
            "ttft_rank_spearman_min": float(np.nanmin(list(rhos.values()))) if rhos else None,
            "ttft_rank_spearman_median": float(np.nanmedian(list(rhos.values()))) if rhos else None,
            "ttft_rank_spearman": rhos,
            "noise_smape_throughput": pairwise([n["throughput_tok_s"] for n in noise]) if noise else None,
            "noise_smape_ttft": pairwise([n["ttft_mean_ms"] for n in noise]) if noise else None,
            "noise": noise,
            "profile": {"steptime": prof.steptime.model_dump(), "frontend": prof.frontend.model_dump()
                        if prof.frontend else None},
            "runs": [{"run_id": run.run_id, "n_adapters": len(run.adapters),
                      "rate_rps": sum(a.rate_rps for a in run.adapters), "pace": g["pace"],
                      "measured": {k: g["row"][k] for k in ("throughput_tok_s", "ttft_mean_ms", "throughput_ratio",
                                                              "starved", "n_completed", "n_sent")},
                      "predicted": {k: g["prediction"][k] for k in ("throughput_tok_s", "ttft_mean_ms",
                                                                      "throughput_ratio", "starved")}}
                     for run, g in results],
        })
        if args.repeat_measure:
            mdir_b, prof_b, wall_b = measure_and_fit("b", 1)
            # each profile at the server's pace against its own measurement (the same probe of each run)
            labels_b = [fd.predict_run(prof_b, run, g["arrivals"], ident, time_scale=pace_of(mdir_b, g["probe_ms"]))
                        ["starved"] for run, g in results]
            out["repeat_measure"] = {"measure_wall_s": wall_b,
                                     "same_starved_labels": float(np.mean(np.array(labels_b) == np.array(p_st))),
                                     "labels_a": p_st, "labels_b": labels_b,
                                     "steptime_b": prof_b.steptime.model_dump()}
    finally:
        server.stop()
    out["wall_s"] = time.monotonic() - t_all
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2, default=float) + "\n")
    keys = ("n_runs", "smape_throughput", "smape_ttft", "starved_agreement", "ttft_rank_spearman_min",
            "noise_smape_throughput", "measure_wall_s")
    for k in keys:
        print(f"{k}: {out.get(k)}")
    if "repeat_measure" in out:
        print(f"repeat measure: same starved labels {out['repeat_measure']['same_starved_labels']:.3f}")
    print(f"wrote {args.out}")
    return 0


def rank_noise(args) -> int:
    """The server's own noise in the order of the adapters' mean TTFTs (see ``--rank-noise``)."""
    from itertools import combinations

    from lorapack.measure import experiments as ex
    from lorapack.measure import proof as fd
    from lorapack.measure.probe import Http, Identity
    from lorapack.measure.run import Store, capacity_rps, idle_service
    from lorapack.profile import load_profile_file
    from lorapack.testbed.env import find_testbed
    from lorapack.testbed.server import start_server

    if args.workdir is None or not (args.workdir / "profile-a.yaml").is_file():
        print("--rank-noise needs --workdir of an earlier run (measure-a/, profile-a.yaml)", file=sys.stderr)
        return 2
    picks = [int(k) for k in args.rank_noise.split(",")]
    mdir = args.workdir / "measure-a"
    prof = load_profile_file(args.workdir / "profile-a.yaml")
    store = Store(mdir)
    ident = Identity(**store.meta["identity"])
    server = start_server(find_testbed(), fd.server_adapters(), fd.SERVER_FLAGS, args.workdir / "logs")
    out: dict = {"date": time.strftime("%Y-%m-%d"), "window_s": args.window_s, "designs": []}
    try:
        ctx = ex.Context(Http(server.url), ident, [(n, r) for n, r, _ in fd.adapter_names()], ex.Caps(), 0, 1.0,
                         print)
        runs = fd.held_back_runs(lambda n: capacity_rps(ctx, store, n, 128.0, 128.0), fd.HELD_BACK,
                                 window_s=args.window_s)
        solo = idle_service(mdir, ident.max_num_batched_tokens)
        for k in picks:
            run = runs[k]
            reps = []
            for i in range(3):
                got = fd.replay_run(server.url, ident.model, run, ident, solo, repeat=i)
                ex.wait_idle(Http(server.url))
                reps.append(got)
            twin = fd.predict_run(prof, run, reps[0]["arrivals"], ident)["adapter_ttft_ms"]
            between = [fd.spearman(a["adapter_ttft_ms"], b["adapter_ttft_ms"]) for a, b in combinations(reps, 2)]
            vs_twin = [fd.spearman(r["adapter_ttft_ms"], twin) for r in reps]
            d = {"run_id": run.run_id, "n_adapters": len(run.adapters), "replay_vs_replay": between,
                 "replay_vs_twin": vs_twin, "ttft_mean_ms": [r["row"]["ttft_mean_ms"] for r in reps]}
            out["designs"].append(d)
            print(f"{run.run_id}: Spearman replay vs replay {np.round(between, 2).tolist()}, replay vs twin "
                  f"{np.round(vs_twin, 2).tolist()}", flush=True)
    finally:
        server.stop()
    allb = [v for d in out["designs"] for v in d["replay_vs_replay"]]
    allt = [v for d in out["designs"] for v in d["replay_vs_twin"]]
    out["replay_vs_replay_median"] = float(np.nanmedian(allb))
    out["replay_vs_twin_median"] = float(np.nanmedian(allt))
    path = HERE / "results" / "testbed_rank_noise.json"
    path.write_text(json.dumps(out, indent=2, default=float) + "\n")
    print(f"median Spearman replay vs replay {out['replay_vs_replay_median']:.2f}, replay vs twin "
          f"{out['replay_vs_twin_median']:.2f}; wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
