"""Step duration of one engine step, from the profile's estimators (docs/calibration.md, the step-time model).

``StepModel`` holds the constants for one server (model x GPU x A x S x N_cpu); ``to_array`` packs them
into a flat float64 vector that the compiled engine reads by index. ``step_ms`` is written in the numba
subset so both engines use the very same arithmetic (it is the estimator, not the scheduler).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# indices into the packed coefficient vector (later additions are appended: older indices are unchanged)
C0, C1, P1, A3, LORA_FORM, E0, E1, E2, E3, RANK_SCALE, K0, K1, SB, S0, SW, SWA, SBASE, E1P, RANK_SCALE_TOKEN, \
    SHRINK_GRID = range(20)
N_COEF = 20

# vLLM 0.8.5 V1's LoRA shrink kernel (default config): blocks of 32 tokens, split-K 64 below 128 tokens and 8
# from 128 on, blocks of 16 rank columns, one grid layer per GPU slot (max_loras + 1); an idle slot's blocks
# exit at once but are still launched
SHRINK_BLOCK_M = 32
SHRINK_SPLIT_K_SMALL, SHRINK_SPLIT_K_LARGE, SHRINK_LARGE_FROM = 64, 8, 128
SHRINK_BLOCK_N = 16

LORA_NONE, LORA_ADDITIVE, LORA_MULTIPLICATIVE = 0.0, 1.0, 2.0


@dataclass(frozen=True)
class StepModel:
    """Constants of ``base + LoRA + scheduler`` for one server configuration (all times in ms)."""

    c0_ms: float
    c1_ms_per_req: float
    p1_ms_per_prefill_token: float = 0.0
    a3_ms_per_kctx: float = 0.0
    lora_form: str = "additive"  # "additive" | "multiplicative" | "none"
    e0_ms: float = 0.0
    e1_ms_per_token: float = 0.0  # LoRA cost per decode token
    e2_ms_per_adapter: float = 0.0
    e3_ms_per_kreq_adapter: float = 0.0  # B x L interaction, per 1000 request-adapters
    rank_scale: float = 1.0  # (S/8)**gamma_adapter: multiplies the per-adapter terms e2, e3
    rank_scale_token: float | None = None  # (S/8)**gamma_token: multiplies e1, e1p; None = rank_scale
    k0_pct: float = 100.0
    k1_pct_per_adapter: float = 0.0
    sched_ms_per_running: float = 0.0
    sched_const_ms: float = 0.0
    sched_ms_per_waiting: float = 0.0
    sched_ms_per_waiting_slot_ratio: float = 0.0  # already multiplied by A / N_cpu
    sched_baseline_ms: float = 0.0
    e1p_ms_per_prefill_token: float | None = None  # LoRA cost per prefill token; None = e1_ms_per_token
    shrink_grid_ms_per_kblock: float = 0.0  # e5 x (A + 1) x ceil(S / 16): per 1000 shrink blocks of one slot

    def to_array(self) -> np.ndarray:
        form = {"none": LORA_NONE, "additive": LORA_ADDITIVE, "multiplicative": LORA_MULTIPLICATIVE}
        if self.lora_form not in form:
            raise ValueError(f"unknown lora_form {self.lora_form!r}")
        coef = np.zeros(N_COEF, dtype=np.float64)
        coef[C0], coef[C1], coef[P1], coef[A3] = (
            self.c0_ms, self.c1_ms_per_req, self.p1_ms_per_prefill_token, self.a3_ms_per_kctx)
        coef[LORA_FORM] = form[self.lora_form]
        coef[E0], coef[E1], coef[E2], coef[E3] = (
            self.e0_ms, self.e1_ms_per_token, self.e2_ms_per_adapter, self.e3_ms_per_kreq_adapter)
        coef[RANK_SCALE], coef[K0], coef[K1] = self.rank_scale, self.k0_pct, self.k1_pct_per_adapter
        coef[SB], coef[S0], coef[SW], coef[SWA], coef[SBASE] = (
            self.sched_ms_per_running, self.sched_const_ms, self.sched_ms_per_waiting,
            self.sched_ms_per_waiting_slot_ratio, self.sched_baseline_ms)
        coef[E1P] = self.e1_ms_per_token if self.e1p_ms_per_prefill_token is None else self.e1p_ms_per_prefill_token
        coef[RANK_SCALE_TOKEN] = self.rank_scale if self.rank_scale_token is None else self.rank_scale_token
        coef[SHRINK_GRID] = self.shrink_grid_ms_per_kblock
        return coef



def compute_ms(coef: np.ndarray, n_sched: int, n_prefill_tokens: int, n_tokens: int,
               ctx_tokens: float, n_lora: int) -> float:
    """GPU time of the forward pass: ``base`` plus the LoRA part when the batch uses adapters.

    additive LoRA part: ``e0 + rank_scale_token * (e1*B_dec + e1p*n_pf) + rank_scale * (e2*L + e3*B*L/1000)
    + shrink_grid * blocks / 1000`` with ``blocks = split_k * ceil(n_tokens / 32)`` (split-K 64 below 128 tokens,
    8 from 128 on: the shrink grid of one slot and one block of 16 rank columns), with ``B_dec = n_tokens - n_prefill_tokens`` (decode
    tokens), ``n_pf`` prefill tokens, ``L`` distinct adapters. The two rank factors differ because the
    shrink/expand kernels' work per token is dominated by the activations (hardly depends on the slot rank S),
    while per adapter they read its weights (grow with S). The last term is the shrink kernel's launch grid,
    one layer per slot whether busy or not: large for small batches (split-K 64), with A and with S.
    """
    base = (coef[C0] + coef[C1] * n_sched + coef[P1] * n_prefill_tokens
            + coef[A3] * ctx_tokens / 1000.0)
    if n_lora <= 0 or coef[LORA_FORM] == LORA_NONE:
        return base
    if coef[LORA_FORM] == LORA_MULTIPLICATIVE:
        return base * (coef[K1] * n_lora + coef[K0]) / 100.0
    split_k = SHRINK_SPLIT_K_SMALL if n_tokens < SHRINK_LARGE_FROM else SHRINK_SPLIT_K_LARGE
    blocks = split_k * ((n_tokens + SHRINK_BLOCK_M - 1) // SHRINK_BLOCK_M)
    return base + coef[E0] + coef[RANK_SCALE_TOKEN] * (
        coef[E1] * (n_tokens - n_prefill_tokens) + coef[E1P] * n_prefill_tokens) + coef[RANK_SCALE] * (
        coef[E2] * n_lora + coef[E3] * n_sched * n_lora / 1000.0) + (
        coef[SHRINK_GRID] * blocks / 1000.0)


def sched_ms(coef: np.ndarray, n_running: int, n_waiting: int) -> float:
    """CPU scheduler time of a step (paper form); charged in every non-idle step."""
    v = (coef[SB] * n_running + coef[S0] + n_waiting * (coef[SW] - coef[SWA]) - coef[SBASE])
    return v if v > 0.0 else 0.0


# ---- per-step variability (docs/engine-semantics.md, "Step noise") -----------------------------------------
NOISE_BITS = 12  # the noise law as a table of 2**NOISE_BITS equiprobable quantiles
NOISE_MULT = 0x9E3779B97F4A7C15  # splitmix64's increment: consecutive steps draw far-apart counters


def capacity_bound_tok_s(step_coef: np.ndarray) -> float:
    """Upper bound on completed tokens per second: each token needs >= min(p1, c1) ms of step time."""
    per_token_ms = min(step_coef[P1], step_coef[C1])
    return 1000.0 / per_token_ms if per_token_ms > 0 else float("inf")


def noise_table(sigma: float) -> np.ndarray:
    """The step-time multiplier's law: mean-one log-normal with log-sd ``sigma``, as 2**NOISE_BITS quantiles at
    the midpoints of equal-probability cells (then divided by their mean, so that the mean is exactly 1: the
    noise moves the tails, not the throughput). Empty for ``sigma == 0`` (no noise, no multiply)."""
    from statistics import NormalDist

    if not sigma > 0.0:
        return np.zeros(0)
    n = 2**NOISE_BITS
    z = np.array([NormalDist().inv_cdf((i + 0.5) / n) for i in range(n)])
    m = np.exp(sigma * z)
    return m / m.mean()


def noise_index(key: int, step: int) -> int:
    """The table cell of step ``step`` (a counter-based draw: splitmix64 of ``key + step * NOISE_MULT``, top
    bits). A pure function of (key, step): a paused, resumed or live engine draws what a batch run draws."""
    mask = (1 << 64) - 1
    z = (key + step * NOISE_MULT) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    z ^= z >> 31
    return z >> (64 - NOISE_BITS)
