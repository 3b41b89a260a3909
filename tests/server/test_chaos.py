"""Many uncoordinated clients at once, some leaving mid-way: nothing leaks, nothing fails, the server goes on.

Seeded, so the same mix runs every time: streamed and non-streamed requests,
greedy and sampled, with logprobs and n=2 choices, streams cut after a random
number of lines and non-streamed clients that give up before the answer.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter

import httpx

COMPLETIONS = "/v1/completions"


async def _client(url: str, rnd: random.Random) -> str:
    cut = rnd.choice([None, None, 0, 2, 8, 30])
    body = {"prompt": "hello " * rnd.randint(1, 200), "max_tokens": rnd.randint(1, 120), "ignore_eos": True,
            "stream": rnd.random() < 0.7, "temperature": rnd.choice([0, 0.8]), "seed": rnd.randint(0, 9),
            "n": rnd.choice([1, 1, 1, 2])}
    if rnd.random() < 0.3:
        body["logprobs"] = 2
    async with httpx.AsyncClient(timeout=120) as client:
        if body["stream"]:
            async with client.stream("POST", url + COMPLETIONS, json=body) as response:
                lines = 0
                async for _ in response.aiter_lines():
                    lines += 1
                    if cut is not None and lines > cut:
                        return "cut"
                return str(response.status_code)
        if cut is not None:
            try:
                await asyncio.wait_for(client.post(url + COMPLETIONS, json=body), timeout=0.02 * (cut + 1))
            except asyncio.TimeoutError:
                return "gave up"
            return "200"
        response = await client.post(url + COMPLETIONS, json=body)
        return str(response.status_code)


def test_clients_leaving_at_random_leak_nothing(llama_server):
    url = llama_server.url
    failed_before = httpx.get(url + "/stats").json()["engine"]["requests_failed"]

    async def crowd():
        rnd = random.Random(7)
        return await asyncio.gather(*[_client(url, rnd) for _ in range(48)])

    outcomes = Counter(asyncio.run(crowd()))
    assert set(outcomes) <= {"200", "cut", "gave up"}, outcomes
    assert outcomes["200"] and outcomes["cut"]  # the mix really had both
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        stats = httpx.get(url + "/stats").json()
        if stats["engine"]["running"] == 0 and stats["engine"]["waiting"] == 0:
            break
        time.sleep(0.05)
    assert stats["engine"]["running"] == 0 and stats["engine"]["waiting"] == 0
    assert stats["batch"]["active_rows"] == 0 and stats["batch"]["prefilling_rows"] == 0
    assert stats["batch"]["kv_bytes"] == 0
    assert stats["engine"]["requests_failed"] == failed_before
    assert httpx.get(url + "/health").json()["status"] == "ok"
    after = httpx.post(url + COMPLETIONS, json={"prompt": "still here", "max_tokens": 3, "n": 2}, timeout=30)
    assert after.status_code == 200 and len(after.json()["choices"]) == 2
