"""The feasibility seam: *can this GPU serve these adapters with ``--max-loras A``, and how well?*

One typed question (``GpuCandidate``), one typed answer (``Prediction``), many per call::

    oracle.predict([cand, ...]) -> [Prediction, ...]

Every oracle applies vLLM's start-up memory rule first (``MemoryOracle``: exact and instantaneous) and
answers the rest its own way: ``TwinOracle`` simulates (seeds and duration are parameters), the learned
models of ``lorapack.surrogate`` predict. Placement never knows which oracle answers.

``features()`` is the only feature code in lorapack: sweep rows, training and queries all call it, so a
model is always asked about the features it was trained on.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Protocol, runtime_checkable

import numpy as np

from .errors import SpecError
from .objective import STARVED_PROBABILITY
from .profile import VLLM_LORA_RANKS, Profile
from .server import ServerConfig, ServerFlag, rules_for_version
from .spec import (
    DEFAULT_LENGTHS_CV,
    DEFAULT_MEAN_INPUT_TOKENS,
    DEFAULT_MEAN_OUTPUT_TOKENS,
    LengthsSpec,
    LognormalArrivals,
    ModulatedArrivals,
    PoissonArrivals,
)
from .twin.jitcache import lazy_njit
from .twin.metrics import RunMetrics

NAN = float("nan")
CandidateArrivals = PoissonArrivals | LognormalArrivals | ModulatedArrivals  # laws driven by per-adapter rates
# The learned models were trained on sweeps of the profile's log-normal length law (``profile_cv``) around the
# reference means; a candidate whose law has another shape is outside their training. The cv is compared within
# this relative tolerance: near saturation the mean TTFT moves by orders of magnitude between cv 0.84 and 1.1.
LENGTHS_CV_TOLERANCE = 0.02
LENGTH_FEATURES = ("mean_input_tokens", "mean_output_tokens")  # the features that carry a candidate's lengths

# Column order of ``features()``. The first seven are the paper's (placement.md §3.1); the rest are lorapack's:
# the slot rank vLLM pads every slot to, the mean lengths (a model is valid only near its training lengths),
# the busiest adapter's rate and the expected offered token rate (the healthy throughput itself).
FEATURE_NAMES: tuple[str, ...] = (
    "served_adapters",  # N
    "adapter_slots",  # A (--max-loras)
    "sum_rate",  # Σ λ_i, req/s
    "std_rate",  # population std of λ_i (ddof 0)
    "max_size",  # largest adapter rank
    "mean_size",  # mean adapter rank
    "std_size",  # population std of the ranks (ddof 0)
    "max_lora_rank",  # S (--max-lora-rank)
    "mean_input_tokens",
    "mean_output_tokens",
    "max_rate",  # max λ_i, req/s
    "incoming_expected_tok_s",  # Σ λ_i × (mean input + mean output)
)


def default_slot_rank(max_rank: int, choices: tuple[int, ...] = VLLM_LORA_RANKS) -> int:
    """Smallest ``--max-lora-rank`` vLLM accepts (``choices``: the version's, 0.8.5's by default) that holds
    ``max_rank`` (placement.md §1)."""
    for s in choices:
        if s >= max_rank:
            return s
    raise SpecError(f"adapter rank {max_rank} exceeds the largest --max-lora-rank vLLM accepts "
                    f"({choices[-1]})")


def profile_cv(profile: Profile) -> float:
    """The cv of the profile's length law: fitted on its real runs (``runs_lengths``), else the spec default."""
    law = profile.runs_lengths
    return float(law.cv) if law is not None else DEFAULT_LENGTHS_CV


def profile_length_law(profile: Profile, mean_input_tokens: float = DEFAULT_MEAN_INPUT_TOKENS,
                       mean_output_tokens: float = DEFAULT_MEAN_OUTPUT_TOKENS) -> LengthsSpec:
    """The profile's ShareGPT-like length law around the given means: what the twin assumes for a candidate
    without a law of its own, and what the sweeps behind the learned models simulated."""
    return LengthsSpec(kind="lognormal", mean_input_tokens=mean_input_tokens, mean_output_tokens=mean_output_tokens,
                       cv=profile_cv(profile))


