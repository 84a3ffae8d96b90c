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
header then gives every part's wall time.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from lorapack.checks import write_text_atomic
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
    skipped = doc.get("skipped") or []
    walls = " + ".join("?" if p.get("wall_s") is None else f"{p['wall_s'] / 60:.0f}" for p in parts)
    head = (f"{len(doc['scenarios'])} scenarios, {walls} min wall"
            + (f" ({len(parts)} runs, merged)" if len(parts) > 1 else "")
            + (f" (budget {doc['budget_s']:g} s; skipped: {len(skipped)} units)" if doc.get("budget_s") else "")
            + f". Source: `{rel}/results.json`.\n")
    body = head + "\n" + study_markdown(doc, [f"{rel}/{n}" for n in names])
    before, rest = text.split(BEGIN, 1)
    _, after = rest.split(END, 1)
    write_text_atomic(args.doc, f"{before}{BEGIN}\n{body}\n{END}{after}")
    print(f"wrote {args.doc} and {len(names)} figures in {args.figures}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
