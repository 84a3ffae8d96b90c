"""One unit of sweep work -> rows. A unit is one config, or (with pruning) one N-series.

``run_unit`` is a pure function of its arguments (timing columns aside), so it runs the same in-process, in a
local process pool or on a Ray worker.

Row fields (one row per config; schema in ``store.SCHEMA``):

* identity: ``config_id`` (hash of the canonical config + seed), ``series_id``, ``seed``, ``model``, ``gpu``;
* surrogate features (placement.md §3.1): ``served_adapters`` (N), ``adapter_slots`` (A), ``sum_rate``,
  ``std_rate`` (ddof 0), ``max_size``, ``mean_size``, ``std_size`` (ddof 0), plus ``mean_input_tokens``,
  ``mean_output_tokens`` (the length law's means), ``lengths_kind``, ``max_lora_rank``, ``duration_s`` and the
  tuples the adapters were drawn from;
* labels and metrics of the twin (``twin.metrics``): ``oom``, ``starved``, ``throughput_tok_s``, ``incoming_tok_s``,
  ``throughput_ratio``, ``itl_mean_ms``, ``ttft_mean_ms``, ``ttft_penalised_mean_ms``, ... and
  ``incoming_expected_tok_s`` = ``sum_rate * (mean_input_tokens + mean_output_tokens)`` (analytic, every row);
* how the row was obtained: ``obtained`` in {``full``, ``early_certain_starved``, ``early_likely_starved``,
  ``early_healthy_converged``, ``pruned``, ``oom``}, the twin's ``stop_reason`` and ``simulated_s``;
* provenance: ``twin_version``, ``profile_hash``, ``twin_fingerprint`` (``lorapack.fingerprint``); timing:
  ``wall_s`` (seconds spent on this row).

Which rows carry which label exactly (``bench/sweep_shortcuts.py`` measures the early ones against full runs):
``starved`` every non-OOM row (pruned rows: True); ``throughput_tok_s`` full and early rows (early ones are
extrapolated); ``adapter_starved`` every non-OOM row (starved rows: True); ``adapters_starved`` only rows with
``adapter_labels_exact`` (full runs and healthy early stops; null otherwise); ITL and TTFT are measured up to
the stop (see ``lorapack.surrogate.dataset.LABEL_ROWS`` for what training uses).

OOM rows (vLLM would refuse ``(A, S)`` at start-up) are written without simulating: ``starved`` is null and
the metrics are NaN (throughput 0). Pruned rows (docs/sweep.md, N-series pruning) carry ``starved = True`` and NaN for every
measured metric (throughput, incoming, ITL, TTFT, counts): nothing was simulated for them, and throughput
past the first starving N keeps falling with N, so any extrapolation would be a guess. Train regressors on
rows with ``obtained != 'pruned'`` (or sweep with pruning off).
"""

from __future__ import annotations

import inspect
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from .. import __version__
from ..fingerprint import twin_fingerprint
from ..guards import Limits
from ..profile import Profile
from .grid import SweepConfig

OBTAINED_FULL = "full"
OBTAINED_PRUNED = "pruned"
OBTAINED_OOM = "oom"
STOP_REASONS = ("full", "certain_starved", "likely_starved", "healthy_converged")
# a series is pruned after this many consecutive starving N points (the first + one more, docs/sweep.md, N-series pruning)
PRUNE_AFTER_STARVING = 2
# ... or after one point that starves clearly: its throughput below this share of the offered tokens. The next N
# of a grid offers >= 1.2x the load (paper grids: 320 -> 384, 160 -> 192) to no more capacity, so a run that
# served < 80 % cannot serve >= 90 % there; the second point only rules out noise near the 0.9 boundary
# (bench/sweep_shortcuts.py compares every pruned row with its full-length run)
PRUNE_CLEAR_RATIO = 0.8
# ... or after one starving point whose next N offers at least this many times its tokens (analytic:
# ``offered_tok_s``; 0 = off). In the full paper-llama / paper-qwen sweeps and the additions sweeps of
# 2026-11-28, 2,136 starving points were followed by a simulated point offering >= 1.04x the load: all starved
# (paper grids: >= 1.19x every time); the 51 that recovered were followed by a point offering <= 0.05x
# (padded or redrawn rate vectors). issue 28, docs/sweep.md
PRUNE_NEXT_LOAD = 1.15