def is_profile_law(lengths: LengthsSpec | None, profile: Profile) -> bool:
    """``lengths`` is the profile's law up to its means (None: the candidate assumes it)."""
    if lengths is None:
        return True
    return lengths.kind == "lognormal" and abs(float(lengths.cv) - profile_cv(profile)) <= 1e-9 * profile_cv(profile)


def length_law_key(lengths: LengthsSpec | None, profile: Profile) -> tuple | None:
    """What identifies a candidate's length law in caches (None for the profile's own law, so caches made before
    candidates carried laws stay valid): its kind, cv and table (the means are keyed apart)."""
    if is_profile_law(lengths, profile):
        return None
    assert lengths is not None
    if lengths.kind == "empirical":
        from .workload.lengths import lengths_table_digest

        return ("empirical", lengths_table_digest(lengths.path))
    return (lengths.kind, float(lengths.cv) if lengths.kind == "lognormal" else None)


def length_law_problem(cand: GpuCandidate) -> str:
    """'' when ``cand``'s length law has the shape the learned models were trained on (the profile's log-normal
    law, its cv within ``LENGTHS_CV_TOLERANCE``), else what differs (their means are checked as features)."""
    law = cand.lengths
    if law is None:
        return ""
    cv = profile_cv(cand.profile)
    if law.kind == "lognormal" and abs(float(law.cv) - cv) <= LENGTHS_CV_TOLERANCE * cv:
        return ""
    shape = f"log-normal with cv {law.cv:g}" if law.kind == "lognormal" else law.kind
    return f"lengths {shape} (trained on the profile's log-normal law, cv {cv:g})"


def lengths_outside_training(oracle: Oracle, cand: GpuCandidate) -> str:
    """Why a learned oracle's answers about ``cand``'s request lengths lie outside its training data -- the
    law's shape (``length_law_problem``) or its means (the oracle's ``out_of_range`` check of those features)
    -- or '' when they do not, or when ``oracle`` is not learned."""
    ranges = getattr(oracle, "out_of_range", None)  # a learned oracle's per-row check of its training ranges
    if not getattr(oracle, "learned", False) or ranges is None:
        return ""
    parts = [length_law_problem(cand), *(x for x in ranges(features([cand]))[0].split("; ")
                                         if x.startswith(LENGTH_FEATURES))]
    return "; ".join(x for x in parts if x)


@lru_cache(maxsize=4096)
def _slots_only(max_loras: int) -> ServerConfig:
    """``ServerConfig(max_loras=max_loras)``, shared: placement's candidates vary only ``max_loras``."""
    return ServerConfig(max_loras=max_loras)


