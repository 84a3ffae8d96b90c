"""What ``lorapack measure`` learns about a running vLLM server without sending it work: its identity.

From the HTTP API: the version (``/version``), the served model and its context limit and the served LoRA
adapters (``/v1/models``), ``--max-loras`` (``vllm:lora_requests_info``, once a LoRA request has run), the KV
cache (``vllm:cache_config_info``: block size, blocks, ``--gpu-memory-utilization``, prefix caching), the load
(``vllm:num_requests_running`` / ``_waiting``) and the engine's step counter (``vllm:iteration_tokens_total``:
one observation per engine step). From the server's start-up log when given (``--log``): the non-default flags
("non-default args: {...}"), the KV capacity line, the device and the tensor-parallel size. Flags neither
source gives come from ``--server-args`` (the command line the server was started with).
"""

from __future__ import annotations

import json
import re
import shlex
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import LorapackError


class MeasureError(LorapackError):
    """A bad input of ``lorapack measure`` or a server it cannot measure (one line, exit code 2)."""


def check_url(url: str) -> str:
    """``http(s)://host[:port]`` without a path (the OpenAI routes are appended), trailing slash removed."""
    u = urllib.parse.urlsplit(url.strip())
    if u.scheme not in ("http", "https") or not u.hostname or u.path.strip("/") or u.query:
        raise MeasureError(f"--url {url!r}: expected the server's base address, e.g. http://127.0.0.1:8000")
    return f"{u.scheme}://{u.netloc}"


@dataclass
class Http:
    """Blocking GETs and POSTs on one server (``api_key`` sent as a bearer token)."""

    url: str
    api_key: str | None = None
    timeout_s: float = 30.0

    def _request(self, path: str, body: dict | None = None) -> urllib.request.Request:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = None if body is None else json.dumps(body).encode()
        return urllib.request.Request(self.url + path, data=data, headers=headers)

    def text(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self._request(path), timeout=self.timeout_s) as r:
                return r.status, r.read().decode(errors="replace")
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode(errors="replace")
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise MeasureError(f"--url {self.url}: no vLLM server answers there ({reason})") from None

    def json(self, path: str, body: dict | None = None) -> tuple[int, dict]:
        try:
            with urllib.request.urlopen(self._request(path, body), timeout=self.timeout_s) as r:
                raw = r.read()
                status = r.status
        except urllib.error.HTTPError as e:
            raw, status = e.read(), e.code
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise MeasureError(f"--url {self.url}: no vLLM server answers there ({reason})") from None
        try:
            return status, json.loads(raw or b"{}")
        except json.JSONDecodeError:
            return status, {"raw": raw.decode(errors="replace")[:200]}


# ---------------------------------------------------------------------------------------------------------
# /metrics


@dataclass
class Scrape:
    """The gauges and counters of one ``/metrics`` page that ``measure`` reads."""

    running: float = 0.0
    waiting: float = 0.0
    max_lora: int | None = None
    cache: dict[str, str] = field(default_factory=dict)  # labels of vllm:cache_config_info
    steps: float = 0.0  # engine steps so far (count of vllm:iteration_tokens_total)
    step_tokens: float = 0.0  # tokens scheduled in them (its sum)
    preemptions: float = 0.0

    @property
    def kv_cache_tokens(self) -> int | None:
        c = self.cache
        if c.get("num_gpu_blocks", "None") not in ("None", "") and c.get("block_size", "None") not in ("None", ""):
            return int(float(c["num_gpu_blocks"])) * int(float(c["block_size"]))
        if c.get("kv_cache_size_tokens", "None") not in ("None", ""):
            return int(float(c["kv_cache_size_tokens"]))
        return None


def parse_scrape(text: str) -> Scrape:
    from prometheus_client.parser import text_string_to_metric_families

    wanted = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:lora_requests_info",
              "vllm:cache_config_info", "vllm:iteration_tokens_total_count", "vllm:iteration_tokens_total_sum",
              "vllm:num_preemptions_total")
    page = "\n".join(ln for ln in text.splitlines() if ln.startswith(wanted) or
                     (ln.startswith("# TYPE") and any(w.split("_total")[0] in ln for w in wanted)))
    s = Scrape()
    lora_stamp = -1.0
    for family in text_string_to_metric_families(page):
        for m in family.samples:
            if m.name == "vllm:num_requests_running":
                s.running += m.value
            elif m.name == "vllm:num_requests_waiting":
                s.waiting += m.value
            elif m.name == "vllm:lora_requests_info" and m.value >= lora_stamp:
                lora_stamp = m.value
                s.max_lora = int(float(m.labels["max_lora"])) if m.labels.get("max_lora") else None
            elif m.name == "vllm:cache_config_info":
                s.cache = dict(m.labels)
            elif m.name == "vllm:iteration_tokens_total_count":
                s.steps += m.value
            elif m.name == "vllm:iteration_tokens_total_sum":
                s.step_tokens += m.value
            elif m.name == "vllm:num_preemptions_total":
                s.preemptions += m.value
    return s


