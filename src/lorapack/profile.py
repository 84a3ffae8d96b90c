"""Profiles: fitted constants of one GPU x model x vLLM version, stored as YAML (docs/calibration.md).

Profiles are data produced by ``scripts/fit_profiles.py`` / ``lorapack calibrate`` — never hand-edited.
A shipped profile lives in ``lorapack/profiles/<gpu>__vllm-<version>__<model>.yaml``.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path
from typing import Literal

import numpy as np
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .errors import ProfileError

PROFILE_DIR = Path(__file__).parent / "profiles"
# --max-lora-rank values vLLM 0.8.5 accepts (other versions: ``lorapack.server.VllmRules.lora_ranks``)
VLLM_LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)


# Profile fields added after profiles were shipped, at the value every shipped profile was measured with: left
# out of ``Profile.file_hash`` and of the twin fingerprint (``fingerprint.NEUTRAL_PROFILE``) at that value
NEUTRAL_FIELDS = {"measured_gpu_memory_utilization": 0.9, "measured_prefix_caching": False, "device": None,
                  "tensor_parallel_size": 1, "api_server": None, "step_noise_sigma": 0.0}


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class KvPoint(_Frozen):
    max_loras: int
    max_lora_rank: int
    kv_tokens: int | None = None  # None when the server failed to start
    error_type: str | None = None  # e.g. kv_cache_insufficient, no_cache_blocks, cuda_oom


class MemoryModel(_Frozen):
    """``T_max(A, S) = kv_tokens_base - A * (kv_tokens_per_slot_rank * S + kv_tokens_per_slot)``."""

    kv_tokens_base: float  # T0, LoRA enabled, at the profile's max_num_seqs
    kv_tokens_per_slot_rank: float  # k
    kv_tokens_per_slot: float  # c
    kv_tokens_no_lora: float | None = None
    startup_margin: float = 0.02  # rule 1 margin when (A, S) was not measured
    measured: list[KvPoint] = Field(default_factory=list)  # start-up probes; used where (A, S) matches


class StepTimeModel(_Frozen):
    """Forward-pass time of one step (formula in ``twin.steptime.compute_ms``; docs/calibration.md).

    ``base = c0 + c1*B + p1*n_pf + a3*ctx/1000``; additive LoRA part, when the batch uses adapters:
    ``e0 + (S/8)**gamma_token * ((e1 + e4*A/1000)*B_dec + (e1p + e4*A/1000)*n_pf)
    + (S/8)**gamma_adapter * (e2*L + e3*B*L/1000) + e5*(A+1)*ceil(S/16)*split_k*ceil(n_tok/32)/1000``
    (split_k = 64 below 128 tokens, else 8: vLLM 0.8.5 V1's shrink grid, one layer per slot).

    The slot rank S (``--max-lora-rank``, every slot is sized for it) enters twice: per token the LoRA
    kernels move activations (little S dependence at large batches), per distinct adapter they read its
    weights (grows with S). ``gamma`` is the single exponent of older profiles: it applies to any of the two
    that is None.
    """

    c0_ms: float
    c1_ms_per_req: float
    p1_ms_per_prefill_token: float
    a3_ms_per_kctx: float = 0.0
    lora_form: Literal["additive", "multiplicative"] = "additive"
    e0_ms: float = 0.0
    e1_ms_per_token: float = 0.0  # per decode token
    e2_ms_per_adapter: float = 0.0
    e3_ms_per_kreq_adapter: float = 0.0
    gamma: float = 0.0  # older profiles: one exponent for every LoRA term
    gamma_token: float | None = None  # per-token LoRA terms scale with (S/8)**gamma_token; None = gamma
    gamma_adapter: float | None = None  # per-adapter LoRA terms scale with (S/8)**gamma_adapter; None = gamma
    k0_pct: float = 100.0
    k1_pct_per_adapter: float = 0.0
    e1p_ms_per_prefill_token: float | None = None  # per prefill token; None = e1_ms_per_token
    e4_ms_per_ktok_slot: float = 0.0  # per token and 1000 GPU slots (A): kernel grid over all slots
    # per 1000 blocks of the shrink kernel's grid per slot (formula above)
    # (twin.steptime: vLLM 0.8.5 V1's default launch config); 0 = not modelled (profiles before it)
    e5_ms_per_kblock_slot: float = 0.0


    def rank_exponents(self) -> tuple[float, float]:
        """``(gamma_token, gamma_adapter)`` with ``gamma`` standing in for a missing one."""
        return (self.gamma if self.gamma_token is None else self.gamma_token,
                self.gamma if self.gamma_adapter is None else self.gamma_adapter)


class SchedulerModel(_Frozen):
    """``max(0, b*B + const + W*(w - wa*A/N_cpu) - baseline)`` ms per step (paper form)."""

    ms_per_running: float
    const_ms: float
    ms_per_waiting: float
    ms_per_waiting_slot_ratio: float
    baseline_ms: float


class LoadPoint(_Frozen):
    max_lora_rank: int
    rank: int
    ms: float


class DiskPoint(_Frozen):
    rank: int
    ms: float


class LoadingModel(_Frozen):
    activation: list[LoadPoint]  # CPU -> GPU, by (slot rank S, adapter rank r)
    disk: list[DiskPoint]  # disk -> CPU, by adapter rank


class RunsLengths(_Frozen):
    """The ShareGPT-like length law (``workload.lengths``) that best rebuilds the real runs the
    profile was refined against: their prompt pool tokenised for this model. ``lorapack validate`` rebuilds
    runs with it; the generic workload default (cv 1.1) is an inference, this one is fitted."""

    kind: Literal["lognormal"] = "lognormal"
    cv: float = Field(gt=0)


class FrontendModel(_Frozen):
    """What a request spends outside the engine (vLLM's API server and the streaming client): added to every
    TTFT; inter-token gaps are unchanged (every token takes the same path). Fitted by the calibration's
    refinement on the runs whose real mean TTFT is below one second (no queueing: the engine's part is
    known), as the median of real minus twin TTFT."""

    ttft_overhead_ms: float = Field(default=0.0, ge=0)


class ApiServerModel(_Frozen):
    """vLLM's API server loop (docs/engine-semantics.md, "The API server"; docs/trust-under-load.md): one asyncio
    loop hands arrivals to the engine core, turns each step's outputs into chunks and answers /metrics scrapes.
    Its work per output delays every chunk (a new request's first one last in its step); a scrape stops it for a
    render time that grows with the label series of ``vllm:lora_requests_info`` (``VllmRules.lora_info_series``),
    and the steps' outputs queued meanwhile leave together, one chunk per request. The scrapes happen only where a
    poller asks (``ServerConfig.metrics_scrape_s``)."""

    ms_per_output: float = Field(default=0.0, ge=0)
    scrape_base_ms: float = Field(default=0.0, ge=0)
    scrape_us_per_series: float = Field(default=0.0, ge=0)
    scrape_us_per_label_name: float = Field(default=0.0, ge=0)


class Priors(_Frozen):
    """The closed-form fits of the profiling data (docs/calibration.md), kept beside the refined values.

    Only sections that a later stage changes are stored: ``steptime`` is refined against end-to-end runs
    (step 2); memory, scheduler and loading are used as fitted (the top-level sections are their priors).
    """

    steptime: StepTimeModel


class Profile(_Frozen):
    schema_version: int = 1
    model: str
    gpu: str
    vllm_version: str
    max_model_len: int
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 2048
    memory: MemoryModel
    steptime: StepTimeModel
    scheduler: SchedulerModel
    loading: LoadingModel
    priors: Priors | None = None  # closed-form fits before refinement (None: the sections above are the fits)
    runs_lengths: RunsLengths | None = None  # fitted length law for rebuilding real runs (None: spec default)
    frontend: FrontendModel | None = None  # None: no time outside the engine
    api_server: ApiServerModel | None = None  # None: the API server's loop is not modelled
    # log-sd of a mean-one per-step multiplier of the step time (docs/engine-semantics.md, "Step noise"); 0: none
    step_noise_sigma: float = Field(default=0.0, ge=0, le=1)
    # the server settings the profile was measured with (``serve.sh`` pins them; the twin models the server
    # at them): vLLM 0.8.5 V1 with --gpu-memory-utilization 0.9 and prefix caching off for the shipped
    # profiles. Neutral values (``fingerprint.NEUTRAL_PROFILE``): profiles fitted before keep their fingerprint.
    measured_gpu_memory_utilization: float = 0.9
    measured_prefix_caching: bool = False
    # what ``lorapack measure`` saw of the server: the device (vLLM's device_config, or the user's label) and the
    # tensor-parallel size: a TP server is one "GPU" of a plan that takes this many devices (``serve.sh``)
    device: str | None = None
    tensor_parallel_size: int = Field(default=1, ge=1)
    provenance: dict = Field(default_factory=dict)

    # ---- memory and the start-up rule (``Profile.startup``) ----
    def _measured(self, max_loras: int, max_lora_rank: int) -> KvPoint | None:
        for p in self.memory.measured:
            if p.max_loras == max_loras and p.max_lora_rank == max_lora_rank:
                return p
        return None

    def kv_tokens(self, max_loras: int, max_lora_rank: int) -> int:
        """KV cache capacity in tokens (multiple of the block size); may be <= 0."""
        p = self._measured(max_loras, max_lora_rank)
        if p is not None and p.kv_tokens is not None:
            return int(p.kv_tokens)
        m = self.memory
        t = m.kv_tokens_base - max_loras * (m.kv_tokens_per_slot_rank * max_lora_rank + m.kv_tokens_per_slot)
        return int(math.floor(t / self.block_size)) * self.block_size

    def startup(self, max_loras: int, max_lora_rank: int, max_model_len: int | None = None,
                kv_start: str = "profile") -> tuple[bool, int, str | None]:
        """``(starts, kv_tokens, error_type)``: would vLLM start with these flags?

        ``kv_start`` is the version's rule (``lorapack.server.VllmRules.kv_start``): ``"profile"`` (vLLM 0.8.5,
        ``Profile.startup``: measured points, else ``kv >= (1 + startup_margin) * max_model_len``) or
        ``"one_sequence_minus_null_block"`` (vLLM 0.32, measured on the testbed: one ``max_model_len``
        sequence must fit in the KV cache minus one block, V1's null block)."""
        mml = self.max_model_len if max_model_len is None else max_model_len
        if kv_start == "one_sequence_minus_null_block":
            p = self._measured(max_loras, max_lora_rank)
            kv = self.kv_tokens(max_loras, max_lora_rank)
            if p is not None and p.kv_tokens is None and mml == self.max_model_len:
                return False, max(kv, 0), p.error_type or "kv_cache_insufficient"
            if kv <= 0:
                return False, 0, "no_cache_blocks"
            if mml > kv - self.block_size:
                return False, kv, "kv_cache_insufficient"
            return True, kv, None
        if kv_start != "profile":
            raise ValueError(f"kv_start {kv_start!r}: expected 'profile' or 'one_sequence_minus_null_block'")
        p = self._measured(max_loras, max_lora_rank)
        kv = self.kv_tokens(max_loras, max_lora_rank)
        if p is not None and mml == self.max_model_len:
            if p.kv_tokens is None:
                return False, max(kv, 0), p.error_type or "kv_cache_insufficient"
            return True, int(p.kv_tokens), None
        if kv <= 0:
            return False, 0, "no_cache_blocks"
        need = mml if p is not None else (1.0 + self.memory.startup_margin) * mml
        if kv < need:
            return False, kv, "kv_cache_insufficient"
        return True, kv, None

    def max_slots(self, max_lora_rank: int, max_model_len: int | None = None, limit: int = 4096) -> int:
        """Largest A that starts for this S (0 if none)."""
        best = 0
        for a in range(1, limit + 1):
            if self.startup(a, max_lora_rank, max_model_len)[0]:
                best = a
            elif best and self.kv_tokens(a, max_lora_rank) <= 0:
                break
        return best

    # ---- adapter loading (docs/calibration.md, the step-time model) ----
    def activation_ms(self, max_lora_rank: int, rank: int) -> float:
        """CPU -> GPU activation time; exact table value, else a log-linear fit over the table."""
        pts = self.loading.activation
        for p in pts:
            if p.max_lora_rank == max_lora_rank and p.rank == rank:
                return p.ms
        x = np.array([[1.0, math.log2(p.max_lora_rank), math.log2(p.max_lora_rank / p.rank)] for p in pts])
        y = np.array([p.ms for p in pts])
        coef, *_ = np.linalg.lstsq(x, y, rcond=None)
        v = float(coef @ [1.0, math.log2(max_lora_rank), math.log2(max_lora_rank / max(rank, 1))])
        return max(v, float(y.min()) * 0.5)

    def disk_ms(self, rank: int) -> float:
        """Disk -> CPU load time, linear in rank between table points (clamped outside)."""
        pts = sorted(self.loading.disk, key=lambda p: p.rank)
        return float(np.interp(rank, [p.rank for p in pts], [p.ms for p in pts]))

    def calibrated_ranks(self) -> tuple[int, int]:
        """The smallest and largest (adapter and slot) rank the profile's data covers (the activation table:
        8-32 for the shipped profiles); outside it the twin extrapolates."""
        ranks = [p.rank for p in self.loading.activation] + [p.max_lora_rank for p in self.loading.activation]
        return (min(ranks), max(ranks)) if ranks else (8, 32)

    def file_hash(self) -> str:
        """16 hex digits of the profile's JSON; fields added after profiles were shipped are left out at their
        neutral value (``NEUTRAL_FIELDS``), so the hash recorded by shipped models and sweeps stays valid."""
        skip = {k for k, v in NEUTRAL_FIELDS.items() if getattr(self, k) == v and type(getattr(self, k)) is type(v)}
        return hashlib.sha256(self.model_dump_json(exclude=skip or None).encode()).hexdigest()[:16]


def smallest_vllm_rank(rank: int, choices: tuple[int, ...] = VLLM_LORA_RANKS) -> int:
    """Smallest ``--max-lora-rank`` value vLLM accepts (``choices``: 0.8.5's by default) that is >= ``rank``."""
    for s in choices:
        if s >= rank:
            return s
    raise ProfileError(f"adapter rank {rank} exceeds the largest --max-lora-rank vLLM accepts ({choices[-1]})")


def load_profile_file(path: str | Path) -> Profile:
    from .checks import check_input_file

    path = check_input_file(path, "profile file", ProfileError)
    try:
        # libyaml's parser when PyYAML has it (same constructor, same values): ~0.2 s -> ~0.02 s for a shipped
        # profile, paid by every command at start
        data = yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except yaml.YAMLError as e:
        raise ProfileError(f"{path}: not valid YAML ({e.__class__.__name__})") from e
    try:
        return Profile.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"])
        raise ProfileError(f"{path}: field '{loc}': {err['msg']}") from e


def available_profiles() -> list[tuple[str, str, Path]]:
    """Shipped ``(gpu, model, path)`` triples."""
    out = []
    for p in sorted(PROFILE_DIR.glob("*__*__*.yaml")):
        gpu, _ver, model = p.stem.split("__")
        out.append((gpu, model, p))
    return out


def find_profile(model: str, gpu: str = "h100-64gb") -> Profile:
    """The shipped profile for ``model`` on ``gpu``."""
    avail = available_profiles()
    hits = [p for g, m, p in avail if g == gpu and m == model]
    if not hits:
        models = sorted({m for g, m, _ in avail if g == gpu})
        gpus = sorted({g for g, _, _ in avail})
        if gpu not in gpus:
            raise ProfileError(f"unknown gpu '{gpu}': shipped profiles exist for {', '.join(gpus) or 'none'}")
        raise ProfileError(f"unknown model '{model}' on {gpu}: expected one of {', '.join(models)}")
    return load_profile_file(hits[-1])


def save_profile(profile: Profile, path: str | Path) -> None:
    """Write a profile YAML atomically (no half-written file on error)."""
    from .checks import write_text_atomic

    write_text_atomic(path, yaml.safe_dump(profile.model_dump(mode="json"), sort_keys=False))
