"""A twin server against ``lorapack simulate`` on the same arrivals (issue "Serve", acceptance 2).

For each design (16 adapters of ranks 8/16 on llama-3.1-8b-instruct's shipped profile, Zipf rates: one slot
per adapter; a tail that starves behind 4 slots; an overload on 2 slots), a ``lorapack serve`` at
``--time-scale 1`` receives Poisson arrivals from a streaming client (``lorapack.testbed.replay``: aiohttp, one request per arrival, its send time, first chunk and every gap
recorded), and the twin simulates the same arrivals (``twin_replay``) at the times the server's engine got them
(the twin server's ``x-lorapack-arrival-monotonic`` header, same machine). Scores:

* per request, the time from the request's arrival to its first token reaching the client against the twin's
  TTFT (frontend share included), and the mean
  inter-token gap against the twin's ``(t_finish - t_first) / (tokens - 1)``: the median relative error
  (target <= 5 %);
* the same TTFT error with the twin fed the times each body left the client (``*_from_wire``) and the times the
  client's send calls began (``*_from_send_call``): these add the step clock's phase (the twin's steps anchored
  on other times than the server's) and the client's own send path;
* the starved adapters: the twin's rule (``twin.metrics.compute_metrics``) applied to the client's times and
  to the twin's (target: the same set);
* ``/metrics`` against the twin's timeline: the scraped ``vllm:num_requests_running`` / ``_waiting`` (every
  second) against the twin's at the same times, mean absolute difference, and the final counters.

Each design runs twice (``--http-path both``): with the server's own HTTP-path probe (``lorapack serve``'s
default), and with this client's measured path (aiohttp to ``/lorapack/probe``, median of 60) given as
``--http-path-ms``, as a user who knows their client's path would (docs/serve.md, "Why h").

Prints per design and writes ``bench/results/serve_fidelity.json``. About 2 x 2 x ``--duration-s`` + start-up
per design.

Usage: ``python bench/serve_fidelity.py [--duration-s 120] [--http-path both|server-probe|client-measured]``
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from contextlib import contextmanager
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
MODEL = "llama-3.1-8b-instruct"

# name, adapters, total rate (req/s), --max-loras, --max-cpu-loras
DESIGNS = [("all-slots", 16, 4.0, 16, 16), ("zipf-tail-starves", 16, 4.0, 4, 8), ("overload", 16, 14.0, 2, 8)]


@contextmanager
def server(adapters: list[str], ranks: list[int], max_loras: int, max_cpu_loras: int,
           http_path_ms: float | None = None):
    from lorapack.serve.launch import twin_process

    modules = [json.dumps({"name": a, "path": f"/adapters/{a}", "rank": r}) for a, r in zip(adapters, ranks, strict=True)]
    flags = ["--model", MODEL, "--enable-lora", "--max-loras", str(max_loras), "--max-lora-rank", "16",
             "--max-cpu-loras", str(max_cpu_loras), "--lora-modules", *modules]
    if http_path_ms is not None:
        flags += ["--http-path-ms", f"{http_path_ms:.3f}"]
    with twin_process(flags) as url:
        yield url


def client_http_path_ms(url: str, n: int = 60, warmup: int = 10) -> float:
    """Median wall ms from sending a streamed request to ``/lorapack/probe`` (one event, no engine) to having parsed
    its event, with the replay's own client (aiohttp, one session, JSON per event): what this client's HTTP
    path adds to a TTFT, which a user who knows it gives the server as ``--http-path-ms``."""
    import asyncio
    import time

    import aiohttp

    async def run() -> list[float]:
        times = []
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            for k in range(warmup + n):
                t0 = time.monotonic()
                async with session.post(url + "/lorapack/probe", json={}) as r:
                    async for raw in r.content:
                        line = raw.decode().strip()
                        if line.startswith("data: "):
                            json.loads(line[6:])
                            break
                    took = time.monotonic() - t0
                if k >= warmup:
                    times.append(took)
        return times

    return float(np.median(asyncio.run(run()))) * 1000


def _arrivals(n_adapters: int, rate_rps: float, duration_s: float, seed: int):
    from lorapack.testbed.replay import Arrival

    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, n_adapters + 1)  # Zipf: a few hot adapters, a long tail
    weights /= weights.sum()
    n = int(rng.poisson(rate_rps * duration_s))
    t = np.sort(rng.uniform(0.0, duration_s, n))
    ad = rng.choice(n_adapters, size=n, p=weights)
    prompt = np.clip(rng.lognormal(np.log(223) - 0.3, 0.77, n), 4, 3000).astype(int)
    output = np.clip(rng.lognormal(np.log(197) - 0.3, 0.77, n), 2, 1500).astype(int)
    return [Arrival(float(t[k]), f"a{ad[k]:02d}", int(prompt[k]), int(output[k])) for k in range(n)]


def _starved(profile, ranks, arrivals, t_sent, t_first, t_finish, duration_s, flags) -> list[str]:
    """The twin's starvation rule applied to the given per-request times."""
    from lorapack.twin.metrics import compute_metrics
    from lorapack.twin.run import engine_config, resolve_server
    from lorapack.twin.types import EngineResult, RequestArrays

    ids = sorted({a.adapter_id for a in arrivals} | {f"a{k:02d}" for k in range(len(ranks))})
    index = {a: i for i, a in enumerate(ids)}
    order = np.lexsort((np.arange(len(t_sent)), t_sent))
    req = RequestArrays(np.maximum(t_sent[order], 0), np.array([index[arrivals[i].adapter_id] for i in order]),
                        np.array([arrivals[i].prompt_tokens for i in order]),
                        np.array([arrivals[i].output_tokens for i in order]))
    res = EngineResult(t_sent_s=t_sent[order], t_first_s=t_first[order], t_finish_s=t_finish[order],
                       n_preempted=np.zeros(len(order), np.int32))
    srv = resolve_server(profile, np.asarray(ranks), flags)
    cfg = engine_config(profile, np.asarray(ranks), srv, duration_s, warm_start=False)
    m = compute_metrics(res, req, duration_s, len(ranks), cfg=cfg)
    return sorted(ids[i] for i in m.starved_adapter_indices)


