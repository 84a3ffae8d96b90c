"""Toy oracles and instances for the placement tests (placement.md §7)."""

from __future__ import annotations

import math

import numpy as np

from lorapack.oracle import GpuCandidate, Prediction
from lorapack.placement import OracleOverrides, PlaceConfig, Plan, make_instance, place
from lorapack.profile import find_profile

LLAMA = find_profile("llama-3.1-8b-instruct")
TAU = 420.0  # tokens per request (223 + 197)


class ToyOracle:
    """Starved iff Σλ > ``cap_rps``; throughput ``min(τ Σλ, τ cap)`` times a mild preference for
    ``prefer_a`` (5 % less for any other A). ``cheap`` decides lookahead vs lazy questions in the driver."""

    name = "toy"

    def __init__(self, cap_rps: float, prefer_a: int | None = None, cheap: bool = True,
                 ttft_s: float = 0.1) -> None:
        self.cap_rps = cap_rps
        self.prefer_a = prefer_a
        self.cheap = cheap
        self.ttft_s = ttft_s
        self.asked: list[tuple[int, int, float]] = []  # (N, A, Σλ) per candidate

    def predict(self, cands: list[GpuCandidate]) -> list[Prediction]:
        out = []
        for c in cands:
            lam = float(c.rates_rps.sum())
            self.asked.append((c.n_adapters, c.max_loras, lam))
            starts = c.startup()[0]
            tau = c.input_tokens + c.output_tokens
            thr = min(lam, self.cap_rps) * tau
            if self.prefer_a is not None and c.max_loras != self.prefer_a:
                thr *= 0.95
            out.append(Prediction(fits=starts, throughput_tok_s=thr if starts else 0.0, incoming_tok_s=lam * tau,
                                  starved=float(lam > self.cap_rps + 1e-9) if starts else 1.0,
                                  itl_ms=math.nan, ttft_s=self.ttft_s if starts else math.nan))
        return out


def toy_capacity(cap_rps: float):
    """C(S) consistent with ``ToyOracle``: a passing GPU serves at most cap x τ tokens/s, so K = cap τ."""
    return lambda slot_rank: 0.9 * cap_rps * TAU


def instance(rates, ranks=None, headroom: float = 0.0, ids=None):
    rates = np.asarray(rates, dtype=float)
    ranks = np.full(len(rates), 8) if ranks is None else np.asarray(ranks)
    ids = ids or [f"a{i:03d}" for i in range(len(rates))]
    return make_instance(ids, ranks, rates, mean_input_tokens=223, mean_output_tokens=197, headroom=headroom)


def run_place(adapters, profile, method: str = "proposed", **kw) -> Plan:
    """``place()`` with one keyword list, split into its ``PlaceConfig`` and ``OracleOverrides``."""
    swaps = {k: kw.pop(k) for k in list(kw) if k in OracleOverrides.__dataclass_fields__}
    progress = kw.pop("progress", None)
    return place(adapters, profile, PlaceConfig(method=method, **kw), OracleOverrides(**swaps), progress)


def toy_kwargs(cap_rps: float, **kw) -> dict:
    """``run_place`` keywords that swap every twin use for the toy oracle (no simulation)."""
    toy = ToyOracle(cap_rps, **kw)
    return dict(oracle=toy, search_oracle=toy, verify_oracle=toy, capacity=toy_capacity(cap_rps), workers=1)