@dataclass(frozen=True, eq=False)
class GpuCandidate:
    """One GPU as a placement would configure it: its adapters (registration order) and its server
    (``server``: the one ``ServerConfig``, issue 22).

    ``None`` flags of ``server`` take vLLM's / the profile's defaults: ``max_lora_rank`` = the smallest accepted
    value that holds the largest rank, ``max_cpu_loras`` = max(N, A), batch limits and lengths from the profile.
    ``cand.max_loras`` etc. read ``server``'s flags.
    """

    profile: Profile
    ranks: np.ndarray  # int [N]: adapter ranks
    rates_rps: np.ndarray  # float [N]: Poisson request rates
    server: ServerConfig  # the flags: A = server.max_loras, S = server.max_lora_rank, ...
    mean_input_tokens: float | None = None
    mean_output_tokens: float | None = None
    # the request length law (None: the profile's, ``profile_length_law``); for kinds fixed and lognormal the
    # candidate's means replace the law's, so one law serves every candidate of a workload
    lengths: LengthsSpec | None = None

    def __post_init__(self) -> None:
        ranks = np.asarray(self.ranks)
        rates = np.asarray(self.rates_rps, dtype=np.float64)
        if ranks.ndim != 1 or rates.ndim != 1 or len(ranks) != len(rates):
            raise SpecError(f"a GPU candidate needs one rank and one rate per adapter; got {ranks.shape} ranks "
                            f"and {rates.shape} rates")
        if len(ranks) == 0:
            raise SpecError("a GPU candidate needs at least one adapter")
        if not np.issubdtype(ranks.dtype, np.integer):
            if not (np.all(np.isfinite(ranks)) and np.all(ranks == np.round(ranks))):
                raise SpecError("adapter ranks must be integers")
        ranks = ranks.astype(np.int64)
        if ranks.min() < 1:
            raise SpecError(f"adapter rank {int(ranks.min())}: expected an integer >= 1")
        if not np.all(np.isfinite(rates)) or rates.min() < 0:
            raise SpecError("adapter rates must be finite numbers >= 0 req/s")
        server = self.server
        if not isinstance(server, ServerConfig):
            raise SpecError(f"a GPU candidate's server: expected a ServerConfig, got {type(server).__name__}")
        if int(server.max_loras) < 1:
            raise SpecError(f"--max-loras {server.max_loras}: expected an integer >= 1")
        for name in ("mean_input_tokens", "mean_output_tokens"):
            v = getattr(self, name)
            if v is not None and (not math.isfinite(v) or v < 1):
                raise SpecError(f"{name} {v}: expected a finite number of tokens >= 1")
        if self.lengths is not None and not isinstance(self.lengths, LengthsSpec):
            raise SpecError(f"a GPU candidate's lengths: expected a lorapack.spec.LengthsSpec, got "
                            f"{type(self.lengths).__name__}")
        s = server.max_lora_rank
        if s is not None and int(s) < int(ranks.max()):
            raise SpecError(f"--max-lora-rank {s} is below the largest adapter rank {int(ranks.max())}")
        object.__setattr__(self, "ranks", ranks)
        object.__setattr__(self, "rates_rps", rates)
        if type(server.max_loras) is not int:
            object.__setattr__(self, "server", server.replace(max_loras=int(server.max_loras)))

    @classmethod
    def prevalidated(cls, profile: Profile, ranks: np.ndarray, rates_rps: np.ndarray, max_loras: int,
                     mean_input_tokens: float | None = None, mean_output_tokens: float | None = None,
                     lengths: LengthsSpec | None = None) -> GpuCandidate:
        """A candidate built without the checks of ``__init__``, for callers whose arrays are already
        validated (int64 ranks >= 1, finite float64 rates >= 0, non-empty; placement's ``Instance``): the
        greedy builds thousands of candidates per placement, and the checks would dominate its time. Its
        server is ``ServerConfig(max_loras=max_loras)`` (one shared, cached instance per value)."""
        self = object.__new__(cls)
        for name, v in (("profile", profile), ("ranks", ranks), ("rates_rps", rates_rps),
                        ("server", _slots_only(int(max_loras))),
                        ("mean_input_tokens", mean_input_tokens), ("mean_output_tokens", mean_output_tokens),
                        ("lengths", lengths)):
            object.__setattr__(self, name, v)
        return self

    # the server's flags, read from ``server`` (read-only: replace ``server`` to change them)
    max_loras = ServerFlag()
    max_lora_rank = ServerFlag()
    max_cpu_loras = ServerFlag()
    max_num_seqs = ServerFlag()
    max_num_batched_tokens = ServerFlag()

    # ---- resolved flags ----
    @property
    def n_adapters(self) -> int:
        return len(self.ranks)

    @property
    def slot_rank(self) -> int:
        """S: the ``--max-lora-rank`` this GPU runs with."""
        # placement's default is the smallest of 0.8.5's values (8 and up): every version accepts them
        return int(self.max_lora_rank) if self.max_lora_rank is not None else default_slot_rank(int(self.ranks.max()))

    @property
    def cpu_loras(self) -> int:
        return int(self.max_cpu_loras) if self.max_cpu_loras is not None else max(self.n_adapters, self.max_loras)

    @property
    def input_tokens(self) -> float:
        return float(self.mean_input_tokens) if self.mean_input_tokens is not None else DEFAULT_MEAN_INPUT_TOKENS

    @property
    def output_tokens(self) -> float:
        return float(self.mean_output_tokens) if self.mean_output_tokens is not None else DEFAULT_MEAN_OUTPUT_TOKENS

    def length_law(self) -> LengthsSpec:
        """The law the twin draws this candidate's request lengths from: ``lengths`` (its means the
        candidate's, unless empirical), else the profile's law around the candidate's means."""
        if self.lengths is None:
            return profile_length_law(self.profile, self.input_tokens, self.output_tokens)
        if self.lengths.kind == "empirical":
            return self.lengths
        return self.lengths.model_copy(update={"mean_input_tokens": self.input_tokens,
                                               "mean_output_tokens": self.output_tokens})

    @property
    def incoming_expected_tok_s(self) -> float:
        """Expected offered token rate: Σ λ_i × (mean input + mean output tokens)."""
        return float(self.rates_rps.sum()) * (self.input_tokens + self.output_tokens)

    def startup(self) -> tuple[bool, int, str | None]:
        """vLLM's start-up rule for ``(A, S)`` (the profile's version's rule): ``(starts, kv_cache_tokens,
        error_type)``."""
        return self.profile.startup(self.max_loras, self.slot_rank,
                                    kv_start=rules_for_version(self.profile.vllm_version).kv_start)

    def server_config(self) -> ServerConfig:
        """``server`` with ``--max-lora-rank`` and ``--max-cpu-loras`` resolved (``slot_rank``, ``cpu_loras``):
        the server the twin runs."""
        return self.server.replace(max_lora_rank=self.slot_rank, max_cpu_loras=self.cpu_loras)


