"""The single-GPU Max_pack curve of a derived workload (placement.md §6.6 experiment 3).

One GPU serves the first ``n`` adapters of the workload (a random subset: weights and ranks are drawn
independently of the index) for ``n`` at the testing points up to 384, with ``--max-loras`` A from a few
slot values (8, 32, 128 and ``max`` = the memory limit of the GPU's slot rank; each capped at ``n``
and at that limit); each point replays those
adapters' requests of the replay window through the twin. ``Max_pack(A)`` is the largest ``n`` whose run is
not starved (throughput >= 0.9 x incoming).
"""

from __future__ import annotations

from typing import Any

from ..oracle import default_slot_rank
from ..placement.plan import GpuPlan, Plan
from ..profile import Profile
from ..server import ServerConfig
from .replay import Replayer

TESTING_POINTS = (8, 16, 32, 64, 96, 128, 160, 192, 256, 320, 384)
SLOT_VALUES: tuple[int | str, ...] = (8, 32, 128, "max")


def max_pack_curve(replayer: Replayer, profile: Profile, slot_values: tuple[int | str, ...] = SLOT_VALUES,
                   testing_points: tuple[int, ...] = TESTING_POINTS) -> dict[str, Any]:
    """``{"by_slots": {A: {"n": [...], "throughput_tok_s": [...], "incoming_tok_s": [...], "starved": [...],
    "max_pack": int | None}}, "slot_rank": {n: S}}`` with A as text (``"8"`` ... ``"max"``)."""
    d = replayer.derived
    ns = [n for n in testing_points if n <= d.n_adapters]
    if d.n_adapters < testing_points[-1] and d.n_adapters not in ns:
        ns.append(d.n_adapters)
    plans: list[tuple[str, int, Plan]] = []
    slot_rank: dict[int, int] = {}
    limits: dict[int, int] = {}
    for n in ns:
        ids = d.adapter_ids[:n]
        s = default_slot_rank(int(d.ranks[:n].max()))
        slot_rank[n] = s
        limit = limits.setdefault(s, profile.max_slots(s))
        for a in slot_values:
            a_eff = min(limit if a == "max" else int(a), n, limit)
            if a_eff < 1:
                continue
            gpu = GpuPlan(adapters=list(ids), weights=[1.0] * n,
                          server=ServerConfig(max_loras=a_eff, max_lora_rank=s, max_cpu_loras=n,
                                              max_num_seqs=profile.max_num_seqs,
                                              max_num_batched_tokens=profile.max_num_batched_tokens))
            plans.append((str(a), n, Plan(method="max_pack", model=profile.model, gpu_type=profile.gpu, gpus=[gpu])))
    reps = replayer.replay_many([p for _, _, p in plans], partial=True)
    by_slots: dict[str, dict[str, Any]] = {}
    for (a, n, _), rep in zip(plans, reps, strict=True):
        g = rep.gpus[0]
        c = by_slots.setdefault(a, {"n": [], "max_loras": [], "throughput_tok_s": [], "incoming_tok_s": [],
                                    "starved": [], "ttft_mean_s": []})
        c["n"].append(n)
        c["max_loras"].append(g.max_loras)
        c["throughput_tok_s"].append(g.throughput_tok_s)
        c["incoming_tok_s"].append(g.incoming_tok_s)
        c["starved"].append(bool(g.starved))
        c["ttft_mean_s"].append(g.ttft_mean_s)
    for c in by_slots.values():
        ok = [n for n, bad in zip(c["n"], c["starved"], strict=True) if not bad]
        c["max_pack"] = max(ok) if ok else None
    return {"by_slots": by_slots, "slot_rank": slot_rank, "model": profile.model}
