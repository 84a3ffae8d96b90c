"""Start a testbed vLLM server on a free loopback port and stop its whole process tree (docs/testbed.md).

The server runs under ``lorapack.testbed.guard``: it dies with whoever started it (pytest killed with ``-9``
included) and ``stop()`` ends every process of it. One model thread (``OMP_NUM_THREADS=1``, unpinned) leaves the
second core of a 2-core machine to the client and to a second server; the KV cache is
``VLLM_CPU_KVCACHE_SPACE`` = 1 GiB.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from lorapack.testbed.env import VLLM_ENV, Testbed, TestbedError

START_TIMEOUT_S = 420.0  # about 40 s on an idle 2-core machine; much more when the machine is loaded
SERVER_ENV = {
    **VLLM_ENV,  # the CPU platform, offline
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # no core pinning: two servers would pin the same core
    "OMP_NUM_THREADS": "1",
}
# Flags every testbed server gets: the model's own dtype; no torch.compile (minutes of start-up on a CPU); the
# engine's per-request intervals in each response's last chunk (the replayer orders first tokens by them).
BASE_FLAGS = ("--dtype", "bfloat16", "--enforce-eager", "--enable-per-request-metrics")
# The server runs at a lower CPU priority than the client: on 2 cores a server busy with a replay would
# otherwise delay the client's sends and reads (seen: 0.6-1.2 s) and blur the orders the tests compare.
SERVER_NICE = 19  # the lowest priority: measured, nice 5 still let a busy server delay the client
# The real tier runs ahead of other work on the machine where it may (root or CAP_SYS_NICE): the client at
# CLIENT_NICE, its servers SERVER_NICE steps below it (the gap, hence the client's lead over its servers, is the
# one measured above; CFS weights depend only on the difference). At nice 0 beside two busy loops a server at 19
# got ~1.5 % of a core, its steps stretched and scattered, and the staircases' orders fell to 0.91
# (docs/testbed.md, "Test tiers").
CLIENT_NICE = -20


def raise_priority(nice: int = CLIENT_NICE) -> int:
    """Set this process's niceness to ``nice`` (children and later threads inherit it) where the system allows;
    returns the niceness in effect (unchanged without the permission)."""
    try:
        os.setpriority(os.PRIO_PROCESS, 0, nice)
    except OSError:  # PermissionError without CAP_SYS_NICE: run as we are
        pass
    return os.getpriority(os.PRIO_PROCESS, 0)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def lora_module_arg(name: str, path: Path | str) -> str:
    """One ``--lora-modules`` value in vLLM's JSON form (safe for any id or path)."""
    return json.dumps({"name": name, "path": str(path)})


def guarded(cmd: Sequence[str], env: dict[str, str] | None = None, log: Path | None = None,
            cwd: Path | None = None, nice: int = 0) -> subprocess.Popen:
    """Start ``cmd`` under the guard (it and its descendants die with this process or at ``stop_tree``),
    ``nice`` steps below this process's CPU priority, in a process group of its own but in this process's
    session.

    The session matters: with the kernel's autogroup scheduling (``/proc/sys/kernel/sched_autogroup_enabled``,
    on by default) niceness orders tasks only within a session; between sessions the CPU is shared fairly,
    whatever the nice values. A server in a session of its own (``setsid``) beside a busy loop in the client's
    session left the client at nice -20 waiting up to 4 s for a core (its run-queue delay,
    ``/proc/thread-self/schedstat``), so sends were seconds late (docs/testbed.md, "Other work on the
    machine")."""
    out = open(log, "ab") if log is not None else subprocess.DEVNULL  # noqa: SIM115 (kept by the child)
    try:
        return subprocess.Popen([sys.executable, "-m", "lorapack.testbed.guard", f"--nice={nice}", "--", *cmd],
                                env=env, cwd=cwd,
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                process_group=0)
    finally:
        if log is not None:
            out.close()


def stop_tree(proc: subprocess.Popen, timeout_s: float = 20.0) -> None:
    """SIGTERM to the guard (it stops the tree: SIGTERM, then SIGKILL after its grace), then SIGKILL the group."""
    if proc.poll() is None:
        try:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # process_group=0: the guard's pid is its group's id
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


