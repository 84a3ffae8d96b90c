"""``lorapack serve``: the twin behind vLLM's HTTP API, driven by real clients (``openai``, ``httpx``).

One server process per module (loopback, free port, stopped with its process group); the engine-level
behaviour (live engine = batch engine) is in ``test_engine_live.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from lorapack.serve.launch import parse_lora_modules
from lorapack.serve.twin import LoraModule
from serve_helpers import LLAMA, twin_server

MODULES = ["a0=/adapters/a0", "a1=/adapters/a1", '{"name": "r32", "path": "/adapters/r32", "rank": 32}',
           '{"name": "a3", "path": "/adapters/a3", "rank": 8}']
FLAGS = ("--model", LLAMA, "--enable-lora", "--max-loras", "2", "--max-lora-rank", "32", "--max-model-len", "4096",
         "--time-scale", "5", "--api-key", "sekret", "--http-path-ms", "1.5", "--lora-modules", *MODULES)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with twin_server(*FLAGS, env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}, log=log) as url:
        yield url


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="sekret", max_retries=0, timeout=60)


def _post(url: str, path: str, body, **kw) -> httpx.Response:
    headers = {"Authorization": "Bearer sekret", **kw.pop("headers", {})}
    content = body if isinstance(body, bytes | str) else json.dumps(body)
    return httpx.post(url + path, content=content, headers={"content-type": "application/json", **headers},
                      timeout=60, **kw)


def test_openai_completions_and_chat(server) -> None:
    c = _client(server)
    ids = [m.id for m in c.models.list().data]
    assert ids == [LLAMA, "a0", "a1", "r32", "a3"]
    r = c.completions.create(model="a1", prompt="one two three four", max_tokens=7)
    assert r.usage.completion_tokens == 7 and r.usage.prompt_tokens == 5  # 19 bytes / 4, rounded up
    assert r.choices[0].finish_reason == "length" and len(r.choices[0].text.split()) == 7
    chunks = list(c.completions.create(model="r32", prompt=[1, 2, 3], max_tokens=5, stream=True,
                                       stream_options={"include_usage": True}))
    texts = [ch.choices[0].text for ch in chunks if ch.choices]
    assert len(texts) == 5 and chunks[-1].usage.prompt_tokens == 3 and chunks[-1].usage.completion_tokens == 5
    chat = c.chat.completions.create(model=LLAMA, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert chat.usage.completion_tokens == 4 and chat.choices[0].message.role == "assistant"
    stream = c.chat.completions.create(model="a0", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                       stream=True)
    deltas = [ch.choices[0].delta.content for ch in stream if ch.choices]
    assert deltas[0] == "" and len([d for d in deltas[1:] if d]) == 3


def test_errors_are_vllms(server) -> None:
    c = _client(server)
    with pytest.raises(openai.NotFoundError, match="The model `nope` does not exist"):
        c.completions.create(model="nope", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="maximum context length is 4096"):
        c.completions.create(model="a0", prompt=list(range(4096)), max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="you requested 10000001 tokens"):
        c.completions.create(model="a0", prompt="x", max_tokens=10_000_000)
    r = _post(server, "/v1/completions", b'{"model": "a0", "prompt": ')
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]
    r = _post(server, "/v1/completions", b"x" * (5 * 1024 * 1024))
    assert r.status_code == 413
    r = httpx.post(server + "/v1/completions", json={"model": "a0", "prompt": "x"}, timeout=30)
    assert r.status_code == 401  # no api key
    assert httpx.get(server + "/health", timeout=30).status_code == 200  # not a /v1 route: open


def test_runtime_adapters(server) -> None:
    r = _post(server, "/v1/load_lora_adapter", {"lora_name": "big", "lora_path": "/x", "rank": 64})
    assert r.status_code == 400 and "LoRA rank 64 is greater than max_lora_rank 32" in r.json()["error"]["message"]
    r = _post(server, "/v1/load_lora_adapter", {"lora_name": "new", "lora_path": "/x/new", "rank": 16})
    assert r.status_code == 200, r.text
    r = _post(server, "/v1/load_lora_adapter", {"lora_name": "new", "lora_path": "/x/new"})
    assert r.status_code == 400 and "already been loaded" in r.text
    assert _client(server).completions.create(model="new", prompt="x", max_tokens=2).usage.completion_tokens == 2
    assert _post(server, "/v1/unload_lora_adapter", {"lora_name": "new"}).status_code == 200
    r = _post(server, "/v1/unload_lora_adapter", {"lora_name": "new"})
    assert r.status_code == 404
    with pytest.raises(openai.NotFoundError):
        _client(server).completions.create(model="new", prompt="x", max_tokens=2)


def test_runtime_loading_needs_the_env_variable() -> None:
    with twin_server("--model", LLAMA, "--enable-lora", "--lora-modules", "a=/a") as url:
        r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": "/b"}, timeout=30)
        assert r.status_code == 404
        v = httpx.get(url + "/version", timeout=30).json()
        assert v["version"] == "0.8.5" and v["time_scale"] == 1.0 and v["twin"] is True
        # no --http-path-ms: the start-up probe measures the server's own HTTP path (loopback round trips)
        deadline = time.monotonic() + 60
        while v["http_path_ms"] == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
            v = httpx.get(url + "/version", timeout=30).json()
        assert 0 < v["http_path_ms"] < v["frontend_ms"]


def test_http_path_is_taken_out_of_the_frontend_share(server) -> None:
    from lorapack.profile import find_profile
    from lorapack.serve.twin import TwinServer
    from lorapack.server import ServerConfig

    v = httpx.get(server + "/version", timeout=30).json()
    assert v["http_path_ms"] == 1.5  # --http-path-ms: no probe
    twin = TwinServer(find_profile(LLAMA), ServerConfig(max_loras=1), [], enable_lora=True, time_scale=2.0)
    front = twin.frontend_s
    assert front > 0.005
    twin.set_http_path_s(0.004)
    assert twin.publish_wall(1.0) == pytest.approx(twin.wall_at(1.0 + front) - 0.004)
    twin.set_http_path_s(1.0)  # never before the step's own end
    assert twin.publish_wall(1.0) == twin.wall_at(1.0)
    for bad in (-0.001, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="HTTP path"):
            twin.set_http_path_s(bad)


def _scrape(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def _metric(scrape: dict[str, float], prefix: str) -> float:
    return sum(v for k, v in scrape.items() if k.startswith(prefix))


def test_disconnect_mid_stream_aborts_and_the_server_lives(server) -> None:
    async def go() -> None:
        async with httpx.AsyncClient(timeout=60, headers={"Authorization": "Bearer sekret"}) as client:
            body = {"model": "a0", "prompt": "x", "max_tokens": 3000, "stream": True}
            async with client.stream("POST", server + "/v1/completions", json=body) as r:
                assert r.status_code == 200
                n = 0
                async for line in r.aiter_lines():
                    n += line.startswith("data:")
                    if n >= 3:
                        break  # the client goes away mid-stream
    before = _metric(_scrape(server), 'vllm:request_success_total{engine="0",finished_reason="abort"')
    asyncio.run(go())
    for _ in range(100):
        s = _scrape(server)
        if _metric(s, 'vllm:request_success_total{engine="0",finished_reason="abort"') > before:
            break
        asyncio.run(asyncio.sleep(0.1))
    assert _metric(s, 'vllm:request_success_total{engine="0",finished_reason="abort"') == before + 1
    assert _client(server).completions.create(model="a0", prompt="x", max_tokens=2).usage.completion_tokens == 2


def test_a_flood_of_connections(server) -> None:
    """400 concurrent streams and 200 idle connections: all served, the server still answers."""
    async def go() -> list[int]:
        limits = httpx.Limits(max_connections=1000)
        async with httpx.AsyncClient(timeout=120, limits=limits, headers={"Authorization": "Bearer sekret"}) as c:
            async def one(k: int) -> int:
                body = {"model": f"a{k % 2}", "prompt": "x y z", "max_tokens": 4, "stream": k % 2 == 0}
                r = await c.post(server + "/v1/completions", json=body)
                return r.status_code
            idle = [await asyncio.open_connection("127.0.0.1", int(server.rsplit(":", 1)[1])) for _ in range(200)]
            codes = await asyncio.gather(*(one(k) for k in range(400)))
            for _reader, writer in idle:
                writer.close()
            return codes
    codes = asyncio.run(go())
    assert codes == [200] * 400
    s = _scrape(server)
    assert _metric(s, "vllm:num_requests_running") == 0


def test_metrics_names(server) -> None:
    _client(server).completions.create(model="a3", prompt="x", max_tokens=3)
    s = _scrape(server)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:lora_requests_info", "vllm:cache_config_info", "vllm:time_to_first_token_seconds_count",
                 "vllm:inter_token_latency_seconds_count", "vllm:e2e_request_latency_seconds_count",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:lora_adapter_loaded",
                 "vllm:num_gpu_loaded_lora_adapters", "vllm:num_cpu_loaded_lora_adapters",
                 "vllm:max_gpu_lora_adapters", "vllm:iteration_tokens_total_count"):
        assert any(k.startswith(name) for k in s), name
    assert _metric(s, "vllm:max_gpu_lora_adapters") == 2


def test_parse_lora_modules() -> None:
    assert parse_lora_modules(["a=/p", '{"name": "b", "path": "/q", "rank": 8, "base_model_name": "m"}']) == [
        LoraModule("a", "/p"), LoraModule("b", "/q", 8, "m")]
    for bad in ("a", "=p", '{"name": 1}', '{"name": "a", "path": "/p", "rank": 0}', "{oops"):
        with pytest.raises(ValueError, match="--lora-modules"):
            parse_lora_modules([bad])


@pytest.mark.parametrize("args, message", [
    (["--lora-modules", "a=/a"], "--lora-modules needs --enable-lora"),
    (["--enable-lora", "--max-lora-rank", "8", "--lora-modules", '{"name": "a", "path": "/a", "rank": 16}'],
     "LoRA rank 16 is greater than max_lora_rank 8"),
    (["--time-scale", "0"], "--time-scale 0"),
    (["--max-lora-rank", "12"], "--max-lora-rank 12"),
    (["--http-path-ms", "-1"], "--http-path-ms -1"),
])
def test_bad_flags_exit_2_with_one_line(args, message) -> None:
    p = subprocess.run([sys.executable, "-m", "lorapack.cli", "serve", "--model", LLAMA, "--port", "1", *args],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and message in lines[0], p.stderr
    assert "Traceback" not in p.stderr


def test_serve_plan_follows_routes_json(tmp_path) -> None:
    """``serve --plan``: one twin server per GPU on the ports of routes.json, each with its GPU's adapters and
    flags from plan.json; Ctrl-C stops them all."""
    import os
    import signal
    import socket
    import time

    from serve_helpers import free_port, sigint_default

    examples = Path(__file__).resolve().parents[1] / "src" / "lorapack" / "examples"
    plan_dir = tmp_path / "plan"
    while True:  # two free ports in a row
        base = free_port()
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", base + 1))
            break
        except OSError:
            continue
    p = subprocess.run([sys.executable, "-m", "lorapack.cli", "place", str(examples / "adapters.csv"), "--model", LLAMA,
                        "--out", str(plan_dir), "--no-verify", "--gpus", "2", "--method", "round-robin",
                        "--base-port", str(base)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    routes = json.loads((plan_dir / "routes.json").read_text())
    plan = json.loads((plan_dir / "plan.json").read_text())
    # stderr to a file, not a pipe: the servers share it, and a pipe nobody reads until the end can fill up and
    # block the last line ("interrupted") forever on a loaded machine
    err_path = tmp_path / "serve.err"
    err = err_path.open("w")
    proc = subprocess.Popen([sys.executable, "-m", "lorapack.cli", "serve", "--plan", str(plan_dir), "--base-port",
                             str(base)], stdout=subprocess.DEVNULL, stderr=err, text=True, start_new_session=True,
                            preexec_fn=sigint_default)
    try:
        for adapter, targets in routes.items():
            for target in targets:
                url = target["url"].removesuffix("/v1")
                deadline = time.monotonic() + 300
                while True:
                    try:
                        models = httpx.get(url + "/v1/models", timeout=5).json()
                        break
                    except httpx.HTTPError:
                        assert time.monotonic() < deadline, f"{url} did not start"
                        time.sleep(0.3)
                ids = [m["id"] for m in models["data"]]
                assert adapter in ids
                assert ids[1:] == plan["gpus"][target["gpu"]]["adapters"]
                r = httpx.post(url + "/v1/completions", json={"model": adapter, "prompt": "x", "max_tokens": 2},
                               timeout=60)
                assert r.status_code == 200
        os.killpg(proc.pid, signal.SIGINT)
        try:
            code = proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            code = None
        assert code == 130, err_path.read_text()[-4000:]
        assert err_path.read_text().strip().splitlines()[-1] == "interrupted"
        for targets in routes.values():
            with pytest.raises(httpx.HTTPError):
                httpx.get(targets[0]["url"].removesuffix("/v1") + "/health", timeout=2)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        err.close()
        # the per-GPU servers run in sessions of their own ("GPU g: twin server on port p (PID n)"): never leak one
        import re

        for pid in re.findall(r"\(PID (\d+)\)", err_path.read_text()):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(int(pid), signal.SIGKILL)


def _outward_address() -> str | None:
    """This machine's address on its default route (not loopback), or None."""
    import socket

    candidates = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))  # no packet is sent: this only picks the outgoing interface
            candidates.append(s.getsockname()[0])
        except OSError:
            pass
    try:
        candidates.append(socket.gethostbyname(socket.gethostname()))
    except OSError:
        pass
    return next((a for a in candidates if not a.startswith("127.") and a != "0.0.0.0"), None)


