"""A placement plan: which adapters go on which GPU, with which vLLM flags, and what was predicted/verified.

This is the contract between the placement methods (which build plans), verification (which fills
``GpuPlan.verified``), the exports (``plan.json``, ``serve.sh``, ``routes.json``) and ``lorapack evaluate``
(which replays a plan through the twin). Adapters are referred to by id; a GPU lists its adapters in
registration order (the last ``max_loras`` registered are resident when vLLM starts) with the share
``weight`` of each adapter's requests it receives (1.0 unless the adapter is split over several GPUs).
"""

from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from ..server import ServerConfig, ServerFlag

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


# the flags a GPU of plan.json lists (flat keys, in this order, between ``weights`` and ``incoming_tok_s``)
PLAN_FLAGS = ("max_loras", "max_lora_rank", "max_cpu_loras", "max_num_seqs", "max_num_batched_tokens",
              "max_model_len")
_PLAN_ONLY = ServerConfig(max_loras=1)  # the non-flag fields a GpuPlan's server keeps at their defaults


@dataclass
class GpuPlan:
    """One GPU of a plan: its adapters and its server (``server``: the one ``ServerConfig``, issue 22).

    ``g.max_loras`` etc. read ``server``'s flags; ``plan.json`` lists them as flat keys (``to_dict`` /
    ``plan_from_dict``), so the server holds only those flags (the version is the plan's)."""

    adapters: list[str]  # ids, registration order
    weights: list[float]  # share of each adapter's requests routed here (same order)
    server: ServerConfig  # the flags: max_loras, max_lora_rank, max_cpu_loras, max_num_seqs, ...
    incoming_tok_s: float = NAN  # expected offered token rate of this GPU's share of the load
    predicted: GpuMetrics | None = None
    verified: GpuMetrics | None = None
    binding: str = "none"
    # each adapter's LoRA rank (same order; empty in plans written before it was recorded): ``lorapack serve
    # --plan`` registers the adapters with it
    ranks: list[int] = field(default_factory=list)
    # the rate (req/s, headroom included, this GPU's share) each adapter was planned for, same order (empty in
    # plans written before it was recorded): ``place --previous`` re-tests only GPUs whose adapters' rates rose
    rates_rps: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if len(self.weights) != len(self.adapters):
            raise ValueError("one weight per adapter")
        if self.ranks and len(self.ranks) != len(self.adapters):
            raise ValueError("one rank per adapter (or none)")
        if self.rates_rps and len(self.rates_rps) != len(self.adapters):
            raise ValueError("one rate per adapter (or none)")
        if self.binding not in BINDING:
            raise ValueError(f"binding {self.binding!r}: expected one of {', '.join(BINDING)}")
        if not isinstance(self.server, ServerConfig):
            raise ValueError(f"a GPU plan's server: expected a ServerConfig, got {type(self.server).__name__}")
        if self.server.replace(**{k: None for k in PLAN_FLAGS[1:]}, max_loras=1) != _PLAN_ONLY:
            raise ValueError("a GPU plan's server holds only plan.json's flags "
                             f"({', '.join(PLAN_FLAGS)}); the rest are the plan's")

    # the server's flags, read from ``server`` (read-only: replace ``server`` to change them)
    max_loras = ServerFlag()
    max_lora_rank = ServerFlag()
    max_cpu_loras = ServerFlag()
    max_num_seqs = ServerFlag()
    max_num_batched_tokens = ServerFlag()
    max_model_len = ServerFlag()

    def to_dict(self) -> dict[str, Any]:
        """plan.json's form: the server's flags as flat keys between ``weights`` and ``incoming_tok_s``."""
        flat = copy.copy(self)  # the long per-adapter lists copied as lists: asdict walks them element by element
        flat.adapters, flat.weights, flat.ranks, flat.rates_rps = [], [], [], []
        d = asdict(flat)
        d.update(adapters=list(self.adapters), weights=list(self.weights), ranks=list(self.ranks),
                 rates_rps=list(self.rates_rps))
        d.pop("server")
        out: dict[str, Any] = {"adapters": d.pop("adapters"), "weights": d.pop("weights")}
        out.update((k, getattr(self.server, k)) for k in PLAN_FLAGS)
        out.update(d)
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GpuPlan:
        """Inverse of ``to_dict`` (``predicted`` / ``verified`` as ``GpuMetrics``, or None)."""
        d = dict(d)
        server = ServerConfig(**{k: d.pop(k) for k in PLAN_FLAGS if k in d})
        d["predicted"] = _metrics(d.get("predicted"))
        d["verified"] = _metrics(d.get("verified"))
        if d.get("incoming_tok_s") is None:
            d["incoming_tok_s"] = NAN
        return cls(server=server, **d)


