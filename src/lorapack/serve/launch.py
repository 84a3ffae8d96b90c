"""Starting twin servers: one (``run_server``), or one per GPU of a plan (``serve_plan``).

``parse_lora_modules`` reads ``--lora-modules`` in both of vLLM's forms: ``name=path`` and the JSON object
``{"name": ..., "path": ..., "base_model_name": ...}``, to which lorapack adds ``"rank"`` (vLLM reads the
rank from the adapter's files; the twin never opens them).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from ..errors import SpecError
from .twin import LoraModule

DEFAULT_MAX_CONNECTIONS = 4096  # open connections before the server answers 503 (uvicorn's limit_concurrency)


def parse_lora_modules(values: list[str]) -> list[LoraModule]:
    """``--lora-modules`` values -> ``LoraModule``s (a one-line ``SpecError`` for a malformed one)."""
    out = []
    for v in values:
        v = v.strip()
        if v.startswith("{"):
            try:
                d = json.loads(v)
            except json.JSONDecodeError as exc:
                raise SpecError(f"--lora-modules {v!r}: malformed JSON ({exc.msg})") from None
            if not isinstance(d, dict) or not isinstance(d.get("name"), str) or not isinstance(d.get("path"), str):
                raise SpecError(f"--lora-modules {v!r}: expected {{\"name\": ..., \"path\": ...}} (and optionally "
                                f"\"base_model_name\", \"rank\")")
            rank = d.get("rank")
            if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 1):
                raise SpecError(f"--lora-modules {v!r}: rank {rank!r}: expected an integer >= 1")
            out.append(LoraModule(name=d["name"], path=d["path"], rank=rank, base_model_name=d.get("base_model_name")))
        else:
            name, sep, path = v.partition("=")
            if not sep or not name or not path:
                raise SpecError(f"--lora-modules {v!r}: expected name=path or a JSON object "
                                f"{{\"name\": ..., \"path\": ...}}")
            out.append(LoraModule(name=name, path=path))
    return out


@contextlib.contextmanager
def twin_process(flags: Sequence[str], log: Path | None = None, env: dict[str, str] | None = None,
                 start_timeout_s: float = 120.0) -> Iterator[str]:
    """A ``lorapack serve FLAGS`` process on a free loopback port (benches, tests): yields its base URL once
    ``/health`` answers. It runs under the testbed's process-tree guard (``testbed.server.guarded``: it dies with
    this process, even by SIGKILL) and is stopped with its tree (``stop_tree``) however the block ends. Output
    goes to ``log`` (else nowhere); a server that exits or does not answer in time is a ``RuntimeError``."""
    import httpx

    from ..testbed.server import free_port, guarded, stop_tree

    port = free_port()
    proc = guarded([sys.executable, "-m", "lorapack.cli", "serve", "--port", str(port), *flags],
                   env={**os.environ, **(env or {})}, log=log)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + start_timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"lorapack serve exited with {proc.returncode} before it answered (log: {log})")
            try:
                if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"lorapack serve did not answer /health within {start_timeout_s:.0f} s (log: {log})")
            time.sleep(0.2)
        yield url
    finally:
        stop_tree(proc)


def run_server(app, host: str, port: int, max_connections: int = DEFAULT_MAX_CONNECTIONS) -> None:
    """Serve ``app`` with uvicorn until Ctrl-C / SIGTERM (uvicorn then re-raises the signal)."""
    import uvicorn

    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                            limit_concurrency=max_connections, timeout_graceful_shutdown=2, lifespan="on")
    uvicorn.Server(config).run()


def plan_commands(plan_dir: Path, base_port: int, host: str, extra: list[str],
                  plans_model: bool = True) -> list[tuple[int, int, list[str]]]:
    """``(gpu, port, argv)`` of one ``lorapack serve`` per GPU of the plan in ``plan_dir`` (GPUs without
    adapters are skipped, as ``serve.sh`` does). Ports: ``base_port + gpu``, as ``routes.json`` with
    ``place --base-port`` (one node). Flags: each GPU's ``ServerConfig`` in ``plan.json``; ``plans_model``: the
    plan's model and GPU type pick the shipped profile (else ``extra`` names one)."""
    from ..placement.export import Endpoints
    from ..placement.plan import plan_from_dict

    path = plan_dir / "plan.json"
    if not path.is_file():
        raise SpecError(f"--plan {plan_dir}: no plan.json in it (expected the --out directory of lorapack place)")
    try:
        plan = plan_from_dict(json.loads(path.read_text()))
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise SpecError(f"--plan {plan_dir}: plan.json does not parse ({' '.join(str(exc).split())})") from None
    endpoints = Endpoints(base_port=base_port, gpus_per_node=max(len(plan.gpus), 1))
    out = []
    for gi, g in enumerate(plan.gpus):
        if not g.adapters:
            continue
        port = endpoints.port(gi)
        argv = [sys.executable, "-m", "lorapack.cli", "serve", "--host", host, "--port", str(port),
                "--enable-lora", "--max-loras", str(g.max_loras), "--max-lora-rank", str(g.max_lora_rank),
                "--max-cpu-loras", str(g.max_cpu_loras), "--max-num-seqs", str(g.max_num_seqs),
                "--max-num-batched-tokens", str(g.max_num_batched_tokens)]
        if g.max_model_len is not None:
            argv += ["--max-model-len", str(g.max_model_len)]
        ranks = getattr(g, "ranks", None) or [None] * len(g.adapters)
        for name, rank in zip(g.adapters, ranks, strict=True):
            module = {"name": name, "path": f"adapters/{name}"}
            if rank is not None:
                module["rank"] = int(rank)
            argv += ["--lora-modules", json.dumps(module)]
        if plans_model:
            argv += ["--model", plan.model, "--gpu", plan.gpu_type]
        out.append((gi, port, argv + extra))
    if not out:
        raise SpecError(f"--plan {plan_dir}: the plan has no GPU with adapters")
    return out


def serve_plan(commands: list[tuple[int, int, list[str]]], log) -> int:
    """Run one server process per GPU; when one exits, or on Ctrl-C / SIGTERM, stop them all (their whole
    process groups). Returns the exit code: 130 on Ctrl-C, else the first exited server's (1 if it was 0)."""
    procs: list[tuple[int, subprocess.Popen]] = []

    def stop_all() -> None:
        for _gi, p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 5.0
        for _gi, p in procs:
            try:
                p.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()

    previous = signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        for gi, port, argv in commands:
            procs.append((gi, subprocess.Popen(argv, start_new_session=True)))
            log(f"GPU {gi}: twin server on port {port} (PID {procs[-1][1].pid})")
        while True:
            for gi, p in procs:
                code = p.poll()
                if code is not None:
                    log(f"GPU {gi}'s twin server exited with status {code}; stopping the others")
                    return code or 1
            time.sleep(0.2)
    except KeyboardInterrupt:
        return 130
    finally:
        stop_all()
        signal.signal(signal.SIGTERM, previous)
