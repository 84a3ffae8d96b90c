"""Synthetic sweep directories for the surrogate tests: real features (``oracle.features``), smooth made-up
labels, so training is fast and the expected behaviour is known."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from lorapack.oracle import GpuCandidate, feature_row
from lorapack.profile import find_profile
from lorapack.server import ServerConfig
from lorapack.sweep.store import META_FILE, PartWriter

LLAMA = find_profile("llama-3.1-8b-instruct")


def synthetic_rows(n_series: int = 60, seed: int = 0, fingerprint: str = "f" * 16, profile=LLAMA) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = []
    for s in range(n_series):
        rate = float(np.exp(rng.uniform(np.log(0.005), np.log(1.0))))
        ranks = [8, 16, 32][s % 3]
        a = int(rng.choice([8, 16, 32]))
        for n in (8, 16, 32, 64, 96, 128):
            if a > n:
                continue
            cand = GpuCandidate(profile=profile, ranks=np.full(n, ranks), rates_rps=np.full(n, rate) *
                                rng.uniform(0.5, 1.5, n), server=ServerConfig(max_loras=a))
            row = {**feature_row(cand), "config_id": f"c{s}-{n}", "series_id": f"s{s}", "seed": 0,
                   "model": profile.model, "gpu": profile.gpu, "lengths_kind": "lognormal", "duration_s": 3600.0}
            inc = row["incoming_expected_tok_s"]
            cap = 9000.0 - 20.0 * n / a * 8 - 30 * ranks
            ratio = min(1.0, cap / inc) * (1 + rng.normal(0, 0.003))
            row.update({
                "oom": False, "starved": bool(ratio < 0.9), "adapter_starved": bool(ratio < 0.9),
                "throughput_tok_s": ratio * inc, "incoming_tok_s": inc, "throughput_ratio": ratio,
                "itl_mean_ms": 15.0 + inc / 500.0 + n / 20.0, "ttft_mean_ms": 40.0 + (1.0 - min(ratio, 1.0)) * 5e4,
                "obtained": ["full", "early_healthy_converged", "early_certain_starved"][(s + n) % 3],
                "adapter_labels_exact": True, "twin_fingerprint": fingerprint, "profile_hash": profile.file_hash(),
                "twin_version": "test", "wall_s": 0.0})
            for k in ("served_adapters", "adapter_slots", "max_size", "max_lora_rank"):
                row[k] = int(row[k])
            rows.append(row)
    return rows


def write_sweep(out: Path, rows: list[dict]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    PartWriter(out).write(rows)
    (out / META_FILE).write_text(json.dumps({"format": 3, "synthetic": True}))
    return out
