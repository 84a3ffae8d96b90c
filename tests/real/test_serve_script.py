"""``serve.sh`` as generated, started on the testbed: every server up, every adapter served, routes.json answers.

Each test writes a plan with lorapack, then runs its ``serve.sh`` exactly as generated; only what the script
reads from its environment differs from a deployment: ``MODEL`` (the tiny model instead of the profile's Hugging
Face id), ``LORA_DIR`` (a folder of links, one per adapter id, to the testbed's adapters), ``BIND_HOST``
(loopback), ``LOG_DIR``, the testbed's ``vllm`` first on ``PATH`` and its CPU settings
(``lorapack.testbed.server.SERVER_ENV``). The plans' flags are the shipped H100 profiles' (``--max-model-len
131072``, ``--max-num-seqs 2048``, ...): the tiny model accepts them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from lorapack.testbed.guard import alive, descendants
from lorapack.testbed.server import free_port, guarded, healthy, server_env, stop_tree

pytestmark = pytest.mark.real

LLAMA = "llama-3.1-8b-instruct"
START_TIMEOUT_S = 600.0  # three servers starting at once on two cores


def lorapack(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-m", "lorapack.cli", *args], cwd=cwd, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return out


def base_port(span: int) -> int:
    """A port p such that p .. p + span - 1 are free now."""
    import socket

    for _ in range(50):
        p = free_port()
        if p + span > 65000:
            continue
        ok = True
        for q in range(p, p + span):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", q))
                except OSError:
                    ok = False
                    break
        if ok:
            return p
    raise RuntimeError("no free port range")


def lora_dir(plan: dict, testbed, where: Path) -> Path:
    """A folder with one link per adapter id of the plan, to a testbed adapter no larger than its GPU's
    ``--max-lora-rank`` (cycling over the testbed's adapters, so a GPU serves several distinct weights)."""
    where.mkdir()
    pool = testbed.adapters()
    for gpu in plan["gpus"]:
        fitting = [a for a in pool if a.rank <= gpu["max_lora_rank"]]
        for k, adapter_id in enumerate(gpu["adapters"]):
            link = where / adapter_id
            if not link.exists():
                link.symlink_to(fitting[k % len(fitting)].path, target_is_directory=True)
    return where


def get_json(url: str, timeout_s: float = 10.0):
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        return json.loads(r.read())


def run_serve_sh(plan_dir: Path, testbed, tmp: Path):
    plan = json.loads((plan_dir / "plan.json").read_text())
    env = server_env({"MODEL": str(testbed.model_dir), "LORA_DIR": str(lora_dir(plan, testbed, tmp / "loras")),
                      "BIND_HOST": "127.0.0.1", "LOG_DIR": str(tmp / "logs"),
                      "PATH": f"{testbed.venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"})
    proc = guarded(["bash", str(plan_dir / "serve.sh")], env=env, log=tmp / "serve.sh.log", cwd=plan_dir)
    return plan, proc


def wait_all(urls: list[str], proc: subprocess.Popen, tmp: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    pending = set(urls)
    while pending and time.monotonic() < deadline:
        if proc.poll() is not None:
            logs = "\n".join(p.read_text(errors="replace")[-1500:] for p in sorted((tmp / "logs").glob("*.log")))
            pytest.fail(f"serve.sh exited with {proc.returncode} before every server was up:\n"
                        f"{(tmp / 'serve.sh.log').read_text()[-1500:]}\n{logs}")
        pending = {u for u in pending if not healthy(u)}
        time.sleep(1.0)
    assert not pending, f"not healthy after {START_TIMEOUT_S:.0f} s: {sorted(pending)}"


def check_plan_served(plan_dir: Path, testbed, tmp: Path) -> dict:
    """Start serve.sh, check every server and adapter, stop it; returns a summary."""
    plan, proc = run_serve_sh(plan_dir, testbed, tmp)
    routes = json.loads((plan_dir / "routes.json").read_text())
    try:
        urls = sorted({r["url"].removesuffix("/v1") for rs in routes.values() for r in rs})
        assert len(urls) == plan["gpus_used"]
        wait_all(urls, proc, tmp)
        for gpu in plan["gpus"]:
            if not gpu["adapters"]:
                continue
            url = next(r["url"] for r in routes[gpu["adapters"][0]] if r["gpu"] == plan["gpus"].index(gpu))
            served = {m["id"] for m in get_json(url + "/models")["data"]}
            assert set(gpu["adapters"]) <= served, sorted(set(gpu["adapters"]) - served)[:5]
        n_requests = 0
        for adapter_id, replicas in routes.items():
            for r in replicas:
                req = urllib.request.Request(r["url"] + "/completions", headers={"Content-Type": "application/json"},
                                             data=json.dumps({"model": adapter_id, "prompt": [5, 6, 7],
                                                              "max_tokens": 2, "ignore_eos": True}).encode())
                with urllib.request.urlopen(req, timeout=120) as resp:
                    body = json.loads(resp.read())
                assert resp.status == 200 and body["model"] == adapter_id
                assert body["usage"]["completion_tokens"] == 2
                n_requests += 1
        assert proc.poll() is None, "serve.sh ended while its servers were serving"
        return {"gpus": len(urls), "adapters": len(routes), "requests": n_requests, "proc": proc}
    except BaseException:
        stop_tree(proc)
        raise


@pytest.fixture
def work(tmp_path: Path, servers) -> Path:
    """A scratch folder; the shared test servers are stopped first: serve.sh starts one server per GPU of its
    plan (three for the demo), the most this tier ever runs at once (otherwise at most two)."""
    servers.stop_all()
    return tmp_path


def test_demo_plan_serves_every_adapter(testbed, work: Path):
    out = work / "demo"
    lorapack("demo", "--out", str(out), "--workers", "1", cwd=work)
    summary = check_plan_served(out, testbed, work)
    stop_tree(summary["proc"])
    assert summary["gpus"] >= 2 and summary["requests"] >= summary["adapters"]


def test_split_hot_plan_serves_every_replica(testbed, work: Path):
    csv = work / "hot.csv"
    rows = ["adapter_id,rank,rate_rps", "hot-one,16,60"] + [f"cold-{i},8,0.2" for i in range(6)]
    csv.write_text("\n".join(rows) + "\n")
    out = work / "plan"
    lorapack("place", str(csv), "-m", LLAMA, "--method", "proposed-exact", "--split-hot", "--out", str(out),
             "--base-port", str(base_port(16)), cwd=work)
    routes = json.loads((out / "routes.json").read_text())
    assert len(routes["hot-one"]) >= 2, "the workload is meant to split the hot adapter"
    summary = check_plan_served(out, testbed, work)
    stop_tree(summary["proc"])
    assert summary["requests"] > summary["adapters"]  # every replica of the hot adapter answered


def test_ids_with_equals_and_dashes_and_serve_sh_fails_when_a_server_dies(testbed, work: Path):
    """Adapter ids that break vLLM's ``name=path`` form are served through the JSON form; and when one server
    of a running serve.sh is killed, serve.sh stops the others and exits non-zero."""
    csv = work / "ids.csv"
    ids = ["team=a-1", "-lead", "x=y=z", "a-b-c", "--double", "plain"]
    rows = ["adapter_id,rank,rate_rps"] + [f"{a},{8 if k % 2 else 16},{12 if k < 3 else 0.5}"
                                           for k, a in enumerate(ids)]
    csv.write_text("\n".join(rows) + "\n")
    out = work / "plan"
    lorapack("place", str(csv), "-m", LLAMA, "--method", "proposed-exact", "--gpus", "2", "--out", str(out),
             "--base-port", str(base_port(16)), cwd=work)
    plan = json.loads((out / "plan.json").read_text())
    assert {a for g in plan["gpus"] for a in g["adapters"]} == set(ids)
    summary = check_plan_served(out, testbed, work)
    proc = summary["proc"]
    try:
        assert summary["adapters"] == len(ids)
        # kill -9 one server's API process (a child of the script): serve.sh must stop the rest and fail
        script_pid = next(p for p in descendants(proc.pid) if _cmdline(p).startswith("bash"))
        servers = [p for p in descendants(script_pid) if "vllm" in _cmdline(p) and "serve" in _cmdline(p)]
        assert servers
        os.kill(servers[0], signal.SIGKILL)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and alive(script_pid):
            time.sleep(0.5)
        assert not alive(script_pid), "serve.sh kept running after one of its servers died"
        status = (work / "serve.sh.log").read_text()
        assert "exited with status" in status and "stopping the others" in status
    finally:
        stop_tree(proc)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""

