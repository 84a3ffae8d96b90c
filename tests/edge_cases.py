"""Every operator-facing edge case of issue 12, runnable one by one in a fresh directory and a subprocess.

Each case is a CLI command line (``lorapack ...``) or a short Python API snippet with the files it needs. A case
runs in its own temporary directory (the working directory of the subprocess), under a memory cap and a time
limit, so a crash (SIGSEGV), a runaway allocation or a hang is reported as such instead of taking the machine
down. ``tests/test_edges.py`` asserts the outcome of every case; ``python tests/edge_cases.py`` prints the table
(command, exit code, first line of stderr, files left) quoted in the issue's closing note.

Placeholders in arguments and file texts: ``{examples}`` = the shipped examples, ``{data}`` = the shared data
directory (cases needing it are skipped when it is absent), ``{tmp}`` = the case's directory.
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import tempfile
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "src" / "lorapack" / "examples"
DATA = Path(os.environ.get("LORAPACK_DATA", REPO.parent / "shared" / "data"))
LLAMA = "llama-3.1-8b-instruct"
MEMORY_CAP_BYTES = 6 << 30  # a runaway allocation fails instead of swapping the machine to death
DEFAULT_TIMEOUT_S = 60.0
NOBODY = 65534

TRACE = "arrived_at,num_prefill_tokens,num_decode_tokens\n0.0,100,10\n1.5,200,20\n3.0,50,5\n"
TWO = "adapter_id,rank,rate_rps\na,8,0.1\nb,16,0.1\n"
GRID = """name: g
model: {model}
rate_pool_rps: {pool}
rate_tuple_size: 1
rank_tuples: [[8]]
served_adapters: [2]
adapter_slots: [2]
duration_s: {duration}
"""
RUNS_HEADER = ("run_id,model,n_adapters,max_loras,max_lora_rank,max_cpu_loras,max_num_seqs,max_num_batched_tokens,"
               "rank_counts,rate_counts,window_s,mean_input_tokens,mean_output_tokens,status,throughput_tok_s,"
               "itl_mean_ms,ttft_mean_ms,throughput_ratio,starved\n")


def runs_row(run_id: str, model: str = LLAMA, rates: str = "0.1:4", window_s: float = 60) -> str:
    return (f"{run_id},{model},4,4,16,4,2048,2048,8:2 16:2,{rates},{window_s},223,197,ok,1000,20,100,0.99,0\n")


API = """
import math
import numpy as np
from lorapack.profile import find_profile
from lorapack.server import ServerConfig
from lorapack.twin.run import simulate_requests
from lorapack.twin.types import RequestArrays
prof = find_profile("llama-3.1-8b-instruct")
ranks = np.array([8, 16], np.int32)
def run(t, a, p, o, duration_s=60.0):
    req = RequestArrays(np.array(t, float), np.array(a), np.array(p), np.array(o))
    m, _ = simulate_requests(prof, ranks, req, ServerConfig(max_loras=2), duration_s)
    d = m.to_dict() if hasattr(m, "to_dict") else m  # (a dict before the typed results)
    print(f"ttft_mean_ms={d['ttft_mean_ms']:.1f} throughput_tok_s={d['throughput_tok_s']:.1f} "
          f"starved={d['starved']} n_arrived={d['n_arrived']}")
"""
ENGINE = """
import numpy as np
from lorapack.twin.engine import Engine, simulate_fast
from lorapack.twin.types import EngineConfig, RequestArrays
from lorapack.twin.steptime import StepModel
cfg = EngineConfig(load_ms=np.ones(2), disk_ms=np.ones(2), max_loras=1, max_cpu_loras=2, kv_blocks=64,
                   step_coef=StepModel(c0_ms=10.0, c1_ms_per_req=0.05).to_array(), duration_s=10.0)
