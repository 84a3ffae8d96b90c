"""Multi-adapter workloads derived from a request trace, split into an estimation and a replay window
(placement.md §6.2).

``derive_workload(trace, DeriveOptions(...), seed)`` turns an aggregate trace (``arrived_at,
num_prefill_tokens, num_decode_tokens``) into N adapters with ranks, per-adapter rates estimated on the first
window, and the requests of the second window to replay through the twin:

* **load scaling ×k** before anything else: the integer part by replication with uniform ``±jitter_s``
  jitter (clipped at 0, re-sorted), the fractional part by Bernoulli thinning (``trace.scaled_trace``);
* **adapter assignment**: one request per adapter, the rest multinomial over the adapter weights
  (``uniform``, ``zipf:s`` over a seeded permutation, ``dirichlet:alpha``), shuffled; needs at least as many
  requests as adapters;
* **ranks** round-robin over the rank set, then shuffled (independent of the rates);
* **lengths**: the profile's ShareGPT-like law (default; what the surrogates were trained on) or the trace's
  own token counts (``trace_lengths``);
* **windows** (the trace covers one hour):

  - ``E1`` split-half (default): estimate on ``[0, split_s)``, replay ``[split_s, span)`` shifted to 0;
  - ``E2`` two-hour synthesis: hour 1 = the labelled trace (estimation over its span); hour 2 = the same
    scaled timestamps with fresh ``±jitter_s`` jitter and labels redrawn from the same weights (replay);
  - ``E3`` Poisson: estimate on the whole labelled trace, replay Poisson arrivals at exactly those rates
    for the span (the planner's own assumption: its best case).

* **rates**: ``λ_i`` = requests of adapter ``i`` in the estimation window / window length, floored at
  ``1 / window`` (an adapter unseen in the window still exists and gets a nominal rate);
* **rate profile**: the estimation window's requests per ``RATE_PROFILE_PERIOD_S`` divided by their mean
  (a partial last period by its length): the load swings every adapter sees at once, which a planner may
  verify against (``rate_profile_arrivals``).

``span`` is the trace's last arrival rounded up to the next second (3,502 s → 3,503 s for the conversation
trace); E2/E3 divide by it, not by 3,600, so their rates are unbiased. Every draw comes from its own stream
``default_rng([seed, DERIVE_KEY, stream])``: the same trace, options and seed give identical workloads.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import numpy as np

from ..errors import SpecError
from ..spec import (
    DEFAULT_MEAN_INPUT_TOKENS,
    DEFAULT_MEAN_OUTPUT_TOKENS,
    Adapter,
    LengthsSpec,
    ModulatedArrivals,
    Workload,
)
from ..twin.types import RequestArrays
from .arrivals import poisson_times
from .lengths import sample_lengths
from .trace import Trace, assign_adapters, assignment_weights, scaled_trace

PROTOCOLS = ("E1", "E2", "E3")
DEFAULT_SPLIT_S = 1800.0
DEFAULT_JITTER_S = 5.0
RATE_PROFILE_PERIOD_S = 60.0
DERIVE_KEY = 0x646572697665  # "derive": keeps these streams apart from workload.generate's
_S_SCALE, _S_WEIGHTS, _S_ASSIGN, _S_RANKS, _S_LENGTHS = 1, 2, 3, 4, 5
_S_E2_JITTER, _S_E2_ASSIGN, _S_E2_LENGTHS, _S_E3_ARRIVALS, _S_E3_LENGTHS = 6, 7, 8, 9, 10

_WEIGHTS_RE = re.compile(r"^\s*(uniform|zipf|dirichlet)\s*(?::\s*([^\s]+)\s*)?$")
_WEIGHT_DEFAULTS = {"zipf": 1.0, "dirichlet": 0.5}


@dataclass(frozen=True)
class AdapterWeights:
    """How requests are spread over adapters: ``uniform``, ``zipf`` (exponent s) or ``dirichlet`` (alpha)."""

    kind: str = "uniform"
    param: float | None = None  # zipf s (default 1) / dirichlet alpha (default 0.5); None for uniform

    def __str__(self) -> str:
        return self.kind if self.param is None else f"{self.kind}:{self.param:g}"


def parse_weights(text: str) -> AdapterWeights:
    """``uniform`` | ``zipf[:s]`` | ``dirichlet[:alpha]`` -> ``AdapterWeights`` (ValueError if malformed)."""
    m = _WEIGHTS_RE.match(str(text))
    if m is None:
        raise ValueError(f"expected uniform, zipf:S or dirichlet:ALPHA (got {text!r})")
    kind, raw = m.group(1), m.group(2)
    if kind == "uniform":
        if raw is not None:
            raise ValueError(f"uniform weights take no parameter (got {text!r})")
        return AdapterWeights("uniform", None)
    try:
        value = _WEIGHT_DEFAULTS[kind] if raw is None else float(raw)
    except ValueError:
        raise ValueError(f"{kind}: expected a number after ':' (got {raw!r})") from None
    if not math.isfinite(value) or value < 0 or (kind == "dirichlet" and value == 0):
        raise ValueError(f"{kind}: expected a finite number {'> 0' if kind == 'dirichlet' else '>= 0'} "
                         f"(got {raw})")
    return AdapterWeights(kind, value)


@dataclass(frozen=True)
class DeriveOptions:
    """Everything but the trace and the seed that a derived workload depends on."""

    n_adapters: int
    weights: AdapterWeights = field(default_factory=AdapterWeights)
    load_scale: float = 1.0
    rank_set: tuple[int, ...] = (8, 16)
    protocol: str = "E1"
    trace_lengths: bool = False
    profile_lengths: LengthsSpec = field(default_factory=LengthsSpec)  # used unless trace_lengths
    split_s: float = DEFAULT_SPLIT_S  # E1 only
    jitter_s: float = DEFAULT_JITTER_S
    id_prefix: str = "adapter"

    def __post_init__(self) -> None:
        if int(self.n_adapters) < 1:
            raise SpecError(f"n_adapters {self.n_adapters}: expected an integer >= 1")
        if not (math.isfinite(self.load_scale) and self.load_scale > 0):
            raise SpecError(f"load_scale {self.load_scale}: expected a finite number > 0")
        if not self.rank_set or min(self.rank_set) < 1:
            raise SpecError(f"ranks {list(self.rank_set)}: expected a non-empty set of ranks >= 1")
        if self.protocol not in PROTOCOLS:
            raise SpecError(f"protocol {self.protocol!r}: expected one of {', '.join(PROTOCOLS)}")
        if not (math.isfinite(self.split_s) and self.split_s > 0):
            raise SpecError(f"split_s {self.split_s}: expected a finite number of seconds > 0")
        if not (math.isfinite(self.jitter_s) and self.jitter_s >= 0):
            raise SpecError(f"jitter_s {self.jitter_s}: expected a finite number of seconds >= 0")


@dataclass
class DerivedWorkload:
    """Adapters with estimated rates (what a planner sees) and the replay requests (what then happens).

    ``replay.adapter`` indexes ``adapter_ids`` (not a GPU's registration order).
    """

    adapter_ids: list[str]
    ranks: np.ndarray  # int32 [N]
    weights: np.ndarray  # float64 [N]: the assignment weights (sum 1)
    rates_rps: np.ndarray  # float64 [N]: estimated on the estimation window (>= 1 / window)
    estimation_counts: np.ndarray  # int64 [N]: requests per adapter in the estimation window
    estimation_window_s: float
    mean_input_tokens: float  # of the estimation-window requests
    mean_output_tokens: float
    replay: RequestArrays
    replay_window_s: float
    protocol: str
    trace_requests: int  # requests of the scaled trace (both windows, E2: hour 1)
    trace_span_s: float
    lengths: LengthsSpec  # the length law of the requests (for twin runs of candidate GPUs)
    rate_profile: np.ndarray = field(default_factory=lambda: np.ones(1))  # float64 [periods], mean 1

    def rate_profile_arrivals(self) -> ModulatedArrivals:
        """Poisson arrivals whose rate follows the estimation window's load profile (mean 1)."""
        return ModulatedArrivals(period_s=RATE_PROFILE_PERIOD_S, multipliers=[float(m) for m in self.rate_profile])

    @property
    def n_adapters(self) -> int:
        return len(self.adapter_ids)

    @property
    def aggregate_rate_rps(self) -> float:
        """Estimated total request rate (the sum of the planner's rates)."""
        return float(self.rates_rps.sum())

    @property
    def replay_rate_rps(self) -> float:
        return len(self.replay) / self.replay_window_s

    def workload(self, rate_profile: bool = False) -> Workload:
        """The workload spec a planner gets: the adapters with their estimated rates and the mean lengths, and
        (``rate_profile``) arrivals that follow the estimation window's load profile (else Poisson)."""
        base = self.lengths.model_dump()
        base.update(mean_input_tokens=max(1.0, self.mean_input_tokens),
                    mean_output_tokens=max(1.0, self.mean_output_tokens))
        return Workload(
            adapters=[Adapter(adapter_id=a, rank=int(r), rate_rps=float(q))
                      for a, r, q in zip(self.adapter_ids, self.ranks, self.rates_rps, strict=True)],
            lengths=LengthsSpec.model_validate(base), duration_s=self.replay_window_s,
            **({"arrivals": self.rate_profile_arrivals()} if rate_profile else {}))


def _rng(seed: int, stream: int) -> np.random.Generator:
    return np.random.default_rng([int(seed), DERIVE_KEY, stream])


def trace_span_s(trace: Trace) -> float:
    """The trace's window: its last arrival rounded up to the next whole second."""
    return float(math.floor(float(trace.t_s[-1])) + 1.0)


def profile_lengths(cv: float | None) -> LengthsSpec:
    """The ShareGPT-like length law of a profile (means of the reference runs, the profile's fitted CV)."""
    extra = {} if cv is None else {"cv": float(cv)}
    return LengthsSpec(kind="lognormal", mean_input_tokens=DEFAULT_MEAN_INPUT_TOKENS,
                       mean_output_tokens=DEFAULT_MEAN_OUTPUT_TOKENS, **extra)


def _rank_assignment(n: int, rank_set: tuple[int, ...], seed: int) -> np.ndarray:
    ranks = np.resize(np.asarray(sorted(set(rank_set)), dtype=np.int32), n)
    _rng(seed, _S_RANKS).shuffle(ranks)
    return ranks


def _lengths(opts: DeriveOptions, trace: Trace, idx: np.ndarray, seed: int, stream: int
             ) -> tuple[np.ndarray, np.ndarray]:
    if opts.trace_lengths:
        return trace.prompt_tokens[idx].astype(np.int32), trace.output_tokens[idx].astype(np.int32)
    return sample_lengths(opts.profile_lengths, len(idx), _rng(seed, stream))


def _requests(t: np.ndarray, adapter: np.ndarray, p: np.ndarray, o: np.ndarray) -> RequestArrays:
    order = np.lexsort((adapter, t))  # time order, exact ties in adapter order (the RequestArrays contract)
    return RequestArrays(t[order], adapter[order], p[order], o[order])


def derive_workload(trace: Trace, opts: DeriveOptions, seed: int) -> DerivedWorkload:
    """The estimation view and the replay requests of ``trace`` under ``opts`` (module docstring)."""
    if isinstance(seed, bool) or int(seed) < 0:
        raise SpecError(f"seed {seed!r}: expected a non-negative integer")
    n_ad = int(opts.n_adapters)
    span = trace_span_s(trace)
    idx, t = scaled_trace(trace.t_s, opts.load_scale, opts.jitter_s, _rng(seed, _S_SCALE))
    # a copy jittered past the end is clipped into the window, as one before 0 is: ×k keeps k× the requests
    t = np.minimum(t, np.nextafter(span, 0.0))
    if len(t) < n_ad:
        raise SpecError(f"the trace has {len(t):,} requests at load ×{opts.load_scale:g}, fewer than the "
                        f"{n_ad:,} adapters; expected at least one request per adapter (raise load_scale or "
                        f"lower n_adapters)")
    w = opts.weights
    weights = assignment_weights(n_ad, w.kind, w.param if w.kind == "zipf" else 1.0,
                                 w.param if w.kind == "dirichlet" else 0.5, _rng(seed, _S_WEIGHTS))
    label = assign_adapters(len(t), weights, _rng(seed, _S_ASSIGN))
    p, o = _lengths(opts, trace, idx, seed, _S_LENGTHS)

    if opts.protocol == "E1":
        if opts.split_s >= span:
            raise SpecError(f"split_s {opts.split_s:g}: expected a split inside the trace's {span:g} s")
        est = t < opts.split_s
        est_window = opts.split_s
        rep = ~est
        replay = _requests(t[rep] - opts.split_s, label[rep], p[rep], o[rep])
        replay_window = span - opts.split_s
    else:
        est = np.ones(len(t), dtype=bool)
        est_window = span
        replay_window = span
        if opts.protocol == "E2":
            jit = _rng(seed, _S_E2_JITTER).uniform(-opts.jitter_s, opts.jitter_s, size=len(t))
            t2 = np.clip(t + jit, 0.0, np.nextafter(span, 0.0))
            label2 = assign_adapters(len(t2), weights, _rng(seed, _S_E2_ASSIGN))
            p2, o2 = (p, o) if opts.trace_lengths else _lengths(opts, trace, idx, seed, _S_E2_LENGTHS)
            replay = _requests(t2, label2, p2, o2)
        else:  # E3
            counts = np.bincount(label, minlength=n_ad)
            rates = np.maximum(counts, 1) / span
            arr_rng = _rng(seed, _S_E3_ARRIVALS)
            times = [poisson_times(arr_rng, float(q), span) for q in rates]
            t3 = np.concatenate(times)
            a3 = np.repeat(np.arange(n_ad, dtype=np.int32), [len(x) for x in times])
            len_rng = _rng(seed, _S_E3_LENGTHS)
            if opts.trace_lengths:  # bootstrap (P, O) pairs of the labelled trace
                pick = len_rng.integers(0, len(t), size=len(t3))
                p3, o3 = p[pick], o[pick]
            else:
                p3, o3 = sample_lengths(opts.profile_lengths, len(t3), len_rng)
            replay = _requests(t3, a3, p3, o3)

    counts = np.bincount(label[est], minlength=n_ad).astype(np.int64)
    rates = np.maximum(counts, 1) / est_window
    n_est = int(est.sum())
    mean_in = float(p[est].mean()) if n_est else float(opts.profile_lengths.mean_input_tokens)
    mean_out = float(o[est].mean()) if n_est else float(opts.profile_lengths.mean_output_tokens)
    width = len(str(n_ad - 1))
    ids = [f"{opts.id_prefix}-{i:0{width}d}" for i in range(n_ad)]
    # trace lengths reach the planner as their means only (they can exceed the ShareGPT filter that the
    # log-normal law is solved under); surrogates are out of distribution there anyway (placement.md §6.2)
    lengths = (LengthsSpec(kind="fixed", mean_input_tokens=max(1.0, mean_in),
                           mean_output_tokens=max(1.0, mean_out))
               if opts.trace_lengths else opts.profile_lengths)
    return DerivedWorkload(
        adapter_ids=ids, ranks=_rank_assignment(n_ad, opts.rank_set, seed), weights=weights,
        rates_rps=rates, estimation_counts=counts, estimation_window_s=float(est_window),
        mean_input_tokens=mean_in, mean_output_tokens=mean_out, replay=replay,
        replay_window_s=float(replay_window), protocol=opts.protocol, trace_requests=len(t),
        trace_span_s=span, lengths=lengths, rate_profile=load_profile(t[est], float(est_window)))


def load_profile(t_s: np.ndarray, window_s: float, period_s: float = RATE_PROFILE_PERIOD_S) -> np.ndarray:
    """Arrivals per period of ``[0, window_s)`` as rates relative to the window's mean rate (float64, mean 1
    weighted by period length; a partial last period counts by its length). No arrival: ``[1.0]``."""
    if len(t_s) == 0 or not window_s > 0:
        return np.ones(1)
    n = max(1, math.ceil(window_s / period_s))
    counts = np.bincount(np.minimum((np.asarray(t_s) // period_s).astype(np.int64), n - 1), minlength=n)
    lengths = np.minimum(period_s, window_s - period_s * np.arange(n))
    return (counts / lengths) / (len(t_s) / window_s)