def run_design(name: str, n_adapters: int, rate: float, max_loras: int, max_cpu_loras: int, duration_s: float,
               seed: int, http_path_ms: float | None = None) -> dict:
    from lorapack.profile import find_profile
    from lorapack.server import ServerConfig
    from lorapack.testbed.replay import ReplayOptions, replay, twin_replay

    profile = find_profile(MODEL, "h100-64gb")
    adapters = [f"a{k:02d}" for k in range(n_adapters)]
    ranks = [16 if k % 2 else 8 for k in range(n_adapters)]
    arrivals = _arrivals(n_adapters, rate, duration_s, seed)
    flags = ServerConfig(max_loras=max_loras, max_lora_rank=16, max_cpu_loras=max_cpu_loras, warm_start=False)
    import httpx

    with server(adapters, ranks, max_loras, max_cpu_loras, http_path_ms) as url:
        got = replay(url, arrivals, ReplayOptions(model=MODEL, seed=seed, window_s=duration_s, scrape_every_s=1.0))
        served_path_ms = httpx.get(url + "/version", timeout=30).json()["http_path_ms"]
    recs = got.records
    # Three clocks for "the same arrivals" (docs/serve.md, "Measured"): when the server's engine got each request
    # (the twin server's x-lorapack-arrival-monotonic header; the scores), when its body left the client
    # (t_wire_s) and when the client's send call began (t_sent_s). A step-based server's steps run in a chain
    # anchored where its engine last went idle, so a twin fed the client's times runs its steps at another phase
    # than the server's, by however late the anchoring request reached the server: every TTFT of that busy period
    # moves by it (0-5 ms here, from run to run). Fed the server's arrivals, the twin runs the server's steps and
    # the score is what the server adds: handing the tokens out and the way to the client.
    call = np.array([r.t_sent_s for r in recs])
    wire = np.array([r.t_wire_s if np.isfinite(r.t_wire_s) else r.t_sent_s for r in recs])
    engine_in = np.array([r.t_server_arrival_s for r in recs])
    sent = np.where(np.isfinite(engine_in), engine_in, wire)
    overhead_s = profile.frontend.ttft_overhead_ms / 1000.0 if profile.frontend is not None else 0.0
    first = np.array([r.t_first_s for r in recs])

    def ttft_errors(basis: np.ndarray):
        """(client TTFT, twin TTFT, the twin's result) with the arrivals at ``basis``."""
        _m, res = twin_replay(profile, adapters, ranks, arrivals, flags, duration_s, sent_s=basis)
        return first - basis, res.t_first_s - res.t_sent_s + overhead_s, res

    client_ttft, twin_ttft, res = ttft_errors(sent)
    others = {}
    for label, basis in (("from_wire", wire), ("from_send_call", call)):
        c, t, _ = ttft_errors(basis)
        ok = np.isfinite(c) & np.isfinite(t)
        others[f"ttft_{label}_median_rel_err"] = float(np.median(np.abs(c[ok] - t[ok]) / t[ok])) if ok.any() else None
        others[f"ttft_{label}_median_signed_err_ms"] = float(np.median(c[ok] - t[ok])) * 1000 if ok.any() else None
    client_itl = np.array([np.mean(r.gaps_s) if len(r.gaps_s) else np.nan for r in recs])
    n_out = np.array([a.output_tokens for a in arrivals])
    twin_itl = np.where(n_out > 1, (res.t_finish_s - res.t_first_s) / np.maximum(n_out - 1, 1), np.nan)
    done = np.isfinite(client_ttft) & np.isfinite(twin_ttft)
    ttft_err = np.abs(client_ttft[done] - twin_ttft[done]) / twin_ttft[done]
    both_itl = np.isfinite(client_itl) & np.isfinite(twin_itl) & (n_out > 1)
    both_itl &= np.array([np.isfinite(r.t_finish_s) and r.completion_tokens == r.output_tokens for r in recs])
    itl_err = np.abs(client_itl[both_itl] - twin_itl[both_itl]) / twin_itl[both_itl]
    client_finish = np.array([r.t_finish_s if r.completion_tokens == r.output_tokens else np.nan for r in recs])
    client_first = np.where(np.isfinite(client_ttft), client_ttft + sent, np.nan) - overhead_s
    starved_client = _starved(profile, ranks, arrivals, sent, client_first, client_finish - overhead_s, duration_s,
                              flags)
    starved_twin = _starved(profile, ranks, arrivals, sent, res.t_first_s, res.t_finish_s, duration_s, flags)
    # /metrics against the twin's timeline (2 s samples; the state at a time is the last sample before it)
    tl = res.timeline
    diffs_run, diffs_wait = [], []
    for s in got.samples:
        k = int(np.searchsorted(tl["t_s"], s.t_s, side="right")) - 1
        if 0 <= k < len(tl["t_s"]) and s.t_s < duration_s:
            diffs_run.append(abs(s.running - tl["num_requests_running"][k]))
            diffs_wait.append(abs(s.waiting - tl["num_requests_waiting"][k]))
    out = {
        "design": name, "http_path": "client-measured" if http_path_ms is not None else "server-probe",
        "http_path_ms": served_path_ms, "adapters": n_adapters, "rate_rps": rate, "max_loras": max_loras,
        "max_cpu_loras": max_cpu_loras, "duration_s": duration_s, "requests": len(recs),
        "errors": sum(bool(r.error) for r in recs),
        "ttft_median_rel_err": float(np.median(ttft_err)) if len(ttft_err) else None,
        "ttft_p90_rel_err": float(np.percentile(ttft_err, 90)) if len(ttft_err) else None,
        "ttft_median_abs_err_ms": float(np.median(np.abs(client_ttft[done] - twin_ttft[done]))) * 1000,
        "ttft_median_signed_err_ms": float(np.median(client_ttft[done] - twin_ttft[done])) * 1000,
        "ttft_twin_median_ms": float(np.median(twin_ttft[done])) * 1000,
        **others,
        "client_send_path_median_ms": float(np.nanmedian(wire - call)) * 1000,
        "to_the_engine_median_ms": float(np.nanmedian(engine_in - wire)) * 1000,
        "server_arrivals": bool(np.isfinite(engine_in).all()),
        # where the error sits: a shift of every request, or a few requests a whole step late
        "ttft_signed_err_ms_p10_p25_p75_p90": [float(x) * 1000 for x in
                                               np.percentile(client_ttft[done] - twin_ttft[done], [10, 25, 75, 90])],
        "itl_median_rel_err": float(np.median(itl_err)) if len(itl_err) else None,
        "itl_p90_rel_err": float(np.percentile(itl_err, 90)) if len(itl_err) else None,
        "n_ttft": int(done.sum()), "n_itl": int(both_itl.sum()),
        "starved_client": starved_client, "starved_twin": starved_twin,
        "same_starved": starved_client == starved_twin,
        "metrics_running_mean_abs_diff": float(np.mean(diffs_run)) if diffs_run else None,
        "metrics_waiting_mean_abs_diff": float(np.mean(diffs_wait)) if diffs_wait else None,
        "metrics_running_mean": float(np.mean([x.running for x in got.samples if x.t_s < duration_s])),
        "metrics_waiting_mean": float(np.mean([x.waiting for x in got.samples if x.t_s < duration_s])),
        "twin_running_mean": float(np.mean(tl["num_requests_running"])),
        "twin_waiting_mean": float(np.mean(tl["num_requests_waiting"])),
        "n_scrapes": len(diffs_run),
    }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration-s", type=float, default=120.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--designs", default=",".join(d[0] for d in DESIGNS))
    ap.add_argument("--out", type=Path, default=HERE / "results" / "serve_fidelity.json")
    ap.add_argument("--http-path", default="both", choices=["server-probe", "client-measured", "both"],
                    help="server-probe: the server measures its own HTTP path (the default of lorapack serve); "
                    "client-measured: this client's path to /lorapack/probe, given as --http-path-ms")
    a = ap.parse_args()
    client_ms = None
    if a.http_path != "server-probe":
        with server(["a00"], [8], 1, 1) as url:
            client_ms = client_http_path_ms(url)
        print(f"this client's HTTP path (aiohttp, median of 60 probes): {client_ms:.2f} ms", flush=True)
    variants = {"server-probe": [None], "client-measured": [client_ms], "both": [None, client_ms]}[a.http_path]
    results = []
    for (name, n, rate, slots, cpu), path_ms in ((d, v) for d in DESIGNS for v in variants):
        if name not in a.designs.split(","):
            continue
        r = run_design(name, n, rate, slots, cpu, a.duration_s, a.seed, path_ms)
        results.append(r)
        print(f"{name} [{r['http_path']} {r['http_path_ms']:.2f} ms]: {r['requests']} requests ({r['errors']} errors); TTFT median rel. error "
              f"{100 * r['ttft_median_rel_err']:.2f} % (p90 {100 * r['ttft_p90_rel_err']:.1f} %, median abs "
              f"{r['ttft_median_abs_err_ms']:.1f} ms, signed {r['ttft_median_signed_err_ms']:+.1f} ms, twin median "
              f"{r['ttft_twin_median_ms']:.0f} ms), ITL median rel. error {100 * r['itl_median_rel_err']:.2f} % "
              f"(p90 {100 * r['itl_p90_rel_err']:.1f} %); starved: client {r['starved_client']} twin "
              f"{r['starved_twin']} ({'same' if r['same_starved'] else 'DIFFERENT'}); /metrics vs timeline: "
              f"running {r['metrics_running_mean_abs_diff']:.2f}, waiting {r['metrics_waiting_mean_abs_diff']:.2f} "
              f"mean abs diff; time means scraped {r['metrics_running_mean']:.1f} / {r['metrics_waiting_mean']:.1f}, twin "
              f"{r['twin_running_mean']:.1f} / {r['twin_waiting_mean']:.1f}", flush=True)
    out = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "load_avg": os.getloadavg()[0]},
           "client_http_path_ms": client_ms, "designs": results}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
