"""Traffic for the experiments of ``lorapack measure``: closed-loop workers and open-loop arrival sequences.

Both send streaming ``/v1/completions`` requests whose prompt is a list of token ids (its length is exact on any
tokenizer with at least ``PROMPT_TOKEN_HI`` ids) with ``ignore_eos`` (the output length is exact), through the
replayer of ``lorapack.testbed.replay`` (one request = one ``RequestRecord``). Closed loop (``ClosedLoad``):
``concurrency`` workers, each sending its next request when its previous one finished, hold the running batch
at ``concurrency`` for as long as they run. Open loop: ``replay`` sends an arrival sequence at its times.
"""

from __future__ import annotations

import asyncio
import numbers
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import SpecError
from ..testbed.replay import Arrival, ReplayOptions, RequestRecord, send_request

TRANSPORT_RETRIES = 2
RESENT_INDEX_OFFSET = 10**9


@dataclass
class ClosedLoopResult:
    records: list[RequestRecord]
    wall_s: float


def session_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


@dataclass(frozen=True)
class ClosedLoad:
    """A closed-loop load: ``concurrency`` workers, worker ``w`` sending up to ``requests_per_worker`` requests of
    ``prompt_tokens`` -> ``output_tokens`` one after the other to adapter ``adapters[w % len(adapters)]`` (None =
    the base model); with ``duration_s`` a worker sends no new request after that time (every worker sends at
    least one). Request indices (and so prompts) start at ``first_index``: give every load its own range, or
    prefix caching would serve a repeated prompt."""

    adapters: tuple[str | None, ...]
    concurrency: int
    requests_per_worker: int
    prompt_tokens: int
    output_tokens: int
    first_index: int = 0
    duration_s: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "adapters", tuple(self.adapters))
        if not self.adapters:
            raise SpecError("a closed-loop load needs at least one adapter (None = the base model)")
        for name in ("concurrency", "requests_per_worker", "prompt_tokens", "output_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
                raise SpecError(f"{name} {v!r}: expected an integer >= 1")


async def closed_loop_async(url: str, model: str, load: ClosedLoad, seed: int, api_key: str | None = None,
                            timeout_s: float = 600.0) -> ClosedLoopResult:
    """Run ``load`` (``ClosedLoad``) against the server at ``url``: streamed requests to ``model`` (an adapter
    replaces it), prompts seeded by ``seed``, ``api_key`` sent as a bearer token; the whole load is cut at
    ``timeout_s``. Returns every request's record, in index order, and the wall time."""
    import aiohttp

    records: list[RequestRecord] = []
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    send = ReplayOptions(model=model, seed=seed, stream=True, timeout_s=timeout_s)
    adapters, per_worker = load.adapters, load.requests_per_worker
    prompt_tokens, output_tokens, duration_s = load.prompt_tokens, load.output_tokens, load.duration_s
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout,
                                     headers=session_headers(api_key)) as session:
        t0 = time.monotonic()

        async def worker(w: int) -> None:
            adapter = adapters[w % len(adapters)]
            for k in range(per_worker):
                if k and duration_s is not None and time.monotonic() - t0 >= duration_s:
                    break
                index = load.first_index + w * per_worker + k
                for attempt in range(1 + TRANSPORT_RETRIES):
                    # a resent request gets another prompt: the first may have left its prefix in the cache
                    rec = RequestRecord(index + attempt * RESENT_INDEX_OFFSET, adapter, prompt_tokens, output_tokens,
                                        time.monotonic() - t0)
                    arrival = Arrival(rec.t_planned_s, adapter, prompt_tokens, output_tokens)
                    await send_request(session, url, arrival, rec, t0, send)
                    # no HTTP answer at all (seen: aiohttp's ServerDisconnectedError, 2 of 100 requests at
                    # concurrency 32 on the CPU testbed): the request is sent again, the server was not at fault
                    if rec.status != 0 or attempt == TRANSPORT_RETRIES:
                        break
                records.append(rec)

        await asyncio.wait_for(asyncio.gather(*(worker(w) for w in range(load.concurrency))), timeout_s)
        wall = time.monotonic() - t0
    records.sort(key=lambda r: r.index)
    return ClosedLoopResult(records, wall)


def closed_loop(url: str, model: str, load: ClosedLoad, seed: int, api_key: str | None = None,
                timeout_s: float = 600.0) -> ClosedLoopResult:
    """``closed_loop_async``, blocking."""
    return asyncio.run(closed_loop_async(url, model, load, seed, api_key, timeout_s))


def tpot_ms(rec: RequestRecord) -> float:
    """Time per output token after the first (ms): robust to chunks merged by a slow client."""
    n = rec.completion_tokens
    if rec.status != 200 or n < 2 or not np.isfinite(rec.t_first_s) or not np.isfinite(rec.t_finish_s):
        return float("nan")
    return 1000.0 * (rec.t_finish_s - rec.t_first_s) / (n - 1)


def failed(records: Sequence[RequestRecord]) -> list[RequestRecord]:
    return [r for r in records if r.status != 200 or r.error]