def test_binds_to_loopback_by_default(server) -> None:
    addr = _outward_address()
    if addr is None:
        pytest.skip("this machine has no address besides loopback to try")
    port = int(server.rsplit(":", 1)[1])
    assert httpx.get(server + "/health", timeout=10).status_code == 200
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://{addr}:{port}/health", timeout=10)


def test_runtime_adapter_room_is_reused_then_runs_out() -> None:
    """Unloaded adapters' engine slots are reused once they have left the caches; past that, vLLM-style 507."""
    from lorapack.profile import find_profile
    from lorapack.serve.twin import TwinServer, TwinServerError
    from lorapack.server import ServerConfig

    twin = TwinServer(find_profile(LLAMA, "h100-64gb"), ServerConfig(max_loras=1, max_cpu_loras=1),
                      [LoraModule("a", "/a")], runtime_adapters=2)
    twin.load_adapter(LoraModule("b", "/b"))  # evicts a from the 1-slot CPU cache
    twin.load_adapter(LoraModule("c", "/c"))  # evicts b
    twin.unload_adapter("a")
    d = twin.load_adapter(LoraModule("d", "/d"))  # a's slot: unloaded and out of the caches
    assert d.index == 1
    with pytest.raises(TwinServerError, match="no room for another adapter"):
        twin.load_adapter(LoraModule("e", "/e"))


