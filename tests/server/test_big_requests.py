"""Big requests run off the event loop and are refused early when they cannot fit: other streams keep flowing."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import threading
import time

import httpx
import pytest

MIB = 2**20


def _rss_bytes(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


_READER = """
import sys, time, httpx
body = {"prompt": "x", "max_tokens": 4000, "ignore_eos": True, "stream": True}
with httpx.stream("POST", sys.argv[1] + "/v1/completions", json=body, timeout=60) as r:
    for line in r.iter_lines():
        if line.startswith("data: "):
            print(time.monotonic(), flush=True)
"""


class _Stream:
    """A long streamed completion read by another process (this one is busy sending), timing each chunk."""

    def __init__(self, url: str):
        self.proc = subprocess.Popen([sys.executable, "-c", _READER, url], stdout=subprocess.PIPE, text=True)
        self.arrivals: list[float] = []
        self._reader = threading.Thread(target=self._collect, daemon=True)
        self._reader.start()

    def _collect(self):
        for line in self.proc.stdout:
            self.arrivals.append(float(line))

    def stop(self):
        self.proc.kill()
        self.proc.wait(30)
        self._reader.join(30)

    def longest_gap(self, after: float) -> float:
        times = [t for t in self.arrivals if t >= after]
        return max(b - a for a, b in zip(times, times[1:], strict=False))


@functools.cache
def _big_bodies() -> dict[str, bytes]:
    text = "lorem ipsum dolor sit amet " * (15 * MIB // 27)
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "d" * 100}
                                                for i in range(12 * MIB // 150)}}
    return {
        "15 MiB completion prompt": json.dumps({"prompt": text, "max_tokens": 4}).encode(),
        "15 MiB chat message": json.dumps({"messages": [{"role": "user", "content": text}]}).encode(),
        "100k messages": json.dumps({"messages": [{"role": "user", "content": "hello there"}] * 100_000}).encode(),
        "12 MiB tool schema": json.dumps({"messages": [{"role": "user", "content": "hi"}], "tools": [
            {"type": "function", "function": {"name": "f", "parameters": schema}}]}).encode(),
    }


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
@pytest.mark.parametrize("name", list(_big_bodies()))
def test_a_big_request_leaves_another_stream_flowing_and_memory_returned(llama_server, name):
    raw = _big_bodies()[name]
    path = "/v1/completions" if "completion" in name else "/v1/chat/completions"
    stream = _Stream(llama_server.url)
    try:
        deadline = time.monotonic() + 60
        while len(stream.arrivals) < 20 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(stream.arrivals) >= 20, "the stream never started"
        rss_before = _rss_bytes(llama_server.proc.pid)
        started = time.monotonic()
        r = httpx.post(llama_server.url + path, content=raw, headers={"content-type": "application/json"},
                       timeout=120)
        finished = time.monotonic()
        time.sleep(0.3)
    finally:
        stream.stop()
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text[:300]
    assert stream.arrivals[-1] > finished, "the stream ended before the big request did"
    gap = stream.longest_gap(after=started)
    print(f"{name}: answered in {finished - started:.2f} s; the stream's longest gap meanwhile {gap:.3f} s")
    assert gap < 1.0
    assert _rss_bytes(llama_server.proc.pid) - rss_before < 200 * MIB
