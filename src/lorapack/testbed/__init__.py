"""The testbed: a real vLLM (its CPU build) with a tiny local model and LoRA adapters, to check the twin's rules,
``serve.sh`` and measured profiles against vLLM itself, without a GPU (docs/testbed.md).

``env``: the pinned install, cached per machine. ``server``: start a server on loopback and stop its whole
process tree (``guard``). ``replay``: send an arrival sequence to a server and record every request; the same
arrivals through the twin for a request-by-request comparison. Nothing here imports torch or vLLM.
"""