def test_first_tokens_are_handed_out_before_the_rest_of_their_step() -> None:
    """Every stream of a step wakes at once and the event loop serves them in hand-out order: a request's first
    token goes out before the later tokens of the requests already running (docs/serve.md, "Measured")."""
    import math

    from lorapack.profile import find_profile
    from lorapack.serve.twin import TwinServer
    from lorapack.server import ServerConfig

    twin = TwinServer(find_profile(LLAMA), ServerConfig(max_loras=4), [LoraModule(f"a{i}", f"/a{i}") for i in range(4)])
    order: list[tuple[int, bool]] = []
    twin.on_token = lambda s, n_new, gap: order.append((s.request_id, math.isnan(gap)))
    w0 = twin._wall0
    old = [twin.submit(f"a{i}", 64, 500, received_wall=w0) for i in range(3)]
    eng = twin.engine
    while any(s.produced < 3 for s in old) or not order:
        eng.advance_to(math.nextafter(eng.t_s, math.inf))
        twin._publish()
    new = twin.submit("a3", 16, 500, received_wall=w0 + eng.t_s / twin.time_scale)
    while not new.produced:
        order.clear()
        eng.advance_to(math.nextafter(eng.t_s, math.inf))
        twin._publish()
    # the step that gave the new request its first token also gave every running request a token
    assert sorted(rid for rid, _ in order) == sorted([s.request_id for s in old] + [new.request_id])
    assert order[0] == (new.request_id, True), order
    assert all(not first for _, first in order[1:])


def test_replay_records_when_each_body_left_the_client(server) -> None:
    """The replayer's ``t_wire_s`` (aiohttp's chunk-sent trace) and ``t_server_arrival_s`` (the twin server's header):
    after the send call, before the first token."""
    from lorapack.testbed.replay import Arrival, ReplayOptions, replay

    arrivals = [Arrival(0.02 * i, "a0" if i % 2 else "a1", 40 + 30 * i, 3) for i in range(4)]
    got = replay(server, arrivals, ReplayOptions(model=LLAMA, headers={"Authorization": "Bearer sekret"},
                                                 scrape_every_s=5.0))
    for r in got.records:
        assert r.status == 200 and r.completion_tokens == 3, r.error
        assert r.t_sent_s <= r.t_wire_s < r.t_first_s, r
        # the twin server's arrival header: when the request entered its engine, on the client's clock
        assert r.t_sent_s <= r.t_server_arrival_s < r.t_first_s, r
