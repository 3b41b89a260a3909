"""A web page cannot drive the default server: foreign Origins and Hosts are refused, bodies must be JSON."""

from __future__ import annotations

import httpx
import pytest

from mlxq.server.guard import GuardPolicy, host_name
from mlxq.server.state import HIDDEN_PATH
from tests.conftest import ServerProcess

CHAT = "/v1/chat/completions"
BODY = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


@pytest.mark.parametrize("origin", ["http://evil.example", "null", "http://localhost.evil.example",
                                    "http://127.0.0.1.evil.example:80", "file://"])
def test_a_foreign_origin_is_refused_by_default(llama_server, origin):
    r = httpx.post(llama_server.url + CHAT, json=BODY, headers={"Origin": origin})
    assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"
    flush = httpx.post(llama_server.url + "/admin/cache/flush", headers={"Origin": origin})
    assert flush.status_code == 403
    stats = httpx.get(llama_server.url + "/stats", headers={"Origin": origin})
    assert stats.status_code == 403 and "access-control-allow-origin" not in stats.headers


@pytest.mark.parametrize("origin", ["http://localhost:3000", "https://127.0.0.1", "http://[::1]:5173"])
def test_loopback_origins_are_allowed_with_cors_headers(llama_server, origin):
    r = httpx.post(llama_server.url + CHAT, json=BODY, headers={"Origin": origin})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin
    pre = httpx.options(llama_server.url + CHAT, headers={"Origin": origin, "Access-Control-Request-Method": "POST",
                                                          "Access-Control-Request-Headers": "content-type"})
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == origin


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", None])
def test_a_simple_request_body_is_refused(llama_server, content_type):
    """What a page can send cross-origin without a preflight (here even from an allowed origin)."""
    headers = {"Origin": "http://localhost:1"} | ({"Content-Type": content_type} if content_type else {})
    r = httpx.post(llama_server.url + CHAT, content=httpx.Request("POST", "/", json=BODY).content, headers=headers)
    assert r.status_code == 415, r.text
    assert r.json()["error"]["code"] == "unsupported_media_type"
    assert "application/json" in r.json()["error"]["message"]


def test_json_with_a_charset_and_a_bodyless_flush_are_accepted(llama_server):
    r = httpx.post(llama_server.url + CHAT, content=httpx.Request("POST", "/", json=BODY).content,
                   headers={"Content-Type": "Application/JSON; charset=utf-8"})
    assert r.status_code == 200
    assert httpx.post(llama_server.url + "/admin/cache/flush").status_code == 409  # reached: no SSD tier here


@pytest.mark.parametrize("host", ["attacker.evil.example", "attacker.evil.example:8080", "192.168.1.20",
                                  "localhost.evil.example"])
def test_a_foreign_host_is_refused_on_a_loopback_bind(llama_server, host):
    """DNS rebinding: the page's name resolves to 127.0.0.1, and its requests carry that name."""
    for path in ("/v1/models", "/health", "/stats"):
        r = httpx.get(llama_server.url + path, headers={"Host": host})
        assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed", (path, r.text)


@pytest.mark.parametrize("host", ["localhost", "LOCALHOST:8080", "127.0.0.1:1", "[::1]:8080", "[::1]"])
def test_loopback_hosts_are_allowed(llama_server, host):
    assert httpx.get(llama_server.url + "/v1/models", headers={"Host": host}).status_code == 200


def test_stats_hide_filesystem_paths_without_an_api_key(llama_server):
    stats = httpx.get(llama_server.url + "/stats").json()
    assert stats["model"]["path"] == HIDDEN_PATH
    assert stats["runtime"]["blas"]["path"] in (HIDDEN_PATH, None)
    assert "/" not in str(stats["model"])


def test_flags_open_origins_and_hosts(tiny_model_dirs):
    args = ("--model", str(tiny_model_dirs["llama"]), "--allowed-origins", "https://app.example, http://x.test:81",
            "--allowed-hosts", "mlxq.lan", "--api-key", "k")
    with ServerProcess(*args) as server:
        auth = {"Authorization": "Bearer k"}
        r = httpx.post(server.url + CHAT, json=BODY, headers=auth | {"Origin": "https://app.example",
                                                                     "Host": "MLXQ.lan:9000"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
        assert httpx.get(server.url + "/v1/models", headers=auth | {"Origin": "http://x.test:81"}).status_code == 200
        assert httpx.get(server.url + "/v1/models", headers=auth | {"Origin": "http://x.test"}).status_code == 403
        assert httpx.get(server.url + "/v1/models", headers=auth | {"Host": "other.lan"}).status_code == 403
        own = {"Host": "mlxq.lan:9000", "Origin": "http://mlxq.lan:9000"}  # a page the server served itself
        assert httpx.get(server.url + "/v1/models", headers=auth | own).status_code == 200
        other_port = {"Host": "mlxq.lan:9000", "Origin": "http://mlxq.lan:9001"}
        assert httpx.get(server.url + "/v1/models", headers=auth | other_port).status_code == 403
        stats = httpx.get(server.url + "/stats", headers=auth).json()
        assert stats["model"]["path"] == str(tiny_model_dirs["llama"].resolve())  # the key holder sees paths


def test_policy_decisions():
    assert host_name("[::1]:80") == "::1" and host_name("::1") == "::1" and host_name("A.b:1") == "a.b"
    off = GuardPolicy(allowed_hosts=("*",))
    assert off.host_allowed("anything.example")
    assert GuardPolicy(check_host=False).host_allowed("anything.example")
    assert GuardPolicy(allowed_origins=("*",)).origin_allowed("http://evil.example")
    assert not GuardPolicy().origin_allowed("http://localhost:99999999")
