"""Outputs of ``lorapack evaluate``: the JSON document, a Markdown report, PNG figures, the plans.

Everything here reads the results document (``runner.evaluate_scenarios``), so a report can be rebuilt
from ``results.json`` alone (``render_report``).
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

from ..checks import write_text_atomic
from ..textfiles import fmt, json_safe
from .runner import CONTRACT_KEYS

PROPOSED = "proposed"
PAPER_SAVING = 0.60
GAP_GPUS, GAP_FRAC, GAP_MAX_N, GAP_TARGET = 1, 0.05, 256, 0.90


# ---------------------------------------------------------------------------------------------------------
# the JSON contract


def contract_json(doc: dict[str, Any]) -> dict[str, Any]:
    """``{"scenarios": [{"name", "n_adapters", "load_scale", "methods": {METHOD: {...}}}]}`` plus extras."""
    keys = CONTRACT_KEYS
    extra = ("error", "infeasible", "reason", "replay_clean", "latency_violation_gpus", "starved_adapters",
             "verification_added_gpus", "self_gpus", "gap_gpus", "no_clean_pool", "no_verified_pool", "verified",
             "best_case", "fixed_pool", "ttft_penalised_s", "throughput_ratio", "incoming_tok_s")
    out = []
    for sc in doc["scenarios"]:
        methods = {}
        for m, r in sc["methods"].items():
            row = {k: r.get(k) for k in keys}
            row.update({k: r[k] for k in extra if r.get(k) is not None})
            methods[m] = row
        item = {"name": sc["name"], "n_adapters": sc["n_adapters"], "load_scale": sc["load_scale"],
                "model": sc["scenario"]["model"], "ranks": sc["scenario"]["ranks"],
                "objective": sc["scenario"]["objective"], "lower_bound_gpus": sc["lower_bound_gpus"],
                "aggregate_rate_rps": sc["workload"]["aggregate_rate_rps"], "methods": methods}
        out.append(item)
    payload: dict[str, Any] = {"scenarios": out, "skipped": doc.get("skipped", []), "summary": acceptance(doc)}
    if doc.get("drift"):  # drift scenarios: per policy its totals (per-window rows in results.json)
        payload["drift"] = [{"name": e["name"], "method": e["method"], "acceptance": e["acceptance"],
                             "policies": {n: {k: v for k, v in p.items() if k != "per_window"}
                                          for n, p in e["policies"].items()}} for e in doc["drift"]]
    return json_safe(payload)


# ---------------------------------------------------------------------------------------------------------
# acceptance summary


def _within_gap(g: int | None, lb: int) -> bool:
    return g is not None and (g - lb <= GAP_GPUS or g <= lb * (1 + GAP_FRAC))


def _methods() -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """From the placement registry: the baselines ``method`` is compared with, the verified (greedy) methods, and
    the methods the paper reports a fixed-pool saving against."""
    from ..placement.registry import method_names, methods, report_baselines

    return report_baselines(), method_names("greedy"), tuple(m.name for m in methods() if m.paper_fixed_pool)


def _fair_pool(r: dict[str, Any]) -> tuple[int | None, bool | None, int | None]:
    """A baseline's smallest pool under the fair protocol: (GPUs, passes the greedy methods' verification, GPUs
    failing it). Its plan passed that verification by construction where the scenario verifies (``verified``)."""
    return r.get("gpus_used"), (True if r.get("verified") else None), None


def _best_pool(r: dict[str, Any]) -> tuple[int | None, bool | None, int | None]:
    """A baseline's best case (the replay-searched pool), and what the verification says of its plan."""
    bc = r.get("best_case") or {}
    return bc.get("gpus_used"), bc.get("passes_verification"), bc.get("failed_verification_gpus")


def _compare(planned: list[dict], method: str, baselines: tuple[str, ...], pool: Any) -> dict[str, Any]:
    """``method``'s GPUs against each baseline's (``pool(result)``: GPUs, passes verification, failed GPUs):
    the cases where it uses more, and ties / fewer per baseline (a baseline without a pool counts as fewer)."""
    more, ties, fewer = [], defaultdict(int), defaultdict(int)
    for sc in planned:
        g = sc["methods"][method].get("gpus_used")
        for b in baselines:
            r = sc["methods"].get(b)
            if r is None or g is None or r.get("error"):
                continue
            gb, passes, failed = pool(r)
            if gb is None:  # no pool (or infeasible): the method wins
                fewer[b] += 1
            elif g > gb:
                more.append({"scenario": sc["name"], "baseline": b, "gpus": g, "baseline_gpus": gb,
                             "baseline_passes_verification": passes, "baseline_failed_gpus": failed})
            elif g == gb:
                ties[b] += 1
            else:
                fewer[b] += 1
    return {"more_gpus": more, "ties": dict(ties), "fewer": dict(fewer)}


