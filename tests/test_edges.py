"""Issue 12: every bad input is one clean error, every output path is checked first, nothing is left behind.

* every case of ``edge_cases.CASES`` (the issue's list) gives exit code 2, one error line naming the input and
  no leftover file -- or a correct result where the input is legitimate;
* hypothesis feeds random invalid arrays to the public twin entry points and random option combinations to
  the CLI; every outcome must be a result or a clean error: no crash, no traceback, no hang.

Cases run in a long-lived subprocess (``edge_worker.py``) with a time limit, so a crash or a hang fails the
test that caused it instead of the whole run; cases that need another user (read-only directories, when the
tests run as root) run through ``setpriv``.
"""

from __future__ import annotations

import json
import math
import os
import select
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rich.console import Console

from edge_cases import CASES, DATA, EXAMPLES, LLAMA, Case, _sub, _tree, run_case
from edge_worker import encode

HERE = Path(__file__).parent
CASE_TIMEOUT_S = 60.0


class Worker:
    """One ``edge_worker.py`` process; ``call`` restarts it after a crash or a time-out."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None

    def _start(self) -> subprocess.Popen:
        env = {**os.environ, "COLUMNS": "80"}
        env.pop("LORAPACK_DEBUG", None)
        return subprocess.Popen([sys.executable, str(HERE / "edge_worker.py")], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, cwd=HERE)

    def call(self, request: dict, timeout_s: float = CASE_TIMEOUT_S) -> dict:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = self._start()
        proc = self.proc
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(encode(request))
        proc.stdin.flush()
        ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
        line = proc.stdout.readline() if ready else b""
        if line:
            return json.loads(line)
        self.proc = None
        if not ready:  # no answer in time: a hang
            proc.kill()
            proc.wait()
            return {"code": None, "stdout": "", "stderr": f"hang: no answer within {timeout_s:g} s"}
        proc.wait()  # end of output: the worker died
        return {"code": 128 - proc.returncode if proc.returncode < 0 else proc.returncode, "stdout": "",
                "stderr": f"crash: worker died with status {proc.returncode}"}

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()  # type: ignore[union-attr]
            self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def worker():
    w = Worker()
    yield w
    w.close()


def assert_clean_error(reply: dict, match: str = "") -> None:
    """Exit code 2, one line on stderr (naming ``match``), no traceback, nothing on stdout."""
    err = reply["stderr"]
    assert reply["code"] == 2, reply
    assert "Traceback" not in err + reply["stdout"], err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert match in lines[0], (match, lines[0])


# ---- the issue's cases ------------------------------------------------------------------------------------


def _needs_other_user(case: Case) -> bool:
    return bool(case.read_only) and os.geteuid() == 0


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_issue_case(case: Case, worker: Worker, tmp_path: Path) -> None:
    if case.needs_data and not DATA.is_dir():
        pytest.skip(f"shared data not found at {DATA}")
    if _needs_other_user(case):
        if shutil.which("setpriv") is None:
            pytest.skip("read-only cases as root need setpriv (root ignores permissions)")
        o = run_case(case, tmp_path)
        reply = {"code": o.code, "stdout": o.stdout, "stderr": o.stderr}
        left = o.left
    else:
        for d in case.dirs:
            (tmp_path / d).mkdir(parents=True, exist_ok=True)
        for name, text in case.files.items():
            (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / name).write_text(_sub(text, tmp_path))
        for d in case.read_only:
            os.chmod(tmp_path / d, 0o555)
        before = _tree(tmp_path)
        if case.argv is not None:
            request = {"kind": "cli", "argv": [_sub(a, tmp_path) for a in case.argv], "cwd": str(tmp_path)}
        else:
            request = {"kind": "py", "code": case.py, "cwd": str(tmp_path)}
        reply = worker.call(request, case.timeout_s)
        for d in case.read_only:
            os.chmod(tmp_path / d, 0o755)
        left = sorted(_tree(tmp_path) - before)
    if case.legit:
        assert reply["code"] == 0, reply
        assert case.expect in reply["stdout"]
    else:
        assert_clean_error(reply, case.expect)
    assert left == [], left


# ---- random invalid arrays through the public API --------------------------------------------------------

INT32_MAX = 2**31 - 1
N_ADAPTERS = 3
BAD_TIMES = [math.nan, math.inf, -math.inf, -1.0, -1e-9]
BAD_TOKENS = [0, -1, -(2**31), 2**31, 2**31 + 5, 2**40, 2**62]
BAD_ADAPTERS = [-1, N_ADAPTERS, N_ADAPTERS + 1, 10**9, 2**31, 2**40]
DTYPES = ["int64", "int32", "uint32", "float64", "float32", "bool"]


def _column(draw, good, bad, n: int, dtype_choices: list[str]) -> np.ndarray:
    vals = [draw(good) for _ in range(n)]
    if n and draw(st.integers(0, 3)) == 0:
        vals[draw(st.integers(0, n - 1))] = draw(st.sampled_from(bad))
    dtype = draw(st.sampled_from(dtype_choices))
    a = np.asarray(vals)
    try:
        with np.errstate(all="ignore"):
            cast = a.astype(dtype)
        if dtype != "bool" and not np.array_equal(cast.astype(a.dtype), a, equal_nan=a.dtype.kind == "f"):
            return a  # the cast would change values: keep the natural dtype
        return cast
    except (OverflowError, ValueError):
        return a


@st.composite
def request_arrays(draw):
    n = draw(st.integers(0, 12))
    t = sorted(draw(st.floats(0, 50, allow_nan=False)) for _ in range(n))
    if n > 1 and draw(st.integers(0, 4)) == 0:  # unsorted
        i = draw(st.integers(0, n - 2))
        t[i], t[i + 1] = t[i + 1] + 1.0, t[i]
    times = np.asarray(t, dtype=np.float64)
    if n and draw(st.integers(0, 4)) == 0:
        times[draw(st.integers(0, n - 1))] = draw(st.sampled_from(BAD_TIMES))
    adapters = _column(draw, st.integers(0, N_ADAPTERS - 1), BAD_ADAPTERS, n, DTYPES)
    prompt = _column(draw, st.integers(1, 3000), BAD_TOKENS, n, DTYPES)
    output = _column(draw, st.integers(1, 300), BAD_TOKENS, n, DTYPES)
    arrays = [times, adapters, prompt, output]
    shape = draw(st.integers(0, 9))
    if shape == 0 and n:  # one array shorter
        k = draw(st.integers(0, 3))
        arrays[k] = arrays[k][:-1]
    elif shape == 1:  # 2-D
        k = draw(st.integers(0, 3))
        arrays[k] = arrays[k].reshape(1, -1)
    return arrays


def expected_valid(t, a, p, o) -> bool:
    """The contract of ``RequestArrays``, restated independently of the implementation."""
    arrays = [np.asarray(x) for x in (t, a, p, o)]
    if any(x.ndim != 1 for x in arrays) or len({len(x) for x in arrays}) != 1:
        return False
    if any(x.dtype == bool for x in arrays):
        return False
    t, a, p, o = arrays
    if len(t) and (not np.all(np.isfinite(t)) or np.any(t < 0) or np.any(np.diff(t) < 0)):
        return False
    for x, lo, hi in ((a, 0, N_ADAPTERS - 1), (p, 1, INT32_MAX), (o, 1, INT32_MAX)):
        vals = [float(v) if x.dtype.kind == "f" else int(v) for v in x]
        if any(not (lo <= v <= hi) or v != int(v) for v in vals):
            return False
    return True


API_ARRAYS = dict(arrays=request_arrays(), entry=st.sampled_from(["simulate_requests", "simulate_fast", "Engine",
                                                                  "sorted"]),
                  max_loras=st.integers(1, N_ADAPTERS), duration_s=st.sampled_from([5.0, 30.0]))


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**API_ARRAYS)
def test_api_random_arrays_quick(worker: Worker, arrays, entry: str, max_loras: int, duration_s: float) -> None:
    """The fast tier's sample; the 60 examples of the next test run in the slow tier."""
    check_api_outcome(worker, arrays, entry, max_loras, duration_s)


