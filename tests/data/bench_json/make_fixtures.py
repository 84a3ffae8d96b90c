"""Writes the ``vllm bench serve`` / ``benchmark_serving.py`` result files of this directory (see README.md).

Synthetic requests (seeded), turned into result objects with the keys, key order, value types and
statistics of each writer (the statistics as its ``calculate_metrics`` computes them: numpy mean / median /
std / 99th percentile, in ms) and written as the writers write them: ``json.dump(result_json, f)`` (one
line; a float ``inf`` becomes ``Infinity``), ``--append-result`` adding a newline and the next object.

Run from the repository root: ``.venv/bin/python tests/data/bench_json/make_fixtures.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
LLAMA, QWEN = "meta-llama/Llama-3.1-8B-Instruct", "Qwen/Qwen2.5-7B-Instruct"


def requests(n: int, rate: float, seed: int, out_range: tuple[int, int], failed: tuple[int, ...] = ()) -> dict:
    """Per-request outcomes of ``n`` requests sent as a Poisson process at ``rate`` (what the client records)."""
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1 / rate, n)
    send = np.cumsum(gaps) - gaps[0]
    send *= (n / rate) / send[-1] if send[-1] > 0 else 1.0  # the newest client rescales its gaps to n / rate
    t0 = 80412.3315  # time.perf_counter() at the first request
    out = {k: [] for k in ("input_lens", "output_lens", "ttfts", "itls", "latencies", "start_times",
                           "queue_times", "generated_texts", "errors", "ok")}
    for i in range(n):
        p = int(rng.integers(40, 420))
        o = int(rng.integers(*out_range))
        ok = i not in failed
        ttft = float(rng.uniform(0.028, 0.061)) if ok else 0.0
        itl = [float(g) for g in rng.normal(0.0125, 0.0015, o - 1).clip(0.008)] if ok else []
        out["input_lens"].append(p)
        out["output_lens"].append(o if ok else 0)
        out["ttfts"].append(ttft)
        out["itls"].append(itl)
        out["latencies"].append(ttft + sum(itl) if ok else 0.0)
        out["start_times"].append(t0 + float(send[i]))
        out["queue_times"].append(float(rng.uniform(1e-5, 4e-5)))
        out["generated_texts"].append(" lorem" * o if ok else "")
        out["errors"].append("" if ok else "Bad Request")
        out["ok"].append(ok)
    out["duration"] = max(s + lat for s, lat in zip(out["start_times"], out["latencies"], strict=True)) - t0 + 0.0042
    return out


def metrics(r: dict, failed_key: bool, goodput_key: str, newest: bool) -> dict:
    """The benchmark's result dict (before the per-request lists are dropped), in the writer's key order."""
    ok = r["ok"]
    ins = [p for p, k in zip(r["input_lens"], ok, strict=True) if k]
    outs = [o for o, k in zip(r["output_lens"], ok, strict=True) if k]
    ttfts = [t for t, k in zip(r["ttfts"], ok, strict=True) if k]
    itls = [g for req, k in zip(r["itls"], ok, strict=True) if k for g in req]
    tpots = [(lat - t) / (o - 1) for lat, t, o, k in zip(r["latencies"], r["ttfts"], r["output_lens"], ok,
                                                          strict=True) if k and o > 1]
    dur = r["duration"]
    res: dict = {"duration": dur, "completed": len(ins)}
    if failed_key:
        res["failed"] = len(ok) - len(ins)
    res.update({"total_input_tokens": sum(ins), "total_output_tokens": sum(outs),
                "request_throughput": len(ins) / dur, goodput_key: None, "output_throughput": sum(outs) / dur,
                "total_token_throughput": (sum(ins) + sum(outs)) / dur,
                "input_lens": r["input_lens"], "output_lens": r["output_lens"], "ttfts": r["ttfts"],
                "itls": r["itls"]})
    if newest:
        res.update({"latencies": r["latencies"], "start_times": r["start_times"], "queue_times": r["queue_times"]})
    res.update({"generated_texts": r["generated_texts"], "errors": r["errors"]})
    if newest:
        res.update({"max_output_tokens_per_s": 512.0, "max_concurrent_requests": 5, "rtfx": 0.0})
    for name, xs in (("ttft", ttfts), ("tpot", tpots), ("itl", itls)):
        a = np.asarray(xs or [0.0])
        res[f"mean_{name}_ms"] = float(np.mean(a) * 1000)
        res[f"median_{name}_ms"] = float(np.median(a) * 1000)
        res[f"std_{name}_ms"] = float(np.std(a) * 1000)
        res[f"p99_{name}_ms"] = float(np.percentile(a, 99) * 1000)
    return res


def newest(r: dict, num_prompts: int, rate: float, metadata: dict, detailed: bool, model: str = LLAMA) -> dict:
    """``vllm bench serve --save-result`` (vllm/benchmarks/serve.py, vLLM >= 0.10, newest layout)."""
    head = {"date": "20250918-141207", "endpoint_type": "openai", "backend": "openai", "label": None,
            "model_id": model, "tokenizer_id": model, "num_prompts": num_prompts, **metadata,
            "request_rate": rate, "burstiness": 1.0, "max_concurrency": None}
    res = {**head, **metrics(r, True, "request_goodput", True)}
    if not detailed:  # latencies and queue_times stay
        for k in ("input_lens", "output_lens", "start_times", "ttfts", "itls", "generated_texts", "errors"):
            res.pop(k)
    return res


def old(r: dict, num_prompts: int, rate: float | str, metadata: dict, detailed: bool, model: str = LLAMA) -> dict:
    """``benchmarks/benchmark_serving.py --save-result`` (vLLM 0.7-0.9): ``"request_goodput:"``, no ``failed``."""
    head = {"date": "20250412-093321", "backend": "vllm", "model_id": model, "tokenizer_id": model,
            "num_prompts": num_prompts, **metadata, "request_rate": rate, "burstiness": 1.0,
            "max_concurrency": None}
    res = {**head, **metrics(r, False, "request_goodput:", False)}
    if not detailed:
        for k in ("input_lens", "output_lens", "ttfts", "itls", "generated_texts", "errors"):
            res.pop(k)
    return res


def write(name: str, *objs: dict) -> None:
    with (HERE / name).open("w", encoding="utf-8") as f:
        for k, obj in enumerate(objs):
            if k:
                f.write("\n")
            json.dump(obj, f)


def main() -> None:
    meta4 = {"max_loras": "4", "max_lora_rank": "16", "lora_ranks": "8:2 16:2", "vllm_version": "0.11.0"}
    write("vllm-bench-serve.json", newest(requests(60, 2.0, 1, (150, 240)), 60, 2.0, meta4, False))
    write("vllm-bench-serve-detailed.json",
          newest(requests(12, 1.0, 2, (16, 64), failed=(5,)), 12, 1.0, {}, True))
    write("vllm-bench-serve-appended.json",
          newest(requests(20, 1.0, 3, (150, 240)), 20, 1.0, meta4, False),
          newest(requests(40, 2.0, 4, (150, 240)), 40, 2.0, meta4, False))
    meta8 = {"max_loras": "8", "max_lora_rank": "16", "lora_ranks": "16:8"}
    write("benchmark-serving-0.8.json", old(requests(10, 0.5, 5, (20, 80)), 10, 0.5, meta8, True, QWEN))
    write("benchmark-serving-0.8-summary.json", old(requests(50, 2.5, 6, (150, 240)), 50, 2.5, meta8, False))
    write("benchmark-serving-0.8-unlimited.json", old(requests(50, 50.0, 7, (150, 240)), 50, "inf", meta8, False))


if __name__ == "__main__":
    main()