def server_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(SERVER_ENV)
    env.update(extra or {})
    return env


@dataclass
class RunningServer:
    """A started testbed server: its URL, the flags it was given, its log."""

    url: str
    port: int
    flags: tuple[str, ...]
    adapters: tuple[str, ...]
    log: Path
    proc: subprocess.Popen = field(repr=False)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def get(self, path: str, timeout_s: float = 10.0) -> tuple[int, str]:
        """``(status, body)`` of a GET on the server."""
        try:
            with urllib.request.urlopen(self.url + path, timeout=timeout_s) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def post(self, path: str, body: dict, timeout_s: float = 60.0) -> tuple[int, dict]:
        """``(status, JSON body)`` of a POST (non-streaming)."""
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                return r.status, json.loads(r.read() or b"{}")
        except urllib.error.HTTPError as e:
            raw = e.read()
            try:
                return e.code, json.loads(raw or b"{}")
            except json.JSONDecodeError:
                return e.code, {"raw": raw.decode(errors="replace")}

    def metrics(self) -> str:
        return self.get("/metrics")[1]

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.is_file() else ""

    def stop(self) -> None:
        stop_tree(self.proc)


def why_it_failed(log: Path, tail: int = 15) -> list[str]:
    """The log's error lines (vLLM's reason is often far above the end of its traceback) and its last lines."""
    lines = log.read_text(errors="replace").splitlines() if log.is_file() else []
    errors = [ln for ln in lines if "Error:" in ln or "error:" in ln]
    return list(dict.fromkeys(errors[-10:] + lines[-tail:]))


def healthy(url: str) -> bool:
    """Whether the vLLM server at ``url`` answers ``/health`` with 200."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout_s: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise TestbedError(f"vLLM server exited with {proc.returncode} before it was healthy; log {log}:\n"
                               + "\n".join(why_it_failed(log)))
        if healthy(url):
            return
        time.sleep(0.5)
    raise TestbedError(f"vLLM server at {url} not healthy after {timeout_s:.0f} s; log {log}")


def served_name(adapter: str) -> str:
    """An adapter entry is a testbed adapter id (``r8-0``) or ``name=id``: the same weights served under another
    name (vLLM treats every name as its own adapter: more adapters than the testbed has weights)."""
    return adapter.partition("=")[0]


def serve_command(testbed: Testbed, port: int, adapters: Sequence[str], flags: Sequence[str]) -> list[str]:
    """``vllm serve`` of the tiny model on 127.0.0.1:port with the given adapters (registration order, entries as in
    ``served_name``) and flags."""
    cmd = [str(testbed.vllm), "serve", str(testbed.model_dir), "--host", "127.0.0.1", "--port", str(port),
           *BASE_FLAGS]
    if adapters:
        cmd += ["--enable-lora", "--lora-modules"]
        cmd += [lora_module_arg(served_name(a), testbed.adapter(a.partition("=")[2] or a).path) for a in adapters]
    return cmd + list(flags)


def start_server(testbed: Testbed, adapters: Sequence[str], flags: Sequence[str], log_dir: Path,
                 timeout_s: float = START_TIMEOUT_S, wait: bool = True,
                 env: dict[str, str] | None = None) -> RunningServer:
    """Start ``vllm serve`` (the tiny model, ``adapters`` registered in order, ``flags`` appended; ``env`` added to
    ``SERVER_ENV``) and wait until ``/health`` answers. The caller stops it (``stop()``); it also dies with the
    calling process."""
    port = free_port()
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"vllm-{port}.log"
    cmd = serve_command(testbed, port, adapters, flags)
    proc = guarded(cmd, env=server_env(env), log=log, nice=SERVER_NICE)
    server = RunningServer(f"http://127.0.0.1:{port}", port, tuple(flags), tuple(adapters), log, proc)
    if wait:
        try:
            wait_healthy(server.url, proc, log, timeout_s)
        except BaseException:
            server.stop()
            raise
    return server
