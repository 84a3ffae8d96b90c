"""Put the evaluate study's tables and figures into docs/evaluation.md (the second half of ``make evaluate``).

Usage: python scripts/evaluation_doc.py RESULTS_DIR [RESULTS_DIR ...] [--doc docs/evaluation.md]
       [--figures docs/evaluation]

Reads ``RESULTS_DIR/results.json`` (written by ``lorapack evaluate --out RESULTS_DIR``), draws one figure per
model and objective (GPUs vs adapters, per rank set and load) and one Max_pack figure per model into the figures
directory, copies the results there (``results.json``: per-scenario metrics without the per-GPU details), and
replaces the text between ``<!-- results:begin -->`` and ``<!-- results:end -->`` of the doc with the summary
and tables. Nothing is computed here that is not in the results file.

Several RESULTS_DIRs are merged in the order given (their scenarios and Max_pack curves; a scenario name in two
of them is an error): a study can be rerun in parts, e.g. one model's files after its profile changed. The
header then gives every part's measured wall time (``wall_s`` of its results file). Results of the old
smallest-pool protocol (format 1: the pool methods' pools searched on the replay window) are labelled so, and
are not merged with results of the fair protocol (format 2), whose tables would then mix two meanings of "GPUs".
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from lorapack.checks import fill_marked_section, write_text_atomic
from lorapack.evaluate.report import study_figures, study_markdown
from lorapack.textfiles import json_safe

ROOT = Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"


def _slim(doc: dict) -> dict:
    def strip(r: dict) -> dict:
        r = {k: v for k, v in r.items() if k != "per_gpu"}
        if isinstance(r.get("fixed_pool"), dict):
            r["fixed_pool"] = {k: v for k, v in r["fixed_pool"].items() if k != "per_gpu"}
        return r

    scs = [{**{k: v for k, v in sc.items() if k not in ("plans",)},
            "methods": {m: strip(r) for m, r in sc["methods"].items()}} for sc in doc["scenarios"]]
    return {**doc, "scenarios": scs}


def merge_results(parts: list[dict]) -> dict:
    """One results document from several (scenarios and Max_pack curves in order; wall times and skipped units
    added up). A scenario name in two parts is a ValueError."""
    if len(parts) == 1:
        return parts[0]
    doc = {**parts[0], "scenarios": [], "max_pack": [], "skipped": [], "wall_s": 0.0, "budget_s": None}
    seen: set[str] = set()
    for p in parts:
        twice = sorted(seen & {s["name"] for s in p["scenarios"]})
        if twice:
            raise ValueError(f"scenario {twice[0]} is in two results directories; give each scenario once")
        seen |= {s["name"] for s in p["scenarios"]}
        doc["scenarios"] += p["scenarios"]
        doc["max_pack"] += p.get("max_pack") or []
        doc["skipped"] += p.get("skipped") or []
        doc["wall_s"] += p.get("wall_s") or 0.0
        if p.get("budget_s"):
            doc["budget_s"] = (doc.get("budget_s") or 0.0) + p["budget_s"]
    return doc


OLD_PROTOCOL_NOTE = ("**Old protocol** (results format 1, before issue 26): the pool methods' smallest pools were "
                     "searched on the replay window itself (today's best case); there is no fair column.\n")


def wall_text(wall_s: float | None) -> str:
    """A measured wall time as "12 min 34 s" (or "not recorded")."""
    if wall_s is None:
        return "not recorded"
    m, s = divmod(round(wall_s), 60)
    return f"{m} min {s} s" if m else f"{s} s"


def header(parts: list[dict], doc: dict, rel: Path) -> str:
    """The results section's first line: scenarios, each part's measured wall time, budget, source."""
    walls = [wall_text(p.get("wall_s")) for p in parts]
    if len(parts) > 1:
        when = "; ".join(f"part {i + 1} ({len(p['scenarios'])} scenarios) {w}"
                         for i, (p, w) in enumerate(zip(parts, walls, strict=True)))
        wall = f"wall time {when} ({len(parts)} runs, merged)"
    else:
        wall = f"{walls[0]} wall"
    skipped = doc.get("skipped") or []
    head = (f"{len(doc['scenarios'])} scenarios, {wall}"
            + (f" (budget {doc['budget_s']:g} s; skipped: {len(skipped)} units)" if doc.get("budget_s") else "")
            + f". Source: `{rel}/results.json`.\n")
    return head + ("\n" + OLD_PROTOCOL_NOTE if doc.get("format", 1) < 2 else "")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results_dir", type=Path, nargs="+")
    ap.add_argument("--doc", type=Path, default=ROOT / "docs" / "evaluation.md")
    ap.add_argument("--figures", type=Path, default=ROOT / "docs" / "evaluation")
    args = ap.parse_args(argv)
    parts = []
    for d in args.results_dir:
        src = d / "results.json"
        if not src.is_file():
            print(f"error: {src} not found (run lorapack evaluate --out {d} first)", file=sys.stderr)
            return 2
        parts.append(json.loads(src.read_text()))
    formats = sorted({min(p.get("format", 1), 2) for p in parts})
    if len(formats) > 1:
        print("error: these results mix the old smallest-pool protocol (format 1) with the fair one (format 2); "
              "rerun the old parts", file=sys.stderr)
        return 2
    try:
        doc = merge_results(parts)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    text = args.doc.read_text()
    if BEGIN not in text or END not in text:
        print(f"error: {args.doc} has no {BEGIN} ... {END} section", file=sys.stderr)
        return 2
    names = study_figures(doc, args.figures)
    rel = args.figures.resolve().relative_to(args.doc.resolve().parent)
    write_text_atomic(args.figures / "results.json", json.dumps(json_safe(_slim(doc)), indent=1) + "\n")
    head = header(parts, doc, rel)
    body = head + "\n" + study_markdown(doc, [f"{rel}/{n}" for n in names])
    fill_marked_section(args.doc, BEGIN, END, body)  # the markers were checked above
    print(f"wrote {args.doc} and {len(names)} figures in {args.figures}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
