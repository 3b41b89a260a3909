"""API key, CORS, and engine faults seen through a real server."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from mlxq.engine.engine import Engine, EngineConfig
from mlxq.models.loader import load_model
from mlxq.server.config import ServerConfig
from mlxq.server.state import ServerState
from tests.conftest import InProcessServer, ServerProcess
from tests.engine.test_engine_thread import POISON, PoisonedModel


@pytest.fixture(scope="module")
def keyed_server(tiny_model_dirs):
    args = ("--model", str(tiny_model_dirs["llama"]), "--api-key", "s3cret",
            "--allowed-origins", "http://app.example")
    with ServerProcess(*args) as server:
        yield server


@pytest.mark.parametrize("path", ["/v1/models", "/stats"])
def test_api_key_required_everywhere_but_health(keyed_server, path):
    assert httpx.get(keyed_server.url + "/health").status_code == 200
    r = httpx.get(keyed_server.url + path)
    assert r.status_code == 401
    assert r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(keyed_server.url + path, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(keyed_server.url + path, headers={"Authorization": "Bearer s3cret"}).status_code == 200


def test_sdk_with_key(keyed_server):
    client = openai.OpenAI(base_url=keyed_server.url + "/v1", api_key="s3cret", max_retries=0)
    out = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], max_tokens=2)
    assert out.usage.completion_tokens == 2
    bad = openai.OpenAI(base_url=keyed_server.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_cors_allows_configured_origin_only(keyed_server):
    pre = httpx.options(keyed_server.url + "/v1/chat/completions", headers={
        "Origin": "http://app.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert pre.status_code == 200
    assert pre.headers["access-control-allow-origin"] == "http://app.example"
    other = httpx.options(keyed_server.url + "/v1/chat/completions", headers={
        "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
    assert other.status_code == 403  # the guard refuses a foreign origin before CORS


def poisoned_server(model_dir) -> InProcessServer:
    """A real server on a model that raises on prompts holding POISON (the text "#")."""
    def load():
        loaded = load_model(str(model_dir))
        loaded.model = PoisonedModel(loaded.model)
        return loaded

    return InProcessServer(ServerState(ServerConfig(), Engine(load, EngineConfig())))


def test_engine_exception_is_a_500_and_the_server_keeps_serving(tiny_model_dirs):
    with poisoned_server(tiny_model_dirs["llama"]) as server:
        url = server.url + "/v1/completions"
        r = httpx.post(url, json={"prompt": [1, POISON, 2], "max_tokens": 4})
        assert r.status_code == 500
        assert "injected fault" in r.json()["error"]["message"]
        assert r.json()["error"]["type"] == "server_error"
        with httpx.stream("POST", url, json={"prompt": [1, POISON, 2], "max_tokens": 4, "stream": True}) as s:
            lines = [line for line in s.iter_lines() if line]
        assert "injected fault" in lines[0] and lines[-1] == "data: [DONE]"
        assert httpx.post(url, json={"prompt": [1, 2], "max_tokens": 4}).status_code == 200
        assert httpx.get(server.url + "/health").status_code == 200
        assert httpx.get(server.url + "/stats").json()["engine"]["requests_failed"] == 2


def test_an_engine_fault_is_each_protocol_s_error_plain_and_streamed(tiny_model_dirs):
    poisoned = [{"role": "user", "content": "a # here"}]
    with poisoned_server(tiny_model_dirs["llama"]) as server:
        messages = {"model": "m", "max_tokens": 4, "messages": poisoned}
        r = httpx.post(server.url + "/v1/messages", json=messages)
        assert r.status_code == 500 and r.json()["type"] == "error"
        assert r.json()["error"]["type"] == "api_error" and "injected fault" in r.json()["error"]["message"]
        events = _sse_events(server.url + "/v1/messages", {**messages, "stream": True})
        assert events[0]["type"] == "message_start"
        assert events[-1]["type"] == "error" and "injected fault" in events[-1]["error"]["message"]

        responses = {"model": "m", "max_output_tokens": 4, "input": poisoned}
        r = httpx.post(server.url + "/v1/responses", json=responses)
        assert r.status_code == 500 and r.json()["error"]["code"] == "engine_error"
        events = _sse_events(server.url + "/v1/responses", {**responses, "stream": True})
        assert events[0]["type"] == "response.created"
        assert events[-1]["type"] == "error" and events[-1]["code"] == "engine_error"
        assert "injected fault" in events[-1]["message"]
        assert httpx.get(server.url + "/stats").json()["engine"]["requests_failed"] == 4


def _sse_events(url: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url, json=body) as stream:
        assert stream.status_code == 200
        return [json.loads(line[len("data: "):]) for line in stream.iter_lines() if line.startswith("data: ")]


def test_health_is_503_when_the_engine_thread_is_gone(tiny_model_dirs):
    def load():
        raise RuntimeError("weights are corrupt")

    state = ServerState(ServerConfig(), Engine(load, EngineConfig()))
    server = InProcessServer(state)  # not entered: it never becomes healthy
    server.thread.start()
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                r = httpx.get(server.url + "/health")
                if r.status_code == 503 and "corrupt" in r.json()["reason"]:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline
            time.sleep(0.05)
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
    finally:
        server.server.should_exit = True
        server.thread.join(10)
