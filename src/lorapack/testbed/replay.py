"""Send an arrival sequence to a vLLM server and record every request; the same arrivals through the twin.

``replay(url, arrivals, options)`` sends each arrival at its time (streaming ``/v1/completions`` with the prompt given as
token ids, so its length is exact, and ``ignore_eos`` so the output length is), and records per request: send
time, TTFT, every inter-chunk gap, finish, HTTP status and error message, and (``--enable-per-request-metrics``)
the engine's own queue and first-token intervals; ``/metrics`` is scraped every second
(running / waiting requests, the running and waiting adapters). ``twin_replay`` runs the same arrivals through
the twin (``simulate_requests``) so the two can be compared request by request (``order_agreement``).

vLLM streams one chunk per engine step and request; a client that falls behind may receive two steps merged in
one chunk (``n_chunks`` < the output tokens, ``completion_tokens`` from the usage block is exact).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ..errors import SpecError
from ..serve import ARRIVAL_HEADER

PROMPT_TOKEN_LO = 3  # token ids below are the tiny tokenizer's specials (<s>, </s>, <unk>)
PROMPT_TOKEN_HI = 2000


@dataclass(frozen=True)
class Arrival:
    """One request to send: when (seconds after the start), to which adapter (None = the base model), how long."""

    t_s: float
    adapter_id: str | None
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class ReplayOptions:
    """How the client sends requests (``replay``, ``send_request``): the served model to ask for (an arrival's
    adapter replaces it; "" = the server's base model, asked from ``/v1/models``), the seed of the prompts,
    streaming or one answer per request, extra JSON fields of every request body, HTTP headers (e.g.
    ``Authorization``), the client's time-out, how often ``/metrics`` is scraped, and ``window_s``: at this time
    after the start, requests still open are cancelled and the replay returns what it has."""

    model: str = ""
    seed: int = 0
    stream: bool = True
    extra_body: dict | None = None
    headers: dict[str, str] | None = None
    timeout_s: float = 600.0
    scrape_every_s: float = 1.0
    window_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("timeout_s", "scrape_every_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not v > 0:
                raise SpecError(f"{name} {v!r}: expected a positive number of seconds")
        if self.window_s is not None and (isinstance(self.window_s, bool)
                                          or not isinstance(self.window_s, int | float) or not self.window_s > 0):
            raise SpecError(f"window_s {self.window_s!r}: expected a positive number of seconds or None")


@dataclass
class RequestRecord:
    """What the client saw of one request (times in seconds after the replay's start)."""

    index: int
    adapter_id: str | None
    prompt_tokens: int
    output_tokens: int
    t_planned_s: float
    t_sent_s: float = float("nan")
    # when the request's body was handed to the socket (aiohttp's ``on_request_chunk_sent``): ``t_sent_s`` plus
    # the client's own work before it (encoding the body, taking a connection): a median 0.7-1.4 ms on 2 cores
    t_wire_s: float = float("nan")
    # when the server says the request entered its engine (a twin server's ``x-lorapack-arrival-monotonic``, the
    # same machine's monotonic clock); NaN from any other server
    t_server_arrival_s: float = float("nan")
    t_first_s: float = float("nan")
    t_finish_s: float = float("nan")
    gaps_s: list[float] = field(default_factory=list)
    n_chunks: int = 0
    completion_tokens: int = 0
    status: int = 0  # HTTP status; 0 = no answer (connection error, time-out)
    error: str = ""
    # the engine's own clock (vLLM's per-request metrics, `--enable-per-request-metrics`): queued -> scheduled,
    # scheduled -> first token; NaN when the server does not send them
    queue_ms: float = float("nan")
    engine_ttft_ms: float = float("nan")
    engine_itl_ms: float = float("nan")  # the engine's mean inter-token interval of this request

    @property
    def ttft_s(self) -> float:
        return self.t_first_s - self.t_sent_s

    @property
    def t_first_server_s(self) -> float:
        """When the engine made the first token: the send time plus the engine's queued -> first-token interval
        (free of the client's own delays in reading the stream); the client's first-chunk time when the server
        sends no per-request metrics."""
        if np.isfinite(self.queue_ms) and np.isfinite(self.engine_ttft_ms):
            return self.t_sent_s + (self.queue_ms + self.engine_ttft_ms) / 1000.0
        return self.t_first_s

    @property
    def outside_engine_s(self) -> float:
        """Client-seen time the engine's own intervals do not cover: the API server's time between receiving the
        request and queuing it in the engine, plus the answer's way back (the first token is placed from the end:
        finish minus the engine's decode span). Tens of ms normally; a stalled API loop that queued the request
        late shows here, and then the engine may have seen requests in another order than they were sent. NaN
        without per-request metrics."""
        if not (np.isfinite(self.engine_itl_ms) and np.isfinite(self.t_finish_s)) or self.completion_tokens < 1:
            return float("nan")
        decode_s = self.engine_itl_ms * max(self.completion_tokens - 1, 0) / 1000.0
        return self.t_finish_s - decode_s - self.t_first_server_s


@dataclass
class MetricsSample:
    t_s: float
    running: float
    waiting: float
    running_adapters: tuple[str, ...]
    waiting_adapters: tuple[str, ...]
    max_lora: int | None


@dataclass
class ReplayResult:
    records: list[RequestRecord]
    samples: list[MetricsSample]
    wall_s: float


def prompt_ids(index: int, n_tokens: int, seed: int) -> list[int]:
    """A seeded prompt of exactly ``n_tokens`` ids (distinct per request, so prefix caching finds nothing)."""
    rng = np.random.default_rng([seed, index])
    return rng.integers(PROMPT_TOKEN_LO, PROMPT_TOKEN_HI, size=n_tokens).tolist()


GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:lora_requests_info")


def parse_metrics(text: str, t_s: float) -> MetricsSample:
    """The gauges the testbed reads from a Prometheus text page (vLLM's names). Only their lines are parsed: the
    whole page (600 lines, histograms) takes the parser 40 ms on an idle core and far more on a busy one, time
    the replay's event loop would not send requests in."""
    from prometheus_client.parser import text_string_to_metric_families

    wanted = "\n".join(ln for ln in text.splitlines() if ln.startswith(GAUGES))
    running = waiting = float("nan")
    lora_latest = None
    for family in text_string_to_metric_families(wanted):
        for s in family.samples:
            if s.name == "vllm:num_requests_running":
                running = s.value
            elif s.name == "vllm:num_requests_waiting":
                waiting = s.value
            elif s.name == "vllm:lora_requests_info" and (lora_latest is None or s.value >= lora_latest.value):
                lora_latest = s  # one sample per state; its value is the time it was set: the newest holds

    def names(key: str) -> tuple[str, ...]:
        raw = lora_latest.labels.get(key, "") if lora_latest is not None else ""
        return tuple(sorted(a for a in raw.split(",") if a))

    max_lora = int(lora_latest.labels["max_lora"]) if lora_latest is not None else None
    return MetricsSample(t_s, running, waiting, names("running_lora_adapters"), names("waiting_lora_adapters"),
                         max_lora)


def _record_engine_metrics(rec: RequestRecord, engine: dict | None) -> None:
    engine = engine or {}
    if engine.get("queue_time_ms") is not None and engine.get("time_to_first_token_ms") is not None:
        rec.queue_ms = float(engine["queue_time_ms"])
        rec.engine_ttft_ms = float(engine["time_to_first_token_ms"])
    if engine.get("mean_itl_ms") is not None:
        rec.engine_itl_ms = float(engine["mean_itl_ms"])


def _error_message(raw: str) -> str:
    try:
        return str(json.loads(raw).get("error", {}).get("message", raw))
    except (json.JSONDecodeError, AttributeError):
        return raw


async def send_request(session, url: str, arrival: Arrival, rec: RequestRecord, t0: float,
                       options: ReplayOptions) -> None:
    """Send ``arrival`` at its time (``t0`` + ``arrival.t_s``, monotonic clock) on the aiohttp ``session`` and fill
    ``rec``; ``options``: the model, prompt seed, streaming and extra body fields (``ReplayOptions``)."""
    await asyncio.sleep(max(0.0, t0 + arrival.t_s - time.monotonic()))
    stream = options.stream
    body = {"model": arrival.adapter_id or options.model,
            "prompt": prompt_ids(rec.index, arrival.prompt_tokens, options.seed),
            "max_tokens": arrival.output_tokens, "ignore_eos": True, "stream": stream, "temperature": 0.0,
            **({"stream_options": {"include_usage": True}} if stream else {}), **(options.extra_body or {})}
    rec.t_sent_s = time.monotonic() - t0
    last = None
    try:
        async with session.post(url + "/v1/completions", json=body, trace_request_ctx=rec) as r:
            rec.status = r.status
            if (stamp := r.headers.get(ARRIVAL_HEADER)) is not None:
                with contextlib.suppress(ValueError):
                    rec.t_server_arrival_s = float(stamp) - t0
            if r.status != 200:
                rec.error = _error_message(await r.text())
                return
            if not stream:
                answer = await r.json()
                rec.t_finish_s = time.monotonic() - t0
                rec.completion_tokens = int((answer.get("usage") or {}).get("completion_tokens") or 0)
                _record_engine_metrics(rec, answer.get("metrics"))
                return
            async for raw in r.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.monotonic() - t0
                chunk = json.loads(line[6:])
                if chunk.get("choices"):
                    rec.n_chunks += 1
                    if last is None:
                        rec.t_first_s = now
                    else:
                        rec.gaps_s.append(now - last)
                    last = now
                if chunk.get("usage"):
                    rec.completion_tokens = int(chunk["usage"].get("completion_tokens") or 0)
                _record_engine_metrics(rec, chunk.get("metrics"))
            rec.t_finish_s = time.monotonic() - t0
    except Exception as e:  # noqa: BLE001 - recorded per request: one failure must not end the replay
        rec.error = f"{type(e).__name__}: {e}"


def _scrape(url: str, t0: float, samples: list[MetricsSample], stop: threading.Event, every_s: float) -> None:
    """Scrape ``/metrics`` every ``every_s`` until ``stop`` (a thread of its own: in the replay's event loop a
    scrape delayed the sends by up to a second on a busy 2-core machine)."""
    import urllib.request

    while not stop.is_set():
        try:
            with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
                text = r.read().decode()
            samples.append(parse_metrics(text, time.monotonic() - t0))
        except Exception:  # noqa: BLE001 - a missed scrape is a gap in the gauges, not a failed replay
            pass
        stop.wait(every_s)


async def replay_async(url: str, arrivals: Sequence[Arrival], options: ReplayOptions | None = None) -> ReplayResult:
    """Send ``arrivals`` (see the module's docstring) as ``options`` says (``ReplayOptions``; default: streamed,
    the server's base model, seed 0, no window). ``stream=False``: one answer per request, no per-token record
    (``t_first_s`` and ``gaps_s`` stay empty; ``t_first_server_s`` comes from the engine's metrics): the client
    then needs almost no CPU, which keeps its send times exact on a busy 2-core machine.

    ``window_s``: at this time after the start, requests still open are cancelled (the server aborts them when
    the connection closes) and the replay returns what it has, as a benchmark with a time window does."""
    import dataclasses

    import aiohttp
    import prometheus_client.parser  # noqa: F401 - imported now, not in the scraper's first pass

    options = options or ReplayOptions()
    records = [RequestRecord(i, a.adapter_id, a.prompt_tokens, a.output_tokens, a.t_s) for i, a in enumerate(arrivals)]
    samples: list[MetricsSample] = []
    stop = threading.Event()
    timeout_s = options.timeout_s
    # aiohttp, not httpx: httpx's connection set-up (anyio connect_tcp) held the event loop for up to 1.7 s at
    # a time on a busy 2-core machine, delaying sends; aiohttp kept them within a few ms (docs/testbed.md)
    connector = aiohttp.TCPConnector(limit=0)
    clock = {"t0": time.monotonic()}

    async def on_chunk_sent(_session, ctx, _params) -> None:
        if ctx.trace_request_ctx is not None:  # the last chunk of the body counts
            ctx.trace_request_ctx.t_wire_s = time.monotonic() - clock["t0"]

    trace = aiohttp.TraceConfig()
    trace.on_request_chunk_sent.append(on_chunk_sent)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout_s),
                                     headers=options.headers or {}, trace_configs=[trace]) as session:
        if not options.model:
            async with session.get(url + "/v1/models") as r:
                model = (await r.json())["data"][0]["id"]  # the base model is listed first
            options = dataclasses.replace(options, model=model)
        t0 = clock["t0"] = time.monotonic()
        scraper = threading.Thread(target=_scrape, args=(url, t0, samples, stop, options.scrape_every_s),
                                   daemon=True)
        scraper.start()
        sends = [asyncio.create_task(send_request(session, url, a, rec, t0, options))
                 for a, rec in zip(arrivals, records, strict=True)]
        try:
            if options.window_s is None:
                await asyncio.wait_for(asyncio.gather(*sends), timeout_s)
            else:
                await asyncio.wait(sends, timeout=options.window_s)
        finally:
            stop.set()
            scraper.join(timeout=15)
            for task in sends:
                task.cancel()
        wall = time.monotonic() - t0
    return ReplayResult(records, samples, wall)