def scrape(http: Http) -> Scrape:
    status, text = http.text("/metrics")
    if status != 200:
        raise MeasureError(f"--url {http.url}: /metrics answered {status}; measure needs vLLM's Prometheus metrics")
    return parse_scrape(text)


# ---------------------------------------------------------------------------------------------------------
# start-up log and server arguments

# the flags measure needs, by vLLM's argument name (the keys of "non-default args")
FLAG_KEYS = ("max_loras", "max_lora_rank", "max_cpu_loras", "max_num_seqs", "max_num_batched_tokens",
             "tensor_parallel_size", "gpu_memory_utilization", "enable_prefix_caching", "max_model_len")
_ARG = re.compile(r"'(\w+)': ('[^']*'|[-\w.]+)")


def _value(raw: str) -> int | float | bool | str:
    raw = raw.strip().strip("'")
    if raw in ("True", "true"):
        return True
    if raw in ("False", "false"):
        return False
    for kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            pass
    return raw


def read_log(path: Path) -> dict:
    """Flags, KV capacity, device and version from a vLLM start-up log (missing items are left out)."""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError as e:
        raise MeasureError(f"--log {path}: cannot read it ({e.strerror or e})") from None
    out: dict = {}
    for line in text.splitlines():
        if "non-default args:" in line:
            for key, raw in _ARG.findall(line.split("non-default args:", 1)[1]):
                if key in FLAG_KEYS:
                    out[key] = _value(raw)
        m = re.search(r"(GPU|CPU|XPU|TPU|HPU)? ?KV cache size: ([\d,]+) tokens", line)
        if m:
            out["kv_cache_tokens"] = int(m.group(2).replace(",", ""))
        m = re.search(r"max_num_batched_tokens=(\d+)", line)
        if m and "max_num_batched_tokens" not in out:
            out["max_num_batched_tokens"] = int(m.group(1))
        m = re.search(r"Initializing a V1 LLM engine \(v([^)]+)\)", line)
        if m:
            out["vllm_version"] = m.group(1)
        for key in ("device_config", "tensor_parallel_size"):
            m = re.search(rf"\b{key}=([\w.:-]+)", line)
            if m:
                out["device" if key == "device_config" else key] = _value(m.group(1))
    return out


def parse_server_args(args: str) -> dict:
    """The flags of a ``vllm serve`` command line (``--max-loras 8``, ``--max-loras=8``,
    ``--[no-]enable-prefix-caching``); others are ignored."""
    try:
        words = shlex.split(args)
    except ValueError as e:
        raise MeasureError(f"--server-args {args!r}: not a command line ({e})") from None
    out: dict = {}
    for i, w in enumerate(words):
        if not w.startswith("--"):
            continue
        name, eq, val = w[2:].partition("=")
        key = name.replace("-", "_")
        if key == "enable_prefix_caching":
            out[key] = True
        elif key == "no_enable_prefix_caching":
            out["enable_prefix_caching"] = False
        elif key in FLAG_KEYS:
            if not eq:
                if i + 1 >= len(words) or words[i + 1].startswith("--"):
                    raise MeasureError(f"--server-args: {w} has no value")
                val = words[i + 1]
            out[key] = _value(val)
    return out


# ---------------------------------------------------------------------------------------------------------
# identity


@dataclass
class Identity:
    """The server being measured (what ``calibrate`` records in the profile)."""

    url: str
    vllm_version: str
    model: str  # the served model's id (the base model of /v1/models)
    max_model_len: int
    served_adapters: list[str]
    max_loras: int
    max_lora_rank: int
    max_cpu_loras: int
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_cache_tokens: int
    block_size: int
    gpu_memory_utilization: float | None
    prefix_caching: bool | None
    device: str | None
    tensor_parallel_size: int
    per_request_metrics: bool
    sources: dict[str, str] = field(default_factory=dict)

    def key(self) -> dict:
        """What must match for a measurement directory to be resumed against this server."""
        return {k: getattr(self, k) for k in ("vllm_version", "model", "max_loras", "max_lora_rank",
                                              "max_cpu_loras", "max_num_seqs", "max_num_batched_tokens",
                                              "kv_cache_tokens")}


def served(http: Http) -> tuple[str, int | None, list[str]]:
    """``(base model id, its max_model_len, LoRA adapter ids)`` from ``/v1/models``."""
    status, body = http.json("/v1/models")
    if status == 401:
        raise MeasureError(f"--url {http.url}: the server wants an API key (401); pass --api-key")
    data = body.get("data") if isinstance(body, dict) else None
    if status != 200 or not data:
        raise MeasureError(f"--url {http.url}: /v1/models answered {status} without models; is it a vLLM "
                           "OpenAI-compatible server?")
    base = [m for m in data if not m.get("parent")]
    base_id = (base or data)[0]["id"]
    adapters = [m["id"] for m in data if m.get("parent")]
    mml = (base or data)[0].get("max_model_len")
    return base_id, int(mml) if mml else None, adapters


def version(http: Http) -> str:
    status, body = http.json("/version")
    if status != 200 or "version" not in body:
        raise MeasureError(f"--url {http.url}: /version answered {status}; measure needs a vLLM server")
    return str(body["version"])