# the starved early stops of a sweep extrapolate once the goodput trend's drift over the remaining time is within
# this share of the goodput (the twin's default, ``EarlyStopOptions.starved_max_drift``, is 0.005): on the paper-qwen
# estimate sample the starved stops come ~3 % of the simulation earlier, the throughput SMAPE of all early rows
# moves 0.24 -> 0.27 % and no label changes (bench/sweep_rules.py; bench/sweep_shortcuts.py checks it against full runs).
# The twin's own default, and so its fingerprint, are unchanged.
SWEEP_STARVED_MAX_DRIFT = 0.01

NAN = float("nan")
METRIC_KEYS_FLOAT = ("throughput_tok_s", "input_tok_s", "output_tok_s", "incoming_tok_s", "throughput_ratio",
                     "itl_mean_ms", "tpot_mean_ms", "ttft_mean_ms", "ttft_median_ms", "ttft_p99_ms",
                     "ttft_penalised_mean_ms", "busy_frac", "waiting_max")
METRIC_KEYS_INT = ("n_arrived", "n_completed", "preemptions", "adapter_loads", "adapters_starved")


@dataclass(frozen=True)
class Shortcuts:
    """Which shortcuts a sweep may take; every one can be switched off."""

    early_stop: bool = True  # pass EarlyStopOptions to the twin (when the twin has it)
    certain: bool = True  # early stop: starvation certain (token accounting)
    likely: bool = True  # early stop: sequential test for starvation
    healthy: bool = True  # early stop: healthy run's throughput converged
    prune: bool = True  # N-series pruning
    # N-series pruning after one clearly starving point (``PRUNE_CLEAR_RATIO``; 0: only after two starving points)
    prune_clear_ratio: float = PRUNE_CLEAR_RATIO
    # N-series pruning after one starving point whose next N offers >= this x its tokens (``PRUNE_NEXT_LOAD``; 0: off)
    prune_next_load: float = PRUNE_NEXT_LOAD
    # early stop: the drift a starved run's goodput trend may still have when it is extrapolated (``twin.early``)
    starved_max_drift: float = SWEEP_STARVED_MAX_DRIFT

    def as_dict(self) -> dict:
        return {"early_stop": self.early_stop, "certain": self.certain, "likely": self.likely,
                "healthy": self.healthy, "prune": self.prune, "prune_clear_ratio": self.prune_clear_ratio,
                "prune_next_load": self.prune_next_load, "starved_max_drift": self.starved_max_drift}


def early_stop_available() -> bool:
    """True once the twin has early termination (``lorapack.twin.early`` + ``simulate_requests(early_stop=)``)."""
    try:
        from ..twin.early import EarlyStopOptions  # noqa: F401
    except ImportError:
        return False
    from ..twin.run import simulate_requests

    return "early_stop" in inspect.signature(simulate_requests).parameters


def _early_stop_options(sc: Shortcuts):
    if not sc.early_stop or not (sc.certain or sc.likely or sc.healthy) or not early_stop_available():
        return None
    from ..twin.early import EarlyStopOptions

    return EarlyStopOptions(certain=sc.certain, likely=sc.likely, healthy=sc.healthy,
                            starved_max_drift=sc.starved_max_drift)


@dataclass
class WorkUnit:
    """Configs run together: a single config, or one N-series sorted by N (then ``prune`` applies)."""

    configs: list[SweepConfig]
    prune: bool = False
    key: str = field(default="")
    limits: Limits | None = None  # resource limits of each run (guards.DEFAULT_LIMITS when None)

    def __post_init__(self) -> None:
        if not self.key:
            self.key = self.configs[0].series_id if self.prune else self.configs[0].config_id


def candidate(cfg: SweepConfig, profile: Profile):
    """The config as an oracle question (``oracle.GpuCandidate``)."""
    from ..oracle import GpuCandidate
    from ..server import ServerConfig

    return GpuCandidate(profile=profile, ranks=cfg.ranks(), rates_rps=cfg.rates_rps(),
                        server=ServerConfig(max_loras=cfg.adapter_slots, max_lora_rank=cfg.max_lora_rank,
                                            max_cpu_loras=cfg.served_adapters),
                        mean_input_tokens=cfg.mean_input_tokens,
                        mean_output_tokens=cfg.mean_output_tokens)


