"""One vLLM server's configuration: its flags under vLLM's names, its vLLM version and that version's rules.

``ServerConfig`` is the one type that goes from the CLI (or a plan, or a profile) to the engine (docs/testbed.md,
"Version rules"): a placement candidate (``oracle.GpuCandidate.server``) and a plan's GPU (``GpuPlan.server``)
hold one, and a run's ``RunMetrics.server`` is the resolved one. ``None`` flags take vLLM's / the profile's
defaults when the twin resolves them (``lorapack.twin.run.resolve_server``: a ``ServerConfig`` with every flag
set and ``rules`` chosen).

``VllmRules`` is a named set of behaviour rules; ``rules_for_version`` picks the newest rule set at or below a
version (a version below the oldest, or one that does not parse, is a one-line ``VersionError`` asking for
``--vllm-version``). A newer vLLM's rule is a named option of the rule set, never a copy of its scheduler:

=====================  ==========================  ===============================  ==========================
rule                   0.8.5 (shipped profiles)    0.32 (checked on the testbed)    0.33
=====================  ==========================  ===============================  ==========================
``max_loras``          adapters scheduled this     same as 0.8.5                    adapters of all running
admission              step count                                                   requests count
over-long request      prompt + max_tokens >       refused iff prompt >= mml or     as 0.32
                       mml: refused (HTTP 400)     max_tokens > mml; else the
                                                   output is cut to mml - prompt
``--max-lora-rank``    8 16 32 64 128 256 320 512  1 and the same                  as 0.32
KV start rule          the profile's memory rule   one max_model_len sequence fits  as 0.32
                       (``Profile.startup``)       in the KV cache minus one block
active-adapter cost    0 (neutral seam)            0 (neutral seam)                 0 (neutral seam)
=====================  ==========================  ===============================  ==========================

Defaults that follow the version, not the rule set: ``--gpu-memory-utilization`` is 0.90 before vLLM 0.22 and
0.92 from 0.22.0; prefix caching is on by default in the V1 engine (every version here). The shipped profiles
were measured with 0.90 and prefix caching off (``Profile.measured_gpu_memory_utilization`` /
``measured_prefix_caching``); ``serve.sh`` pins both to the profile's values, and the twin models the server
at those values.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal

import numpy as np

from .errors import SpecError

INT64_SAFE = 2**62  # integer settings pass through numba's int64 arithmetic

Admission = Literal["scheduled", "running"]
OverLong = Literal["refuse_sum", "clamp_output"]
KvStart = Literal["profile", "one_sequence_minus_null_block"]
LoraInfoSeries = Literal["per_distinct_set", "none"]


class VersionError(SpecError):
    """A vLLM version that does not parse or that no rule set covers."""


@dataclass(frozen=True)
class VllmRules:
    """The behaviour rules of one vLLM version range (a named rule set; see the module docstring)."""

    name: str  # the version the set was read from ("0.8.5", "0.32", "0.33")
    since: tuple[int, int, int]  # the oldest version it applies to
    # the max_loras rule of the waiting pass: "scheduled" = the adapters of the requests scheduled this step
    # (running pass + waiting requests admitted so far) count (vLLM <= 0.32); "running" = the adapters of all
    # running requests count (vLLM 0.33, vllm/v1/core/sched/scheduler.py ~1038-1047)
    admission: Admission
    # requests longer than --max-model-len: "refuse_sum" = prompt + max_tokens > mml is refused (0.8.5);
    # "clamp_output" = refused iff prompt >= mml or max_tokens > mml, else served with the output cut to
    # mml - prompt tokens (0.32, measured on the testbed)
    over_long: OverLong
    lora_ranks: tuple[int, ...]  # the --max-lora-rank values vLLM accepts
    # the start-up rule: "profile" = the profile's memory rule (``Profile.startup``); "one_sequence_minus_null_block"
    # = additionally one max_model_len sequence must fit in the KV cache minus one block (V1's null block)
    kv_start: KvStart
    default_gpu_memory_utilization: float = 0.9  # vLLM's default when the flag is not given
    default_prefix_caching: bool = True  # V1 turns prefix caching on by default
    # step-cost seam for LoRA CUDA graphs specialised per number of active adapters (vLLM PRs #25914,
    # #32005): ms per distinct adapter of a batch, added to the profile's per-adapter cost. No fitted value
    # exists yet: 0.0 (no cost change) for every version.
    active_adapter_step_ms: float = 0.0
    # ``vllm:lora_requests_info`` (``PrometheusStatLogger.record``, once per step): "per_distinct_set" = one gauge
    # series per distinct (running adapters, waiting adapters) label set ever seen, never removed, rendered by
    # every /metrics scrape on the API server's loop (vLLM 0.8.5 ``v1/metrics/loggers.py``; the same code is in
    # later versions until a testbed measurement says otherwise); "none" = no such gauge
    lora_info_series: LoraInfoSeries = "per_distinct_set"
    # outputs of one step the API server's output handler processes before it yields to the stream tasks
    # (``VLLM_V1_OUTPUT_PROC_CHUNK_SIZE``, 0.8.5 ``envs.py`` default 128; ``AsyncLLM._run_output_handler``)
    output_proc_chunk: int = 128

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["since"] = ".".join(map(str, self.since))
        d["lora_ranks"] = list(self.lora_ranks)
        return d


VLLM_0_8_5 = VllmRules(name="0.8.5", since=(0, 8, 5), admission="scheduled", over_long="refuse_sum",
                       lora_ranks=(8, 16, 32, 64, 128, 256, 320, 512), kv_start="profile")
VLLM_0_32 = VllmRules(name="0.32", since=(0, 32, 0), admission="scheduled", over_long="clamp_output",
                      lora_ranks=(1, 8, 16, 32, 64, 128, 256, 320, 512), kv_start="one_sequence_minus_null_block",
                      default_gpu_memory_utilization=0.92)
VLLM_0_33 = dataclasses.replace(VLLM_0_32, name="0.33", since=(0, 33, 0), admission="running")
RULE_SETS: tuple[VllmRules, ...] = (VLLM_0_8_5, VLLM_0_32, VLLM_0_33)  # oldest first
# --gpu-memory-utilization's default moved from 0.90 to 0.92 in vLLM 0.22.0
GPU_MEMORY_UTILIZATION_DEFAULTS: tuple[tuple[tuple[int, int, int], float], ...] = (((0, 0, 0), 0.9),
                                                                                    ((0, 22, 0), 0.92))

_VERSION = re.compile(r"^v?(\d+)\.(\d+)(?:\.(\d+))?(?:(?:rc|post|\.post)\d*)?(?:\+[0-9A-Za-z.]+)?$")


def parse_vllm_version(text: str) -> tuple[int, int, int]:
    """``"0.8.5"`` -> ``(0, 8, 5)``; ``"0.32"`` -> ``(0, 32, 0)`` (``v``, ``rcN``, ``postN`` and a ``+local``
    part are accepted). A development build (``0.1.dev6216+g…``) or anything else is a ``VersionError``."""
    m = _VERSION.match(str(text).strip())
    if m is None:
        raise VersionError(f"vLLM version {str(text)!r} does not parse (expected e.g. 0.8.5 or 0.32.0); give the "
                           f"version the server runs with --vllm-version")
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


@lru_cache(maxsize=64)
def rules_for_version(version: str) -> VllmRules:
    """The newest rule set at or below ``version``, with that version's default memory fraction."""
    v = parse_vllm_version(version)
    fitting = [r for r in RULE_SETS if r.since <= v]
    if not fitting:
        raise VersionError(f"vLLM version {version} is older than the oldest rule set ({RULE_SETS[0].name}); "
                           f"give a supported version with --vllm-version")
    gmu = [g for since, g in GPU_MEMORY_UTILIZATION_DEFAULTS if since <= v][-1]
    return dataclasses.replace(fitting[-1], default_gpu_memory_utilization=gmu)


