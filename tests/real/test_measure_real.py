"""``lorapack measure`` -> ``calibrate`` -> predict on the testbed, the CI smoke version of
``bench/testbed_fidelity.py``: ``measure --launch --budget-min 3`` with a two-point start-up grid (killed with
SIGKILL half-way and resumed), calibrate the measurement, then three held-back runs (light, near capacity,
starving) replayed on another server and predicted at that server's pace of the moment (``server_pace``)."""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lorapack.measure import proof as fd
from lorapack.measure.probe import Http, Identity

pytestmark = pytest.mark.real


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "lorapack.cli", *args]


def _done(mdir: Path) -> dict:
    try:
        return json.loads((mdir / "measure.json").read_text()).get("experiments", {})
    except (OSError, json.JSONDecodeError):
        return {}


def launch_template(testbed) -> str:
    """The testbed server of ``fidelity`` as a ``--launch`` command (environment and priority included)."""
    from lorapack.testbed.server import BASE_FLAGS, SERVER_ENV, SERVER_NICE, lora_module_arg, served_name

    mods = [lora_module_arg(served_name(a), testbed.adapter(a.partition("=")[2]).path) for a in fd.server_adapters()]
    words = ["env", *[f"{k}={v}" for k, v in SERVER_ENV.items()], "nice", "-n", str(SERVER_NICE),
             str(testbed.vllm), "serve", str(testbed.model_dir), *BASE_FLAGS, "--enable-lora", "--lora-modules", *mods,
             *fd.SERVER_FLAGS]
    return shlex.join(words) + " {flags}"


