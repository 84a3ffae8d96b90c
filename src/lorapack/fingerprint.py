"""The twin's behavioural fingerprint: a hash of its outputs on a small fixed probe set plus the profile.

Every sweep row and every model file records it. Two twins with equal fingerprints give the same run-level
answers on the probes, so models trained on one stay valid for the other (a pure refactor keeps the
fingerprint; a change of the engine, the step-time model, the run-level metrics, the early-stop rules, the
request generator or the profile's constants changes it and requires ``make models``). Per-adapter labels
are not part of it: no learned model is trained on them.

The probes run through the same path as sweep rows and the twin oracle (``generate_requests`` ->
``simulate_requests``, with and without early termination) and cover idle, healthy, adapter-thrashing and
starved regimes in well under a second.
"""

from __future__ import annotations

import hashlib
import json
import math
from functools import lru_cache

import numpy as np

from .profile import NEUTRAL_FIELDS, Profile
from .server import ServerConfig

FINGERPRINT_SCHEME = "probe/v1"
# step-time constants that entered the model after profiles were shipped, at the value that switches them off
NEUTRAL_STEPTIME = {"e5_ms_per_kblock_slot": 0.0}
# profile fields added after profiles were shipped, at the value every shipped profile was measured with
NEUTRAL_PROFILE = NEUTRAL_FIELDS
_NEUTRAL = {**NEUTRAL_STEPTIME, **NEUTRAL_PROFILE}
# (N, A, rate per adapter req/s, rank tuple, duration s, early stop)
PROBES: tuple[tuple[int, int, float, tuple[int, ...], float, bool], ...] = (
    (8, 8, 0.5, (8, 16), 300.0, False),  # light, every adapter resident
    (48, 4, 0.2, (8, 16, 32), 300.0, False),  # adapter thrashing: 4 slots for 48 adapters
    (16, 16, 0.6, (16,), 1500.0, True),  # healthy early stop
    (64, 8, 1.0, (8, 32), 1500.0, True),  # starved, early stop
)
# metrics that define the behaviour (timing columns and wall clock excluded)
# Run-level behaviour only: what the learned models are trained on (throughput, the starvation label, ITL,
# TTFT), how runs end (early stop) and the engine counters behind them. Per-adapter labels are left out on
# purpose: no model learns them (their definition has its own tests), so changing it must not void models.
PROBE_KEYS = ("throughput_tok_s", "incoming_tok_s", "starved", "itl_mean_ms", "ttft_mean_ms", "ttft_p99_ms",
              "n_arrived", "n_completed", "preemptions", "adapter_loads", "steps", "stop_reason", "simulated_s",
              "kv_cache_tokens")


def _canon(v):
    """Values rounded to 10 significant digits: robust to last-bit libm differences between machines."""
    if isinstance(v, bool) or v is None or isinstance(v, str):
        return v
    if isinstance(v, int | np.integer):
        return int(v)
    v = float(v)
    return None if not math.isfinite(v) else float(f"{v:.10g}")


def probe_outputs(profile: Profile) -> list[dict]:
    """The twin's answers on the probe set (for the fingerprint and for inspecting a change)."""
    from .oracle import GpuCandidate, candidate_workload
    from .twin.early import EarlyStopOptions
    from .twin.run import simulate_requests
    from .workload import generate_requests

    out = []
    for k, (n, a, rate, ranks, dur, early) in enumerate(PROBES):
        cand = GpuCandidate(profile=profile, ranks=np.array([ranks[i % len(ranks)] for i in range(n)]),
                            rates_rps=np.full(n, rate), server=ServerConfig(max_loras=a))
        req = generate_requests(candidate_workload(cand, dur), dur, 1000 + k)
        m, _ = simulate_requests(profile, cand.ranks, req, cand.server_config(), dur,
                                 early_stop=EarlyStopOptions() if early else None)
        d = m.to_dict() if hasattr(m, "to_dict") else m
        out.append({key: _canon(d.get(key)) for key in PROBE_KEYS})
    return out


@lru_cache(maxsize=8)
def _fingerprint(profile_json: str) -> str:
    profile = Profile.model_validate_json(profile_json)
    doc = {"scheme": FINGERPRINT_SCHEME, "profile": json.loads(profile_json), "probes": probe_outputs(profile)}
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def twin_fingerprint(profile: Profile) -> str:
    """16 hex digits identifying (twin behaviour, profile constants). Cached per profile and process."""
    # provenance (who fitted the profile, when) does not change behaviour; constants added to the model later
    # are left out at their neutral value, so profiles fitted before them keep their fingerprint
    doc = _drop_neutral(profile.model_copy(update={"provenance": {}}).model_dump(mode="json"))
    return _fingerprint(json.dumps(doc))


def _drop_neutral(v):
    """``v`` without the NEUTRAL_STEPTIME / NEUTRAL_PROFILE keys that hold their neutral value (at any depth:
    priors too)."""
    if isinstance(v, dict):
        return {k: _drop_neutral(x) for k, x in v.items()
                if not (k in _NEUTRAL and x == _NEUTRAL[k] and type(x) is type(_NEUTRAL[k]))}
    if isinstance(v, list):
        return [_drop_neutral(x) for x in v]
    return v