def features(cfg: SweepConfig, profile: Profile) -> dict:
    """Identity columns and the surrogate features of a config (``oracle.features``; no simulation)."""
    from ..oracle import feature_row

    row = {
        "config_id": cfg.config_id, "series_id": cfg.series_id, "seed": cfg.seed, "model": cfg.model,
        "gpu": cfg.gpu, "lengths_kind": cfg.lengths_kind, "duration_s": cfg.duration_s,
        "rate_tuple": list(cfg.rate_tuple), "rank_tuple": list(cfg.rank_tuple),
        "rate_law": ":".join(map(str, cfg.rate_law)) if cfg.rate_law else None, "pad_fraction": cfg.pad_fraction,
    }
    row.update(feature_row(candidate(cfg, profile)))
    for k in ("served_adapters", "adapter_slots", "max_size", "max_lora_rank"):
        row[k] = int(row[k])
    return row


def _empty_metrics() -> dict:
    out: dict = {k: NAN for k in METRIC_KEYS_FLOAT}
    out.update({k: None for k in METRIC_KEYS_INT})
    out.update({"adapter_starved": None, "kv_cache_tokens": None, "error_type": None,
                "adapter_labels_exact": None})
    return out


def oom_row(cfg: SweepConfig, profile: Profile) -> dict:
    _starts, kv, err = profile.startup(cfg.adapter_slots, cfg.max_lora_rank)
    row = features(cfg, profile)
    row.update(_empty_metrics())
    row.update({"oom": True, "starved": None, "throughput_tok_s": 0.0, "error_type": err,
                "kv_cache_tokens": int(kv), "obtained": OBTAINED_OOM, "stop_reason": None, "simulated_s": 0.0})
    return _provenance(row, profile, 0.0)


def pruned_row(cfg: SweepConfig, profile: Profile) -> dict:
    _starts, kv, _err = profile.startup(cfg.adapter_slots, cfg.max_lora_rank)
    row = features(cfg, profile)
    row.update(_empty_metrics())
    # a starved run misses >= 10 % of its tokens: some adapter starves (which ones is unknown)
    row.update({"oom": False, "starved": True, "adapter_starved": True, "adapter_labels_exact": False,
                "kv_cache_tokens": int(kv), "obtained": OBTAINED_PRUNED, "stop_reason": None, "simulated_s": 0.0})
    return _provenance(row, profile, 0.0)


# (profile, its file hash, its twin fingerprint) of the latest profile seen: hashing a profile's JSON for every
# row cost ~0.3 ms, as much as building a pruned row's features (a worker receives one profile per task)
_provenance_of: list[tuple[Profile, str, str]] = []


def _provenance(row: dict, profile: Profile, wall_s: float) -> dict:
    if not _provenance_of or _provenance_of[0][0] is not profile:
        _provenance_of[:] = [(profile, profile.file_hash(), twin_fingerprint(profile))]
    _p, file_hash, fingerprint = _provenance_of[0]
    row["twin_version"] = __version__
    row["profile_hash"] = file_hash
    row["twin_fingerprint"] = fingerprint
    row["wall_s"] = wall_s
    return row


def _num(v, kind=float):
    if v is None:
        return NAN if kind is float else None
    v = kind(v)
    return v


# Arrivals and lengths depend only on (seed, N, rate tuple, length law, window): every rank tuple and A_max
# with the same N replays the same requests (common random numbers), so a worker keeps recent ones.
REQUEST_CACHE_BUDGET = 6_000_000  # requests held per process (~20 bytes each)
_request_cache: OrderedDict[tuple, object] = OrderedDict()
# this process's generation work so far: a sample reuses arrivals less than a full sweep, so --estimate
# (sweep.estimate) measures the generation apart from the simulation
_arrivals_generated = {"s": 0.0, "requests": 0}