"""


@dataclass
class Case:
    name: str
    summary: str  # what the issue says about it
    argv: list[str] | None = None  # lorapack arguments
    py: str | None = None  # or a Python snippet (prelude + body)
    body: str = ""  # the snippet's own line (shown in the table)
    files: dict[str, str] = field(default_factory=dict)  # name -> text ("/" in the name: subdirectory)
    dirs: tuple[str, ...] = ()  # directories to create
    read_only: tuple[str, ...] = ()  # directories made read-only (the case then runs as nobody)
    legit: bool = False  # a legitimate input: expect exit 0
    expect: str = ""  # after the fix: a substring of the one error line (or of stdout when legit)
    needs_data: bool = False
    timeout_s: float = DEFAULT_TIMEOUT_S

    @property
    def command(self) -> str:
        if self.argv is not None:
            return "lorapack " + " ".join(self.argv)
        return "python: " + self.body


@dataclass
class Outcome:
    code: int | None  # None: killed by the time limit
    stdout: str
    stderr: str
    left: list[str]  # files created by the command (relative to its directory)
    signal: str | None = None

    @property
    def first_line(self) -> str:
        lines = [ln for ln in self.stderr.splitlines() if ln.strip()]
        if lines and lines[0].startswith("Traceback"):  # show what was raised, too
            return f"Traceback ... {lines[-1].strip()}"
        return lines[0] if lines else ""

    @property
    def status(self) -> str:
        if self.code is None:
            return "hang (killed)"
        if self.signal:
            return f"{self.code} ({self.signal})"
        return str(self.code)


def _sub(text: str, tmp: Path) -> str:
    return text.replace("{examples}", str(EXAMPLES)).replace("{data}", str(DATA)).replace("{tmp}", str(tmp))


# a ValueError (the API's documented error) is reported like the CLI does: one line on stderr, exit code 2
CATCH = """
import sys
try:
{body}
except ValueError as e:
    print(f"{{type(e).__name__}}: {{e}}", file=sys.stderr)
    sys.exit(2)