@pytest.mark.slow
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**API_ARRAYS)
def test_api_random_arrays(worker: Worker, arrays, entry: str, max_loras: int, duration_s: float) -> None:
    check_api_outcome(worker, arrays, entry, max_loras, duration_s)


def check_api_outcome(worker: Worker, arrays, entry: str, max_loras: int, duration_s: float) -> None:
    reply = worker.call({"kind": "api", "entry": entry, "arrays": arrays, "ranks": [8, 16, 8],
                         "max_loras": max_loras, "duration_s": duration_s}, 60.0)
    # RequestArrays.sorted repairs the order, and only the order
    if expected_valid(*(_time_sorted(arrays) if entry == "sorted" else arrays)):
        assert reply["code"] == 0, reply
    else:
        assert_clean_error(reply)
        assert reply["stderr"].startswith("SpecError:"), reply["stderr"]


def _time_sorted(arrays: list[np.ndarray]) -> list[np.ndarray]:
    if any(np.ndim(x) != 1 for x in arrays) or len({len(x) for x in arrays}) != 1 or arrays[1].dtype == bool:
        return arrays
    order = np.lexsort((arrays[1], arrays[0]))
    return [x[order] for x in arrays]


# ---- random option combinations through the CLI runner ------------------------------------------------------

DEMO = str(EXAMPLES / "demo.yaml")
LLAMA_PROFILE = str(EXAMPLES.parent / "profiles" / f"h100-64gb__vllm-0.8.5__{LLAMA}.yaml")
COMMON: dict[str, list] = {
    "--profile": [LLAMA_PROFILE, "{tmp}", "{tmp}/missing.yaml"],
    "--gpu": ["h100-64gb", "a100"],
    "--workers": [1, 0, -1],
    "--limit": [1, 0, -2],
}
OPTIONS: dict[str, dict[str, list]] = {
    "simulate": {
        "--max-loras": [8, 1, 0, -3, "4,8", "8,0", "abc", 10**12],
        "--duration-s": [20, 0, -1, "nan", "inf", "1e15", "1e-9"],
        "--seed": [0, 3, -1],
        "--max-num-seqs": [2048, 1, 0, -5, 10**19],
        "--max-num-batched-tokens": [2048, 16, 0, -1],
        "--max-lora-rank": [16, 8, 0, 512],
        "--max-cpu-loras": [64, 4, 0],
        "--max-model-len": [4096, 0, 10**7],
        "--client-cap": [0, 100, -1],
        "--mean-input-tokens": [300, 0, "1e12", "nan"],
        "--mean-output-tokens": [100, -1],
        "--model": [LLAMA, "qwen-2.5-7b-instruct", "gpt-5"],
        "--gpu": COMMON["--gpu"], "--profile": COMMON["--profile"],
        "--timeline": ["{tmp}/tl.csv", "{tmp}", "{tmp}/no/tl.csv"],
    },
    "validate": {
        "--seeds": [1, 0], "--lengths": ["fixed", "lognormal", "zipf"], "--out": ["{tmp}/v.csv", "{tmp}",
                                                                                 "{tmp}/no/v.csv"],
        **{k: COMMON[k] for k in ("--profile", "--gpu", "--workers", "--limit")},
    },
    "sweep": {
        "--out": ["{tmp}/sw", "{tmp}/bad.csv", "{tmp}/no/sw"], "--backend": ["local", "spark"],
        "--seed": [0, -1], "--early-stop-tests": ["certain", "sometimes"], "--model": [LLAMA, "gpt-5"],
        **{k: COMMON[k] for k in ("--workers", "--limit")},
    },
}
FLAGS = {"simulate": ["--early-stop", "--cold-start", "--force", "--json"], "validate": ["--force", "--json"],
         "sweep": ["--force", "--json", "--resume", "--no-prune"]}
