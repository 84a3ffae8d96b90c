"""Sweep shortcuts: how well early termination and N-series pruning agree with full-length runs.

Draws random N-series (fixed rates, ranks, A_max; every N of the grid) of a preset until at least ``--configs``
configs that vLLM would start are covered, then sweeps them twice through ``lorapack.sweep.run_sweep``: once
with every shortcut off (full one-hour runs, the reference) and once with the shortcuts on. Per config_id it
compares the starvation label and the throughput:

* label agreement = share of rows whose ``starved`` equals the full run's, over the shortcut rows (early-stopped
  or pruned; full rows are identical by construction) and over all rows;
* throughput SMAPE of early-stopped rows vs the full run, in both conventions of ``realruns.smape`` (paper: no factor
  2, range 0-100; usual: factor 2, range 0-200). Pruned rows carry no throughput (NaN by design) and enter the
  label agreement only.

* per-adapter labels: agreement of ``adapter_starved`` (any adapter starved) and, on the rows that claim to
  carry them exactly (``adapter_labels_exact``: full runs and healthy early stops), of ``adapters_starved``;
* ITL / TTFT SMAPE per kind of early stop (which rows carry which latency label, ``surrogate.dataset``).

Targets (issues 4 and 8, ``twin.early``): run-level and per-adapter label agreement >= 99.5 %, throughput SMAPE
<= 0.5 % (checked with the stricter usual convention). Before the twin had early termination this bench measured pruning alone; it
says which shortcuts were active in its output.

Usage: ``python bench/sweep_shortcuts.py [--preset paper-llama] [--configs 2000] [--mode both|early|prune]
[--workers 0] [--seed 0] [--out FILE]``
"""

from __future__ import annotations

import argparse
import collections
import datetime as dt
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("NUMBA_NUM_THREADS", "1")

TARGET_AGREEMENT = 0.995
TARGET_SMAPE_PCT = 0.5


def sample_series(grid, profile, min_configs: int, seed: int):
    """Random whole N-series of ``grid`` whose configs start, until >= ``min_configs`` configs."""
    from lorapack.sweep import enumerate_configs

    series: dict[tuple, list] = {}
    for c in enumerate_configs(grid):
        if profile.startup(c.adapter_slots, c.max_lora_rank)[0]:
            series.setdefault(c.series_key, []).append(c)
    keys = list(series)
    order = np.random.default_rng([seed, 0x5C7]).permutation(len(keys))
    out: list = []
    for i in order:
        out.extend(series[keys[i]])
        if len(out) >= min_configs:
            break
    return out


def smape(y: np.ndarray, yhat: np.ndarray, factor: float) -> float:
    ok = np.isfinite(y) & np.isfinite(yhat) & ((np.abs(y) + np.abs(yhat)) > 0)
    if not ok.any():
        return float("nan")
    return float(100.0 * np.mean(factor * np.abs(y[ok] - yhat[ok]) / (np.abs(y[ok]) + np.abs(yhat[ok]))))


def _rows(path: Path) -> dict[str, dict]:
    from lorapack.sweep import read_rows

    return {r["config_id"]: r for r in read_rows(path).to_pylist()}


