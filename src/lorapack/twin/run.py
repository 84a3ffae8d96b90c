"""High-level twin API: profile + server flags + workload + seed -> ``RunMetrics``.

``simulate`` is a pure function of its inputs (the seed included), so runs can be spread over processes.
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass

import numpy as np

from ..errors import LorapackWarning, SpecError
from ..guards import Limits, check
from ..profile import VLLM_LORA_RANKS, Profile, smallest_vllm_rank
from ..server import VLLM_0_8_5, ServerConfig, VllmRules
from ..workload.cost import estimate_workload
from .early import EarlyStopOptions, run_with_early_stop
from .metrics import RunMetrics, compute_metrics
from .steptime import StepModel
from .types import INT32_MAX, EngineConfig, EngineResult, RequestArrays

DEFAULT_DURATION_S = 3600.0
# the real benchmark client plateaued at ~25.5k waiting requests (``client_cap``, docs/engine-semantics.md)
REAL_CLIENT_CAP = 25_500


def check_seconds(value, name: str = "--duration-s") -> float:
    """A finite, positive number of seconds as a float, else a one-line ``SpecError``."""
    numeric = isinstance(value, int | float | np.integer | np.floating) and not isinstance(value, bool)
    if not numeric or not math.isfinite(value) or value <= 0:
        raise SpecError(f"{name} {value!r}: expected a positive number of seconds")
    return float(value)


def check_ranks(ranks) -> np.ndarray:
    """Adapter ranks as a 1-D int32 array of integers >= 1 (one per adapter, registration order)."""
    a = np.asarray(ranks)
    if a.ndim != 1 or a.dtype == np.bool_ or a.dtype.kind not in "iu":
        raise SpecError(f"ranks: expected a 1-D array of integers (one per adapter), got {a.dtype} of shape "
                        f"{a.shape}")
    if len(a) and (int(a.min()) < 1 or int(a.max()) > INT32_MAX):
        raise SpecError(f"ranks: expected integers >= 1, got {int(a.min())} .. {int(a.max())}")
    return a.astype(np.int32)


@dataclass(frozen=True)
class ResolvedServer:
    """A ``ServerConfig`` with every flag and the rule set resolved (``config``) and the start-up rule's outcome.

    It restates no flag: ``srv.max_loras`` etc. read ``srv.config``."""

    config: ServerConfig
    starts: bool
    kv_cache_tokens: int
    error_type: str | None

    def __getattr__(self, name: str):
        if name == "config":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.config, name)


def check_lora_ranks(ranks: np.ndarray, max_lora_rank: int | None,
                     choices: tuple[int, ...] = VLLM_LORA_RANKS) -> int:
    """vLLM's rank rules (``choices``: the version's accepted values, 0.8.5's by default); returns the slot
    rank S.

    ``--max-lora-rank`` must be one of ``choices`` (``LoRAConfig`` refuses to start otherwise; the
    default is the smallest accepted value that holds the largest adapter); an adapter of a rank above it is
    refused when it is loaded (``PEFTHelper.validate_legal``). An adapter's own rank may be any integer up to
    S: vLLM pads it into its slot."""
    max_rank = int(np.max(ranks))
    if max_lora_rank is None:
        if max_rank > choices[-1]:
            raise SpecError(f"adapter rank {max_rank} exceeds the largest --max-lora-rank vLLM accepts "
                            f"({choices[-1]})")
        return smallest_vllm_rank(max_rank, choices)
    s = int(max_lora_rank)
    if s not in choices:
        raise SpecError(f"--max-lora-rank {s}: vLLM accepts only {', '.join(map(str, choices))}")
    if s < max_rank:
        raise SpecError(f"--max-lora-rank {s} is below the largest adapter rank {max_rank} (vLLM refuses to load "
                        f"it); expected --max-lora-rank >= {max_rank}")
    return s


def warn_uncalibrated_ranks(profile: Profile, ranks: np.ndarray, slot_rank: int) -> None:
    """A ``LorapackWarning`` when an adapter or slot rank lies outside the ranks the profile's data covers."""
    lo, hi = profile.calibrated_ranks()
    outside = sorted({int(r) for r in np.unique(ranks) if not lo <= r <= hi} | ({slot_rank} - set(range(lo, hi + 1))))
    if outside:
        warnings.warn(f"rank(s) {', '.join(map(str, outside))} lie outside the ranks {profile.model}'s profile was "
                      f"calibrated on ({lo}-{hi}): the twin extrapolates their LoRA costs", LorapackWarning,
                      stacklevel=3)


