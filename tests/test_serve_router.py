"""A router no one here wrote in front of ``lorapack serve --plan``: vLLM's Rust router (``vllm-router`` from the
registry, in its own cached environment) in inference-gateway mode routes each adapter's requests to the GPU
that ``routes.json`` names for it (issue "Serve", deliver 4).

``slow`` tier: the router is installed once per machine under ``~/.cache/lorapack/vllm-router-<version>``
(``LORAPACK_CACHE_DIR`` moves it); with ``CI=true`` a failed install fails the test, elsewhere it skips.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from lorapack.testbed.server import guarded, stop_tree
from lorapack.twin.jitcache import cache_root
from serve_helpers import LLAMA, free_port

pytestmark = pytest.mark.slow
ROUTER_VERSION = "0.1.17"


def _router() -> Path:
    env = cache_root() / f"vllm-router-{ROUTER_VERSION}"
    exe = env / "bin" / "vllm-router"
    if exe.is_file():
        return exe
    try:
        subprocess.run([sys.executable, "-m", "venv", str(env)], check=True, capture_output=True, timeout=300)
        subprocess.run([str(env / "bin" / "pip"), "install", "-q", f"vllm-router=={ROUTER_VERSION}"], check=True,
                       capture_output=True, timeout=900)
    except (subprocess.SubprocessError, OSError) as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"cannot install vllm-router {ROUTER_VERSION}: {exc}")
        pytest.skip(f"vllm-router {ROUTER_VERSION} cannot be installed here: {exc}")
    return exe


def _ports_free(base: int, n: int) -> bool:
    for p in range(base, base + n):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p))
            except OSError:
                return False
    return True


def test_vllm_router_routes_by_adapter_to_the_plans_gpus(tmp_path: Path) -> None:
    router = _router()
    examples = Path(__file__).resolve().parents[1] / "src" / "lorapack" / "examples"
    base = free_port()
    while not _ports_free(base, 2):
        base = free_port()
    plan_dir = tmp_path / "plan"
    p = subprocess.run([sys.executable, "-m", "lorapack.cli", "place", str(examples / "adapters.csv"), "--model", LLAMA,
                        "--out", str(plan_dir), "--no-verify", "--gpus", "2", "--method", "round-robin",
                        "--base-port", str(base)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    routes = json.loads((plan_dir / "routes.json").read_text())
    servers = guarded([sys.executable, "-m", "lorapack.cli", "serve", "--plan", str(plan_dir), "--base-port",
                       str(base)])
    router_port = free_port()
    proxy = guarded([str(router), "--host", "127.0.0.1", "--port", str(router_port), "--enable-igw", "--policy",
                     "round_robin"])
    front = f"http://127.0.0.1:{router_port}"
    try:
        urls = sorted({t["url"].removesuffix("/v1").replace("localhost", "127.0.0.1")
                       for targets in routes.values() for t in targets})
        deadline = time.monotonic() + 300
        for url in [*urls, front]:
            while True:
                try:
                    httpx.get(url + "/health", timeout=2)
                    break
                except httpx.HTTPError:
                    assert time.monotonic() < deadline, f"{url} did not start"
                    time.sleep(0.3)
        # register each GPU's server once per adapter it serves (the gateway routes by model id)
        for adapter, targets in routes.items():
            for t in targets:
                url = t["url"].removesuffix("/v1").replace("localhost", "127.0.0.1")
                r = httpx.post(front + "/workers", json={"url": url, "model_id": adapter}, timeout=30)
                assert r.status_code < 300, r.text
        time.sleep(1.0)
        per_gpu: dict[str, int] = {}
        for _round in range(3):
            for adapter, targets in routes.items():
                r = httpx.post(front + "/v1/completions", json={"model": adapter, "prompt": "x", "max_tokens": 2},
                               timeout=60)
                assert r.status_code == 200, (adapter, r.status_code, r.text[:200])
                url = targets[0]["url"]
                per_gpu[url] = per_gpu.get(url, 0) + 1
        for url, n in per_gpu.items():  # each GPU served exactly the requests of its own adapters
            text = httpx.get(url.removesuffix("/v1").replace("localhost", "127.0.0.1") + "/metrics", timeout=30).text
            done = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                       if line.startswith("vllm:request_success_total{"))
            assert done == n, (url, done, n)
    finally:
        stop_tree(proxy)
        stop_tree(servers)
