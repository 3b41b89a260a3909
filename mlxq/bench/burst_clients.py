"""A burst's clients: one streaming chat request per agent, sent from this process or from several.

One Python process sending 64 requests builds, connects and writes them one
after another on its own event loop: the last leaves tens of milliseconds
after the first, and that wait lands in each request's measured send time.
Agents are separate processes, each with its own interpreter; ``ClientProcs``
spreads a burst over ``n`` such processes, every one waiting for the same
start time (``time.monotonic`` is CLOCK_MONOTONIC, one clock for the host).
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import time
from dataclasses import dataclass

import httpx

from mlxq.bench.burst_causes import Record


async def one_request(client: httpx.AsyncClient, url: str, system: str, question: str, max_tokens: int,
                      wave: int, t0: float) -> Record:
    body = {"model": "m", "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
            "max_tokens": max_tokens, "stream": True, "ignore_eos": True, "temperature": 0,
            "stream_options": {"include_usage": True}}
    written: list[float] = []

    async def trace(event: str, info: dict) -> None:  # httpcore's steps: the headers go out now
        if event == "http11.send_request_headers.started":
            written.append(time.monotonic())

    sent = time.monotonic()  # CLOCK_MONOTONIC, as the server's request log (received_monotonic_s)
    first, usage, rid = None, {}, ""
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body,
                             extensions={"trace": trace}) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            rid = chunk.get("id", rid)
            if first is None and chunk.get("choices") and chunk["choices"][0]["delta"].get("content") is not None:
                first = time.monotonic()
            usage = chunk.get("usage") or usage
    end = time.monotonic()
    return Record(wave, rid, sent - t0, ((first or end) - sent) * 1000, end - sent, usage.get("prompt_tokens", 0),
                  (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
                  usage.get("completion_tokens", 0), sent_at=sent, written_at=written[0] if written else None)


@dataclass(frozen=True)
class BurstPart:
    """One client process's share of a wave: its questions, all sent at ``start_at`` (time.monotonic)."""

    url: str
    system: str
    questions: list[str]
    max_tokens: int
    wave: int
    start_at: float
    timeout_s: float


async def send_part(part: BurstPart) -> list[Record]:
    limits = httpx.Limits(max_connections=len(part.questions) + 4)
    async with httpx.AsyncClient(timeout=part.timeout_s, limits=limits) as client:
        await asyncio.sleep(max(0.0, part.start_at - time.monotonic()))
        return list(await asyncio.gather(*(one_request(client, part.url, part.system, q, part.max_tokens,
                                                       part.wave, part.start_at) for q in part.questions)))


def _serve_parts(conn) -> None:
    """A client process: runs each part it is sent, answers its records (or the error's text)."""
    while (part := conn.recv()) is not None:
        try:
            conn.send(asyncio.run(send_part(part)))
        except Exception as exc:  # the parent raises it: a failed request fails the wave
            conn.send(f"{type(exc).__name__}: {exc}")


class ClientProcs:
    """``n`` client processes, started once (their start-up is no wave's), each sending its share of a burst."""

    LEAD_S = 0.25  # from handing out the parts to the common start: every process is waiting by then

    def __init__(self, n: int):
        ctx = multiprocessing.get_context("spawn")  # no copy of the parent's threads or event loop
        self._conns, self._procs = [], []
        for _ in range(n):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve_parts, args=(child,), daemon=True)
            proc.start()
            self._conns.append(parent)
            self._procs.append(proc)

    def parts(self, url: str, system: str, questions: list[str], max_tokens: int, wave: int,
              timeout_s: float) -> list[BurstPart]:
        """The burst dealt round robin, every share starting at one time (the wave's t0)."""
        start_at = time.monotonic() + self.LEAD_S
        n = len(self._conns)
        return [BurstPart(url, system, questions[i::n], max_tokens, wave, start_at, timeout_s) for i in range(n)]

    async def send(self, parts: list[BurstPart]) -> list[Record]:
        for conn, part in zip(self._conns, parts, strict=True):
            conn.send(part)
        loop = asyncio.get_running_loop()
        answers = await asyncio.gather(*(loop.run_in_executor(None, conn.recv) for conn in self._conns))
        failed = [a for a in answers if isinstance(a, str)]
        if failed:
            raise RuntimeError(f"a client process failed: {failed[0]}")
        return [record for answer in answers for record in answer]

    def close(self) -> None:
        for conn in self._conns:
            try:
                conn.send(None)
            except OSError:  # that process is gone already
                pass
        for proc in self._procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