def resolve_server(profile: Profile, ranks: np.ndarray, flags: ServerConfig) -> ResolvedServer:
    """Apply defaults and the version's rule set, check the flags against the adapters (vLLM's rules) and the
    start-up rule (``Profile.startup``; from vLLM 0.32 also one ``max_model_len`` sequence in the KV cache minus one
    block)."""
    n_adapters = len(ranks)
    if n_adapters == 0:
        raise SpecError("the workload has no adapters; expected at least one")
    if flags.max_loras < 1:
        raise SpecError(f"--max-loras {flags.max_loras}: expected an integer >= 1")
    rules = flags.version_rules(profile.vllm_version)
    s = check_lora_ranks(ranks, flags.max_lora_rank, rules.lora_ranks)
    n_cpu = max(n_adapters, flags.max_loras) if flags.max_cpu_loras is None else int(flags.max_cpu_loras)
    if n_cpu < flags.max_loras:
        raise SpecError(f"--max-cpu-loras {n_cpu} is below --max-loras {flags.max_loras}; vLLM requires "
                        f"max_cpu_loras >= max_loras")
    mml = profile.max_model_len if flags.max_model_len is None else int(flags.max_model_len)
    if not 1 <= mml <= profile.max_model_len:
        raise SpecError(f"--max-model-len {mml}: expected an integer between 1 and the model's maximum "
                        f"{profile.max_model_len}")
    for name, v in (("--max-num-batched-tokens", flags.max_num_batched_tokens),
                    ("--max-num-seqs", flags.max_num_seqs)):
        if v is not None and v < 1:
            raise SpecError(f"{name} {v}: expected an integer >= 1")
    if flags.client_cap < 0:
        raise SpecError(f"--client-cap {flags.client_cap}: expected an integer >= 0 (0 = off)")
    # warnings only once every flag is known good: a refused command prints its one error line alone
    warn_uncalibrated_ranks(profile, ranks, s)
    gmu = profile.measured_gpu_memory_utilization
    if flags.gpu_memory_utilization is not None and float(flags.gpu_memory_utilization) != gmu:
        warnings.warn(f"--gpu-memory-utilization {flags.gpu_memory_utilization}: the twin models the KV cache at "
                      f"{gmu}, the fraction {profile.model}'s profile was measured with", LorapackWarning,
                      stacklevel=3)
    starts, kv, err = profile.startup(flags.max_loras, s, mml, kv_start=rules.kv_start)
    config = flags.replace(
        max_loras=int(flags.max_loras), max_lora_rank=s, max_cpu_loras=n_cpu,
        max_num_batched_tokens=flags.max_num_batched_tokens or profile.max_num_batched_tokens,
        max_num_seqs=flags.max_num_seqs or profile.max_num_seqs, max_model_len=mml,
        gpu_memory_utilization=gmu if flags.gpu_memory_utilization is None else float(flags.gpu_memory_utilization),
        enable_prefix_caching=(profile.measured_prefix_caching if flags.enable_prefix_caching is None
                               else bool(flags.enable_prefix_caching)),
        vllm_version=flags.vllm_version or profile.vllm_version, rules=rules)
    return ResolvedServer(config=config, starts=starts, kv_cache_tokens=int(kv), error_type=err)


