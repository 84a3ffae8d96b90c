"""The router configs of ``place --out`` read by the routers themselves (issue 25, item 4), end to end: a plan
with an adapter split over two GPUs, its twin servers (``lorapack serve --plan``), and in front of them

* LiteLLM's proxy started from ``litellm.yaml`` (``litellm --config``): each adapter's requests land only on
  the plan's GPUs (the servers' ``/metrics``), the proxy names the same deployment per request, and the split
  adapter's shares match the plan's weights (each request drawn independently);
* vllm-project/router (``vllm-router --enable-igw``) given its workers by ``vllm-router.sh``: each adapter's
  requests land only on the plan's GPUs, the split adapter's evenly (the router has no weights, as the script
  and ``place`` say).

``slow`` tier. Each router is installed once per machine in its own environment under
``lorapack.twin.jitcache.cache_root()`` (``LORAPACK_CACHE_DIR`` moves it); with ``CI=true`` a failed install
fails the test, elsewhere it skips. lorapack itself depends on neither router.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from lorapack.placement.routers import LITELLM_FILE, VLLM_ROUTER_FILE, server_url
from lorapack.testbed.server import guarded, stop_tree
from lorapack.twin.jitcache import cache_root
from serve_helpers import LLAMA, free_port
from test_serve_router import _ports_free, _router

pytestmark = pytest.mark.slow
LITELLM_VERSION = "1.110.2"
# `litellm[proxy]` pins `litellm-proxy` (and proxy-extras / enterprise releases) that the registry does not
# serve: the proxy's code ships in `litellm` itself, so its extra's other dependencies are named here instead
LITELLM_PROXY_DEPS = (
    "fastapi", "uvicorn", "backoff", "orjson", "apscheduler", "pyjwt", "python-multipart", "cryptography", "rq",
    "websockets", "pynacl", "fastapi-sso", "restrictedpython", "expression", "semver", "tomlkit", "backports-zstd",
    "litellm-enterprise", "litellm-proxy-extras", "mcp>=2.3.0,<3", "httpx2>=2.10.0,<3", "soundfile", "polars",
    "azure-identity", "azure-storage-blob", "gunicorn", "uvloop", "hiredis", "inquirerpy", "rich",
)
# every package of that environment at the version it was proven with (mostly unpinned above: no drift)
LITELLM_CONSTRAINTS = Path(__file__).resolve().parent / "data" / "routers" / f"litellm-{LITELLM_VERSION}-constraints.txt"
# requests per adapter; the split one gets enough for its shares to be told from an even split
REQUESTS_PER_ADAPTER = 4
REQUESTS_SPLIT = 200
# a split adapter's count on a GPU must lie within this many binomial standard deviations of n * weight
SHARE_TOLERANCE_SD = 4.0


def _litellm() -> Path:
    """The ``litellm`` proxy command of a cached environment (installed on first use)."""
    env = cache_root() / f"litellm-{LITELLM_VERSION}"
    exe, done = env / "bin" / "litellm", env / ".lorapack-installed"
    if exe.is_file() and done.is_file():
        return exe
    try:
        subprocess.run([sys.executable, "-m", "venv", str(env)], check=True, capture_output=True, timeout=300)
        subprocess.run([str(env / "bin" / "pip"), "install", "-q", "-c", str(LITELLM_CONSTRAINTS),
                        f"litellm=={LITELLM_VERSION}", *LITELLM_PROXY_DEPS], check=True, capture_output=True,
                       timeout=1800)
    except (subprocess.SubprocessError, OSError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        if os.environ.get("CI") == "true":
            pytest.fail(f"cannot install litellm {LITELLM_VERSION}: {exc} {detail[-2000:]!r}")
        pytest.skip(f"litellm {LITELLM_VERSION} cannot be installed here: {exc}")
    done.write_text("ok\n")
    return exe


def _local(url: str) -> str:
    return server_url(url).replace("localhost", "127.0.0.1")


def _wait_up(url: str, deadline: float, headers: dict[str, str] | None = None) -> None:
    while True:
        try:
            if httpx.get(url, timeout=2, headers=headers).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"{url} did not come up"
        time.sleep(0.3)


def _served(urls: list[str]) -> dict[str, float]:
    """Requests each server finished (``vllm:request_success_total``, every finish reason)."""
    out = {}
    for url in urls:
        text = httpx.get(_local(url) + "/metrics", timeout=30).text
        out[url] = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                       if line.startswith("vllm:request_success_total{"))
    return out


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict]]:
    """A plan with one adapter split over two GPUs, written by ``place --out``, and its twin servers running."""
    tmp = tmp_path_factory.mktemp("fleet")
    wl = tmp / "adapters.csv"
    wl.write_text("adapter_id,rank,rate_rps\nhot,16,40\nsql,8,0.5\nchat,8,0.5\nlegal,16,0.3\n")
    base = free_port()
    while not _ports_free(base, 4):
        base = free_port()
    plan_dir = tmp / "plan"
    p = subprocess.run([sys.executable, "-m", "lorapack.cli", "place", str(wl), "--model", LLAMA, "--out",
                        str(plan_dir), "--no-verify", "--split-hot", "--method", "proposed-exact", "--base-port",
                        str(base)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    routes = json.loads((plan_dir / "routes.json").read_text())
    assert len(routes["hot"]) == 2, routes  # the case the configs must carry: a split adapter
    log = tmp / "serve.log"
    servers = guarded([sys.executable, "-m", "lorapack.cli", "serve", "--plan", str(plan_dir), "--base-port",
                       str(base)], log=log)
    try:
        deadline = time.monotonic() + 300
        for url in sorted({t["url"] for targets in routes.values() for t in targets}):
            _wait_up(_local(url) + "/health", deadline)
        yield plan_dir, routes
    finally:
        stop_tree(servers)
        # the per-GPU servers run in sessions of their own ("(PID n)" in serve's log): never leak one
        for pid in re.findall(r"\(PID (\d+)\)", log.read_text(errors="replace")):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(int(pid), signal.SIGKILL)


def _send(client: httpx.Client, front: str, adapter: str, n: int, headers: dict[str, str]) -> list[httpx.Response]:
    out = []
    for _ in range(n):
        r = client.post(front + "/v1/completions", json={"model": adapter, "prompt": "x", "max_tokens": 1},
                        headers=headers, timeout=60)
        assert r.status_code == 200, (adapter, r.status_code, r.text[:300])
        out.append(r)
    return out


def _landed(routes: dict, client: httpx.Client, front: str, adapter: str, n: int,
            headers: dict[str, str]) -> tuple[dict[int, float], list[httpx.Response]]:
    """Send ``n`` requests for ``adapter`` through the router: GPU -> requests its server finished meanwhile
    (every GPU of the plan, so a request landing off the adapter's GPUs shows)."""
    gpu_url = {t["gpu"]: t["url"] for targets in routes.values() for t in targets}
    before = _served(list(gpu_url.values()))
    responses = _send(client, front, adapter, n, headers)
    after = _served(list(gpu_url.values()))
    return {g: after[u] - before[u] for g, u in gpu_url.items()}, responses


def test_litellm_proxy_from_litellm_yaml_routes_each_adapter_by_the_plans_weights(fleet, tmp_path: Path) -> None:
    exe = _litellm()
    plan_dir, routes = fleet
    key = "sk-" + secrets.token_hex(24)  # the proxy refuses to start without a strong master key
    env = dict(os.environ, LITELLM_MASTER_KEY=key, LITELLM_LOCAL_MODEL_COST_MAP="True")  # no fetch at start
    port = free_port()
    proxy = guarded([str(exe), "--config", str(plan_dir / LITELLM_FILE), "--host", "127.0.0.1", "--port",
                     str(port)], env=env, log=tmp_path / "litellm.log")
    front, auth = f"http://127.0.0.1:{port}", {"Authorization": f"Bearer {key}"}
    try:
        _wait_up(front + "/health/liveliness", time.monotonic() + 600)
        models = httpx.get(front + "/v1/models", headers=auth, timeout=30).json()
        assert sorted(m["id"] for m in models["data"]) == sorted(routes)  # the config as LiteLLM read it
        with httpx.Client() as client:
            for adapter, targets in routes.items():
                n = REQUESTS_SPLIT if len(targets) > 1 else REQUESTS_PER_ADAPTER
                landed, responses = _landed(routes, client, front, adapter, n, auth)
                planned = {t["gpu"]: t["weight"] for t in targets}
                assert {g for g, k in landed.items() if k} <= set(planned), (adapter, landed, planned)
                assert sum(landed.values()) == n, (adapter, landed)
                # the proxy's own account of each request's deployment (model_info.id: "<adapter>@gpu<g>")
                chosen = Counter(int(r.headers["x-litellm-model-id"].rsplit("@gpu", 1)[1]) for r in responses)
                assert {g: float(k) for g, k in chosen.items()} == {g: k for g, k in landed.items() if k}
                for g, w in planned.items():
                    sd = math.sqrt(n * w * (1 - w))
                    assert abs(landed[g] - n * w) <= SHARE_TOLERANCE_SD * max(sd, 0.5), (adapter, g, landed, w)
        split = next(a for a, t in routes.items() if len(t) > 1)
        assert abs(routes[split][0]["weight"] - 0.5) * REQUESTS_SPLIT > SHARE_TOLERANCE_SD * math.sqrt(
            REQUESTS_SPLIT / 4), "the plan's split is too even for this test to tell weights from an even split"
    finally:
        stop_tree(proxy)


@pytest.mark.skipif(sys.platform == "win32", reason="vllm-router.sh needs bash and curl")
def test_vllm_router_given_its_workers_by_vllm_router_sh_routes_each_adapter_to_its_gpus(fleet,
                                                                                        tmp_path: Path) -> None:
    exe = _router()
    plan_dir, routes = fleet
    port = free_port()
    proxy = guarded([str(exe), "--host", "127.0.0.1", "--port", str(port), "--enable-igw", "--policy",
                     "round_robin"], log=tmp_path / "router.log")
    front = f"http://127.0.0.1:{port}"
    try:
        _wait_up(front + "/health", time.monotonic() + 300)
        p = subprocess.run(["bash", str(plan_dir / VLLM_ROUTER_FILE)], env=dict(os.environ, ROUTER_URL=front),
                           capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr
        n_workers = sum(len(t) for t in routes.values())
        assert p.stdout.strip().endswith(f"registered {n_workers} worker(s) with {front}")
        assert "NOT EXPRESSED" in (plan_dir / VLLM_ROUTER_FILE).read_text()  # the split adapter's weights
        time.sleep(1.0)
        with httpx.Client() as client:
            for adapter, targets in routes.items():
                n = 10 * len(targets)
                landed, _ = _landed(routes, client, front, adapter, n, {})
                planned = {t["gpu"] for t in targets}
                assert {g for g, k in landed.items() if k} <= planned, (adapter, landed, planned)
                assert sum(landed.values()) == n, (adapter, landed)
                # round_robin: an even split whatever the plan's weights (what the script and place say)
                assert all(abs(landed[g] - n / len(targets)) <= 1 for g in planned), (adapter, landed)
    finally:
        stop_tree(proxy)
