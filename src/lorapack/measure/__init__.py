"""``lorapack measure``: probe a live vLLM server from the outside and write profiling data that ``lorapack
calibrate`` fits into a profile (docs/profile-your-gpu.md).

* ``probe``: the server's identity (version, model, flags, KV cache) from its HTTP API, metrics and log;
* ``traffic``: closed-loop workers over the OpenAI completions route;
* ``experiments``: the designed experiments (decode ladder, prefill, LoRA cost, adapter loading);
* ``runs``: windowed Poisson runs in the runs schema of the research data;
* ``run``: the command itself (budget, progress, resumable measurement directory);
* ``launch``: ``--launch``: start the server per start-up grid point and for the experiments;
* ``fit``: the closed-form priors of a profile from a measurement directory;
* ``proof``: the testbed server, held-back runs and scores of ``bench/testbed_fidelity.py``.
"""