def replay(url: str, arrivals: Sequence[Arrival], options: ReplayOptions | None = None) -> ReplayResult:
    """Send ``arrivals`` to the server at ``url`` (blocking); see ``replay_async`` and ``ReplayOptions``."""
    return asyncio.run(replay_async(url, arrivals, options))


# --- the twin side -------------------------------------------------------------------------------------------

def twin_replay(profile, adapter_ids: Sequence[str], ranks: Sequence[int], arrivals: Sequence[Arrival], flags,
                duration_s: float, sent_s: Sequence[float] | None = None, time_scale: float = 1.0):
    """The same arrivals through the twin: ``(metrics, EngineResult)`` (``simulate_requests``), the result's
    per-request arrays in the order of ``arrivals``. ``adapter_ids`` is the server's registration order.

    ``sent_s``: the times the requests were actually sent (``RequestRecord.t_sent_s``) instead of the planned
    ``Arrival.t_s``. Compare with a server run on these: a client that is starved of CPU for a moment sends
    late, in a burst, and the server sees that burst, not the plan.

    ``time_scale``: the twin runs ``time_scale`` times slower than the profile says (every duration of the
    simulation -- steps, adapter loads -- stretched alike): the arrivals are divided by it, the result's times
    multiplied back; the metrics stay in the twin's stretched time (rates ÷ ``time_scale``, durations ×
    ``time_scale`` give the server's: ``measure.proof.predict_run``). ``pace_to_server`` picks it so that the twin
    keeps a server's pace."""
    import dataclasses

    from lorapack.twin.run import simulate_requests
    from lorapack.twin.types import RequestArrays

    index = {a: i for i, a in enumerate(adapter_ids)}
    t = np.array([a.t_s for a in arrivals] if sent_s is None else sent_s, dtype=np.float64)
    if not np.all(np.isfinite(t)):
        raise ValueError("every request needs a send time (a request that was never sent has none)")
    if not (isinstance(time_scale, int | float) and time_scale > 0 and np.isfinite(time_scale)):
        raise ValueError(f"time_scale {time_scale!r}: expected a positive number")
    t = np.maximum(t, 0.0) / time_scale
    order = np.lexsort((np.arange(len(t)), t))  # by time, then in the given order
    req = RequestArrays(t[order], np.array([index[arrivals[i].adapter_id] for i in order], dtype=np.int32),
                        np.array([arrivals[i].prompt_tokens for i in order], dtype=np.int32),
                        np.array([arrivals[i].output_tokens for i in order], dtype=np.int32))
    metrics, res = simulate_requests(profile, np.asarray(ranks, dtype=np.int32), req, flags,
                                     duration_s=duration_s / time_scale)
    if res is None:
        return metrics, None
    back = np.empty_like(order)
    back[order] = np.arange(len(order))
    return metrics, dataclasses.replace(res, t_sent_s=res.t_sent_s[back] * time_scale,
                                        t_first_s=res.t_first_s[back] * time_scale,
                                        t_finish_s=res.t_finish_s[back] * time_scale, n_preempted=res.n_preempted[back],
                                        n_merged=None if res.n_merged is None else res.n_merged[back])