ARGUMENTS = {"simulate": [DEMO, "{tmp}", "{tmp}/missing.yaml", "{tmp}/bad.csv"],
             "validate": ["{tmp}/runs.csv", "{tmp}", "{tmp}/bad.csv"],
             "sweep": ["{tmp}/g.yaml", "{tmp}/big.yaml", "{tmp}/bad.csv"]}
CLI_FILES = {"bad.csv": "adapter_id,rank,rate_rps\na,8,-1\n",
             "runs.csv": CASES[[c.name for c in CASES].index("validate --limit 0")].files["runs.csv"],
             "g.yaml": CASES[[c.name for c in CASES].index("sweep --out is a file")].files["g.yaml"],
             "big.yaml": CASES[[c.name for c in CASES].index("sweep rate_pool_rps [1e9]")].files["g.yaml"]}


@st.composite
def cli_argv(draw, cmd: str) -> list[str]:
    pool = OPTIONS[cmd]
    argv = [cmd, draw(st.sampled_from(ARGUMENTS[cmd]))]
    opts = draw(st.lists(st.sampled_from(sorted(pool)), unique=True, max_size=6))
    if cmd == "simulate":  # mostly well-formed enough to reach the interesting checks
        if "--max-loras" not in opts and draw(st.booleans()):
            opts.append("--max-loras")
        if "--model" not in opts and "--profile" not in opts and draw(st.integers(0, 3)):
            opts.append("--model")
    if cmd == "sweep" and "--out" not in opts and draw(st.integers(0, 3)):
        opts.append("--out")
    for o in opts:
        argv += [o, str(draw(st.sampled_from(pool[o])))]
    argv += draw(st.lists(st.sampled_from(FLAGS[cmd]), unique=True, max_size=3))
    return argv + _bounds(cmd, opts)