# the flags ServerConfig.to_dict reports, in vLLM's order of the README's table
FLAG_NAMES = ("max_loras", "max_lora_rank", "max_cpu_loras", "max_num_batched_tokens", "max_num_seqs",
              "max_model_len")


@dataclass(frozen=True)
class ServerConfig:
    """vLLM's server flags under vLLM's names, the vLLM version and its behaviour rules.

    ``None`` = vLLM's / the profile's default (``twin.run.resolve_server`` fills them): ``max_lora_rank`` the
    smallest accepted value holding every served rank, ``max_cpu_loras`` max(N, max_loras), the batch limits
    and ``max_model_len`` the profile's, ``gpu_memory_utilization`` / ``enable_prefix_caching`` the values the
    profile was measured with (what ``serve.sh`` pins), ``vllm_version`` the profile's, ``rules`` the rule set
    of that version. ``client_cap`` (the benchmark client's saturation cap, docs/engine-semantics.md; 0 = off) and
    ``warm_start`` (the last registered adapters are resident at t = 0) describe the run, not vLLM.
    """

    max_loras: int
    max_lora_rank: int | None = None
    max_cpu_loras: int | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    max_model_len: int | None = None
    client_cap: int = 0
    warm_start: bool = True
    gpu_memory_utilization: float | None = None
    enable_prefix_caching: bool | None = None
    vllm_version: str | None = None
    rules: VllmRules | None = None
    # the deployment, not vLLM: a /metrics poller's sleep between an answer and its next scrape (s); None = no
    # poller. The reference runs of ../shared/data had one (2 s, the harness's concurrent_metrics_checker.py)
    metrics_scrape_s: float | None = None

    def __post_init__(self) -> None:
        # types only (values are checked against the profile and the adapters by ``resolve_server``)
        for name in ("max_loras", "max_lora_rank", "max_cpu_loras", "max_num_batched_tokens", "max_num_seqs",
                     "max_model_len", "client_cap"):
            v = getattr(self, name)
            if v is None and name not in ("max_loras", "client_cap"):
                continue
            if isinstance(v, bool) or not isinstance(v, int | np.integer) or abs(v) > INT64_SAFE:
                raise SpecError(f"--{name.replace('_', '-')} {v!r}: expected an integer")
        g = self.gpu_memory_utilization
        if g is not None and (isinstance(g, bool) or not isinstance(g, int | float | np.integer | np.floating)
                              or not math.isfinite(g) or not 0.0 < g <= 1.0):
            raise SpecError(f"--gpu-memory-utilization {g!r}: expected a fraction in (0, 1]")
        if self.enable_prefix_caching is not None and not isinstance(self.enable_prefix_caching, bool | np.bool_):
            raise SpecError(f"enable_prefix_caching {self.enable_prefix_caching!r}: expected True or False")
        m = self.metrics_scrape_s
        if m is not None and (isinstance(m, bool) or not isinstance(m, int | float | np.integer | np.floating)
                              or not math.isfinite(m) or m <= 0):
            raise SpecError(f"--metrics-scrape-s {m!r}: expected seconds > 0 between scrapes, or None (no poller)")
        if self.vllm_version is not None:
            parse_vllm_version(self.vllm_version)
        if self.rules is not None and not isinstance(self.rules, VllmRules):
            raise SpecError(f"rules: expected VllmRules, got {type(self.rules).__name__}")

    def replace(self, **changes: Any) -> ServerConfig:
        return dataclasses.replace(self, **changes)

    def version_rules(self, profile_version: str | None = None) -> VllmRules:
        """``rules`` if set, else the rule set of ``vllm_version`` (or of ``profile_version``)."""
        if self.rules is not None:
            return self.rules
        version = self.vllm_version or profile_version
        return rules_for_version(version) if version is not None else VLLM_0_8_5

    def to_dict(self) -> dict[str, Any]:
        """The flags under vLLM's names plus the version and the rule set's name (``simulate --json``'s
        ``server`` object: keys are added, never renamed)."""
        out: dict[str, Any] = {k: getattr(self, k) for k in FLAG_NAMES}
        out.update(gpu_memory_utilization=self.gpu_memory_utilization,
                   enable_prefix_caching=self.enable_prefix_caching, vllm_version=self.vllm_version,
                   vllm_rules=None if self.rules is None else self.rules.name, metrics_scrape_s=self.metrics_scrape_s)
        return out


class ServerFlag:
    """A read-only attribute of a type that holds a ``server: ServerConfig`` (a placement candidate, a plan's
    GPU): it reads the flag of the same name from ``server``, so the type keeps the flags in one place and
    ``cand.max_loras`` still reads naturally. To change a flag, replace ``server``."""

    def __set_name__(self, owner: type, name: str) -> None:
        if name not in FLAG_NAMES:
            raise TypeError(f"ServerFlag {name!r}: not a ServerConfig flag ({', '.join(FLAG_NAMES)})")
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        return self if obj is None else getattr(obj.server, self.name)

    def __set__(self, obj: Any, value: Any) -> None:
        raise AttributeError(f"{self.name} is read-only: replace the server (a ServerConfig) to change it")
