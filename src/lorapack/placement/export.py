"""What ``lorapack place`` writes: ``plan.json`` (the plan), ``serve.sh`` (one ``vllm serve`` line per GPU with
every flag the twin assumed) and ``routes.json`` (adapter -> ``[{gpu, url, weight}]``, weights summing to 1).

Only flags of ``VLLM_SERVE_FLAGS`` are emitted: every one exists in vLLM ``VLLM_VERSION`` (engine arguments
``--enable-lora --max-loras --max-lora-rank --max-cpu-loras --max-num-seqs --max-num-batched-tokens
--max-model-len --gpu-memory-utilization --no-enable-prefix-caching``; OpenAI-server arguments ``--host --port
--lora-modules``, checked against the vLLM 0.8.5 sources: ``vllm/engine/arg_utils.py``,
``vllm/entrypoints/openai/cli_args.py``). Besides the plan's own values, ``serve.sh`` pins what the shipped
profiles were measured with (``MEASURED_GPU_MEMORY_UTILIZATION``, ``MEASURED_PREFIX_CACHING``, ``VLLM_ENV``),
since vLLM's defaults differ. The model is the positional argument of ``vllm serve``; the device is the
``CUDA_VISIBLE_DEVICES`` environment variable of each line.

``--lora-modules`` takes one JSON object ``{"name": ID, "path": PATH}`` per adapter (vLLM's
``LoRAParserAction``; the ``name=path`` form breaks on ids or paths with ``=`` or ``,``), each one shell word.

GPU ``g`` runs on node ``g // gpus_per_node`` as device ``g % gpus_per_node``, port ``base_port + device``.
``serve.sh`` starts every GPU of the plan, or only node ``$NODE``'s when that variable is set, each server in
the background with its own log (``$LOG_DIR/gpu<g>.log``, default ``logs/`` beside the script), listening on
``$BIND_HOST`` (default ``0.0.0.0``); adapters without a ``path`` in the workload are loaded from
``$LORA_DIR/<id>``. ``RUNTIME_LORA=1`` exports ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` (vLLM's runtime
``/v1/load_lora_adapter``, what a re-plan's ``migrate.sh`` calls) and ``VLLM_API_KEY`` is passed on to the
servers (vLLM reads it as ``--api-key``; not on the command line, where ``ps`` would show it). It waits on every server's PID: when one exits, it stops the others and exits non-zero;
SIGINT / SIGTERM stop every server.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, replace
from pathlib import Path

from .. import __version__
from ..errors import SpecError
from ..profile import Profile
from ..server import parse_vllm_version
from .plan import Plan
from .routers import ROUTER_FILES, router_configs

VLLM_VERSION = "0.8.5"
# every flag serve.sh may contain; all accepted by `vllm serve` in VLLM_VERSION (--enable-prefix-caching and
# --no-enable-prefix-caching: argparse.BooleanOptionalAction, from get_kwargs in vllm/engine/arg_utils.py)
VLLM_SERVE_FLAGS: tuple[str, ...] = (
    "--enable-lora", "--max-loras", "--max-lora-rank", "--max-cpu-loras", "--max-num-seqs",
    "--max-num-batched-tokens", "--max-model-len", "--gpu-memory-utilization", "--enable-prefix-caching",
    "--no-enable-prefix-caching", "--host", "--port", "--lora-modules",
)
# How the measurements behind the shipped profiles were taken (research data README, section 1.1: H100 64 GB,
# vLLM 0.8.5 V1, `gpu_memory_utilization = 0.9`, prefix caching off). Profiles have no field for these, so
# they are pinned here: the KV capacity of a profile holds only at this memory fraction, and vLLM's V1 engine
# turns prefix caching on by default (EngineArgs._set_default_args_v1), which the twin does not model.
# (read from one place: the defaults of the profile's ``measured_*`` fields, which every shipped profile has)
MEASURED_GPU_MEMORY_UTILIZATION = Profile.model_fields["measured_gpu_memory_utilization"].default
MEASURED_PREFIX_CACHING = Profile.model_fields["measured_prefix_caching"].default
# Environment of every server. VLLM_USE_V1=1: the V1 engine the profiles were measured with; set explicitly,
# vLLM 0.8.5 raises instead of silently falling back to V0 for a feature V1 lacks (_raise_or_fallback), and
# V0 would not enable chunked prefill with LoRA, refusing a token budget below --max-model-len.
# Only for vLLM before 0.9 (the plan's `settings.vllm_version`): later releases have no V0 engine to fall back to.
VLLM_ENV: tuple[tuple[str, str], ...] = (("VLLM_USE_V1", "1"),)
VLLM_ENV_BEFORE = (0, 9, 0)


def plan_measured(plan: Plan) -> tuple[float, bool, int]:
    """``(--gpu-memory-utilization, prefix caching, tensor-parallel size)`` the plan's profile was measured with
    (``place`` records them in the settings when they differ from the shipped profiles')."""
    st = plan.settings
    return (float(st.get("measured_gpu_memory_utilization", MEASURED_GPU_MEMORY_UTILIZATION)),
            bool(st.get("measured_prefix_caching", MEASURED_PREFIX_CACHING)), int(st.get("tensor_parallel_size", 1)))


def plan_vllm_version(plan: Plan) -> str:
    """The vLLM version whose rules the plan's twin followed (``place --vllm-version``; default 0.8.5)."""
    return str(plan.settings.get("vllm_version") or VLLM_VERSION)


def server_env(plan: Plan) -> tuple[tuple[str, str], ...]:
    """The environment every server of the plan gets (``VLLM_ENV`` for vLLM 0.8.x, nothing later)."""
    return VLLM_ENV if parse_vllm_version(plan_vllm_version(plan)) < VLLM_ENV_BEFORE else ()
# seconds serve.sh waits for servers to exit after SIGTERM before it sends SIGKILL (default of $STOP_GRACE_S)
STOP_GRACE_S = 30
# Hugging Face ids of the profiles' models (serve.sh's default $MODEL)
HF_MODEL_IDS = {
    "llama-3.1-8b-instruct": "meta-llama/Llama-3.1-8B-Instruct",
    "qwen-2.5-7b-instruct": "Qwen/Qwen2.5-7B-Instruct",
}
OUTPUT_FILES = ("plan.json", "serve.sh", "routes.json", *ROUTER_FILES)  # router configs: routers.py


@dataclass(frozen=True)
class Endpoints:
    """Where the GPUs of a plan listen. A "GPU" of the plan is one server; with tensor parallelism
    (``devices_per_server`` > 1, the profile's ``tensor_parallel_size``) it takes that many devices of a node."""

    base_port: int = 8000
    gpus_per_node: int = 8
    host_pattern: str | None = None  # e.g. "gpu-node-{node}"; default: localhost on one node, else that
    devices_per_server: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.base_port <= 65535 - 64:
            raise SpecError(f"--base-port {self.base_port}: expected a TCP port between 1 and {65535 - 64}")
        if self.gpus_per_node < 1:
            raise SpecError(f"--gpus-per-node {self.gpus_per_node}: expected a positive integer")
        if self.host_pattern is not None:
            try:
                self.host_pattern.format(node=0)
            except (KeyError, IndexError, ValueError):
                raise SpecError(f"--host-pattern {self.host_pattern!r}: expected a host name, optionally with "
                                f"{{node}} (e.g. gpu-node-{{node}})") from None

        if self.devices_per_server < 1 or self.gpus_per_node % self.devices_per_server:
            raise SpecError(f"--gpus-per-node {self.gpus_per_node}: expected a multiple of the profile's "
                            f"tensor-parallel size {self.devices_per_server} (devices per server)")

    @property
    def servers_per_node(self) -> int:
        return self.gpus_per_node // self.devices_per_server

    def node(self, gpu: int) -> int:
        return gpu // self.servers_per_node

    def device(self, gpu: int) -> int:
        """The server's index on its node (its port offset; its first device when tensor-parallel)."""
        return gpu % self.servers_per_node

    def devices(self, gpu: int) -> str:
        """``CUDA_VISIBLE_DEVICES`` of the server: its ``devices_per_server`` devices."""
        first = self.device(gpu) * self.devices_per_server
        return ",".join(str(first + k) for k in range(self.devices_per_server))

    def port(self, gpu: int) -> int:
        return self.base_port + self.device(gpu)

    def host(self, gpu: int, n_gpus: int) -> str:
        pattern = self.host_pattern
        if pattern is None:
            pattern = "localhost" if n_gpus <= self.gpus_per_node else "gpu-node-{node}"
        return pattern.format(node=self.node(gpu))

    def url(self, gpu: int, n_gpus: int) -> str:
        return f"http://{self.host(gpu, n_gpus)}:{self.port(gpu)}/v1"


def _lora_module(adapter_id: str, paths: dict[str, str]) -> str:
    """One ``--lora-modules`` value, ``{"name": ID, "path": PATH}``, as one shell word. Without a path in the
    workload, PATH is ``$LORA_DIR/<id>``, expanded by the shell (``$LORA_DIR_JSON``: $LORA_DIR escaped for JSON)."""
    if adapter_id in paths:
        return shlex.quote(json.dumps({"name": adapter_id, "path": paths[adapter_id]}, ensure_ascii=False))
    name = json.dumps(adapter_id, ensure_ascii=False)
    return (shlex.quote(f'{{"name": {name}, "path": "') + '"$LORA_DIR_JSON"'
            + shlex.quote(f'/{name[1:-1]}"}}'))


def serve_args(plan: Plan, gpu: int, paths: dict[str, str], endpoints: Endpoints = Endpoints()) -> list[str]:
    """The ``vllm serve`` flags of one GPU (shell words, already quoted)."""
    g = plan.gpus[gpu]
    args = ["--enable-lora", "--max-loras", str(g.max_loras), "--max-lora-rank", str(g.max_lora_rank),
            "--max-cpu-loras", str(g.max_cpu_loras), "--max-num-seqs", str(g.max_num_seqs),
            "--max-num-batched-tokens", str(g.max_num_batched_tokens)]
    if g.max_model_len is not None:
        args += ["--max-model-len", str(g.max_model_len)]
    fraction, prefix, tp = plan_measured(plan)
    if tp > 1:
        args += ["--tensor-parallel-size", str(tp)]
    args += ["--gpu-memory-utilization", str(fraction),
             "--enable-prefix-caching" if prefix else "--no-enable-prefix-caching",
             "--host", '"$BIND_HOST"', "--port", str(endpoints.port(gpu)), "--lora-modules"]
    args += [_lora_module(a, paths) for a in g.adapters]  # registration order: the last ones start resident
    return args


# serve.sh after its header and settings: the helpers, then (after the launch lines) the supervision loop
_SERVE_HELPERS = r"""
# $LORA_DIR inside a JSON string (the --lora-modules of adapters without a path)
json_escape() { local s=${1//\\/\\\\}; s=${s//\"/\\\"}; s=${s//$'\t'/\\t}; s=${s//$'\n'/\\n}; printf '%s' "$s"; }
LORA_DIR_JSON=$(json_escape "$LORA_DIR")

pids=() gpus=()
# launch NODE GPU COMMAND...: when node NODE is selected, run COMMAND in the background, output to its log
launch() {
  local node=$1 gpu=$2; shift 2
  if [ "$NODE" = all ] || [ "$NODE" = "$node" ]; then
    "$@" >"$LOG_DIR/gpu$gpu.log" 2>&1 &
    pids+=("$!") gpus+=("$gpu")
    echo "GPU $gpu: PID $!, log $LOG_DIR/gpu$gpu.log"
  fi
}
running() { local pid; for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && return 0; done; return 1; }
# stop every server: SIGTERM, then SIGKILL to those still running after STOP_GRACE_S seconds
stop() {
  local t
  [ ${#pids[@]} -gt 0 ] || return 0
  kill -TERM "${pids[@]}" 2>/dev/null
  for ((t = 0; t < 5 * STOP_GRACE_S; t++)); do running || return 0; sleep 0.2; done
  kill -KILL "${pids[@]}" 2>/dev/null
}
trap 'echo "serve.sh: interrupted, stopping every server" >&2; stop; exit 130' INT
trap 'echo "serve.sh: terminated, stopping every server" >&2; stop; exit 143' TERM
"""

_SERVE_SUPERVISE = r"""
if [ ${#pids[@]} -eq 0 ]; then
  echo "serve.sh: NODE=$NODE selects no GPU of this plan (its GPUs run on nodes: {nodes})" >&2
  exit 2
fi
# A server runs until it is stopped: the first one to exit ends the deployment.
while :; do
  for i in "${!pids[@]}"; do
    if ! kill -0 "${pids[i]}" 2>/dev/null; then
      wait "${pids[i]}"
      status=$?
      echo "serve.sh: GPU ${gpus[i]}'s server (PID ${pids[i]}) exited with status $status" \
        "(log: $LOG_DIR/gpu${gpus[i]}.log); stopping the others" >&2
      stop
      exit $((status == 0 ? 1 : status))
    fi
  done
  sleep 1 &
  wait $!
done
"""


def serve_script(plan: Plan, paths: dict[str, str] | None = None, endpoints: Endpoints = Endpoints()) -> str:
    paths = paths or {}
    model = HF_MODEL_IDS.get(plan.model, plan.model)
    nodes = sorted({endpoints.node(gi) for gi, g in enumerate(plan.gpus) if g.adapters})
    fraction, prefix_on, tp = plan_measured(plan)
    endpoints = replace(endpoints, devices_per_server=tp)  # one server = tp devices
    prefix = "on" if prefix_on else "off"
    lines = [
        "#!/usr/bin/env bash",
        f"# Generated by lorapack {__version__}: method {plan.method}, {plan.model} on {plan.gpu_type}, "
        f"{plan.gpus_used} GPU(s) (lower bound {plan.lower_bound_gpus}).",
        f"# One `vllm serve` per GPU with the flags the twin assumed (vLLM {plan_vllm_version(plan)}), run with what",
        f"# the profile was measured with: V1 engine, --gpu-memory-utilization {fraction}, "
        f"prefix caching {prefix}" + (f", {tp} devices per server (tensor parallel)." if tp > 1 else "."),
        "# Environment: MODEL; LORA_DIR (adapters without a path load from $LORA_DIR/<id>); BIND_HOST (address",
        "# the servers listen on); LOG_DIR (one log per server, gpu<g>.log); NODE=k (only node k's GPUs: GPU g",
        f"# runs on node g // {endpoints.gpus_per_node} as device g % {endpoints.gpus_per_node}; unset: every GPU).",
        "# The servers run in the background; when one exits, the others are stopped and serve.sh exits non-zero.",
        "# Ctrl-C / SIGTERM stop every server. RUNTIME_LORA=1: the servers accept vLLM's runtime adapter loading",
        "# (VLLM_ALLOW_RUNTIME_LORA_UPDATING=True), which a re-plan's migrate.sh needs; VLLM_API_KEY: the servers'",
        "# API key (vLLM reads it from the environment, as --api-key; keep it set with RUNTIME_LORA=1).",
        "set -u",
        f'MODEL="${{MODEL:-{model}}}"',
        'LORA_DIR="${LORA_DIR:-./adapters}"',
        'BIND_HOST="${BIND_HOST:-0.0.0.0}"  # 127.0.0.1: this machine only',
        'LOG_DIR="${LOG_DIR:-$(dirname -- "$0")/logs}"',
        'NODE="${NODE:-all}"',
        f'STOP_GRACE_S="${{STOP_GRACE_S:-{STOP_GRACE_S}}}"  # seconds between SIGTERM and SIGKILL when stopping',
        'RUNTIME_LORA="${RUNTIME_LORA:-0}"',
        'if [ "$RUNTIME_LORA" = 1 ]; then',
        '  export VLLM_ALLOW_RUNTIME_LORA_UPDATING=True',
        '  [ -n "${VLLM_API_KEY:-}" ] || echo "serve.sh: RUNTIME_LORA=1 without VLLM_API_KEY: anyone who reaches the'
        ' servers can load adapters" >&2',
        'fi',
        '[ -z "${VLLM_API_KEY:-}" ] || export VLLM_API_KEY',
        'mkdir -p -- "$LOG_DIR" || exit 1',
        _SERVE_HELPERS,
    ]
    env = [f"{k}={shlex.quote(v)}" for k, v in server_env(plan)]
    for gi, g in enumerate(plan.gpus):
        if not g.adapters:  # vLLM refuses --lora-modules without a value; the plan routes nothing here
            lines.append(f"# GPU {gi}: no adapters, not started")
            continue
        lines.append(f"# GPU {gi}: {len(g.adapters)} adapters, {g.incoming_tok_s:,.0f} tok/s offered, "
                     f"binding: {g.binding}")
        words = ["launch", str(endpoints.node(gi)), str(gi), "env", f"CUDA_VISIBLE_DEVICES={endpoints.devices(gi)}",
                 *env, "vllm", "serve", '"$MODEL"', *serve_args(plan, gi, paths, endpoints)]
        lines.append(" ".join(words))
    lines.append(_SERVE_SUPERVISE.replace("{nodes}", ", ".join(map(str, nodes)) or "none"))
    return "\n".join(lines)


def routes(plan: Plan, endpoints: Endpoints = Endpoints()) -> dict[str, list[dict]]:
    """adapter id -> ``[{gpu, url, weight}]`` (weights sum to 1, largest first)."""
    n = len(plan.gpus)
    endpoints = replace(endpoints, devices_per_server=plan_measured(plan)[2])
    return {a: [{"gpu": gi, "url": endpoints.url(gi, n), "weight": w} for gi, w in lst]
            for a, lst in plan.routes().items()}


def check_out_dir(out: Path) -> Path:
    """Refuse an output directory that cannot be written, before any work starts (the shared rule of
    ``lorapack.checks``: created when missing, never its missing parents), nor one whose output names are
    taken by directories."""
    from ..checks import check_output_dir

    out = check_output_dir(out, "--out")
    for name in (*OUTPUT_FILES, "migrate.json", "migrate.sh"):
        if (out / name).is_dir():
            raise SpecError(f"--out {out}: {out / name} is a directory")
    return out


def write_outputs(plan: Plan, out: Path, paths: dict[str, str] | None = None,
                  endpoints: Endpoints = Endpoints(), extra: dict[str, str] | None = None) -> list[Path]:
    """Write plan.json, serve.sh, routes.json and the router configs into ``out``, and the ``extra`` files
    (name -> text: a re-plan's migrate.json and migrate.sh, ``replan.migrate.migration_files``): every file is
    written to a temporary file first and all are renamed into place only when all were written (nothing
    half-written)."""
    from contextlib import ExitStack

    from ..checks import atomic_path

    out = check_out_dir(out)
    out.mkdir(exist_ok=True)
    route_table = routes(plan, endpoints)
    texts = {
        "plan.json": json.dumps(plan.to_dict(), indent=1) + "\n",
        "serve.sh": serve_script(plan, paths, endpoints),
        "routes.json": json.dumps(route_table, indent=1) + "\n",
        **{c.file_name: c.text for c in router_configs(route_table)},
    }
    texts.update(extra or {})
    with ExitStack() as stack:
        for name, text in texts.items():
            tmp = stack.enter_context(atomic_path(out / name))
            tmp.write_text(text, encoding="utf-8")
            if name.endswith(".sh"):
                tmp.chmod(0o755)
    return [out / name for name in texts]
