"""Re-planning with a churn cap (``place --previous [--max-moves K]``) and its migration (migrate.json,
migrate.sh): toy oracles (a GPU passes while its rates sum to at most ``CAP`` req/s), no simulation."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lorapack.errors import SpecError
from lorapack.placement import PlaceConfig, Plan, plan_from_dict
from lorapack.placement.export import Endpoints, write_outputs
from lorapack.replan.migrate import migration, migration_files
from lorapack.replan.replan import best_matching, churn, needs_restart
from lorapack.server import ServerConfig
from placement_helpers import LLAMA, instance, run_place, toy_kwargs

CAP = 10.0  # req/s one GPU serves under the toy oracle
EXAMPLES = Path(__file__).resolve().parents[1] / "src" / "lorapack" / "examples"


def _place(inst, tmp: Path, name: str, verify: bool = False, **kw) -> tuple[Plan, Path]:
    plan = run_place(inst, LLAMA, verify=verify, **toy_kwargs(CAP), **kw)
    assert not plan.infeasible, plan.reason
    out = tmp / name
    prev = kw.get("previous")
    previous = plan_from_dict(json.loads((Path(prev) / "plan.json").read_text())) if prev else None
    write_outputs(plan, out, extra=migration_files(previous, plan, {}) if previous else None)
    return plan, out


def _placed(plan: Plan) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for g, gp in enumerate(plan.gpus):
        for a in gp.adapters:
            out.setdefault(a, []).append(g)
    return out


def _gpu_rates(plan: Plan) -> list[float]:
    return [sum(gp.rates_rps) for gp in plan.gpus]


def test_no_rate_changes_moves_nothing(tmp_path) -> None:
    inst = instance(np.linspace(0.2, 1.6, 30))
    first, d0 = _place(inst, tmp_path, "w0")
    again, d1 = _place(inst, tmp_path, "w1", previous=d0)
    r = again.replan
    assert r["moves"]["total"] == 0 and r["restarts"] == [] and r["gpus"]["now"] == first.gpus_used
    assert [g.adapters for g in again.gpus] == [g.adapters for g in first.gpus]
    assert [g.server for g in again.gpus] == [g.server for g in first.gpus]
    mig = json.loads((d1 / "migrate.json").read_text())
    assert mig["steps"] == [] and all(s["passes"] for s in mig["states"])


def test_a_gpu_that_fails_sheds_its_hottest_adapters(tmp_path) -> None:
    rates = np.full(30, 0.8)
    first, d0 = _place(instance(rates), tmp_path, "w0")
    g0 = first.gpus[0].adapters
    rates2 = rates.copy()
    ids = list(instance(rates).adapter_ids)
    for a in g0[:2]:
        rates2[ids.index(a)] = 3.0  # GPU 0 now fails (over CAP)
    plan, _ = _place(instance(rates2), tmp_path, "w1", previous=d0)
    r = plan.replan
    assert r["failing_before"] == [0]
    assert r["moves"]["needed"] >= 2 and r["moves"]["optional"] == 0 and r["moves"]["total"] == r["moves"]["needed"]
    assert all(x <= CAP + 1e-9 for x in _gpu_rates(plan))
    assert sorted(_placed(plan)) == sorted(ids) and all(len(v) == 1 for v in _placed(plan).values())
    moved = {c["adapter"] for c in r["changes"]}
    assert moved <= set(g0)  # only the failing GPU's adapters move
    assert set(r["moved_from"]) == moved and all(v == [0] for v in r["moved_from"].values())


def test_new_adapters_are_placed_and_gone_ones_removed(tmp_path) -> None:
    rates = np.full(20, 0.8)
    first, d0 = _place(instance(rates), tmp_path, "w0")
    ids = [f"a{i:03d}" for i in range(5, 20)] + ["fresh1", "fresh2"]
    plan, d1 = _place(instance(np.full(len(ids), 0.8), ids=ids), tmp_path, "w1", previous=d0)
    r = plan.replan
    assert r["moves"]["gone"] == 5 and r["moves"]["new"] == 2
    assert r["moves"]["total"] == r["moves"]["gone"] + r["moves"]["new"]
    assert sorted(_placed(plan)) == sorted(ids)
    mig = json.loads((d1 / "migrate.json").read_text())
    assert mig["loads"] == 2 and mig["unloads"] == 5
    kinds = [s["kind"] for s in mig["steps"]]
    # load before the route switch, drain before unloading
    assert kinds.index("load") < kinds.index("route") < kinds.index("drain") < kinds.index("unload")


def test_max_moves_caps_the_optional_moves(tmp_path) -> None:
    first, d0 = _place(instance(np.full(30, 0.9)), tmp_path, "w0")
    assert first.gpus_used == 3
    low = instance(np.full(30, 0.3))  # everything fits on one GPU now
    capped, _ = _place(low, tmp_path, "k0", previous=d0, max_moves=0)
    assert capped.replan["moves"]["total"] == 0 and capped.gpus_used == 3
    some, _ = _place(low, tmp_path, "k20", previous=d0, max_moves=20)
    assert some.replan["moves"]["optional"] <= 20 and some.gpus_used == 2
    free, _ = _place(low, tmp_path, "kinf", previous=d0)
    assert free.gpus_used == 1 and free.replan["gpus"]["released"]
    assert free.replan["from_scratch"]["gpus"] == 1
    for p in (some, free):
        assert all(x <= CAP + 1e-9 for x in _gpu_rates(p))


def test_no_bouncing_in_the_next_window(tmp_path) -> None:
    rates = np.full(30, 0.8)
    ids = list(instance(rates).adapter_ids)
    first, d0 = _place(instance(rates), tmp_path, "w0")
    hot = first.gpus[0].adapters[0]
    rates1 = rates.copy()
    rates1[ids.index(hot)] = 4.0
    second, d1 = _place(instance(rates1), tmp_path, "w1", previous=d0)
    assert 0 not in _placed(second)[hot]
    assert json.loads((d1 / "plan.json").read_text())["replan"]["moved_from"][hot] == [0]
    assert second.gpus_used == 4  # no other GPU had room for it: a GPU was added
    # it cools down again: the GPU added for it is released (a GPU saved), and GPU 0, which has room for it
    # again, does not get it back
    third, _ = _place(instance(rates), tmp_path, "w2", previous=d1)
    assert third.gpus_used == 3 and third.replan["gpus"]["released"] == _placed(second)[hot]
    assert 0 not in _placed(third)[hot] and third.replan["moves"]["optional"] == 2


def test_verification_moves_are_made_and_reported(tmp_path) -> None:
    from placement_helpers import ToyOracle

    rates = np.full(30, 0.8)
    first, d0 = _place(instance(rates), tmp_path, "w0")
    strict = ToyOracle(CAP * 0.7)  # the verifier is stricter than the method's oracle: GPUs over 7 req/s fail
    plan = run_place(instance(rates), LLAMA, previous=d0, verify=True,
                     **{**toy_kwargs(CAP), "verify_oracle": strict, "search_oracle": strict})
    assert not plan.infeasible, plan.reason
    r = plan.replan
    assert r["moves"]["verification"] > 0 and r["moves"]["total"] == r["moves"]["verification"]
    assert plan.verification["passed"] and all(x <= 0.7 * CAP + 1e-9 for x in _gpu_rates(plan))


def test_from_scratch_is_matched_to_the_previous_gpus() -> None:
    def plan(*sets):
        from lorapack.placement import GpuPlan

        return Plan("x", "m", "g", [GpuPlan(adapters=list(s), weights=[1.0] * len(s),
                                            server=ServerConfig(max_loras=max(len(s), 1))) for s in sets])

    before = plan("ab", "cd", "ef")
    after = plan("ef", "ab", "cdx")  # the same GPUs, listed in another order, and one new adapter
    m = best_matching(before, after)
    assert sorted(m) == [(0, 1), (1, 2), (2, 0)]
    c = churn(before, after, m)
    assert c["moves"] == 1 and c["gpus_started"] == 0 and c["restarts"] == 1  # cdx: --max-loras 2 -> 3


@settings(max_examples=80, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sets(st.sampled_from("abcdefghijkl"), max_size=6), min_size=1, max_size=6),
       st.lists(st.sets(st.sampled_from("abcdefghijkl"), max_size=6), min_size=1, max_size=6))
def test_best_matching_has_the_fewest_moves(before_sets, after_sets) -> None:
    """The greedy-or-assignment matching moves no more than scipy's assignment on the padded cost matrix."""
    from scipy.optimize import linear_sum_assignment

    from lorapack.placement import GpuPlan

    def plan(sets):
        return Plan("x", "m", "g", [GpuPlan(adapters=sorted(s), weights=[1.0] * len(s),
                                            server=ServerConfig(max_loras=max(len(s), 1))) for s in sets])

    before, after = plan(before_sets), plan(after_sets)
    n = max(len(before_sets), len(after_sets))
    pad = lambda sets, i: set(sets[i]) if i < len(sets) else set()  # noqa: E731
    cost = np.array([[len(pad(before_sets, i) ^ pad(after_sets, j)) for j in range(n)] for i in range(n)])
    rows, cols = linear_sum_assignment(cost)
    m = best_matching(before, after)
    assert churn(before, after, m)["moves"] == int(cost[rows, cols].sum())
    assert len({p for p, _ in m if p is not None}) == sum(1 for p, _ in m if p is not None)
    assert len({q for _, q in m if q is not None}) == sum(1 for _, q in m if q is not None)


