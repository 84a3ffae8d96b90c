"""The placement problem: the adapters to place (``Instance``); what a GPU must achieve is
``lorapack.objective.Objective`` (re-exported here).

An ``Instance`` is validated once, here, so the methods never see unchecked arrays: ids unique and non-empty,
ranks integers vLLM can serve (1 ... 512), rates finite and >= 0 req/s. An adapter at rate 0 (kept deployed,
no requests forecast) is placed like any other: it takes a slot of ``--max-cpu-loras``, a place in a GPU's
adapter count and its rank class, and brings no load. Headroom is applied when the instance
is built (``rates_rps`` are the rates the plan is made for); ``nominal_rates_rps`` keeps the forecast.

Request lengths: ``Instance.lengths`` is the workload's own law (fixed, log-normal with its cv, or empirical),
which every candidate GPU, the verification and the bound simulate; None when the workload gave none (an
adapters CSV, a YAML without ``lengths:``): then the profile's log-normal law around the means is assumed
(``oracle.profile_length_law``) -- what the learned models were trained on -- and plans say so.

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
from ..oracle import GpuCandidate, Prediction, profile_cv, profile_length_law
from ..profile import VLLM_LORA_RANKS, Profile
from ..server import ServerConfig
from ..spec import DEFAULT_MEAN_INPUT_TOKENS, DEFAULT_MEAN_OUTPUT_TOKENS, LengthsSpec

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
    # the request length law (its means are the fields above); None: none given, the profile's law is assumed
    lengths: LengthsSpec | None = None

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
                                             self.mean_input_tokens, self.mean_output_tokens, self.lengths)
        return GpuCandidate(profile=profile, ranks=self.ranks[idx], rates_rps=self.rates_rps[idx],
                            server=ServerConfig(max_loras=int(max_loras), max_lora_rank=max_lora_rank),
                            mean_input_tokens=self.mean_input_tokens, mean_output_tokens=self.mean_output_tokens,
                            lengths=self.lengths)

    def with_lengths(self, lengths: LengthsSpec | None) -> Instance:
        """This instance with the request length law ``lengths`` (None: the profile's law assumed): the means
        become the law's (an empirical law's: its table's). Validated: a ``SpecError`` for anything else."""
        if lengths is None:
            return replace(self, lengths=None)
        if not isinstance(lengths, LengthsSpec):
            raise SpecError(f"lengths {lengths!r}: expected a lorapack.spec.LengthsSpec")
        pi, po = law_means(lengths)
        return replace(self, lengths=lengths, mean_input_tokens=pi, mean_output_tokens=po)

    def length_law(self, profile: Profile) -> LengthsSpec:
        """The law candidates of this instance are simulated with (``lengths``, else the profile's)."""
        if self.lengths is not None:
            return self.lengths
        return profile_length_law(profile, self.mean_input_tokens, self.mean_output_tokens)


def law_means(lengths: LengthsSpec) -> tuple[float, float]:
    """Mean prompt and output tokens of a length law (an empirical one's: its table's)."""
    if lengths.kind == "empirical":
        from ..workload.lengths import load_lengths_table

        tab = load_lengths_table(lengths.path)
        return float(tab[:, 0].mean()), float(tab[:, 1].mean())
    return float(lengths.mean_input_tokens), float(lengths.mean_output_tokens)


def check_assumed_lengths(inst: Instance, profile: Profile, where: str = "workload") -> None:
    """An instance without a length law of its own assumes the profile's log-normal law around its means: a
    ``SpecError`` naming ``where`` when no log-normal with the profile's cv reaches them (and which cv would)."""
    if inst.lengths is not None:
        return
    from ..workload.lengths import largest_reachable_cv, lognormal_reaches

    cv = profile_cv(profile)
    pi, po = inst.mean_input_tokens, inst.mean_output_tokens
    if lognormal_reaches(pi, po, cv):
        return
    better = largest_reachable_cv(pi, po, cv)
    if better is None:
        fix = "no log-normal law does: give the lengths in a YAML workload with kind fixed or empirical"
    else:
        law = f"kind: lognormal, mean_input_tokens: {pi:g}, mean_output_tokens: {po:g}, cv: {better:g}"
        fix = (f"cv {better:g} or less would: give the lengths in a YAML workload, e.g. lengths: {{{law}}}, or kind "
               f"fixed or empirical")
    raise SpecError(f"{where} gives no request lengths, so place assumes the profile's log-normal law (cv {cv:g}), "
                    f"which cannot reach means {pi:g}/{po:g} tokens under the ShareGPT filter (prompt 4...1024, "
                    f"output >= 4, sum <= 2048); {fix}")


def _check_lengths(mean_input_tokens: float, mean_output_tokens: float) -> None:
    for name, v in (("mean_input_tokens", mean_input_tokens), ("mean_output_tokens", mean_output_tokens)):
        if isinstance(v, bool) or not isinstance(v, int | float | np.number) or not math.isfinite(v) or v < 1:
            raise SpecError(f"{name} {v!r}: expected a finite number of tokens >= 1")


def make_instance(adapter_ids: Sequence[str], ranks: Sequence[int] | np.ndarray, rates_rps: Sequence[float] | np.ndarray,
                  *, mean_input_tokens: float, mean_output_tokens: float, headroom: float = DEFAULT_HEADROOM,
                  paths: dict[str, str] | None = None, where: str = "workload") -> Instance:
    """Validate adapters and build the instance the methods place (rates x (1 + headroom)).

    Refused, each with a one-line ``SpecError`` naming the adapter: no adapters, duplicate or empty ids, ranks
    that are not integers in 1 ... 512 (vLLM's largest --max-lora-rank), rates that are not finite and >= 0
    (the spec's rule: an adapter at rate 0 stays in the plan, on a GPU, with no load)."""
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
        if not math.isfinite(q) or q < 0:  # the workload spec's own rule (``spec.Adapter``): >= 0
            raise SpecError(f"{where}: adapter '{a}': rate_rps {q!r}: expected a finite number >= 0")
    return Instance(adapter_ids=tuple(ids), ranks=rk.astype(np.int64), rates_rps=rt * (1.0 + headroom),
                    weights=np.ones(len(ids)), mean_input_tokens=float(mean_input_tokens),
                    mean_output_tokens=float(mean_output_tokens), headroom=float(headroom),
                    paths=dict(paths or {}))


def instance_from_workload(workload, *, headroom: float = DEFAULT_HEADROOM, mean_input_tokens: float | None = None,
                           mean_output_tokens: float | None = None, where: str = "workload",
                           profile: Profile | None = None) -> Instance:
    """The instance of a ``lorapack.spec.Workload``: its adapters, rates, paths and length law.

    A workload that gives its lengths (``"lengths" in workload.model_fields_set``: a YAML ``lengths:`` key, a
    ``Workload(lengths=...)``) is planned with that law, the overrides replacing a fixed or log-normal law's
    means (an empirical law's means are its table's: overriding them is an error, as in ``simulate``). One that
    gives none (an adapters CSV) is planned with the profile's law around the means (default 223/197, or the
    overrides): ``Instance.lengths`` None, which ``profile`` (when given) checks is reachable."""
    from ..spec import TraceArrivals

    if isinstance(workload.arrivals, TraceArrivals):
        raise SpecError(f"{where}: trace arrivals carry no per-adapter rates; placement needs 'rate_rps' per "
                        f"adapter (Poisson arrivals)")
    law: LengthsSpec | None = workload.lengths if "lengths" in workload.model_fields_set else None
    overrides = {k: v for k, v in (("mean_input_tokens", mean_input_tokens),
                                   ("mean_output_tokens", mean_output_tokens)) if v is not None}
    if law is not None and overrides:
        law = _overridden(law, overrides, where)
    if law is not None:
        pi, po = law_means(law)
    else:
        pi = overrides.get("mean_input_tokens", DEFAULT_MEAN_INPUT_TOKENS)
        po = overrides.get("mean_output_tokens", DEFAULT_MEAN_OUTPUT_TOKENS)
    inst = make_instance(
        workload.adapter_ids, workload.ranks, workload.rates_rps, mean_input_tokens=pi, mean_output_tokens=po,
        headroom=headroom, paths={a.adapter_id: a.path for a in workload.adapters if a.path}, where=where)
    inst = replace(inst, lengths=law)
    if profile is not None:
        check_assumed_lengths(inst, profile, where)
    return inst


def _overridden(law: LengthsSpec, overrides: dict[str, float], where: str) -> LengthsSpec:
    """``law`` with the ``--mean-input-tokens`` / ``--mean-output-tokens`` overrides (validated as the spec)."""
    from ..spec import Workload
    from ..workload import with_mean_lengths

    flags = "/".join(f"--{k.replace('_', '-')}" for k in overrides)
    if law.kind == "empirical":
        raise SpecError(f"{where}: {flags}: the workload's lengths are 'empirical' (their means are the table's); "
                        f"expected no mean overrides, or fixed or lognormal lengths")
    probe = Workload(adapters=[{"adapter_id": "a", "rank": 8, "rate_rps": 1.0}], lengths=law)
    try:
        return with_mean_lengths(probe, overrides.get("mean_input_tokens"),
                                 overrides.get("mean_output_tokens")).lengths
    except SpecError as e:
        raise SpecError(f"{where}: {flags}: {e}") from None


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
