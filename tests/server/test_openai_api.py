"""A real `mlxq serve` process on loopback, driven by the openai SDK and httpx."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from mlxq.golden.cases import CASES
from mlxq.golden.oracle import oracle_tokens


@pytest.fixture(scope="module")
def client(llama_server):
    return openai.OpenAI(base_url=f"{llama_server.url}/v1", api_key="unused", max_retries=0)


def test_models_lists_what_is_served(llama_server):
    body = httpx.get(f"{llama_server.url}/v1/models").json()
    assert body["object"] == "list"
    assert body["data"][0]["id"] == "mlxq-tiny-llama"
    assert "random weights" in body["data"][0]["description"]


def test_sdk_streams_a_chat_completion(client):
    stream = client.chat.completions.create(
        model="x", messages=[{"role": "user", "content": "Hello"}], max_tokens=12, stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].usage.completion_tokens == 12
    usage = chunks[-1].usage
    # Earlier requests on this shared server leave the chat template's prefix in the prompt cache.
    assert 0 <= usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens
    assert content  # some text arrived
    # Streamed and non-streamed greedy outputs are the same text.
    whole = client.chat.completions.create(model="x", messages=[{"role": "user", "content": "Hello"}], max_tokens=12)
    assert whole.choices[0].message.content == content
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 12


def test_greedy_completion_equals_mlx_lm_text(client, load_tiny):
    model, tokenizer = load_tiny("llama")
    case = CASES[1]
    prompt_ids = tokenizer.encode(case.prompt)
    expected = tokenizer.decode(oracle_tokens(model, tokenizer, prompt_ids, case))
    got = client.completions.create(model="x", prompt=prompt_ids, max_tokens=case.max_tokens)
    assert got.choices[0].text == expected


def test_seeded_sampling_equals_mlx_lm_and_repeats(client, load_tiny):
    model, tokenizer = load_tiny("llama")
    case = CASES[4]  # seeded, with every logits processor
    prompt_ids = tokenizer.encode(case.prompt)
    expected = tokenizer.decode(oracle_tokens(model, tokenizer, prompt_ids, case))
    s = dict(case.sampling)
    extra = {k: s.pop(k) for k in ("top_k", "min_p", "repetition_penalty")}
    bias = {str(k): v for k, v in s.pop("logit_bias").items()}
    texts = [
        client.completions.create(model="x", prompt=prompt_ids, max_tokens=case.max_tokens, logit_bias=bias,
                                  extra_body=extra, **s).choices[0].text
        for _ in range(2)
    ]
    assert texts == [expected, expected]


def test_stop_string_is_honoured_and_cut(client):
    full = client.completions.create(model="x", prompt="Once upon a time", max_tokens=24).choices[0].text
    stop = full[8:11]
    assert stop.strip(), "need a non-blank stop string from the output"
    got = client.completions.create(model="x", prompt="Once upon a time", max_tokens=24, stop=[stop])
    assert got.choices[0].finish_reason == "stop"
    assert got.choices[0].text == full[: full.index(stop)]
    streamed = client.completions.create(model="x", prompt="Once upon a time", max_tokens=24, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == full[: full.index(stop)]


def test_chat_logprobs_are_well_formed(client):
    got = client.chat.completions.create(
        model="x", messages=[{"role": "user", "content": "Hi"}], max_tokens=5, logprobs=True, top_logprobs=3
    )
    entries = got.choices[0].logprobs.content
    assert len(entries) == 5
    for entry in entries:
        assert entry.logprob <= 0
        assert len(entry.top_logprobs) == 3
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        # Greedy: the chosen token is the most likely one.
        assert entry.logprob == pytest.approx(values[0])


def test_completion_logprobs_legacy_shape(llama_server):
    body = httpx.post(f"{llama_server.url}/v1/completions",
                      json={"prompt": "abc", "max_tokens": 4, "logprobs": 2}).json()
    lp = body["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 4
    assert all(len(t) <= 2 for t in lp["top_logprobs"])
    assert "".join(lp["tokens"]) == body["choices"][0]["text"]


def test_chat_with_tools_renders_through_the_template(client):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    got = client.chat.completions.create(
        model="x", messages=[{"role": "user", "content": "Weather?"}], tools=tools, max_tokens=4
    )
    plain = client.chat.completions.create(model="x", messages=[{"role": "user", "content": "Weather?"}], max_tokens=4)
    # The tool definitions are part of the prompt.
    assert got.usage.prompt_tokens > plain.usage.prompt_tokens


def test_tool_round_trip_is_accepted(client):
    """The turn after a tool call, as the SDK sends it: the assistant's call, then the tool's result."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    got = client.chat.completions.create(model="x", messages=messages, tools=tools, max_tokens=3)
    assert got.usage.completion_tokens == 3
    first_turn = client.chat.completions.create(model="x", messages=messages[:1], tools=tools, max_tokens=3)
    assert got.usage.prompt_tokens > first_turn.usage.prompt_tokens  # the call and its result are in the prompt