def acceptance(doc: dict[str, Any], method: str = PROPOSED) -> dict[str, Any]:
    """The issue's acceptance figures for ``method`` over the scenarios that ran it."""
    rows = [sc for sc in doc["scenarios"] if method in sc["methods"] and not sc["methods"][method].get("error")]
    out: dict[str, Any] = {"method": method, "scenarios": len(rows)}
    if not rows:
        return out
    baselines, _, paper = _methods()
    planned = [sc for sc in rows if not sc["methods"][method].get("infeasible")]
    bad = [sc["name"] for sc in planned
           if (sc["methods"][method].get("starved_gpus") or 0) or (sc["methods"][method].get("oom_gpus") or 0)
           or (sc["methods"][method].get("latency_violation_gpus") or 0)]
    out["plans"] = len(planned)
    out["infeasible"] = [sc["name"] for sc in rows if sc["methods"][method].get("infeasible")]
    out["replay_not_clean"] = bad
    # GPU-level clean (the acceptance's "0 starved GPUs") but one of its adapters starved: named separately
    out["adapters_starved"] = [sc["name"] for sc in planned if sc["name"] not in bad
                               and (sc["methods"][method].get("starved_adapters") or 0)]
    small = [sc for sc in planned if sc["n_adapters"] <= GAP_MAX_N]
    near = [sc for sc in small if _within_gap(sc["methods"][method].get("gpus_used"), sc["lower_bound_gpus"])]
    out["near_lower_bound"] = {"within": len(near), "of": len(small),
                               "fraction": len(near) / len(small) if small else None,
                               "target": GAP_TARGET, "met": (len(near) / len(small) >= GAP_TARGET) if small else None,
                               "misses": [sc["name"] for sc in small if sc not in near]}
    lost = []
    for sc in rows:
        if sc in planned:
            continue
        have = [b for b in baselines if (sc["methods"].get(b) or {}).get("gpus_used") is not None]
        if have:
            lost.append({"scenario": sc["name"], "baselines": have})
    out["vs_baselines"] = {**_compare(planned, method, baselines, _fair_pool), "no_plan_where_baseline_has_one": lost}
    out["vs_best_case"] = _compare(planned, method, baselines, _best_pool)
    savings: dict[str, Any] = {}
    for b in paper:
        pairs = []
        for sc in rows:
            mine, theirs = sc["methods"][method], sc["methods"].get(b)
            if theirs is None or theirs.get("error"):
                continue
            g, gb = mine.get("gpus_used_fixed_pool"), theirs.get("gpus_used_fixed_pool")
            if g is not None and gb:
                clean_b = (theirs.get("fixed_pool") or {}).get("replay_clean")
                pairs.append((1.0 - g / gb, bool(clean_b)))
        savings[b] = {"scenarios": len(pairs),
                      "mean_saving": sum(s for s, _ in pairs) / len(pairs) if pairs else None,
                      "baseline_replay_clean": sum(c for _, c in pairs), "paper": PAPER_SAVING}
    out["fixed_pool_saving"] = savings
    return out


# ---------------------------------------------------------------------------------------------------------
# Markdown


def _method_row(m: str, r: dict[str, Any]) -> list[str]:
    if r.get("error"):
        return [m, f"error: {r['error']}", *["–"] * (len(METHOD_COLUMNS) - 2)]
    if r.get("infeasible"):
        return [m, "infeasible", "–", "–", "–", fmt(r.get("gpus_used_fixed_pool")), "–", "–", "–", "–", "–", "–",
                fmt(r.get("placement_ms")), "–"]
    g = r.get("gpus_used")
    gtxt = fmt(g) if g is not None else f"none ≤ {max((p['pool'] for p in r.get('search', [])), default='?')}"
    fixed = r.get("fixed_pool") or {}
    ftxt = fmt(r.get("gpus_used_fixed_pool"))
    if fixed.get("infeasible"):
        ftxt = "infeasible"
    elif "gpus_used" in fixed and not fixed.get("replay_clean", True):
        ftxt += f" ({fixed.get('starved_gpus', 0)} st, {fixed.get('oom_gpus', 0)} oom)"
    added = r.get("verification_added_gpus")
    return [m, gtxt, fmt(r.get("replay_clean")), _cell(r, "gpus_used_best_case"), fmt(r.get("gap_gpus")), ftxt,
            fmt(r.get("starved_gpus")), fmt(r.get("oom_gpus")), fmt(r.get("latency_violation_gpus")),
            fmt(r.get("throughput_tok_s"), 0), fmt(r.get("itl_mean_ms")),
            f"{fmt(r.get('ttft_mean_s'), 2)} / {fmt(r.get('ttft_p99_s'), 1)}", fmt(r.get("placement_ms"), 2),
            "–" if added is None else f"+{added}"]


