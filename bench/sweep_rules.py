"""Replay early-stop and pruning rules on recorded full-length runs (issue 28: where a sweep's time goes).

Runs every startable config of a sample (default: the ``--estimate`` sample of a preset, whole N-series) once
for the whole window, pausing every 60 s exactly as ``twin.early.run_with_early_stop`` does (a paused run is the
uninterrupted run), and records per window what the early-stop rules read (goodput, offered, waiting, in-flight,
sent tokens), the engine steps so far (the cost proxy), whether the healthy test (default options) would stop
there, and the full run's labels. ``--rules`` then replays rule variants on the records: for each config where
it stops, the extrapolated throughput and starved label, and per series which points pruning skips; it prints
steps and seconds simulated per variant, label agreement with the full runs and the throughput SMAPE.

The replay of the starved rules is exact (they read only the window series); the healthy decisions are the
recorded ones (default options), so variants here change only the starved rules and pruning.

Usage: ``python bench/sweep_rules.py record --preset paper-qwen --out /tmp/rules-qwen.pkl [--configs 1500]
[--workers 2]`` then ``python bench/sweep_rules.py replay /tmp/rules-qwen.pkl``.
"""

from __future__ import annotations

import argparse
import os
import pickle
import time
from dataclasses import replace

import numpy as np

os.environ.setdefault("NUMBA_NUM_THREADS", "1")

_last: dict = {}


def _recorder(cfg, req, opts, limits=None):
    """``run_with_early_stop`` that never stops: records the window series and the healthy decision."""
    from lorapack.twin import early as E
    from lorapack.twin.engine import Engine

    eng = Engine(cfg, req, limits=limits)
    T = float(cfg.duration_s)
    tok = req.prompt_tokens.astype(np.int64) + req.output_tokens
    in_window = req.t_arr_s < T
    total_tok = float(tok[in_window].sum())
    finishable_tok = float(tok[in_window & E.finishable_mask(req, req.t_arr_s, T, cfg)].sum())
    cum_tok = np.concatenate([[0], np.cumsum(tok)])
    c_max = E.capacity_bound_tok_s(cfg.step_coef)
    w = opts.window_s
    prev = eng.snapshot(oldest_wait=False)
    ws = E.WindowSeries.empty()
    rec = {"f": [], "q": [], "sent": [], "steps": [], "cpu": [], "healthy_k": None, "healthy_done": None,
           "total_tok": total_tok, "finishable_tok": finishable_tok, "c_max": c_max, "T": T}
    labels_unsettled = False
    t_cpu = time.process_time()
    while not eng.done:
        t0 = ws.t_marks[-1] if ws.t_marks else 0.0
        eng.advance_to(min(t0 + w, T))
        snap = eng.snapshot(oldest_wait=False)
        t_now = min(snap["t_s"], T)
        span = max(t_now - t0, 1e-9)
        lo, hi = np.searchsorted(req.t_arr_s, [t0, t_now], side="right")
        ws.goodput.append((snap["completed_tokens"] - prev["completed_tokens"]) / span)
        ws.offered.append(float(cum_tok[hi] - cum_tok[lo]) / span)
        ws.waiting.append(snap["num_requests_waiting"])
        ws.inflight.append(snap["inflight_tokens"])
        ws.t_marks.append(t_now)
        rec["f"].append(snap["completed_tokens"])
        rec["q"].append(snap["inflight_tokens"])
        rec["sent"].append(snap["sent_tokens"])
        rec["steps"].append(snap["steps"])
        rec["cpu"].append(time.process_time() - t_cpu)
        prev = snap
        if eng.done:
            break
        if rec["healthy_k"] is None and opts.healthy and not labels_unsettled and E.healthy_converged(ws, 0.0, opts) \
                and eng.oldest_wait_s() < opts.healthy_max_wait_s:
            if E.adapter_labels_settled(eng.result(), req, t_now, T, cfg.n_adapters, opts):
                q_bar = float(np.mean(np.asarray(ws.inflight, float)[ws.after(opts.warmup_s)]))
                rec["healthy_k"] = len(ws.t_marks) - 1
                rec["healthy_done"] = total_tok - q_bar
            else:
                labels_unsettled = True
    rec["ws"] = ws
    res = eng.result()
    m = E._full_run_metrics(res, req, cfg)
    _last["rec"] = rec
    return res, m, eng


