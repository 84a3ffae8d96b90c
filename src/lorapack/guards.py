"""Resource guards: what a run will cost, estimated before anything is allocated, refused when it cannot finish.

A twin run's cost grows with the requests it simulates, the memory they and the 2 s timeline take, and the
engine steps it walks. Absurd inputs (``rate_rps: 1e9``, ``--duration-s 1e15``, a trace ``load_scale: 1e9``,
``period_s: 0.0001``) would otherwise allocate hundreds of GiB or run for days. Every entry point that
simulates (``twin.run.simulate``/``simulate_requests``, ``twin.engine.Engine``/``simulate_fast``, ``validate``,
``sweep``) estimates first and raises ``ResourceLimitError`` -- one line naming the input and the limit (the
estimate of a workload spec is ``workload.cost.estimate_workload``):

============================  ==============================================  ======
limit                         default                                          kind
============================  ==============================================  ======
requests in one run           50,000,000 (``DEFAULT_MAX_REQUESTS``)            soft
memory of one run             half of this machine's memory                    soft
engine steps of one run       500,000,000 (``DEFAULT_MAX_STEPS``)              soft
arrival periods generated     5,000,000 adapter-periods (unpredictable)        soft
requests in one run           2**31 - 1 (array indices)                        hard
memory of one run             all of this machine's memory                     hard
adapters + replicas placed    100,000 (``DEFAULT_MAX_PLACE_ENTRIES``)          soft
twin requests of a placement  20,000,000 (``DEFAULT_MAX_PLACE_TWIN_REQUESTS``)  soft
memory of a placement         half / all of this machine's memory              soft / hard
============================  ==============================================  ======

``place`` estimates its own cost first (``placement.estimate``: replicas, GPUs, memory, the requests its twin
runs would simulate) and refuses past the last three rows.

``Limits(force=True)`` (the CLI's ``--force``) lifts the soft limits; the hard ones always hold (such a run
cannot finish on this machine). Generation also counts as it goes (``Limits.request_budget``), so a
heavy-tailed law that produces far more requests than its nominal rate still stops at the limit.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from .errors import ResourceLimitError

DEFAULT_MAX_REQUESTS = 50_000_000
DEFAULT_MAX_STEPS = 500_000_000
DEFAULT_MAX_PERIODS = 5_000_000
# one placement (``placement.estimate``): adapters and --split-hot replicas to place, and requests its twin runs
# simulate in all (at the twin's ~130-250 k requests/s per core, 20 M are a few minutes on 2 cores)
DEFAULT_MAX_PLACE_ENTRIES = 100_000
DEFAULT_MAX_PLACE_TWIN_REQUESTS = 20_000_000
MEMORY_FRACTION = 0.5
HARD_MAX_REQUESTS = 2**31 - 1
# peak bytes per simulated request: generation (times, draws, sort order), the engine's request arrays
# (~60 B), the metrics' temporaries; measured peaks are ~200 B, this errs on the safe side
BYTES_PER_REQUEST = 256
BYTES_PER_SAMPLE = 64  # one timeline row (7 float64) plus its share of the CSV output
BYTES_PER_ADAPTER = 4096  # the adapter's spec object, per-adapter engine state and metrics
TIMELINE_DT_S = 2.0
FORCE_HINT = "--force lifts it"


def machine_memory_bytes() -> int:
    """Physical memory, or the container's cgroup limit when that is lower (8 GiB when unknown)."""
    total = 0
    try:
        total = int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        pass
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) < (total or 2**62):
            total = int(text)
    return total or 8 << 30


def fmt_bytes(n: float) -> str:
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n / 1024:,.1f} KiB"


def fmt_count(n: float) -> str:
    return f"{n:,.0f}" if n < 1e15 else f"{n:.3g}"


@dataclass(frozen=True)
class Limits:
    """What one run may cost. ``force`` lifts the soft limits (the CLI's ``--force``)."""

    max_requests: int = DEFAULT_MAX_REQUESTS
    max_memory_bytes: int | None = None  # None: MEMORY_FRACTION of the machine's memory
    max_steps: int = DEFAULT_MAX_STEPS
    max_periods: int = DEFAULT_MAX_PERIODS
    force: bool = False
    max_place_entries: int = DEFAULT_MAX_PLACE_ENTRIES
    max_place_twin_requests: int = DEFAULT_MAX_PLACE_TWIN_REQUESTS

    def memory_limit(self) -> int:
        if self.max_memory_bytes is not None:
            return int(self.max_memory_bytes)
        return int(MEMORY_FRACTION * machine_memory_bytes())

    def request_budget(self) -> int:
        """The most requests generation may produce before it stops with an error."""
        return HARD_MAX_REQUESTS if self.force else min(int(self.max_requests), HARD_MAX_REQUESTS)


DEFAULT_LIMITS = Limits()


def limits_help() -> str:
    """The defaults, for ``--help`` texts."""
    return (f"Run anyway past the soft resource limits of one run: {DEFAULT_MAX_REQUESTS:,} requests, half of "
            f"this machine's memory ({fmt_bytes(DEFAULT_LIMITS.memory_limit())}), {DEFAULT_MAX_STEPS:,} engine "
            f"steps, {DEFAULT_MAX_PERIODS:,} arrival periods. Hard limits (2^31-1 requests, all of the memory) "
            f"stay.")