def feature_row(cand: GpuCandidate) -> dict[str, float]:
    """The features of one candidate, by name (``FEATURE_NAMES`` order)."""
    return dict(zip(FEATURE_NAMES, features([cand])[0].tolist(), strict=True))


_SLOT_RANKS = np.array(VLLM_LORA_RANKS, dtype=np.float64)
# adapter entries (summed over candidates) whose features numpy computes per process before the compiled kernel
# is readied (numba's set-up costs 0.5-1 s); see _features_numpy
NUMPY_FEATURE_ENTRIES = 5_000_000
# the numpy version pads every candidate to the longest: above this many cells the kernel answers
NUMPY_FEATURE_CELLS = 2_000_000


@lazy_njit(numpy_budget=NUMPY_FEATURE_ENTRIES)
def _features_kernel(sizes, ranks, rates, scalars, slot_ranks, out):  # pragma: no cover - compiled
    """One row per candidate from the concatenated rank / rate vectors (population std: ddof 0, two-pass)."""
    k = 0
    for i in range(sizes.shape[0]):
        n = sizes[i]
        q_sum = 0.0
        q_max = -np.inf
        r_sum = 0.0
        r_max = -np.inf
        for j in range(k, k + n):
            q_sum += rates[j]
            q_max = max(q_max, rates[j])
            r_sum += ranks[j]
            r_max = max(r_max, ranks[j])
        q_mean = q_sum / n
        r_mean = r_sum / n
        q_ss = 0.0
        r_ss = 0.0
        for j in range(k, k + n):
            q_ss += (rates[j] - q_mean) ** 2
            r_ss += (ranks[j] - r_mean) ** 2
        k += n
        a, s, pi, po = scalars[i, 0], scalars[i, 1], scalars[i, 2], scalars[i, 3]
        if s == 0.0:  # default --max-lora-rank: the smallest value vLLM accepts that holds the largest rank
            for v in slot_ranks:
                if v >= r_max:
                    s = v
                    break
        out[i, 0] = n
        out[i, 1] = a
        out[i, 2] = q_sum
        out[i, 3] = np.sqrt(q_ss / n)
        out[i, 4] = r_max
        out[i, 5] = r_mean
        out[i, 6] = np.sqrt(r_ss / n)
        out[i, 7] = s
        out[i, 8] = pi
        out[i, 9] = po
        out[i, 10] = q_max
        out[i, 11] = q_sum * (pi + po)


