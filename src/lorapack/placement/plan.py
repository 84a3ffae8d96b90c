"""A placement plan: which adapters go on which GPU, with which vLLM flags, and what was predicted/verified.

This is the contract between the placement methods (which build plans), verification (which fills
``GpuPlan.verified``), the exports (``plan.json``, ``serve.sh``, ``routes.json``) and ``lorapack evaluate``
(which replays a plan through the twin). Adapters are referred to by id; a GPU lists its adapters in
registration order (the last ``max_loras`` registered are resident when vLLM starts) with the share
``weight`` of each adapter's requests it receives (1.0 unless the adapter is split over several GPUs).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from ..server import ServerConfig

NAN = float("nan")

# what limited a GPU: the reason it holds no more adapters / needs these flags
BINDING = ("memory", "slots", "throughput", "latency", "adapters", "none")


@dataclass
class GpuMetrics:
    """Throughput, latency and starvation of one GPU, as an oracle predicted or the twin measured."""

    throughput_tok_s: float = NAN
    incoming_tok_s: float = NAN
    itl_ms: float = NAN
    ttft_s: float = NAN
    ttft_p99_s: float = NAN
    itl_p99_ms: float = NAN
    starved: float = NAN  # probability (predicted) or fraction of seeds starved (verified)
    starved_adapters: list[str] = field(default_factory=list)
    fits: bool = True  # vLLM starts
    seeds: int = 0
    per_seed: list[dict] = field(default_factory=list)  # verified: what each seed's twin run measured
    passed: bool | None = None  # verified: meets the objective in every seed (None: not judged)
    detail: str = ""  # why it failed, when it did
    # predicted: adapters in the candidate the oracle answered for. The greedy tests a GPU's last adapters padded
    # up to its testing point (placement.md §4.1), so this can exceed the GPU's own count, and incoming_tok_s,
    # TTFT and ITL then describe the padded test (a heavier load), not the GPU. None: the GPU's own adapters.
    tested_adapters: int | None = None


@dataclass
class GpuPlan:
    """One GPU of a plan."""

    adapters: list[str]  # ids, registration order
    weights: list[float]  # share of each adapter's requests routed here (same order)
    max_loras: int
    max_lora_rank: int
    max_cpu_loras: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int | None = None
    incoming_tok_s: float = NAN  # expected offered token rate of this GPU's share of the load
    predicted: GpuMetrics | None = None
    verified: GpuMetrics | None = None
    binding: str = "none"

    def __post_init__(self) -> None:
        if len(self.weights) != len(self.adapters):
            raise ValueError("one weight per adapter")
        if self.binding not in BINDING:
            raise ValueError(f"binding {self.binding!r}: expected one of {', '.join(BINDING)}")

    def server_config(self) -> ServerConfig:
        """This GPU's flags as the one server type (``lorapack.server.ServerConfig``). The fields above are
        ``plan.json``'s serialised form of the same flags; ``evaluate`` and ``serve.sh`` go through this."""
        return ServerConfig(max_loras=self.max_loras, max_lora_rank=self.max_lora_rank,
                            max_cpu_loras=self.max_cpu_loras, max_num_seqs=self.max_num_seqs,
                            max_num_batched_tokens=self.max_num_batched_tokens, max_model_len=self.max_model_len)


@dataclass
class Plan:
    """A placement of a workload's adapters onto GPUs."""

    method: str
    model: str
    gpu_type: str
    gpus: list[GpuPlan]
    lower_bound_gpus: int | None = None
    placement_ms: float = NAN
    verification_ms: float = NAN
    infeasible: bool = False  # the method declared the workload infeasible (then ``gpus`` may be empty)
    reason: str = ""
    settings: dict[str, Any] = field(default_factory=dict)  # objective, headroom, seeds, oracle, ...
    lower_bound: dict[str, Any] = field(default_factory=dict)  # the bound's parts (placement.bound.LowerBound)
    verification: dict[str, Any] = field(default_factory=dict)  # seeds, passed, repair log, gpus_added
    diagnostics: dict[str, Any] = field(default_factory=dict)  # oracle calls, search probes, rebalance, ...

    @property
    def gpus_used(self) -> int:
        return sum(1 for g in self.gpus if g.adapters)

    @property
    def gap_gpus(self) -> int | None:
        """GPUs above the lower bound (None without a bound or a plan)."""
        if self.lower_bound_gpus is None or self.infeasible:
            return None
        return self.gpus_used - self.lower_bound_gpus

    def routes(self) -> dict[str, list[tuple[int, float]]]:
        """adapter id -> ``[(gpu index, weight), ...]`` with weights normalised to sum to 1."""
        out: dict[str, list[tuple[int, float]]] = {}
        for gi, g in enumerate(self.gpus):
            for a, w in zip(g.adapters, g.weights, strict=True):
                if w > 0:
                    out.setdefault(a, []).append((gi, float(w)))
        for a, lst in out.items():
            tot = sum(w for _, w in lst)
            out[a] = sorted(((gi, w / tot) for gi, w in lst), key=lambda t: (-t[1], t[0]))
        return out

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["gpus_used"] = self.gpus_used
        d["gap_gpus"] = self.gap_gpus
        return _json_safe(d)


def _json_safe(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_json_safe(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def _metrics(d: dict | None) -> GpuMetrics | None:
    if d is None:
        return None
    keep_none = {"starved_adapters", "per_seed", "passed", "detail", "tested_adapters"}
    return GpuMetrics(**{k: (NAN if v is None and k not in keep_none else v) for k, v in d.items()})


def plan_from_dict(d: dict[str, Any]) -> Plan:
    """Inverse of ``Plan.to_dict`` (``plan.json``)."""
    gpus = []
    for g in d["gpus"]:
        g = dict(g)
        g["predicted"] = _metrics(g.get("predicted"))
        g["verified"] = _metrics(g.get("verified"))
        if g.get("incoming_tok_s") is None:
            g["incoming_tok_s"] = NAN
        gpus.append(GpuPlan(**g))
    keys = {k: d[k] for k in ("method", "model", "gpu_type", "lower_bound_gpus", "infeasible", "reason",
                              "settings", "lower_bound", "verification", "diagnostics") if k in d}
    for k in ("placement_ms", "verification_ms"):
        keys[k] = NAN if d.get(k) is None else d[k]
    return Plan(gpus=gpus, **keys)