def server_itl_s(records: Sequence[RequestRecord]) -> float:
    """The server's median inter-token interval over the answered requests of a replay (the engine's own
    per-request mean when it sends one, else the client's first-to-last span): NaN when none has two tokens."""
    itl = []
    for r in records:
        if np.isfinite(r.engine_itl_ms):
            itl.append(r.engine_itl_ms / 1000.0)
        elif r.completion_tokens > 1 and np.isfinite(r.t_finish_s) and np.isfinite(r.t_first_server_s):
            itl.append((r.t_finish_s - r.t_first_server_s) / (r.completion_tokens - 1))
    itl = [x for x in itl if x > 0]
    return float(np.median(itl)) if itl else float("nan")


def twin_itl_s(engine, output_tokens: Sequence[int]) -> float:
    """The twin's median inter-token interval over its finished requests with two or more output tokens."""
    out = np.asarray(output_tokens, dtype=float)
    span = np.asarray(engine.t_finish_s, dtype=float) - np.asarray(engine.t_first_s, dtype=float)
    ok = (out > 1) & np.isfinite(span) & (span > 0)
    return float(np.median(span[ok] / (out[ok] - 1))) if ok.any() else float("nan")


def pace_to_server(profile, adapter_ids: Sequence[str], ranks: Sequence[int], arrivals: Sequence[Arrival], flags,
                   duration_s: float, records: Sequence[RequestRecord], rounds: int = 3):
    """``twin_replay`` of a replayed run (the actual send times) at the server's pace: ``(time_scale, metrics,
    EngineResult)``, the scale chosen so that the twin's median inter-token interval matches the server's.

    What the scheduler's rules decide -- which waiting request is admitted, which adapter waits for a slot --
    depends on whether a running request has finished when the next one arrives, i.e. on the step time
    against the send gaps. The shipped profiles' steps are an H100's; the testbed's CPU server is slower or
    faster by a factor that moves with the machine's load (a CPU shared with other work at ``nice 19``
    takes several times longer per step). Comparing rules at a common pace keeps that factor out of the
    comparison: a step-time ratio, not a rule, would otherwise decide orders (docs/testbed.md)."""
    sent = [r.t_sent_s for r in records]
    outs = [a.output_tokens for a in arrivals]
    target = server_itl_s(records)
    scale = 1.0
    metrics, engine = twin_replay(profile, adapter_ids, ranks, arrivals, flags, duration_s, sent_s=sent)
    for _ in range(rounds):
        if engine is None or not np.isfinite(target):
            break
        now = twin_itl_s(engine, outs)
        if not np.isfinite(now) or abs(now / target - 1.0) < 0.02:
            break
        scale *= target / now
        metrics, engine = twin_replay(profile, adapter_ids, ranks, arrivals, flags, duration_s, sent_s=sent,
                                      time_scale=scale)
    return scale, metrics, engine