def _record_unit(args):
    cfgs, profile = args
    from lorapack.sweep.work import Shortcuts, config_requests, simulate_config
    from lorapack.twin import run as R

    R.run_with_early_stop = _recorder
    out = []
    for c in cfgs:
        if not profile.startup(c.adapter_slots, c.max_lora_rank)[0]:
            continue
        row = simulate_config(c, profile, Shortcuts(), None, config_requests(c))
        rec = _last.pop("rec")
        rec.update(config_id=c.config_id, series_key=c.series_key, n=c.served_adapters,
                   starved=row["starved"], adapter_starved=row["adapter_starved"],
                   throughput=row["throughput_tok_s"], ratio=row["throughput_ratio"], wall_s=row["wall_s"])
        out.append(rec)
    return out


def record(args) -> None:
    from multiprocessing import get_context

    from lorapack.profile import find_profile
    from lorapack.sweep import preset_grid
    from lorapack.sweep.grid import group_series, select_configs

    grid = preset_grid(args.preset)
    profile = find_profile(grid.model, grid.gpu)
    series = group_series(select_configs(grid, args.configs))
    t0 = time.perf_counter()
    with get_context("spawn").Pool(args.workers) as pool:
        recs = [r for rs in pool.imap_unordered(_record_unit, [(s, profile) for s in series]) for r in rs]
    print(f"{len(recs)} runs recorded in {time.perf_counter() - t0:.1f} s")
    with open(args.out, "wb") as f:
        pickle.dump({"preset": args.preset, "recs": recs}, f)


def _likely_agg(ws, opts):
    """Variant: the last windows' goodput in all below (0.9 - margin) x their offered tokens, queue grows."""
    from lorapack.twin import early as E

    k = opts.starved_windows
    if len(ws.goodput) < k:
        return False
    if not sum(ws.goodput[-k:]) < (0.9 - opts.starved_margin) * sum(ws.offered[-k:]):
        return False
    return E.grows(np.asarray(ws.waiting, float), opts.trend_p)


def _stop(rec, opts):
    """(window index, throughput tok/s, starved, reason) of one run under ``opts`` (starved rules replayed)."""
    from lorapack.twin import early as E

    ws_all, T = rec["ws"], rec["T"]
    n = len(ws_all.t_marks)
    for k in range(n - 1):  # the last window ends the run
        if rec["healthy_k"] is not None and rec["healthy_k"] == k:
            return k, rec["healthy_done"] / T, False, "healthy"
        t_now = ws_all.t_marks[k]
        if (opts.certain or opts.likely) and t_now >= opts.starved_min_s and k + 1 >= opts.starved_windows:
            ws = E.WindowSeries(ws_all.t_marks[:k + 1], ws_all.goodput[:k + 1], ws_all.offered[:k + 1],
                                ws_all.waiting[:k + 1], ws_all.inflight[:k + 1])
            f_t, q_t = rec["f"][k], rec["q"][k]
            certain = opts.certain and E.starvation_certain(f_t, q_t, rec["total_tok"] - rec["sent"][k], t_now, T,
                                                            rec["c_max"], rec["finishable_tok"])
            likely = not certain and opts.likely and (_likely_agg(ws, opts) if getattr(opts, "_agg", False)
                                                      else E.starvation_likely(ws, opts))
            if certain or likely:
                est = E.starved_trend(ws, f_t, t_now, T, rec["total_tok"], opts)
                if est is not None:
                    thr = max(est, float(f_t)) / T
                    return k, thr, bool(thr < 0.9 * rec["finishable_tok"] / T), "certain" if certain else "likely"
    return n - 1, rec["throughput"], rec["starved"], "full"


