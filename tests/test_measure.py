"""``lorapack measure`` without a real server: identity parsing, input errors against a fake vLLM HTTP API,
and the closed-form fits of a measurement directory (``lorapack.measure.fit``) recovering known constants.
The real thing runs in tests/real/test_measure_real.py."""

from __future__ import annotations

import csv
import json
import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from data_helpers import run_main
from lorapack.cli import app
from lorapack.measure.fit import FORMAT, MEASURE_JSON, fit_measured, model_label
from lorapack.measure.probe import MeasureError, check_url, parse_scrape, parse_server_args, read_log
from lorapack.measure.run import read_adapters

METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} RUNNING
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 0.0
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="4",running_lora_adapters="",waiting_lora_adapters=""} 1.7e9
vllm:lora_requests_info{max_lora="4",running_lora_adapters="a",waiting_lora_adapters=""} 1.8e9
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",enable_prefix_caching="False",gpu_memory_utilization="0.9",num_gpu_blocks="1000"} 1.0
# TYPE vllm:iteration_tokens_total histogram
vllm:iteration_tokens_total_bucket{engine="0",le="+Inf",model_name="m"} 12.0
vllm:iteration_tokens_total_count{engine="0",model_name="m"} 12.0
vllm:iteration_tokens_total_sum{engine="0",model_name="m"} 345.0
"""

LOG = ("(APIServer pid=1) INFO [api_utils.py:286] non-default args: {'model_tag': '/m', 'lora_modules': "
       "[LoRAModulePath(name='a', path='/p', base_model_name=None)], 'max_loras': 4, 'max_lora_rank': 32, "
       "'max_cpu_loras': 12, 'max_num_seqs': 32, 'max_num_batched_tokens': 256, 'enable_prefix_caching': False}\n"
       "(EngineCore pid=2) INFO [core.py:133] Initializing a V1 LLM engine (v0.32.0) with config: model='/m', "
       "tensor_parallel_size=2, device_config=cuda, enable_prefix_caching=False\n"
       "(EngineCore pid=2) INFO [kv_cache_utils.py:2327] GPU KV cache size: 2,097,152 tokens, Maximum concurrency\n")


def test_scrape_reads_the_gauges_and_the_newest_lora_state() -> None:
    s = parse_scrape(METRICS.replace("RUNNING", "3.0"))
    assert s.running == 3.0 and s.waiting == 0.0
    assert s.max_lora == 4
    assert s.kv_cache_tokens == 16000
    assert s.steps == 12 and s.step_tokens == 345


def test_start_up_log_and_server_args() -> None:
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".log", delete=False) as f:
        f.write(LOG)
    got = read_log(Path(f.name))
    assert got["max_loras"] == 4 and got["max_lora_rank"] == 32 and got["max_cpu_loras"] == 12
    assert got["max_num_batched_tokens"] == 256 and got["enable_prefix_caching"] is False
    assert got["kv_cache_tokens"] == 2097152 and got["vllm_version"] == "0.32.0"
    assert got["device"] == "cuda" and got["tensor_parallel_size"] == 2
    args = parse_server_args("vllm serve m --max-loras 8 --max-num-seqs=64 --no-enable-prefix-caching "
                             "--lora-modules a=/x")
    assert args == {"max_loras": 8, "max_num_seqs": 64, "enable_prefix_caching": False}
    with pytest.raises(MeasureError, match="--max-loras has no value"):
        parse_server_args("--max-loras --max-num-seqs 4")


@pytest.mark.parametrize("url", ["localhost:8000", "ftp://x", "http://h:1/v1", "http://h:1?x=1"])
def test_bad_url_is_one_line(url: str) -> None:
    with pytest.raises(MeasureError, match="expected the server's base address"):
        check_url(url)


def test_adapters_csv_errors(tmp_path: Path) -> None:
    p = tmp_path / "a.csv"
    for text, match in (("id,rank\na,8\n", "expected a header adapter_id,rank"),
                        ("adapter_id,rank\na,eight\n", "rank 'eight'"),
                        ("adapter_id,rank\na,8\na,16\n", "listed twice"),
                        ("adapter_id,rank\n", "no adapters")):
        p.write_text(text)
        with pytest.raises(MeasureError, match=match):
            read_adapters(p)
    p.write_text("adapter_id,rank,path\na,8,/x\nb,16,\n")
    assert read_adapters(p) == [("a", 8, "/x"), ("b", 16, None)]


def test_model_label() -> None:
    assert model_label("/cache/tiny/model") == "tiny"
    assert model_label("meta-llama/Llama-3.1-8B-Instruct") == "llama-3.1-8b-instruct"


# ---------------------------------------------------------------------------------------------------------
# a fake vLLM API: enough for the identity step and its errors


class _Fake:
    def __init__(self, lora: bool = True, running: float = 0.0, runtime_loading: bool = False) -> None:
        self.lora, self.running, self.runtime_loading = lora, running, runtime_loading
        self.paths: list[str] = []


def _serve(fake: _Fake):
    class H(BaseHTTPRequestHandler):
        def log_message(self, *a) -> None:  # noqa: ANN002
            pass

        def _send(self, code: int, body) -> None:
            raw = body.encode() if isinstance(body, str) else json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def do_GET(self) -> None:  # noqa: N802
            fake.paths.append(self.path)
            if self.path == "/version":
                self._send(200, {"version": "0.32.0"})
            elif self.path == "/v1/models":
                data = [{"id": "/m/tiny", "max_model_len": 4096, "parent": None}]
                if fake.lora:
                    data += [{"id": "a", "parent": "/m/tiny"}, {"id": "b", "parent": "/m/tiny"}]
                self._send(200, {"data": data})
            elif self.path == "/metrics":
                self._send(200, METRICS.replace("RUNNING", str(fake.running)))
            else:
                self._send(404, {})

        def do_POST(self) -> None:  # noqa: N802
            fake.paths.append(self.path)
            n = int(self.headers.get("Content-Length") or 0)
            self.rfile.read(n)
            if self.path == "/v1/completions":
                self._send(200, {"choices": [{"text": "x"}], "usage": {"completion_tokens": 1}})
            elif self.path == "/v1/load_lora_adapter" and fake.runtime_loading:
                self._send(200, {})
            else:
                self._send(404, {"detail": "Not Found"})

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}"


@pytest.mark.parametrize("case,adapters,match", [
    ("no-lora", "adapter_id,rank\na,8\n", "serves no LoRA adapter"),
    ("unknown", "adapter_id,rank\nzz,8\n", "adapter 'zz' is not served"),
    ("no-runtime", "adapter_id,rank,path\nzz,8,/w\n", "does not allow runtime LoRA loading"),
    ("busy", "adapter_id,rank\na,8\n", "the server is busy"),
    ("rank", "adapter_id,rank\na,64\n", "above the server's --max-lora-rank"),
    ("unknown-flags", "adapter_id,rank\na,8\n", "--max-num-seqs is unknown"),
])
def test_measure_refuses_with_one_line_and_writes_nothing(tmp_path: Path, case: str, adapters: str,
                                                          match: str, monkeypatch, capsys) -> None:
    fake = _Fake(lora=case != "no-lora", running=2.0 if case == "busy" else 0.0)
    srv, url = _serve(fake)
    try:
        (tmp_path / "a.csv").write_text(adapters)
        out = tmp_path / "m"
        extra = [] if case == "unknown-flags" else ["--server-args", "--max-lora-rank 32 --max-num-seqs 8 "
                                                                     "--max-num-batched-tokens 64"]
        code, stdout, err = run_main(monkeypatch, capsys, "measure", "--url", url, "--adapters",
                                     tmp_path / "a.csv", "--out", out, "--budget-min", "2", *extra)
        assert code == 2, err
        assert match in err and "Traceback" not in err
        assert len(err.strip().splitlines()) == 1 and not stdout
        assert not out.exists()
        # traffic went to the given URL only, and never beyond the one probe request (none to a busy server)
        assert fake.paths.count("/v1/completions") <= (0 if case == "busy" else 1)
    finally:
        srv.shutdown()


def test_measure_needs_a_reachable_server(tmp_path: Path, monkeypatch, capsys) -> None:
    (tmp_path / "a.csv").write_text("adapter_id,rank\na,8\n")
    code, _, err = run_main(monkeypatch, capsys, "measure", "--url", "http://127.0.0.1:9", "--adapters",
                            tmp_path / "a.csv", "--out", tmp_path / "m")
    assert code == 2 and "no vLLM server answers there" in err and not (tmp_path / "m").exists()
    code, _, err = run_main(monkeypatch, capsys, "measure", "--url", "http://127.0.0.1:9", "--adapters",
                            tmp_path / "a.csv", "--out", tmp_path / "m", "--budget-min", "0.5")
    assert code == 2 and "--budget-min 0.5" in err


# ---------------------------------------------------------------------------------------------------------
# fits: a synthetic measurement with known constants


TRUE = {"c0": 2.0, "c1": 0.10, "a3": 0.05, "p1": 0.012, "e0": 0.8, "e1": 0.15, "e2": 0.3}


def _write(path: Path, rows: list[dict]) -> None:
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def synthetic_measurement(d: Path, true: dict = TRUE, noise: float = 0.0, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    d.mkdir(parents=True, exist_ok=True)
    budget = 256
    ident = {"url": "http://x", "vllm_version": "0.32.0", "model": "/cache/tiny/model", "max_model_len": 131072,
             "served_adapters": ["a", "b"], "max_loras": 4, "max_lora_rank": 32, "max_cpu_loras": 12,
             "max_num_seqs": 32, "max_num_batched_tokens": budget, "kv_cache_tokens": 2097152, "block_size": 128,
             "gpu_memory_utilization": 0.92, "prefix_caching": True, "device": "cpu", "tensor_parallel_size": 2,
             "per_request_metrics": True, "sources": {}}
    (d / MEASURE_JSON).write_text(json.dumps({"format": FORMAT, "format_version": 1, "identity": ident,
                                              "settings": {"seed": 0}, "experiments": {}}))

    def jitter() -> float:
        return 1.0 + noise * rng.standard_normal()

    dec = []
    for p in (16, 1024):
        for b in (1, 2, 4, 8, 16, 32):
            ctx = p + 64
            itl = (true["c0"] + true["c1"] * b + true["a3"] * b * ctx / 1000) * jitter()
            dec.append({"concurrency": b, "prompt_tokens": p, "itl_mean_ms": itl, "context_tokens_mean": ctx})
    _write(d / "decode.csv", dec)
    pre = []
    for p in (16, 64, 128, 256, 512, 1024):
        ch = math.ceil(p / budget)
        pre.append({"prompt_tokens": p, "chunks": ch, "frontend_ms": 4.0,
                    "ttft_ms": (ch * (true["c0"] + true["c1"]) + true["p1"] * p) * jitter()})
    _write(d / "prefill.csv", pre)
    lora = []
    for b in (8, 32):
        for n in (1, 2, 4):
            over = (true["e0"] + true["e1"] * b + true["e2"] * n) * jitter()
            lora.append({"concurrency": b, "n_adapters": n, "rank": 32, "max_lora_rank": 32, "max_loras": 4,
                         "itl_mean_ms": 5 + over, "base_itl_ms": 5, "overhead_ms": over})
    _write(d / "lora.csv", lora)
    _write(d / "loading.csv", [{"adapter_id": "a", "rank": 8, "max_lora_rank": 32, "activation_ms": 1.5,
                                "disk_ms": 6.0}])
    return d


def test_fits_recover_the_constants(tmp_path: Path) -> None:
    prof = fit_measured(synthetic_measurement(tmp_path / "m"))
    st = prof.steptime
    got = {"c0": st.c0_ms, "c1": st.c1_ms_per_req, "a3": st.a3_ms_per_kctx, "p1": st.p1_ms_per_prefill_token,
           "e0": st.e0_ms, "e1": st.e1_ms_per_token, "e2": st.e2_ms_per_adapter}
    for k, v in TRUE.items():
        assert got[k] == pytest.approx(v, rel=1e-6, abs=1e-9), k
    assert prof.vllm_version == "0.32.0" and prof.model == "tiny" and prof.gpu == "cpu"
    assert prof.device == "cpu" and prof.tensor_parallel_size == 2
    assert prof.max_num_batched_tokens == 256 and prof.max_num_seqs == 32 and prof.block_size == 128
    assert prof.kv_tokens(4, 32) == 2097152
    assert prof.activation_ms(32, 8) == pytest.approx(1.5) and prof.disk_ms(8) == pytest.approx(6.0)
    assert prof.measured_prefix_caching is True and prof.measured_gpu_memory_utilization == 0.92


def test_fits_hold_under_noise(tmp_path: Path) -> None:
    prof = fit_measured(synthetic_measurement(tmp_path / "m", noise=0.02, seed=3))
    assert prof.steptime.c0_ms == pytest.approx(TRUE["c0"], rel=0.15)
    assert prof.steptime.c1_ms_per_req == pytest.approx(TRUE["c1"], rel=0.15)
    assert prof.steptime.p1_ms_per_prefill_token == pytest.approx(TRUE["p1"], rel=0.15)


def test_calibrate_fits_a_measurement_directory(tmp_path: Path, monkeypatch, capsys) -> None:
    d = synthetic_measurement(tmp_path / "m")
    out = tmp_path / "p.yaml"
    r = CliRunner().invoke(app, ["calibrate", "--profiling", str(d), "--out", str(out)])
    assert r.exit_code == 0, r.output
    from lorapack.profile import load_profile_file

    prof = load_profile_file(out)
    assert prof.vllm_version == "0.32.0" and prof.model == "tiny" and prof.tensor_parallel_size == 2
    code, _, err = run_main(monkeypatch, capsys, "calibrate", "--profiling", d, "--out", tmp_path / "q.yaml",
                            "--vllm-version", "0.8.5")
    assert code == 2 and "the measured server runs vLLM 0.32.0" in err
    code, _, err = run_main(monkeypatch, capsys, "calibrate", "--profiling", tmp_path, "--out", tmp_path / "q.yaml")
    assert code == 2 and "needs --model" in err


# ---------------------------------------------------------------------------------------------------------
# --launch: a fake `vllm serve` (a Python script taking --host/--port/--max-loras/--max-lora-rank)

FAKE_SERVE = '''
import argparse, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
ap = argparse.ArgumentParser()
ap.add_argument("--host"); ap.add_argument("--port", type=int)
ap.add_argument("--max-loras", type=int, default=1); ap.add_argument("--max-lora-rank", type=int, default=16)
a = ap.parse_args()
if a.max_lora_rank not in (8, 16, 32):
    print(f"ValueError: max_lora_rank ({a.max_lora_rank}) must be one of (8, 16, 32)", flush=True); sys.exit(1)
kv = 100000 - a.max_loras * (10 * a.max_lora_rank + 50)
if kv < 4096:
    print("ValueError: 4096 tokens of KV cache is needed, which is larger than the available KV cache memory",
          flush=True); sys.exit(1)
class H(BaseHTTPRequestHandler):
    def log_message(self, *x): pass
    def do_GET(self):
        body = (f'vllm:cache_config_info{{block_size="16",num_gpu_blocks="{kv // 16}"}} 1.0\\n' if self.path ==
                "/metrics" else "ok").encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
HTTPServer((a.host, a.port), H).serve_forever()
'''


def test_launch_grid_records_starts_and_refusals(tmp_path: Path) -> None:
    import shlex
    import sys

    from lorapack.measure import launch as ln
    from lorapack.measure.fit import fit_memory

    script = tmp_path / "fake_serve.py"
    script.write_text(FAKE_SERVE)
    template = f"{shlex.quote(sys.executable)} {shlex.quote(str(script))} {{flags}} --max-loras 1"
    # the grid's flags come before the template's own --max-loras 1 here: the last one wins, as in vLLM
    assert ln.command_words(template, ["--port", "9"])[-4:] == ["--port", "9", "--max-loras", "1"]
    template = f"{shlex.quote(sys.executable)} {shlex.quote(str(script))} {{flags}}"
    grid = ln.parse_grid("4,64,400", "8,7,32")
    saved: list[int] = []
    rows = ln.startup_grid(template, grid, tmp_path / "logs", 60.0, lambda s: None,
                           save=lambda r: saved.append(len(r)))
    assert saved == list(range(1, len(grid) + 1))  # written after every point (resumable)
    by = {(r["max_loras"], r["max_lora_rank"]): r for r in rows}
    assert by[(4, 8)]["status"] == "ok" and by[(4, 8)]["kv_cache_tokens"] == (100000 - 4 * 130) // 16 * 16
    assert by[(4, 7)] == {**by[(4, 7)], "status": "failed", "error_type": "invalid_argument"}
    assert by[(400, 32)]["error_type"] == "kv_cache_insufficient"
    # a resumed grid starts only what is missing
    again = ln.startup_grid(template, grid, tmp_path / "logs", 60.0, lambda s: None, done=rows[:-1])
    assert [r["start_s"] for r in again[:-1]] == [r["start_s"] for r in rows[:-1]]
    # the memory rule fitted over the starts (k, c of the fake: 10 tokens per slot and rank, 50 per slot)
    ident = {"max_loras": 4, "max_lora_rank": 8, "kv_cache_tokens": by[(4, 8)]["kv_cache_tokens"]}
    mm, _prov = fit_memory(ident, [{k: str(v) for k, v in r.items()} for r in rows])
    assert mm.kv_tokens_per_slot_rank == pytest.approx(10.0, abs=0.3)
    assert mm.kv_tokens_per_slot == pytest.approx(50.0, abs=8.0)
    assert any(p.kv_tokens is None and p.error_type == "kv_cache_insufficient" for p in mm.measured)
    with pytest.raises(MeasureError, match="--grid-max-loras 'x'"):
        ln.parse_grid("x", "8")
    with pytest.raises(MeasureError, match="cannot start '/nonexistent/vllm': no such program"):
        ln.start("/nonexistent/vllm serve m", [], tmp_path / "l.log", 5.0)
    with pytest.raises(MeasureError, match="^failed: the server did not start: .*ZeroDivisionError"):
        ln.start(f"{shlex.quote(sys.executable)} -c '1/0'", [], tmp_path / "l.log", 5.0)


def test_run_row_counts_like_the_twin() -> None:
    """A windowed run's row: completed = finished in the window; the offered tokens behind the ratio count only
    requests an idle server could have finished by the window's end (``twin.metrics.finishable_mask``)."""
    from lorapack.measure.probe import Identity
    from lorapack.measure.runs import RunAdapter, RunSpec, run_row
    from lorapack.testbed.replay import Arrival, ReplayResult, RequestRecord

    ident = Identity(url="u", vllm_version="0.32.0", model="m", max_model_len=4096, served_adapters=["a", "b"],
                     max_loras=1, max_lora_rank=16, max_cpu_loras=2, max_num_seqs=8, max_num_batched_tokens=256,
                     kv_cache_tokens=1000, block_size=16, gpu_memory_utilization=0.9, prefix_caching=False,
                     device="cpu", tensor_parallel_size=1, per_request_metrics=True)
    ads = [RunAdapter("a", 8, 1.0), RunAdapter("b", 16, 1.0)]

    def rec(i: int, adapter: str, sent: float, finish: float, queue_ms: float = 5.0) -> RequestRecord:
        r = RequestRecord(i, adapter, 100, 50, sent, t_sent_s=sent, t_finish_s=finish, completion_tokens=50,
                          status=200, queue_ms=queue_ms, engine_ttft_ms=20.0, engine_itl_ms=10.0)
        return r

    recs = [rec(0, "a", 1.0, 2.0), rec(1, "b", 2.0, 3.0, 105.0), rec(2, "a", 8.0, 11.0), rec(3, "b", 9.9, 12.0)]
    arrivals = [Arrival(r.t_planned_s, r.adapter_id, 100, 50) for r in recs]
    res = ReplayResult(recs, [], 12.0)
    run = RunSpec("measure__m__x___1_2_16_", tuple(ads), 10.0, 0)
    row = run_row(run, "m", ident, arrivals, res, idle_service_s=lambda p, o: 1.0)
    assert row["n_completed"] == 2 and row["n_sent"] == 4
    assert row["throughput_tok_s"] == pytest.approx(2 * 150 / 10.0)
    # offered: requests 0, 1 and 2 could finish (sent + 1 s <= 10 s); request 3 (sent at 9.9 s) could not
    assert row["throughput_ratio"] == pytest.approx(300 / 450)
    assert row["starved"] == 1
    assert row["incoming_tok_s"] == pytest.approx(600 / 10.0)
    assert row["ttft_mean_ms"] == pytest.approx((25.0 + 125.0) / 2)
    assert row["itl_mean_ms"] == pytest.approx(10.0)
    assert row["rank_counts"] == "8:1 16:1" and row["rate_counts"] == "1:2"
    assert row["ttft_source"] == "engine"
    from lorapack.realruns import check_row

    check_row({k: str(v) for k, v in row.items()}, "row", measured=("throughput_tok_s", "itl_mean_ms"),
              need_counts=True)