def test_restart_rule() -> None:
    old = ServerConfig(max_loras=8, max_lora_rank=16, max_cpu_loras=10)
    assert not needs_restart(old, old.replace(max_cpu_loras=40), 12)
    assert not needs_restart(old, old.replace(max_lora_rank=8), 12)
    assert needs_restart(old, old.replace(max_lora_rank=32), 12)
    assert needs_restart(old, old.replace(max_loras=16), 12)
    assert not needs_restart(old, old.replace(max_loras=4), 4)  # both >= the 4 adapters: the same server


def test_config_errors() -> None:
    with pytest.raises(SpecError, match="--max-moves 3: expected with --previous"):
        PlaceConfig(max_moves=3)
    with pytest.raises(SpecError, match="--previous /nonexistent: expected a plan.json"):
        PlaceConfig(previous=Path("/nonexistent"))


@pytest.mark.parametrize("args, message", [
    (["--previous", "{bad}"], "--previous {bad}: expected a plan.json written by lorapack place"),
    (["--max-moves", "-1", "--previous", "{prev}"], "--max-moves -1: expected an integer >= 0"),
])
def test_cli_errors_are_one_line(tmp_path, args, message) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    prev = tmp_path / "prev"
    prev.mkdir()
    (prev / "plan.json").write_text("[]")
    args = [a.format(bad=bad, prev=prev) for a in args]
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "-m", "lorapack.cli", "place", str(EXAMPLES / "adapters.csv"), "--model",
                        "llama-3.1-8b-instruct", "--no-verify", "--out", str(out), *args],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and message.format(bad=bad, prev=prev) in lines[0] and "Traceback" not in p.stderr
    assert not out.exists() or not any(out.iterdir())


