"""API key, CORS, and engine faults seen through a real server."""

from __future__ import annotations

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


def test_engine_exception_is_a_500_and_the_server_keeps_serving(tiny_model_dirs):
    def load():
        loaded = load_model(str(tiny_model_dirs["llama"]))
        loaded.model = PoisonedModel(loaded.model)
        return loaded

    state = ServerState(ServerConfig(), Engine(load, EngineConfig()))
    with InProcessServer(state) as server:
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
