"""The ``lorapack`` command line (issue 2, Deliver 7 and 8, and the bad-input acceptance criterion).

Most tests run in-process: ``CliRunner`` against ``lorapack.cli.app`` for successful commands, and
``lorapack.cli.main()`` (the console entry point, which maps ``LorapackError`` to one line and exit 2) with a
patched ``sys.argv`` for failures. A few go through the installed ``lorapack`` script in a subprocess.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from data_helpers import run_main
from lorapack import cli
from lorapack.cli import app, write_csv_atomic
from lorapack.errors import SpecError
from lorapack.workload import example_workload

LLAMA, QWEN = "llama-3.1-8b-instruct", "qwen-2.5-7b-instruct"
DEMO = str(example_workload())
SCRIPT = Path(sys.executable).parent / "lorapack"
JSON_KEYS = {"throughput_tok_s", "input_tok_s", "output_tok_s", "itl_mean_ms", "ttft_mean_ms",
             "ttft_penalised_mean_ms", "n_arrived", "n_completed", "incoming_tok_s", "starved", "oom",
             "kv_cache_tokens", "wall_s", "compile_s"}
TIMELINE_COLUMNS = ["t_s", "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                    "num_preemptions_total", "num_adapters_resident"]
TRACE = "arrived_at,num_prefill_tokens,num_decode_tokens\n0.0,100,10\n1.5,200,20\n3.0,50,5\n"
runner = CliRunner()


@pytest.fixture(autouse=True)
def _no_debug_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LORAPACK_DEBUG", raising=False)


def invoke(*args: str):
    res = runner.invoke(app, [str(a) for a in args])
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        raise res.exception
    return res


def sim_json(*args: str) -> dict:
    res = invoke("simulate", *args, "--json")
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def assert_one_line_error(code: int, out: str, err: str, match: str) -> None:
    assert code == 2, (code, out, err)
    lines = err.strip("\n").split("\n")
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ") and match in lines[0], err
    assert "Traceback" not in err and "Traceback" not in out
    assert out == ""


# ---- help ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cmd, expect", [
    ((), ["simulate", "validate", "demo", "profiles", "--debug"]),
    (("simulate",), ["--max-loras", "--model", "--gpu", "--profile", "--max-lora-rank", "--duration-s", "--seed",
                     "--timeline", "--json"]),
    (("validate",), ["--seeds", "--json", "--out", "--limit"]),
    (("demo",), ["--model", "--json", "--out"]),
    (("profiles",), ["shipped profiles"]),
])
def test_help(cmd: tuple, expect: list[str]) -> None:
    res = invoke(*cmd, "--help")
    assert res.exit_code == 0
    text = " ".join(res.stdout.split())
    for word in expect:
        assert word in text, word


def test_no_arguments_shows_help() -> None:
    res = invoke()
    assert "simulate" in res.output and "Usage" in res.output


# ---- simulate ------------------------------------------------------------------------------------------


def test_simulate_human_output() -> None:
    res = invoke("simulate", DEMO, "-m", LLAMA, "-a", 16, "--duration-s", 120)
    assert res.exit_code == 0
    out = res.stdout
    assert f"{LLAMA} on h100-64gb: 64 adapters, 120 s, seed 0" in " ".join(out.split())
    # the server's flags under vLLM's names (issue 12), not "A=16, S=16"
    assert "--max-loras 16" in " ".join(out.replace("│", " ").split())
    assert "--max-lora-rank 16" in " ".join(out.replace("│", " ").split())
    for label in ("throughput (tok/s)", "incoming (tok/s)", "starved", "ITL mean / p99 (ms)",
                  "requests arrived / completed", "KV cache (tokens)", "wall time (s)"):
        assert label in out, label
    # a healthy server: no penalised TTFT (the requests in flight at the end, counted as the whole window, made
    # it thousands of ms beside a mean of ~100 ms; issue 26); a starving one shows it, named
    assert "penalised" not in out
    starving = invoke("simulate", DEMO, "-m", LLAMA, "-a", 1, "--duration-s", 120).stdout
    assert "TTFT penalised mean (ms; unfinished = window)" in starving


def test_simulate_json_keys_and_values() -> None:
    d = sim_json(DEMO, "-m", LLAMA, "-a", 16, "--duration-s", 120)
    assert JSON_KEYS <= set(d)
    assert d["oom"] is False and d["starved"] in (True, False)
    assert d["throughput_tok_s"] == pytest.approx(d["input_tok_s"] + d["output_tok_s"])
    assert 0 < d["n_completed"] <= d["n_arrived"]
    assert d["incoming_tok_s"] > 0 and d["itl_mean_ms"] > 0 and d["ttft_mean_ms"] > 0
    assert d["ttft_penalised_mean_ms"] >= d["ttft_mean_ms"]
    assert d["kv_cache_tokens"] > 0 and d["wall_s"] >= 0 and d["compile_s"] >= 0
    assert d["duration_s"] == 120 and d["seed"] == 0
    assert d["server"]["max_loras"] == 16 and d["server"]["max_lora_rank"] == 16


def test_simulate_csv_workload_and_flags(tmp_path: Path) -> None:
    p = tmp_path / "a.csv"
    p.write_text("adapter_id,rank,rate_rps\na,8,0.5\nb,16,0.5\nc,8,0.25\n")
    d = sim_json(p, "-m", QWEN, "-a", 2, "--max-lora-rank", 32, "--max-cpu-loras", 5, "--duration-s", 60)
    assert d["server"] == {**d["server"], "max_loras": 2, "max_lora_rank": 32, "max_cpu_loras": 5,
                           "max_model_len": 32768}
    assert d["model"] == QWEN


def test_simulate_profile_file() -> None:
    from lorapack.profile import available_profiles

    path = next(p for _, m, p in available_profiles() if m == QWEN)
    d = sim_json(DEMO, "--profile", path, "-a", 8, "--duration-s", 60)
    assert d["model"] == QWEN


def test_simulate_metrics_scrape_s(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture) -> None:
    """``--metrics-scrape-s``: a /metrics poller stalls the API-server loop of a profile that models it (the run
    changes, the server reports the flag); a profile without one says the flag changes nothing; a bad value is
    one line naming the flag."""
    import yaml

    from lorapack.profile import ApiServerModel, find_profile

    prof = find_profile(LLAMA)
    loop = ApiServerModel(ms_per_output=0.1, scrape_base_ms=0.6, scrape_us_per_series=12.0,
                          scrape_us_per_label_name=0.15)
    path = tmp_path / "loop.yaml"
    path.write_text(yaml.safe_dump(prof.model_copy(update={"api_server": loop}).model_dump(mode="json")))
    args = (DEMO, "--profile", path, "-a", 8, "--duration-s", 120)
    quiet, polled = sim_json(*args), sim_json(*args, "--metrics-scrape-s", 2)
    assert quiet["server"]["metrics_scrape_s"] is None and polled["server"]["metrics_scrape_s"] == 2
    assert (polled["ttft_mean_ms"], polled["itl_mean_ms"]) != (quiet["ttft_mean_ms"], quiet["itl_mean_ms"])
    bare = tmp_path / "bare.yaml"
    bare.write_text(yaml.safe_dump(prof.model_copy(update={"api_server": None}).model_dump(mode="json")))
    res = invoke("simulate", DEMO, "--profile", bare, "-a", 8, "--duration-s", 60, "--metrics-scrape-s", 2)
    assert res.exit_code == 0 and "has no API-server model" in " ".join(res.stderr.split())
    for bad in ("0", "-1", "nan"):
        code, out, err = run_main(monkeypatch, capsys, "simulate", DEMO, "-m", LLAMA, "-a", 8,
                                  "--metrics-scrape-s", bad)
        assert_one_line_error(code, out, err, f"--metrics-scrape-s {float(bad)}: expected seconds > 0")


def test_simulate_mean_token_overrides() -> None:
    base = sim_json(DEMO, "-m", LLAMA, "-a", 64, "--duration-s", 120)
    longer = sim_json(DEMO, "-m", LLAMA, "-a", 64, "--duration-s", 120, "--mean-input-tokens", 446)
    # fixed lengths: same arrivals, twice the prompt tokens of every sent request
    assert longer["n_arrived"] == base["n_arrived"]
    assert longer["incoming_tok_s"] == pytest.approx(base["incoming_tok_s"] * (446 + 197) / (223 + 197))


def test_timeline_csv(tmp_path: Path) -> None:
    tl = tmp_path / "tl.csv"
    d = sim_json(DEMO, "-m", LLAMA, "-a", 16, "--duration-s", 120, "--timeline", tl)
    with tl.open(newline="") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
        cols = reader.fieldnames
    assert cols[:len(TIMELINE_COLUMNS)] == TIMELINE_COLUMNS
    assert [float(r["t_s"]) for r in rows] == [2.0 * k for k in range(60)]  # one row per 2 simulated s
    for r in rows:
        assert int(r["num_adapters_resident"]) <= 16
        assert 0.0 <= float(r["kv_cache_usage_perc"]) <= 1.0
        for c in cols:
            if c.startswith("num_"):
                assert r[c].lstrip("-").isdigit(), (c, r[c])  # counts are written as integers
    assert max(int(r["num_requests_running"]) for r in rows) == d["running_max"]
    assert not list(tmp_path.glob("*.tmp"))


def test_oom_config_reports_oom(tmp_path: Path) -> None:
    d = sim_json(DEMO, "-m", LLAMA, "-a", 256, "--duration-s", 120)  # rank-16 slots x 256: KV too small
    assert JSON_KEYS <= set(d)
    assert d["oom"] is True and d["error_type"] == "kv_cache_insufficient"
    assert d["starved"] is None and d["n_completed"] == 0 and 0 < d["kv_cache_tokens"] < 131072
    res = invoke("simulate", DEMO, "-m", LLAMA, "-a", 256, "--duration-s", 120)
    assert res.exit_code == 0
    assert "server starts" in res.stdout and "kv_cache_insufficient" in res.stdout


def test_oom_with_timeline_errors_without_a_file(monkeypatch, capsys, tmp_path: Path) -> None:
    tl = tmp_path / "tl.csv"
    code, out, err = run_main(monkeypatch, capsys, "simulate", DEMO, "-m", LLAMA, "-a", 256, "--duration-s", 120,
                              "--timeline", tl)
    assert_one_line_error(code, out, err, "would not start")
    assert list(tmp_path.iterdir()) == []


def test_same_seed_same_json_different_seed_different() -> None:
    args = (DEMO, "-m", LLAMA, "-a", 8, "--duration-s", 120)
    a, b = sim_json(*args, "--seed", 7), sim_json(*args, "--seed", 7)
    c = sim_json(*args, "--seed", 8)
    for d in (a, b, c):
        d.pop("wall_s"), d.pop("compile_s")
    assert a == b
    assert a != c and c["seed"] == 8
    assert (a["n_arrived"], a["ttft_mean_ms"]) != (c["n_arrived"], c["ttft_mean_ms"])


# ---- bad input: one line, exit 2, no traceback, no output file ---------------------------------------------


def _bad_inputs(tmp: Path) -> dict[str, tuple[list, str]]:
    def w(name: str, text: str) -> Path:
        p = tmp / name
        if tmp.is_dir():  # (the case names are also listed at collection time, without a directory)
            p.write_text(text)
        return p

    ok = w("ok.csv", "adapter_id,rank,rate_rps\na,8,0.1\nb,16,0.1\n")
    m = ["-m", LLAMA, "--duration-s", "120"]
    return {
        "unknown model": ([DEMO, "-m", "gpt-5", "-a", 8], "unknown model 'gpt-5'"),
        "unknown gpu": ([DEMO, "-m", LLAMA, "--gpu", "a100-40gb", "-a", 8], "unknown gpu 'a100-40gb'"),
        "no model": ([DEMO, "-a", 8], "--model is required"),
        "negative rate": ([w("neg.csv", "adapter_id,rank,rate_rps\na,8,0.1\nb,16,-1\n"), *m, "-a", 2],
                          "neg.csv:3: rate_rps"),
        "nan rate": ([w("nan.csv", "adapter_id,rank,rate_rps\na,8,0.1\nb,16,nan\n"), *m, "-a", 2],
                     "nan.csv:3: rate_rps"),
        "nan rate yaml": ([w("nan.yaml", "adapters:\n  - {adapter_id: a, rank: 8, rate_rps: .nan}\n"), *m, "-a", 1],
                          "nan.yaml:2"),
        "rank above S": ([w("r64.csv", "adapter_id,rank,rate_rps\na,8,0.1\nb,64,0.1\n"), *m, "-a", 2,
                          "--max-lora-rank", 16], "--max-lora-rank 16 is below the largest adapter rank 64"),
        "empty csv": ([w("empty.csv", "adapter_id,rank,rate_rps\n"), *m, "-a", 2], "no adapters"),
        "empty yaml list": ([w("empty.yaml", "adapters: []\n"), *m, "-a", 2], "at least one adapter"),
        "malformed csv header": ([w("hdr.csv", "adapter_id,rank\na,8\n"), *m, "-a", 2], "hdr.csv:1"),
        "malformed csv row": ([w("row.csv", "adapter_id,rank,rate_rps\na,8,0.1\nb,eight,0.1\n"), *m, "-a", 2],
                              "row.csv:3"),
        "malformed yaml": ([w("bad.yaml", "adapters: [\n  - {a: 1\n"), *m, "-a", 2], "bad.yaml"),
        "yaml not a mapping": ([w("list.yaml", "- 1\n- 2\n"), *m, "-a", 2], "list.yaml:1"),
        "missing file": ([tmp / "nope.yaml", *m, "-a", 2], "file not found"),
        "unknown suffix": ([w("w.json", "{}"), *m, "-a", 2], "unknown workload file type"),
        "max-loras 0": ([ok, *m, "-a", 0], "--max-loras 0"),
        "max-loras negative": ([ok, *m, "-a", -4], "--max-loras -4"),
        "cpu below slots": ([ok, *m, "-a", 2, "--max-cpu-loras", 1], "--max-cpu-loras 1 is below --max-loras 2"),
        "duration 0": ([ok, "-m", LLAMA, "-a", 2, "--duration-s", 0], "--duration-s 0"),
        "duration negative": ([ok, "-m", LLAMA, "-a", 2, "--duration-s", -5], "--duration-s -5"),
        "duration nan": ([ok, "-m", LLAMA, "-a", 2, "--duration-s", "nan"], "--duration-s nan"),
        "negative seed": ([ok, *m, "-a", 2, "--seed", -1], "seed"),
        "max-model-len 0": ([ok, *m, "-a", 2, "--max-model-len", 0], "--max-model-len 0"),
        "max-model-len too big": ([ok, *m, "-a", 2, "--max-model-len", 10**6], "--max-model-len 1000000"),
        "client cap negative": ([ok, *m, "-a", 2, "--client-cap", -1], "--client-cap -1"),
        "mean tokens 0": ([ok, *m, "-a", 2, "--mean-input-tokens", 0], "--mean-input-tokens"),
        "mean tokens unreachable": ([ok, *m, "-a", 2, "--mean-input-tokens", 5000], "cannot reach"),
        "mean tokens with trace lengths": (
            [w("tr.yaml", "adapters:\n  - {count: 2, rank: 8, rate_rps: 0.1}\n"
                          f"arrivals: {{kind: trace, path: {w('trace.csv', TRACE)}}}\n"),
             *m, "-a", 2, "--mean-input-tokens", 300], "trace_lengths"),
        "missing profile file": ([ok, "--profile", tmp / "p.yaml", "-a", 2], "profile file not found"),
        "profile not a profile": ([ok, "--profile", DEMO, "-a", 2], "field"),
        "timeline dir missing": ([ok, *m, "-a", 2, "--timeline", tmp / "no" / "tl.csv"], "does not exist"),
    }


BAD_CASES = sorted(_bad_inputs(Path("/nonexistent")))


@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_input_one_line_exit_2(case: str, monkeypatch, capsys, tmp_path: Path) -> None:
    args, match = _bad_inputs(tmp_path)[case]
    tl = tmp_path / "timeline.csv"
    extra = [] if "--timeline" in args else ["--timeline", tl]
    before = set(tmp_path.rglob("*"))
    code, out, err = run_main(monkeypatch, capsys, "simulate", *args, *extra, "--json")
    assert_one_line_error(code, out, err, match)
    assert set(tmp_path.rglob("*")) == before  # no (half-)written output


def test_empirical_lengths_reject_mean_overrides(monkeypatch, capsys, tmp_path: Path) -> None:
    (tmp_path / "len.csv").write_text("input_tokens,output_tokens\n100,50\n200,80\n")
    wl = tmp_path / "w.yaml"
    wl.write_text("adapters:\n  - {adapter_id: a, rank: 8, rate_rps: 1}\n"
                  "lengths: {kind: empirical, path: len.csv}\n")
    code, out, err = run_main(monkeypatch, capsys, "simulate", wl, "-m", LLAMA, "-a", 1, "--duration-s", 30,
                              "--mean-output-tokens", 300)
    assert_one_line_error(code, out, err, "empirical")


@pytest.mark.parametrize("args, match", [
    (["simulate", DEMO, "-m", LLAMA], "Missing option '--max-loras'"),
    (["simulate", DEMO, "-m", LLAMA, "-a", 8, "--seed", "abc"], "Invalid value for '--seed'"),
    (["simulate", DEMO, "-m", LLAMA, "-a", "abc"], "--max-loras abc: expected an integer >= 1 or a comma list"),
    (["simulate"], "Missing argument"),
    (["frobnicate"], "No such command 'frobnicate'"),
])
def test_usage_error_exit_2(args, match, monkeypatch, capsys) -> None:
    # click usage errors (typer >= 0.2x vendors click as typer._click): click's message on one line, exit 2
    code, out, err = run_main(monkeypatch, capsys, *args)
    assert_one_line_error(code, out, err, match)
    if not match.startswith("--max-loras abc"):  # click's own (that one is lorapack's): where to look
        assert "--help)" in err


def test_script_usage_error_no_traceback() -> None:
    p = _script("simulate", DEMO, "-m", LLAMA, "-a", "8", "--seed", "abc")
    assert p.returncode == 2 and "Invalid value" in p.stderr and "Traceback" not in p.stderr


def test_long_message_stays_on_one_line(monkeypatch, capsys, tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    p = deep / ("workload-with-a-long-name-" * 3 + ".csv")
    p.write_text("adapter_id,rank,rate_rps\na,8,-1\n")
    code, out, err = run_main(monkeypatch, capsys, "simulate", p, "-m", LLAMA, "-a", 1)
    assert_one_line_error(code, out, err, str(p))


def test_main_success_path(monkeypatch, capsys) -> None:
    code, out, err = run_main(monkeypatch, capsys, "simulate", DEMO, "-m", LLAMA, "-a", 8, "--duration-s", 30,
                              "--json")
    assert code == 0 and err == ""
    assert json.loads(out)["oom"] is False


def test_write_csv_atomic_leaves_nothing_on_error(tmp_path: Path) -> None:
    class Boom(list):
        def __getitem__(self, i):
            if i == 2:
                raise RuntimeError("disk on fire")
            return super().__getitem__(i)

    out = tmp_path / "x.csv"
    with pytest.raises(RuntimeError):
        write_csv_atomic(out, {"a": Boom([1, 2, 3]), "b": [4, 5, 6]})
    assert list(tmp_path.iterdir()) == []
    write_csv_atomic(out, {"a": [1, float("nan")], "b": ["x", "y"]})
    assert out.read_text().splitlines() == ["a,b", "1,x", ",y"]
    with pytest.raises(SpecError, match="does not exist"):
        write_csv_atomic(tmp_path / "no" / "x.csv", {"a": [1]})


# ---- through the installed console script --------------------------------------------------------------


def _script(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    import os

    e = {k: v for k, v in os.environ.items() if k != "LORAPACK_DEBUG"}
    e.update(env or {})
    cmd = [str(SCRIPT)] if SCRIPT.is_file() else [sys.executable, "-m", "lorapack.cli"]  # not installed as script
    return subprocess.run([*cmd, *[str(a) for a in args]], capture_output=True, text=True, timeout=120, env=e)


@pytest.mark.parametrize("case", ["unknown model", "nan rate", "missing file", "rank above S", "duration 0"])
def test_script_bad_input(case: str, tmp_path: Path) -> None:
    args, match = _bad_inputs(tmp_path)[case]
    tl = tmp_path / "timeline.csv"
    p = _script("simulate", *args, "--timeline", tl)
    assert_one_line_error(p.returncode, p.stdout, p.stderr, match)
    assert not tl.exists()


def test_script_debug_shows_traceback(tmp_path: Path) -> None:
    p = _script("--debug", "simulate", DEMO, "-m", "gpt-5", "-a", 8)
    assert p.returncode != 0 and "Traceback" in p.stderr and "ProfileError" in p.stderr
    p = _script("simulate", DEMO, "-m", "gpt-5", "-a", 8, env={"LORAPACK_DEBUG": "1"})
    assert p.returncode != 0 and "Traceback" in p.stderr


def test_script_simulate_json() -> None:
    p = _script("simulate", DEMO, "-m", LLAMA, "-a", 8, "--duration-s", 60, "--json")
    assert p.returncode == 0, p.stderr
    assert JSON_KEYS <= set(json.loads(p.stdout))


# ---- demo, profiles, validate ------------------------------------------------------------------------------


def test_demo_unknown_model(monkeypatch, capsys) -> None:
    code, out, err = run_main(monkeypatch, capsys, "demo", "--model", "gpt-5")
    assert_one_line_error(code, out, err, "unknown model")


def test_profiles_lists_both() -> None:
    res = invoke("profiles")
    assert res.exit_code == 0
    for word in (LLAMA, QWEN, "h100-64gb", "0.8.5", "131,072", "32,768"):
        assert word in res.stdout


def _runs_csv(tmp: Path) -> Path:
    cols = ["run_id", "model", "n_adapters", "max_loras", "max_lora_rank", "max_cpu_loras", "rank_counts",
            "rate_counts", "status", "window_s", "throughput_tok_s", "itl_mean_ms", "ttft_mean_ms", "starved",
            "throughput_ratio"]
    rows = [["ok1", LLAMA, 8, 8, 16, 8, "8:4 16:4", "0.1:8", "ok", 60, 300, 20, 60, 0, 1.0],
            ["ok2", QWEN, 8, 4, 16, 8, "8:4 16:4", "0.1:8", "ok", 60, 300, 20, 60, 0, 1.0],
            ["oom1", LLAMA, 256, 256, 16, 256, "16:256", "", "oom", 60, "", "", "", "", ""],
            ["skip", "llama-2-7b", 8, 8, 16, 8, "8:8", "0.1:8", "ok", 60, 1, 1, 1, 0, 1.0]]
    p = tmp / "runs.csv"
    with p.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(cols)
        w.writerows(rows)
    return p


def test_validate_json_and_out(tmp_path: Path) -> None:
    out = tmp_path / "per_run.csv"
    res = invoke("validate", _runs_csv(tmp_path), "--json", "--workers", 1, "--out", out)
    assert res.exit_code == 0, res.output
    d = json.loads(res.stdout)
    assert set(d) == {"models", "skipped", "pooled"}  # pooled: two models scored
    assert set(d["models"]) == {LLAMA, QWEN, "llama-2-7b"}
    assert d["pooled"]["ttft_objective_agreement"]["2"]["n"] == sum(
        d["models"][m]["ttft_objective_agreement"]["2"]["n"] for m in (LLAMA, QWEN))
    # a skipped run says why (issue 12), in the list and in its model's counts
    assert [(s["run_id"], s["model"]) for s in d["skipped"]] == [("skip", "llama-2-7b")]
    assert "model 'llama-2-7b': no shipped profile on h100-64gb" in d["skipped"][0]["reason"]
    assert d["models"]["llama-2-7b"]["skip_reasons"] == {d["skipped"][0]["reason"]: 1}
    keys = {"n_ok", "n_oom", "n_skipped", "smape_throughput", "smape_itl", "smape_ttft", "starved_agreement",
            "oom_agreement"}
    for s in d["models"].values():
        assert keys <= set(s)
    assert (d["models"][LLAMA]["n_ok"], d["models"][LLAMA]["n_oom"], d["models"][LLAMA]["oom_agreement"]) == (
        1, 1, 1.0)
    assert d["models"]["llama-2-7b"]["n_skipped"] == 1
    with out.open(newline="") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
    assert reader.fieldnames[:5] == ["run_id", "model", "status", "measured_oom", "predicted_oom"]
    assert {"predicted_throughput_tok_s", "predicted_itl_ms", "predicted_ttft_ms", "predicted_starved"} <= set(
        reader.fieldnames)
    assert [r["run_id"] for r in rows] == ["ok1", "ok2", "oom1"]
    # the mean running batch, measured and simulated (the feedback of step time on batch size, docs/calibration.md)
    assert float(rows[0]["predicted_running_mean"]) > 0
    assert rows[2]["predicted_running_mean"] in ("", "nan")  # an oom run is not simulated


def test_validate_human_table(tmp_path: Path) -> None:
    res = invoke("validate", _runs_csv(tmp_path), "--workers", 1)
    assert res.exit_code == 0
    assert "SMAPE" in res.stdout and LLAMA in res.stdout and "OOM agree" in res.stdout


@pytest.mark.parametrize("args, match", [
    (["missing.csv"], "runs file not found"),
    (["{runs}", "--seeds", 0], "--seeds 0"),
    (["{runs}", "--gpu", "a100"], "unknown gpu 'a100'"),
    (["{runs}", "--out", "{tmp}/no/x.csv"], "does not exist"),
    (["{bad}"], "missing column"),
])
def test_validate_bad_input(args, match, monkeypatch, capsys, tmp_path: Path) -> None:
    runs = _runs_csv(tmp_path)
    bad = tmp_path / "bad.csv"
    bad.write_text("run_id,model\nx,y\n")
    fmt = [str(a).format(runs=runs, tmp=tmp_path, bad=bad) for a in args]
    before = set(tmp_path.rglob("*"))
    code, out, err = run_main(monkeypatch, capsys, "validate", *fmt, "--workers", 1, "--json")
    assert_one_line_error(code, out, err, match)
    assert set(tmp_path.rglob("*")) == before


def test_debug_flag_is_reset_between_invocations() -> None:
    invoke("--debug", "profiles")
    assert cli._DEBUG["on"] is True
    invoke("profiles")
    assert cli._DEBUG["on"] is False


COMMANDS = [c.name for c in app.registered_commands]


@pytest.mark.parametrize("cmd", [[], *[[c] for c in COMMANDS]], ids=["lorapack", *COMMANDS])
def test_help_fits_80_columns(cmd: list[str]) -> None:
    """Issue 12: in an 80-column terminal no help line is longer, and no option name or value is cut (…)."""
    res = CliRunner().invoke(app, [*cmd, "--help"], env={"COLUMNS": "80"})
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert len(lines) > 5 and not [ln for ln in lines if len(ln.rstrip()) > 80], res.output
    assert "…" not in res.output, [ln for ln in lines if "…" in ln]
    assert "shipped profile ." not in res.output  # a "[default: ...]" eaten as console markup


def test_error_text_is_not_read_as_markup(monkeypatch, capsys, tmp_path: Path) -> None:
    """Brackets in an error (a path, "lorapack[ray]") are printed as they are, not taken for style tags."""
    d = tmp_path / "runs[red]"
    d.mkdir()
    code, _, err = run_main(monkeypatch, capsys, "simulate", d / "w.yaml", "-m", LLAMA, "-a", "1")
    assert code == 2 and f"{d / 'w.yaml'}: file not found" in err, err


def test_a_dead_worker_is_one_line_not_a_traceback(monkeypatch, capsys) -> None:
    from concurrent.futures.process import BrokenProcessPool

    import lorapack.twin.run

    def killed(*a, **k):
        raise BrokenProcessPool("A process in the process pool was terminated abruptly")

    monkeypatch.setattr(lorapack.twin.run, "simulate", killed)
    code, out, err = run_main(monkeypatch, capsys, "simulate", DEMO, "-m", LLAMA, "-a", "8", "--duration-s", "20")
    assert code == 1 and err.count("\n") == 1 and "a worker process died abruptly" in err and "Traceback" not in err


@pytest.mark.parametrize("command", [["simulate", "-a", "2"], ["place", "--method", "proposed-exact"]])
def test_a_warning_is_printed_once_per_command(command: list[str], tmp_path: Path) -> None:
    """The rank warning comes from every twin run and oracle call (several modules): one line (issue 26).
    A fresh process: in this one, warnings' per-module registries remember earlier tests."""
    wl = tmp_path / "w.csv"
    wl.write_text("adapter_id,rank,rate_rps\na,64,0.1\nb,8,0.2\nc,16,0.1\n")
    p = subprocess.run([sys.executable, "-m", "lorapack.cli", command[0], str(wl), "-m", "llama-3.1-8b-instruct",
                        *command[1:], *(["--out", str(tmp_path / "plan")] if command[0] == "place" else [])],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    assert p.stderr.count("rank(s) 64 lie outside") == 1, p.stderr