def _bounds(cmd: str, opts: list[str]) -> list[str]:
    """Keep a run short where the options leave it long (a shorter window, one sweep configuration)."""
    if cmd == "simulate" and "--duration-s" not in opts:
        return ["--duration-s", "20"]
    if cmd == "sweep" and "--limit" not in opts:
        return ["--limit", "1"]
    return []


def check_cli_outcome(worker: Worker, argv: list[str]) -> None:
    """A result or a clean error: exit 0 or 2, no traceback, one line for lorapack's own errors, no crash or
    hang (the worker's time limit), and nothing left behind but the outputs asked for."""
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for name, text in CLI_FILES.items():
            (tmp / name).write_text(text)
        before = _tree(tmp)
        reply = worker.call({"kind": "cli", "argv": [_sub(a, tmp) for a in argv], "cwd": d}, 60.0)
        made = sorted(_tree(tmp) - before)
    assert reply["code"] in (0, 2), (argv, reply)
    assert "Traceback" not in reply["stderr"] + reply["stdout"], (argv, reply["stderr"])
    if reply["code"] == 2:
        assert_clean_error(reply)  # one line, lorapack's own errors and click's usage errors alike
        assert made == [], (argv, made)
    else:  # the outputs asked for, nothing else (no .tmp, no probe files)
        assert all(m.split("/")[0] in ("tl.csv", "v.csv", "sw") and ".tmp" not in m and "probe" not in m
                   for m in made), (argv, made)


# one strategy per command (a shared one drew simulate for 1 example in 5), 40 random combinations each (slow
# tier; the fast tier draws 10 each)
@pytest.mark.parametrize("cmd", sorted(OPTIONS))
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_cli_random_options_quick(worker: Worker, cmd: str, data) -> None:
    check_cli_outcome(worker, data.draw(cli_argv(cmd), label="argv"))


@pytest.mark.slow
@pytest.mark.parametrize("cmd", sorted(OPTIONS))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_cli_random_options(worker: Worker, cmd: str, data) -> None:
    check_cli_outcome(worker, data.draw(cli_argv(cmd), label="argv"))


# every listed value of every option at least once, on an otherwise valid command line (random combinations
# alone reach a rare value by chance only)
BASE = {"simulate": [DEMO, "--model", LLAMA, "--max-loras", "8", "--duration-s", "20"],
        "validate": ["{tmp}/runs.csv", "--workers", "1"],
        "sweep": ["{tmp}/g.yaml", "--out", "{tmp}/sw", "--limit", "1", "--workers", "1"]}
SINGLE = [(cmd, opt, str(v)) for cmd in sorted(OPTIONS) for opt in sorted(OPTIONS[cmd]) for v in OPTIONS[cmd][opt]]
SINGLE += [(cmd, flag, None) for cmd in sorted(FLAGS) for flag in FLAGS[cmd]]


@pytest.mark.parametrize("cmd, option, value", SINGLE, ids=[f"{c} {o} {v or ''}".strip() for c, o, v in SINGLE])
def test_cli_each_option_value(worker: Worker, cmd: str, option: str, value: str | None) -> None:
    base = list(BASE[cmd])
    if option in ("--model", "--gpu") and "--model" in base:  # the option under test replaces the base's
        i = base.index("--model")
        del base[i:i + 2]
    if option == "--profile":  # --profile with --model is a conflict: tested, but also alone
        i = base.index("--model") if "--model" in base else None
        if i is not None:
            del base[i:i + 2]
    check_cli_outcome(worker, [cmd, *base, option, *([value] if value is not None else [])])


