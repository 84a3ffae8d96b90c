"""``vllm bench serve`` result JSON files as real runs (``lorapack.benchjson``): every writer's layout converts to
a row of the runs schema, ``validate`` / ``calibrate --runs`` take them end to end, and a file the twin
cannot rebuild is one line naming what is missing or unsupported (exit 2).

The fixtures (``tests/data/bench_json``, see its README) are written in the exact layout of each writer."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from data_helpers import run_main
from lorapack.benchjson import (
    BenchOptions,
    bench_row,
    is_bench_json,
    load_results,
    read_bench_json,
    read_run_files,
    read_runs_file,
)
from lorapack.calibrate.command import load_runs
from lorapack.cli import app
from lorapack.errors import DataError, SpecError
from lorapack.realruns import check_row

DATA = Path(__file__).parent / "data" / "bench_json"
LLAMA, QWEN = "llama-3.1-8b-instruct", "qwen-2.5-7b-instruct"
DETAILED_FLAGS = ["--max-loras", "2", "--max-lora-rank", "16", "--adapter-ranks", "16:4"]
runner = CliRunner()


@pytest.fixture(autouse=True)
def _no_debug_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LORAPACK_DEBUG", raising=False)


def raw(name: str) -> dict:
    return json.loads((DATA / name).read_text())


def write(tmp: Path, name: str, obj: dict) -> Path:
    p = tmp / name
    p.write_text(json.dumps(obj))  # as the writers: json.dump, float inf -> Infinity
    return p


def one_line_error(monkeypatch, capsys, *args) -> str:
    code, out, err = run_main(monkeypatch, capsys, *args)
    lines = err.strip("\n").split("\n")
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (code, out, err)
    assert "Traceback" not in err and out == ""
    return lines[0]


# ---- each writer's layout -> one row of the runs schema ------------------------------------------------------


def _expected(res: dict, n_requests: int, mean_in: float, mean_out: float) -> dict[str, float]:
    """The measured columns as the runs schema defines them, from the file's own numbers."""
    rate = float(res["request_rate"])
    incoming = rate * (mean_in + mean_out)
    return {"window_s": n_requests / rate, "duration_s": res["duration"], "incoming_req_s": rate,
            "mean_input_tokens": mean_in, "mean_output_tokens": mean_out, "incoming_tok_s": incoming,
            "throughput_tok_s": res["total_token_throughput"],
            "input_tok_s": res["total_input_tokens"] / res["duration"], "output_tok_s": res["output_throughput"],
            "throughput_ratio": res["total_token_throughput"] / incoming,
            "ttft_mean_ms": res["mean_ttft_ms"], "ttft_median_ms": res["median_ttft_ms"],
            "ttft_p99_ms": res["p99_ttft_ms"], "tpot_mean_ms": res["mean_tpot_ms"], "itl_mean_ms": res["mean_itl_ms"],
            "itl_median_ms": res["median_itl_ms"], "itl_p99_ms": res["p99_itl_ms"]}


def _check_numbers(row: dict, expected: dict[str, float]) -> None:
    for k, v in expected.items():
        assert float(row[k]) == pytest.approx(v, rel=1e-12), k
    assert row["starved"] == str(int(expected["throughput_ratio"] < 0.9))


@pytest.mark.parametrize("name, model, n, ranks, rates, flags", [
    ("vllm-bench-serve.json", LLAMA, "4", "8:2 16:2", "0.5:4", ("4", "16", "4")),
    ("benchmark-serving-0.8.json", QWEN, "8", "16:8", "0.0625:8", ("8", "16", "8")),
    ("benchmark-serving-0.8-summary.json", LLAMA, "8", "16:8", "0.3125:8", ("8", "16", "8")),
])
def test_metadata_files_convert_to_rows(name: str, model: str, n: str, ranks: str, rates: str, flags: tuple) -> None:
    res = raw(name)
    notes: list[str] = []
    (row,) = read_bench_json(DATA / name, log=notes.append)
    assert (row["run_id"], row["model"], row["status"], row["n_completed"], row["num_prompts"]) == (
        Path(name).stem, model, "ok", str(res["completed"]), str(res["num_prompts"]))
    assert (row["rank_counts"], row["rate_counts"], row["n_adapters"]) == (ranks, rates, n)
    assert (row["max_loras"], row["max_lora_rank"], row["max_cpu_loras"]) == flags
    assert row["max_num_seqs"] == row["max_num_batched_tokens"] == ""  # the profile's
    _check_numbers(row, _expected(res, res["num_prompts"], res["total_input_tokens"] / res["completed"],
                                  res["total_output_tokens"] / res["completed"]))
    check_row(row, name, measured=("throughput_tok_s", "itl_mean_ms"), need_counts=True)
    (note,) = notes
    assert "drawn uniformly at random" in note and "vLLM's default" in note and note.startswith(str(DATA / name))


