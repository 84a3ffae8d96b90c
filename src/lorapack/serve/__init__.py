"""``lorapack serve``: the calibrated twin behind vLLM's own HTTP API (docs/serve.md).

* ``twin.py``: ``TwinServer``, a live engine (``twin.engine.Engine.live``) stepped in (scaled) wall time, with
  the adapters a server has registered;
* ``metrics.py``: ``/metrics`` under vLLM's names;
* ``http.py``: the Starlette app (vLLM's OpenAI-compatible routes), the optional extra ``lorapack[serve]``;
* ``launch.py``: the command's server(s): one, or one per GPU of a plan (``--plan``).
"""

# a completion's arrival in the engine (this machine's time.monotonic(); not a vLLM header): set by ``http.py``,
# read by the replayer (``testbed.replay``) so a client on the same machine can simulate the arrivals served
ARRIVAL_HEADER = "x-lorapack-arrival-monotonic"
