"""Bad input gets a clear OpenAI-style 4xx, and the server stays healthy after it."""

from __future__ import annotations

import time

import httpx
import pytest

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]

BAD_BODIES = [
    # (path, body, expected status, words the message must contain, param)
    (CHAT, {}, 400, "messages", "messages"),
    (CHAT, {"messages": []}, 400, "non-empty", "messages"),
    (CHAT, {"messages": "hello"}, 400, "messages", "messages"),
    (CHAT, {"messages": [{"content": "x"}]}, 400, "role", "messages"),
    (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "role", "messages"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "content", "messages"),
    (CHAT, {"messages": [{"role": "user"}]}, 400, "content", "messages"),
    (CHAT, {"messages": [{"role": "user", "content": "x", "name": 5}]}, 400, "name", "messages"),
    (CHAT, {"messages": [{"role": "assistant", "content": None, "tool_calls": "x"}]}, 400, "tool_calls must be a list",
     "messages"),
    (CHAT, {"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]}]}, 400,
     "tool_calls[0]", "messages"),
    (CHAT, {"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, 400, "assistant", "messages"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "images", "messages"),
    (CHAT, {"messages": MSG, "max_tokens": -1}, 400, "max_tokens", "max_tokens"),
    (CHAT, {"messages": MSG, "max_tokens": 0}, 400, "max_tokens", "max_tokens"),
    (CHAT, {"messages": MSG, "max_tokens": "ten"}, 400, "integer", "max_tokens"),
    (CHAT, {"messages": MSG, "max_tokens": 1.5}, 400, "integer", "max_tokens"),
    (CHAT, {"messages": MSG, "temperature": "hot"}, 400, "number", "temperature"),
    (CHAT, {"messages": MSG, "temperature": -1}, 400, "temperature", "temperature"),
    (CHAT, {"messages": MSG, "top_p": 2}, 400, "top_p", "top_p"),
    (CHAT, {"messages": MSG, "top_k": -3}, 400, "top_k", "top_k"),
    (CHAT, {"messages": MSG, "stream": "yes"}, 400, "boolean", "stream"),
    (CHAT, {"messages": MSG, "stop": 5}, 400, "stop", "stop"),
    (CHAT, {"messages": MSG, "stop": ["a", 1]}, 400, "stop", "stop"),
    (CHAT, {"messages": MSG, "seed": "abc"}, 400, "integer", "seed"),
    (CHAT, {"messages": MSG, "seed": -1}, 400, "seed", "seed"),
    (CHAT, {"messages": MSG, "logit_bias": {"abc": 1}}, 400, "token ids", "logit_bias"),
    (CHAT, {"messages": MSG, "logit_bias": {"99999999": 1}}, 400, "vocabulary", "logit_bias"),
    (CHAT, {"messages": MSG, "logit_bias": [1, 2]}, 400, "object", "logit_bias"),
    (CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 99}, 400, "top_logprobs", "top_logprobs"),
    (CHAT, {"messages": MSG, "n": 0}, 400, "'n' must be >= 1", "n"),
    (CHAT, {"messages": MSG, "n": 17}, 400, "'n' must be <= 16", "n"),
    (CHAT, {"messages": MSG, "n": "2"}, 400, "integer", "n"),
    (CHAT, {"messages": MSG, "response_format": "json"}, 400, "object", "response_format"),
    (CHAT, {"messages": MSG, "adapters": "lora"}, 400, "--adapter NAME=PATH", "adapters"),
    (CHAT, {"messages": MSG, "tools": "get_weather"}, 400, "tools", "tools"),
    (CHAT, {"messages": MSG, "tools": [{"type": "function"}]}, 400, "tools[0].function", "tools"),
    (CHAT, {"messages": MSG, "tools": [{"type": "function", "function": {"name": ""}}]}, 400, "name", "tools"),
    (CHAT, {"messages": MSG, "tools": [{"type": "retrieval", "function": {"name": "f"}}]}, 400, "'function'",
     "tools"),
    (CHAT, {"messages": MSG, "tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, 400,
     "JSON Schema", "tools"),
    (CHAT, {"messages": MSG, "stream_options": 3}, 400, "object", "stream_options"),
    (CHAT, [1, 2, 3], 400, "JSON object", None),
    (COMPLETIONS, {"prompt": ""}, 400, "empty", "prompt"),
    (COMPLETIONS, {"prompt": ["one", "two"]}, 400, "one request per prompt", "prompt"),
    (COMPLETIONS, {"prompt": [[1, 2], [3]]}, 400, "one request per prompt", "prompt"),
    (COMPLETIONS, {"prompt": "hi", "echo": True}, 400, "not supported yet", "echo"),
    (COMPLETIONS, {"prompt": "hi", "suffix": "end"}, 400, "not supported yet", "suffix"),
    (COMPLETIONS, {"prompt": "hi", "best_of": 3}, 400, "not supported yet", "best_of"),
    (COMPLETIONS, {"prompt": "hi", "echo": "yes"}, 400, "boolean", "echo"),
    (COMPLETIONS, {"prompt": 42}, 400, "prompt", "prompt"),
    (COMPLETIONS, {"prompt": [1, -5]}, 400, "token ids", "prompt"),
    (COMPLETIONS, {"prompt": [1] * 4096}, 400, "shorten the prompt", "messages"),
]


@pytest.mark.parametrize("path,body,status,words,param", BAD_BODIES)
def test_bad_body_gets_openai_error(llama_server, path, body, status, words, param):
    r = httpx.post(llama_server.url + path, json=body, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert words.lower() in error["message"].lower()
    assert error["param"] == param


@pytest.mark.parametrize("raw", [b"{bad json", b"", b"\xff\xfe", b"null", b'"text"'])
def test_malformed_bodies(llama_server, raw):
    r = httpx.post(llama_server.url + CHAT, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("number", [b"NaN", b"Infinity", b"-Infinity"])
def test_non_finite_numbers_are_refused(llama_server, number):
    raw = b'{"messages": [{"role": "user", "content": "x"}], "temperature": ' + number + b"}"
    r = httpx.post(llama_server.url + CHAT, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400 and "finite" in r.json()["error"]["message"]


HOSTILE = [
    # (path, raw body, words the message must contain): each was a 500 once
    (CHAT, b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nests deeper"),
    (CHAT, b'{"messages": ' + b"[" * 200 + b"]" * 200 + b"}", "nests deeper"),
    (CHAT, b'{"messages": [{"role": "user", "content": "x"}], "seed": ' + b"7" * 5000 + b"}", "not valid json"),
    (COMPLETIONS, b'{"prompt": "abc\\ud800def", "max_tokens": 1}', "surrogate"),
    (CHAT, b'{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 1}', "surrogate"),
    (CHAT, b'{"messages": [{"role": "user", "content": "x"}], "model": "\\ud83d", "max_tokens": 1}', "surrogate"),
    (CHAT, b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "chat_template_kwargs": '
           b'{"return_tensors": "np"}}', "return_tensors"),
    (CHAT, b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "\\ud800": 1}', "surrogate"),
    (COMPLETIONS, b'{"prompt": "\xed\xa0\x80", "max_tokens": 1}', "utf-8"),
]


@pytest.mark.parametrize(("path", "raw", "words"), HOSTILE, ids=range(len(HOSTILE)))
def test_hostile_bodies_are_a_400(llama_server, path, raw, words):
    r = httpx.post(llama_server.url + path, content=raw, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
    assert words in r.json()["error"]["message"].lower()


@pytest.mark.parametrize("top_k", [2**64, 2**31, 10**6, 4096])
def test_top_k_beyond_the_vocabulary_keeps_every_token(llama_server, top_k):
    """top_k >= vocab is no filter at all: the same greedy answer as no top_k."""
    body = {"messages": MSG, "max_tokens": 4}
    plain = httpx.post(llama_server.url + CHAT, json=body).json()
    r = httpx.post(llama_server.url + CHAT, json=body | {"top_k": top_k})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"] == plain["choices"][0]["message"]


def test_paired_surrogate_escapes_are_text(llama_server):
    """What ensure_ascii JSON encoders send for emoji is fine."""
    raw = b'{"prompt": "smile \\ud83d\\ude00", "max_tokens": 1}'
    r = httpx.post(llama_server.url + COMPLETIONS, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text


def test_unknown_route_and_method(llama_server):
    r = httpx.get(llama_server.url + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.get(llama_server.url + CHAT)
    assert r.status_code == 405 and "error" in r.json()


def test_unknown_fields_are_ignored(llama_server):
    r = httpx.post(llama_server.url + CHAT, json={"messages": MSG, "max_tokens": 2, "user": "me", "foo": [1]})
    assert r.status_code == 200


def test_defaults_of_refused_fields_are_accepted(llama_server):
    """What SDKs send by default (echo false, best_of 1, an empty suffix, a well-formed tool) still works."""
    r = httpx.post(llama_server.url + COMPLETIONS, json={"prompt": "hi", "max_tokens": 2, "echo": False,
                                                         "best_of": 1, "suffix": None})
    assert r.status_code == 200, r.text
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    r = httpx.post(llama_server.url + CHAT, json={"messages": MSG, "max_tokens": 2, "tools": [tool]})
    assert r.status_code == 200, r.text


def test_max_tokens_beyond_the_context_is_clamped_to_the_room_left(llama_server):
    """The default --max-tokens-policy clamp: an agent asking for 64000 gets what fits, finish "length"."""
    body = {"prompt": [1] * 4090, "max_tokens": 64000, "ignore_eos": True}
    r = httpx.post(llama_server.url + COMPLETIONS, json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 6
    assert r.json()["choices"][0]["finish_reason"] == "length"


def test_integral_floats_are_integers(llama_server):
    body = {"messages": MSG, "max_tokens": 2.0, "n": 1.0}
    r = httpx.post(llama_server.url + CHAT, json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["refusal"] is None


def test_context_limit_exact_fit_is_accepted(llama_server):
    r = httpx.post(llama_server.url + COMPLETIONS, json={"prompt": [1] * 4094, "max_tokens": 2}, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2


def test_client_disconnect_mid_stream_cancels_generation(llama_server):
    before = httpx.get(llama_server.url + "/stats").json()["engine"]["requests_cancelled"]
    with httpx.stream("POST", llama_server.url + COMPLETIONS,
                      json={"prompt": "x", "max_tokens": 4000, "stream": True, "ignore_eos": True}) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 3:
                break  # leaving the block closes the connection mid-stream
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        stats = httpx.get(llama_server.url + "/stats").json()["engine"]
        if stats["requests_cancelled"] > before and stats["running"] == 0:
            break
        time.sleep(0.05)
    assert stats["requests_cancelled"] == before + 1
    assert stats["running"] == 0
    assert httpx.get(llama_server.url + "/health").status_code == 200
    r = httpx.post(llama_server.url + COMPLETIONS, json={"prompt": "y", "max_tokens": 3})
    assert r.status_code == 200


def test_client_disconnect_cancels_every_choice(llama_server):
    before = httpx.get(llama_server.url + "/stats").json()["engine"]["requests_cancelled"]
    with httpx.stream("POST", llama_server.url + COMPLETIONS,
                      json={"prompt": "x", "max_tokens": 4000, "n": 3, "stream": True, "ignore_eos": True}) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 6:
                break
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        stats = httpx.get(llama_server.url + "/stats").json()["engine"]
        if stats["requests_cancelled"] >= before + 3 and stats["running"] == 0:
            break
        time.sleep(0.05)
    assert stats["requests_cancelled"] == before + 3
    assert stats["running"] == 0


def test_server_healthy_after_all_of_the_above(llama_server):
    assert httpx.get(llama_server.url + "/health").json() == {"status": "ok", "reason": "ok"}
