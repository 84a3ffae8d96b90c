"""``lorapack place`` (issue 9, Deliver 4): outputs, the pinned vLLM flags, and bad workloads."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from data_helpers import run_main
from lorapack.placement.export import VLLM_SERVE_FLAGS, VLLM_VERSION
from lorapack.workload import example_workload

LLAMA = "llama-3.1-8b-instruct"
PLAN_KEYS = {"method", "gpus_used", "lower_bound_gpus", "placement_ms", "gpus"}
GPU_KEYS = {"adapters", "max_loras", "max_lora_rank", "max_cpu_loras", "max_num_seqs", "max_num_batched_tokens",
            "predicted", "verified", "incoming_tok_s", "binding"}


@pytest.fixture(autouse=True)
def _no_debug_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LORAPACK_DEBUG", raising=False)


def _csv(tmp_path: Path, rows: str, name: str = "adapters.csv") -> Path:
    p = tmp_path / name
    p.write_text("adapter_id,rank,rate_rps,path\n" + rows)
    return p


def serve_lines(text: str) -> list[list[str]]:
    return [shlex.split(line) for line in text.splitlines() if " vllm serve " in line]


def test_place_writes_plan_serve_and_routes(tmp_path, monkeypatch, capsys) -> None:
    wl = _csv(tmp_path, "".join(f"a{i},{8 if i % 2 else 16},{0.05 + 0.01 * i},/lora/a{i}\n" for i in range(12))
              + "no-path,8,0.1,\n")
    out = tmp_path / "out"
    code, stdout, err = run_main(monkeypatch, capsys, "place", wl, "--model", LLAMA, "--method", "proposed-exact",
                                 "--out", out, "--json")
    assert code == 0, err
    plan = json.loads(stdout)
    assert PLAN_KEYS <= set(plan) and plan["method"] == "proposed-exact"
    assert plan["gpus_used"] == len(plan["gpus"]) >= plan["lower_bound_gpus"] >= 1
    for g in plan["gpus"]:
        assert GPU_KEYS <= set(g)
        assert g["verified"]["passed"] and g["verified"]["seeds"] == 3 and len(g["verified"]["per_seed"]) == 3
    assert json.loads((out / "plan.json").read_text())["gpus"] == plan["gpus"]
    # routes: every adapter, weights summing to 1, a URL per GPU
    routes = json.loads((out / "routes.json").read_text())
    assert set(routes) == {f"a{i}" for i in range(12)} | {"no-path"}
    for lst in routes.values():
        assert sum(r["weight"] for r in lst) == pytest.approx(1.0)
        assert all(r["url"].startswith("http://localhost:80") and r["url"].endswith("/v1") for r in lst)
    # serve.sh: one vllm serve line per GPU, only pinned vLLM 0.8.5 flags, every adapter with its path
    text = (out / "serve.sh").read_text()
    assert VLLM_VERSION == "0.8.5" and f"vLLM {VLLM_VERSION}" in text
    lines = serve_lines(text)
    assert len(lines) == plan["gpus_used"]
    for words, g in zip(lines, plan["gpus"], strict=True):
        flags = [w for w in words if w.startswith("--")]
        assert set(flags) <= set(VLLM_SERVE_FLAGS), set(flags) - set(VLLM_SERVE_FLAGS)
        for f in ("--enable-lora", "--max-loras", "--max-lora-rank", "--max-cpu-loras", "--max-num-seqs",
                  "--max-num-batched-tokens", "--max-model-len", "--port", "--lora-modules"):
            assert f in flags, f
        assert words[words.index("--max-loras") + 1] == str(g["max_loras"])
        assert any(w.startswith("CUDA_VISIBLE_DEVICES=") for w in words)
        mods = [json.loads(m) for m in words[words.index("--lora-modules") + 1:]]  # vLLM's JSON form
        assert [m["name"] for m in mods] == g["adapters"]  # registration order
        assert all(m["path"] == ("$LORA_DIR_JSON/no-path" if m["name"] == "no-path" else f"/lora/{m['name']}")
                   for m in mods)
    if shutil.which("bash"):
        assert subprocess.run(["bash", "-n", str(out / "serve.sh")]).returncode == 0


@pytest.mark.parametrize("rows, match", [
    ("a,8,0.1,\na,16,0.1,\n", "duplicate id 'a'"),
    ("a,600,0.1,\n", ":2: rank: expected an integer rank 1 ... 512"),  # with its line (issue 26)
    ("a,0,0.1,\n", "rank"),
    ("a,8,-1,\n", ":2: rate_rps: expected a finite number >= 0"),  # rate 0 is placed (test_place_lengths)
    ("", "no adapters"),
])
def test_bad_workloads_exit_2_with_one_line_and_write_nothing(tmp_path, monkeypatch, capsys, rows, match) -> None:
    wl = _csv(tmp_path, rows)
    out = tmp_path / "out"
    code, stdout, err = run_main(monkeypatch, capsys, "place", wl, "--model", LLAMA, "--method", "proposed-exact",
                                 "--out", out)
    assert code == 2, (stdout, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and match in lines[0], err
    assert "Traceback" not in err and not out.exists()


@pytest.mark.parametrize("args, match", [
    (("--method", "best-fit"), "--method 'best-fit'"),
    (("--gpus", "0", "--method", "dlora"), "--gpus 0"),
    (("--headroom", "-1"), "--headroom"),
    (("--max-ttft-s", "0"), "--max-ttft-s"),
    (("--out", "FILE"), "not a directory"),
    (("--out", "missing/deeper"), "does not exist"),
    (("--verify-arrivals", "nope.csv"), "--verify-arrivals nope.csv: expected 'workload', 'poisson' or an existing"),
    (("--n-max", "0"), "--n-max 0"),
])
def test_bad_options_exit_2_before_any_work(tmp_path, monkeypatch, capsys, args, match) -> None:
    (tmp_path / "FILE").write_text("x")
    monkeypatch.chdir(tmp_path)
    code, stdout, err = run_main(monkeypatch, capsys, "place", example_workload(), "--model", LLAMA, *args)
    assert code == 2 and match in err and len(err.strip().splitlines()) == 1, err


def test_verification_follows_a_traces_load_swings(tmp_path, monkeypatch, capsys) -> None:
    wl = _csv(tmp_path, "".join(f"a{i},8,0.05,\n" for i in range(4)))
    trace = tmp_path / "t.csv"  # 30 arrivals in the first minute, 10 in the second
    trace.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n"
                     + "".join(f"{t:.3f},100,50\n" for t in [*np.linspace(0, 59, 30), *np.linspace(60, 119, 10)]))
    code, stdout, err = run_main(monkeypatch, capsys, "place", wl, "--model", LLAMA, "--method", "proposed-exact",
                                 "--verify-seeds", "1", "--verify-arrivals", trace, "--out", tmp_path / "out", "--json")
    assert code == 0, err
    law = json.loads(stdout)["settings"]["verify_arrivals"]
    assert law == {"kind": "modulated", "period_s": 60.0, "periods": 2, "mean_multiplier": pytest.approx(1.0),
                   "max_multiplier": pytest.approx(1.5)}


def test_a_pool_too_small_says_how_many_gpus_are_needed(tmp_path, monkeypatch, capsys) -> None:
    # 24 adapters at 2 req/s (x 1.2 headroom: 57.6 req/s, ~24 k tok/s): more than one GPU serves
    wl = _csv(tmp_path, "".join(f"h{i},8,2.0,\n" for i in range(24)))
    code, stdout, err = run_main(monkeypatch, capsys, "place", wl, "--model", LLAMA, "--method", "proposed-exact",
                                 "--gpus", "1", "--out", tmp_path / "out")
    assert code == 2 and "needs at least" in err and "1 given" in err, err
    assert not (tmp_path / "out").exists()


def test_unverified_plan_says_what_its_prediction_describes(tmp_path, monkeypatch, capsys) -> None:
    # two light adapters: the greedy tests them padded to its first testing point (8); the plan records that,
    # the table says so, and "starved" reads the learned oracle's probability (a tiny one is "no", not "yes")
    wl = _csv(tmp_path, "a,8,0.4,\nb,16,0.3,\n")
    code, stdout, err = run_main(monkeypatch, capsys, "place", wl, "--model", LLAMA, "--method", "proposed",
                                 "--no-verify", "--out", tmp_path / "out")
    assert code == 0, err
    g = json.loads((tmp_path / "out" / "plan.json").read_text())["gpus"][0]
    assert g["verified"] is None and g["predicted"]["tested_adapters"] == 8
    assert g["predicted"]["incoming_tok_s"] > 3 * g["incoming_tok_s"]  # the padded test's load, not the GPU's
    assert 0 < g["predicted"]["starved"] < 0.5  # a probability, not a verdict
    row = next(line for line in stdout.splitlines() if line.strip().startswith("0 "))
    assert " no " in row and " yes " not in row, row
    assert "tested padded to that many adapters" in " ".join(stdout.split()) and "0 (8)" in stdout
    # verified: the GPU's own metrics; the prediction keeps its tested size
    code, stdout, err = run_main(monkeypatch, capsys, "place", wl, "--model", LLAMA, "--method", "proposed-exact",
                                 "--verify-seeds", "1", "--out", tmp_path / "v")
    assert code == 0, err
    g = json.loads((tmp_path / "v" / "plan.json").read_text())["gpus"][0]
    assert g["verified"]["seeds"] == 1 and "tested padded" not in stdout
    assert g["predicted"]["tested_adapters"] == 8


def test_more_adapters_than_n_max_on_a_gpu_only_after_verification_and_said_so(tmp_path, monkeypatch, capsys
                                                                                 ) -> None:
    # 400 light adapters (0.8 req/s in all): the greedy stops at 384 per GPU, the verified consolidation puts
    # them on one GPU and the output warns that the twin extrapolates; --n-max 384 keeps two GPUs
    wl = _csv(tmp_path, "".join(f"a{i},8,0.002,\n" for i in range(400)))
    args = ("place", wl, "--model", LLAMA, "--method", "proposed-exact", "--verify-seeds", "1", "--headroom", "0")
    code, stdout, err = run_main(monkeypatch, capsys, *args, "--out", tmp_path / "soft")
    assert code == 0, err
    plan = json.loads((tmp_path / "soft" / "plan.json").read_text())
    assert plan["gpus_used"] == 1 and len(plan["gpus"][0]["adapters"]) == 400
    assert plan["verification"]["consolidated"]["accepted"] and plan["lower_bound_gpus"] == 1
    assert "consolidated from 2 to 1 GPUs" in stdout and "host more than 384 adapters" in stdout
    code, stdout, err = run_main(monkeypatch, capsys, *args, "--n-max", "384", "--out", tmp_path / "hard", "--json")
    assert code == 0, err
    plan = json.loads(stdout)
    assert plan["gpus_used"] == plan["lower_bound_gpus"] == 2 and plan["settings"]["n_max_hard"]
    assert max(len(g["adapters"]) for g in plan["gpus"]) <= 384


def test_help_states_the_defaults() -> None:
    from typer.testing import CliRunner

    from lorapack.cli import app

    res = CliRunner().invoke(app, ["place", "--help"])
    text = " ".join(res.stdout.split())
    for word in ("--gpus", "--method", "--models", "--out", "--json", "--headroom", "Default 0.2",
                 "--objective", "--max-ttft-s", "--max-itl-ms", "--max-ttft-p99-s", "--max-itl-p99-ms",
                 "--no-verify", "--split-hot", "proposed-exact", "round-robin"):
        assert word in text, word
