"""Slow and numerous clients: half-sent requests neither exhaust descriptors nor lock others out."""

from __future__ import annotations

import resource
import socket
import sys
import time

import httpx
import pytest

from mlxq import fd_limit
from tests.conftest import ServerProcess

HALF_OPEN = 2100  # past the 2,048 descriptors mlx-lm's import leaves


def _open_file_limit(pid: int) -> int:
    for line in open(f"/proc/{pid}/limits"):
        if line.startswith("Max open files"):
            return int(line.split()[3])
    raise AssertionError("no open-file limit in /proc")


def _half_sent(port: int, partial: bytes) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(partial)
    return s


def _closed_by_server(s: socket.socket, within_s: float) -> bool:
    s.settimeout(within_s)
    try:
        return s.recv(1) == b""
    except (TimeoutError, ConnectionResetError):
        return False


@pytest.fixture(scope="module")
def slow_server(tiny_model_dirs):
    with ServerProcess("--model", str(tiny_model_dirs["llama"]), "--request-read-timeout", "4") as server:
        yield server


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_the_server_keeps_more_descriptors_than_mlx_lm_leaves(slow_server):
    import mlx_lm  # noqa: F401  (lowers this process's limit too)

    assert fd_limit.restore() > HALF_OPEN + 100
    assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] > HALF_OPEN + 100
    assert _open_file_limit(slow_server.proc.pid) > HALF_OPEN + 100


def test_half_open_connections_do_not_stop_a_normal_request(slow_server):
    fd_limit.restore()  # this test process holds the other ends of the sockets
    sockets = []
    try:
        for i in range(HALF_OPEN):
            partial = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Le" if i % 2 else \
                b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n" \
                b"Content-Length: 100\r\n\r\n{\"prompt\""  # headers done, the body never finishes
            sockets.append(_half_sent(slow_server.port, partial))
        started = time.monotonic()
        r = httpx.post(slow_server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
        assert r.status_code == 200, r.text
        assert time.monotonic() - started < 4  # served before the half-sent requests' deadline expired
        # Past the deadline the server hangs up on them: headers half-sent and bodies half-sent alike.
        assert _closed_by_server(sockets[0], within_s=15) and _closed_by_server(sockets[1], within_s=15)
        assert all(_closed_by_server(s, within_s=2) for s in sockets[2:200])
    finally:
        for s in sockets:
            s.close()
    assert httpx.get(slow_server.url + "/health").status_code == 200


def test_a_request_sent_in_time_is_served_and_keep_alive_works(slow_server):
    with httpx.Client(base_url=slow_server.url) as client:
        for _ in range(3):
            assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code == 200
        time.sleep(1)
        assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code == 200
