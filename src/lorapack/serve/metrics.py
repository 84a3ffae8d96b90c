"""``/metrics`` of a twin server: Prometheus text under vLLM's metric names, in twin seconds.

Gauges are read from the engine when scraped (``TwinServer.state``); histograms and counters are updated as
tokens are handed out and requests finish. Every series carries vLLM's ``model_name`` and ``engine`` labels.
Names and labels follow vLLM's V1 metrics (``vllm/v1/metrics/loggers.py``), plus the adapter-residency gauges
vLLM is adding (``vllm:lora_adapter_loaded``, ``vllm:num_gpu_loaded_lora_adapters``,
``vllm:num_cpu_loaded_lora_adapters``, ``vllm:max_gpu_lora_adapters``) and ``lorapack:twin_lag_seconds``
(wall seconds by which a step's tokens were handed out late: the machine did not keep up).
"""

from __future__ import annotations

import math
import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from .twin import RequestStream, TwinServer

# vLLM's default buckets (seconds)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
LAG_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


class _EngineGauges:
    """A custom collector: the gauges of the server now."""

    def __init__(self, twin: TwinServer, labels: dict[str, str]) -> None:
        self.twin, self.labels = twin, labels

    def _gauge(self, name: str, doc: str, value: float, **extra: str) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=[*self.labels, *extra])
        g.add_metric([*self.labels.values(), *extra.values()], value)
        return g

    def collect(self):
        twin = self.twin
        s = twin.state()
        cfg, srv = twin.cfg, twin.srv
        yield self._gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                          s["num_requests_running"])
        yield self._gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                          s["num_requests_waiting"])
        yield self._gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                          s["kv_cache_usage_perc"])
        yield self._gauge("vllm:lora_requests_info", "Running stats on lora requests.", time.time(),
                          max_lora=str(cfg.max_loras), running_lora_adapters=",".join(s["running_lora_adapters"]),
                          waiting_lora_adapters=",".join(s["waiting_lora_adapters"]))
        info = {"block_size": str(cfg.block_size), "num_gpu_blocks": str(cfg.kv_blocks),
                "gpu_memory_utilization": str(srv.gpu_memory_utilization),
                "enable_prefix_caching": str(bool(srv.enable_prefix_caching)), "cache_dtype": "auto"}
        g = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", labels=list(info))
        g.add_metric(list(info.values()), 1.0)
        yield g
        loaded = GaugeMetricFamily("vllm:lora_adapter_loaded", "LoRA adapters resident, by level.",
                                   labels=[*self.labels, "adapter_name", "level", "pinned"])
        for level, key in (("gpu", "gpu_adapters"), ("cpu", "cpu_adapters")):
            for name in s[key]:
                loaded.add_metric([*self.labels.values(), name, level, "false"], 1.0)
        yield loaded
        yield self._gauge("vllm:num_gpu_loaded_lora_adapters", "LoRA adapters in GPU slots.", len(s["gpu_adapters"]))
        yield self._gauge("vllm:num_cpu_loaded_lora_adapters", "LoRA adapters in the CPU cache.",
                          len(s["cpu_adapters"]))
        yield self._gauge("vllm:max_gpu_lora_adapters", "GPU LoRA slots (--max-loras).", cfg.max_loras)
        c = CounterMetricFamily("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                                labels=list(self.labels))
        c.add_metric(list(self.labels.values()), s["n_preemptions"])
        yield c
        counters = twin.engine.counters
        h = HistogramMetricFamily("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                                  labels=list(self.labels))
        h.add_metric(list(self.labels.values()), buckets=[("+Inf", int(counters["step"]))],
                     sum_value=int(counters["scheduled_tokens"]))
        yield h


class TwinMetrics:
    """The registry of one twin server; ``render()`` is the ``/metrics`` body."""

    def __init__(self, twin: TwinServer) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        labels = {"model_name": twin.model_name, "engine": "0"}
        names = list(labels)
        r = self.registry
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              names, buckets=TTFT_BUCKETS, registry=r).labels(**labels)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             names, buckets=ITL_BUCKETS, registry=r).labels(**labels)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             names, buckets=E2E_BUCKETS, registry=r).labels(**labels)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", names,
                                     registry=r).labels(**labels)
        self.generation_tokens = Counter("vllm:generation_tokens", "Number of generation tokens processed.", names,
                                         registry=r).labels(**labels)
        self.success = Counter("vllm:request_success", "Count of successfully processed requests.",
                               [*names, "finished_reason"], registry=r)
        self.lag = Histogram("lorapack:twin_lag_seconds", "Wall seconds by which a step's tokens were handed out "
                             "after their twin time.", buckets=LAG_BUCKETS, registry=r)
        self._labels = labels
        self._frontend_s = twin.frontend_s
        r.register(_EngineGauges(twin, labels))
        twin.on_token = self._on_token
        twin.on_finish = self._on_finish
        twin.on_lag = self.lag.observe

    def _on_token(self, s: RequestStream, n_new: int, gap_s: float) -> None:
        self.generation_tokens.inc(n_new)
        if math.isnan(gap_s):  # the first token (vLLM observes the TTFT then)
            self.prompt_tokens.inc(s.prompt_tokens)
            self.ttft.observe(s.t_first_s - s.t_arr_s + self._frontend_s)
            n_new -= 1
        for _ in range(n_new):
            self.itl.observe(gap_s)

    def _on_finish(self, s: RequestStream, e2e_s: float) -> None:
        if s.aborted:
            self.success.labels(**self._labels, finished_reason="abort").inc()
            return
        self.e2e.observe(e2e_s)
        self.success.labels(**self._labels, finished_reason="length").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
