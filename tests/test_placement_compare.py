"""Plans a user can compare (issue 26 item 4): what ``--gpus`` means for each kind of method, the worst GPU's
wait reported next to the GPU count, and a verified plan's slack spread over its GPUs."""

from __future__ import annotations

import math

import numpy as np

from lorapack.objective import Objective
from lorapack.oracle import GpuCandidate, Prediction
from lorapack.placement import plan_from_dict
from placement_helpers import LLAMA, ToyOracle, instance, run_place, toy_capacity

THR = Objective.throughput()


class QueueingToy(ToyOracle):
    """``ToyOracle`` whose mean TTFT grows steeply with the GPU's load (a queue builds near capacity), p99 ten
    times the mean."""

    seeds = (0,)  # as a verifier reports them (plan.verification["seeds"])

    def predict(self, cands: list[GpuCandidate]) -> list[Prediction]:
        out = []
        for c, p in zip(cands, super().predict(cands), strict=True):
            load = float(c.rates_rps.sum()) / self.cap_rps
            ttft_s = 0.1 + 5.0 * load ** 6 if p.fits else math.nan
            out.append(Prediction(fits=p.fits, throughput_tok_s=p.throughput_tok_s, incoming_tok_s=p.incoming_tok_s,
                                  starved=p.starved, itl_ms=p.itl_ms, ttft_s=ttft_s, ttft_p99_s=10.0 * ttft_s))
        return out


def _place(inst, verify_cap_rps: float = 10.0, **kw):
    toy, strict = QueueingToy(10.0), QueueingToy(verify_cap_rps)
    return run_place(inst, LLAMA, "proposed", objective=THR, oracle=toy, search_oracle=strict, verify_oracle=strict,
                     capacity=toy_capacity(10.0), workers=1, **kw)


def test_verified_slack_is_spread_over_the_same_gpus() -> None:
    # 12 adapters at 1.5 req/s = 18 req/s: the greedy (10 req/s per GPU) makes two GPUs of 9 req/s; the verifier
    # (8.5 req/s) fails both, repair keeps 5 adapters on each and opens a third GPU for the 2 x 1 left: 7.5,
    # 7.5 and 3 req/s -- the first two wait long, the third hardly at all
    inst = instance(np.full(12, 1.5))
    plan = _place(inst, verify_cap_rps=8.5)
    assert plan.verification["gpus_added"] == 1
    spread = plan.verification["spread"]
    assert plan.gpus_used == 3 and spread["accepted"], spread
    assert spread["worst_ttft_s_after"] <= 0.8 * spread["worst_ttft_s_before"]
    assert sorted(len(g.adapters) for g in plan.gpus) == [4, 4, 4]
    worst = plan.worst_gpu
    assert worst["verified"] and worst["ttft_s"] == max(g.verified.ttft_s for g in plan.gpus)
    assert worst["ttft_s"] == spread["worst_ttft_s_after"] and worst["ttft_p99_s"] == 10.0 * worst["ttft_s"]
    # plan.json carries it; a plan read back recomputes it
    d = plan.to_dict()
    assert d["worst_gpu"] == worst and plan_from_dict(d).worst_gpu == worst


def test_a_balanced_plan_is_left_as_it_is() -> None:
    plan = _place(instance(np.full(8, 1.0)))  # 8 req/s: one GPU, nothing to spread
    assert plan.gpus_used == 1 and "spread" not in plan.verification


def test_the_pool_means_a_cap_or_a_size() -> None:
    from typer.testing import CliRunner

    from lorapack.cli import app

    inst = instance(np.full(4, 0.5))
    for method, role in (("proposed", "cap"), ("dlora", "size")):
        plan = run_place(inst, LLAMA, method, gpus=3, objective=THR, verify=False, oracle=ToyOracle(10.0),
                         search_oracle=ToyOracle(10.0), capacity=toy_capacity(10.0), workers=1)
        assert plan.settings["pool"] == 3 and plan.settings["pool_role"] == role
        assert plan.gpus_used == (1 if role == "cap" else 3)
    out = CliRunner().invoke(app, ["place", "--help"], env={"COLUMNS": "200"}).stdout
    text = " ".join(out.replace("│", " ").split())
    assert "a cap for the greedy methods (proposed, proposed-fast, proposed-exact" in text
    assert "the pool size for the others (they place onto exactly G GPUs)" in text


def test_the_table_names_the_worst_gpu(capsys) -> None:
    from lorapack.cli.place import _render

    plan = _place(instance(np.full(12, 1.5)), verify_cap_rps=8.5)
    _render(plan, [])
    out = " ".join(capsys.readouterr().out.split())
    worst = plan.worst_gpu
    assert (f"worst GPU {worst['gpu']}: mean TTFT {worst['ttft_s']:.2f} s, p99 {worst['ttft_p99_s']:.2f} s "
            f"(verified)") in out
    assert "spread over the same GPUs (balanced arrangement" in out
