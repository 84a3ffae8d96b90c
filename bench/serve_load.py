"""How well a twin server keeps time under load (issue "Serve", acceptance 1): client and server on this machine.

Three phases, each on a fresh ``lorapack serve`` (llama-3.1-8b-instruct's shipped profile, 16 adapters of rank
8/16, ``--max-loras 8``), the client an asyncio ``aiohttp`` process on the same cores:

1. ``stream``: open-loop Poisson requests, every one streamed, sized to ``--tokens-per-s`` (default 5,000)
   streamed tokens per second at ``--time-scale 1`` for ``--seconds``; the server's lag (wall seconds by which a
   step's tokens were handed out after their twin time: ``/version``'s ``twin_lag``) at p50 / p99 / max, and
   the client's count of tokens and errors;
2. ``concurrent``: ``--streams`` (default 1,000) streams opened at once (long outputs), every one read to its
   end: errors and lag;
3. ``replay``: a healthy one-hour workload (``--rate-rps`` requests/s over the 16 adapters) sent at
   ``--time-scale 20`` (non-streamed): wall time of the whole replay (target <= 4 min) and lag.

Targets: phase 1 lag p99 <= 50 ms; phase 2 no error; phase 3 <= 240 s. Prints the figures and writes
``bench/results/serve_load.json``. ``--quick``: short phases (a smoke run, not the acceptance).

Usage: ``python bench/serve_load.py [--quick] [--phases stream,concurrent,replay]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import time
from contextlib import contextmanager
from pathlib import Path

import aiohttp
import numpy as np

HERE = Path(__file__).resolve().parent
MODEL = "llama-3.1-8b-instruct"
N_ADAPTERS = 16


@contextmanager
def server(time_scale: float, max_connections: int = 4096):
    from lorapack.serve.launch import twin_process

    modules = [json.dumps({"name": f"a{k:02d}", "path": f"/adapters/a{k:02d}", "rank": 8 if k % 2 else 16})
               for k in range(N_ADAPTERS)]
    flags = ["--model", MODEL, "--enable-lora", "--max-loras", "8", "--max-lora-rank", "16", "--max-cpu-loras", "16",
             "--time-scale", str(time_scale), "--max-connections", str(max_connections), "--lora-modules", *modules]
    with twin_process(flags) as url:
        yield url


async def _version(session: aiohttp.ClientSession, url: str) -> dict:
    async with session.get(url + "/version") as r:
        return await r.json()


async def _one(session: aiohttp.ClientSession, url: str, adapter: str, prompt_tokens: int, max_tokens: int,
               stream: bool) -> tuple[int, bool]:
    """(tokens received, ok)."""
    body = {"model": adapter, "prompt": list(range(prompt_tokens)), "max_tokens": max_tokens, "stream": stream}
    try:
        async with session.post(url + "/v1/completions", json=body) as r:
            if r.status != 200:
                return 0, False
            if not stream:
                data = await r.json()
                return int(data["usage"]["completion_tokens"]), True
            n = 0
            async for line in r.content:
                if line.startswith(b"data: {"):
                    n += 1
            return n, True
    except (TimeoutError, aiohttp.ClientError):
        return 0, False


async def _open_loop(url: str, t_arr: np.ndarray, adapters: list[str], prompt: np.ndarray, output: np.ndarray,
                     time_scale: float, stream: bool) -> dict:
    conn = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
        v0 = await _version(session, url)
        start = time.monotonic()
        tasks = []
        for k in range(len(t_arr)):
            delay = start + t_arr[k] / time_scale - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(_one(session, url, adapters[k], int(prompt[k]), int(output[k]), stream)))
        results = await asyncio.gather(*tasks)
        wall = time.monotonic() - start
        v1 = await _version(session, url)
    tokens = sum(n for n, _ok in results)
    window = max(float(t_arr[-1]) / time_scale, 1e-9)  # wall seconds over which requests were sent
    return {"requests": len(results), "errors": sum(not ok for _n, ok in results), "tokens": tokens,
            "wall_s": wall, "tokens_per_wall_s": tokens / wall, "send_window_s": window,
            "tokens_per_s_sent_window": tokens / window, "lag": v1["twin_lag"],
            "twin_s": v1["twin_now_s"] - v0["twin_now_s"]}


def phase_stream(tokens_per_s: float, seconds: float, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    out_tokens = 100
    rate = tokens_per_s / out_tokens
    n = int(rate * seconds)
    t = np.cumsum(rng.exponential(1 / rate, n))
    adapters = [f"a{k:02d}" for k in rng.integers(0, N_ADAPTERS, n)]
    with server(1.0) as url:
        r = asyncio.run(_open_loop(url, t, adapters, rng.integers(50, 400, n), np.full(n, out_tokens), 1.0, True))
    r.update(target_tokens_per_s=tokens_per_s, time_scale=1.0)
    return r


def phase_concurrent(streams: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    t = np.zeros(streams)
    adapters = [f"a{k % N_ADAPTERS:02d}" for k in range(streams)]
    with server(1.0, max_connections=streams + 64) as url:
        r = asyncio.run(_open_loop(url, t, adapters, rng.integers(20, 200, streams), np.full(streams, 200), 1.0,
                                   True))
    r.update(streams=streams, time_scale=1.0)
    return r


def phase_replay(rate_rps: float, hours: float, time_scale: float, seed: int) -> dict:
    from lorapack.spec import Workload  # noqa: F401 - the workload law the twin uses elsewhere
    rng = np.random.default_rng(seed)
    duration = 3600.0 * hours
    n = int(rng.poisson(rate_rps * duration))
    t = np.sort(rng.uniform(0, duration, n))
    adapters = [f"a{k:02d}" for k in rng.integers(0, N_ADAPTERS, n)]
    prompt = np.clip(rng.lognormal(np.log(223) - 0.3, 0.77, n), 4, 4000).astype(int)
    output = np.clip(rng.lognormal(np.log(197) - 0.3, 0.77, n), 1, 2000).astype(int)
    with server(time_scale) as url:
        r = asyncio.run(_open_loop(url, t, adapters, prompt, output, time_scale, False))
    r.update(rate_rps=rate_rps, simulated_s=duration, time_scale=time_scale)
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--phases", default="stream,concurrent,replay")
    ap.add_argument("--tokens-per-s", type=float, default=5000.0)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--streams", type=int, default=1000)
    ap.add_argument("--rate-rps", type=float, default=4.0)
    ap.add_argument("--hours", type=float, default=1.0)
    ap.add_argument("--replay-time-scale", type=float, default=20.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="short phases (smoke run)")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "serve_load.json")
    a = ap.parse_args()
    if a.quick:
        a.seconds, a.streams, a.hours = 10.0, 200, 0.05
    phases = a.phases.split(",")
    out: dict = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                             "load_avg_start": os.getloadavg()[0]}, "quick": a.quick}
    if "stream" in phases:
        r = out["stream"] = phase_stream(a.tokens_per_s, a.seconds, a.seed)
        print(f"stream: {r['tokens']:,} tokens streamed ({r['tokens_per_s_sent_window']:,.0f}/s over the "
              f"{r['send_window_s']:.0f} s of sending, all done in {r['wall_s']:.1f} s), {r['errors']} errors;"
              f" lag p50 {1000 * r['lag']['p50_s']:.1f} ms, p99 {1000 * r['lag']['p99_s']:.1f} ms, max "
              f"{1000 * r['lag']['max_s']:.1f} ms (target p99 <= 50 ms)", flush=True)
    if "concurrent" in phases:
        r = out["concurrent"] = phase_concurrent(a.streams, a.seed)
        print(f"concurrent: {r['requests']} streams at once, {r['errors']} errors, {r['tokens']:,} tokens in "
              f"{r['wall_s']:.1f} s; lag p99 {1000 * r['lag']['p99_s']:.1f} ms, max {1000 * r['lag']['max_s']:.1f} ms",
              flush=True)
    if "replay" in phases:
        r = out["replay"] = phase_replay(a.rate_rps, a.hours, a.replay_time_scale, a.seed)
        print(f"replay: {r['simulated_s']:.0f} s of {r['rate_rps']} req/s at --time-scale {r['time_scale']:g} in "
              f"{r['wall_s']:.1f} s wall (target <= {240 * a.hours:.0f} s), {r['requests']} requests, {r['errors']} "
              f"errors; lag p99 {1000 * r['lag']['p99_s']:.1f} ms, max {1000 * r['lag']['max_s']:.1f} ms", flush=True)
    out["machine"]["load_avg_end"] = os.getloadavg()[0]
    if not a.quick:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
