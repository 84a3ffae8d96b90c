"""Put the drift study's tables and figures into docs/replan.md (the second half of ``make drift``).

Usage: python scripts/drift_doc.py RESULTS_DIR [--doc docs/replan.md] [--figures docs/replan]

Reads ``RESULTS_DIR/results.json`` (written by ``lorapack evaluate studies/evaluate/drift.yaml --out
RESULTS_DIR``), draws each drift scenario's figure (GPUs and moves per window per policy) into the figures
directory, copies the drift part of the results there (``drift.json``), and replaces the text between
``<!-- drift:begin -->`` and ``<!-- drift:end -->`` of the doc with the study's measured wall time and each
scenario's tables (``lorapack.evaluate.drift.drift_markdown``). Nothing is computed here that is not in the
results file.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from lorapack.checks import fill_marked_section, write_text_atomic
from lorapack.evaluate.drift import drift_markdown, figure_name, plot_drift
from lorapack.textfiles import json_safe

ROOT = Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- drift:begin -->", "<!-- drift:end -->"


def _slim(entry: dict) -> dict:
    """A drift entry without its plans (kept in the results directory)."""
    return {k: v for k, v in entry.items() if k != "plans"}


def section(doc: dict, figures: list[str], source: Path) -> str:
    """The generated part of the doc: the study's wall time and source, then each scenario's tables and figure."""
    entries = doc.get("drift") or []
    m, s = divmod(round(doc.get("wall_s") or 0.0), 60)
    head = (f"{len(entries)} drift scenarios, {m} min {s} s wall (`make drift`, 2 workers). Source: "
            f"`{source}`.\n")
    return "\n".join([head, *(drift_markdown(e, f) for e, f in zip(entries, figures, strict=True))])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results_dir", type=Path)
    ap.add_argument("--doc", type=Path, default=ROOT / "docs" / "replan.md")
    ap.add_argument("--figures", type=Path, default=ROOT / "docs" / "replan")
    args = ap.parse_args(argv)
    src = args.results_dir / "results.json"
    if not src.is_file():
        print(f"error: {src} not found (run make drift, or lorapack evaluate --out {args.results_dir})",
              file=sys.stderr)
        return 2
    doc = json.loads(src.read_text())
    if not doc.get("drift"):
        print(f"error: {src} has no drift scenarios (a scenario file with a 'drift:' block)", file=sys.stderr)
        return 2
    text = args.doc.read_text()
    if BEGIN not in text or END not in text:  # before any figure is drawn
        print(f"error: {args.doc} has no {BEGIN} ... {END} section", file=sys.stderr)
        return 2
    args.figures.mkdir(parents=True, exist_ok=True)
    rel_dir = Path(os.path.relpath(args.figures, args.doc.parent))
    figures = []
    for entry in doc["drift"]:
        name = figure_name(entry)
        plot_drift(entry, args.figures / name)
        figures.append(str(rel_dir / name))
    slim = {"wall_s": doc.get("wall_s"), "drift": [_slim(e) for e in doc["drift"]]}
    write_text_atomic(args.figures / "drift.json", json.dumps(json_safe(slim), indent=1) + "\n")
    source = Path(os.path.relpath(args.figures / "drift.json", ROOT))
    fill_marked_section(args.doc, BEGIN, END, section(doc, figures, source))  # the markers were checked above
    print(f"updated {args.doc} ({len(doc['drift'])} drift scenarios; figures in {args.figures})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