def step_model(profile: Profile, srv: ResolvedServer | ServerConfig) -> StepModel:
    """The step-time coefficients of ``profile`` at the server's flags (``max_loras``, ``max_lora_rank``,
    ``max_cpu_loras``: resolved values) and its rule set's active-adapter term (0 for every version so far)."""
    st, sc = profile.steptime, profile.scheduler
    rules = srv.rules or VLLM_0_8_5
    slots = st.e4_ms_per_ktok_slot * srv.max_loras / 1000.0  # per-token cost of the slot grid
    e1p = st.e1_ms_per_token if st.e1p_ms_per_prefill_token is None else st.e1p_ms_per_prefill_token
    gamma_token, gamma_adapter = st.rank_exponents()
    return StepModel(
        c0_ms=st.c0_ms, c1_ms_per_req=st.c1_ms_per_req, p1_ms_per_prefill_token=st.p1_ms_per_prefill_token,
        a3_ms_per_kctx=st.a3_ms_per_kctx, lora_form=st.lora_form, e0_ms=st.e0_ms,
        e1_ms_per_token=st.e1_ms_per_token + slots, e1p_ms_per_prefill_token=e1p + slots,
        e2_ms_per_adapter=st.e2_ms_per_adapter + rules.active_adapter_step_ms,
        e3_ms_per_kreq_adapter=st.e3_ms_per_kreq_adapter,
        shrink_grid_ms_per_kblock=st.e5_ms_per_kblock_slot * (srv.max_loras + 1) * -(-srv.max_lora_rank // 16),
        rank_scale=(srv.max_lora_rank / 8.0) ** gamma_adapter,
        rank_scale_token=(srv.max_lora_rank / 8.0) ** gamma_token, k0_pct=st.k0_pct,
        k1_pct_per_adapter=st.k1_pct_per_adapter,
        sched_ms_per_running=sc.ms_per_running, sched_const_ms=sc.const_ms,
        sched_ms_per_waiting=sc.ms_per_waiting,
        sched_ms_per_waiting_slot_ratio=sc.ms_per_waiting_slot_ratio * srv.max_loras / srv.max_cpu_loras,
        sched_baseline_ms=sc.baseline_ms)


def engine_config(profile: Profile, ranks: np.ndarray, srv: ResolvedServer, duration_s: float,
                  client_cap: int | None = None, warm_start: bool | None = None) -> EngineConfig:
    """The engine's input for ``srv`` (``resolve_server``); ``client_cap`` / ``warm_start`` override the
    server config's."""
    s = srv.max_lora_rank
    act = {int(r): profile.activation_ms(s, int(r)) for r in np.unique(ranks)}
    disk = {int(r): profile.disk_ms(int(r)) for r in np.unique(ranks)}
    server = srv.config
    if profile.api_server is None and server.metrics_scrape_s is not None:
        server = server.replace(metrics_scrape_s=None)  # no API-server loop modelled: a poller changes nothing
    if client_cap is not None or warm_start is not None:
        server = server.replace(client_cap=server.client_cap if client_cap is None else client_cap,
                                warm_start=server.warm_start if warm_start is None else warm_start)
    return EngineConfig.from_server(
        server, np.array([act[int(r)] for r in ranks]), np.array([disk[int(r)] for r in ranks]),
        srv.kv_cache_tokens // profile.block_size, step_model(profile, srv).to_array(), profile.block_size,
        duration_s, warm_cpu=True,
        ttft_overhead_ms=profile.frontend.ttft_overhead_ms if profile.frontend is not None else 0.0,
        step_noise_sigma=profile.step_noise_sigma, **api_server_options(profile, server))


def api_server_options(profile: Profile, server: ServerConfig) -> dict[str, float]:
    """The engine's API-server loop constants (``EngineConfig``) from the profile's ``api_server`` and the version
    rules (``VllmRules.lora_info_series``: without the gauge, no label series to render)."""
    api = profile.api_server
    if api is None:
        return {}
    series = server.rules is None or server.rules.lora_info_series == "per_distinct_set"
    return {"api_ms_per_output": api.ms_per_output, "scrape_base_ms": api.scrape_base_ms,
            "scrape_us_per_series": api.scrape_us_per_series if series else 0.0,
            "scrape_us_per_label_name": api.scrape_us_per_label_name if series else 0.0}


def oom_metrics(srv: ResolvedServer, n_generated: int) -> RunMetrics:
    """The result of a run whose server does not start: nothing served, every arrival counted as sent."""
    return RunMetrics(oom=True, error_type=srv.error_type, kv_cache_tokens=srv.kv_cache_tokens,
                      throughput_tok_s=0.0, input_tok_s=0.0, output_tok_s=0.0, n_arrived=n_generated,
                      n_completed=0, n_generated=n_generated)


def reject_over_long(req: RequestArrays, max_model_len: int) -> np.ndarray | None:
    """The requests vLLM 0.8.5 accepts (a mask), or None when it accepts all: the OpenAI server refuses a
    request whose prompt plus ``max_tokens`` (the benchmark client sets it to O) exceeds ``--max-model-len``."""
    too_long = req.prompt_tokens.astype(np.int64) + req.output_tokens.astype(np.int64) > max_model_len
    return ~too_long if too_long.any() else None


def admit_over_long(req: RequestArrays, max_model_len: int, rules: VllmRules
                    ) -> tuple[np.ndarray | None, np.ndarray | None]:
    """``(kept, clamped)`` under the version's over-long rule: ``kept`` the requests the server accepts (a
    mask; None = all), ``clamped`` those it serves with the output cut to ``max_model_len - prompt`` tokens
    (a mask over ``req``; None = none).

    ``refuse_sum`` (vLLM 0.8.5): prompt + ``max_tokens`` > ``--max-model-len`` is refused (HTTP 400).
    ``clamp_output`` (vLLM 0.32, measured on the testbed): refused iff prompt >= ``--max-model-len`` ("max_tokens
    must be at least 1, got 0") or ``max_tokens`` > ``--max-model-len``; otherwise served, the output cut."""
    if rules.over_long == "refuse_sum":
        return reject_over_long(req, max_model_len), None
    p = req.prompt_tokens.astype(np.int64)
    o = req.output_tokens.astype(np.int64)
    refused = (p >= max_model_len) | (o > max_model_len)
    clamped = ~refused & (p + o > max_model_len)
    return (~refused if refused.any() else None), (clamped if clamped.any() else None)


def _subset(req: RequestArrays, keep: np.ndarray) -> RequestArrays:
    return RequestArrays(req.t_arr_s[keep], req.adapter[keep], req.prompt_tokens[keep], req.output_tokens[keep])


def _clamp_outputs(req: RequestArrays, clamped: np.ndarray, max_model_len: int) -> RequestArrays:
    out = req.output_tokens.copy()
    out[clamped] = max_model_len - req.prompt_tokens[clamped]
    return RequestArrays(req.t_arr_s, req.adapter, req.prompt_tokens, out)


def simulate_requests(profile: Profile, ranks: np.ndarray, req: RequestArrays, flags: ServerConfig,
                      duration_s: float = DEFAULT_DURATION_S, early_stop: EarlyStopOptions | None = None,
                      limits: Limits | None = None) -> tuple[RunMetrics, EngineResult | None]:
    """Run the twin on given arrivals. Returns ``(metrics, engine_result)``; the result is None on OOM.

    With ``early_stop`` the run may end before ``duration_s`` (``stop_reason``, ``simulated_s`` say so) and
    the run-level metrics are extrapolated (``twin.early``); the engine result is then partial. (With a
    client cap the run is simulated in full: held-back arrivals make the extrapolation unknowable.)

    Requests longer than ``--max-model-len`` (prompt + output) follow the version's over-long rule
    (``admit_over_long``): from vLLM 0.32 most are served with their output cut to fit (a ``LorapackWarning``
    says how many; the engine runs them with the shorter output). Refused requests never reach the engine, the metrics count them in ``n_rejected`` / ``rejected_tok_s`` only (not as load: more GPUs
    would not serve them), a ``LorapackWarning`` says how many, and the engine result (per request, aligned
    with ``req``) shows them as never sent.

    Every input is checked before the compiled engine runs: ``SpecError`` (a ``ValueError``) for malformed
    arrays or flags, ``ResourceLimitError`` for runs over ``limits`` (``guards.DEFAULT_LIMITS``)."""
    duration_s = check_seconds(duration_s)
    ranks = check_ranks(ranks)
    if not isinstance(req, RequestArrays):
        raise SpecError(f"req: expected RequestArrays, got {type(req).__name__}")
    if not isinstance(flags, ServerConfig):
        raise SpecError(f"flags: expected ServerConfig, got {type(flags).__name__}")
    req.check(len(ranks))
    srv = resolve_server(profile, ranks, flags)
    server = srv.config
    if not srv.starts:
        return oom_metrics(srv, len(req)).replace(server=server), None
    cfg = engine_config(profile, ranks, srv, duration_s)
    kept, clamped = admit_over_long(req, srv.max_model_len, srv.rules)
    if clamped is not None:
        req = _clamp_outputs(req, clamped, srv.max_model_len)
        n_cut = int((clamped & (req.t_arr_s < duration_s)).sum())
        if n_cut:
            warnings.warn(f"{n_cut} request(s) are longer than --max-model-len {srv.max_model_len} (prompt + output "
                          f"tokens): vLLM {srv.rules.name} serves them with the output cut to fit",
                          LorapackWarning, stacklevel=2)
    served = req if kept is None else _subset(req, kept)
    if early_stop is not None:
        res, metrics, _eng = run_with_early_stop(cfg, served, early_stop, limits)
    else:
        from .engine import simulate_fast  # here: importing the engine (and numba) costs ~0.5 s a process

        res = simulate_fast(cfg, served, limits=limits)
        metrics = compute_metrics(res, served, duration_s, len(ranks), cfg=cfg).replace(stop_reason="full",
                                                                                simulated_s=duration_s)
    if kept is not None:
        gone = ~kept & (req.t_arr_s < duration_s)
        tokens = float(req.prompt_tokens[gone].astype(np.int64).sum() + req.output_tokens[gone].astype(np.int64).sum())
        metrics = metrics.replace(n_rejected=int(gone.sum()), rejected_tok_s=tokens / duration_s)
        res = res.expanded(kept)
        if gone.any():
            why = "(prompt + output tokens)" if srv.rules.over_long == "refuse_sum" else \
                "(prompt >= it, or output > it)"
            warnings.warn(f"{int(gone.sum())} request(s) are longer than --max-model-len {srv.max_model_len} {why}: "
                          f"vLLM rejects them; they are counted in n_rejected, not served",
                          LorapackWarning, stacklevel=2)
    return metrics.replace(kv_cache_tokens=srv.kv_cache_tokens, server=server), res


def simulate(profile: Profile, workload, flags: ServerConfig, duration_s: float | None = None,
             seed: int = 0, early_stop: EarlyStopOptions | None = None, limits: Limits | None = None
             ) -> tuple[RunMetrics, EngineResult | None]:
    """Generate the workload's arrivals with ``seed`` and simulate them; sets ``wall_s``, ``duration_s``,
    ``seed``, ``model`` and ``gpu``.

    The run's cost is estimated from the workload before anything is generated (``guards``)."""
    from ..workload import generate_requests

    t0 = time.perf_counter()
    # an explicit 0 is an error, not "use the default"
    dur = check_seconds(duration_s if duration_s is not None else (workload.duration_s or DEFAULT_DURATION_S))
    check(estimate_workload(workload, dur, step_model(profile, resolve_server(profile, workload.ranks, flags))
                            .to_array()), limits)
    req = generate_requests(workload, dur, seed, limits=limits)
    out, res = simulate_requests(profile, workload.ranks, req, flags, dur, early_stop, limits)
    return out.replace(wall_s=time.perf_counter() - t0, duration_s=dur, seed=seed, model=profile.model,
                       gpu=profile.gpu), res