@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), k=st.one_of(st.none(), st.integers(0, 40)))
def test_invariants(tmp_path_factory, seed, k) -> None:
    """Every adapter placed once, as the plan says; optional moves <= K; the moves add up; every GPU passes;
    nothing moved back onto a GPU it left in the previous window."""
    rng = np.random.default_rng(seed)
    tmp = tmp_path_factory.mktemp("inv")
    n = int(rng.integers(8, 40))
    rates = rng.uniform(0.05, 1.5, n)
    p0, d0 = _place(instance(rates), tmp, "w0")
    ids = list(instance(rates).adapter_ids)
    plans = [p0]
    d = d0
    for w in range(2):
        change = rng.random(len(ids)) < 0.3
        rates = np.where(change, rng.uniform(0.05, 3.0, len(ids)), rates)
        keep = rng.random(len(ids)) > 0.1
        ids = [a for a, kk in zip(ids, keep, strict=True) if kk] + [f"n{w}_{i}" for i in range(int(rng.integers(0, 4)))]
        rates = np.concatenate([rates[keep], rng.uniform(0.05, 1.5, len(ids) - int(keep.sum()))])
        plan, d = _place(instance(rates, ids=ids), tmp, f"w{w + 1}", previous=d, max_moves=k)
        r = plan.replan
        placed = _placed(plan)
        assert sorted(placed) == sorted(ids) and all(len(v) == 1 for v in placed.values())
        assert plan.routes() == {a: [(g[0], 1.0)] for a, g in placed.items()}
        m = r["moves"]
        assert k is None or m["optional"] <= k
        assert m["total"] == sum(m[x] for x in ("gone", "new", "needed", "optional", "verification"))
        assert m["total"] == r["churn"]["moves"]
        assert all(x <= CAP + 1e-9 for x in _gpu_rates(plan))
        moved_before = plans[-1].replan.get("moved_from", {}) if plans[-1].replan else {}
        for a, gs in moved_before.items():
            for g in gs:
                assert g not in placed.get(a, []), f"{a} bounced back to GPU {g}"
        mig = migration(plans[-1], plan, {})
        resident = {g: set(gp.adapters) for g, gp in enumerate(plans[-1].gpus)}
        for s in mig["steps"]:
            if s["kind"] == "load":
                resident.setdefault(s["gpu"], set()).add(s["adapter"])
            elif s["kind"] == "unload":
                resident[s["gpu"]].discard(s["adapter"])
            elif s["kind"] == "stop":
                resident[s["gpu"]] = set()
            elif s["kind"] in ("start", "restart"):
                resident[s["gpu"]] = set(plan.gpus[s["gpu"]].adapters)
        for g in range(max(len(plan.gpus), len(plans[-1].gpus))):
            want = set(plan.gpus[g].adapters) if g < len(plan.gpus) else set()
            assert resident.get(g, set()) == want, f"GPU {g}"
        plans.append(plan)


# ---------------------------------------------------------------------------------------------------------
# migrate.sh against fake servers: the order of the calls, restarts through SERVER_CTL, stop and resume


class _Fleet:
    """Fake vLLM servers (runtime load / unload, /metrics, /health) and a fake vllm-router (/workers) on
    loopback, one thread each; every call is logged as ``(port, method, path, body)``."""

    def __init__(self, ports_from: dict[int, set[str]]) -> None:
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.calls: list[tuple[int, str, str, dict | None]] = []
        self.resident = ports_from
        self.fail_unload = 0  # the next N unloads answer 500
        fleet = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _reply(self, code: int, text: str = "{}") -> None:
                data = text.encode()
                self.send_response(code)
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                port = self.server.server_address[1]
                fleet.calls.append((port, "GET", self.path, None))
                if self.path == "/metrics":
                    return self._reply(200, 'vllm:lora_requests_info{max_lora="8",running_lora_adapters="",'
                                            'waiting_lora_adapters=""} 1.7e9\n')
                self._reply(200)

            def do_DELETE(self) -> None:
                fleet.calls.append((self.server.server_address[1], "DELETE", self.path, None))
                self._reply(200)

            def do_POST(self) -> None:
                port = self.server.server_address[1]
                body = json.loads(self.rfile.read(int(self.headers["content-length"])) or b"{}")
                fleet.calls.append((port, "POST", self.path, body))
                if self.headers.get("Authorization") != "Bearer k" and self.path.startswith("/v1/"):
                    return self._reply(401)
                names = fleet.resident.setdefault(port, set())
                if self.path == "/v1/load_lora_adapter":
                    if body["lora_name"] in names:
                        return self._reply(400, '{"message": "has already been loaded"}')
                    names.add(body["lora_name"])
                elif self.path == "/v1/unload_lora_adapter":
                    if fleet.fail_unload:
                        fleet.fail_unload -= 1
                        return self._reply(500, '{"message": "boom"}')
                    if body["lora_name"] not in names:
                        return self._reply(404)
                    names.discard(body["lora_name"])
                self._reply(200)

        self.servers = []
        for port in ports_from:
            srv = ThreadingHTTPServer(("127.0.0.1", port), Handler)
            threading.Thread(target=srv.serve_forever, daemon=True).start()
            self.servers.append(srv)

    def close(self) -> None:
        for s in self.servers:
            s.shutdown()
            s.server_close()


