"""Workload generation: arrivals (Poisson, log-normal, unpredictable, trace replay) and request lengths.

Entry points: ``load_workload(path)`` (``files``), ``generate_requests(workload, duration_s, seed) ->
RequestArrays`` and ``adapter_ranks(workload)``; the validated models live in ``lorapack.spec``.
"""

from __future__ import annotations

from ..spec import Workload
from .files import example_workload, load_adapters_csv, load_workload, with_mean_lengths
from .generate import (
    STREAM_ARRIVALS,
    STREAM_LENGTHS,
    STREAM_REGIME,
    adapter_arrival_times,
    adapter_ranks,
    generate_requests,
    stream_rng,
    unpredictable_rate_multipliers,
)
from .lengths import LognormalLengths, load_lengths_table, sample_lengths, solve_lognormal_lengths
from .trace import Trace, load_trace

__all__ = [
    "STREAM_ARRIVALS",
    "STREAM_LENGTHS",
    "STREAM_REGIME",
    "LognormalLengths",
    "Trace",
    "Workload",
    "adapter_arrival_times",
    "adapter_ranks",
    "example_workload",
    "generate_requests",
    "load_adapters_csv",
    "load_lengths_table",
    "load_trace",
    "load_workload",
    "sample_lengths",
    "solve_lognormal_lengths",
    "stream_rng",
    "unpredictable_rate_multipliers",
    "with_mean_lengths",
]