def test_short_run_windows_are_named_with_the_budget_that_would_do() -> None:
    """Windows under 15x a request's time alone get one line naming the --budget-min that gives them; none when
    they are long enough; a note that the labels are rough when even the longest window is short."""
    from lorapack.measure.run import SETTLE_S, SHARES, short_window_note

    assert short_window_note(27.0, 1.0, 3) is None
    note = short_window_note(27.0, 2.8, 3)  # the slow CI machine of 2026-11-29
    assert note is not None and "2.8 s alone" in note and "27 s windows" in note and "42 s" in note
    need = int(note.rsplit("--budget-min ", 1)[1].split()[0])
    assert (need * 60 * SHARES["runs"]) / 3 - SETTLE_S >= 15 * 2.8
    assert ((need - 1) * 60 * SHARES["runs"]) / 3 - SETTLE_S < 15 * 2.8
    assert "stop at 120 s" in short_window_note(120.0, 10.0, 3)
    assert short_window_note(30.0, float("nan"), 3) is None


def test_predict_run_at_a_pace_reports_in_the_servers_time() -> None:
    """``predict_run(..., time_scale=k)``: the twin with every duration k times longer, its figures in the
    server's time: a light run's throughput is its offered load at any pace, a starving run's falls about k-fold,
    and ITL grows k-fold."""
    from types import SimpleNamespace

    from lorapack.measure import proof as fd
    from lorapack.measure.runs import RunAdapter, RunSpec, arrivals_for
    from lorapack.profile import find_profile

    prof = find_profile("llama-3.1-8b-instruct")
    ident = SimpleNamespace(max_loras=4, max_lora_rank=32, max_cpu_loras=12, max_num_seqs=32,
                            max_num_batched_tokens=256)
    names = fd.adapter_names()

    def run(rate: float) -> tuple[RunSpec, list]:
        spec = RunSpec("r", tuple(RunAdapter(n, r, rate) for n, r, _ in names[:3]), 120.0, 7)
        return spec, arrivals_for(spec.adapters, 120.0, 128.0, 128.0, 7)

    light, heavy = run(0.3), run(200.0)
    for k in (0.5, 2.0):
        a, b = fd.predict_run(prof, *light, ident), fd.predict_run(prof, *light, ident, time_scale=k)
        # (within 10 %: at another pace other requests are still in flight at the window's end)
        assert b["throughput_tok_s"] == pytest.approx(a["throughput_tok_s"], rel=0.1) and not b["starved"]
        assert b["itl_mean_ms"] == pytest.approx(k * a["itl_mean_ms"], rel=0.05)  # (batches differ a little)
        a, b = fd.predict_run(prof, *heavy, ident), fd.predict_run(prof, *heavy, ident, time_scale=k)
        assert a["starved"] and b["starved"]
        assert b["throughput_tok_s"] == pytest.approx(a["throughput_tok_s"] / k, rel=0.1)


def test_paced_idle_service_scales_the_idle_servers_time() -> None:
    """A held-back run's server "starved" is judged against an idle server at the probed pace (as the twin's)."""
    from lorapack.measure.proof import paced_idle_service

    solo = paced_idle_service(lambda prompt, output: 0.001 * prompt + 0.01 * output, 1.5)
    assert solo(100, 10) == 1.5 * (0.1 + 0.1)
    assert paced_idle_service(lambda p, o: 2.0, 1.0)(1, 1) == 2.0
