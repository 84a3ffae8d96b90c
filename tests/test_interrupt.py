"""Ctrl-C: a real SIGINT to a running ``lorapack`` command (to its whole process group, as a terminal sends
it). Every command exits 130 with the one line ``interrupted`` on stderr, its worker processes stop (no
``KeyboardInterrupt`` traceback from any of them, none left running) and no output file is written.

The command runs through ``interrupt_main.py``, which says ``READY`` on stderr once the command is busy
(workers in the middle of their jobs, or the twin running): the test waits for that line, not for a fixed
time, so a loaded machine only makes it slower. Timeouts are generous for the same reason.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
EXAMPLES = HERE.parent / "src" / "lorapack" / "examples"
READY_TIMEOUT_S = 300.0  # cold numba cache and a loaded machine: the command may take long to get busy
EXIT_TIMEOUT_S = 60.0

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="POSIX signals, Linux /proc (children)")


def _children(pid: int) -> list[int]:
    """Direct children of ``pid`` (Linux /proc; empty elsewhere)."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by its parent) counts as gone
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def interrupt(args: list[str], tmp_path: Path, want_workers: int = 0) -> tuple[int, str, list[int]]:
    """Start ``lorapack ARGS``, wait until it is busy (and has ``want_workers`` children), send SIGINT to its
    process group; ``(exit code, stderr without the READY line, the children it had)``."""
    env = {**os.environ, "LORAPACK_WORKERS": "2", "COLUMNS": "200"}
    err_path = tmp_path / "stderr.txt"
    with err_path.open("w") as err:
        p = subprocess.Popen([sys.executable, str(HERE / "interrupt_main.py"), *args], cwd=tmp_path, env=env,
                             stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        children: list[int] = []
        while time.monotonic() < deadline:
            if p.poll() is not None:
                pytest.fail(f"the command ended before it was interrupted (exit {p.returncode}):\n"
                            f"{err_path.read_text()[-3000:]}")
            children = _children(p.pid) if want_workers else []
            if "READY" in err_path.read_text() and sum(
                    "spawn_main" in Path(f"/proc/{c}/cmdline").read_text(errors="replace")
                    for c in children if Path(f"/proc/{c}/cmdline").exists()) >= want_workers:
                break
            time.sleep(0.05)
        else:
            pytest.fail(f"not busy after {READY_TIMEOUT_S:.0f} s:\n{err_path.read_text()[-3000:]}")
        os.killpg(p.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: the whole foreground group
        code = p.wait(timeout=EXIT_TIMEOUT_S)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    deadline = time.monotonic() + EXIT_TIMEOUT_S
    while any(_alive(c) for c in children) and time.monotonic() < deadline:
        time.sleep(0.05)
    # (a progress bar on a non-terminal stderr may leave an empty line: not a message)
    lines = [ln for ln in err_path.read_text().splitlines() if ln.strip() and ln != "READY"]
    return code, "\n".join(lines), children


def _check(code: int, stderr: str, children: list[int], out: Path | None = None,
           kept: tuple[str, ...] = ()) -> None:
    """Exit 130, one line, no worker left; in ``out`` only the files in ``kept`` (each complete), nothing else:
    no temporary file, no half-written output."""
    assert code == 130, stderr[-3000:]
    assert stderr == "interrupted", stderr[-3000:]  # one line: no traceback from the command or a worker
    assert not [c for c in children if _alive(c)], "worker processes left running"
    if out is not None:
        written = sorted(str(p.relative_to(out)) for p in out.rglob("*")) if out.exists() else []
        assert set(written) <= set(kept), written
        for name in written:
            if name.endswith(".json"):
                json.loads((out / name).read_text())  # complete


def test_simulate_interrupted(tmp_path: Path) -> None:
    values = ",".join(str(a) for a in range(1, 65))  # 64 runs in a row: still running when interrupted
    timeline_dir = tmp_path / "out"
    timeline_dir.mkdir()
    code, stderr, children = interrupt(["simulate", str(EXAMPLES / "demo.yaml"), "-m", "llama-3.1-8b-instruct",
                                        "--max-loras", values, "--json"], tmp_path)
    _check(code, stderr, children, timeline_dir)


def test_place_interrupted_with_workers(tmp_path: Path) -> None:
    """``proposed-exact`` on 1,280 adapters asks the twin through two worker processes (LORAPACK_WORKERS=2)."""
    import numpy as np

    rng = np.random.default_rng(2026)  # bench/placement_speed.py's instance: skewed rates, 20 req/s in all
    ranks, rates = rng.choice([8, 16], 1280), np.maximum(rng.dirichlet(np.full(1280, 0.5)) * 20.0, 1e-4)
    workload = tmp_path / "adapters.csv"
    workload.write_text("adapter_id,rank,rate_rps\n" + "".join(
        f"a{i:05d},{r},{q:.6g}\n" for i, (r, q) in enumerate(zip(ranks, rates, strict=True))))
    out = tmp_path / "plan"
    code, stderr, children = interrupt(["place", str(workload), "-m", "llama-3.1-8b-instruct",
                                        "--method", "proposed-exact", "--out", str(out)], tmp_path,
                                       want_workers=2)
    _check(code, stderr, children, out)


@pytest.mark.slow
def test_evaluate_interrupted_with_nested_workers(tmp_path: Path) -> None:
    """``--jobs 2``: scenario groups in worker processes, each replaying on its own workers (``--workers 2``)."""
    from evaluate_helpers import write_trace

    trace = write_trace(tmp_path / "trace.csv", n=6000, span_s=1200.0)
    scenarios = tmp_path / "sc.yaml"
    scenarios.write_text(f"trace: {trace}\nwindows: {{protocol: E1, split_s: 600}}\nn_adapters: [64, 96]\n"
                         f"load_scale: [4, 6]\nfixed_pool: 4\nmax_pack: false\n")
    out = tmp_path / "ev"
    code, stderr, children = interrupt(["evaluate", str(scenarios), "--methods",
                                        "least-adapters,loraserve", "--workers", "2", "--jobs", "2",
                                        "--out", str(out)], tmp_path, want_workers=1)
    _check(code, stderr, children, out, kept=("results.json",))  # the scenarios done (it grows as they end)


def test_sweep_interrupted_keeps_whole_parts_only(tmp_path: Path) -> None:
    """A sweep keeps the rows of the units that completed (whole Parquet parts, resumable with --resume)."""
    import pyarrow.parquet as pq

    out = tmp_path / "sweep"
    code, stderr, children = interrupt(["sweep", "--preset", "paper-llama", "--limit", "300", "--workers", "2",
                                        "--out", str(out)], tmp_path, want_workers=2)
    parts = sorted(p.name for p in out.glob("part-*.parquet"))
    _check(code, stderr, children, out, kept=("_sweep.json", *parts))
    for name in parts:
        pq.read_table(out / name)  # complete
