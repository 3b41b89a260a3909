"""--burst-window-ms reaches the batch lane: /stats says the window a burst's tails wait with."""

from __future__ import annotations

import httpx

from tests.conftest import ServerProcess


def _window_ms(server: ServerProcess) -> float:
    return httpx.get(f"{server.url}/stats", timeout=10).json()["batch"]["burst_window_ms"]


def test_the_burst_window_is_off_on_the_cpu_unless_asked_for(tiny_model_dirs):
    model = str(tiny_model_dirs["llama"])
    with ServerProcess("--model", model, "--log-level", "warning") as server:
        assert _window_ms(server) == 0  # auto: the CPU has no forward for a burst to share
    with ServerProcess("--model", model, "--log-level", "warning", "--burst-window-ms", "40") as server:
        assert _window_ms(server) == 40
        reply = httpx.post(f"{server.url}/v1/completions", timeout=60,
                           json={"model": "x", "prompt": "a lone request", "max_tokens": 3})
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3


def _stats(server: ServerProcess) -> dict:
    return httpx.get(f"{server.url}/stats", timeout=10).json()["batch"]


def _chat(client: httpx.Client, system: str, question: str) -> dict:
    reply = client.post("/v1/chat/completions", timeout=120, json={
        "model": "x", "max_tokens": 4, "temperature": 0,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]})
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_a_held_burst_answers_as_its_requests_alone_and_leaves_nothing_on_the_way(tiny_model_dirs):
    """A burst of agents on a cached system prompt under a hold (the engine thread sleeping through its
    arrivals, then taking them in one pass) answers each agent as that agent alone; requests the server
    read and settled (answered, refused, or their client gone) leave nothing counted on their way."""
    import socket
    from concurrent.futures import ThreadPoolExecutor

    model = str(tiny_model_dirs["llama"])
    system = "You are one of many agents sharing this long system prompt. " * 12
    questions = [f"Agent {i}: summarise item {i} of the list." for i in range(8)]
    with ServerProcess("--model", model, "--log-level", "warning", "--burst-window-ms", "500") as server:
        with httpx.Client(base_url=server.url) as client:
            alone = [_chat(client, system, q)["choices"][0]["message"]["content"] for q in questions]
        assert _stats(server)["on_the_way"] == 0
        clients = [httpx.Client(base_url=server.url) for _ in questions]
        try:
            with ThreadPoolExecutor(len(questions)) as pool:
                burst = list(pool.map(lambda cq: _chat(cq[0], system, cq[1]), zip(clients, questions, strict=True)))
        finally:
            for c in clients:
                c.close()
        assert [r["choices"][0]["message"]["content"] for r in burst] == alone
        bad = httpx.post(f"{server.url}/v1/chat/completions", timeout=30, content=b"{not json",
                         headers={"content-type": "application/json"})
        assert bad.status_code == 400
        body = b'{"model": "x", "prompt": "gone before its answer", "max_tokens": 64}'
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:  # read in full, then gone
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        with httpx.Client(base_url=server.url) as client:
            _chat(client, system, "a lone request after all that")
        assert _stats(server)["on_the_way"] == 0
