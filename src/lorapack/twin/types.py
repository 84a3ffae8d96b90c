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

from dataclasses import dataclass, field

import numpy as np


@dataclass
class RequestArrays:
    """All arrivals of one run, sorted by ``t_arr_s`` (ties: lower adapter first)."""

    t_arr_s: np.ndarray  # float64 [n]
    adapter: np.ndarray  # int32 [n], index into the server's adapter list (registration order)
    prompt_tokens: np.ndarray  # int32 [n], >= 1
    output_tokens: np.ndarray  # int32 [n], >= 1

    def __post_init__(self) -> None:
        self.t_arr_s = np.ascontiguousarray(self.t_arr_s, dtype=np.float64)
        self.adapter = np.ascontiguousarray(self.adapter, dtype=np.int32)
        self.prompt_tokens = np.ascontiguousarray(self.prompt_tokens, dtype=np.int32)
        self.output_tokens = np.ascontiguousarray(self.output_tokens, dtype=np.int32)
        n = len(self.t_arr_s)
        if not (len(self.adapter) == len(self.prompt_tokens) == len(self.output_tokens) == n):
            raise ValueError("request arrays must all have the same length")

    def __len__(self) -> int:
        return len(self.t_arr_s)


@dataclass
class EngineConfig:
    """One server as the engine sees it. Built from a Profile + server flags by ``twin.run``."""

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

    def __post_init__(self) -> None:
        self.load_ms = np.ascontiguousarray(self.load_ms, dtype=np.float64)
        self.disk_ms = np.ascontiguousarray(self.disk_ms, dtype=np.float64)
        self.step_coef = np.ascontiguousarray(self.step_coef, dtype=np.float64)
        if len(self.load_ms) != len(self.disk_ms):
            raise ValueError("load_ms and disk_ms must have one entry per adapter")
        if self.max_loras < 1 or self.max_cpu_loras < self.max_loras:
            raise ValueError("need 1 <= max_loras <= max_cpu_loras")

    @property
    def n_adapters(self) -> int:
        return len(self.load_ms)


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