"""


def _api(name: str, summary: str, body: str, **kw) -> Case:
    return Case(name, summary, py=API + CATCH.format(body=textwrap.indent(body, "    ")), body=body, **kw)


def _engine(name: str, summary: str, body: str, **kw) -> Case:
    return Case(name, summary, py=ENGINE + CATCH.format(body=textwrap.indent(body, "    ")), body=body, **kw)


M = ["-m", LLAMA]
S = ["--duration-s", "60"]
CASES: list[Case] = [
    # ---- Python API --------------------------------------------------------------------------------------
    _api("api adapter index out of range", "SIGSEGV (exit 139)", "run([0.0, 1.0], [0, 5], [10, 10], [5, 5])", expect="adapter"),
    _api("api adapter index 10**9", "SIGSEGV", "run([0.0, 1.0], [0, 10**9], [10, 10], [5, 5])", expect="adapter"),
    _api("api negative adapter index", "raw numpy error", "run([0.0, 1.0], [0, -1], [10, 10], [5, 5])", expect="adapter"),
    _api("api unsorted arrivals", "mean TTFT 2,029 ms instead of 19 ms", "t = np.linspace(0, 50, 200)[::-1]; run(t, np.arange(200) % 2, [100] * 200, [20] * 200)", expect="sorted"),
    _api("api negative arrival time", "accepted", "run([-5.0, 1.0], [0, 1], [10, 10], [5, 5])", expect="t_arr_s"),
    _api("api NaN arrival time", "counted as incoming, never arrives: 'starved'", "run([0.0, float('nan')], [0, 1], [10, 10], [5, 5])", expect="t_arr_s"),
    _api("api zero prompt tokens", "accepted", "run([0.0, 1.0], [0, 1], [0, 10], [5, 5])", expect="prompt_tokens"),
    _api("api negative output tokens", "accepted", "run([0.0, 1.0], [0, 1], [10, 10], [-3, 5])", expect="output_tokens"),
    _api("api 2**31+5-token prompt", "int32 wrap: negative throughput", "run([0.0, 1.0], [0, 1], [2**31 + 5, 10], [5, 5])", expect="prompt_tokens"),
    _api("api arrays of different lengths", "(checked)", "run([0.0, 1.0], [0], [10, 10], [5, 5])", expect="same length"),
    _api("api 2-D arrays", "(new)", "run([[0.0, 1.0]], [[0, 1]], [[10, 10]], [[5, 5]])", expect="1-D"),
    _api("api float adapter indices", "(new: silently truncated)", "run([0.0, 1.0], [0.5, 1.7], [10, 10], [5, 5])", expect="integer"),
    _engine("api engine adapter out of range", "SIGSEGV in simulate_fast / Engine",
            "simulate_fast(cfg, RequestArrays([0.0, 0.1], [0, 7], [20, 30], [3, 4]))", expect="adapter"),
    _api("api legit run", "(control)", "run([0.0, 1.0], [0, 1], [100, 10], [5, 5])", legit=True,
         expect="ttft_mean_ms="),
    # ---- huge values -------------------------------------------------------------------------------------
    Case("rate_rps 1e9", "447 GiB allocation",
         argv=["simulate", "w.yaml", *M, "-a", "1"],
         files={"w.yaml": "adapters:\n  - {adapter_id: a, rank: 8, rate_rps: 1e9}\n"}, expect="requests"),
    Case("mean_input_tokens 1e12 (YAML)", "int32 overflow",
         argv=["simulate", "w.yaml", *M, "-a", "1", *S],
         files={"w.yaml": "adapters:\n  - {adapter_id: a, rank: 8, rate_rps: 0.1}\n"
                          "lengths: {kind: fixed, mean_input_tokens: 1e12}\n"}, expect="mean_input_tokens"),
    Case("--mean-input-tokens 1e12", "int32 overflow",
         argv=["simulate", "{examples}/demo.yaml", *M, "-a", "8", *S, "--mean-input-tokens", "1e12"],
         expect="--mean-input-tokens"),
    Case("--duration-s 1e15", "traceback or hang",
         argv=["simulate", "{examples}/demo.yaml", *M, "-a", "8", "--duration-s", "1e15"], expect="duration_s"),
    Case("lognormal arrivals sigma 50", "math range error",
         argv=["simulate", "w.yaml", *M, "-a", "1", *S],
         files={"w.yaml": "adapters:\n  - {adapter_id: a, rank: 8, rate_rps: 0.1}\n"
                          "arrivals: {kind: lognormal, sigma: 50}\n"}, expect="sigma"),
    Case("validate rate_counts 1e9:4", "traceback",
         argv=["validate", "runs.csv", "--workers", "1"],
         files={"runs.csv": RUNS_HEADER + runs_row("big", rates="1e9:4")}, expect="requests"),
    Case("trace load_scale 1e9", "hang",
         argv=["simulate", "w.yaml", *M, "-a", "2", *S],
         files={"trace.csv": TRACE, "w.yaml": "adapters:\n  - {count: 2, rank: 8, rate_rps: 0.1}\n"
                "arrivals: {kind: trace, path: trace.csv, load_scale: 1e9}\n"}, expect="load_scale"),
    Case("unpredictable period_s 0.0001", "hang",
         argv=["simulate", "w.yaml", *M, "-a", "2"],
         files={"w.yaml": "adapters:\n  - {count: 2, rank: 8, rate_rps: 0.1}\n"
                          "arrivals: {kind: unpredictable, period_s: 0.0001}\n"}, expect="period_s"),
    Case("sweep rate_pool_rps [1e9]", "traceback; leaves .lock and _sweep.json",
         argv=["sweep", "g.yaml", "--out", "sw", "--workers", "1"],
         files={"g.yaml": GRID.format(model=LLAMA, pool="[1.0e9]", duration=3600)}, expect="requests"),
    Case("sweep duration_s 1e12", "traceback; leaves .lock and _sweep.json",
         argv=["sweep", "g.yaml", "--out", "sw", "--workers", "1"],
         files={"g.yaml": GRID.format(model=LLAMA, pool="[0.1]", duration="1.0e12")}, expect="duration_s"),
    # ---- output paths ------------------------------------------------------------------------------------
    Case("simulate --timeline in a read-only dir", "traceback",
         argv=["simulate", "{examples}/demo.yaml", *M, "-a", "8", *S, "--timeline", "ro/tl.csv"],
         dirs=("ro",), read_only=("ro",), expect="--timeline"),
    Case("simulate --timeline is a directory", "traceback",
         argv=["simulate", "{examples}/demo.yaml", *M, "-a", "8", *S, "--timeline", "adir"],
         dirs=("adir",), expect="--timeline"),
    Case("validate --out in a read-only dir", "traceback after the work",
         argv=["validate", "runs.csv", "--workers", "1", "--out", "ro/v.csv"],
         files={"runs.csv": RUNS_HEADER + runs_row("r1")}, dirs=("ro",), read_only=("ro",), expect="--out"),
    Case("validate --out is a directory", "traceback after the work",
         argv=["validate", "runs.csv", "--workers", "1", "--out", "adir"],
         files={"runs.csv": RUNS_HEADER + runs_row("r1")}, dirs=("adir",), expect="--out"),
    Case("calibrate --out is a directory", "traceback; leaves <name>.tmp",
         argv=["calibrate", "--profiling", "{data}/profiling", *M, "--out", "adir"], dirs=("adir",),
         needs_data=True, expect="--out", timeout_s=120),
    Case("calibrate --out in a read-only dir", "traceback after the fits",
         argv=["calibrate", "--profiling", "{data}/profiling", *M, "--out", "ro/p.yaml"], dirs=("ro",),
         read_only=("ro",), needs_data=True, expect="--out", timeout_s=120),
    Case("calibrate --report is a file", "traceback after the fits",
         argv=["calibrate", "--profiling", "{data}/profiling", *M, "--out", "p.yaml", "--report", "afile"],
         files={"afile": "x"}, needs_data=True, expect="--report", timeout_s=120),
    Case("calibrate --report in a read-only dir", "traceback after the fits",
         argv=["calibrate", "--profiling", "{data}/profiling", *M, "--out", "p.yaml", "--report", "ro/rep"],
         dirs=("ro",), read_only=("ro",), needs_data=True, expect="--report", timeout_s=120),
    Case("sweep --out in a read-only dir", "traceback",
         argv=["sweep", "g.yaml", "--out", "ro/sw", "--workers", "1"],
         files={"g.yaml": GRID.format(model=LLAMA, pool="[0.1]", duration=60)}, dirs=("ro",), read_only=("ro",),
         expect="--out"),
    Case("sweep --out is a file", "(checked)",
         argv=["sweep", "g.yaml", "--out", "afile", "--workers", "1"],
         files={"g.yaml": GRID.format(model=LLAMA, pool="[0.1]", duration=60), "afile": "x"}, expect="--out"),
    # ---- conflicting or inconsistent options ---------------------------------------------------------------
    Case("--profile with --model", "--profile silently overrides --model",
         argv=["simulate", "{examples}/demo.yaml", "-m", "qwen-2.5-7b-instruct", "--profile",
               "{examples}/../profiles/h100-64gb__vllm-0.8.5__llama-3.1-8b-instruct.yaml", "-a", "8", *S],
         expect="--profile"),
    Case("validate --limit 0", "accepted (sweep rejects it)",
         argv=["validate", "runs.csv", "--limit", "0"], files={"runs.csv": RUNS_HEADER + runs_row("r1")},
         expect="--limit 0"),
    Case("validate --workers -1", "accepted (sweep rejects it)",
         argv=["validate", "runs.csv", "--workers", "-1"], files={"runs.csv": RUNS_HEADER + runs_row("r1")},
         expect="--workers -1"),
    Case("sweep --out with a missing parent", "created (other commands refuse)",
         argv=["sweep", "g.yaml", "--out", "missing/sub/sw", "--workers", "1"],
         files={"g.yaml": GRID.format(model=LLAMA, pool="[0.1]", duration=60)}, expect="does not exist"),
    Case("--early-stop with --client-cap", "silently runs the full window",
         argv=["simulate", "{examples}/demo.yaml", *M, "-a", "8", *S, "--early-stop", "--client-cap", "100"],
         expect="--client-cap"),
    Case("trace path is a directory", "'file not found'",
         argv=["simulate", "w.yaml", *M, "-a", "2", *S], dirs=("tdir",),
         files={"w.yaml": "adapters:\n  - {count: 2, rank: 8, rate_rps: 0.1}\n"
                          "arrivals: {kind: trace, path: tdir}\n"}, expect="directory"),
    Case("--profile is a directory", "'file not found'",
         argv=["simulate", "{examples}/demo.yaml", "--profile", "pdir", "-a", "8", *S], dirs=("pdir",),
         expect="directory"),
    Case("legit: simulate --max-loras scan", "(new: a table row per value)",
         argv=["simulate", "{examples}/demo.yaml", *M, "--max-loras", "4,8,16", *S], legit=True,
         expect="smallest safe --max-loras"),
    Case("legit: validate --profile FILE", "(new: score a profile file)",
         argv=["validate", "runs.csv", "--workers", "1", "--profile",
               "{examples}/../profiles/h100-64gb__vllm-0.8.5__llama-3.1-8b-instruct.yaml"],
         files={"runs.csv": RUNS_HEADER + runs_row("r1") + runs_row("q1", model="qwen-2.5-7b-instruct")},
         legit=True, expect="skipped 1 run(s) of qwen-2.5-7b-instruct"),
    Case("calibrate --workers -1", "(new: accepted, the fits ran; every other command refuses it)",
         argv=["calibrate", "--profiling", "{data}/profiling", *M, "--workers", "-1", "--out", "p.yaml"],
         needs_data=True, expect="--workers -1"),
    Case("legit: validate --json names skipped runs", "(new: reasons printed and in --json)",
         argv=["validate", "runs.csv", "--workers", "1", "--json"],
         files={"runs.csv": RUNS_HEADER + runs_row("r1") + runs_row("m1", model="mistral-7b")}, legit=True,
         expect='"reason": "model \'mistral-7b\': no shipped profile'),
    # ---- what operators expect -----------------------------------------------------------------------------
    Case("legit: --max-num-seqs / --max-num-batched-tokens", "(new: flags; defaults documented in --help)",
         argv=["simulate", "{examples}/demo.yaml", *M, "-a", "8", *S, "--max-num-seqs", "256",
               "--max-num-batched-tokens", "8192", "--json"], legit=True,
         expect='"max_num_batched_tokens": 8192,\n    "max_num_seqs": 256,'),
    Case("legit: starved adapters named (--json)", "(new: starved_adapter_ids)",
         argv=["simulate", "hot.yaml", *M, "-a", "1", "--duration-s", "600", "--json"],
         files={"hot.yaml": "adapters:\n  - {count: 24, rank: 16, rate_rps: 0.6, id_prefix: hot}\n"}, legit=True,
         expect='"starved_adapter_ids": [\n    "hot-'),
    Case("validate runs of a model without a profile", "'skipped 5', no reason, exit 0",
         argv=["validate", "runs.csv", "--workers", "1"],
         files={"runs.csv": RUNS_HEADER + "".join(runs_row(f"m{i}", model="mistral-7b") for i in range(5))},
         expect="no shipped profile"),
]


def _limit_memory() -> None:  # runs in the child before exec
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CAP_BYTES, MEMORY_CAP_BYTES))
    os.setsid()


def _numba_cache_for_nobody() -> Path:
    """A numba cache directory nobody can write, seeded with the twin's cached machine code (numba keys it by
    the source file's content), so a case run as nobody does not spend half a minute compiling."""
    import hashlib
    import importlib.util
    import shutil

    spec = importlib.util.find_spec("lorapack")
    assert spec is not None and spec.origin is not None
    twin = Path(spec.origin).parent / "twin"
    root = Path(tempfile.gettempdir()) / "lorapack-edge-cases-numba"
    sub = root / f"twin_{hashlib.sha1(str(twin).encode()).hexdigest()}"  # numba's UserProvidedCacheLocator
    sub.mkdir(parents=True, exist_ok=True)
    for f in (twin / "__pycache__").glob("*.nb[ic]"):
        shutil.copy2(f, sub / f.name)
    for d in (root, sub):
        os.chmod(d, 0o1777)
    for f in sub.iterdir():
        os.chmod(f, 0o666)
    return root


