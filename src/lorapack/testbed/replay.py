"""Send an arrival sequence to a vLLM server and record every request; the same arrivals through the twin.

``replay(url, arrivals)`` sends each arrival at its time (streaming ``/v1/completions`` with the prompt given as
token ids, so its length is exact, and ``ignore_eos`` so the output length is), and records per request: send
time, TTFT, every inter-chunk gap, finish, HTTP status and error message; ``/metrics`` is scraped every second
(running / waiting requests, the running and waiting adapters). ``twin_replay`` runs the same arrivals through
the twin (``simulate_requests``) so the two can be compared request by request (``order_agreement``).

vLLM streams one chunk per engine step and request; a client that falls behind may receive two steps merged in
one chunk (``n_chunks`` < the output tokens, ``completion_tokens`` from the usage block is exact).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

PROMPT_TOKEN_LO = 3  # token ids below are the tiny tokenizer's specials (<s>, </s>, <unk>)
PROMPT_TOKEN_HI = 2000


@dataclass(frozen=True)
class Arrival:
    """One request to send: when (seconds after the start), to which adapter (None = the base model), how long."""

    t_s: float
    adapter_id: str | None
    prompt_tokens: int
    output_tokens: int


@dataclass
class RequestRecord:
    """What the client saw of one request (times in seconds after the replay's start)."""

    index: int
    adapter_id: str | None
    prompt_tokens: int
    output_tokens: int
    t_planned_s: float
    t_sent_s: float = float("nan")
    t_first_s: float = float("nan")
    t_finish_s: float = float("nan")
    gaps_s: list[float] = field(default_factory=list)
    n_chunks: int = 0
    completion_tokens: int = 0
    status: int = 0  # HTTP status; 0 = no answer (connection error, time-out)
    error: str = ""

    @property
    def ttft_s(self) -> float:
        return self.t_first_s - self.t_sent_s


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


def parse_metrics(text: str, t_s: float) -> MetricsSample:
    """The gauges the testbed reads from a Prometheus text page (vLLM's names)."""
    from prometheus_client.parser import text_string_to_metric_families

    running = waiting = float("nan")
    lora_latest = None
    for family in text_string_to_metric_families(text):
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


async def _send(client, url: str, model: str, arrival: Arrival, rec: RequestRecord, t0: float, seed: int,
                extra: dict | None) -> None:
    await asyncio.sleep(max(0.0, t0 + arrival.t_s - time.monotonic()))
    body = {"model": arrival.adapter_id or model, "prompt": prompt_ids(rec.index, arrival.prompt_tokens, seed),
            "max_tokens": arrival.output_tokens, "ignore_eos": True, "stream": True, "temperature": 0.0,
            "stream_options": {"include_usage": True}, **(extra or {})}
    rec.t_sent_s = time.monotonic() - t0
    last = None
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            rec.status = r.status_code
            if r.status_code != 200:
                raw = (await r.aread()).decode(errors="replace")
                try:
                    rec.error = str(json.loads(raw).get("error", {}).get("message", raw))
                except (json.JSONDecodeError, AttributeError):
                    rec.error = raw
                return
            async for line in r.aiter_lines():
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
            rec.t_finish_s = time.monotonic() - t0
    except Exception as e:  # noqa: BLE001 - recorded per request: one failure must not end the replay
        rec.error = f"{type(e).__name__}: {e}"


async def _scrape(client, url: str, t0: float, samples: list[MetricsSample], stop: asyncio.Event,
                  every_s: float) -> None:
    while not stop.is_set():
        try:
            r = await client.get(url + "/metrics")
            samples.append(parse_metrics(r.text, time.monotonic() - t0))
        except Exception:  # noqa: BLE001 - a missed scrape is a gap in the gauges, not a failed replay
            pass
        try:
            await asyncio.wait_for(stop.wait(), every_s)
        except TimeoutError:
            pass


async def replay_async(url: str, arrivals: Sequence[Arrival], model: str = "", seed: int = 0,
                       scrape_every_s: float = 1.0, timeout_s: float = 600.0,
                       extra_body: dict | None = None) -> ReplayResult:
    import httpx

    records = [RequestRecord(i, a.adapter_id, a.prompt_tokens, a.output_tokens, a.t_s) for i, a in enumerate(arrivals)]
    samples: list[MetricsSample] = []
    stop = asyncio.Event()
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as client:
        if not model:
            r = await client.get(url + "/v1/models")
            model = r.json()["data"][0]["id"]  # the base model is listed first
        t0 = time.monotonic()
        scraper = asyncio.create_task(_scrape(client, url, t0, samples, stop, scrape_every_s))
        sends = [asyncio.create_task(_send(client, url, model, a, rec, t0, seed, extra_body))
                 for a, rec in zip(arrivals, records, strict=True)]
        try:
            await asyncio.wait_for(asyncio.gather(*sends), timeout_s)
        finally:
            stop.set()
            await scraper
            for task in sends:
                task.cancel()
        wall = time.monotonic() - t0
    return ReplayResult(records, samples, wall)


def replay(url: str, arrivals: Sequence[Arrival], **kwargs) -> ReplayResult:
    """Send ``arrivals`` to the server at ``url`` (blocking); see ``replay_async`` for the options."""
    return asyncio.run(replay_async(url, arrivals, **kwargs))


# --- the twin side -------------------------------------------------------------------------------------------

def twin_replay(profile, adapter_ids: Sequence[str], ranks: Sequence[int], arrivals: Sequence[Arrival], flags,
                duration_s: float):
    """The same arrivals through the twin: ``(metrics, EngineResult)`` (``simulate_requests``), requests in the
    order of ``arrivals`` (which must be sorted by time). ``adapter_ids`` is the server's registration order."""
    from lorapack.twin.run import simulate_requests
    from lorapack.twin.types import RequestArrays

    index = {a: i for i, a in enumerate(adapter_ids)}
    t = np.array([a.t_s for a in arrivals], dtype=np.float64)
    if np.any(np.diff(t) < 0):
        raise ValueError("arrivals must be sorted by time")
    req = RequestArrays(t, np.array([index[a.adapter_id] for a in arrivals], dtype=np.int32),
                        np.array([a.prompt_tokens for a in arrivals], dtype=np.int32),
                        np.array([a.output_tokens for a in arrivals], dtype=np.int32))
    return simulate_requests(profile, np.asarray(ranks, dtype=np.int32), req, flags, duration_s=duration_s)


def order_agreement(t_sent_s: np.ndarray, adapter: Sequence, first_a: np.ndarray, first_b: np.ndarray,
                    min_gap_s: float = 0.02) -> tuple[float, int]:
    """Of the request pairs with different adapters sent at least ``min_gap_s`` apart, the share whose first
    tokens come in the same order in ``first_a`` and ``first_b`` (e.g. server and twin); ``(share, pairs)``.
    Pairs where either side has no first token are left out; a tie on one side counts as agreement."""
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
    agree = (sa == sb) | (sa == 0) | (sb == 0)
    return float(agree.mean()), int(len(i))