def test_writers_quirks_are_in_the_fixtures() -> None:
    """The fixtures have what each writer writes: the old colon key and no ``failed``, the new keys."""
    new, old = raw("vllm-bench-serve.json"), raw("benchmark-serving-0.8.json")
    assert "request_goodput:" in old and "failed" not in old and "endpoint_type" not in old
    assert "request_goodput" in new and "failed" in new and new["label"] is None and "latencies" in new
    assert "input_lens" not in new and "input_lens" in old  # old copies always kept the per-request lists
    assert all(isinstance(new[k], str) for k in ("max_loras", "max_lora_rank", "lora_ranks"))  # --metadata
    assert raw("benchmark-serving-0.8-unlimited.json")["request_rate"] == "inf"


def test_detailed_file_uses_per_request_lengths_and_the_command_line() -> None:
    res = raw("vllm-bench-serve-detailed.json")
    ok = [not e for e in res["errors"]]
    assert res["failed"] == 1 and sum(ok) == res["completed"] == 11
    notes: list[str] = []
    (row,) = read_bench_json(DATA / "vllm-bench-serve-detailed.json",
                             BenchOptions(max_loras=2, max_lora_rank=16, adapter_ranks="16:4"), notes.append)
    mean_in = sum(x for x, k in zip(res["input_lens"], ok, strict=True) if k) / 11
    mean_out = sum(x for x, k in zip(res["output_lens"], ok, strict=True) if k) / 11
    assert mean_in == pytest.approx(res["total_input_tokens"] / 11)  # the failed request is not counted
    _check_numbers(row, _expected(res, len(res["input_lens"]), mean_in, mean_out))
    assert (row["n_adapters"], row["rank_counts"], row["rate_counts"], row["max_loras"], row["max_cpu_loras"]) == (
        "4", "16:4", "0.25:4", "2", "2")
    assert row["window_s"] == "12.0" and row["n_completed"] == "11"
    assert "4 Poisson stream(s) of 1/4 = 0.25 req/s over 12 s" in notes[0]


def test_detailed_file_without_summaries_computes_them() -> None:
    """A file whose percentile metrics were not selected: TTFT and ITL come from the per-request lists."""
    res = raw("vllm-bench-serve-detailed.json")
    full = bench_row(res, "x", "x.json", BenchOptions(max_loras=2, max_lora_rank=16, adapter_ranks="16:4"))
    bare = {k: v for k, v in res.items() if not k.endswith("_ms")}
    row = bench_row(bare, "x", "x.json", BenchOptions(max_loras=2, max_lora_rank=16, adapter_ranks="16:4"))
    for k in ("ttft_mean_ms", "ttft_median_ms", "ttft_p99_ms", "itl_mean_ms", "itl_median_ms", "itl_p99_ms"):
        assert float(row[k]) == pytest.approx(float(full[k]), rel=1e-9), k
    assert row["tpot_mean_ms"] == ""


def test_constant_lengths_suggest_fixed_lengths() -> None:
    """The random dataset: every request has the same lengths, which the log-normal law cannot rebuild."""
    res = raw("vllm-bench-serve-detailed.json")
    n = len(res["input_lens"])
    same = {**res, "input_lens": [1024] * n, "output_lens": [0 if e else 128 for e in res["errors"]]}
    notes: list[str] = []
    row = bench_row(same, "x", "x.json", BenchOptions(max_loras=2, max_lora_rank=16, adapter_ranks="16:4"),
                    notes.append)
    assert (row["mean_input_tokens"], row["mean_output_tokens"]) == ("1024.0", "128.0")
    assert "every request has 1024 input and 128 output tokens" in notes[0] and "--lengths fixed" in notes[0]