LEGEND = ("GPUs = the smallest pool under the fair protocol: a greedy method's own count (its plan passed twin "
          "verification on the estimation window); for a pool method, the smallest pool whose plan passes the same "
          "verification (estimation window, same arrival law, seeds and headroom; nothing of the replay window), "
          "replayed as is. *Best case* (pool methods, after the `/`) = the smallest pool whose replay is clean, "
          "searched on the replay window itself, which no planner can see (the protocol before issue 26). Clean = "
          "no refused GPU, no GPU and no adapter starved, every GPU within the latency objective. `N!` = a plan whose "
          "replay is not clean; `none` = no passing pool up to the search cap; `inf.` = the method declared the "
          "workload infeasible; `err.` = the method could not run; `–` = not applicable; LB = lower bound with the "
          "N_max row (without it in parentheses when lower).\n")
METHOD_COLUMNS = ("method", "GPUs (smallest, fair)", "clean", "GPUs best case", "gap", "GPUs fixed pool", "starved",
                  "OOM", "latency viol.", "thr tok/s", "ITL ms", "TTFT mean / p99 s", "place ms", "verify")


def _table(header: tuple[str, ...] | list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def summary_markdown(doc: dict[str, Any]) -> str:
    """The acceptance figures of every verified greedy method that ran, as Markdown bullets."""
    verified = _methods()[1]
    blocks = [_method_summary(doc, m) for m in verified]
    blocks = [b for b in blocks if b]
    return "\n\n".join(blocks) if blocks else "No scenario ran a verified greedy method (" + ", ".join(
        f"`{m}`" for m in verified) + ")."


def _method_summary(doc: dict[str, Any], method: str) -> str:
    a = acceptance(doc, method)
    if not a.get("scenarios"):
        return ""
    near = a["near_lower_bound"]
    lines = [f"**`{method}`** returned a plan in {a['plans']} of {a['scenarios']} scenarios"
             + (f" (infeasible: {', '.join(a['infeasible'])})" if a["infeasible"] else "") + "."]
    clean = ("0 starved, 0 refused GPUs and no latency violation in every one" if not a["replay_not_clean"]
             else f"not clean in {len(a['replay_not_clean'])}: " + ", ".join(a["replay_not_clean"]))
    if a["adapters_starved"]:
        clean += (f"; adapters starved (their GPU not) in {len(a['adapters_starved'])}: "
                  + ", ".join(a["adapters_starved"]))
    lines.append(f"- Replay of its plans: {clean}.")
    if near["of"]:
        lines.append(f"- Within {GAP_GPUS} GPU or {GAP_FRAC:.0%} of the lower bound on {near['within']} of "
                     f"{near['of']} scenarios up to {GAP_MAX_N} adapters ({near['fraction']:.0%}; target "
                     f"{GAP_TARGET:.0%}: {'met' if near['met'] else 'missed'})"
                     + (f"; misses: {', '.join(near['misses'])}" if near["misses"] else "") + ".")
    vs = a["vs_baselines"]
    if vs["more_gpus"]:
        worse = "; ".join(f"{x['scenario']} vs {x['baseline']} ({x['gpus']} > {x['baseline_gpus']})"
                          for x in vs["more_gpus"])
        verified = [x for x in vs["more_gpus"] if x.get("baseline_passes_verification")]
        lines.append(f"- Smallest pools (fair): MORE GPUs than a baseline in {len(vs['more_gpus'])} case(s), "
                     f"{len(verified)} of them against a plan that passes the verification `{method}`'s plans "
                     f"must pass (the rule is that there are none): {worse}.")
    else:
        lines.append("- Smallest pools (fair): never more GPUs than a baseline plan that passes the same "
                     "verification, nor than any baseline where it returned a plan.")
    if vs["no_plan_where_baseline_has_one"]:
        lines.append("- No plan where a baseline has one: " + "; ".join(
            f"{x['scenario']} ({', '.join(x['baselines'])})" for x in vs["no_plan_where_baseline_has_one"]) + ".")
    if vs["ties"] or vs["fewer"]:
        lines.append("- Ties / fewer GPUs than each baseline (fair): " + _ties(vs) + ".")
    best = a["vs_best_case"]
    if best["more_gpus"]:
        worse = "; ".join(f"{x['scenario']} vs {x['baseline']} ({x['gpus']} > {x['baseline_gpus']}"
                          + _verified_note(x) + ")" for x in best["more_gpus"])
        judged = [x for x in best["more_gpus"] if x.get("baseline_passes_verification") is not None]
        passing = [x for x in judged if x["baseline_passes_verification"]]
        lines.append(f"- Against the baselines' best case (the smallest pool whose replay is clean, searched on the "
                     f"replay window, which no planner sees): more GPUs in {len(best['more_gpus'])} case(s): "
                     f"{worse}." + (f" The best-case plan passes the verification `{method}`'s plans must pass in "
                                    f"{len(passing)} of {len(judged)}." if judged else ""))
    else:
        lines.append("- Against the baselines' best case (replay-searched pools): never more GPUs.")
    if best["ties"] or best["fewer"]:
        lines.append("- Ties / fewer GPUs than each baseline's best case: " + _ties(best) + ".")
    for b, s in a["fixed_pool_saving"].items():
        if s["scenarios"]:
            lines.append(f"- Fixed pool: mean GPU saving against `{b}` {s['mean_saving']:.0%} over {s['scenarios']} "
                         f"scenarios (paper: {PAPER_SAVING:.0%}); `{b}`'s fixed-pool plan replayed clean in "
                         f"{s['baseline_replay_clean']} of them.")
    return "\n".join(lines)


def _ties(vs: dict[str, Any]) -> str:
    return ", ".join(f"{b} {vs['ties'].get(b, 0)} / {vs['fewer'].get(b, 0)}" for b in _methods()[0]
                     if b in vs["ties"] or b in vs["fewer"])


def _verified_note(x: dict[str, Any]) -> str:
    ok = x.get("baseline_passes_verification")
    if ok is None:
        return ""
    return "; its plan passes our verification" if ok else \
        f"; its plan fails our verification on {x.get('baseline_failed_gpus')} GPU(s)"


def load_text(w: dict[str, Any]) -> str:
    """The load a scenario's workload record gives, both labelled: what the planners were given (estimation
    window) and what the replay offered (the replay window's requests / its length)."""
    return (f"estimated {w['aggregate_rate_rps']:.1f} req/s ({w['offered_tok_s']:,.0f} tok/s), "
            f"replayed {w['replay_rate_rps']:.1f} req/s")


def scenario_markdown(sc: dict[str, Any]) -> str:
    s, w = sc["scenario"], sc["workload"]
    head = (f"### {sc['name']}\n\n{s['model']}, ranks {s['ranks']}, {s['n_adapters']} adapters "
            f"({s['weights']}), load ×{s['load_scale']:g} of `{s['trace']}`: {load_text(w)}; replay "
            f"{w['replay_requests']:,} requests over {w['replay_window_s']:,.0f} s ({s['windows']['protocol']}); "
            f"objective {s['objective']} "
            f"({sc['objective_limits']}); lower bound **{sc['lower_bound_gpus']}** GPUs"
            + (f"; fixed pool {s['fixed_pool']}" if s.get("fixed_pool") else "") + ".\n")
    rows = [_method_row(m, r) for m, r in sc["methods"].items()]
    out = head + "\n" + _table(METHOD_COLUMNS, rows) + "\n"
    mp = sc.get("max_pack")
    if mp:
        out += "\nMax_pack (largest n not starved on one GPU) by --max-loras: " + ", ".join(
            f"{a}: {fmt(v)}" for a, v in mp.items()) + "\n"
    return out


def _lb(sc: dict[str, Any]) -> str:
    """The bound with the N_max row, and the one without it in parentheses when it is lower."""
    lb, free = sc["lower_bound_gpus"], sc.get("lower_bound_gpus_no_nmax", sc["lower_bound_gpus"])
    return str(lb) if free == lb else f"{lb} ({free})"


def _cell(r: dict[str, Any] | None, key: str) -> str:
    """One method's GPU count for a protocol: ``N``, ``N!`` (replay not clean), ``inf.``, ``none``, ``err.``, ``–``
    (a best case of a method that is not searched)."""
    if r is None:
        return ""
    if r.get("error"):
        return "err."
    if key in ("gpus_used", "gpus_used_fixed_pool", "gpus_used_best_case"):
        # the protocol's own record: the method's result (smallest pool), its fixed-pool or best-case sub-record
        rec = {"gpus_used": r, "gpus_used_fixed_pool": r.get("fixed_pool") or {},
               "gpus_used_best_case": r.get("best_case")}[key]
        if rec is None:  # no best case: a method that sizes itself (or an infeasible one)
            return "inf." if r.get("infeasible") else "–"
        if rec.get("infeasible"):
            return "inf."
        v = r.get(key)
        if v is None:
            return "none" if key != "gpus_used_fixed_pool" else "-"
        return f"{v}!" if not rec.get("replay_clean", True) else str(v)
    return fmt(r.get(key))


def _fair_best(r: dict[str, Any] | None) -> str:
    """The smallest-pool cell: the fair count, and a pool method's best case after a slash."""
    cell = _cell(r, "gpus_used")
    if r is not None and r.get("best_case") is not None:
        cell += " / " + _cell(r, "gpus_used_best_case")
    return cell


def compact_table(doc: dict[str, Any], methods: list[str] | None = None, key: str = "gpus_used") -> str:
    """One row per scenario, one column per method (``key``; the smallest pool with the best case beside the
    fair count), with the lower bound."""
    scs = doc["scenarios"]
    methods = methods or list(dict.fromkeys(m for sc in scs for m in sc["methods"]))
    rows = []
    for sc in scs:
        s = sc["scenario"]
        cells = [sc["name"], s["model"].split("-")[0], "/".join(map(str, s["ranks"])), str(s["n_adapters"]),
                 f"×{s['load_scale']:g}", s["objective"], _lb(sc)]
        for m in methods:
            r = sc["methods"].get(m)
            cells.append(_fair_best(r) if key == "gpus_used" else _cell(r, key))
        rows.append(cells)
    return _table(["scenario", "model", "ranks", "N", "load", "objective", "LB", *methods], rows)


FAIR_BEST_COLUMNS = ("method", "scenarios", "pool found (fair / best)", "GPUs fair", "GPUs best case",
                     "fair > best", "fair = best", "fair < best", "fair plan replayed clean",
                     "best case < fair: its plan passes verification")


def fair_best_rows(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Per pool method: its fair smallest pools against its best cases over the scenarios where it ran. GPU sums
    are over the scenarios where both protocols found a pool; "passes verification" counts the best-case plans
    smaller than the fair pool that pass it after all (of those judged)."""
    out = []
    methods = list(dict.fromkeys(m for sc in doc["scenarios"] for m, r in sc["methods"].items()
                                 if r.get("best_case") is not None))
    for m in methods:
        rs = [sc["methods"][m] for sc in doc["scenarios"] if m in sc["methods"]
              and not sc["methods"][m].get("error") and not sc["methods"][m].get("infeasible")]
        both = [r for r in rs if r.get("gpus_used") is not None and r.get("gpus_used_best_case") is not None]
        # a best case below the fair pool: does its plan pass the verification after all? (equal: it is the
        # verified plan itself, nothing to learn)
        judged = [r["best_case"]["passes_verification"] for r in rs
                  if (r.get("best_case") or {}).get("passes_verification") is not None
                  and (r.get("gpus_used") is None or r["gpus_used_best_case"] < r["gpus_used"])]
        out.append({"method": m, "scenarios": len(rs),
                    "fair_found": sum(r.get("gpus_used") is not None for r in rs),
                    "best_found": sum(r.get("gpus_used_best_case") is not None for r in rs),
                    "gpus_fair": sum(r["gpus_used"] for r in both),
                    "gpus_best": sum(r["gpus_used_best_case"] for r in both),
                    "fair_more": sum(r["gpus_used"] > r["gpus_used_best_case"] for r in both),
                    "equal": sum(r["gpus_used"] == r["gpus_used_best_case"] for r in both),
                    "fair_fewer": sum(r["gpus_used"] < r["gpus_used_best_case"] for r in both),
                    "fair_clean": sum(bool(r.get("replay_clean")) for r in rs if r.get("gpus_used") is not None),
                    "best_passes": sum(judged), "best_judged": len(judged)})
    return out


def fair_best_table(doc: dict[str, Any]) -> str:
    """``fair_best_rows`` as Markdown ('' when no pool method ran)."""
    rows = fair_best_rows(doc)
    if not rows:
        return ""
    return _table(FAIR_BEST_COLUMNS, [[
        r["method"], str(r["scenarios"]), f"{r['fair_found']} / {r['best_found']}", str(r["gpus_fair"]),
        str(r["gpus_best"]), str(r["fair_more"]), str(r["equal"]), str(r["fair_fewer"]),
        f"{r['fair_clean']} of {r['fair_found']}", f"{r['best_passes']} of {r['best_judged']}"] for r in rows])


def render_report(doc: dict[str, Any], figures: list[str] | None = None) -> str:
    parts = ["# lorapack evaluate report\n",
             f"{len(doc['scenarios'])} scenario(s) in {doc.get('wall_s', float('nan')):,.0f} s"
             + (f" (budget {doc['budget_s']:g} s)" if doc.get("budget_s") else "") + ".\n",
             LEGEND,
             "## Summary\n", summary_markdown(doc) + "\n", "## GPUs used (fair / best case)\n",
             compact_table(doc) + "\n"]
    fb = fair_best_table(doc)
    if fb:
        parts += ["## Pool methods: fair smallest pool against the best case\n", fb + "\n"]
    if any(sc["scenario"].get("fixed_pool") for sc in doc["scenarios"]):
        parts += ["## GPUs used on the fixed pool\n", compact_table(doc, key="gpus_used_fixed_pool") + "\n"]
    if doc.get("skipped"):
        parts.append("## Skipped (time budget)\n")
        parts.append("\n".join(f"- {s['scenario']}: {s['what']}"
                               + (f" ({', '.join(s['methods'])})" if s["methods"] else "") for s in doc["skipped"])
                     + "\n")
    if figures:
        parts.append("## Figures\n")
        parts += [f"![{Path(f).stem}]({f})\n" for f in figures]
    parts.append("## Scenarios\n")
    parts += [scenario_markdown(sc) for sc in doc["scenarios"]]
    return "\n".join(parts)


# ---------------------------------------------------------------------------------------------------------
# figures


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_")


def _group_key(sc: dict[str, Any]) -> tuple:
    s = sc["scenario"]
    return (s["trace"], s["model"], tuple(s["ranks"]), s["load_scale"], s["weights"], s["objective"], s["seed"],
            s["windows"]["protocol"])


def _save(fig: Any, out_dir: Path, name: str) -> str:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(out_dir / name, dpi=100)
    plt.close(fig)
    return name


def _log2_ticks(ax: Any, ns: list[int]) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(ns)
    ax.set_xticklabels([str(n) for n in ns])
    ax.minorticks_off()


MARKERS = "osD^vP*Xh<>"
TIE_OFFSET_GPUS = 0.05  # vertical step between methods' lines: ties stay visible, counts stay readable


def tie_offsets(n_lines: int) -> list[float]:
    """Vertical offsets (GPUs) of ``n_lines`` methods' lines, centred on 0: identical counts show as parallel
    lines instead of one line hiding the others."""
    return [(i - (n_lines - 1) / 2) * TIE_OFFSET_GPUS for i in range(n_lines)]


def plot_gpu_lines(ax: Any, scs: list[dict], methods: list[str], marker_size: float = 5.0) -> None:
    """GPUs (fair smallest pool) vs adapters of each method, offset so that ties show, with the lower bound and
    whole-GPU ticks (a GPU count is an integer)."""
    from matplotlib.ticker import MaxNLocator

    ns = [s["n_adapters"] for s in scs]
    for m, dy, mk in zip(methods, tie_offsets(len(methods)), MARKERS * (len(methods) // len(MARKERS) + 1),
                         strict=False):
        ys = [s["methods"].get(m, {}).get("gpus_used") for s in scs]
        ax.plot(ns, [float("nan") if y is None else y + dy for y in ys], marker=mk, ms=marker_size, lw=1.0,
                alpha=0.85, label=m)
    ax.plot(ns, [s["lower_bound_gpus"] for s in scs], "k--", lw=1.0, label="lower bound")
    _log2_ticks(ax, ns)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))


def _same_curve(c: dict, ref: dict, rel_tol: float) -> bool:
    if c["n"] != ref["n"] or c["starved"] != ref["starved"]:
        return False
    return all(abs(a - b) <= rel_tol * max(abs(b), 1.0)
               for a, b in zip(c["throughput_tok_s"], ref["throughput_tok_s"], strict=True))


def coinciding_groups(by_slots: dict[str, dict], rel_tol: float = 0.01) -> list[list[str]]:
    """The ``--max-loras`` values of a Max_pack panel grouped by curve: values whose curves are the same (same
    points and starved labels, throughput within ``rel_tol``) share a group, drawn as one labelled line."""
    groups: list[list[str]] = []
    for a, c in by_slots.items():
        for g in groups:
            if _same_curve(c, by_slots[g[0]], rel_tol):
                g.append(a)
                break
        else:
            groups.append([a])
    return groups


def curves_coincide(by_slots: dict[str, dict], rel_tol: float = 0.01) -> bool:
    """True when every ``--max-loras`` curve of a Max_pack panel is the same one: the panel adds nothing."""
    return len(by_slots) > 1 and len(coinciding_groups(by_slots, rel_tol)) == 1


def plot_max_pack(ax: Any, by_slots: dict[str, dict], marker_size: float = 5.0) -> bool:
    """One Max_pack panel: throughput vs adapters per ``--max-loras`` (x = starved) and the incoming tokens;
    coinciding ``--max-loras`` curves drawn once, labelled with all their values (none hides another). Returns
    whether every curve coincides."""
    groups = coinciding_groups(by_slots)
    for g in groups:
        c = by_slots[g[0]]
        label = f"--max-loras {', '.join(g)}" + (" (identical)" if len(g) > 1 else "")
        line, = ax.plot(c["n"], c["throughput_tok_s"], marker="o", ms=marker_size, label=label)
        bad = [(n, y) for n, y, st in zip(c["n"], c["throughput_tok_s"], c["starved"], strict=True) if st]
        if bad:
            ax.scatter(*zip(*bad, strict=True), marker="x", s=10 * marker_size, color=line.get_color())
    first = next(iter(by_slots.values()))
    ax.plot(first["n"], first["incoming_tok_s"], "k--", label="incoming")
    return len(by_slots) > 1 and len(groups) == 1


def plot_figures(doc: dict[str, Any], out_dir: Path) -> list[str]:
    """GPUs vs adapters per scenario group (N varies) and every Max_pack curve; returns relative paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig_dir = out_dir / "figures"
    fig_dir.mkdir(parents=True, exist_ok=True)
    written: list[str] = []
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for sc in doc["scenarios"]:
        groups[_group_key(sc)].append(sc)
    for key, scs in groups.items():
        scs = sorted(scs, key=lambda s: s["n_adapters"])
        trace, model, ranks, load, weights, objective, seed, proto = key
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        methods = list(dict.fromkeys(m for s in scs for m in s["methods"]))
        plot_gpu_lines(ax, scs, methods)
        ax.set_xlabel("adapters")
        ax.set_ylabel(f"GPUs, {'fair ' if doc.get('format', 1) >= 2 else ''}smallest pool (lines "
                      f"{TIE_OFFSET_GPUS:g} apart)", fontsize=8)
        ax.set_title(f"{model}, ranks {'/'.join(map(str, ranks))}, ×{load:g} {trace}, {objective}", fontsize=9)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        name = _slug(f"gpus-{model.split('-')[0]}-r{'-'.join(map(str, ranks))}-x{load:g}-{weights}-{objective}"
                     f"-{trace}-s{seed}-{proto}") + ".png"
        written.append("figures/" + _save(fig, fig_dir, name))
    for curve in doc.get("max_pack", []):
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        same = plot_max_pack(ax, curve["by_slots"])
        ax.set_xlabel("adapters on the GPU")
        ax.set_ylabel("throughput tok/s")
        mp = ", ".join(f"{a}: {fmt(c['max_pack'])}" for a, c in curve["by_slots"].items())
        ax.set_title(f"Max_pack — {curve['scenario']}\n(x = starved; Max_pack {mp}"
                     + ("; --max-loras makes no difference here" if same else "") + ")", fontsize=8)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        written.append("figures/" + _save(fig, fig_dir, _slug(f"max_pack-{curve['scenario']}") + ".png"))
    return written


# ---------------------------------------------------------------------------------------------------------
# writing


def write_results(doc: dict[str, Any], out_dir: Path) -> Path:
    """``results.json`` (the full document, plans included when kept)."""
    out_dir.mkdir(exist_ok=True)  # checked up front (checks.check_output_dir): its parent exists
    path = out_dir / "results.json"
    write_text_atomic(path, json.dumps(json_safe(doc), indent=1) + "\n")
    return path


def write_outputs(doc: dict[str, Any], out_dir: Path) -> dict[str, str]:
    """results.json, report.md, figures/*.png, plans/<scenario>/<method>-<protocol>.json."""
    out_dir.mkdir(exist_ok=True)
    for sc in doc["scenarios"]:
        for key, plan in (sc.get("plans") or {}).items():
            method, protocol = key.split("/")
            d = out_dir / "plans" / _slug(sc["name"])
            d.mkdir(parents=True, exist_ok=True)
            write_text_atomic(d / f"{_slug(method)}-{protocol}.json", json.dumps(plan, indent=1) + "\n")
    from .drift import drift_figures, drift_report

    for entry in doc.get("drift", []):  # plans/<scenario>/<policy>-window<w>.json
        for key, plan in (entry.get("plans") or {}).items():
            policy, window = key.split("/")
            d = out_dir / "plans" / _slug(entry["name"])
            d.mkdir(parents=True, exist_ok=True)
            write_text_atomic(d / f"{_slug(policy)}-{window}.json", json.dumps(plan, indent=1) + "\n")
    slim = {**doc, "scenarios": [{k: v for k, v in sc.items() if k != "plans"} for sc in doc["scenarios"]]}
    if doc.get("drift"):
        slim["drift"] = [{k: v for k, v in e.items() if k != "plans"} for e in doc["drift"]]
    results = write_results(slim, out_dir)
    placed = bool(slim["scenarios"]) or not slim.get("drift")  # a drift-only run has no placement tables
    figures = plot_figures(slim, out_dir) if placed else []
    report = out_dir / "report.md"
    text = render_report(slim, figures) if placed else "# lorapack evaluate report\n"
    if slim.get("drift"):
        text += "\n" + drift_report(slim, drift_figures(slim, out_dir))
    write_text_atomic(report, text)
    return {"results": str(results), "report": str(report), "figures": str(out_dir / "figures")}


# ---------------------------------------------------------------------------------------------------------
# study view (docs/evaluation.md): tables per model and objective, figures per model


def _by(doc: dict[str, Any], *keys: str) -> dict[tuple, list[dict]]:
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for sc in doc["scenarios"]:
        groups[tuple(sc["scenario"][k] for k in keys)].append(sc)
    return groups


def study_markdown(doc: dict[str, Any], figures: list[str] | None = None) -> str:
    """Acceptance summary per objective, GPU tables per model and objective, fixed-pool tables."""
    parts = [LEGEND]
    for (objective,), scs in _by(doc, "objective").items():
        sub = {**doc, "scenarios": scs}
        parts.append(f"### Summary, objective `{objective}`\n\n{summary_markdown(sub)}\n")
        fb = fair_best_table(sub)
        if fb:
            parts.append(f"Pool methods, objective `{objective}`: the fair smallest pool against the best case "
                         f"(GPU sums over the scenarios where both found a pool).\n\n{fb}\n")
    for (model, objective), scs in _by(doc, "model", "objective").items():
        sub = {**doc, "scenarios": sorted(scs, key=lambda s: (s["scenario"]["ranks"], s["load_scale"],
                                                                s["n_adapters"]))}
        parts.append(f"### GPUs used (smallest pool: fair / best case): {model}, objective `{objective}`\n\n"
                     + compact_table(sub) + "\n")
        if any(s["scenario"].get("fixed_pool") for s in scs):
            fixed = {**sub, "scenarios": [s for s in sub["scenarios"]
                                          if s["lower_bound_gpus"] <= (s["scenario"].get("fixed_pool") or 0)]}
            parts.append(f"### GPUs used on the fixed pool of {scs[0]['scenario']['fixed_pool']}: {model}, "
                         f"objective `{objective}` (scenarios whose lower bound fits)\n\n"
                         + compact_table(fixed, key="gpus_used_fixed_pool") + "\n")
    if figures:
        parts.append("### Figures\n")
        parts += [f"![{Path(f).stem}]({f})\n" for f in figures]
    return "\n".join(parts)


def study_figures(doc: dict[str, Any], out_dir: Path, prefix: str = "") -> list[str]:
    """Per model: GPUs vs adapters (rows: rank sets, columns: loads; default objective first) and the
    Max_pack curves of the largest workloads. Returns the file names written into ``out_dir``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    curves = {c["scenario"]: c for c in doc.get("max_pack", [])}
    for (model, objective), scs in _by(doc, "model", "objective").items():
        ranks = sorted({tuple(s["scenario"]["ranks"]) for s in scs})
        loads = sorted({s["load_scale"] for s in scs})
        fig, axes = plt.subplots(len(ranks), len(loads), figsize=(4.2 * len(loads), 3.3 * len(ranks)),
                                 squeeze=False)
        methods = list(dict.fromkeys(m for s in scs for m in s["methods"]))
        for i, rk in enumerate(ranks):
            for j, k in enumerate(loads):
                ax = axes[i][j]
                cell = sorted((s for s in scs if tuple(s["scenario"]["ranks"]) == rk and s["load_scale"] == k),
                              key=lambda s: s["n_adapters"])
                plot_gpu_lines(ax, cell, methods, marker_size=3.0)
                ax.set_title(f"ranks {'/'.join(map(str, rk))}, ×{k:g}", fontsize=9)
                ax.grid(alpha=0.3)
                if i == len(ranks) - 1:
                    ax.set_xlabel("adapters")
                if j == 0:
                    ax.set_ylabel("GPUs")
        axes[0][0].legend(fontsize=6)
        what = ("the fair smallest pool (verified on the estimation window)" if doc.get("format", 1) >= 2 else
                "the smallest replay-clean pool (old protocol)")
        fig.suptitle(f"{model}: GPUs of {what}, objective {objective}; lines {TIE_OFFSET_GPUS:g} GPU apart so that "
                     f"ties show", fontsize=10)
        written.append(_save(fig, out_dir, _slug(f"{prefix}gpus-{model}-{objective}") + ".png"))
    for (model,), scs in _by(doc, "model").items():
        n_max = max(s["n_adapters"] for s in scs)
        cells = [s for s in scs if s["n_adapters"] == n_max and s["name"] in curves]
        if not cells:
            continue
        ranks = sorted({tuple(s["scenario"]["ranks"]) for s in cells})
        loads = sorted({s["load_scale"] for s in cells})
        fig, axes = plt.subplots(len(ranks), len(loads), figsize=(4.2 * len(loads), 3.3 * len(ranks)),
                                 squeeze=False)
        n_same = 0
        for s in cells:
            ax = axes[ranks.index(tuple(s["scenario"]["ranks"]))][loads.index(s["load_scale"])]
            c = curves[s["name"]]
            same = plot_max_pack(ax, c["by_slots"], marker_size=3.0)
            n_same += same
            mp = (f"--max-loras makes no difference, Max_pack {fmt(next(iter(c['by_slots'].values()))['max_pack'])}"
                  if same else "Max_pack " + ", ".join(f"{a}:{fmt(cv['max_pack'])}" for a, cv in c["by_slots"].items()))
            ax.set_title(f"ranks {'/'.join(map(str, s['scenario']['ranks']))}, ×{s['load_scale']:g}: {mp}", fontsize=7)
            ax.grid(alpha=0.3)
            ax.set_xlabel("adapters on one GPU")
            ax.set_ylabel("tok/s")
            ax.legend(fontsize=5)
        note = ("; every panel: the --max-loras lines coincide (the figure adds nothing to the tables)"
                if n_same == len(cells) else
                f"; {n_same} of {len(cells)} panels: the --max-loras lines coincide" if n_same else "")
        fig.suptitle(f"{model}: single-GPU throughput vs adapters (first n of the {n_max}; x = starved{note})",
                     fontsize=10)
        written.append(_save(fig, out_dir, _slug(f"{prefix}max_pack-{model}") + ".png"))
    return written