def _free_ports(n: int) -> int:
    import socket

    from serve_helpers import free_port

    while True:
        base = free_port()
        try:
            for k in range(1, n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", base + k))
            return base
        except OSError:
            continue


def _gpu(adapters: str, max_loras: int):
    from lorapack.placement import GpuPlan

    ids = [f"x{c}" for c in adapters]
    return GpuPlan(adapters=ids, weights=[1.0] * len(ids), ranks=[8] * len(ids), rates_rps=[0.5] * len(ids),
                   incoming_tok_s=100.0 * len(ids),
                   server=ServerConfig(max_loras=max_loras, max_lora_rank=8, max_cpu_loras=len(ids),
                                       max_num_seqs=256, max_num_batched_tokens=8192))


def test_migrate_sh_order_restart_and_resume(tmp_path) -> None:
    """GPU 0 loses b and gains c (load, switch, drain, unload); GPU 1 restarts with another --max-loras (its
    adapters on a temporary host meanwhile); GPU 2 is released (drained, stopped); GPU 3 is started. The first
    unload fails: migrate.sh stops there and a second run resumes at that step."""
    base = _free_ports(5)
    router_port = base + 4
    before = Plan("proposed", LLAMA.model, LLAMA.gpu, [_gpu("ab", 2), _gpu("de", 2), _gpu("f", 1)])
    from lorapack.placement import GpuPlan

    released = GpuPlan(adapters=[], weights=[], server=ServerConfig(max_loras=1))
    after = Plan("proposed", LLAMA.model, LLAMA.gpu, [_gpu("ac", 2), _gpu("def", 1), released, _gpu("g", 1)])
    after.replan = {"failing_before": [1]}
    out = tmp_path / "w1"
    endpoints = Endpoints(base_port=base)
    write_outputs(after, out, endpoints=endpoints, extra=migration_files(before, after, {}, endpoints))
    mig = json.loads((out / "migrate.json").read_text())
    assert mig["restarts"] == [1] and mig["started"] == [3] and mig["released"] == [2]
    assert [s for s in mig["states"] if s["passes"] is None], "the temporary host's state is named"
    fleet = _Fleet({base + g: set(gp.adapters) for g, gp in enumerate(before.gpus)} | {router_port: set()})
    ctl_log = tmp_path / "ctl.log"
    ctl = tmp_path / "ctl.sh"
    ctl.write_text(f'#!/usr/bin/env bash\necho "$1 $2 $3" >>{ctl_log}\n')
    ctl.chmod(0o755)
    env = {**os.environ, "VLLM_API_KEY": "k", "SERVER_CTL": str(ctl), "DRAIN_GRACE_S": "0",
           "ROUTES_FILE": str(tmp_path / "live.json"), "LITELLM_CONFIG": str(tmp_path / "litellm.yaml"),
           "ROUTER_URL": f"http://127.0.0.1:{router_port}", "HEALTH_TIMEOUT_S": "10"}
    try:
        # GPU 3 is not running: the fake fleet starts it when SERVER_CTL is called -- here it is simply there
        fleet3 = _Fleet({base + 3: set(after.gpus[3].adapters)})
        fleet.fail_unload = 1
        p = subprocess.run(["bash", str(out / "migrate.sh")], capture_output=True, text=True, env=env, timeout=120)
        assert p.returncode == 1 and "failed (unload" in p.stderr, p.stdout + p.stderr
        k = int(re.search(r"step (\d+) failed", p.stderr).group(1))
        loads_first = [c for c in fleet.calls if c[2] == "/v1/load_lora_adapter"]
        p = subprocess.run(["bash", str(out / "migrate.sh")], capture_output=True, text=True, env=env, timeout=120)
        assert p.returncode == 0, p.stdout + p.stderr
        assert f"step {k}/" in p.stdout and p.stdout.count("done before") == k - 1
        assert [c for c in fleet.calls if c[2] == "/v1/load_lora_adapter"] == loads_first  # nothing loaded twice
        # end state: GPU 0 = {a, c}; the temporary copies on the hosts are gone again
        assert fleet.resident[base] == {"xa", "xc"} and fleet3.resident[base + 3] == {"xg"}
        assert ctl_log.read_text().split("\n")[:3] == [f"start 3 {base + 3}", f"stop 2 {base + 2}",
                                                       f"restart 1 {base + 1}"]
        assert json.loads((tmp_path / "live.json").read_text()) == json.loads((out / "routes.json").read_text())
        assert yaml_load(tmp_path / "litellm.yaml") == yaml_load(out / "litellm.yaml")
        calls = [(port - base, m, path) for port, m, path, _b in fleet.calls + fleet3.calls]
        order = [c for c in calls if c[1] != "GET" or c[2] == "/metrics"]
        i_load = order.index((0, "POST", "/v1/load_lora_adapter"))
        i_route = next(i for i, c in enumerate(order) if c[0] == 4)
        i_drain = order.index((0, "GET", "/metrics"))
        i_unload = order.index((0, "POST", "/v1/unload_lora_adapter"))
        assert i_load < i_route < i_drain < i_unload
        deletes = [c for c in calls if c[1] == "DELETE"]
        assert deletes and all(c[0] == 4 for c in deletes)  # vllm-router: servers that lost adapters re-registered
    finally:
        fleet.close()
        with contextlib.suppress(NameError):
            fleet3.close()


def yaml_load(path: Path):
    import yaml

    return yaml.safe_load(path.read_text())


def test_a_previous_plan_for_another_model_is_refused(tmp_path) -> None:
    _first, d0 = _place(instance(np.full(6, 0.5)), tmp_path, "w0")
    d = json.loads((d0 / "plan.json").read_text())
    d["model"] = "qwen-2.5-7b-instruct"
    (d0 / "plan.json").write_text(json.dumps(d))
    with pytest.raises(SpecError, match="a plan for qwen-2.5-7b-instruct on .*, expected one for llama"):
        run_place(instance(np.full(6, 0.5)), LLAMA, verify=False, previous=d0, **toy_kwargs(CAP))


class _SlotsOracle:
    """Passes while Σλ <= CAP, and past CAP / 2 only with every adapter resident (A >= N): a GPU whose load
    rises past half needs more slots, a restart."""

    name = "slots-toy"
    cheap = True

    def predict(self, cands):
        from lorapack.oracle import Prediction

        out = []
        for c in cands:
            lam = float(c.rates_rps.sum())
            ok = lam <= CAP and (c.max_loras >= c.n_adapters or lam <= CAP / 2)
            tau = c.input_tokens + c.output_tokens
            out.append(Prediction(fits=True, throughput_tok_s=lam * tau, incoming_tok_s=lam * tau,
                                  starved=0.0 if ok else 1.0, itl_ms=float("nan"), ttft_s=0.1))
        return out


@pytest.mark.parametrize("host_slots, passes", [(16, True), (4, False)])
def test_a_restart_parks_its_adapters_on_a_host_the_oracle_accepts(tmp_path, host_slots, passes) -> None:
    from lorapack.placement import GpuPlan
    from lorapack.placement.plan import PLAN_FLAGS

    def gpu(ids, a):
        srv = {k: None for k in PLAN_FLAGS} | {"max_loras": a, "max_lora_rank": 8, "max_cpu_loras": max(a, len(ids)),
                                                "max_num_seqs": LLAMA.max_num_seqs,
                                                "max_num_batched_tokens": LLAMA.max_num_batched_tokens,
                                                "max_model_len": LLAMA.max_model_len}
        return GpuPlan(adapters=ids, weights=[1.0] * len(ids), ranks=[8] * len(ids), rates_rps=[0.5] * len(ids),
                       server=ServerConfig(**srv))

    ids0, ids1 = [f"r{i}" for i in range(6)], [f"s{i}" for i in range(4)]
    prev = Plan("proposed", LLAMA.model, LLAMA.gpu, [gpu(ids0, 2), gpu(ids1, host_slots)])
    d0 = tmp_path / "w0"
    write_outputs(prev, d0)
    toy = _SlotsOracle()
    rates = [1.0] * 6 + [0.5] * 4  # GPU 0 passes half its CAP: it needs every adapter resident
    plan = run_place(instance(rates, ids=ids0 + ids1), LLAMA, verify=False, previous=d0, oracle=toy,
                     search_oracle=toy, verify_oracle=toy, capacity=lambda s: 0.9 * CAP * 420, workers=1,
                     max_moves=0)
    r = plan.replan
    assert r["restarts"] == [0] and r["moves"]["total"] == 0 and plan.gpus[0].max_loras == 6
    parked = r["restart_hosts"]["0"]
    assert set(parked["hosts"]) == set(ids0) and set(parked["hosts"].values()) == {1}
    assert parked["passes"] is passes and parked["failing"] == ([] if passes else [1])
    mig = migration(prev, plan, {})
    (state,) = [s for s in mig["states"] if "restarts" in s["why"]]
    assert state["passes"] is passes and state["gpus"] == [1]
    temporary = [s for s in mig["steps"] if s["kind"] == "load"]
    assert len(temporary) == 6 and all(s["temporary"] and s["gpu"] == 1 for s in temporary)


@pytest.mark.parametrize("seed", [4, 78, 11])
def test_invariants_with_a_stricter_verifier(tmp_path, seed) -> None:
    """Verification's repair splits adapters and moves them: two windows on, every GPU still holds an adapter at
    most once (replicas that met on one GPU are merged), every adapter's weights sum to 1, the moves add up."""
    from placement_helpers import ToyOracle

    rng = np.random.default_rng(seed)
    strict = ToyOracle(CAP * 0.7)
    kw = {**toy_kwargs(CAP), "verify_oracle": strict, "search_oracle": strict}
    rates = rng.uniform(0.05, 1.5, int(rng.integers(8, 40)))
    ids = list(instance(rates).adapter_ids)
    prev = run_place(instance(rates), LLAMA, verify=True, **kw)
    d = tmp_path / "w0"
    write_outputs(prev, d)
    for w in range(2):
        rates = np.where(rng.random(len(ids)) < 0.3, rng.uniform(0.05, 3.0, len(ids)), rates)
        plan = run_place(instance(rates, ids=ids), LLAMA, verify=True, previous=d, **kw)
        assert not plan.infeasible, plan.reason
        d = tmp_path / f"w{w + 1}"
        write_outputs(plan, d, extra=migration_files(prev, plan, {}))
        m = plan.replan["moves"]
        assert all(len(gp.adapters) == len(set(gp.adapters)) for gp in plan.gpus)
        assert sorted(plan.routes()) == sorted(ids)
        assert all(abs(sum(x for _, x in v) - 1.0) < 1e-9 for v in plan.routes().values())
        assert m["total"] == plan.replan["churn"]["moves"] == sum(m[x] for x in
                                                                 ("gone", "new", "needed", "optional", "verification"))
        assert plan.verification["passed"] and all(sum(gp.rates_rps) <= 0.7 * CAP + 1e-9 for gp in plan.gpus)
        prev = plan


def test_cli_replan_of_unchanged_rates_moves_nothing(tmp_path) -> None:
    """The shipped example through ``lorapack place`` twice (the default method, learned oracle and twin
    verification): the second, with ``--previous``, moves nothing, restarts nothing, and its migration is empty."""
    def place(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "lorapack.cli", "place", str(EXAMPLES / "adapters.csv"),
                               "--model", "llama-3.1-8b-instruct", "--workers", "1", *args],
                              capture_output=True, text=True, timeout=600, env={**os.environ, "COLUMNS": "80"})

    p = place("--out", str(tmp_path / "w0"))
    assert p.returncode == 0, p.stderr
    p = place("--out", str(tmp_path / "w1"), "--previous", str(tmp_path / "w0"))
    assert p.returncode == 0, p.stderr
    assert "re-plan: 0 moves (none" in p.stdout and "0 restart(s)" in p.stdout, p.stdout
    before = json.loads((tmp_path / "w0" / "plan.json").read_text())
    after = json.loads((tmp_path / "w1" / "plan.json").read_text())
    assert [g["adapters"] for g in after["gpus"]] == [g["adapters"] for g in before["gpus"]]
    assert after["replan"]["moves"]["total"] == 0 and after["replan"]["from_scratch"]["moves"] == 0
    assert json.loads((tmp_path / "w1" / "migrate.json").read_text())["steps"] == []
    assert (tmp_path / "w1" / "migrate.sh").read_text().count("\nstep ") == 0