def test_appended_results_are_one_run_each() -> None:
    rows = read_bench_json(DATA / "vllm-bench-serve-appended.json")
    assert [r["run_id"] for r in rows] == ["vllm-bench-serve-appended#1", "vllm-bench-serve-appended#2"]
    assert [r["window_s"] for r in rows] == ["20.0", "20.0"] and [r["rate_counts"] for r in rows] == ["0.25:4",
                                                                                                       "0.5:4"]
    assert len(load_results(DATA / "vllm-bench-serve-appended.json")) == 2


def test_model_keys() -> None:
    base = raw("vllm-bench-serve.json")
    for model_id, key in (("meta-llama/Llama-3.1-8B-Instruct", LLAMA), ("/models/llama-3.1-8b-instruct/", LLAMA),
                          ("/m/Qwen2.5-7B-Instruct", QWEN), ("/m/MyModel", "mymodel")):
        assert bench_row({**base, "model_id": model_id}, "x", "x")["model"] == key
    assert bench_row({**base, "model_id": "/m/x", "model": QWEN}, "x", "x")["model"] == QWEN  # --metadata model=
    assert bench_row({**base, "model_id": "/m/x"}, "x", "x", BenchOptions(model=LLAMA))["model"] == LLAMA


def test_dispatch_and_sources(tmp_path: Path) -> None:
    assert is_bench_json("a.JSON") and not is_bench_json("a.csv")
    rows, where = read_run_files([DATA / "vllm-bench-serve-appended.json", DATA / "vllm-bench-serve.json"])
    assert len(rows) == 3 and where[0].endswith("(run 1)") and where[2] == str(DATA / "vllm-bench-serve.json")
    assert read_runs_file(DATA / "vllm-bench-serve.json")[0]["run_id"] == "vllm-bench-serve"
    assert read_runs_file(_runs_csv(tmp_path))[0]["run_id"] == "csv1"
    with pytest.raises(SpecError, match="--max-loras.*JSON runs"):
        read_run_files([_runs_csv(tmp_path)], BenchOptions(max_loras=4))


# ---- what the twin cannot rebuild: one line naming it ---------------------------------------------------------


@pytest.mark.parametrize("edit, match", [
    (lambda d: {k: v for k, v in d.items() if not k.startswith("total_")},
     "missing key(s) total_input_tokens, total_output_tokens (or the per-request input_lens, output_lens)"),
    (lambda d: {k: v for k, v in d.items() if k not in ("request_rate", "num_prompts")},
     "missing key(s) request_rate, num_prompts"),
    (lambda d: {**d, "request_rate": float("inf")}, "request_rate is inf"),
    (lambda d: {**d, "request_rate": "inf"}, "request_rate is 'inf': vllm bench serve sent all 50 requests at t = 0"),
    (lambda d: {**d, "burstiness": 0.5}, "burstiness 0.5 (gamma-distributed gaps)"),
    (lambda d: {**d, "burstiness": float("inf")}, "burstiness inf (constant gaps)"),
    (lambda d: {**d, "max_concurrency": 16}, "max_concurrency 16"),
    (lambda d: {**d, "ramp_up_strategy": "linear"}, "ramp_up_strategy 'linear'"),
    (lambda d: {**d, "completed": 0}, "completed 0"),
    (lambda d: {**d, "duration": "soon"}, "duration = 'soon'; expected a number"),
    (lambda d: {k: v for k, v in d.items() if k not in ("max_loras", "lora_ranks")},
     "does not record the adapters' ranks (--adapter-ranks, e.g. 16:8, or --metadata lora_ranks=16:8); "
     "--max-loras (or --metadata max_loras=...)"),
    (lambda d: {**d, "lora_ranks": "16x8"}, "malformed count '16x8'"),
    (lambda d: {**d, "max_loras": "four"}, "max_loras = 'four'; expected an integer >= 1"),
])
def test_unusable_files_are_one_line(tmp_path: Path, edit, match: str) -> None:
    p = write(tmp_path, "run.json", edit(raw("benchmark-serving-0.8-summary.json")))
    with pytest.raises(DataError) as e:
        read_bench_json(p)
    assert match in str(e.value) and str(p) in str(e.value) and "\n" not in str(e.value)


