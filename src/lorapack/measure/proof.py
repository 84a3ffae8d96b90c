"""``measure`` -> ``calibrate`` -> predict, proven on the testbed (vLLM's CPU build, ``lorapack.testbed``;
``bench/testbed_fidelity.py``, the ``real`` smoke test): one testbed server, its measurement, and held-back runs the fit never saw, replayed on the server and
predicted by the twin with the same arrivals.

The server: 16 adapters (ranks 8, 16, 32: the testbed's weights under several names), ``--max-loras 4``,
``--max-cpu-loras 12`` (so adapters are also evicted from the CPU cache), ``--max-num-seqs 32``, a token budget
of 256. Held-back runs use other seeds and other designs than ``measure``'s own runs: 2 to 16 adapters
(above and below the 4 slots), Zipf-like rates over the adapters (so adapters differ in their TTFT), loads from
light to starving.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from .runs import RunAdapter, RunSpec, per_adapter_ttft, run_once, run_row

MAX_LORAS, MAX_LORA_RANK, MAX_CPU_LORAS = 4, 32, 12
SERVER_FLAGS = ("--max-loras", str(MAX_LORAS), "--max-lora-rank", str(MAX_LORA_RANK), "--max-cpu-loras",
                str(MAX_CPU_LORAS), "--max-num-seqs", "32", "--max-num-batched-tokens", "256")
RANKS = (8, 16, 32)
N_SERVED = 16
HELD_BACK_SEED = 1000  # measure's runs use seeds from 0


def adapter_names() -> list[tuple[str, int, str]]:
    """(served name, rank, testbed weights) of the 16 adapters, ranks interleaved."""
    out = []
    for i in range(N_SERVED):
        r = RANKS[i % len(RANKS)]
        out.append((f"a{i:02d}-r{r}", r, f"r{r}-{(i // len(RANKS)) % 3}"))
    return out


def server_adapters() -> list[str]:
    return [f"{name}={base}" for name, _, base in adapter_names()]


def write_adapters_csv(path: Path) -> Path:
    path.write_text("adapter_id,rank\n" + "".join(f"{n},{r}\n" for n, r, _ in adapter_names()))
    return path


# (adapters, load as a fraction of the measured capacity): 21 designs, above and below the 4 slots
HELD_BACK = ((2, 0.3), (2, 0.9), (2, 1.6), (3, 0.5), (3, 1.2), (4, 0.2), (4, 0.7), (4, 1.0), (4, 1.4),
             (6, 0.4), (6, 0.8), (6, 1.3), (8, 0.3), (8, 0.6), (8, 1.1), (8, 1.8), (12, 0.5), (12, 0.9),
             (12, 1.5), (16, 0.4), (16, 1.0))


def held_back_runs(capacity_rps, designs: Sequence[tuple[int, float]] = HELD_BACK, window_s: float = 30.0,
                   max_rate_rps: float = 50.0) -> list[RunSpec]:
    """The runs: ``capacity_rps(n_adapters)`` scales the load; adapter k of a run gets a rate ∝ 1/(k+1)."""
    names = adapter_names()
    out = []
    for k, (n, load) in enumerate(designs):
        # the run's adapters: every rank, spread over the served list (not the first n: other adapters than
        # measure's runs)
        idx = [(3 * j + k) % N_SERVED for j in range(n)]
        idx = list(dict.fromkeys(idx))
        j = 0
        while len(idx) < n:
            if j not in idx:
                idx.append(j)
            j += 1
        total = min(max_rate_rps, load * capacity_rps(n))
        weights = np.array([1.0 / (i + 1) for i in range(n)])
        rates = total * weights / weights.sum()
        ads = [RunAdapter(names[i][0], names[i][1], float(rates[j])) for j, i in enumerate(idx)]
        out.append(RunSpec(f"heldback__tiny__load_{load:g}___{MAX_LORAS}_{n}_{MAX_LORA_RANK}_{k}", ads,
                               window_s, HELD_BACK_SEED + k))
    return out


def replay_run(url: str, model: str, run: RunSpec, identity, idle_service_s, repeat: int = 0) -> dict:
    """Replay one held-back run on the server: its runs-schema row plus the per-adapter TTFTs and arrivals."""
    arrivals, res = run_once(url, model, run)
    row = run_row(run, "tiny", identity, arrivals, res, idle_service_s=idle_service_s)
    return {"row": row, "adapter_ttft_ms": per_adapter_ttft(res, run.window_s), "arrivals": arrivals,
            "repeat": repeat}


def paced_idle_service(idle_service_s, pace: float):
    """``idle_service_s(prompt, output)`` (an idle server's time for one request alone, s) at ``pace`` times the
    measured step times: what a held-back run's server "starved" label is judged against, as the twin's is at
    ``predict_run(..., time_scale=pace)`` (under load a server is slower than when it was measured; judged
    against the measured idle server, a light run read ratio 0.60 on 2026-11-29)."""
    return lambda prompt, output: pace * idle_service_s(prompt, output)


# A base-model decode point of measure's ladder (concurrency, prompt tokens, output tokens): the pace probe
PACE_PROBE = (8, 16, 128)


def server_pace(ctx, mdir: Path, probe_ms: float | None = None) -> float:
    """How many times longer the server's steps are now than when ``mdir`` was measured: the pace probe (base
    model, ``PACE_PROBE``, two requests per worker) against the measurement's decode fit at that point.
    ``probe_ms``: a probe already taken (``pace_probe_ms``), to set one probe against several measurements.

    A GPU keeps its pace; a shared CPU does not: on 2026-11-29 the same testbed server, minutes apart, ran the
    same held-back run at 595 and at 818-844 tok/s (docs/testbed.md). ``predict_run(..., time_scale=pace)`` then
    compares the profile's shape, not the machine's drift since it was measured."""
    from .fit import decode_itl_ms, fit_decode, read_rows

    c0, c1, a3, _ = fit_decode(read_rows(Path(mdir), "decode.csv"))
    b, prompt, output = PACE_PROBE
    then_ms = decode_itl_ms(c0, c1, a3, min(b, ctx.concurrency_cap()), prompt + output / 2.0)
    return (pace_probe_ms(ctx) if probe_ms is None else probe_ms) / then_ms


def pace_probe_ms(ctx) -> float:
    """The pace probe's ITL (ms) on the server now (see ``server_pace``)."""
    from .experiments import base_itl_ms

    b, prompt, output = PACE_PROBE
    return base_itl_ms(ctx, min(b, ctx.concurrency_cap()), 2, prompt, output)