def arrivals_key(cfg: SweepConfig) -> tuple:
    """What a config's arrivals depend on (configs with equal keys replay the same requests)."""
    return (cfg.seed, cfg.served_adapters, cfg.rate_tuple, cfg.rate_law, cfg.pad_fraction, cfg.explicit_rates,
            cfg.lengths_kind, cfg.mean_input_tokens, cfg.mean_output_tokens, cfg.lengths_cv, cfg.duration_s)


def config_requests(cfg: SweepConfig, limits: Limits | None = None):
    """The config's arrivals (``RequestArrays``), generated once per process and arrivals key.

    The engine only reads these arrays; they are shared between the configs of one key.
    """
    from ..spec import Adapter, PoissonArrivals, Workload
    from ..workload import generate_requests

    key = arrivals_key(cfg)
    req = _request_cache.get(key)
    if req is not None:
        _request_cache.move_to_end(key)
        return req
    t0 = time.perf_counter()  # a cache miss: building the workload and generating it
    rates = cfg.rates_rps()
    # ranks play no part in generation; rank 8 keeps the workload valid
    wl = Workload(adapters=[Adapter(adapter_id=f"a{i}", rank=8, rate_rps=float(q)) for i, q in enumerate(rates)],
                  lengths=cfg.lengths(), arrivals=PoissonArrivals(), duration_s=cfg.duration_s)
    req = generate_requests(wl, cfg.duration_s, cfg.seed, limits)
    _arrivals_generated["s"] += time.perf_counter() - t0
    _arrivals_generated["requests"] += len(req)
    if len(req) <= REQUEST_CACHE_BUDGET:
        _request_cache[key] = req
        held = sum(len(r) for r in _request_cache.values())
        while held > REQUEST_CACHE_BUDGET and len(_request_cache) > 1:
            _k, old = _request_cache.popitem(last=False)
            held -= len(old)
    return req


def clear_request_cache() -> None:
    _request_cache.clear()


def arrivals_generated() -> tuple[float, int]:
    """``(seconds, requests)`` this process has spent generating arrivals (cache misses) so far."""
    return _arrivals_generated["s"], _arrivals_generated["requests"]


def simulate_config(cfg: SweepConfig, profile: Profile, shortcuts: Shortcuts, limits: Limits | None = None,
                    req=None) -> dict:
    """Run the twin on one config (which must start) and return its row. ``req``: its arrivals
    (``config_requests``), when the caller holds them already."""
    from ..server import ServerConfig
    from ..twin.run import simulate_requests

    t0 = time.perf_counter()
    ranks = cfg.ranks()
    if req is None:
        req = config_requests(cfg, limits)
    flags = ServerConfig(max_loras=cfg.adapter_slots, max_lora_rank=cfg.max_lora_rank,
                         max_cpu_loras=cfg.served_adapters)
    opts = _early_stop_options(shortcuts)
    m, _ = simulate_requests(profile, ranks, req, flags, cfg.duration_s, early_stop=opts, limits=limits)
    row = features(cfg, profile)
    if m.oom:  # the caller checks the start-up rule first; kept for safety
        row.update(_empty_metrics())
        row.update({"oom": True, "starved": None, "throughput_tok_s": 0.0, "error_type": m.error_type,
                    "kv_cache_tokens": m.kv_cache_tokens, "obtained": OBTAINED_OOM, "stop_reason": None,
                    "simulated_s": 0.0})
        return _provenance(row, profile, time.perf_counter() - t0)
    columns = m.to_dict()  # the Parquet columns are the metrics' JSON keys
    for k in METRIC_KEYS_FLOAT:
        row[k] = _num(columns[k], float)
    for k in METRIC_KEYS_INT:
        row[k] = _num(columns[k], int)
    reason = m.stop_reason or "full"
    exact = bool(m.adapter_labels_exact)
    if not exact:
        row["adapters_starved"] = None  # which adapters starve by the window end is unknown
    row.update({
        "adapter_labels_exact": exact,
        "oom": False, "error_type": None, "kv_cache_tokens": int(m.kv_cache_tokens),
        "starved": bool(m.starved), "adapter_starved": bool(m.adapter_starved),
        "obtained": OBTAINED_FULL if reason == "full" else f"early_{reason}", "stop_reason": reason,
        "simulated_s": float(m.simulated_s),
    })
    return _provenance(row, profile, time.perf_counter() - t0)


