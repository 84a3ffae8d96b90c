"""Test doubles for ``lorapack evaluate``: a small synthetic trace and a toy placer (no learned models)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from lorapack.evaluate.methods import Bounds, PlaceRequest
from lorapack.objective import Objective
from lorapack.oracle import default_slot_rank
from lorapack.placement.plan import GpuPlan, Plan
from lorapack.server import ServerConfig

TOY_CAPACITY_TOK_S = 9000.0  # what the toy methods assume one GPU serves


def write_trace(path: Path, n: int = 3000, span_s: float = 600.0, seed: int = 1) -> Path:
    """A Poisson-like trace with ShareGPT-ish token counts."""
    rng = np.random.default_rng(seed)
    t = np.sort(rng.uniform(0.0, span_s, size=n))
    p = rng.integers(20, 600, size=n)
    o = rng.integers(10, 400, size=n)
    lines = ["arrived_at,num_prefill_tokens,num_decode_tokens"]
    lines += [f"{a:.4f},{b},{c}" for a, b, c in zip(t, p, o, strict=True)]
    path.write_text("\n".join(lines) + "\n")
    return path


class ToyPlacer:
    """``toy-pack`` opens GPUs itself (rate-sorted first fit under a token capacity); ``toy-deal`` deals the
    adapters round-robin over a given pool (its own choice: the capacity bound)."""

    def __init__(self, capacity_tok_s: float = TOY_CAPACITY_TOK_S, slots: int = 16,
                 infeasible_method: str | None = None, pack: tuple[str, ...] = ("toy-pack",),
                 deal: tuple[str, ...] = ("toy-deal", "toy-none")) -> None:
        self.pack, self.deal = pack, deal
        self.capacity = capacity_tok_s
        self.slots = slots
        self.infeasible_method = infeasible_method
        self.calls: list[tuple[str, int | None]] = []

    def methods(self) -> tuple[str, ...]:
        return self.pack + self.deal

    def sizes_itself(self, method: str) -> bool:
        return method in self.pack

    def objective(self, name: str, limits: Objective | None) -> Objective:
        if name == "throughput":
            return Objective.throughput()
        return limits or Objective(max_ttft_s=30.0)

    def _tau(self, workload) -> float:
        return workload.lengths.mean_input_tokens + workload.lengths.mean_output_tokens

    def _bound(self, workload) -> int:
        return max(1, math.ceil(workload.rates_rps.sum() * self._tau(workload) / self.capacity))

    def lower_bound(self, workload, profile, req) -> Bounds:
        return Bounds(gpus=self._bound(workload), gpus_no_nmax=self._bound(workload))

    def method_bound(self, method: str, bounds: Bounds) -> int:
        return bounds.gpus if method in self.pack else bounds.gpus_no_nmax

    def verify(self, workload, profile, req, plan) -> dict | None:
        return None  # the toy has no verifier

    def _gpu(self, workload, ids: list[str], profile) -> GpuPlan:
        ranks = [a.rank for a in workload.adapters if a.adapter_id in set(ids)]
        return GpuPlan(adapters=ids, weights=[1.0] * len(ids),
                       server=ServerConfig(max_loras=min(self.slots, len(ids)),
                                           max_lora_rank=default_slot_rank(max(ranks)), max_cpu_loras=len(ids),
                                           max_num_seqs=profile.max_num_seqs,
                                           max_num_batched_tokens=profile.max_num_batched_tokens))

    def place(self, workload, profile, req: PlaceRequest) -> Plan:
        self.calls.append((req.method, req.gpus))
        tau = self._tau(workload)
        if req.method == self.infeasible_method or req.method == "toy-none":
            return Plan(method=req.method, model=profile.model, gpu_type=profile.gpu, gpus=[], infeasible=True,
                        reason="toy says no", placement_ms=0.1)
        if req.method in self.pack:
            gpus: list[list[str]] = [[]]
            load = [0.0]
            for a in sorted(workload.adapters, key=lambda a: -a.rate_rps):
                if load[-1] + a.rate_rps * tau > self.capacity and gpus[-1]:
                    if req.gpus is not None and len(gpus) == req.gpus:
                        return Plan(method=req.method, model=profile.model, gpu_type=profile.gpu, gpus=[],
                                    infeasible=True, reason="pool too small", placement_ms=0.2)
                    gpus.append([])
                    load.append(0.0)
                gpus[-1].append(a.adapter_id)
                load[-1] += a.rate_rps * tau
        else:
            g = req.gpus or self._bound(workload)
            gpus = [[a.adapter_id for a in workload.adapters[i::g]] for i in range(g)]
        plan = Plan(method=req.method, model=profile.model, gpu_type=profile.gpu,
                    gpus=[self._gpu(workload, ids, profile) for ids in gpus if ids], placement_ms=0.5)
        plan.verification = {"gpus_added": 0}
        return plan
