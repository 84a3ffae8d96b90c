"""The digital twin of one vLLM V1 server serving many LoRA adapters.

- ``types``: the engine's input and output (flat numpy arrays).
- ``steptime``: step duration from the profile's estimators.
- ``engine``: the fast engine (numba-compiled, pure-Python fallback).
- ``reference``: a slow, literal engine used by the tests to check ``engine``.
- ``metrics``: throughput, ITL, TTFT, starvation exactly as the real benchmark defines them.
- ``run``: the high-level ``simulate(profile, server, workload, seed)``.
"""