class _CrowdOracle:
    """The toy oracle's verdicts on rates, and a mean TTFT that grows with the adapters a GPU holds (0.05 s
    each): a GPU of many cold adapters is light by rate and close to a 2 s TTFT limit."""

    name = "crowd"
    cheap = True

    def __init__(self, cap_rps: float) -> None:
        from placement_helpers import ToyOracle

        self.toy = ToyOracle(cap_rps)

    def predict(self, cands):
        from dataclasses import replace as dc_replace

        return [dc_replace(p, ttft_s=0.05 * c.n_adapters) for c, p in zip(cands, self.toy.predict(cands),
                                                                           strict=True)]


def test_newcomers_go_where_the_latency_margin_is_largest_not_only_least_load(tmp_path) -> None:
    """Step 3 by margin: of two running GPUs that both pass with a newcomer, the one whose prediction uses the
    smaller share of the latency limit gets it, even when the other carries less load (docs/replan.md,
    "Evaluation over time": a GPU filled up to the objective misses it on a replay's own draws)."""
    from lorapack.objective import Objective
    from placement_helpers import toy_capacity

    crowd = _CrowdOracle(CAP)
    kw = dict(oracle=crowd, search_oracle=crowd, verify_oracle=crowd, capacity=toy_capacity(CAP), workers=1,
              objective=Objective(max_ttft_s=2.0), verify=False)
    # window 0, as deployed: GPU 0 holds 30 cold adapters (0.1 req/s each, 3 req/s: TTFT 1.5 s), GPU 1 four hot
    # ones (2 req/s each, 8 req/s: TTFT 0.2 s)
    ids = [f"cold{i:02d}" for i in range(30)] + [f"hot{i}" for i in range(4)]
    rates = [0.1] * 30 + [2.0] * 4
    first = run_place(instance(rates, ids=ids), LLAMA, **kw)
    assert not first.infeasible
    doc = first.to_dict()
    template = doc["gpus"][0]
    doc["gpus"] = []
    for members, q in ((ids[:30], 0.1), (ids[30:], 2.0)):
        gpu = {**template, "adapters": members, "weights": [1.0] * len(members), "max_loras": len(members),
               "max_cpu_loras": len(members)}
        gpu.update(ranks=[8] * len(members), rates_rps=[q] * len(members))
        doc["gpus"].append(gpu)
    d0 = tmp_path / "w0"
    d0.mkdir()
    (d0 / "plan.json").write_text(json.dumps(doc))
    cold_gpu, hot_gpu = 0, 1
    # window 1: a newcomer at 0.5 req/s -- the cold GPU is less loaded (3 req/s) but its TTFT would be 1.55 s of
    # 2 s; the hot GPU's 0.25 s
    plan = run_place(instance([*rates, 0.5], ids=[*ids, "fresh"]), LLAMA, previous=d0, **kw)
    assert not plan.infeasible and plan.replan["moves"]["total"] == 1
    assert _placed(plan)["fresh"] == [hot_gpu] != [cold_gpu]


