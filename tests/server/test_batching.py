"""Continuous batching through a real server: concurrent clients, drain, budget, stats."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest

from mlxq.engine.serial import run_serial
from mlxq.engine.types import Request, SamplingParams
from mlxq.golden.cases import LONG
from tests.conftest import ServerProcess


def solo_run(load_tiny, prompt_ids, max_tokens, stop=(), **params) -> tuple[str, str]:
    """(text, finish_reason) of the serial lane on its own: the reference for a batched row."""
    model, tokenizer = load_tiny("llama")
    events = []
    request = Request("solo", list(prompt_ids), SamplingParams(**params), max_tokens, tuple(stop))
    run_serial(model, tokenizer, request, events.append, prefill_step_size=2048)
    return "".join(e.text for e in events), events[-1].finish_reason.value


def solo_text(load_tiny, prompt_ids, max_tokens, stop=(), **params) -> str:
    return solo_run(load_tiny, prompt_ids, max_tokens, stop, **params)[0]


async def stream_completion(url: str, body: dict, *, delay: float = 0.0, hang_up_after: int | None = None) -> dict:
    await asyncio.sleep(delay)
    out = {"text": "", "finish": None, "first_at": None, "done_at": None}
    async with httpx.AsyncClient(timeout=120) as client:
        async with client.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            chunks = 0
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choice = json.loads(line[6:])["choices"][0]
                out["first_at"] = out["first_at"] or time.monotonic()
                out["text"] += choice["text"]
                out["finish"] = choice["finish_reason"] or out["finish"]
                chunks += 1
                if hang_up_after is not None and chunks >= hang_up_after:
                    return out  # leaving the context manager drops the connection
    out["done_at"] = time.monotonic()
    return out


class StatsWatcher:
    """Polls /stats in the background and remembers the widest batch seen."""

    def __init__(self, url: str):
        self.url, self.max_rows, self._stop = url, 0, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            batch = httpx.get(self.url + "/stats").json()["batch"]
            self.max_rows = max(self.max_rows, batch["active_rows"])
            time.sleep(0.01)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self.thread.join(5)


def wait_drained(url: str, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        stats = httpx.get(url + "/stats").json()
        b = stats["batch"]
        if b["active_rows"] == 0 and b["prefilling_rows"] == 0 and b["pending_rows"] == 0:
            return stats
        assert time.monotonic() < deadline, b
        time.sleep(0.05)


def test_concurrent_staggered_clients_match_their_solo_runs(llama_server, load_tiny):
    _, tokenizer = load_tiny("llama")
    long_ids, short_ids = tokenizer.encode(LONG), tokenizer.encode("Once upon a time")
    plans = []
    for i in range(10):
        prompt = (long_ids if i % 2 else short_ids)[: 20 + 7 * i]
        params = {} if i % 3 == 0 else {"temperature": 0.8, "top_p": 0.9, "seed": 100 + i}
        hang_up = 3 if i in (5, 8) else None
        # Clients that hang up ask for far more than they read, so their rows are still running.
        body = {"prompt": prompt, "max_tokens": 3000 if hang_up else 24 + 4 * i, "ignore_eos": bool(hang_up),
                **params}
        if i == 4:
            body["stop"] = [solo_text(load_tiny, prompt, 40, **params)[6:9]]
        plans.append((body, 0.03 * i, hang_up))

    async def run_all():
        return await asyncio.gather(*(stream_completion(llama_server.url, b, delay=d, hang_up_after=h)
                                      for b, d, h in plans))

    start = wait_drained(llama_server.url)
    baseline, cache_before = start["memory"]["mlx_active_bytes"], start["prompt_cache"]["bytes"]
    with StatsWatcher(llama_server.url) as watcher:
        results = asyncio.run(run_all())
    assert watcher.max_rows >= 3, "the clients must actually have been batched"
    for (body, _, hang_up), result in zip(plans, results, strict=True):
        if hang_up is not None:
            continue
        params = {k: body[k] for k in ("temperature", "top_p", "seed") if k in body}
        expected, finish = solo_run(load_tiny, body["prompt"], body["max_tokens"], body.get("stop", ()), **params)
        assert result["text"] == expected, body
        assert result["finish"] == finish
    before = httpx.get(llama_server.url + "/stats").json()["engine"]["requests_cancelled"]
    stats = wait_drained(llama_server.url)
    assert stats["batch"]["kv_bytes"] == 0
    # Every row's KV was released: MLX's live memory grew by what the prompt cache keeps, no more.
    kept = stats["prompt_cache"]["bytes"] - cache_before
    assert stats["memory"]["mlx_active_bytes"] <= baseline + kept + (1 << 20)
    assert stats["engine"]["requests_cancelled"] >= 2
    assert before <= stats["engine"]["requests_cancelled"]


@pytest.fixture(scope="module")
def small_batch_server(tiny_model_dirs):
    # tiny llama KV: 2 KiB/token, rows padded to 256 tokens -> 512 KiB per short row; 1.2 MiB fits two.
    args = ("--model", str(tiny_model_dirs["llama"]), "--batch", "4", "--kv-budget", "1.2MiB")
    with ServerProcess(*args) as server:
        yield server


def test_max_tokens_the_budget_cannot_hold_is_clamped_to_what_it_can(small_batch_server):
    body = {"prompt": [1, 2, 3], "max_tokens": 900, "ignore_eos": True}
    r = httpx.post(small_batch_server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert 0 < r.json()["usage"]["completion_tokens"] < 900
    assert r.json()["choices"][0]["finish_reason"] == "length"


def test_request_that_can_never_fit_the_budget_is_refused_at_once(tiny_model_dirs):
    args = ("--model", str(tiny_model_dirs["llama"]), "--batch", "4", "--kv-budget", "1.2MiB",
            "--max-tokens-policy", "reject")
    with ServerProcess(*args) as server:
        r = httpx.post(server.url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 900})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["code"] == "kv_budget_exceeded"
    assert "lower max_tokens to" in error["message"]


def test_budget_queues_rows_instead_of_overcommitting(small_batch_server):
    async def run_all():
        return await asyncio.gather(*(stream_completion(small_batch_server.url,
                                                        {"prompt": [1, 2, 3 + i], "max_tokens": 60})
                                      for i in range(6)))

    with StatsWatcher(small_batch_server.url) as watcher:
        results = asyncio.run(run_all())
    assert all(r["finish"] == "length" for r in results)
    assert watcher.max_rows == 2  # the budget, not --batch 4, is the limit
    stats = wait_drained(small_batch_server.url)
    assert stats["batch"]["kv_budget_bytes"] == int(1.2 * 2**20)


def test_serial_request_drains_the_batch_and_nobody_starves(small_batch_server, load_tiny):
    url = small_batch_server.url
    serial_body = {"prompt": [7, 8, 9], "max_tokens": 30, "deterministic": True}

    async def run_all():
        first_wave = [stream_completion(url, {"prompt": [1, 2, i], "max_tokens": 120}) for i in range(2)]
        serial = stream_completion(url, serial_body, delay=0.3)
        later = [stream_completion(url, {"prompt": [4, 5, i], "max_tokens": 20}, delay=0.4) for i in range(3)]
        return await asyncio.gather(*first_wave, serial, *later)

    results = asyncio.run(run_all())
    wave, serial, later = results[:2], results[2], results[3:]
    assert all(r["finish"] == "length" for r in results)
    # The serial request ran alone: after the running rows finished, before later arrivals started.
    assert serial["first_at"] >= max(r["done_at"] for r in wave) - 0.05
    assert all(r["first_at"] >= serial["done_at"] - 0.05 for r in later)
    assert serial["text"] == solo_text(load_tiny, [7, 8, 9], 30)
    stats = httpx.get(url + "/stats").json()["engine"]
    assert stats["placement_reasons"]["deterministic-requested"] >= 1
