"""The twin engine's input and output: flat numpy arrays, no objects per request.

Both engines (``engine.simulate_fast`` and ``reference.simulate_reference``) take exactly these
inputs and return an ``EngineResult``; the tests compare the two field by field.

Time conventions (shared by both engines):
* the window is ``[0, duration_s)``; the step loop runs while the step start ``t < duration_s``; a step
  that starts before the end is completed and its events are recorded at the step end time;
* a request counts as completed when ``t_finish_s <= duration_s``;
* ``t_sent_s`` is the arrival time, or, for a request held back by the client-saturation cap, the step
  start at which it was finally injected; it stays NaN for requests never injected before the end (held
  back — index < ``held_end`` — or arrived during the last step);
* a request is *sent* when ``t_arr_s < duration_s`` and it was not held back at the end, i.e. its index is
  ``>= held_end`` or it was injected;
* timeline samples are taken at ``k * timeline_dt_s < duration_s``; each is emitted at the first loop
  start at or after it (so it shows the state after the step that was running at the sample time).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np

from ..errors import SpecError
from ..server import ServerConfig
from .steptime import N_COEF

INT32_MAX = 2**31 - 1
INT64_SAFE = 2**62  # integer settings pass through numba's int64 arithmetic


def _array(name: str, values, kind: str) -> np.ndarray:
    """``values`` as a 1-D array of ``kind`` ("float" or "int"), or a one-line ``SpecError`` saying why not.

    Integer fields accept integer arrays and floats with integral values (checked *before* the int32 cast,
    so 2**31 + 5 is an error instead of a negative number); booleans, strings and objects are refused.
    """
    try:
        a = np.asarray(values)
    except (ValueError, TypeError) as exc:  # ragged nested lists
        raise SpecError(f"{name}: expected a 1-D numeric array ({' '.join(str(exc).split())})") from None
    if a.ndim != 1:
        raise SpecError(f"{name}: expected a 1-D array, got shape {a.shape}")
    if a.dtype == np.bool_ or a.dtype.kind not in "iuf":
        raise SpecError(f"{name}: expected {'numbers' if kind == 'float' else 'integers'}, got dtype {a.dtype}")
    if kind == "float":
        return np.ascontiguousarray(a, dtype=np.float64)
    if a.dtype.kind == "f":
        a = a.astype(np.float64)  # float32 cannot hold 2**31 - 1: range checks must not round
        with np.errstate(invalid="ignore"):
            bad = ~np.isfinite(a) | (a != np.round(a))
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise SpecError(f"{name}[{i}] = {float(a[i])}: expected integers")
    return a


def _int32_in(name: str, a: np.ndarray, lo: int, hi: int, what: str) -> np.ndarray:
    """``a`` cast to int32 after checking ``lo <= a <= hi`` on the original values."""
    if len(a):
        bad = (a < lo) | (a > hi)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise SpecError(f"{name}[{i}] = {int(a[i])}: expected {what}")
    return np.ascontiguousarray(a, dtype=np.int32)


@dataclass
class RequestArrays:
    """All arrivals of one run, sorted by ``t_arr_s`` (ties: lower adapter first).

    Checked on construction (and again by the engines, since arrays can be changed afterwards): 1-D, equal
    lengths, finite arrival times >= 0 in non-decreasing order, token counts in ``[1, 2**31 - 1]``, adapter
    indices in ``[0, 2**31 - 1]`` (``check_adapters`` compares them with the server's adapter count).
    Violations raise ``SpecError`` (a ``ValueError``). ``RequestArrays.sorted(...)`` sorts unsorted input.
    """

    t_arr_s: np.ndarray  # float64 [n]
    adapter: np.ndarray  # int32 [n], index into the server's adapter list (registration order)
    prompt_tokens: np.ndarray  # int32 [n], >= 1
    output_tokens: np.ndarray  # int32 [n], >= 1

    def __post_init__(self) -> None:
        t = _array("t_arr_s", self.t_arr_s, "float")
        ad = _array("adapter", self.adapter, "int")
        p = _array("prompt_tokens", self.prompt_tokens, "int")
        o = _array("output_tokens", self.output_tokens, "int")
        if not len(ad) == len(p) == len(o) == len(t):
            raise SpecError(f"request arrays must all have the same length (t_arr_s {len(t)}, adapter {len(ad)}, "
                            f"prompt_tokens {len(p)}, output_tokens {len(o)})")
        self.t_arr_s = t
        self.adapter = _int32_in("adapter", ad, 0, INT32_MAX, "an adapter index >= 0")
        self.prompt_tokens = _int32_in("prompt_tokens", p, 1, INT32_MAX, f"a token count in [1, {INT32_MAX}]")
        self.output_tokens = _int32_in("output_tokens", o, 1, INT32_MAX, f"a token count in [1, {INT32_MAX}]")
        _check_times(self.t_arr_s)

    def __len__(self) -> int:
        return len(self.t_arr_s)

    @classmethod
    def sorted(cls, t_arr_s, adapter, prompt_tokens, output_tokens) -> RequestArrays:
        """Build from unsorted requests: sorted by time, ties by adapter (the order the engines expect)."""
        t = _array("t_arr_s", t_arr_s, "float")
        ad = _array("adapter", adapter, "int")
        p = _array("prompt_tokens", prompt_tokens, "int")
        o = _array("output_tokens", output_tokens, "int")
        if not len(ad) == len(p) == len(o) == len(t):
            return cls(t, ad, p, o)  # the constructor names the lengths
        order = np.lexsort((ad, t))
        return cls(t[order], ad[order], p[order], o[order])

    def check(self, n_adapters: int | None = None) -> None:
        """Re-check every field (the arrays may have been modified since construction); with
        ``n_adapters``, also that every adapter index is below it. Raises ``SpecError``."""
        RequestArrays(self.t_arr_s, self.adapter, self.prompt_tokens, self.output_tokens)
        if n_adapters is not None:
            check_adapters(self.adapter, n_adapters)


def _check_times(t: np.ndarray) -> None:
    if not len(t):
        return
    bad = ~np.isfinite(t) | (t < 0.0)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise SpecError(f"t_arr_s[{i}] = {float(t[i])}: expected finite arrival times >= 0 s")
    down = np.diff(t) < 0.0
    if down.any():
        i = int(np.flatnonzero(down)[0])
        raise SpecError(f"t_arr_s is not sorted (t_arr_s[{i + 1}] = {t[i + 1]:g} < t_arr_s[{i}] = {t[i]:g}); "
                        f"expected non-decreasing times (RequestArrays.sorted(...) sorts them)")


def check_adapters(adapter: np.ndarray, n_adapters: int) -> None:
    """Every index in ``[0, n_adapters)``: the engines index per-adapter arrays with it, unchecked."""
    if len(adapter) and (int(adapter.min()) < 0 or int(adapter.max()) >= n_adapters):
        bad = (adapter < 0) | (adapter >= n_adapters)
        i = int(np.flatnonzero(bad)[0])
        raise SpecError(f"adapter[{i}] = {int(adapter[i])}: expected an adapter index in [0, {n_adapters - 1}] "
                        f"(the server has {n_adapters} adapter{'s' if n_adapters != 1 else ''})")


@dataclass
class EngineConfig:
    """One server as the engine sees it: flat arrays and numbers. Built from a Profile and a resolved
    ``lorapack.server.ServerConfig`` by ``twin.run.engine_config`` through ``EngineConfig.from_server`` (the
    one place the flags are copied in); the engines' own tests build it directly from numbers."""

    load_ms: np.ndarray  # float64 [n_adapters]: CPU -> GPU activation cost of each adapter (slot rank S)
    disk_ms: np.ndarray  # float64 [n_adapters]: disk -> CPU load cost of each adapter
    max_loras: int  # A: GPU adapter slots
    max_cpu_loras: int  # N_cpu: CPU adapter cache capacity (>= max_loras)
    kv_blocks: int  # KV cache capacity in blocks
    step_coef: np.ndarray  # float64, see steptime.StepModel.to_array()
    duration_s: float = 3600.0
    max_num_seqs: int = 2048
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    warm_gpu: bool = True  # GPU slots hold the last min(A, N) registered adapters at t = 0
    warm_cpu: bool = True  # CPU cache holds the last min(N_cpu, N) registered adapters at t = 0
    client_cap: int = 0  # client-saturation cap W_cap on waiting requests; 0 = off
    timeline_dt_s: float = 2.0
    # time a request spends outside the engine before the client sees its first token (API server:
    # tokenisation, the hop to the engine core and back, detokenisation, streaming): added to every TTFT
    ttft_overhead_ms: float = 0.0
    # Adapter LRU (vLLM 0.8.5's ``LRUCacheWorkerLoRAManager._apply_adapters``): every step the worker walks the
    # batch's adapters in the order of a Python set, touching each and activating a missing one at once, which
    # evicts the least recently used slot even when that adapter is in the batch but not walked yet (it is
    # activated again at its turn). ``adapter_order`` is that walk order, a permutation of the adapters (None:
    # a fixed pseudo-random one, as a set ordered by the hash of the adapter names is); ``lru_protects_batch``
    # is the simpler batch-protecting policy (evict only adapters outside the batch, load in increasing index).
    adapter_order: np.ndarray | None = None
    lru_protects_batch: bool = False
    # the max_loras rule of the waiting pass (``lorapack.server.VllmRules.admission``): "scheduled" = the
    # adapters of the requests scheduled this step count (vLLM <= 0.32), "running" = those of all running
    # requests (vLLM 0.33). See docs/engine-semantics.md, waiting pass.
    admission: str = "scheduled"
    # vLLM's API server loop (docs/engine-semantics.md, "The API server"): its work per output of a step (ms),
    # the sleep of a /metrics poller between an answer and its next scrape (s; 0 = none), and a scrape's render
    # time: fixed, per label series of vllm:lora_requests_info and per adapter name in their labels. All 0: the
    # loop is not modelled (every token reaches its client at the end of its step).
    # per-step variability (docs/engine-semantics.md, "Step noise"): the scheduler + forward-pass time of step s
    # is multiplied by a mean-one log-normal draw of log-sd ``step_noise_sigma`` (0: none), counter-based on
    # (``step_noise_seed``, s) so that every engine draws the same
    step_noise_sigma: float = 0.0
    step_noise_seed: int = 0
    api_ms_per_output: float = 0.0
    output_proc_chunk: int = 128  # VllmRules.output_proc_chunk: outputs the loop processes without yielding
    metrics_scrape_s: float = 0.0
    scrape_base_ms: float = 0.0
    scrape_us_per_series: float = 0.0
    scrape_us_per_label_name: float = 0.0

    def __post_init__(self) -> None:
        self.check()

    @classmethod
    def from_server(cls, server: ServerConfig, load_ms: np.ndarray, disk_ms: np.ndarray, kv_blocks: int,
                    step_coef: np.ndarray, block_size: int, duration_s: float, **engine_options) -> EngineConfig:
        """The engine's input for a resolved ``server`` (``twin.run.resolve_server``: every flag set): the one
        place the flags (``max_loras``, ``max_cpu_loras``, ``max_num_seqs``, ``max_num_batched_tokens``, the
        client cap, the warm start, the rule set's admission, the /metrics poller) are copied into the flat engine
        input.
        ``engine_options``: the engine-only fields (``warm_cpu``, ``ttft_overhead_ms``, ``timeline_dt_s``, ...)."""
        missing = [k for k in ("max_lora_rank", "max_cpu_loras", "max_num_seqs", "max_num_batched_tokens")
                   if getattr(server, k) is None]
        if missing or server.rules is None:
            raise SpecError(f"EngineConfig.from_server: the server is not resolved ({', '.join(missing) or 'rules'} "
                            f"unset); resolve it with twin.run.resolve_server")
        return cls(load_ms=load_ms, disk_ms=disk_ms, max_loras=int(server.max_loras),
                   max_cpu_loras=int(server.max_cpu_loras), kv_blocks=int(kv_blocks), step_coef=step_coef,
                   duration_s=duration_s, max_num_seqs=int(server.max_num_seqs),
                   max_num_batched_tokens=int(server.max_num_batched_tokens), block_size=int(block_size),
                   warm_gpu=bool(server.warm_start), client_cap=int(server.client_cap),
                   admission=server.rules.admission, metrics_scrape_s=float(server.metrics_scrape_s or 0.0),
                   output_proc_chunk=int(server.rules.output_proc_chunk),
                   **engine_options)

    def check(self) -> None:
        """Validate every field (``SpecError``); the engines call it again before running."""
        for name in ("load_ms", "disk_ms", "step_coef"):
            a = _array(name, getattr(self, name), "float")
            if not np.all(np.isfinite(a)):
                raise SpecError(f"{name}: expected finite numbers")
            setattr(self, name, a)
        if len(self.step_coef) != N_COEF:
            raise SpecError(f"step_coef: expected {N_COEF} coefficients (StepModel.to_array()), got "
                            f"{len(self.step_coef)}")
        if len(self.load_ms) != len(self.disk_ms) or len(self.load_ms) < 1:
            raise SpecError("load_ms and disk_ms must have one entry per adapter (at least one adapter)")
        if (self.load_ms < 0).any() or (self.disk_ms < 0).any():
            raise SpecError("load_ms and disk_ms: expected load times >= 0 ms")
        for name, lo in (("max_loras", 1), ("max_cpu_loras", 1), ("kv_blocks", 0), ("max_num_seqs", 1),
                         ("max_num_batched_tokens", 1), ("block_size", 1), ("client_cap", 0), ("output_proc_chunk", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | np.integer) or not lo <= v <= INT64_SAFE:
                raise SpecError(f"{name} {v!r}: expected an integer between {lo} and {INT64_SAFE}")
        if self.max_cpu_loras < self.max_loras:
            raise SpecError(f"max_cpu_loras {self.max_cpu_loras} < max_loras {self.max_loras}: "
                            "need 1 <= max_loras <= max_cpu_loras")
        for name in ("duration_s", "timeline_dt_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float | np.integer | np.floating) \
                    or not math.isfinite(v) or v <= 0:
                raise SpecError(f"{name} {v!r}: expected a finite number of seconds > 0")
        v = self.step_noise_sigma
        if isinstance(v, bool) or not isinstance(v, int | float | np.integer | np.floating) \
                or not math.isfinite(v) or not 0 <= v <= 1:
            raise SpecError(f"step_noise_sigma {v!r}: expected a log-sd in [0, 1]")
        v = self.step_noise_seed
        if isinstance(v, bool) or not isinstance(v, int | np.integer) or not 0 <= v < 2**64:
            raise SpecError(f"step_noise_seed {v!r}: expected an integer in [0, 2**64)")
        for name, unit in (("ttft_overhead_ms", "ms"), ("api_ms_per_output", "ms"), ("metrics_scrape_s", "seconds"),
                           ("scrape_base_ms", "ms"), ("scrape_us_per_series", "µs"),
                           ("scrape_us_per_label_name", "µs")):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float | np.integer | np.floating) \
                    or not math.isfinite(v) or v < 0:
                raise SpecError(f"{name} {v!r}: expected a finite number of {unit} >= 0")
        if self.admission not in ("scheduled", "running"):
            raise SpecError(f"admission {self.admission!r}: expected 'scheduled' or 'running'")
        if not isinstance(self.lru_protects_batch, bool | np.bool_):
            raise SpecError(f"lru_protects_batch {self.lru_protects_batch!r}: expected True or False")
        if self.adapter_order is not None:
            order = np.asarray(self.adapter_order)
            if order.ndim != 1 or order.dtype.kind not in "iu" or len(order) != len(self.load_ms) \
                    or not np.array_equal(np.sort(order), np.arange(len(order))):
                raise SpecError("adapter_order: expected a permutation of the adapter indices")
            self.adapter_order = order.astype(np.int64)

    def adapter_walk_order(self) -> np.ndarray:
        """Each adapter's position in the worker's walk over a batch (see ``adapter_order``)."""
        n = len(self.load_ms)
        if self.lru_protects_batch:
            return np.arange(n, dtype=np.int64)  # the batch-protecting policy loads in increasing index
        if self.adapter_order is not None:
            return self.adapter_order
        return default_walk_order(n)

    @property
    def n_adapters(self) -> int:
        return len(self.load_ms)


def label_set_keys(cfg: EngineConfig) -> tuple[np.ndarray, np.ndarray]:
    """Per adapter, the keys of the fingerprint of a (running adapters, waiting adapters) label set: the XOR of
    the "running" key of each adapter with running requests and the "waiting" key of each with waiting ones
    (fixed draws; zeros when no /metrics poller reads the label sets)."""
    n = cfg.n_adapters
    if not float(cfg.metrics_scrape_s) > 0.0:
        return np.zeros(n, np.uint64), np.zeros(n, np.uint64)
    keys = np.random.default_rng([0x1AB, n]).integers(0, 2**64, size=(2, n), dtype=np.uint64, endpoint=False)
    return keys[0].copy(), keys[1].copy()


def default_walk_order(n_adapters: int) -> np.ndarray:
    """A fixed pseudo-random permutation of ``n_adapters`` (the order of a Python set of adapter names is
    arbitrary but stable within a server's life)."""
    return np.random.default_rng([0x5E7, n_adapters]).permutation(n_adapters).astype(np.int64)


TIMELINE_COLUMNS = (
    "t_s",
    "num_requests_running",
    "num_requests_waiting",
    "kv_cache_usage_perc",
    "num_preemptions_total",
    "num_adapters_resident",
    "num_adapters_running",
)


@dataclass
class EngineResult:
    """Per-request event times and run counters of one simulation."""

    t_sent_s: np.ndarray  # float64 [n]; NaN if never injected
    t_first_s: np.ndarray  # float64 [n]; NaN if no token was produced
    t_finish_s: np.ndarray  # float64 [n]; NaN if not finished (may exceed duration_s for the last step)
    n_preempted: np.ndarray  # int32 [n]: times this request was preempted
    n_steps: int = 0
    n_preemptions: int = 0
    n_gpu_loads: int = 0  # CPU -> GPU adapter activations during the window
    n_disk_loads: int = 0  # disk -> CPU loads during the window
    busy_s: float = 0.0  # sum of step durations
    sched_s: float = 0.0  # sum of scheduler (CPU) time
    load_s: float = 0.0  # sum of adapter load time
    held_end: int = 0  # arrivals with a lower index were held back by the client cap at some point
    timeline: dict[str, np.ndarray] = field(default_factory=dict)  # TIMELINE_COLUMNS -> arrays
    # inter-token gaps that ended in the window (``gaps.gap_bin`` bins); None from engines that keep none
    gap_hist: np.ndarray | None = None
    ttft_overhead_ms: float = 0.0  # EngineConfig.ttft_overhead_ms: the metrics add it to every TTFT
    # per request, tokens that reached the client in the chunk of an earlier one (the API server's loop was
    # behind: one chunk for several steps); None from engines that do not model the loop
    n_merged: np.ndarray | None = None
    n_scrapes: int = 0  # /metrics scrapes answered
    scrape_s: float = 0.0  # the API server's loop's time on them
    label_series: int = 0  # label series of vllm:lora_requests_info at the end

    def expanded(self, kept: np.ndarray) -> EngineResult:
        """This result of the requests ``kept`` (a mask over a larger request list) laid out over that whole
        list: the others were never sent to the engine (NaN times, no preemption)."""
        n = len(kept)
        idx = np.flatnonzero(kept)

        def spread(a: np.ndarray, fill) -> np.ndarray:
            out = np.full(n, fill, dtype=a.dtype)
            out[idx] = a
            return out

        held = int(idx[self.held_end]) if self.held_end < len(idx) else n
        return dataclasses.replace(self, t_sent_s=spread(self.t_sent_s, np.nan), t_first_s=spread(self.t_first_s, np.nan),
                                   t_finish_s=spread(self.t_finish_s, np.nan), n_preempted=spread(self.n_preempted, 0),
                                   held_end=held,
                                   n_merged=None if self.n_merged is None else spread(self.n_merged, 0))