def _features_numpy(sizes, ranks, rates, scalars, slot_ranks, out) -> None:
    """``_features_kernel`` in numpy, bit for bit: a short-lived command (``lorapack place --no-verify``) then
    never sets numba up. The candidates' vectors are padded into one matrix, a row each, and summed along the
    rows with ``cumsum`` (sequential, as the loop; numpy's ``sum`` is pairwise): the padding adds exact
    zeros after the last element."""
    n = sizes.astype(np.float64)
    width = int(sizes.max())
    pad = np.arange(width) < sizes[:, None]  # [candidate, position]: holds an adapter
    q = np.zeros(pad.shape)
    r = np.zeros(pad.shape)
    q[pad], r[pad] = rates, ranks  # row-major boolean assignment: the concatenation's order
    q_sum, r_sum = np.cumsum(q, axis=1)[:, -1], np.cumsum(r, axis=1)[:, -1]
    q_ss = np.cumsum(np.where(pad, (q - (q_sum / n)[:, None]) ** 2, 0.0), axis=1)[:, -1]
    r_ss = np.cumsum(np.where(pad, (r - (r_sum / n)[:, None]) ** 2, 0.0), axis=1)[:, -1]
    r_max = np.where(pad, r, -np.inf).max(axis=1)
    s = scalars[:, 1].copy()
    for i in np.flatnonzero(s == 0.0).tolist():  # default --max-lora-rank, as the kernel
        s[i] = next((v for v in slot_ranks.tolist() if v >= r_max[i]), 0.0)
    pi, po = scalars[:, 2], scalars[:, 3]
    out[:] = np.column_stack([n, scalars[:, 0], q_sum, np.sqrt(q_ss / n), r_max, r_sum / n, np.sqrt(r_ss / n), s,
                              pi, po, np.where(pad, q, -np.inf).max(axis=1), q_sum * (pi + po)])


def features(cands: Sequence[GpuCandidate]) -> np.ndarray:
    """Feature matrix ``[len(cands), len(FEATURE_NAMES)]`` (float64). The only feature code in lorapack.

    Compiled: a few microseconds per candidate, so a placement can afford it for every query. While the
    kernel is not readied in a process, numpy computes the features of small batches (``NUMPY_FEATURE_CELLS``)
    (the same bits; ``tests/test_oracle.py``)."""
    n = len(cands)
    out = np.empty((n, len(FEATURE_NAMES)), dtype=np.float64)
    if n == 0:
        return out
    sizes = np.fromiter((c.n_adapters for c in cands), np.int64, n)
    ranks = np.concatenate([c.ranks for c in cands]).astype(np.float64)
    rates = np.concatenate([c.rates_rps for c in cands])
    scalars = np.array([(c.max_loras, c.max_lora_rank or 0, c.mean_input_tokens or DEFAULT_MEAN_INPUT_TOKENS,
                         c.mean_output_tokens or DEFAULT_MEAN_OUTPUT_TOKENS) for c in cands], np.float64)
    if n * int(sizes.max()) <= NUMPY_FEATURE_CELLS and _features_kernel.prefer_numpy(len(ranks)):
        _features_numpy(sizes, ranks, rates, scalars, _SLOT_RANKS, out)
    else:
        _features_kernel(sizes, ranks, rates, scalars, _SLOT_RANKS, out)
    return out




@dataclass(frozen=True)
class Prediction:
    """An oracle's answer for one candidate.

    ``starved`` is the probability of the run-level label (throughput < 0.9 × incoming; the twin gives the
    fraction of its seeds). ``adapter_starved`` and ``starved_adapters`` (indices into the candidate's
    adapters) come from the twin's per-adapter check (``twin.metrics.compute_metrics``); learned oracles leave
    them NaN / empty.
    A learned oracle sets ``in_range = False`` and names the offending feature in ``out_of_range`` when the
    candidate lies outside its training data. Metrics are NaN when the server does not start (``fits`` False).
    """

    fits: bool  # vLLM starts with (A, S)
    throughput_tok_s: float
    incoming_tok_s: float
    starved: float  # probability in [0, 1]
    itl_ms: float
    ttft_s: float
    kv_cache_tokens: int = 0
    error_type: str | None = None
    adapter_starved: float = NAN
    starved_adapters: tuple[int, ...] = ()
    ttft_p99_s: float = NAN
    itl_p99_ms: float = NAN
    in_range: bool = True
    out_of_range: str = ""
    seeds: int = 0  # simulations behind the answer (twin only)
    extra: dict = field(default_factory=dict, compare=False)

    @property
    def throughput_ratio(self) -> float:
        return self.throughput_tok_s / self.incoming_tok_s if self.incoming_tok_s > 0 else NAN

    def serves(self, max_starved: float = STARVED_PROBABILITY) -> bool:
        """Starts and is not predicted starved (run level, and per adapter where known)."""
        if not self.fits or not self.starved < max_starved:
            return False
        return not (self.adapter_starved >= max_starved)  # NaN (unknown) passes