def predict_run(profile, run: RunSpec, arrivals, identity, time_scale: float = 1.0) -> dict:
    """The twin on the run's own arrivals (planned times): its metrics and per-adapter mean TTFTs.
    ``time_scale``: every duration of the twin stretched by it (``server_pace``; ``testbed.replay.twin_replay``),
    the figures returned in the server's time."""
    from ..server import ServerConfig
    from ..testbed.replay import twin_replay

    ids = [name for name, _, _ in adapter_names()]  # the server's registration order
    ranks = [rank for _, rank, _ in adapter_names()]
    flags = ServerConfig(max_loras=identity.max_loras, max_lora_rank=identity.max_lora_rank,
                         max_cpu_loras=identity.max_cpu_loras, max_num_seqs=identity.max_num_seqs,
                         max_num_batched_tokens=identity.max_num_batched_tokens, client_cap=0)
    metrics, res = twin_replay(profile, ids, ranks, arrivals, flags, run.window_s, time_scale=time_scale)
    by: dict[str, list[float]] = {}
    if res is not None:
        for a, tf, tfin, ts in zip(arrivals, res.t_first_s, res.t_finish_s, res.t_sent_s, strict=True):
            if np.isfinite(tfin) and tfin <= run.window_s:
                by.setdefault(a.adapter_id, []).append(1000.0 * (tf - ts))
    scale = time_scale  # the metrics are in the twin's (stretched) time; res's times are the server's already
    front = (profile.frontend.ttft_overhead_ms if profile.frontend is not None else 0.0) * scale
    return {"throughput_tok_s": metrics.throughput_tok_s / scale, "ttft_mean_ms": metrics.ttft_mean_ms * scale,
            "starved": bool(metrics.starved), "throughput_ratio": metrics.throughput_ratio,
            "finishable_tok_s": metrics.finishable_tok_s / scale, "itl_mean_ms": metrics.itl_mean_ms * scale,
            "adapter_ttft_ms": {a: float(np.mean(v)) + front for a, v in by.items()}}


def spearman(a: dict[str, float], b: dict[str, float]) -> float:
    from scipy.stats import spearmanr

    keys = sorted(set(a) & set(b))
    if len(keys) < 3:
        return math.nan
    rho = spearmanr([a[k] for k in keys], [b[k] for k in keys]).statistic
    return float(rho)
