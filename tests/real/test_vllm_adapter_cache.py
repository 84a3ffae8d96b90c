"""Adapter residency on a real vLLM (the testbed's 0.32 CPU build) against the twin: warm start, LRU eviction on
the GPU slots (``--max-loras``) and in the CPU cache (``--max-cpu-loras``).

Residency is not in ``/metrics``; the LoRA manager logs it at DEBUG level (``vllm/lora/model_manager.py``):
"Adding lora. Model id: N" when an adapter is loaded from disk into the CPU cache, "Activating LoRA. int id: N,
slot index: K" when it takes a GPU slot, "Removing adapter int id: N" when it leaves a cache (just before the
load or activation it makes room for). Static adapters get int ids 1, 2, ... in ``--lora-modules`` order.
"""

from __future__ import annotations

import re
import time

import pytest

from lorapack.profile import find_profile
from lorapack.server import ServerConfig
from lorapack.testbed.env import VLLM_VERSION
from lorapack.testbed.replay import Arrival, twin_replay
from lorapack.testbed.staircase import ADAPTERS, RANKS

pytestmark = pytest.mark.real

SLOTS, CPU_SLOTS = 2, 4
FLAGS = ["--max-loras", str(SLOTS), "--max-cpu-loras", str(CPU_SLOTS), "--max-lora-rank", "32",
         "--max-model-len", "256"]
EVENT = re.compile(r"(Adding lora)\. Model id: (\d+)|(Activating LoRA)\. int id: (\d+), slot index: (\d+)"
                   r"|(Removing adapter) int id: (\d+)")
# one request at a time; chosen so that an LRU cache and a FIFO cache would evict differently (r16-0 is used
# again right after warm start, so LRU keeps it where FIFO would drop it)
SEQUENCE = ("r16-0", "r8-0", "r16-0", "r32-1", "r8-1", "r16-1", "r8-0", "r32-0", "r16-0")


def events(log: str) -> list[tuple[str, int]]:
    """``("disk", id)``, ``("gpu", id)``, ``("evict", id)`` in log order."""
    out = []
    for m in EVENT.finditer(log):
        if m.group(1):
            out.append(("disk", int(m.group(2))))
        elif m.group(3):
            out.append(("gpu", int(m.group(4))))
        else:
            out.append(("evict", int(m.group(7))))
    return out


def residency(evs: list[tuple[str, int]]) -> tuple[list[int], list[int], list[tuple[str, int]]]:
    """Replay log events: ``(CPU-resident ids, GPU-resident ids, evictions as ("cpu"|"gpu", id))``. A removal
    right before a disk load is a CPU eviction, right before an activation a GPU one."""
    cpu: list[int] = []
    gpu: list[int] = []
    evictions = []
    for k, (kind, a) in enumerate(evs):
        if kind == "disk":
            cpu.append(a)
        elif kind == "gpu":
            gpu.append(a)
        else:
            nxt = next((e for e in evs[k + 1:] if e[0] != "evict"), None)
            which = "cpu" if nxt is not None and nxt[0] == "disk" else "gpu"
            evictions.append((which, a))
            if which == "cpu" and a in cpu:
                cpu.remove(a)
                if a in gpu:
                    gpu.remove(a)
            elif which == "gpu" and a in gpu:
                gpu.remove(a)
    return sorted(cpu), sorted(gpu), evictions


def lru_model(sequence: list[int], n_adapters: int) -> list[tuple[bool, bool, int | None, int | None]]:
    """The twin's documented rule (docs/engine-semantics.md, "Warm start" and step 5) for one request at a time:
    per request ``(disk load, GPU load, CPU-evicted id, GPU-evicted id)``; ids are 1-based registration order."""
    cpu = list(range(n_adapters - CPU_SLOTS + 1, n_adapters + 1))  # least recently used first
    gpu = list(range(n_adapters - SLOTS + 1, n_adapters + 1))
    out = []
    for a in sequence:
        cpu_evicted = gpu_evicted = None
        disk = a not in cpu
        if disk:
            cpu_evicted = cpu.pop(0)
            if cpu_evicted in gpu:
                gpu.remove(cpu_evicted)
        else:
            cpu.remove(a)
        cpu.append(a)
        load = a not in gpu
        if load:
            if len(gpu) == SLOTS:
                gpu_evicted = gpu.pop(0)
        else:
            gpu.remove(a)
        gpu.append(a)
        out.append((disk, load, cpu_evicted, gpu_evicted))
    return out


