"""Burst benchmark: one adapter, 8,192 prompts sent at once, as operators first try with ``vllm bench``.

Every request arrives at t = 0 for a single adapter (``--max-loras 1``), ``--max-num-seqs 2048`` and the
profile's token budget; lengths are the presets' log-normal law (means 223 prompt / 197 output tokens for
Llama, 223 / 200 for Qwen, the profile's fitted CV). The twin runs until the last request finishes; the
throughput is (input + output tokens) / that time, as the benchmark computes it for a fixed prompt count, and
ITL the token-weighted mean gap. Configurations: slot rank S (``--max-lora-rank``) 8, 16 and 32 with an
adapter of that rank, and no LoRA (the base model alone: the step-time model without its LoRA part, the KV
cache of the rank-8 single-slot server).

What it shows: how the twin's throughput falls with the slot rank at large batches. The per-token LoRA cost
of the shrink/expand kernels (activations) hardly depends on S there; only the per-adapter weight reads do,
so the drop from S = 8 to S = 32 should be small.

Usage: ``python bench/burst.py [--prompts 8192] [--out bench/results/burst.json]``
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import numpy as np

from lorapack.profile import find_profile
from lorapack.server import ServerConfig
from lorapack.spec import LengthsSpec
from lorapack.twin.engine import simulate_fast
from lorapack.twin.run import engine_config, resolve_server
from lorapack.twin.steptime import LORA_FORM, LORA_NONE
from lorapack.twin.types import RequestArrays
from lorapack.workload.lengths import sample_lengths

MODELS = {"llama-3.1-8b-instruct": (223.0, 197.0), "qwen-2.5-7b-instruct": (223.0, 200.0)}
HORIZON_S = 36_000.0  # long enough for every prompt to finish


def burst(model: str, slot_rank: int | None, prompts: int, seed: int = 0) -> dict:
    prof = find_profile(model)
    mi, mo = MODELS[model]
    cv = prof.runs_lengths.cv if prof.runs_lengths is not None else 1.1
    p, o = sample_lengths(LengthsSpec(kind="lognormal", mean_input_tokens=mi, mean_output_tokens=mo, cv=cv), prompts,
                          np.random.default_rng(seed))
    req = RequestArrays(np.zeros(prompts), np.zeros(prompts, np.int32), p.astype(np.int32), o.astype(np.int32))
    rank = 8 if slot_rank is None else slot_rank
    srv = resolve_server(prof, np.array([rank]), ServerConfig(max_loras=1, max_lora_rank=rank, max_num_seqs=2048))
    cfg = engine_config(prof, np.array([rank]), srv, HORIZON_S)
    if slot_rank is None:  # the base model: no LoRA part in the step time
        cfg.step_coef = cfg.step_coef.copy()
        cfg.step_coef[LORA_FORM] = LORA_NONE
    t0 = time.perf_counter()
    res = simulate_fast(cfg, req)
    wall = time.perf_counter() - t0
    if not np.isfinite(res.t_finish_s).all():
        raise RuntimeError(f"{model} S={slot_rank}: not every prompt finished within {HORIZON_S} s")
    end_s = float(res.t_finish_s.max())
    tokens = float(p.sum() + o.sum())
    gaps = o.astype(np.int64) - 1
    itl = float((res.t_finish_s - res.t_first_s).sum() / gaps.sum() * 1000.0)
    return {"model": model, "slot_rank": slot_rank, "lora": slot_rank is not None, "prompts": prompts,
            "duration_s": end_s, "throughput_tok_s": tokens / end_s, "output_tok_s": float(o.sum()) / end_s,
            "itl_mean_ms": itl, "ttft_mean_s": float(np.mean(res.t_first_s)), "n_preemptions": res.n_preemptions,
            "kv_cache_tokens": srv.kv_cache_tokens, "wall_s": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8192)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "burst.json")
    args = ap.parse_args()
    rows = []
    print(f"{'model':24} {'S':>5} {'tok/s':>9} {'vs S=8':>7} {'ITL ms':>7} {'preempt':>8}")
    for model in MODELS:
        base = None
        for s in (8, 16, 32, None):
            r = burst(model, s, args.prompts)
            rows.append(r)
            base = r["throughput_tok_s"] if s == 8 else base
            print(f"{model:24} {'none' if s is None else s:>5} {r['throughput_tok_s']:9.0f} "
                  f"{r['throughput_tok_s'] / base:7.3f} {r['itl_mean_ms']:7.1f} {r['n_preemptions']:8d}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "machine": platform.platform(),
                                    "prompts": args.prompts, "results": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
