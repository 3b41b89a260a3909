"""The RAM prompt cache through real servers: shared prefixes hit, outputs do not change."""

from __future__ import annotations

import httpx
import pytest

from mlxq.golden.cases import LONG
from tests.conftest import ServerProcess

SYSTEM = LONG + " " + LONG  # a long shared system prompt, as agents send


def chat(url: str, question: str, **extra) -> dict:
    body = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
            "max_tokens": 16} | extra
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def reference(tiny_model_dirs):
    with ServerProcess("--model", str(tiny_model_dirs["llama"]), "--prompt-cache", "0") as server:
        yield server


@pytest.mark.parametrize("batch", ["8", "1"])
def test_shared_prefix_hits_and_outputs_equal_an_uncached_server(tiny_model_dirs, reference, batch):
    questions = ["What is the cache?", "Who wrote this?", "Why is the sky blue?"]
    with ServerProcess("--model", str(tiny_model_dirs["llama"]), "--batch", batch) as server:
        fresh = httpx.get(server.url + "/stats").json()["prompt_cache"]
        assert fresh["enabled"] and fresh["entries"] == 0 and fresh["queries"] == 0  # an empty cache still reports
        results = [chat(server.url, q) for q in questions]
        multi_turn = chat(server.url, questions[0])  # the same prompt again: all but one token cached
        stats = httpx.get(server.url + "/stats").json()["prompt_cache"]
    expected = [chat(reference.url, q) for q in questions]
    for got, want in zip(results, expected, strict=True):
        assert got["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
    cached = [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in results]
    prompt = results[0]["usage"]["prompt_tokens"]
    assert cached[0] == 0
    assert all(c > prompt * 0.8 for c in cached[1:]), cached  # the system prompt came from the cache
    assert multi_turn["usage"]["prompt_tokens_details"]["cached_tokens"] == prompt - 1
    assert multi_turn["choices"][0]["message"]["content"] == results[0]["choices"][0]["message"]["content"]
    assert stats["enabled"] and stats["hits"] == 3 and stats["entries"] >= 1
    assert 0 < stats["bytes"] <= stats["max_bytes"]


@pytest.mark.parametrize("batch", ["8", "1"])
def test_requests_with_penalties_take_from_the_cache_and_see_the_whole_prompt(tiny_model_dirs, reference, batch):
    # Strong penalties over the whole context: what the processors see of the prompt decides the tokens.
    penalties = {"repetition_penalty": 5.0, "repetition_context_size": 4096, "presence_penalty": 4.0,
                 "presence_context_size": 4096, "logit_bias": {"5": 3.0}, "max_tokens": 24}
    with ServerProcess("--model", str(tiny_model_dirs["llama"]), "--batch", batch) as server:
        chat(server.url, "first")
        penalized = chat(server.url, "second", **penalties)
    expected = chat(reference.url, "second", **penalties)
    assert penalized["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    # The processors saw the cached prefix too: same output as a server that prefilled it all.
    assert penalized["choices"][0]["message"]["content"] == expected["choices"][0]["message"]["content"]


def conversation(url: str) -> tuple[dict, dict]:
    """Two turns: the second sends the first turn's history back, as chat clients do."""
    first_messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is the cache?"}]
    first = httpx.post(url + "/v1/chat/completions", json={"messages": first_messages, "max_tokens": 12},
                       timeout=60).json()
    answer = first["choices"][0]["message"]["content"]
    second_messages = first_messages + [{"role": "assistant", "content": answer},
                                        {"role": "user", "content": "And the disk?"}]
    second = httpx.post(url + "/v1/chat/completions", json={"messages": second_messages, "max_tokens": 12},
                        timeout=60).json()
    return first, second


@pytest.mark.parametrize("arch", ["gemma3_text", pytest.param("qwen3_next", marks=pytest.mark.slow)])
@pytest.mark.parametrize("batch", ["8", pytest.param("1", marks=pytest.mark.slow)])  # ~10 s each on two cores
def test_next_turn_hits_a_boundary_snapshot_on_untrimmable_models(tiny_model_dirs, arch, batch):
    model = str(tiny_model_dirs[arch])
    with ServerProcess("--model", model, "--batch", batch) as server:
        first, second = conversation(server.url)
        stats = httpx.get(server.url + "/stats").json()["prompt_cache"]
    with ServerProcess("--model", model, "--prompt-cache", "0") as uncached:
        want_first, want_second = conversation(uncached.url)
    assert stats["enabled"] and stats["hits"] >= 1
    # The sliding window / recurrent state after the first prompt (all but its last token) was reused.
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= first["usage"]["prompt_tokens"] - 2
    assert first["choices"][0]["message"]["content"] == want_first["choices"][0]["message"]["content"]
    assert second["choices"][0]["message"]["content"] == want_second["choices"][0]["message"]["content"]


# One architecture per batch size in the test command, the other two in the slow set (~8 s each on two cores).
@pytest.mark.parametrize(("arch", "batch"), [("gemma3_text", "8"), ("qwen3_next", "1"),
                                             pytest.param("qwen3_next", "8", marks=pytest.mark.slow),
                                             pytest.param("gemma3_text", "1", marks=pytest.mark.slow)])
def test_agents_sharing_a_system_prompt_hit_its_snapshot_on_untrimmable_models(tiny_model_dirs, arch, batch):
    model = str(tiny_model_dirs[arch])
    questions = ["What is the cache?", "Who wrote this?", "Why is the sky blue?"]
    with ServerProcess("--model", model, "--batch", batch) as server:
        got = [chat(server.url, q) for q in questions]
    with ServerProcess("--model", model, "--prompt-cache", "0") as uncached:
        want = [chat(uncached.url, q) for q in questions]
    cached = [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in got]
    prompt = got[0]["usage"]["prompt_tokens"]
    assert cached[0] == 0
    assert all(c > prompt * 0.8 for c in cached[1:]), cached  # the system prompt's snapshot
    for g, w in zip(got, want, strict=True):
        assert g["choices"][0]["message"]["content"] == w["choices"][0]["message"]["content"]
