"""Fit the shipped profiles from a profiling data directory (twin.md §3.5 step 1, §3.6).

Usage: python scripts/fit_profiles.py [--data-dir DIR] [--out-dir DIR] [--model KEY ...]

The data directory defaults to $LORAPACK_DATA, else ../shared/data next to the repository. Output files are
``<gpu>__vllm-<version>__<model>.yaml``; re-running on the same data only changes ``provenance.date``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lorapack.calibrate import default_data_dir, fit_priors
from lorapack.errors import LorapackError
from lorapack.profile import PROFILE_DIR, save_profile

MODELS = ("llama-3.1-8b-instruct", "qwen-2.5-7b-instruct")
GPU = "h100-64gb"
VLLM_VERSION = "0.8.5"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", type=Path, default=None, help="profiling data directory (default: %(default)s)")
    ap.add_argument("--out-dir", type=Path, default=PROFILE_DIR, help="where to write the profile YAML files")
    ap.add_argument("--model", action="append", choices=MODELS, help="fit only this model (repeatable)")
    args = ap.parse_args(argv)
    data_dir = args.data_dir or default_data_dir()
    try:
        for model in args.model or MODELS:
            prof = fit_priors(data_dir, model, gpu=GPU, vllm_version=VLLM_VERSION)
            out = args.out_dir / f"{GPU}__vllm-{VLLM_VERSION}__{model}.yaml"
            save_profile(prof, out)
            st, mem = prof.steptime, prof.memory
            print(f"{out}: T0={mem.kv_tokens_base:.0f} k={mem.kv_tokens_per_slot_rank:.3f} "
                  f"c={mem.kv_tokens_per_slot:.2f} c0={st.c0_ms:.5f} c1={st.c1_ms_per_req:.7f} "
                  f"p1={st.p1_ms_per_prefill_token:.5f} e=({st.e0_ms:.3f}, {st.e1_ms_per_token:.4f}, "
                  f"{st.e2_ms_per_adapter:.3f}) k=({st.k0_pct:.2f}, {st.k1_pct_per_adapter:.4f})")
    except LorapackError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
