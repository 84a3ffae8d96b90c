"""What a real vLLM (the testbed's 0.32 CPU build) refuses, and what the twin refuses: over-long requests,
``--max-lora-rank``, unknown adapters, the KV capacity rule (docs/testbed.md, "Rules").

Where vLLM 0.32 and the twin (the 0.8.5 rules) differ, the test pins both behaviours and the exact difference,
so that the version rule that closes it (the testbed issue's deliverable 3) has a test waiting for it.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from lorapack.errors import LorapackError, ProfileError, SpecError
from lorapack.profile import VLLM_LORA_RANKS, find_profile
from lorapack.server import ServerConfig, rules_for_version
from lorapack.testbed.env import VLLM_VERSION
from lorapack.testbed.replay import Arrival, twin_replay
from lorapack.testbed.server import start_server

pytestmark = pytest.mark.real

THREE = ("r8-0", "r16-0", "r32-0")
MML = 256
LIMIT_FLAGS = ["--max-loras", "2", "--max-lora-rank", "32", "--max-num-seqs", "8", "--max-num-batched-tokens",
               "256", "--max-model-len", str(MML)]
# (prompt tokens, max_tokens) around --max-model-len 256
LENGTH_CASES = [(16, 16), (200, 56), (200, 57), (200, 100), (255, 10), (256, 1), (300, 1), (1, 256), (1, 257),
                (128, 200)]


def served_tokens_032(prompt: int, output: int, mml: int) -> int | None:
    """vLLM 0.32's OpenAI server, read off the testbed: a prompt of ``mml`` tokens or more, or a ``max_tokens``
    above ``mml``, is refused (400); otherwise the output is cut to ``mml - prompt`` tokens. None = refused."""
    if prompt >= mml or output > mml:
        return None
    return min(output, mml - prompt)


def test_over_long_requests_status_and_served_tokens(servers):
    server = servers.get(THREE, LIMIT_FLAGS)
    for prompt, output in LENGTH_CASES:
        status, body = server.post("/v1/completions", {"model": "r8-0", "prompt": [5] * prompt,
                                                       "max_tokens": output, "ignore_eos": True})
        expected = served_tokens_032(prompt, output, MML)
        if expected is None:
            assert status == 400, (prompt, output, status, body)
            message = body["error"]["message"]
            assert ("maximum context length" in message or "max_tokens" in message), message
        else:
            assert status == 200, (prompt, output, status, body)
            assert body["usage"]["completion_tokens"] == expected, (prompt, output, body["usage"])


def _twin_lengths(version: str) -> tuple[set, dict]:
    """The twin under ``version``'s rules on LENGTH_CASES: (refused cases, {served case: tokens it serves})."""
    llama = find_profile("llama-3.1-8b-instruct")
    arrivals = [Arrival(0.5 * i, "a", p, o) for i, (p, o) in enumerate(LENGTH_CASES)]
    flags = ServerConfig(max_loras=1, max_model_len=MML, vllm_version=version)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, engine = twin_replay(llama, ["a"], [8], arrivals, flags, 120.0)
    refused = {c for c, t in zip(LENGTH_CASES, engine.t_sent_s, strict=True) if np.isnan(t)}
    return refused, engine


def test_the_twin_under_032_rules_refuses_and_cuts_what_the_server_does():
    """With the testbed's version (``clamp_output`` rule) the twin refuses exactly the requests vLLM 0.32
    refuses (``served_tokens_032``, pinned against the server by the test above) and serves the others; under
    0.8.5's rule (``refuse_sum``) it also refuses exactly those 0.32 serves cut short. (No server needed.)"""
    refused_032 = {c for c in LENGTH_CASES if served_tokens_032(*c, MML) is None}
    twin_032, engine = _twin_lengths(VLLM_VERSION)
    assert twin_032 == refused_032
    assert all(np.isfinite(engine.t_finish_s[i]) for i, c in enumerate(LENGTH_CASES) if c not in refused_032)
    twin_085, _ = _twin_lengths("0.8.5")
    assert refused_032 <= twin_085
    assert twin_085 - refused_032 == {(p, o) for p, o in LENGTH_CASES if p < MML and o <= MML and p + o > MML}


def test_unknown_adapter_and_runtime_loading_disabled(servers):
    server = servers.get(THREE, LIMIT_FLAGS)
    status, body = server.post("/v1/completions", {"model": "nope", "prompt": [5, 6], "max_tokens": 2})
    assert status == 404 and body["error"]["message"].startswith("The model `nope` does not exist")
    # runtime adapter updates are off unless VLLM_ALLOW_RUNTIME_LORA_UPDATING is set: the route does not exist
    status, _ = server.post("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/nonexistent"})
    assert status == 404


