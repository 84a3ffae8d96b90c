"""Put the evaluate study's tables and figures into docs/evaluation.md (the second half of ``make evaluate``).

Usage: python scripts/evaluation_doc.py RESULTS_DIR [--doc docs/evaluation.md] [--figures docs/evaluation]

Reads ``RESULTS_DIR/results.json`` (written by ``lorapack evaluate --out RESULTS_DIR``), draws one figure per
model and objective (GPUs vs adapters, per rank set and load) and one Max_pack figure per model into the figures
directory, copies the results there (``results.json``: per-scenario metrics without the per-GPU details), and
replaces the text between ``<!-- results:begin -->`` and ``<!-- results:end -->`` of the doc with the summary
and tables. Nothing is computed here that is not in the results file.
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results_dir", type=Path)
    ap.add_argument("--doc", type=Path, default=ROOT / "docs" / "evaluation.md")
    ap.add_argument("--figures", type=Path, default=ROOT / "docs" / "evaluation")
    args = ap.parse_args(argv)
    src = args.results_dir / "results.json"
    if not src.is_file():
        print(f"error: {src} not found (run lorapack evaluate --out {args.results_dir} first)", file=sys.stderr)
        return 2
    doc = json.loads(src.read_text())
    text = args.doc.read_text()
    if BEGIN not in text or END not in text:
        print(f"error: {args.doc} has no {BEGIN} ... {END} section", file=sys.stderr)
        return 2
    names = study_figures(doc, args.figures)
    rel = args.figures.resolve().relative_to(args.doc.resolve().parent)
    write_text_atomic(args.figures / "results.json", json.dumps(json_safe(_slim(doc)), indent=1) + "\n")
    skipped = doc.get("skipped") or []
    head = (f"{len(doc['scenarios'])} scenarios, {doc.get('wall_s', 0) / 60:.0f} min wall"
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
