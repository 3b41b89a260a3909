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