def order_agreement(t_sent_s: np.ndarray, adapter: Sequence, first_a: np.ndarray, first_b: np.ndarray,
                    min_gap_s: float = 0.02, tie_s: float = 0.0) -> tuple[float, int]:
    """Of the request pairs with different adapters sent at least ``min_gap_s`` apart, the share whose first
    tokens come in the same order in ``first_a`` and ``first_b`` (e.g. server and twin); ``(share, pairs)``.
    Pairs where either side has no first token are left out; a tie on one side -- first tokens at most
    ``tie_s`` apart -- counts as agreement.

    ``tie_s`` of one step (``staircase.compare_with_twin``) leaves out what no rule decides: whether two requests
    were picked up in the same step or one step apart depends on where the step boundaries fell, and the
    server's first-token times carry the front end's own delay before queuing (tens of ms, ``outside_engine_s``)."""
    if not (tie_s >= 0.0):
        raise ValueError(f"tie_s {tie_s!r}: expected a number of seconds >= 0")
    t = np.asarray(t_sent_s, dtype=float)
    a = np.asarray(first_a, dtype=float)
    b = np.asarray(first_b, dtype=float)
    ad = np.asarray([str(x) for x in adapter])
    ok = np.isfinite(a) & np.isfinite(b)
    i, j = np.triu_indices(len(t), k=1)
    keep = ok[i] & ok[j] & (ad[i] != ad[j]) & (np.abs(t[i] - t[j]) >= min_gap_s)
    i, j = i[keep], j[keep]
    if len(i) == 0:
        return float("nan"), 0
    sa = np.sign(a[i] - a[j])
    sb = np.sign(b[i] - b[j])
    tied = (np.abs(a[i] - a[j]) <= tie_s) | (np.abs(b[i] - b[j]) <= tie_s)
    agree = (sa == sb) | tied
    return float(agree.mean()), int(len(i))
