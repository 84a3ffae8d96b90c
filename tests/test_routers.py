"""Router configs written by ``place --out`` (issue 25, item 4): ``litellm.yaml`` and ``vllm-router.sh``.

Fast tier: the text parses (YAML; bash, and the bodies a fake router receives are JSON) with the structure the
routers read, one deployment / worker per (adapter, GPU), each adapter's weights summing to 1, split adapters
flagged where the router cannot weight them, any adapter id carried, the same plan giving the same bytes.
The routers' own parsers and end-to-end routing: tests/test_routers_real.py (slow tier).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import stat
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from data_helpers import run_main
from lorapack.placement.export import OUTPUT_FILES, Endpoints, routes, write_outputs
from lorapack.placement.plan import GpuPlan, Plan
from lorapack.placement.routers import (
    LITELLM_FILE,
    LITELLM_PROVIDER,
    LITELLM_STRATEGY,
    ROUTER_FILES,
    VLLM_ROUTER_FILE,
    litellm_config,
    router_configs,
    server_url,
    split_adapters,
    vllm_router_script,
)
from lorapack.server import ServerConfig

LLAMA = "llama-3.1-8b-instruct"
# ids a YAML plain scalar, a shell word or a JSON body could break on; plus what YAML reads as a line break
ODD_IDS = ["a=b", "x,y", "-lead", "has space", "it's", 'dq"uote', "$HOME", "back\\slash", "ünï", "#hash",
           "key: value", "[red]markup[/red]", "line\nbreak", "nel\x85", "ls\u2028", "emoji\U0001f600", "null", "1.5"]


def _gpu(adapters: list[str], weights: list[float]) -> GpuPlan:
    n = len(adapters)
    return GpuPlan(adapters=adapters, weights=weights,
                   server=ServerConfig(max_loras=n, max_lora_rank=16, max_cpu_loras=n, max_num_seqs=256,
                                       max_num_batched_tokens=2048, max_model_len=8192), incoming_tok_s=100.0)


def _plan() -> Plan:
    """Three GPUs; "hot" split 0.5 / 0.3 / 0.2 (the plan's weights are per-GPU request shares, unnormalised
    here on purpose: routes normalise them), "warm" split 1:3, the odd ids on one GPU each but one."""
    return Plan(method="proposed", model=LLAMA, gpu_type="h100-64gb", gpus=[
        _gpu(["hot", "warm", *ODD_IDS[:9]], [1.0, 0.25] + [1.0] * 9),
        _gpu(["hot", "warm", *ODD_IDS[9:]], [0.6, 0.75] + [1.0] * 9),
        _gpu(["hot", "solo", "line\nbreak"], [0.4, 1.0, 1.0]),  # an id with a line break, split 1:1
    ])


def _routes(plan: Plan | None = None) -> dict:
    return routes(plan or _plan(), Endpoints(base_port=18000))


def test_litellm_yaml_is_a_model_list_with_the_plans_weights() -> None:
    table = _routes()
    config = litellm_config(table)
    assert config.file_name == LITELLM_FILE and config.unexpressed == []  # LiteLLM weights deployments
    doc = yaml.safe_load(config.text)
    assert set(doc) == {"model_list", "router_settings"}
    assert doc["router_settings"] == {"routing_strategy": LITELLM_STRATEGY}
    deployments = doc["model_list"]
    assert len(deployments) == sum(len(t) for t in table.values())  # one per (adapter, GPU)
    by_adapter: dict[str, list[dict]] = {}
    for d in deployments:
        assert set(d) == {"model_name", "litellm_params", "model_info"}
        assert set(d["litellm_params"]) == {"model", "api_base", "weight"}
        by_adapter.setdefault(d["model_name"], []).append(d)
    assert set(by_adapter) == set(table)  # every id read back exactly, the odd ones too
    for adapter, targets in table.items():
        got = by_adapter[adapter]
        assert [d["litellm_params"]["api_base"] for d in got] == [t["url"] for t in targets]
        assert all(d["litellm_params"]["model"] == f"{LITELLM_PROVIDER}/{adapter}" for d in got)
        assert [d["model_info"]["gpu"] for d in got] == [t["gpu"] for t in targets]
        assert [d["litellm_params"]["weight"] for d in got] == [t["weight"] for t in targets]  # exact floats
        assert math.isclose(sum(d["litellm_params"]["weight"] for d in got), 1.0)
    ids = [d["model_info"]["id"] for d in deployments]
    assert len(set(ids)) == len(ids)  # LiteLLM keys deployments by model_info.id
    hot = {d["model_info"]["gpu"]: d["litellm_params"]["weight"] for d in by_adapter["hot"]}
    assert hot == pytest.approx({0: 0.5, 1: 0.3, 2: 0.2})
    assert {d["model_info"]["gpu"]: d["litellm_params"]["weight"] for d in by_adapter["warm"]} == \
        pytest.approx({0: 0.25, 1: 0.75})
    # the header says what weight means and which adapters are split
    header = config.text.split("model_list:")[0]
    assert "drawn independently per request" in header and "\"hot\" (GPU 0 0.500" in header


def test_vllm_router_script_flags_the_weights_it_cannot_express() -> None:
    table = _routes()
    config = vllm_router_script(table)
    assert config.file_name == VLLM_ROUTER_FILE
    assert set(split_adapters(table)) == {"hot", "warm", "line\nbreak"}
    assert len(config.unexpressed) == 3
    hot = next(n for n in config.unexpressed if "'hot'" in n)
    assert "GPU 0 0.500, GPU 1 0.300, GPU 2 0.200" in hot and "0.333 of its requests to each" in hot
    assert "# NOT EXPRESSED" in config.text
    for note in config.unexpressed:
        assert f"#   {note}" in config.text and "\n" not in note
    # nothing to flag when no adapter is split
    single = {"a": [{"gpu": 0, "url": "http://h:8000/v1", "weight": 1.0}]}
    assert vllm_router_script(single).unexpressed == [] and "NOT EXPRESSED" not in vllm_router_script(single).text


def test_configs_are_deterministic_and_follow_the_routes_order() -> None:
    first = [(c.file_name, c.text) for c in router_configs(_routes())]
    assert first == [(c.file_name, c.text) for c in router_configs(_routes(_plan()))]
    assert [name for name, _ in first] == list(ROUTER_FILES)
    assert server_url("http://gpu-node-1:8003/v1") == "http://gpu-node-1:8003"
    assert server_url("http://h:8000/v1/") == "http://h:8000"


def test_empty_routes_give_loadable_files() -> None:
    doc = yaml.safe_load(litellm_config({}).text)
    assert doc["model_list"] == []
    assert "registered 0 worker(s)" in vllm_router_script({}).text


class _FakeRouter(BaseHTTPRequestHandler):
    """Records each ``POST /workers`` body and header; answers 200, or 400 for model ids in ``refuse``."""

    received: list[tuple[dict, str | None]] = []
    refuse: set[str] = set()

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        type(self).received.append((body, self.headers.get("authorization")))
        code = 400 if self.path != "/workers" or body.get("model_id") in self.refuse else 200
        self.send_response(code)
        self.send_header("content-length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def fake_router() -> Iterator[str]:
    _FakeRouter.received, _FakeRouter.refuse = [], set()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeRouter)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _run_script(path: Path, router_url: str, api_key: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "ROUTER_API_KEY"}
    env["ROUTER_URL"] = router_url
    if api_key is not None:
        env["ROUTER_API_KEY"] = api_key
    return subprocess.run(["bash", str(path)], env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("curl") is None, reason="needs bash and curl")
def test_vllm_router_script_posts_one_worker_per_adapter_and_gpu(tmp_path: Path, fake_router: str) -> None:
    table = _routes()
    script = tmp_path / VLLM_ROUTER_FILE
    script.write_text(vllm_router_script(table).text, encoding="utf-8")
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    p = _run_script(script, fake_router)
    assert p.returncode == 0, p.stderr
    n = sum(len(t) for t in table.values())
    assert p.stdout.strip() == f"registered {n} worker(s) with {fake_router}"
    expected = [{"url": f"http://localhost:{18000 + t['gpu']}", "model_id": a}
                for a, targets in table.items() for t in targets]
    assert [body for body, _ in _FakeRouter.received] == expected  # every odd id intact, in routes order
    assert all(auth is None for _, auth in _FakeRouter.received)
    # the router's API key, when it has one
    _FakeRouter.received = []
    assert _run_script(script, fake_router, api_key="s3cret").returncode == 0
    assert {auth for _, auth in _FakeRouter.received} == {"Bearer s3cret"}
    # a refused registration stops the script with one line naming the worker
    _FakeRouter.received, _FakeRouter.refuse = [], {"warm"}
    p = _run_script(script, fake_router)
    assert p.returncode == 1
    assert [body["model_id"] for body, _ in _FakeRouter.received] == ["hot", "hot", "hot", "warm"]
    assert f"vllm-router.sh: {fake_router} refused worker" in p.stderr and '"model_id": "warm"' in p.stderr


def test_place_out_writes_the_router_configs_and_says_what_they_cannot_express(tmp_path: Path, monkeypatch,
                                                                               capsys) -> None:
    written = write_outputs(_plan(), tmp_path / "out", endpoints=Endpoints(base_port=18000))
    assert [p.name for p in written] == list(OUTPUT_FILES) and set(ROUTER_FILES) <= set(OUTPUT_FILES)
    table = json.loads((tmp_path / "out" / "routes.json").read_text())
    assert (tmp_path / "out" / LITELLM_FILE).read_text() == litellm_config(table).text
    script = tmp_path / "out" / VLLM_ROUTER_FILE
    assert script.read_text() == vllm_router_script(table).text and script.stat().st_mode & stat.S_IXUSR
    # the command: one hot adapter that no GPU holds alone, split by --split-hot
    wl = tmp_path / "adapters.csv"
    wl.write_text("adapter_id,rank,rate_rps\nhot,16,40\nsql,8,0.5\nchat,8,0.5\n")
    code, out, err = run_main(monkeypatch, capsys, "place", wl, "--model", LLAMA, "--method", "proposed-exact",
                              "--no-verify", "--split-hot", "--out", tmp_path / "cli")
    assert code == 0, err
    table = json.loads((tmp_path / "cli" / "routes.json").read_text())
    assert len(table["hot"]) > 1
    text = " ".join(out.split())
    assert f"{VLLM_ROUTER_FILE}: vllm-router cannot weight the GPUs of 'hot'" in text
    assert all(f"GPU {t['gpu']} {t['weight']:.3f}" in text for t in table["hot"])
    assert f"{LITELLM_FILE}:" not in text  # LiteLLM carries the weights