def test_adapter_above_max_lora_rank_stops_the_server_at_startup(testbed, tmp_path):
    """vLLM loads every ``--lora-modules`` adapter at start-up: one of rank 64 with ``--max-lora-rank 32`` makes
    the server exit before it is healthy; the twin refuses the same configuration."""
    with pytest.raises(LorapackError) as err:
        start_server(testbed, ["r8-0", "r64-0"], LIMIT_FLAGS, tmp_path, timeout_s=300)
    assert "LoRA rank 64 is greater than max_lora_rank 32" in str(err.value)
    with pytest.raises((SpecError, ProfileError)):
        twin_replay(find_profile("llama-3.1-8b-instruct"), ["r8-0", "r64-0"], [8, 64],
                    [Arrival(0.0, "r8-0", 8, 8)], ServerConfig(max_loras=2, max_lora_rank=32), 10.0)


def test_max_lora_rank_choices(testbed, tmp_path):
    """``--max-lora-rank 24`` is an argparse error naming vLLM's choices: those of the twin's 0.32 rule set (which
    adds 1 to 0.8.5's list; docs/testbed.md)."""
    with pytest.raises(LorapackError) as err:
        start_server(testbed, ["r8-0"], ["--max-lora-rank", "24", "--max-model-len", "256"], tmp_path, timeout_s=120)
    text = str(err.value)
    assert "invalid choice: 24" in text
    choices = [int(x) for x in text.split("(choose from ", 1)[1].split(")", 1)[0].split(",")]
    assert choices == list(rules_for_version(VLLM_VERSION).lora_ranks)
    assert choices == [1, *VLLM_LORA_RANKS]  # 0.8.5's list, plus 1


def _cache_config(server) -> dict[str, str]:
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(server.metrics()):
        for s in family.samples:
            if s.name == "vllm:cache_config_info":
                return dict(s.labels)
    raise AssertionError("no vllm:cache_config_info")


# bytes of KV per token of the tiny model: K and V x 2 layers x 2 KV heads x head size 32 x 2 bytes (bf16)
TINY_KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 32 * 2
KV_SPACE_BYTES = 1 << 30  # VLLM_CPU_KVCACHE_SPACE=1


def test_kv_capacity_is_the_cpu_formula_and_independent_of_the_lora_flags(servers):
    expected_tokens = KV_SPACE_BYTES // TINY_KV_BYTES_PER_TOKEN
    assert expected_tokens == 2_097_152
    seen = []
    for flags in (LIMIT_FLAGS, ["--max-loras", "1", "--max-lora-rank", "8", "--max-model-len", "512"]):
        info = _cache_config(servers.get(("r8-0",), flags))
        assert int(info["kv_cache_size_tokens"]) == expected_tokens
        assert int(info["num_gpu_blocks"]) * int(info["block_size"]) == expected_tokens
        seen.append((info["block_size"], info["enable_prefix_caching"], info["gpu_memory_utilization"]))
    # the CPU backend's block, prefix caching on by default, the 0.22+ default memory fraction
    assert seen[0] == seen[1] == ("128", "True", "0.92")


@pytest.mark.parametrize("max_model_len, starts", [(2_097_024, True), (2_097_025, False)])
def test_a_max_model_len_above_the_kv_cache_is_refused(testbed, tmp_path, max_model_len, starts):
    """vLLM starts only when one sequence of ``--max-model-len`` tokens fits in the KV cache *minus one block*
    (V1's block pool keeps block 0 as its null block): 16,384 blocks of 128 tokens hold 2,097,152 tokens, the
    largest length that starts is 16,383 x 128 = 2,097,024. (The tiny model has 131,072 positions;
    ``VLLM_ALLOW_LONG_MAX_MODEL_LEN`` lets a longer ``--max-model-len`` reach the KV check.)"""
    flags = ["--max-loras", "1", "--max-lora-rank", "8", "--max-model-len", str(max_model_len)]
    env = {"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}
    if starts:
        server = start_server(testbed, ["r8-0"], flags, tmp_path, timeout_s=300, env=env)
        server.stop()
        return
    with pytest.raises(LorapackError) as err:
        start_server(testbed, ["r8-0"], flags, tmp_path, timeout_s=300, env=env)
    assert "larger than the available KV cache memory" in str(err.value)
    assert "estimated maximum model length is 2097024" in str(err.value)