def refused(cand: GpuCandidate, kv: int, err: str | None) -> Prediction:
    return Prediction(fits=False, throughput_tok_s=0.0, incoming_tok_s=cand.incoming_expected_tok_s,
                      starved=1.0, itl_ms=NAN, ttft_s=NAN, kv_cache_tokens=int(kv), error_type=err,
                      adapter_starved=1.0)


@runtime_checkable
class Oracle(Protocol):
    """Anything that answers candidates in batches."""

    name: str

    def predict(self, candidates: Sequence[GpuCandidate]) -> list[Prediction]: ...


class MemoryRuleOracle:
    """Applies the start-up rule first, then asks ``_predict_fitting`` about the candidates that start.

    Subclasses implement ``_predict_fitting(cands, kv_tokens) -> list[Prediction]``. Used alone it is the
    memory oracle: every candidate that starts "serves" with unknown metrics (NaN, starved 0).
    """

    name = "memory"

    def predict(self, candidates: Sequence[GpuCandidate]) -> list[Prediction]:
        out: list[Prediction | None] = [None] * len(candidates)
        fit_idx, fit_kv = [], []
        rule: dict[tuple, tuple[bool, int, str | None]] = {}  # the start-up rule depends on (profile, A, S) only
        for i, c in enumerate(candidates):
            key = (id(c.profile), c.max_loras, c.slot_rank)
            if key not in rule:
                rule[key] = c.startup()
            starts, kv, err = rule[key]
            if starts:
                fit_idx.append(i)
                fit_kv.append(kv)
            else:
                out[i] = refused(c, kv, err)
        if fit_idx:
            preds = self._predict_fitting([candidates[i] for i in fit_idx], fit_kv)
            for i, p in zip(fit_idx, preds, strict=True):
                out[i] = p
        return out  # type: ignore[return-value]

    def _predict_fitting(self, cands: Sequence[GpuCandidate], kv_tokens: Sequence[int]) -> list[Prediction]:
        return [Prediction(fits=True, throughput_tok_s=NAN, incoming_tok_s=c.incoming_expected_tok_s,
                           starved=0.0, itl_ms=NAN, ttft_s=NAN, kv_cache_tokens=int(kv))
                for c, kv in zip(cands, kv_tokens, strict=True)]