def test_infinity_token_is_an_unlimited_rate(tmp_path: Path) -> None:
    p = write(tmp_path, "inf.json", {**raw("benchmark-serving-0.8-unlimited.json"), "request_rate": float("inf")})
    assert '"request_rate": Infinity' in p.read_text()
    with pytest.raises(DataError, match="request_rate is inf.*no burst arrival"):
        read_bench_json(p)
    with pytest.raises(DataError, match="request_rate is 'inf'"):
        read_bench_json(DATA / "benchmark-serving-0.8-unlimited.json")


@pytest.mark.parametrize("text, match", [
    ("", "empty file"), ("{\"duration\": ", "not valid JSON"), ("[{\"a\": 1}]", "a list (a .pytorch.json"),
    ("{\"completed\": 3}", "missing key(s) duration, request_rate, num_prompts, total_input_tokens"),
])
def test_not_a_result_file(tmp_path: Path, text: str, match: str) -> None:
    p = tmp_path / "x.json"
    p.write_text(text)
    with pytest.raises(DataError, match=match.replace("(", r"\(").replace(")", r"\)")):
        read_bench_json(p)


def test_command_line_and_metadata_must_agree() -> None:
    res = raw("vllm-bench-serve.json")
    assert bench_row(res, "x", "x", BenchOptions(max_loras=4, adapter_ranks="8:2 16:2"))["max_loras"] == "4"
    with pytest.raises(DataError, match="--max-loras 8 but the file's --metadata max_loras=4"):
        bench_row(res, "x", "x", BenchOptions(max_loras=8))
    with pytest.raises(DataError, match="--adapter-ranks 16:4 but the file's --metadata lora_ranks=8:2 16:2"):
        bench_row(res, "x", "x", BenchOptions(adapter_ranks="16:4"))


# ---- lorapack validate, end to end through the CLI -------------------------------------------------------------


def _runs_csv(tmp: Path) -> Path:
    p = tmp / "runs.csv"
    with p.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["run_id", "model", "n_adapters", "max_loras", "max_lora_rank", "rank_counts", "rate_counts",
                    "status", "window_s", "throughput_tok_s", "itl_mean_ms", "ttft_mean_ms", "starved"])
        w.writerow(["csv1", LLAMA, 8, 8, 16, "16:8", "0.1:8", "ok", 30, 300, 20, 60, 0])
    return p


@pytest.mark.parametrize("name, model, extra", [
    ("vllm-bench-serve.json", LLAMA, []),
    ("vllm-bench-serve-detailed.json", LLAMA, DETAILED_FLAGS),
    ("benchmark-serving-0.8.json", QWEN, []),
    ("benchmark-serving-0.8-summary.json", LLAMA, []),
])
def test_validate_cli_on_each_writer(name: str, model: str, extra: list[str]) -> None:
    res = runner.invoke(app, ["validate", str(DATA / name), *extra, "--workers", "1", "--json"])
    assert res.exit_code == 0, res.output
    d = json.loads(res.stdout)
    s = d["models"][model]
    assert (s["n_ok"], s["n_scored"], s["n_skipped"]) == (1, 1, 0) and d["skipped"] == []
    assert math.isfinite(s["smape_throughput"]) and math.isfinite(s["smape_itl"]) and math.isfinite(s["smape_ttft"])
    assert len(d["notes"]) == 1 and "drawn uniformly at random" in d["notes"][0]


