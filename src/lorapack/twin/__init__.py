"""The digital twin of one vLLM V1 server serving many LoRA adapters.

- ``types``: the engine's input and output (flat numpy arrays).
- ``steptime``: step duration from the profile's estimators.
- ``engine``: the fast engine (numba-compiled phases named after vLLM's scheduler; a pure-Python loop for
  debugging); ``jitcache``: where its compiled code is cached.
- ``reference``: a slow, literal engine used by the tests to check ``engine``.
- ``metrics``: throughput, ITL, TTFT, starvation exactly as the real benchmark defines them.
- ``early``: early termination of runs whose outcome is clear.
- ``run``: the high-level ``simulate(profile, workload, flags, duration_s, seed) -> (RunMetrics, EngineResult)``.
"""