class _SlotOracle:
    """The toy oracle's verdicts on rates, and a GPU with more adapters than ``--max-loras`` slots fails."""

    name = "slots"
    cheap = True

    def __init__(self, cap_rps: float) -> None:
        from placement_helpers import ToyOracle

        self.toy = ToyOracle(cap_rps)

    def predict(self, cands):
        from dataclasses import replace as dc_replace

        return [p if c.n_adapters <= c.max_loras else dc_replace(p, starved=1.0)
                for c, p in zip(cands, self.toy.predict(cands), strict=True)]


def test_optional_moves_restart_a_host_when_no_gpu_empties_onto_the_others_as_they_run(tmp_path) -> None:
    """Step 4's second try: two GPUs of 5 adapters on 5 slots each; the rates halve, one GPU would do, but
    neither takes the other's adapters on its 5 slots. Letting the host restart with 10 slots saves the GPU."""
    from placement_helpers import toy_capacity

    slot = _SlotOracle(CAP)
    kw = dict(oracle=slot, search_oracle=slot, verify_oracle=slot, capacity=toy_capacity(CAP), workers=1,
              verify=False)
    ids = [f"a{i:03d}" for i in range(10)]
    first = run_place(instance([1.0] * 10, ids=ids), LLAMA, **kw)
    assert not first.infeasible
    doc = first.to_dict()
    template = doc["gpus"][0]
    doc["gpus"] = [{**template, "adapters": m, "weights": [1.0] * 5, "ranks": [8] * 5, "rates_rps": [1.0] * 5,
                    "max_loras": 5, "max_cpu_loras": 5} for m in (ids[:5], ids[5:])]
    d0 = tmp_path / "w0"
    d0.mkdir()
    (d0 / "plan.json").write_text(json.dumps(doc))
    plan = run_place(instance([0.5] * 10, ids=ids), LLAMA, previous=d0, **kw)
    r = plan.replan
    assert not plan.infeasible and plan.gpus_used == 1 and r["from_scratch"]["gpus"] == 1
    assert r["moves"]["optional"] == 10 and len(r["restarts"]) == 1
    kept = next(g for g in plan.gpus if g.adapters)
    assert sorted(kept.adapters) == ids and kept.server.max_loras >= 10
    capped = run_place(instance([0.5] * 10, ids=ids), LLAMA, previous=d0, max_moves=9, **kw)
    assert capped.gpus_used == 2 and capped.replan["moves"]["total"] == 0  # 10 optional moves do not fit in 9