def replay(args) -> None:
    import collections

    from lorapack.twin.early import EarlyStopOptions

    with open(args.file, "rb") as f:
        data = pickle.load(f)
    recs = data["recs"]
    series = collections.defaultdict(list)
    for r in recs:
        series[r["series_key"]].append(r)
    for s in series.values():
        s.sort(key=lambda r: r["n"])
    base = EarlyStopOptions()
    variants = {"default": (base, 0.8, 0.0)}
    for spec in args.variant or []:
        name, _, kv = spec.partition(":")
        opts, clear, agg, nxt = base, 0.8, False, 0.0
        for item in filter(None, kv.split(",")):
            k, v = item.split("=")
            if k == "clear":
                clear = float(v)
            elif k == "next":
                nxt = float(v)
            elif k == "agg":
                agg = bool(int(v))
            else:
                opts = replace(opts, **{k: type(getattr(base, k))(v)})
        if agg:
            opts = replace(opts)
            object.__setattr__(opts, "_agg", True)
        variants[name] = (opts, clear, nxt)
    full_steps = sum(r["steps"][-1] for r in recs)
    full_cpu = sum(r["cpu"][-1] for r in recs)
    print(f"{data['preset']}: {len(recs)} startable configs in {len(series)} series; all full: {full_steps:,} steps, "
          f"{full_cpu:.1f} s CPU")
    for name, (opts, clear, nxt) in variants.items():
        steps = cpu = sim = 0.0
        kinds = collections.Counter()
        kind_cpu = collections.Counter()
        bad_label = bad_adapter = 0
        errs = []
        all_errs = []
        for s in series.values():
            streak = 0
            for j, r in enumerate(s):
                if streak >= 2:
                    kinds["pruned"] += 1
                    bad_label += not r["starved"]
                    bad_adapter += not r["adapter_starved"]
                    continue
                k, thr, starved, why = _stop(r, opts)
                kinds[why] += 1
                steps += r["steps"][k]
                cpu += r["cpu"][k]
                kind_cpu[why] += r["cpu"][k]
                sim += r["ws"].t_marks[k]
                if why != "full":
                    all_errs.append(200 * abs(thr - r["throughput"]) / (abs(thr) + abs(r["throughput"])))
                    bad_label += starved != r["starved"]
                    if why != "healthy":
                        bad_adapter += not r["adapter_starved"]
                        errs.append(200 * abs(thr - r["throughput"]) / (abs(thr) + abs(r["throughput"])))
                ratio = thr * r["T"] / r["total_tok"] if r["total_tok"] else float("nan")
                streak = streak + 1 if starved else 0
                if starved and ratio < clear:
                    streak = 2
                # the next point's realised tokens stand in for its analytic offered load (sweep.work.offered_tok_s)
                if starved and nxt > 0 and j + 1 < len(s) and s[j + 1]["total_tok"] >= nxt * r["total_tok"]:
                    streak = 2
        print(f"{name:12s} steps {steps / 1e6:8.2f} M ({steps / full_steps:.3f} of full), CPU {cpu:7.1f} s, "
              f"sim {sim / 3600:7.1f} h | {dict(kinds)} | cpu by kind "
              f"{ {k: round(v, 1) for k, v in kind_cpu.items()} } | label errors {bad_label}, adapter {bad_adapter} | "
              f"starved-stop SMAPE (usual) mean {np.mean(errs) if errs else float('nan'):.3f} % "
              f"max {max(errs) if errs else float('nan'):.2f} % (n={len(errs)}); all early rows "
              f"{np.mean(all_errs) if all_errs else float('nan'):.3f} % (n={len(all_errs)})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("--preset", default="paper-qwen")
    r.add_argument("--configs", type=int, default=1500)
    r.add_argument("--workers", type=int, default=2)
    r.add_argument("--out", required=True)
    p = sub.add_parser("replay")
    p.add_argument("file")
    p.add_argument("--variant", action="append",
                   help="NAME:key=value,... (EarlyStopOptions fields; clear=prune_clear_ratio)")
    args = ap.parse_args()
    record(args) if args.cmd == "record" else replay(args)


if __name__ == "__main__":
    main()