def offered_tok_s(cfg: SweepConfig) -> float:
    """The tokens per second a config offers, analytically (sum of rates x mean prompt + output tokens)."""
    return float(cfg.rates_rps().sum()) * (cfg.mean_input_tokens + cfg.mean_output_tokens)


def _next_offers_more(unit: WorkUnit, j: int, factor: float) -> bool:
    """Does the config after ``unit.configs[j]`` offer at least ``factor`` x its tokens? (False without one)"""
    if factor <= 0 or j + 1 >= len(unit.configs):
        return False
    return offered_tok_s(unit.configs[j + 1]) >= factor * offered_tok_s(unit.configs[j])


def arrivals_group(cfg: SweepConfig) -> tuple:
    """``arrivals_key`` without N: the configs of one group share arrivals N by N (a batch, ``WorkBatch``)."""
    key = arrivals_key(cfg)
    return key[:1] + key[2:]


@dataclass
class WorkBatch:
    """Units one worker runs as one task (``run_batch``): the series of one arrivals group (``arrivals_group``),
    or a share of it. One task per series cost ~2.5 ms of pickling the profile and left each worker to
    generate the arrivals the others had generated too."""

    units: list[WorkUnit]
    timed: bool = False  # per row also ``arrivals_s``, ``arrivals_requests``, ``cpu_s`` (not stored; --estimate)


def run_batch(batch: WorkBatch, profile: Profile, shortcuts: Shortcuts) -> list[list[dict]]:
    """Rows of every unit of ``batch`` (one list per unit, in order): each unit's rows are ``run_unit``'s.

    The configs run N by N across the units (each unit's own configs stay in increasing N, so its pruning
    sees the same points in the same order), so that the configs sharing one arrival set run back to back on
    the set generated once."""
    rows: list[list[dict | None]] = [[None] * len(u.configs) for u in batch.units]
    streak = [0] * len(batch.units)  # consecutive starving points of each unit so far
    order = sorted((c.served_adapters, i, j) for i, u in enumerate(batch.units) for j, c in enumerate(u.configs))
    held: tuple[tuple, object] | None = None  # (arrivals key, requests) of the configs running now
    for _n, i, j in order:
        unit, cfg = batch.units[i], batch.units[i].configs[j]
        s0, n0 = arrivals_generated()
        cpu0 = time.process_time()
        if not profile.startup(cfg.adapter_slots, cfg.max_lora_rank)[0]:
            row = oom_row(cfg, profile)
        elif unit.prune and streak[i] >= PRUNE_AFTER_STARVING:
            row = pruned_row(cfg, profile)
        else:
            key = arrivals_key(cfg)
            t0 = time.perf_counter()
            if held is None or held[0] != key:
                held = (key, config_requests(cfg, unit.limits))
            fetch_s = time.perf_counter() - t0
            row = simulate_config(cfg, profile, shortcuts, unit.limits, held[1])
            row["wall_s"] += fetch_s  # the row's seconds include its arrivals, as when it generates them itself
            streak[i] = streak[i] + 1 if row["starved"] else 0
            if row["starved"] and (row["throughput_ratio"] < shortcuts.prune_clear_ratio  # (NaN: not clear)
                                   or _next_offers_more(unit, j, shortcuts.prune_next_load)):
                streak[i] = PRUNE_AFTER_STARVING
        if batch.timed:
            s1, n1 = arrivals_generated()
            row.update(arrivals_s=s1 - s0, arrivals_requests=n1 - n0, cpu_s=time.process_time() - cpu0)
        rows[i][j] = row
    return [[r for r in unit_rows if r is not None] for unit_rows in rows]


def run_unit(unit: WorkUnit, profile: Profile, shortcuts: Shortcuts) -> list[dict]:
    """Rows of every config of ``unit``.

    With ``unit.prune`` the configs (one series, N increasing) are simulated in order until
    ``PRUNE_AFTER_STARVING`` consecutive points starve, or one starves clearly (throughput ratio below
    ``shortcuts.prune_clear_ratio``), or one starves and the next offers at least ``shortcuts.prune_next_load``
    times its tokens (``offered_tok_s``); the remaining points become ``pruned`` rows.
    """
    return run_batch(WorkBatch([unit]), profile, shortcuts)[0]