def test_optional_moves_repack_a_few_gpus_when_none_empties_alone(tmp_path) -> None:
    """Step 4's repack (the toy's capacity is 10 req/s): GPU 0 runs a (rank 16, 2.1 req/s) and b (rank 8, 3.4),
    GPU 1 c (rank 8, 6.0) with --max-lora-rank 8, GPU 2 d (rank 16, 4.7). Two GPUs hold the 16.2 req/s, as the
    from-scratch plan shows, but none empties onto the others as they run: d fits only beside a and b (10.2),
    c beside nothing, and a (rank 16) only on GPU 2, full once b went there. Placing the three GPUs' adapters
    again saves one; under a cap too small for its moves the plan keeps three."""
    from placement_helpers import toy_capacity

    kw = dict(toy_kwargs(CAP), capacity=toy_capacity(CAP), workers=1, verify=False)
    ids, ranks, rates = ["a", "b", "c", "d"], [16, 8, 8, 16], [2.1, 3.4, 6.0, 4.7]
    first = run_place(instance(rates, ranks=ranks, ids=ids), LLAMA, **kw)
    assert not first.infeasible
    doc = first.to_dict()
    template = doc["gpus"][0]
    doc["gpus"] = [{**template, "adapters": [ids[i] for i in m], "weights": [1.0] * len(m),
                    "ranks": [ranks[i] for i in m], "rates_rps": [rates[i] for i in m], "max_loras": len(m),
                    "max_cpu_loras": len(m), "max_lora_rank": max(ranks[i] for i in m)}
                   for m in ([0, 1], [2], [3])]
    d0 = tmp_path / "w0"
    d0.mkdir()
    (d0 / "plan.json").write_text(json.dumps(doc))
    plan = run_place(instance(rates, ranks=ranks, ids=ids), LLAMA, previous=d0, **kw)
    r = plan.replan
    assert not plan.infeasible and r["from_scratch"]["gpus"] == 2 and plan.gpus_used == 2
    assert sorted(a for g in plan.gpus for a in g.adapters) == ids
    assert all(sum(g.rates_rps) <= CAP for g in plan.gpus)
    moved = r["moves"]["optional"]
    assert 0 < moved <= 4 and r["moves"]["total"] == moved
    capped = run_place(instance(rates, ranks=ranks, ids=ids), LLAMA, previous=d0, max_moves=moved - 1, **kw)
    assert capped.gpus_used == 3 and capped.replan["moves"]["total"] == 0


class _BorderOracle:
    """The toy oracle's verdicts on rates, and a starvation probability of 0.4 (a pass, near the TEST's 0.5) for
    a GPU of three adapters or more: the learned oracle's border, where the twin may disagree."""

    name = "border"
    cheap = True

    def __init__(self, cap_rps: float) -> None:
        from placement_helpers import ToyOracle

        self.toy = ToyOracle(cap_rps)

    def predict(self, cands):
        from dataclasses import replace as dc_replace

        return [p if p.starved >= 0.5 or c.n_adapters < 3 else dc_replace(p, starved=0.4)
                for c, p in zip(cands, self.toy.predict(cands), strict=True)]


