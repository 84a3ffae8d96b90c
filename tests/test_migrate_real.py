"""migrate.sh against running twin servers (slow): ``lorapack serve --plan`` of the previous plan with vLLM's runtime
adapter loading on and an API key; clients send requests throughout, routed by the live routes file migrate.sh
rewrites. The servers end with the new plan's resident sets (``/v1/models``) and no request fails."""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from lorapack.placement import plan_from_dict
from lorapack.placement.export import Endpoints, write_outputs
from lorapack.replan.migrate import migration_files
from placement_helpers import LLAMA, instance, run_place, toy_kwargs
from serve_helpers import free_port, sigint_default

pytestmark = pytest.mark.slow

CAP = 10.0
KEY = "migrate-key"


def _two_ports() -> int:
    while True:
        base = free_port()
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", base + 1))
            return base
        except OSError:
            continue


def _plans(tmp: Path, base: int) -> tuple[Path, Path]:
    """Window 0: 20 adapters on 2 GPUs. Window 1: two adapters of GPU 1 gone, one new, two of GPU 0 hotter
    (GPU 0 fails and sheds them onto GPU 1): loads, unloads and relocations, no restart."""
    endpoints = Endpoints(base_port=base)
    rates = np.full(20, 0.8)
    p0 = run_place(instance(rates), LLAMA, verify=False, **toy_kwargs(CAP))
    d0 = tmp / "w0"
    write_outputs(p0, d0, endpoints=endpoints)
    assert p0.gpus_used == 2
    g0, g1 = p0.gpus[0].adapters, p0.gpus[1].adapters
    ids = [a for a in instance(rates).adapter_ids if a not in g1[:2]] + ["fresh"]
    new_rates = np.array([2.0 if a in g0[:2] else 0.8 for a in ids])
    p1 = run_place(instance(new_rates, ids=ids), LLAMA, verify=False, previous=d0, **toy_kwargs(CAP))
    d1 = tmp / "w1"
    write_outputs(p1, d1, endpoints=endpoints, extra=migration_files(p0, p1, {}, endpoints))
    r = p1.replan
    assert r["restarts"] == [] and r["moves"]["gone"] == 2 and r["moves"]["new"] == 1 and r["moves"]["needed"] >= 2
    return d0, d1


def _wait_models(url: str, deadline: float) -> list[str]:
    while True:
        try:
            r = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=5)
            if r.status_code == 200:
                return [m["id"] for m in r.json()["data"]]
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"{url} did not start"
        time.sleep(0.3)


def test_migrate_sh_on_twin_servers_moves_every_adapter_without_a_failed_request(tmp_path) -> None:
    base = _two_ports()
    d0, d1 = _plans(tmp_path, base)
    live = tmp_path / "live-routes.json"
    live.write_text((d0 / "routes.json").read_text())
    err_path = tmp_path / "serve.err"
    err = err_path.open("w")
    env = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    proc = subprocess.Popen([sys.executable, "-m", "lorapack.cli", "serve", "--plan", str(d0), "--base-port", str(base),
                             "--api-key", KEY], stdout=subprocess.DEVNULL, stderr=err, env=env,
                            start_new_session=True, preexec_fn=sigint_default)
    failures: list[str] = []
    sent = [0]
    stop = threading.Event()

    def client(seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(timeout=60, headers={"Authorization": f"Bearer {KEY}"}) as c:
            while not stop.is_set():
                table = json.loads(live.read_text())  # the live routes: rewritten atomically by migrate.sh
                adapter = rng.choice(sorted(table))
                targets = table[adapter]
                t = rng.choices(targets, weights=[x["weight"] for x in targets])[0]
                try:
                    r = c.post(t["url"] + "/completions", json={"model": adapter, "prompt": "x", "max_tokens": 4})
                    if r.status_code != 200:
                        failures.append(f"{adapter} on GPU {t['gpu']}: HTTP {r.status_code} {r.text[:200]}")
                except httpx.HTTPError as exc:
                    failures.append(f"{adapter} on GPU {t['gpu']}: {exc!r}")
                sent[0] += 1

    try:
        deadline = time.monotonic() + 300
        before = plan_from_dict(json.loads((d0 / "plan.json").read_text()))
        for g, gp in enumerate(before.gpus):
            assert sorted(_wait_models(f"http://127.0.0.1:{base + g}", deadline)[1:]) == sorted(gp.adapters)
        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(4)]
        for t in threads:
            t.start()
        time.sleep(2.0)  # traffic on the previous plan first
        run_env = {**os.environ, "VLLM_API_KEY": KEY, "ROUTES_FILE": str(live), "DRAIN_GRACE_S": "1",
                   "STATE_FILE": str(tmp_path / "migrate.state")}
        p = subprocess.run(["bash", str(d1 / "migrate.sh")], capture_output=True, text=True, env=run_env, timeout=600)
        assert p.returncode == 0, p.stdout + p.stderr
        time.sleep(2.0)  # traffic on the new plan
        stop.set()
        for t in threads:
            t.join(timeout=120)
        after = plan_from_dict(json.loads((d1 / "plan.json").read_text()))
        for g, gp in enumerate(after.gpus):
            ids = _wait_models(f"http://127.0.0.1:{base + g}", deadline)
            assert sorted(ids[1:]) == sorted(gp.adapters), f"GPU {g}"
        assert json.loads(live.read_text()) == json.loads((d1 / "routes.json").read_text())
        print(f"requests during the test: {sent[0]}, failed: {len(failures)}; migrate.sh: {p.stdout.count(chr(10))} lines")
        assert sent[0] > 20 and not failures, failures[:5]
        # run again: every step is in the state file, nothing is redone
        p = subprocess.run(["bash", str(d1 / "migrate.sh")], capture_output=True, text=True, env=run_env, timeout=120)
        assert p.returncode == 0 and "done before" in p.stdout and "failed" not in p.stderr
    finally:
        stop.set()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        err.close()
        for pid in re.findall(r"\(PID (\d+)\)", err_path.read_text()):  # the per-GPU servers' own sessions
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(int(pid), signal.SIGKILL)