def compare(full: dict[str, dict], short: dict[str, dict]) -> dict:
    kinds = collections.defaultdict(list)
    for cid, r in short.items():
        kinds[r["obtained"]].append(cid)
    shortcut_ids = [cid for cid, r in short.items() if r["obtained"].startswith("early_") or r["obtained"] == "pruned"]

    def agreement(ids: list[str], key: str = "starved") -> float | None:
        if not ids:
            return None
        return float(np.mean([bool(short[i][key]) == bool(full[i][key]) for i in ids]))

    def exact_agreement(ids: list[str]) -> float | None:
        """Per-adapter counts, on the rows that claim to carry them exactly."""
        ids = [i for i in ids if short[i]["adapter_labels_exact"]]
        if not ids:
            return None
        return float(np.mean([short[i]["adapters_starved"] == full[i]["adapters_starved"] for i in ids]))

    def smapes(ids: list[str], key: str) -> dict:
        y = np.array([full[i][key] for i in ids], float)
        yhat = np.array([short[i][key] for i in ids], float)
        return {"paper_pct": smape(y, yhat, 1.0), "usual_pct": smape(y, yhat, 2.0), "n": int(len(ids))}

    early_ids = [i for i in shortcut_ids if short[i]["obtained"].startswith("early_")]
    by_kind = {}
    for kind, ids in sorted(kinds.items()):
        entry = {"rows": len(ids), "label_agreement": agreement(ids),
                 "adapter_label_agreement": agreement(ids, "adapter_starved"),
                 "adapters_starved_exact_rows": sum(bool(short[i]["adapter_labels_exact"]) for i in ids),
                 "adapters_starved_agreement_exact_rows": exact_agreement(ids),
                 "full_starved_share": float(np.mean([bool(full[i]["starved"]) for i in ids]))}
        if kind.startswith("early_"):
            entry["throughput_smape"] = smapes(ids, "throughput_tok_s")
            entry["itl_smape"] = smapes(ids, "itl_mean_ms")
            entry["ttft_smape"] = smapes(ids, "ttft_mean_ms")
        by_kind[kind] = entry
    disagree = [
        {"config_id": i, "obtained": short[i]["obtained"], "served_adapters": short[i]["served_adapters"],
         "starved": [short[i]["starved"], full[i]["starved"]],
         "adapter_starved": [short[i]["adapter_starved"], full[i]["adapter_starved"]],
         "adapter_slots": short[i]["adapter_slots"], "rate_tuple": short[i]["rate_tuple"],
         "rank_tuple": short[i]["rank_tuple"], "full_throughput_ratio": full[i]["throughput_ratio"],
         "shortcut_throughput_ratio": short[i]["throughput_ratio"]}
        for i in shortcut_ids if bool(short[i]["starved"]) != bool(full[i]["starved"])
        or bool(short[i]["adapter_starved"]) != bool(full[i]["adapter_starved"])
        or (short[i]["adapter_labels_exact"] and short[i]["adapters_starved"] != full[i]["adapters_starved"])
    ]
    return {
        "rows": len(short), "shortcut_rows": len(shortcut_ids), "early_rows": len(early_ids),
        "pruned_rows": len(kinds.get("pruned", [])),
        "label_agreement_shortcut_rows": agreement(shortcut_ids),
        "label_agreement_all_rows": agreement(list(short)),
        "adapter_label_agreement_shortcut_rows": agreement(shortcut_ids, "adapter_starved"),
        "adapter_label_agreement_all_rows": agreement(list(short), "adapter_starved"),
        "adapters_starved_agreement_exact_rows": exact_agreement(list(short)),
        "throughput_smape_early_rows": smapes(early_ids, "throughput_tok_s"),
        "itl_smape_early_rows": smapes(early_ids, "itl_mean_ms"),
        "ttft_smape_early_rows": smapes(early_ids, "ttft_mean_ms"),
        "by_obtained": by_kind, "disagreements": disagree,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="paper-llama")
    ap.add_argument("--configs", type=int, default=2000, help="at least this many (non-OOM) configs")
    ap.add_argument("--mode", choices=("both", "early", "prune"), default="both", help="shortcuts to test")
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0, help="sampling seed (the runs use the grid's seed)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    from lorapack import __version__
    from lorapack.profile import find_profile
    from lorapack.sweep import Shortcuts, SweepOptions, early_stop_available, preset_grid, run_sweep

    grid = preset_grid(args.preset)
    profile = find_profile(grid.model, grid.gpu)
    sample = sample_series(grid, profile, args.configs, args.seed)
    early_on = args.mode in ("both", "early") and early_stop_available()
    prune_on = args.mode in ("both", "prune")
    shortcuts = Shortcuts(early_stop=early_on, prune=prune_on)
    print(f"{args.preset}: {len(sample):,} configs in {len({c.series_key for c in sample}):,} N-series; shortcuts: "
          f"early stop {'on' if early_on else 'off'}"
          f"{'' if early_stop_available() else ' (the twin has no early termination yet)'}, "
          f"pruning {'on' if prune_on else 'off'}")
    load_before = os.getloadavg()  # wall times are comparable only at a similar load
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        run_sweep(grid, Path(tmp) / "full", SweepOptions(workers=args.workers,
                  shortcuts=Shortcuts(early_stop=False, prune=False)), configs=sample, progress=True)
        wall_full = time.perf_counter() - t0
        t0 = time.perf_counter()
        run_sweep(grid, Path(tmp) / "short", SweepOptions(workers=args.workers, shortcuts=shortcuts),
                  configs=sample, progress=True)
        wall_short = time.perf_counter() - t0
        full, short = _rows(Path(tmp) / "full"), _rows(Path(tmp) / "short")
    assert set(full) == set(short)
    hashes = {r["profile_hash"] for r in full.values()} | {r["profile_hash"] for r in short.values()}
    if len(hashes) != 1:
        raise SystemExit(f"the profile changed between the two sweeps ({sorted(hashes)}); run the bench again")
    res = compare(full, short)
    thr = res["throughput_smape_early_rows"]
    agree = res["label_agreement_shortcut_rows"]
    print(f"full-length sweep {wall_full:.1f} s, with shortcuts {wall_short:.1f} s "
          f"({wall_full / wall_short:.1f}x faster)")
    print(f"shortcut rows: {res['shortcut_rows']:,} of {res['rows']:,} ({res['early_rows']:,} early-stopped, "
          f"{res['pruned_rows']:,} pruned)")
    for kind, e in res["by_obtained"].items():
        extra = ""
        if "throughput_smape" in e:
            extra = f", throughput SMAPE {e['throughput_smape']['usual_pct']:.3f} % (usual)"
        ag, aag = e["label_agreement"], e["adapter_label_agreement"]
        print(f"  {kind:26s} {e['rows']:6,d} rows, label agreement {100 * ag:.2f} %, per-adapter "
              f"{100 * aag:.2f} %{extra}")
        if "itl_smape" in e:
            print(f"  {'':26s} ITL SMAPE {e['itl_smape']['paper_pct']:.3f} %, TTFT SMAPE "
                  f"{e['ttft_smape']['paper_pct']:.3f} % (paper convention)")
    agree_txt = "n/a" if agree is None else f"{100 * agree:.2f} %"
    print(f"starvation label agreement on shortcut rows: {agree_txt} (all rows "
          f"{100 * res['label_agreement_all_rows']:.2f} %; target >= {100 * TARGET_AGREEMENT:.1f} %)")
    print(f"throughput SMAPE, early-stopped rows (n={thr['n']}): usual {thr['usual_pct']:.3f} %, paper "
          f"{thr['paper_pct']:.3f} % (target <= {TARGET_SMAPE_PCT} %)")
    aagree = res["adapter_label_agreement_shortcut_rows"]
    exact = res["adapters_starved_agreement_exact_rows"]
    print(f"per-adapter label (adapter_starved) agreement on shortcut rows: "
          f"{'n/a' if aagree is None else f'{100 * aagree:.2f} %'} (all rows "
          f"{100 * res['adapter_label_agreement_all_rows']:.2f} %); starved-adapter counts on the rows that carry "
          f"them exactly: {'n/a' if exact is None else f'{100 * exact:.2f} %'}")
    meets_agree = (agree is None or agree >= TARGET_AGREEMENT) and (aagree is None or aagree >= TARGET_AGREEMENT) \
        and (exact is None or exact >= TARGET_AGREEMENT)
    meets_smape = thr["n"] == 0 or thr["usual_pct"] <= TARGET_SMAPE_PCT
    result = {
        "bench": "sweep_shortcuts", "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "twin_version": __version__, "profile_hash": hashes.pop(),
        "machine": {"python": platform.python_version(), "cpu_count": os.cpu_count(),
                    "processor": platform.machine(), "load_avg_before": load_before, "load_avg_after": os.getloadavg()},
        "preset": args.preset, "configs": len(sample), "series": len({c.series_key for c in sample}),
        "sampling": f"random whole N-series of non-OOM configs, seed {args.seed}",
        "shortcuts": shortcuts.as_dict(), "early_stop_available": early_stop_available(),
        "wall_full_s": wall_full, "wall_shortcuts_s": wall_short, **res,
        "targets": {"label_agreement": TARGET_AGREEMENT, "throughput_smape_pct": TARGET_SMAPE_PCT},
        "meets_targets": bool(meets_agree and meets_smape),
    }
    out = args.out or Path(__file__).parent / "results" / f"sweep_shortcuts_{args.preset}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=float) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