def _tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def run_case(case: Case, tmp: Path, timeout_s: float | None = None) -> Outcome:
    """Run ``case`` with ``tmp`` (empty) as its directory; report exit code, output and the files it left."""
    for d in case.dirs:
        (tmp / d).mkdir(parents=True, exist_ok=True)
    for name, text in case.files.items():
        p = tmp / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(_sub(text, tmp))
    nobody = bool(case.read_only) and os.geteuid() == 0
    if nobody:  # root ignores permissions: drop to nobody, who may write only in tmp itself
        os.chmod(tmp, 0o777)
        for p in tmp.rglob("*"):
            os.chmod(p, 0o777 if p.is_dir() else 0o666)
    for d in case.read_only:
        os.chmod(tmp / d, 0o555)
    before = _tree(tmp)
    if case.argv is not None:
        cmd = [sys.executable, "-m", "lorapack.cli", *(_sub(a, tmp) for a in case.argv)]
    else:
        cmd = [sys.executable, "-c", case.py or ""]
    if nobody:
        cmd = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *cmd]
    env = {**os.environ, "COLUMNS": "80", "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("LORAPACK_DEBUG", None)
    if nobody:
        env["NUMBA_CACHE_DIR"] = str(_numba_cache_for_nobody())
    proc = subprocess.Popen(cmd, cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_limit_memory)
    try:
        out, err = proc.communicate(timeout=timeout_s or case.timeout_s)
        code: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        code = None
    finally:
        for d in case.read_only:
            os.chmod(tmp / d, 0o755)
    sig = None
    if code is not None and code < 0:
        sig = signal.Signals(-code).name
        code = 128 - code
    left = sorted(_tree(tmp) - before)
    return Outcome(code, out, err, left, sig)


def table(cases: list[Case] | None = None, timeout_s: float | None = None) -> str:
    """Markdown table of every case (run now)."""
    rows = ["| case | command | exit | first line of stderr | files left |", "|---|---|---|---|---|"]
    for case in cases or CASES:
        if case.needs_data and not DATA.is_dir():
            rows.append(f"| {case.name} | `{case.command}` | skipped | (no data at {DATA}) | |")
            continue
        with tempfile.TemporaryDirectory(prefix="edge-") as d:
            o = run_case(case, Path(d), timeout_s)
        first = o.first_line.replace("|", "\\|")[:160]
        if o.code == 0 and not first:  # no error: show the result instead (its first line)
            first = "stdout: " + (o.stdout.strip().splitlines() or [""])[0].strip()[:120]
        cmd = case.command.replace(str(EXAMPLES), "EX").replace(str(DATA), "DATA").replace("|", "\\|")
        rows.append(f"| {case.name} | `{cmd}` | {o.status} | {first} | {', '.join(o.left) or '-'} |")
        print(rows[-1], file=sys.stderr, flush=True)
    return "\n".join(rows)


if __name__ == "__main__":
    names = set(sys.argv[1:])
    print(table([c for c in CASES if not names or c.name in names]))
