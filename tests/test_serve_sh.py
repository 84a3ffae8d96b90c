"""``serve.sh`` (issue "testbed", deliverable 4): what the pinned vLLM accepts, run against a fake ``vllm``.

No vLLM here: the script's command lines are parsed back with shlex, and a fake ``vllm`` on PATH records the
arguments and environment it was started with, then sleeps or exits. Every run binds loopback only, is bounded
by timeouts, and its whole process group is killed at the end.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lorapack.errors import SpecError
from lorapack.placement.export import (
    MEASURED_GPU_MEMORY_UTILIZATION,
    MEASURED_PREFIX_CACHING,
    VLLM_SERVE_FLAGS,
    VLLM_VERSION,
    serve_script,
)
from lorapack.placement.plan import GpuPlan, Plan
from lorapack.server import ServerConfig
from serve_helpers import sigint_default

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="serve.sh needs bash")

# ids vLLM's old `name=path` form cannot carry: '=', ',', a leading '-', spaces, quotes, '$', a backslash
ODD_IDS = ["a=b", "x,y", "-lead", "has space", "it's", 'dq"uote', "$HOME", "back\\slash", "ünï"]
PATHS = {"a=b": "/lora/a=b", "x,y": "/lora/x,y", "-lead": "-/lora/lead", "has space": "/lora dir/has space",
         "it's": "/lora/it's", 'dq"uote': '/lora/dq"uote', "plain": "/lora/plain"}
NO_PATH = [a for a in ODD_IDS if a not in PATHS]  # loaded from $LORA_DIR/<id>
LORA_DIR = "/tmp/lora dir/with \"quote\" and 'single' and \\"


def _gpu(adapters: list[str], rank: int = 16) -> GpuPlan:
    n = len(adapters)
    return GpuPlan(adapters=adapters, weights=[1.0] * n,
                   server=ServerConfig(max_loras=n, max_lora_rank=rank, max_cpu_loras=n, max_num_seqs=2048,
                                       max_num_batched_tokens=2048, max_model_len=131072), incoming_tok_s=100.0,
                   binding="throughput")


def _plan() -> Plan:
    return Plan(method="proposed-exact", model="llama-3.1-8b-instruct", gpu_type="h100-64gb", lower_bound_gpus=2,
                gpus=[_gpu(["plain", *ODD_IDS[:5]]), _gpu(ODD_IDS[5:], rank=8)])


def _launch_lines(text: str) -> list[list[str]]:
    return [shlex.split(line) for line in text.splitlines() if line.startswith("launch ")]


def _vllm_accepts(item: str) -> dict:
    """vLLM 0.8.5's ``LoRAParserAction`` on one ``--lora-modules`` value (vllm/entrypoints/openai/cli_args.py;
    unchanged in later releases): ``name=path`` when the value has '=' and no ',', else JSON whose keys are
    ``LoRAModulePath``'s (name, path, base_model_name). The JSON form is the one meant here."""
    assert not ("=" in item and "," not in item), f"vLLM would read {item!r} as name=path"
    d = json.loads(item)
    assert {"name", "path"} <= set(d) <= {"name", "path", "base_model_name"}
    return d


def test_script_parses_and_has_the_pinned_flags(tmp_path: Path) -> None:
    text = serve_script(_plan(), PATHS)
    (tmp_path / "serve.sh").write_text(text)
    assert subprocess.run(["bash", "-n", str(tmp_path / "serve.sh")], timeout=30).returncode == 0
    assert VLLM_VERSION == "0.8.5" and f"vLLM {VLLM_VERSION}" in text
    lines = _launch_lines(text)
    assert len(lines) == 2
    for gi, (words, g) in enumerate(zip(lines, _plan().gpus, strict=True)):
        assert words[:3] == ["launch", "0", str(gi)]
        assert f"CUDA_VISIBLE_DEVICES={gi}" in words and "VLLM_USE_V1=1" in words
        i = words.index("vllm")
        assert words[i:i + 3] == ["vllm", "serve", "$MODEL"]
        flags = [w for w in words if w.startswith("--")]
        assert set(flags) <= set(VLLM_SERVE_FLAGS), set(flags) - set(VLLM_SERVE_FLAGS)
        assert words[words.index("--gpu-memory-utilization") + 1] == str(MEASURED_GPU_MEMORY_UTILIZATION) == "0.9"
        assert MEASURED_PREFIX_CACHING is False  # the shipped profiles were measured with prefix caching off
        assert "--no-enable-prefix-caching" in flags and "--enable-prefix-caching" not in flags
        assert words[words.index("--host") + 1] == "$BIND_HOST"
        assert words[words.index("--port") + 1] == str(8000 + gi)
        assert words[words.index("--max-loras") + 1] == str(g.max_loras)
        assert words[words.index("--max-num-batched-tokens") + 1] == "2048"
        # one JSON word per adapter, registration order, right name and path
        mods = words[words.index("--lora-modules") + 1:]
        assert len(mods) == len(g.adapters)
        for word, a in zip(mods, g.adapters, strict=True):
            d = _vllm_accepts(word)
            assert d["name"] == a
            # an adapter without a path: the shell fills in $LORA_DIR_JSON (checked by the runs below)
            assert d["path"] == PATHS.get(a, f"$LORA_DIR_JSON/{a}")
    assert 'BIND_HOST="${BIND_HOST:-0.0.0.0}"' in text  # the deployment default


