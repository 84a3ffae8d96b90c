"""The placement problem: the adapters to place (``Instance``); what a GPU must achieve is
``lorapack.objective.Objective`` (re-exported here).

An ``Instance`` is validated once, here, so the methods never see unchecked arrays: ids unique and non-empty,
ranks integers vLLM can serve (1 ... 512), rates finite and > 0 req/s. Headroom is applied when the instance
is built (``rates_rps`` are the rates the plan is made for); ``nominal_rates_rps`` keeps the forecast.

Split hot adapters (``--split-hot``) become several *entries* of the instance with the same ``adapter_id``
and ``weight = 1/k`` each; every method places entries, plans list adapter ids with their weights.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from ..errors import SpecError
from ..objective import Objective
from ..oracle import GpuCandidate, Prediction
from ..profile import VLLM_LORA_RANKS, Profile
from ..server import ServerConfig

# Plans are made for the forecast rates x (1 + headroom): a margin for forecast error.
DEFAULT_HEADROOM = 0.2
# The largest rank vLLM accepts (--max-lora-rank 512).
MAX_VLLM_RANK = VLLM_LORA_RANKS[-1]


def check_headroom(headroom: float) -> None:
    if isinstance(headroom, bool) or not isinstance(headroom, int | float) or not math.isfinite(headroom) \
            or headroom < 0:
        raise SpecError(f"--headroom {headroom}: expected a finite number >= 0 (0.2 plans for rates x 1.2)")


@dataclass(frozen=True, eq=False)
class Instance:
    """Adapters to place. Arrays are in input order; ``entry`` ``i`` is one adapter or one replica of a split
    adapter (``weight`` < 1). Build with ``make_instance`` / ``instance_from_workload`` (they validate)."""

    adapter_ids: tuple[str, ...]  # per entry; repeated for the replicas of a split adapter
    ranks: np.ndarray  # int64 [n]
    rates_rps: np.ndarray  # float64 [n]: the rates the plan is made for (forecast x (1 + headroom) x weight)
    weights: np.ndarray  # float64 [n]: share of the adapter's requests this entry carries
    mean_input_tokens: float
    mean_output_tokens: float
    headroom: float = 0.0
    paths: dict[str, str] = field(default_factory=dict)  # adapter id -> weights path (for serve.sh)

    @property
    def n(self) -> int:
        return len(self.adapter_ids)

    @property
    def tokens_per_request(self) -> float:
        return self.mean_input_tokens + self.mean_output_tokens

    @property
    def demand_tok_s(self) -> np.ndarray:
        return self.rates_rps * self.tokens_per_request

    @property
    def nominal_rates_rps(self) -> np.ndarray:
        """Per entry: the forecast rate without headroom."""
        return self.rates_rps / (1.0 + self.headroom)

    @property
    def is_split(self) -> bool:
        return bool(np.any(self.weights < 1.0))

    def subset(self, idx: Sequence[int] | np.ndarray) -> Instance:
        idx = np.asarray(idx, dtype=np.int64)
        return replace(self, adapter_ids=tuple(self.adapter_ids[i] for i in idx), ranks=self.ranks[idx],
                       rates_rps=self.rates_rps[idx], weights=self.weights[idx])

    def candidate(self, profile: Profile, idx: Sequence[int] | np.ndarray, max_loras: int,
                  max_lora_rank: int | None = None) -> GpuCandidate:
        """The GPU that serves entries ``idx`` (registration order) with ``--max-loras max_loras``."""
        idx = np.asarray(idx, dtype=np.int64)
        if max_lora_rank is None:  # the instance is validated: no need to check its slices again
            return GpuCandidate.prevalidated(profile, self.ranks[idx], self.rates_rps[idx], max_loras,
                                             self.mean_input_tokens, self.mean_output_tokens)
        return GpuCandidate(profile=profile, ranks=self.ranks[idx], rates_rps=self.rates_rps[idx],
                            server=ServerConfig(max_loras=int(max_loras), max_lora_rank=max_lora_rank),
                            mean_input_tokens=self.mean_input_tokens, mean_output_tokens=self.mean_output_tokens)


def _check_lengths(mean_input_tokens: float, mean_output_tokens: float) -> None:
    for name, v in (("mean_input_tokens", mean_input_tokens), ("mean_output_tokens", mean_output_tokens)):
        if isinstance(v, bool) or not isinstance(v, int | float | np.number) or not math.isfinite(v) or v < 1:
            raise SpecError(f"{name} {v!r}: expected a finite number of tokens >= 1")


def make_instance(adapter_ids: Sequence[str], ranks: Sequence[int] | np.ndarray, rates_rps: Sequence[float] | np.ndarray,
                  *, mean_input_tokens: float, mean_output_tokens: float, headroom: float = DEFAULT_HEADROOM,
                  paths: dict[str, str] | None = None, where: str = "workload") -> Instance:
    """Validate adapters and build the instance the methods place (rates x (1 + headroom)).

    Refused, each with a one-line ``SpecError`` naming the adapter: no adapters, duplicate or empty ids, ranks
    that are not integers in 1 ... 512 (vLLM's largest --max-lora-rank), rates that are not finite and > 0."""
    ids = [str(a) for a in adapter_ids]
    if not ids:
        raise SpecError(f"{where}: no adapters; expected at least one")
    check_headroom(headroom)
    _check_lengths(mean_input_tokens, mean_output_tokens)
    rk = np.asarray(ranks)
    rt = np.asarray(rates_rps, dtype=np.float64) if len(ids) else np.zeros(0)
    if rk.shape != (len(ids),) or rt.shape != (len(ids),):
        raise SpecError(f"{where}: expected one rank and one rate per adapter ({len(ids)} ids, {rk.shape} ranks, "
                        f"{rt.shape} rates)")
    seen: set[str] = set()
    for i, a in enumerate(ids):
        if not a.strip() or any(ch.isspace() for ch in a):
            raise SpecError(f"{where}: adapter {i}: id {a!r}: expected a non-empty name without spaces")
        if a in seen:
            raise SpecError(f"{where}: duplicate adapter_id '{a}'; expected unique ids")
        seen.add(a)
        r = rk[i].item() if hasattr(rk[i], "item") else rk[i]
        if isinstance(r, bool) or not isinstance(r, int | float) or not math.isfinite(r) or r != int(r) \
                or not 1 <= int(r) <= MAX_VLLM_RANK:
            raise SpecError(f"{where}: adapter '{a}': rank {r!r}: vLLM serves integer ranks 1 ... {MAX_VLLM_RANK} "
                            f"(--max-lora-rank {', '.join(map(str, VLLM_LORA_RANKS))})")
        q = float(rt[i])
        if not math.isfinite(q) or q <= 0:
            raise SpecError(f"{where}: adapter '{a}': rate_rps {q!r}: expected a finite rate > 0 req/s "
                            f"(drop adapters that receive no requests)")
    return Instance(adapter_ids=tuple(ids), ranks=rk.astype(np.int64), rates_rps=rt * (1.0 + headroom),
                    weights=np.ones(len(ids)), mean_input_tokens=float(mean_input_tokens),
                    mean_output_tokens=float(mean_output_tokens), headroom=float(headroom),
                    paths=dict(paths or {}))


def instance_from_workload(workload, *, headroom: float = DEFAULT_HEADROOM, mean_input_tokens: float | None = None,
                           mean_output_tokens: float | None = None, where: str = "workload") -> Instance:
    """The instance of a ``lorapack.spec.Workload``: its adapters, rates, paths and mean lengths."""
    from ..spec import TraceArrivals

    if isinstance(workload.arrivals, TraceArrivals):
        raise SpecError(f"{where}: trace arrivals carry no per-adapter rates; placement needs 'rate_rps' per "
                        f"adapter (Poisson arrivals)")
    if workload.lengths.kind == "empirical":
        from ..workload.lengths import load_lengths_table

        tab = load_lengths_table(workload.lengths.path)
        pi, po = float(tab[:, 0].mean()), float(tab[:, 1].mean())
    else:
        pi, po = workload.lengths.mean_input_tokens, workload.lengths.mean_output_tokens
    return make_instance(
        workload.adapter_ids, workload.ranks, workload.rates_rps,
        mean_input_tokens=pi if mean_input_tokens is None else mean_input_tokens,
        mean_output_tokens=po if mean_output_tokens is None else mean_output_tokens,
        headroom=headroom, paths={a.adapter_id: a.path for a in workload.adapters if a.path}, where=where)


def split_entries(inst: Instance, replicas: dict[int, int]) -> Instance:
    """Replace entry ``i`` by ``replicas[i]`` entries with ``1/k`` of its rate each (same id, weight 1/k).
    Replicas follow their adapter in input order."""
    idx: list[int] = []
    w: list[float] = []
    for i in range(inst.n):
        k = int(replicas.get(i, 1))
        idx.extend([i] * k)
        w.extend([inst.weights[i] / k] * k)
    ix = np.asarray(idx, dtype=np.int64)
    wa = np.asarray(w)
    return replace(inst, adapter_ids=tuple(inst.adapter_ids[i] for i in ix), ranks=inst.ranks[ix],
                   rates_rps=inst.rates_rps[ix] * wa / inst.weights[ix], weights=wa)


def predicted_ok(objective: Objective, p: Prediction) -> bool:
    return objective.check(p) is None
