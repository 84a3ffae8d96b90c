"""``lorapack profiles``: the shipped profiles."""

from __future__ import annotations

from rich import box
from rich.table import Table

from .common import (
    console,
)


def profiles() -> None:
    """List the shipped profiles: GPU, model, vLLM version, context limit and the most --max-loras that start."""
    from ..profile import available_profiles, load_profile_file

    # headers in vLLM's flag names; no column is ever cut (80 columns fit)
    t = Table(title="shipped profiles", title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for c in ("gpu", "model", "vLLM", "--max-model-len", "most\n--max-loras at\n--max-lora-rank\n8/16/32"):
        t.add_column(c, no_wrap=True)
    for g, m, p in available_profiles():
        prof = load_profile_file(p)
        lim = "/".join(str(prof.max_slots(s, limit=1024)) for s in (8, 16, 32))
        t.add_row(g, m, prof.vllm_version, f"{prof.max_model_len:,}", lim)
    console.print(t)