def test_validate_cli_unknown_model_id_takes_the_profiles_model(tmp_path: Path) -> None:
    from lorapack.profile import available_profiles

    (path,) = [p for g, m, p in available_profiles() if g == "h100-64gb" and m == LLAMA]
    run = write(tmp_path, "local.json", {**raw("vllm-bench-serve.json"), "model_id": "/models/my-llama"})
    res = runner.invoke(app, ["validate", str(run), "--profile", str(path), "--workers", "1", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["models"][LLAMA]["n_scored"] == 1


def test_validate_cli_mixes_csv_and_json(tmp_path: Path) -> None:
    out = tmp_path / "per_run.csv"
    res = runner.invoke(app, ["validate", str(_runs_csv(tmp_path)), str(DATA / "vllm-bench-serve-appended.json"),
                              "--workers", "1", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert "3 files" not in res.stdout and "2 files" in res.stdout and "uniformly at random" in res.stderr
    with out.open(newline="") as f:
        ids = [r["run_id"] for r in csv.DictReader(f)]
    assert ids == ["csv1", "vllm-bench-serve-appended#1", "vllm-bench-serve-appended#2"]


@pytest.mark.parametrize("args, match", [
    (["{unlimited}"], "request_rate is 'inf'"),
    (["{detailed}"], "does not record the adapters' ranks"),
    (["{detailed}", "--max-loras", "2", "--adapter-ranks", "16:4"], "--max-lora-rank (or --metadata max_lora_rank"),
    (["{nolens}"], "missing key(s) total_input_tokens, total_output_tokens"),
    (["{csv}", "--max-loras", "4"], "--max-loras: these describe vllm bench serve JSON runs"),
    (["{tmp}/missing.json"], "runs file not found"),
])
def test_validate_cli_bad_json_is_one_line(args: list[str], match: str, tmp_path: Path, monkeypatch,
                                           capsys) -> None:
    summary = raw("benchmark-serving-0.8-summary.json")
    nolens = write(tmp_path, "nolens.json", {k: v for k, v in summary.items() if not k.startswith("total_")})
    fmt = [a.format(unlimited=DATA / "benchmark-serving-0.8-unlimited.json", tmp=tmp_path, nolens=nolens,
                    detailed=DATA / "vllm-bench-serve-detailed.json", csv=_runs_csv(tmp_path)) for a in args]
    line = one_line_error(monkeypatch, capsys, "validate", *fmt, "--workers", "1", "--json")
    assert match in line


# ---- calibrate --runs ------------------------------------------------------------------------------------------


CAL_RUNS = ["vllm-bench-serve.json", "vllm-bench-serve-appended.json", "benchmark-serving-0.8-summary.json"]


def test_load_runs_takes_json_files() -> None:
    rows = load_runs([DATA / n for n in CAL_RUNS], LLAMA, BenchOptions())
    assert [r["run_id"] for r in rows] == ["vllm-bench-serve", "vllm-bench-serve-appended#1",
                                           "vllm-bench-serve-appended#2", "benchmark-serving-0.8-summary"]
    with pytest.raises(DataError, match="benchmark-serving-0.8.json: a run of model 'qwen-2.5-7b-instruct', not "
                                        "of --model llama-3.1-8b-instruct"):
        load_runs([DATA / n for n in [*CAL_RUNS, "benchmark-serving-0.8.json"]], LLAMA, BenchOptions())
    with pytest.raises(DataError, match="1 ok run.s. of llama-3.1-8b-instruct, need at least 3"):
        load_runs(DATA / "vllm-bench-serve.json", LLAMA)


def test_calibrate_cli_with_json_runs(data_dir: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    out = tmp_path / "p.yaml"
    args = ["calibrate", "--profiling", str(data_dir / "profiling"), "-m", LLAMA, "--out", str(out),
            "--max-evals", "0,0", "--workers", "1", "--json"]
    for n in CAL_RUNS:
        args += ["--runs", str(DATA / n)]
    code, stdout, err = run_main(monkeypatch, capsys, *args)
    assert code == 0, err
    val = json.loads(stdout)["validation"]
    assert val["runs"] == ", ".join(CAL_RUNS) and set(val["runs_sha256"]) == {str(DATA / n) for n in CAL_RUNS}
    assert val["refined"]["n_runs"] == 4 and math.isfinite(val["refined"]["smape_throughput"])
    assert out.is_file()
    line = one_line_error(monkeypatch, capsys, "calibrate", "--profiling", str(data_dir / "profiling"), "-m", LLAMA,
                          "--out", str(tmp_path / "q.yaml"), "--max-loras", "4")
    assert "--max-loras: these describe vllm bench serve JSON runs" in line