def test_measure_launch_calibrate_predict(testbed, servers, tmp_path: Path) -> None:
    """``measure --launch`` with a start-up grid (one setting vLLM refuses: slots below the adapters' rank), killed with SIGKILL after the LoRA
    experiment (its server dies with it) and resumed; calibrate; three held-back runs predicted."""
    adapters = fd.write_adapters_csv(tmp_path / "adapters.csv")
    mdir = tmp_path / "m"
    cmd = _cli("measure", "--launch", launch_template(testbed), "--grid-max-loras", "2", "--grid-max-lora-rank",
               "32,8", "--adapters", str(adapters), "--out", str(mdir), "--budget-min", "3", "--runs", "3")
    # first attempt: killed (SIGKILL, the main process alone) once the LoRA experiment is written
    first = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
    deadline = time.monotonic() + 600
    while "lora" not in _done(mdir) and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert first.poll() is None, first.communicate()[0]
    decode_mtime = (mdir / "decode.csv").stat().st_mtime_ns
    launched = json.loads((mdir / "measure.json").read_text())["identity"]["url"]
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    from lorapack.testbed.server import healthy

    deadline = time.monotonic() + 30
    while healthy(launched) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not healthy(launched), "the launched server outlived the killed measure"
    with (mdir / "startup.csv").open() as f:
        grid = {(r["max_loras"], r["max_lora_rank"]): r for r in csv.DictReader(f)}
    assert grid[("2", "32")]["status"] == "ok" and grid[("2", "32")]["kv_cache_tokens"] == "2097152"
    # the served adapters have ranks up to 32: vLLM refuses to start with slots of rank 8
    assert grid[("2", "8")]["status"] == "failed"
    assert grid[("2", "8")]["error_type"] == "adapter_rank_above_max_lora_rank"
    # the killed client's open requests are aborted by the server when their connections close; measure
    # refuses a busy server, so give it a moment
    time.sleep(2)
    t0 = time.monotonic()
    second = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "(resuming)" in second.stderr and "estimated duration" in second.stderr
    assert "decode: up to" not in second.stderr  # done before the kill: not measured again
    assert (mdir / "decode.csv").stat().st_mtime_ns == decode_mtime
    assert f"lorapack calibrate --profiling {mdir}" in second.stdout
    assert "startup: --max-loras" not in second.stderr  # the grid was done: not started again
    assert time.monotonic() - t0 < 3 * 60 + 180
    with (mdir / "runs.csv").open() as f:
        runs = list(csv.DictReader(f))
    assert len(runs) == 3 and {r["status"] for r in runs} == {"ok"}
    assert all(float(r["throughput_tok_s"]) > 0 and r["max_loras"] == "4" for r in runs)

    prof_path = tmp_path / "tiny.yaml"
    cal = subprocess.run(_cli("calibrate", "--profiling", str(mdir), "--runs", str(mdir / "runs.csv"), "--out",
                              str(prof_path), "--workers", "1", "--json"), capture_output=True, text=True,
                         timeout=900)
    assert cal.returncode == 0, cal.stderr
    from lorapack.profile import load_profile_file

    prof = load_profile_file(prof_path)
    assert prof.vllm_version == "0.32.0" and prof.model == "tiny" and prof.device == "cpu"
    assert prof.max_num_batched_tokens == 256 and prof.max_num_seqs == 32 and prof.block_size == 128

    server = servers.get(fd.server_adapters(), fd.SERVER_FLAGS, fresh=True)
    # three held-back runs: light, near capacity, far beyond it
    from lorapack.measure import experiments as ex
    from lorapack.measure.run import Store, capacity_rps, idle_service

    store = Store(mdir)
    ident = Identity(**store.meta["identity"])
    ctx = ex.Context(Http(server.url), ident, [(n, r) for n, r, _ in fd.adapter_names()], ex.Caps(), 0, 1.0, print)
    solo = idle_service(mdir, ident.max_num_batched_tokens)
    # The windows are long against the server's own pace: "starved" compares the tokens completed in the window
    # with those an idle server could have completed, so a request in flight at the end (slower than alone,
    # being batched) counts against the ratio. On a slow machine (CI at ~3x the usual step times, 2026-11-29:
    # a request of the mean lengths 2.8 s alone) a 20 s window made even the light run "starved", on the server
    # and in the twin alike (ratio 0.74 at 0.3 x capacity). The light run is 0.2 x capacity: at 0.3 the twin's
    # run came out starved at 2 of 15 windows from 20 to 90 s (one long request in flight at the end), at 0.2 at
    # none.
    window_s = max(20.0, 15.0 * solo(128, 128))
    runs = fd.held_back_runs(lambda n: capacity_rps(ctx, store, n, 128.0, 128.0), ((6, 0.2), (3, 0.9), (8, 1.8)),
                             window_s=window_s)
    # The light run's window three times as long: at 0.2 x capacity a 25 s window holds ~10 requests, so one
    # request slowed past the window's end by batching costs ~10 % of the finishable tokens and reads "starved"
    # on the server and in the twin alike (CI of b6d7363, pace 1.30: both at ratio 0.896). With ~30 requests one
    # such request costs ~3 %.
    runs[0] = dataclasses.replace(runs[0], window_s=3.0 * window_s)
    # The twin at the server's pace of the moment (fd.server_pace, a probe before each run): on this shared CPU
    # the machine's speed drifts by tens of per cent over minutes (2026-11-29: one held-back run at 595 tok/s,
    # then at 818-844 on the same server), which a GPU does not do and no profile can know.
    got, paces, unpaced = [], [], []
    for run in runs:
        paces.append(fd.server_pace(ctx, mdir))
        # the server's "starved" against an idle server of this pace, as the twin's (2026-11-29: under load, the
        # light run at pace 1.26 read ratio 0.60 against the measurement's idle server)
        r = fd.replay_run(server.url, ident.model, run, ident, fd.paced_idle_service(solo, paces[-1]))
        ex.wait_idle(Http(server.url))
        got.append((r["row"], fd.predict_run(prof, run, r["arrivals"], ident, time_scale=paces[-1])))
        unpaced.append(fd.predict_run(prof, run, r["arrivals"], ident)["throughput_tok_s"])
    light, _, heavy = got
    says = "\n".join(
        f"{row['run_id']} ({run.window_s:.0f} s, pace {pace:.2f}): server {row['throughput_tok_s']:.0f} tok/s, ratio "
        f"{row['throughput_ratio']:.3f}, starved {row['starved']}, ITL {row['itl_mean_ms']:.1f} ms; twin "
        f"{pred['throughput_tok_s']:.0f} tok/s, ratio {pred['throughput_tok_s'] / pred['finishable_tok_s']:.3f}, "
        f"starved {int(pred['starved'])}, ITL {pred['itl_mean_ms']:.1f} ms" for (row, pred), pace, run in zip(got, paces, runs, strict=True))
    assert not light[0]["starved"] and not light[1]["starved"], says
    assert heavy[0]["starved"] and heavy[1]["starved"], says
    # Throughput: within 25 % of the twin at some pace between the measurement's (1) and the probe's. The probe
    # is one short base-model point; on a slow shared machine it has read 1.4-1.6 while the heavy run's server
    # ran nearer the measurement's pace (CI of c3d1f23 and b6d7363, heavy run: server 867 / 822 tok/s and ITL
    # 62.5 / 57.6 ms, the twin at the probe's pace 1.47 / 1.61 534 / 448 tok/s and 93.7 / 112.7 ms), and elsewhere
    # the drift was real (2026-11-29: 595 then 818-844 tok/s on one server). The twin's throughput falls as its
    # pace grows, so the band's two ends suffice.
    for (row, pred), flat in zip(got, unpaced, strict=True):
        lo, hi = sorted((pred["throughput_tok_s"], flat))
        gap = max(lo - row["throughput_tok_s"], row["throughput_tok_s"] - hi, 0.0)
        assert gap / row["throughput_tok_s"] < 0.25, f"{says}\ntwin at pace 1: {flat:.0f} tok/s"