def test_n_greedy_choices_equal_one_request(client):
    messages = [{"role": "user", "content": "Count with me"}]
    one = client.chat.completions.create(model="x", messages=messages, max_tokens=8)
    three = client.chat.completions.create(model="x", messages=messages, max_tokens=8, n=3)
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert {c.message.content for c in three.choices} == {one.choices[0].message.content}
    assert three.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counts once
    assert three.usage.completion_tokens == 3 * one.usage.completion_tokens


def test_n_choices_prefill_their_prompt_once(llama_server):
    def shared():
        return httpx.get(f"{llama_server.url}/stats").json()["batch"]["shared_prefills"]

    before = shared()
    prompt = [7 + (i * 37) % 500 for i in range(200)]  # long enough to share (scheduler.MIN_SHARED_PREFILL)
    body = httpx.post(f"{llama_server.url}/v1/completions", json={"prompt": prompt, "max_tokens": 3, "n": 3},
                      timeout=60).json()
    assert len(body["choices"]) == 3 and body["usage"]["prompt_tokens"] == 200
    assert shared() == before + 2  # choices 1 and 2 took choice 0's prefill from the prompt cache


def test_n_seeded_choices_are_single_requests_with_seed_plus_index(client):
    """Choice i samples as a lone request with seed + i would: the rows decode batched, each equal to
    its solo run; streamed, each index assembles the same text."""
    args = dict(model="x", prompt="Once upon a time", max_tokens=10, temperature=0.9, seed=5)
    singles = [client.completions.create(**{**args, "seed": 5 + i}).choices[0].text for i in range(3)]
    assert len(set(singles)) > 1  # the seeds give different samples: the test can tell choices apart
    together = client.completions.create(**args, n=3)
    assert [c.text for c in together.choices] == singles
    texts, finishes, usage = {}, {}, None
    for chunk in client.completions.create(**args, n=3, stream=True, stream_options={"include_usage": True}):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
        usage = chunk.usage or usage
    assert [texts[i] for i in range(3)] == singles
    assert finishes == {c.index: c.finish_reason for c in together.choices}
    assert usage.completion_tokens == together.usage.completion_tokens


def test_stats_report_engine_model_and_blas(llama_server):
    stats = httpx.get(f"{llama_server.url}/stats").json()
    assert stats["engine"]["alive"] is True
    assert stats["batch"]["mode"] == "batch" and stats["batch"]["configured"] == 8
    assert stats["engine"]["lanes"]["continuous"] > 0
    assert stats["model"]["context_length"] == 4096
    assert stats["runtime"]["blas"]["name"] in {"mkl", "openblas", "custom", "bundled-reference", "not-applicable"}
    assert stats["memory"]["mlx_active_bytes"] > 0


def test_sse_wire_format(llama_server):
    with httpx.stream("POST", f"{llama_server.url}/v1/chat/completions",
                      json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    first = json.loads(lines[0][len("data: "):])
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"]["role"] == "assistant"