# ---- runs against a fake vllm ----

FAKE_VLLM = """\
#!{python}
# fake `vllm`: records argv, pid and environment, then exits with $FAKE_EXIT_<device> or sleeps
import json, os, sys, time
import signal
dev = os.environ["CUDA_VISIBLE_DEVICES"]
if os.environ.get("FAKE_IGNORE_TERM"):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
rec = {{"argv": sys.argv[1:], "pid": os.getpid(), "VLLM_USE_V1": os.environ.get("VLLM_USE_V1")}}
with open(os.path.join(os.environ["FAKE_OUT"], "gpu" + dev + ".json"), "w") as f:
    json.dump(rec, f)
print("fake vllm on device", dev, flush=True)
code = os.environ.get("FAKE_EXIT_" + dev)
if code is not None:
    time.sleep(float(os.environ.get("FAKE_DELAY", "0.3")))
    sys.exit(int(code))
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    """Running (a zombie counts as dead: its parent, serve.sh, is gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    except OSError:  # no /proc
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    return state != "Z"


def _wait_dead(pid: int, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return False


class Run:
    """serve.sh with the fake vllm first on PATH, in its own process group (killed whole at the end)."""

    def __init__(self, tmp_path: Path, text: str, **env: str) -> None:
        self.dir = tmp_path
        (tmp_path / "bin").mkdir()
        fake = tmp_path / "bin" / "vllm"
        fake.write_text(FAKE_VLLM.format(python=sys.executable))
        fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
        (tmp_path / "out").mkdir()
        script = tmp_path / "plan" / "serve.sh"
        script.parent.mkdir()
        script.write_text(text)
        script.chmod(0o755)
        self.env = {**os.environ, "PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}",
                    "FAKE_OUT": str(tmp_path / "out"), "BIND_HOST": "127.0.0.1", "LORA_DIR": LORA_DIR, **env}
        # SIGINT at its default: serve.sh traps it, and bash cannot trap a signal ignored at its start
        self.proc = subprocess.Popen([str(script)], env=self.env, cwd=tmp_path, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, start_new_session=True,
                                     preexec_fn=sigint_default)

    def record(self, gpu: int, timeout: float = 120.0) -> dict:  # generous: a loaded machine starts slowly
        p = self.dir / "out" / f"gpu{gpu}.json"
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if p.is_file():
                try:
                    return json.loads(p.read_text())
                except json.JSONDecodeError:  # being written
                    pass
            time.sleep(0.05)
        raise AssertionError(f"the fake vllm of GPU {gpu} never started")

    def finish(self, timeout: float = 30.0) -> tuple[int, str, str]:
        out, err = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, out, err

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.communicate()


def test_every_server_gets_what_vllm_accepts(tmp_path: Path) -> None:
    plan = _plan()
    run = Run(tmp_path, serve_script(plan, PATHS), FAKE_EXIT_1="3")
    try:
        recs = [run.record(0), run.record(1)]
        code, out, err = run.finish()
        for gi, (rec, g) in enumerate(zip(recs, plan.gpus, strict=True)):
            argv = rec["argv"]
            assert rec["VLLM_USE_V1"] == "1"
            assert argv[:2] == ["serve", "meta-llama/Llama-3.1-8B-Instruct"]
            assert argv[argv.index("--host") + 1] == "127.0.0.1"
            assert argv[argv.index("--port") + 1] == str(8000 + gi)
            mods = argv[argv.index("--lora-modules") + 1:]
            got = [_vllm_accepts(m) for m in mods]
            assert [d["name"] for d in got] == g.adapters
            assert [d["path"] for d in got] == [PATHS.get(a, f"{LORA_DIR}/{a}") for a in g.adapters]
            # one log per server, next to serve.sh by default
            assert f"fake vllm on device {gi}" in (tmp_path / "plan" / "logs" / f"gpu{gi}.log").read_text()
        assert any(a in NO_PATH for a in plan.gpus[1].adapters)  # $LORA_DIR with quotes and a backslash
        assert f"GPU 0: PID {recs[0]['pid']}" in out and f"GPU 1: PID {recs[1]['pid']}" in out
    finally:
        run.kill()
    assert code == 3, err


def test_a_dying_server_stops_the_others_and_fails_the_script(tmp_path: Path) -> None:
    run = Run(tmp_path, serve_script(_plan(), PATHS), FAKE_EXIT_1="7", LOG_DIR=str(tmp_path / "logs"))
    try:
        survivor = run.record(0)["pid"]
        code, _, err = run.finish()
        assert code == 7
        assert "GPU 1's server" in err and "exited with status 7" in err and "stopping the others" in err
        assert _wait_dead(survivor), "GPU 0's server still runs"
        assert (tmp_path / "logs" / "gpu1.log").is_file()  # LOG_DIR honoured
    finally:
        run.kill()


def test_a_server_exiting_zero_still_fails_the_script(tmp_path: Path) -> None:
    run = Run(tmp_path, serve_script(_plan(), PATHS), FAKE_EXIT_0="0")
    try:
        survivor = run.record(1)["pid"]
        code, _, err = run.finish()
        assert code == 1, err
        assert "GPU 0's server" in err and _wait_dead(survivor)
    finally:
        run.kill()


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_stops_every_server(tmp_path: Path, sig: signal.Signals, code: int) -> None:
    run = Run(tmp_path, serve_script(_plan(), PATHS))
    try:
        pids = [run.record(0)["pid"], run.record(1)["pid"]]
        time.sleep(0.3)  # the supervision loop is reached
        run.proc.send_signal(sig)
        got, _, err = run.finish()
        assert got == code, err
        assert all(_wait_dead(p) for p in pids)
    finally:
        run.kill()


def test_a_server_ignoring_sigterm_is_killed(tmp_path: Path) -> None:
    run = Run(tmp_path, serve_script(_plan(), PATHS), FAKE_EXIT_1="1", FAKE_IGNORE_TERM="1", STOP_GRACE_S="1")
    try:
        survivor = run.record(0)["pid"]
        code, _, err = run.finish()
        assert code == 1, err
        assert _wait_dead(survivor)
    finally:
        run.kill()


def test_a_gpu_without_adapters_is_not_started() -> None:
    plan = _plan()
    plan.gpus.insert(1, _gpu([]))
    text = serve_script(plan, PATHS)
    assert [w[2] for w in _launch_lines(text)] == ["0", "2"] and "# GPU 1: no adapters, not started" in text


def test_node_selection(tmp_path: Path) -> None:
    run = Run(tmp_path, serve_script(_plan(), PATHS), NODE="3")
    try:
        code, out, err = run.finish()
        assert code == 2 and len(err.strip().splitlines()) == 1 and "NODE=3" in err, err
        assert not list((tmp_path / "out").iterdir())  # nothing started
    finally:
        run.kill()


@pytest.mark.parametrize("version, use_v1", [(None, True), ("0.8.5", True), ("0.32.0", False), ("0.33", False)])
def test_vllm_use_v1_only_for_the_versions_that_have_v0(version: str | None, use_v1: bool) -> None:
    """``VLLM_USE_V1=1`` keeps vLLM 0.8.x from falling back to V0; later versions have no V0 (the plan's
    ``settings.vllm_version``, from ``place --vllm-version``, decides; no version = the profiles' 0.8.5)."""
    plan = _plan()
    if version is not None:
        plan.settings["vllm_version"] = version
    text = serve_script(plan, PATHS)
    for words in _launch_lines(text):
        assert ("VLLM_USE_V1=1" in words) == use_v1
    assert f"(vLLM {version or '0.8.5'})" in text


def test_a_measured_profile_pins_its_own_settings_and_tensor_parallel_devices() -> None:
    """A profile from ``lorapack measure`` records the server's memory fraction, prefix caching and TP size
    (``place`` copies them into the plan's settings): every server gets them, and a TP server takes that many
    devices of its node (one plan "GPU" = one server)."""
    from lorapack.placement.export import Endpoints, routes

    plan = _plan()
    plan.settings.update({"measured_gpu_memory_utilization": 0.92, "measured_prefix_caching": True,
                          "tensor_parallel_size": 2})
    text = serve_script(plan, PATHS, Endpoints(gpus_per_node=4))
    lines = _launch_lines(text)
    assert len(lines) == len(plan.gpus) >= 2
    for gi, words in enumerate(lines):
        i = words.index("--tensor-parallel-size")
        assert words[i + 1] == "2"
        assert words[words.index("--gpu-memory-utilization") + 1] == "0.92"
        assert "--enable-prefix-caching" in words and "--no-enable-prefix-caching" not in words
        # 2 servers per 4-device node: devices 0,1 and 2,3, ports 8000, 8001; node gi // 2
        assert f"CUDA_VISIBLE_DEVICES={(gi % 2) * 2},{(gi % 2) * 2 + 1}" in words
        assert words[1] == str(gi // 2) and words[words.index("--port") + 1] == str(8000 + gi % 2)
    assert "2 devices per server (tensor parallel)" in text
    urls = {r["url"] for lst in routes(plan, Endpoints(gpus_per_node=4)).values() for r in lst}
    assert all(u.endswith((":8000/v1", ":8001/v1")) for u in urls)
    with pytest.raises(SpecError, match="multiple of the profile's tensor-parallel size 2"):
        serve_script(plan, PATHS, Endpoints(gpus_per_node=3))