@pytest.fixture(scope="module")
def cache_server(testbed, tmp_path_factory):
    from lorapack.testbed.server import start_server

    server = start_server(testbed, ADAPTERS, FLAGS, tmp_path_factory.mktemp("lru"),
                          env={"VLLM_LOGGING_LEVEL": "DEBUG"})
    yield server
    server.stop()


def _wait_for_events(server, n_before: int, timeout_s: float = 10.0) -> list[tuple[str, int]]:
    """The events logged after the first ``n_before``, once the log has been quiet for half a second."""
    deadline = time.monotonic() + timeout_s
    last, stable_since = -1, time.monotonic()
    while time.monotonic() < deadline:
        evs = events(server.log_text())
        if len(evs) != last:
            last, stable_since = len(evs), time.monotonic()
        elif time.monotonic() - stable_since >= 0.5:
            break
        time.sleep(0.1)
    return events(server.log_text())[n_before:]


def test_warm_start_lru_eviction_and_the_cpu_cache(cache_server):
    server = cache_server
    n = len(ADAPTERS)
    # warm start: the last registered adapters are resident, CPU_SLOTS in the CPU cache, SLOTS on the GPU
    cpu, gpu, _ = residency(_wait_for_events(server, 0))
    assert cpu == list(range(n - CPU_SLOTS + 1, n + 1))
    assert gpu == list(range(n - SLOTS + 1, n + 1))
    ids = [ADAPTERS.index(a) + 1 for a in SEQUENCE]
    expected = lru_model(ids, n)
    seen = []
    for adapter_id in SEQUENCE:
        before = len(events(server.log_text()))
        status, body = server.post("/v1/completions", {"model": adapter_id, "prompt": [5, 6, 7], "max_tokens": 2})
        assert status == 200, body
        evs = _wait_for_events(server, before)
        _, _, evictions = residency(evs)
        disk = any(k == "disk" for k, _ in evs)
        load = any(k == "gpu" for k, _ in evs)
        cpu_ev = next((a for w, a in evictions if w == "cpu"), None)
        gpu_ev = next((a for w, a in evictions if w == "gpu"), None)
        seen.append((disk, load, cpu_ev, gpu_ev))
    assert seen == expected


def test_the_twin_loads_adapters_as_the_server_does():
    """The twin, given the same one-at-a-time requests and flags, makes the same disk loads and GPU loads per
    request as the LRU rule the server follows (``lru_model``, pinned against the server above)."""
    llama = find_profile("llama-3.1-8b-instruct")
    flags = ServerConfig(max_loras=SLOTS, max_cpu_loras=CPU_SLOTS, max_lora_rank=32, max_model_len=256,
                        vllm_version=VLLM_VERSION)
    ids = [ADAPTERS.index(a) + 1 for a in SEQUENCE]
    expected = lru_model(ids, len(ADAPTERS))
    previous = (0, 0)
    for k in range(1, len(SEQUENCE) + 1):
        arrivals = [Arrival(1.0 * i, a, 3, 2) for i, a in enumerate(SEQUENCE[:k])]
        _, engine = twin_replay(llama, ADAPTERS, RANKS, arrivals, flags, 1.0 * k + 5.0)
        counts = (engine.n_disk_loads, engine.n_gpu_loads)
        disk, load, _, _ = expected[k - 1]
        assert (counts[0] - previous[0], counts[1] - previous[1]) == (int(disk), int(load)), (k, SEQUENCE[k - 1])
        previous = counts
