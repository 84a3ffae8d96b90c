"""The tiny sweep grid the sweep tests share, and writing a grid file."""

from __future__ import annotations

import textwrap
from pathlib import Path

# series of 3 configs (A = 8) and 2 configs (A = 16)
TINY = """\
name: tiny
model: llama-3.1-8b-instruct
rate_tuples: [[0.4, 0.1, 0.05], [3.2, 1.6, 0.8]]
rank_tuples: [[8, 8, 16], [8, 16, 32]]
served_adapters: [8, 16, 32]
adapter_slots: [8, 16]
lengths: {kind: fixed, mean_input_tokens: 223, mean_output_tokens: 197}
duration_s: 120
seeds: [3]
"""


def write_grid(tmp_path: Path, text: str = TINY, name: str = "grid.yaml") -> Path:
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return p
