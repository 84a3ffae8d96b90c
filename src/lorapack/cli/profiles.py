"""``lorapack profiles``: the shipped profiles."""

from __future__ import annotations

from rich.table import Table

from .common import (
    console,
)


def profiles() -> None:
    """List the shipped profiles."""
    from ..profile import available_profiles, load_profile_file

    t = Table(title="shipped profiles", title_justify="left")
    for c in ("gpu", "model", "vLLM", "max_model_len", "max A at S=8/16/32"):
        t.add_column(c)
    for g, m, p in available_profiles():
        prof = load_profile_file(p)
        lim = "/".join(str(prof.max_slots(s, limit=1024)) for s in (8, 16, 32))
        t.add_row(g, m, prof.vllm_version, f"{prof.max_model_len:,}", lim)
    console.print(t)