@dataclass(frozen=True)
class Estimate:
    """Upper-bound-ish cost of one run and the inputs that drive it (for the error message)."""

    requests: float
    requests_from: str  # e.g. "the adapters' rates (sum 3.8 req/s) over duration_s 3600 s"
    duration_s: float
    n_adapters: int
    tokens_per_request: float  # mean prompt + output tokens
    min_step_ms: float = 0.0  # shortest possible engine step (0: unknown)
    periods: float = 0.0  # adapter-periods of unpredictable arrivals
    periods_from: str = ""
    extra_bytes: float = 0.0  # intermediate arrays (e.g. the load-scaled trace)
    extra_from: str = ""

    @property
    def timeline_samples(self) -> float:
        return math.ceil(self.duration_s / TIMELINE_DT_S)

    @property
    def memory_bytes(self) -> float:
        return (self.requests * BYTES_PER_REQUEST + self.timeline_samples * BYTES_PER_SAMPLE
                + self.n_adapters * BYTES_PER_ADAPTER + self.extra_bytes)

    @property
    def steps(self) -> float:
        """Each step finishes at least one token of work, and lasts at least ``min_step_ms``."""
        by_tokens = self.requests * (self.tokens_per_request + 1.0)
        if self.min_step_ms > 0:
            return min(by_tokens, self.duration_s * 1000.0 / self.min_step_ms)
        return by_tokens


def check(est: Estimate, limits: Limits | None = None) -> None:
    """Raise ``ResourceLimitError`` when ``est`` exceeds a limit (soft ones unless ``limits.force``)."""
    lim = limits or DEFAULT_LIMITS
    soft = not lim.force
    if est.requests > HARD_MAX_REQUESTS or (soft and est.requests > lim.max_requests):
        hard = est.requests > HARD_MAX_REQUESTS
        limit = HARD_MAX_REQUESTS if hard else lim.max_requests
        hint = " (a hard limit)" if hard else f" ({FORCE_HINT})"
        raise ResourceLimitError(f"{est.requests_from} gives {fmt_count(est.requests)} requests in one run; the "
                                 f"limit is {limit:,} requests{hint}")
    if soft and est.periods > lim.max_periods:
        raise ResourceLimitError(f"{est.periods_from} gives {fmt_count(est.periods)} arrival periods to draw; the "
                                 f"limit is {lim.max_periods:,} ({FORCE_HINT})")
    mem = est.memory_bytes
    hard_mem = machine_memory_bytes()
    if mem > hard_mem or (soft and mem > lim.memory_limit()):
        parts = [f"{fmt_count(est.requests)} requests", f"{fmt_count(est.timeline_samples)} timeline samples "
                 f"over {est.duration_s:g} s"]
        if est.extra_bytes:
            parts.append(est.extra_from)
        if mem > hard_mem:
            what = f"all of this machine's memory, {fmt_bytes(hard_mem)} (a hard limit)"
        elif lim.max_memory_bytes is None:
            what = f"half of this machine's memory, {fmt_bytes(lim.memory_limit())} ({FORCE_HINT})"
        else:
            what = f"{fmt_bytes(lim.memory_limit())} ({FORCE_HINT})"
        raise ResourceLimitError(f"{est.requests_from}: the run needs about {fmt_bytes(mem)} of memory "
                                 f"({', '.join(parts)}); the limit is {what}")
    if soft and est.steps > lim.max_steps:
        raise ResourceLimitError(
            f"{est.requests_from}: the run may take up to {fmt_count(est.steps)} engine steps "
            f"({fmt_count(est.requests)} requests of ~{est.tokens_per_request:,.0f} tokens over "
            f"{est.duration_s:g} s); the limit is {lim.max_steps:,} steps ({FORCE_HINT})")


# ---------------------------------------------------------------------------------------------------------
# estimates of the runs lorapack builds


def min_step_ms(step_coef) -> float:
    """Shortest step the step-time model allows (one request, one decode token, no adapter, no scheduler)."""
    from .twin.steptime import compute_ms

    try:
        return max(0.0, float(compute_ms(step_coef, 1, 0, 1, 0.0, 0)))
    except (IndexError, TypeError, ValueError):
        return 0.0


def profile_step_coef(profile):
    """Step coefficients with only the profile's base step (``c0 + c1``): enough for ``min_step_ms``."""
    from .twin.steptime import StepModel

    st = profile.steptime
    return StepModel(c0_ms=st.c0_ms, c1_ms_per_req=st.c1_ms_per_req).to_array()


def estimate_arrays(cfg, req) -> Estimate:
    """The cost of running the engine on given arrays (``EngineConfig``, ``RequestArrays``)."""
    n = len(req)
    tok = (float(req.prompt_tokens.sum(dtype="int64")) + float(req.output_tokens.sum(dtype="int64"))) / n if n else 0.0
    # adapter slot arrays are sized by the flags, not by the adapters; a finer timeline has more rows
    extra = (int(cfg.max_loras) + int(cfg.max_cpu_loras)) * 16.0
    samples = math.ceil(cfg.duration_s / cfg.timeline_dt_s)
    extra += max(0, samples - math.ceil(cfg.duration_s / TIMELINE_DT_S)) * BYTES_PER_SAMPLE
    return Estimate(requests=float(n), requests_from=f"{n:,} requests over duration_s {cfg.duration_s:g} s",
                    duration_s=float(cfg.duration_s), n_adapters=cfg.n_adapters, tokens_per_request=tok,
                    min_step_ms=min_step_ms(cfg.step_coef), extra_bytes=extra,
                    extra_from=f"{cfg.max_loras:,} + {cfg.max_cpu_loras:,} adapter slots, {fmt_count(samples)} "
                               f"timeline rows at {cfg.timeline_dt_s:g} s")


def check_engine(cfg, req, limits: Limits | None = None) -> None:
    """What the compiled engine needs: both inputs valid (``SpecError``) and affordable (``ResourceLimitError``).

    The engine counts its timeline rows one by one and sizes slot arrays by the flags, so the duration and
    the flags are bounded through the estimate before the compiled code runs."""
    cfg.check()
    req.check(cfg.n_adapters)
    check(estimate_arrays(cfg, req), limits)
