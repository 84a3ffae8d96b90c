"""Traffic for the experiments of ``lorapack measure``: closed-loop workers and open-loop arrival sequences.

Both send streaming ``/v1/completions`` requests whose prompt is a list of token ids (its length is exact on any
tokenizer with at least ``PROMPT_TOKEN_HI`` ids) with ``ignore_eos`` (the output length is exact), through the
replayer of ``lorapack.testbed.replay`` (one request = one ``RequestRecord``). Closed loop: ``concurrency``
workers, each sending its next request when its previous one finished, hold the running batch at
``concurrency`` for as long as they run. Open loop: ``replay`` sends an arrival sequence at its times.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..testbed.replay import Arrival, RequestRecord, send_request

TRANSPORT_RETRIES = 2
RESENT_INDEX_OFFSET = 10**9


@dataclass
class ClosedLoopResult:
    records: list[RequestRecord]
    wall_s: float


def session_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def closed_loop_async(url: str, model: str, adapters: Sequence[str | None], concurrency: int,
                            requests_per_worker: int, prompt_tokens: int, output_tokens: int, seed: int,
                            api_key: str | None = None, timeout_s: float = 600.0,
                            first_index: int = 0, duration_s: float | None = None) -> ClosedLoopResult:
    """``concurrency`` workers, worker ``w`` sending up to ``requests_per_worker`` requests one after the other to
    adapter ``adapters[w % len(adapters)]`` (None = the base model); with ``duration_s`` a worker sends no new
    request after that time (every worker sends at least one). Request indices (and so prompts) start at
    ``first_index``: give every call its own range, or prefix caching would serve a repeated prompt."""
    import aiohttp

    records: list[RequestRecord] = []
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout,
                                     headers=session_headers(api_key)) as session:
        t0 = time.monotonic()

        async def worker(w: int) -> None:
            adapter = adapters[w % len(adapters)]
            for k in range(requests_per_worker):
                if k and duration_s is not None and time.monotonic() - t0 >= duration_s:
                    break
                index = first_index + w * requests_per_worker + k
                for attempt in range(1 + TRANSPORT_RETRIES):
                    # a resent request gets another prompt: the first may have left its prefix in the cache
                    rec = RequestRecord(index + attempt * RESENT_INDEX_OFFSET, adapter, prompt_tokens, output_tokens,
                                        time.monotonic() - t0)
                    arrival = Arrival(rec.t_planned_s, adapter, prompt_tokens, output_tokens)
                    await send_request(session, url, model, arrival, rec, t0, seed, None, True)
                    # no HTTP answer at all (seen: aiohttp's ServerDisconnectedError, 2 of 100 requests at
                    # concurrency 32 on the CPU testbed): the request is sent again, the server was not at fault
                    if rec.status != 0 or attempt == TRANSPORT_RETRIES:
                        break
                records.append(rec)

        await asyncio.wait_for(asyncio.gather(*(worker(w) for w in range(concurrency))), timeout_s)
        wall = time.monotonic() - t0
    records.sort(key=lambda r: r.index)
    return ClosedLoopResult(records, wall)


def closed_loop(url: str, model: str, adapters: Sequence[str | None], concurrency: int, requests_per_worker: int,
                prompt_tokens: int, output_tokens: int, seed: int, **kwargs) -> ClosedLoopResult:
    return asyncio.run(closed_loop_async(url, model, adapters, concurrency, requests_per_worker, prompt_tokens,
                                         output_tokens, seed, **kwargs))


def tpot_ms(rec: RequestRecord) -> float:
    """Time per output token after the first (ms): robust to chunks merged by a slow client."""
    n = rec.completion_tokens
    if rec.status != 200 or n < 2 or not np.isfinite(rec.t_first_s) or not np.isfinite(rec.t_finish_s):
        return float("nan")
    return 1000.0 * (rec.t_finish_s - rec.t_first_s) / (n - 1)


def failed(records: Sequence[RequestRecord]) -> list[RequestRecord]:
    return [r for r in records if r.status != 200 or r.error]
