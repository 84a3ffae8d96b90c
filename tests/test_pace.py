"""The twin at a server's pace (``testbed.replay.pace_to_server``): a run whose steps are k times the profile's
is recognised as such, and ``time_scale`` stretches every time of a twin replay alike."""

from __future__ import annotations

import numpy as np
import pytest

from lorapack.profile import find_profile
from lorapack.server import ServerConfig
from lorapack.testbed.replay import Arrival, RequestRecord, pace_to_server, twin_itl_s, twin_replay
from lorapack.testbed.staircase import ADAPTERS, RANKS, design, server_flags

FLAGS = ServerConfig(**server_flags(2))


@pytest.fixture(scope="module")
def llama():
    return find_profile("llama-3.1-8b-instruct")


def _records(arrivals: list[Arrival], engine, sent: np.ndarray) -> list[RequestRecord]:
    """What a client would have recorded of a server that behaved as ``engine`` (per-request engine metrics)."""
    out = []
    for i, a in enumerate(arrivals):
        n = a.output_tokens
        first, finish = float(engine.t_first_s[i]), float(engine.t_finish_s[i])
        out.append(RequestRecord(i, a.adapter_id, a.prompt_tokens, n, a.t_s, t_sent_s=float(sent[i]),
                                 t_first_s=first, t_finish_s=finish, completion_tokens=n, status=200,
                                 queue_ms=0.0, engine_ttft_ms=(first - sent[i]) * 1e3,
                                 engine_itl_ms=(finish - first) / (n - 1) * 1e3))
    return out


def test_time_scale_stretches_a_replay(llama) -> None:
    arrivals = design("interleaved")
    _, base = twin_replay(llama, ADAPTERS, RANKS, arrivals, FLAGS, 120.0)
    slow_arrivals = [Arrival(a.t_s * 3, a.adapter_id, a.prompt_tokens, a.output_tokens) for a in arrivals]
    _, slow = twin_replay(llama, ADAPTERS, RANKS, slow_arrivals, FLAGS, 360.0, time_scale=3.0)
    np.testing.assert_allclose(slow.t_first_s, base.t_first_s * 3, rtol=1e-9)
    np.testing.assert_allclose(slow.t_finish_s, base.t_finish_s * 3, rtol=1e-9)
    with pytest.raises(ValueError, match="time_scale 0"):
        twin_replay(llama, ADAPTERS, RANKS, arrivals, FLAGS, 120.0, time_scale=0)


@pytest.mark.parametrize("k", [0.3, 1.0, 4.0, 25.0])
def test_pace_recovers_a_servers_step_factor(llama, k) -> None:
    """A 'server' that is the twin with every step k times longer: the pace found is k (within 3 %), and the
    twin at that pace orders first tokens exactly as that server did."""
    arrivals = design("bursts")
    sent = np.array([a.t_s for a in arrivals])
    _, server = twin_replay(llama, ADAPTERS, RANKS, arrivals, FLAGS, 600.0, time_scale=k)
    records = _records(arrivals, server, sent)
    scale, _, engine = pace_to_server(llama, ADAPTERS, RANKS, arrivals, FLAGS, 600.0, records)
    assert scale == pytest.approx(k, rel=0.03)
    assert twin_itl_s(engine, [a.output_tokens for a in arrivals]) == pytest.approx(
        twin_itl_s(server, [a.output_tokens for a in arrivals]), rel=0.03)
    assert np.array_equal(np.argsort(engine.t_first_s, kind="stable"), np.argsort(server.t_first_s, kind="stable"))


def test_a_replay_whose_server_queued_requests_late_is_run_again(llama, monkeypatch) -> None:
    """The CI failure of 2026-11-28: the engine first saw some staircase requests ~0.4 s after they were sent
    (out of send order). The engine's intervals, counted from the send, then place their first tokens 0.4 s
    early; ``outside_engine_s`` shows it, and ``run_staircase`` sends the design again."""
    from lorapack.testbed import staircase
    from lorapack.testbed.replay import ReplayResult

    arrivals = design("blocks")
    sent = np.array([a.t_s for a in arrivals])
    _, server = twin_replay(llama, ADAPTERS, RANKS, arrivals, ServerConfig(**server_flags(3)), 120.0)
    clean = _records(arrivals, server, sent)
    assert max(r.outside_engine_s for r in clean) < 1e-9
    held = _records(arrivals, server, sent)
    for r in held[3:10]:  # queued 0.4 s late: the engine's queue and TTFT intervals start then
        r.t_first_s += 0.4
        r.t_finish_s += 0.4
    assert [round(r.outside_engine_s, 6) for r in held[2:11]] == [0.0] + [0.4] * 7 + [0.0]
    results = iter([ReplayResult(held, [], 5.0), ReplayResult(clean, [], 5.0)])
    monkeypatch.setattr(staircase, "replay", lambda *a, **k: next(results))
    run = staircase.run_staircase("http://127.0.0.1:1", llama, "blocks", 3)
    assert run.attempts == 2 and run.max_outside_engine_s < 1e-9 and run.agreement == 1.0
    results = iter([ReplayResult(held, [], 5.0)] * 2)
    run = staircase.run_staircase("http://127.0.0.1:1", llama, "blocks", 3, attempts=2)
    assert run.attempts == 2 and run.max_outside_engine_s == pytest.approx(0.4)
    # none clean: the attempt nearest the design counts, not the last (a busy machine: 2026-11-30, most attempts
    # had some request 0.1-0.25 s outside the engine)
    def late_by(d: float):
        recs = _records(arrivals, server, sent)
        for r in recs[3:10]:
            r.t_first_s += d
            r.t_finish_s += d
        return ReplayResult(recs, [], 5.0)

    results = iter([late_by(0.3), late_by(0.15), late_by(0.6)])
    run = staircase.run_staircase("http://127.0.0.1:1", llama, "blocks", 3)
    assert (run.attempts, run.counted) == (3, 2) and run.max_outside_engine_s == pytest.approx(0.15)