@dataclass
class TwinOracle(MemoryRuleOracle):
    """The digital twin as an oracle: each candidate simulated for ``duration_s`` with every seed.

    Arrivals are Poisson at the candidate's rates (common random numbers: adapter ``i``'s stream depends on
    ``(seed, i, rate)``), lengths follow the candidate's law (``GpuCandidate.length_law``: by default the
    profile's fitted ShareGPT-like law, ``runs_lengths``, around the candidate's means). ``early_stop`` (default on) ends runs whose outcome is clear (``twin.early``).
    Metrics are averaged over seeds; ``starved`` is the fraction of seeds starved; ``starved_adapters``
    the union over seeds.
    """

    seeds: tuple[int, ...] = (0,)
    duration_s: float = 3600.0
    early_stop: bool = True
    arrivals: CandidateArrivals | None = None  # None: Poisson
    name: str = "twin"
    n_simulations: int = field(default=0, init=False)
    sim_wall_s: float = field(default=0.0, init=False)

    def __post_init__(self) -> None:
        if not self.seeds:
            raise SpecError("the twin oracle needs at least one seed")
        if not math.isfinite(self.duration_s) or self.duration_s <= 0:
            raise SpecError(f"duration {self.duration_s}: expected a positive number of seconds")
        self.seeds = tuple(int(s) for s in self.seeds)
        check_candidate_arrivals(self.arrivals)

    def _predict_fitting(self, cands: Sequence[GpuCandidate], kv_tokens: Sequence[int]) -> list[Prediction]:
        return [self._one(c) for c in cands]

    def simulate(self, cand: GpuCandidate, seed: int) -> RunMetrics:
        """One twin run of ``cand`` (``twin.run.simulate_requests``)."""
        import time

        from .twin.early import EarlyStopOptions
        from .twin.run import simulate_requests
        from .workload import generate_requests

        t0 = time.perf_counter()
        wl = candidate_workload(cand, self.duration_s, self.arrivals)
        req = generate_requests(wl, self.duration_s, seed)
        m, _res = simulate_requests(cand.profile, cand.ranks, req, cand.server_config(), self.duration_s,
                                    early_stop=EarlyStopOptions() if self.early_stop else None)
        self.n_simulations += 1
        self.sim_wall_s += time.perf_counter() - t0
        return m

    def _one(self, cand: GpuCandidate) -> Prediction:
        return self.aggregate(cand, [self.simulate(cand, s) for s in self.seeds])

    @staticmethod
    def aggregate(cand: GpuCandidate, runs: Sequence[RunMetrics]) -> Prediction:
        """One answer from the runs of ``cand`` (one per seed)."""
        first = runs[0]
        if first.oom:  # the start-up rule already passed; kept for safety
            return refused(cand, first.kv_cache_tokens, first.error_type)

        def mean(values: Sequence[float | None], scale: float = 1.0) -> float:
            xs = [float(v) for v in values if v is not None and math.isfinite(float(v))]
            return float(np.mean(xs)) * scale if xs else NAN

        bad: set[int] = set()
        for r in runs:
            bad.update(r.starved_adapter_indices)
        return Prediction(
            fits=True, throughput_tok_s=mean([r.throughput_tok_s for r in runs]),
            incoming_tok_s=mean([r.incoming_tok_s for r in runs]),
            starved=float(np.mean([bool(r.starved) for r in runs])), itl_ms=mean([r.itl_mean_ms for r in runs]),
            ttft_s=mean([r.ttft_mean_ms for r in runs], 1e-3), kv_cache_tokens=int(first.kv_cache_tokens),
            adapter_starved=float(np.mean([bool(r.adapter_starved) for r in runs])),
            starved_adapters=tuple(sorted(bad)), ttft_p99_s=mean([r.ttft_p99_ms for r in runs], 1e-3),
            itl_p99_ms=mean([r.itl_p99_ms for r in runs]), seeds=len(runs),
            extra={"stop_reasons": [r.stop_reason for r in runs],
                   "ttft_penalised_s": mean([r.ttft_penalised_mean_ms for r in runs], 1e-3)})


CANDIDATE_ARRIVALS = ("poisson", "lognormal", "modulated")


def check_candidate_arrivals(arrivals: object) -> None:
    """A candidate's adapters are given by their rates: only per-adapter processes driven by a rate apply."""
    if arrivals is None:
        return
    kind = getattr(arrivals, "kind", None)
    if kind not in CANDIDATE_ARRIVALS:
        raise SpecError(f"arrivals of kind {kind!r} for the twin oracle: expected one of "
                        f"{', '.join(CANDIDATE_ARRIVALS)} (a candidate GPU is given by its adapters' rates)")


def candidate_workload(cand: GpuCandidate, duration_s: float, arrivals: CandidateArrivals | None = None):
    """The ``Workload`` the twin simulates for ``cand``: ``arrivals`` (default Poisson) at the candidate's
    rates, the candidate's length law (``GpuCandidate.length_law``)."""
    from .spec import Adapter, PoissonArrivals, Workload

    lengths = cand.length_law()
    adapters = [Adapter(adapter_id=f"a{i}", rank=int(r), rate_rps=float(q))
                for i, (r, q) in enumerate(zip(cand.ranks, cand.rates_rps, strict=True))]
    return Workload(adapters=adapters, lengths=lengths, arrivals=arrivals if arrivals is not None else PoissonArrivals(),
                    duration_s=duration_s)