def test_a_refused_command_prints_its_error_alone(worker: Worker) -> None:
    """Drawn by ``test_cli_random_options`` (CI, 2026-11-29): a rank outside the profile's calibration warned
    before ``--max-model-len 0`` was refused, so the refusal was two lines. Warnings now follow the checks."""
    check_cli_outcome(worker, ["simulate", DEMO, "--max-model-len", "0", "--max-lora-rank", "512", "--max-loras", "8",
                               "--model", LLAMA, "--duration-s", "20"])


# ---- the shared checks and guards, directly -----------------------------------------------------------------


def test_output_checks(tmp_path: Path) -> None:
    from lorapack.checks import check_output_dir, check_output_file
    from lorapack.errors import SpecError

    (tmp_path / "d").mkdir()
    (tmp_path / "f").write_text("x")
    assert check_output_file(tmp_path / "new.csv", "--out") == tmp_path / "new.csv"
    assert check_output_file(tmp_path / "f", "--out") == tmp_path / "f"  # replaced atomically later
    for path, match in ((tmp_path / "d", "is a directory"), (tmp_path / "no" / "x.csv", "does not exist"),
                        (tmp_path / "f" / "x.csv", "is not a directory")):
        with pytest.raises(SpecError, match=match):
            check_output_file(path, "--out")
    assert check_output_dir(tmp_path / "d", "--out") == tmp_path / "d"
    assert check_output_dir(tmp_path / "new", "--out") == tmp_path / "new" and not (tmp_path / "new").exists()
    for path, match in ((tmp_path / "f", "not a directory"), (tmp_path / "a" / "b", "does not exist")):
        with pytest.raises(SpecError, match=match):
            check_output_dir(path, "--out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "f"]  # the probes left nothing


def test_atomic_path_leaves_nothing_on_failure(tmp_path: Path) -> None:
    from lorapack.checks import atomic_path, write_text_atomic
    from lorapack.errors import SpecError

    target = tmp_path / "out.yaml"
    target.write_text("old")
    with pytest.raises(RuntimeError), atomic_path(target) as tmp:
        tmp.write_text("half")
        raise RuntimeError("boom")
    assert target.read_text() == "old" and sorted(tmp_path.iterdir()) == [target]
    (tmp_path / "adir").mkdir()
    with pytest.raises(SpecError, match="cannot write"):  # a directory in the way: one line, no .tmp left
        write_text_atomic(tmp_path / "adir", "x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir", "out.yaml"]
    write_text_atomic(target, "new")
    assert target.read_text() == "new" and oct(target.stat().st_mode & 0o777) != "0o600"


def test_limits_refuse_then_force_runs() -> None:
    from lorapack.errors import ResourceLimitError
    from lorapack.guards import Limits
    from lorapack.profile import find_profile
    from lorapack.server import ServerConfig
    from lorapack.twin.run import simulate
    from lorapack.workload import load_workload

    prof, wl = find_profile(LLAMA), load_workload(DEMO)
    with pytest.raises(ResourceLimitError, match=r"gives 114 requests in one run; the limit is 100 requests "
                                                 r"\(--force lifts it\)"):
        simulate(prof, wl, ServerConfig(max_loras=8), 30.0, 0, limits=Limits(max_requests=100))
    with pytest.raises(ResourceLimitError, match="memory"):
        simulate(prof, wl, ServerConfig(max_loras=8), 30.0, 0, limits=Limits(max_memory_bytes=1000))
    with pytest.raises(ResourceLimitError, match="engine steps"):
        simulate(prof, wl, ServerConfig(max_loras=8), 30.0, 0, limits=Limits(max_steps=10))
    out, _ = simulate(prof, wl, ServerConfig(max_loras=8), 30.0, 0, limits=Limits(max_requests=100, force=True))
    assert out.n_generated > 50  # ran: the soft limit was lifted


def test_generation_budget_stops_heavy_tails() -> None:
    """A heavy-tailed law can exceed its nominal count by far: generation counts as it goes."""
    from lorapack.errors import ResourceLimitError
    from lorapack.guards import Limits
    from lorapack.spec import Adapter, LognormalArrivals, Workload
    from lorapack.workload import generate_requests
    from lorapack.workload.arrivals import TooManyArrivals, lognormal_times

    wl = Workload(adapters=[Adapter(adapter_id="a", rank=8, rate_rps=1.0)], arrivals=LognormalArrivals(sigma=6.0))
    nominal = 600
    with pytest.raises(ResourceLimitError, match="adapter 'a'.*lognormal arrivals.*the limit is 2,000 requests"):
        generate_requests(wl, float(nominal), 0, Limits(max_requests=2_000))
    rng = np.random.default_rng(0)
    with pytest.raises(TooManyArrivals):  # sigma 50 (past the spec's bound): no math range error, no hang
        lognormal_times(rng, 0.1, 60.0, sigma=50.0, max_count=100_000)


def test_sweep_failure_leaves_no_store(tmp_path: Path, monkeypatch) -> None:
    """A sweep that fails before its first part leaves neither _sweep.json nor .lock nor its directory."""
    from lorapack.sweep import SweepOptions, load_grid, run_sweep
    from lorapack.sweep import runner as sweep_runner

    grid = tmp_path / "g.yaml"
    grid.write_text(_sub(CASES[[c.name for c in CASES].index("sweep --out is a file")].files["g.yaml"], tmp_path))

    def boom(*a, **k):
        raise RuntimeError("worker lost")
        yield  # pragma: no cover

    monkeypatch.setattr(sweep_runner, "execute", boom)
    with pytest.raises(RuntimeError, match="worker lost"):
        run_sweep(load_grid(grid), tmp_path / "sw", SweepOptions(workers=1))
    assert not (tmp_path / "sw").exists()
    monkeypatch.undo()
    summary = run_sweep(load_grid(grid), tmp_path / "sw", SweepOptions(workers=1))  # starts afresh, no --resume needed
    assert summary["rows"] == 1 and sorted(p.name for p in (tmp_path / "sw").iterdir() if p.name[0] != "p") == [
        "_sweep.json"]


# ---- operator-facing output: the --max-loras scan, starved adapters by name, 80 columns ----------------------


def _narrow() -> Console:
    return Console(width=80, record=True, color_system=None)


def _assert_fits(con: Console) -> str:
    text = con.export_text()
    too_long = [ln for ln in text.splitlines() if len(ln.rstrip()) > 80]
    assert not too_long, too_long
    assert "…" not in text, text  # rich's ellipsis: a value or header was cut
    return text


def test_scan_json_list_and_starved_ids(tmp_path: Path) -> None:
    wl = tmp_path / "hot.yaml"
    wl.write_text("adapters:\n  - {count: 24, rank: 16, rate_rps: 0.6, id_prefix: hot}\n")
    from typer.testing import CliRunner

    from lorapack.cli import app

    res = CliRunner().invoke(app, ["simulate", str(wl), "-m", LLAMA, "--max-loras", "1,24", "--duration-s", "600",
                                   "--json"])
    assert res.exit_code == 0, res.output
    runs = json.loads(res.stdout)
    assert [r["server"]["max_loras"] for r in runs] == [1, 24]
    one = runs[0]
    # new keys are added, the sweep's columns keep their names
    assert {"adapter_starved", "adapters_starved", "starved_adapter_indices", "starved_adapter_ids"} <= set(one)
    assert one["adapters_starved"] == len(one["starved_adapter_ids"]) > 0 and one["adapter_starved"] is True
    assert one["starved_adapter_ids"] == [f"hot-{i}" for i in one["starved_adapter_indices"]]
    single = json.loads(CliRunner().invoke(app, ["simulate", str(wl), "-m", LLAMA, "-a", "24", "--duration-s", "60",
                                                 "--json"]).stdout)
    assert isinstance(single, dict) and single["server"]["max_loras"] == 24  # one value: one object, as before


def test_layouts_fit_80_columns(monkeypatch, tmp_path: Path) -> None:
    from lorapack.cli import calibrate as cli_calibrate
    from lorapack.cli import profiles as cli_profiles
    from lorapack.cli import simulate as cli_simulate
    from lorapack.profile import find_profile
    from lorapack.server import ServerConfig
    from lorapack.twin.run import simulate
    from lorapack.workload import load_workload

    prof = find_profile(LLAMA)
    wl = load_workload(EXAMPLES / "demo.yaml")
    hot = tmp_path / "hot.yaml"
    hot.write_text("adapters:\n  - {count: 40, rank: 16, rate_rps: 0.6, id_prefix: a-rather-long-adapter-name}\n")
    starving = load_workload(hot)
    runs = [simulate(prof, wl, ServerConfig(max_loras=a), 300.0, 0)[0] for a in (4, 64, 100000)]
    bad, _ = simulate(prof, starving, ServerConfig(max_loras=2), 600.0, 0)
    assert bad.n_adapters_starved > 8 and runs[-1].oom

    con = _narrow()
    cli_simulate.render_run(bad, starving.adapter_ids, "llama-3.1-8b-instruct on h100-64gb: 40 adapters, 600 s, "
                                                       "seed 0", con)
    text = _assert_fits(con)
    for flag in ("--max-loras", "--max-lora-rank", "--max-cpu-loras", "--max-num-seqs", "--max-num-batched-tokens"):
        assert flag in text  # headers speak vLLM's flag names
    assert "a-rather-long-adapter-name-0" in text and "more" in text and "A=" not in text

    con = _narrow()
    cli_simulate.render_scan(runs, "llama-3.1-8b-instruct on h100-64gb: 64 adapters, 300 s, seed 0", con)
    text = _assert_fits(con)
    assert "--max-loras" in text and "oom" in text and "smallest safe --max-loras: 4" in text

    con = _narrow()
    monkeypatch.setattr(cli_profiles, "console", con)
    cli_profiles.profiles()
    assert "llama-3.1-8b-instruct" in _assert_fits(con)

    scores = {"smape_throughput": 1.31, "smape_itl": 3.0, "smape_ttft": 7.09, "smape_throughput_2x": 2.62,
              "smape_itl_2x": 5.99, "starved_agreement": 0.98, "starved_agreement_clear": 1.0, "oom_agreement": 1.0}
    summary = {
        "fits": {"memory": {"parameters": {"kv_tokens_base": 307528.7225, "kv_tokens_per_slot_rank": 43.9789},
                            "r2": 0.9996, "rmse": 1052.2, "n_points": 28},
                 "scheduler": {"parameters": {"ms_per_waiting_slot_ratio": 0.0003, "baseline_ms": 0.1964},
                               "r2": 0.89, "rmse": 0.59, "n_points": 788},
                 "loading": {"parameters": {"disk_medians_ms": {"8": 67.05, "16": 82.77, "32": 125.5}},
                             "n_points": 300}},
        "refinement": {"free": {"e1p": {"field": "steptime.e1p_ms_per_prefill_token", "unit": "ms/token",
                                        "prior": 0.0123, "refined": 0.0456}}},
        "validation": {"runs": "calibration.csv", "seeds": 1, "lengths": "lognormal", "priors": scores,
                       "refined": scores},
    }
    con = _narrow()
    cli_calibrate.render_calibration(summary, LLAMA, "h100-64gb", con)
    text = _assert_fits(con)
    assert "kv_tokens_base=307,528.7225" in text and "ms_per_waiting_slot_ratio=0.0003" in text

    # validate: one column per model
    from typer.testing import CliRunner

    from lorapack.cli import app
    from lorapack.cli import validate as cli_validate

    runs_csv = tmp_path / "runs.csv"
    runs_csv.write_text(CASES[[c.name for c in CASES].index("validate --limit 0")].files["runs.csv"])
    con = _narrow()
    monkeypatch.setattr(cli_validate, "console", con)
    assert CliRunner().invoke(app, ["validate", str(runs_csv), "--workers", "1"]).exit_code == 0
    assert "SMAPE throughput %" in _assert_fits(con)


def test_place_table_fits_80_columns(monkeypatch, tmp_path: Path) -> None:
    # --workers 1: placement's own process pool forks this process, and its long-lived children would keep the
    # edge worker's stdin open (so the worker would never see the end of its input)
    from typer.testing import CliRunner

    from lorapack.cli import app
    from lorapack.cli import place as cli_place

    con = _narrow()
    monkeypatch.setattr(cli_place, "console", con)
    res = CliRunner().invoke(app, ["place", str(EXAMPLES / "adapters.csv"), "-m", LLAMA, "--method", "round-robin",
                                   "--gpus", "2", "--no-verify", "--workers", "1", "--out", str(tmp_path / "plan")])
    assert res.exit_code == 0, res.output
    text = _assert_fits(con)
    assert "--max-loras /" in text and "--max-lora-rank" in text and "binding" in text