@dataclass
class Plan:
    """A placement of a workload's adapters onto GPUs."""

    method: str
    model: str
    gpu_type: str
    gpus: list[GpuPlan]
    lower_bound_gpus: int | None = None
    placement_ms: float = NAN  # the method's wall time, learned models' loading excluded (load_ms)
    load_ms: float = NAN  # loading the learned models the method asked (0 when already loaded or none)
    verification_ms: float = NAN
    infeasible: bool = False  # the method declared the workload infeasible (then ``gpus`` may be empty)
    reason: str = ""
    settings: dict[str, Any] = field(default_factory=dict)  # objective, headroom, seeds, oracle, ...
    lower_bound: dict[str, Any] = field(default_factory=dict)  # the bound's parts (placement.bound.LowerBound)
    verification: dict[str, Any] = field(default_factory=dict)  # seeds, passed, repair log, gpus_added
    diagnostics: dict[str, Any] = field(default_factory=dict)  # oracle calls, search probes, rebalance, ...
    # a re-plan's churn (``place --previous``: moves, restarts, GPUs against a from-scratch plan, and the moves
    # the next window reads so that no adapter moves back); empty for a plan made from scratch
    replan: dict[str, Any] = field(default_factory=dict)

    @property
    def gpus_used(self) -> int:
        return sum(1 for g in self.gpus if g.adapters)

    @property
    def gap_gpus(self) -> int | None:
        """GPUs above the lower bound (None without a bound or a plan)."""
        if self.lower_bound_gpus is None or self.infeasible:
            return None
        return self.gpus_used - self.lower_bound_gpus

    @property
    def worst_gpu(self) -> dict[str, Any] | None:
        """The GPU that waits longest -- the largest mean TTFT, verified (else predicted) -- with its p99: what
        two plans on the same number of GPUs differ by. None without latency figures."""
        rows = [(i, g.verified or g.predicted) for i, g in enumerate(self.gpus) if g.adapters]
        rows = [(i, m) for i, m in rows if m is not None and math.isfinite(m.ttft_s)]
        if not rows:
            return None
        i, m = max(rows, key=lambda r: r[1].ttft_s)
        return {"gpu": i, "ttft_s": m.ttft_s, "ttft_p99_s": m.ttft_p99_s, "verified": self.gpus[i].verified is not None}

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
        rest = copy.copy(self)
        rest.gpus = []  # each GPU by its own to_dict, once
        d = asdict(rest)
        d["gpus"] = [g.to_dict() for g in self.gpus]
        d["gpus_used"] = self.gpus_used
        d["gap_gpus"] = self.gap_gpus
        d["worst_gpu"] = self.worst_gpu
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
    gpus = [GpuPlan.from_dict(g) for g in d["gpus"]]
    keys = {k: d[k] for k in ("method", "model", "gpu_type", "lower_bound_gpus", "infeasible", "reason",
                              "settings", "lower_bound", "verification", "diagnostics", "replan") if k in d}
    for k in ("placement_ms", "load_ms", "verification_ms"):
        keys[k] = NAN if d.get(k) is None else d[k]
    return Plan(gpus=gpus, **keys)