def test_newcomers_keep_away_from_a_gpu_near_its_starvation_border(tmp_path) -> None:
    """Step 3 by margin, starvation too (``Objective.margin_use``): of two GPUs that pass with a newcomer, the one the
    oracle passes near its starvation border does not get it, though it carries less load (docs/replan.md: the
    twin's verification failed such GPUs and repair opened new ones)."""
    from placement_helpers import toy_capacity

    border = _BorderOracle(CAP)
    kw = dict(oracle=border, search_oracle=border, verify_oracle=border, capacity=toy_capacity(CAP), workers=1,
              verify=False)
    ids, rates = ["c0", "c1", "c2", "hot"], [0.1, 0.1, 0.1, 9.8]  # 10.1 req/s: two GPUs
    first = run_place(instance(rates, ids=ids), LLAMA, **kw)
    assert not first.infeasible
    doc = first.to_dict()
    template = doc["gpus"][0]
    doc["gpus"] = [{**template, "adapters": m, "weights": [1.0] * len(m), "ranks": [8] * len(m),
                    "rates_rps": [rates[ids.index(a)] for a in m], "max_loras": len(m), "max_cpu_loras": len(m)}
                   for m in (ids[:3], ids[3:])]
    d0 = tmp_path / "w0"
    d0.mkdir()
    (d0 / "plan.json").write_text(json.dumps(doc))
    plan = run_place(instance([*rates, 0.1], ids=[*ids, "fresh"]), LLAMA, previous=d0, **kw)
    assert not plan.infeasible and plan.replan["moves"]["total"] == 1
    assert _placed(plan)["fresh"] == [1]  # beside the hot adapter (9.8 req/s), not the three cold ones (0.3)


def _previous_plan(tmp: Path, gpus: list[list[tuple[str, float]]]) -> Path:
    """A plan.json of these GPUs ((adapter, planned rate) lists, rank 8, every adapter resident)."""
    from lorapack.placement import GpuPlan

    plan = Plan("proposed", LLAMA.model, LLAMA.gpu, [
        GpuPlan(adapters=[a for a, _ in g], weights=[1.0] * len(g), ranks=[8] * len(g),
                rates_rps=[r for _, r in g], server=ServerConfig(max_loras=len(g), max_lora_rank=8)) for g in gpus])
    d = tmp / "previous"
    write_outputs(plan, d)
    return d


def test_a_failed_verification_is_answered_by_the_fewest_moves_onto_running_gpus(tmp_path, monkeypatch) -> None:
    """Two GPUs the method's oracle passes and the twin fails (9.5 req/s against 9): repair alone cuts an adapter
    off each and, the pair fitting on no single running GPU, opens a fifth GPU; the balance instead moves adapters
    onto the two light GPUs (``verification`` moves, within the from-scratch plan's heaviest GPU), and the four
    GPUs pass."""
    import lorapack.replan.replan as rp
    from placement_helpers import ToyOracle

    gpus = [[(f"a{i:03d}", 1.9) for i in range(0, 5)], [(f"a{i:03d}", 1.9) for i in range(5, 10)],
            [(f"a{i:03d}", 2.0) for i in range(10, 13)], [("a013", 2.0), ("a014", 2.0), ("a015", 2.2)]]
    d0 = _previous_plan(tmp_path, gpus)
    ids = [a for g in gpus for a, _ in g]
    rates = [r for g in gpus for _, r in g]
    strict = ToyOracle(9.0)
    kw = {**toy_kwargs(CAP), "verify_oracle": strict, "search_oracle": strict}
    plan = run_place(instance(rates, ids=ids), LLAMA, previous=d0, verify=True, **kw)
    assert not plan.infeasible, plan.reason
    r = plan.replan
    assert r["verification_balance"] == "balanced" and plan.verification["passed"]
    assert plan.gpus_used == 4
    assert r["moves"]["total"] == r["moves"]["verification"] <= 6
    assert {0, 1} <= {c["gpu"] for c in r["changes"] if c["op"] == "unload"}
    scratch_max = max(sum(g.rates_rps) for g in run_place(instance(rates, ids=ids), LLAMA, verify=True, **kw).gpus)
    assert all(x <= scratch_max + 1e-9 for x in _gpu_rates(plan))

    monkeypatch.setattr(rp.Caps, "of", classmethod(lambda cls, scratch: None))  # repair alone
    alone = run_place(instance(rates, ids=ids), LLAMA, previous=d0, verify=True, **kw)
    assert alone.gpus_used == 5 and "verification_balance" not in alone.replan


def test_the_twin_confirms_a_hot_adapter_the_learned_model_fails_alone(tmp_path) -> None:
    """A learned model that fails an adapter alone on an empty GPU (9 req/s against its 8) is checked by the twin
    (10) before the re-plan gives up, as the from-scratch greedy does (``greedy_fill``'s ``confirm``): the
    re-plan opens a GPU for it, where it declared the window infeasible (the drift study's 64 adapters x30,
    window 4, 2026-11-29: an adapter of 27 req/s)."""
    from placement_helpers import ToyOracle

    class Learned(ToyOracle):
        learned = True

    model, twin = Learned(8.0), ToyOracle(10.0)
    kw = {**toy_kwargs(10.0), "oracle": model, "search_oracle": twin, "verify_oracle": twin}
    d0 = _previous_plan(tmp_path, [[("hot", 5.0), ("c", 1.0)], [("x", 1.0)]])
    plan = run_place(instance([9.0, 1.0, 1.0], ids=["hot", "c", "x"]), LLAMA, previous=d0, verify=False, **kw)
    assert not plan.infeasible, plan.reason
    assert sorted(sorted(g.adapters) for g in plan.gpus if g.adapters) == [["c", "x"], ["hot"]]
