"""The load generator: streamed OpenAI requests over live SSE, timed at the client.

Talks HTTP only, so it measures any OpenAI-compatible server the same way.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from mlxq.bench.datasets import Conversation
from mlxq.bench.metrics import RequestRecord


@dataclass(frozen=True)
class LoadConfig:
    url: str  # server base URL, e.g. http://127.0.0.1:8080
    model: str = "default_model"
    endpoint: str = "chat"  # "chat" or "completions"
    max_tokens: int = 64
    ignore_eos: bool = False  # ask the server to generate exactly max_tokens (vLLM/mlxq extension)
    temperature: float = 0.0
    request_rate: float = math.inf  # requests/s; inf sends everything at once (bounded by concurrency)
    burstiness: float = 1.0  # gamma shape; 1.0 is Poisson
    seed: int = 0
    api_key: str | None = None
    timeout_s: float = 600.0

    def __post_init__(self):
        if self.endpoint not in ("chat", "completions"):
            raise ValueError("endpoint must be 'chat' or 'completions'")
        if self.request_rate <= 0 or self.burstiness <= 0:
            raise ValueError("request_rate and burstiness must be > 0")


def arrival_offsets(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Send times (s from start): gamma inter-arrivals with mean 1/rate (vLLM's model)."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return out


def _payload(cfg: LoadConfig, conv: Conversation, user: str) -> tuple[str, dict]:
    body: dict = {"model": cfg.model, "max_tokens": cfg.max_tokens, "temperature": cfg.temperature,
                  "stream": True, "stream_options": {"include_usage": True}}
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    if cfg.endpoint == "chat":
        messages = ([{"role": "system", "content": conv.system}] if conv.system else []) + conv.history
        body["messages"] = messages + [{"role": "user", "content": user}]
        return "/v1/chat/completions", body
    parts = ([conv.system] if conv.system else []) + [m["content"] for m in conv.history] + [user]
    body["prompt"] = "\n".join(parts)
    return "/v1/completions", body


def _content(chunk: dict) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    if "delta" in choices[0]:
        return (choices[0].get("delta") or {}).get("content") or ""
    return choices[0].get("text") or ""


async def send_one(client: httpx.AsyncClient, cfg: LoadConfig, conv: Conversation, user: str) -> RequestRecord:
    path, body = _payload(cfg, conv, user)
    return await stream_request(client, cfg.url.rstrip("/") + path, body, conv.tag)


async def stream_request(client: httpx.AsyncClient, url: str, body: dict, tag: str = "") -> RequestRecord:
    """POST one streamed completion and time it at the client."""
    record = RequestRecord(sent_at=time.perf_counter(), tag=tag)
    chunks = 0
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")[:300]
                record.error = f"HTTP {response.status_code}: {text}"
                return record
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    record.error = f"stream error: {chunk['error']}"
                    return record
                now = time.perf_counter()
                text = _content(chunk)
                if text:
                    chunks += 1
                    record.first_chunk_at = record.first_chunk_at or now
                    record.chunk_times.append(now)
                    record.output_text += text
                if chunk.get("choices") and chunk["choices"][0].get("finish_reason"):
                    record.finish_reason = chunk["choices"][0]["finish_reason"]
                if chunk.get("choices") and (chunk["choices"][0].get("logprobs") or {}).get("content"):
                    record.logprobs += chunk["choices"][0]["logprobs"]["content"]
                _read_usage(record, chunk.get("usage"))
        record.done_at = time.perf_counter()
        if not record.output_tokens:
            record.output_tokens = chunks
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    return record


def _read_usage(record: RequestRecord, usage: dict | None) -> None:
    if not usage:
        return
    record.output_tokens = usage.get("completion_tokens") or record.output_tokens
    record.prompt_tokens = usage.get("prompt_tokens")
    details = usage.get("prompt_tokens_details") or {}
    record.cached_tokens = details.get("cached_tokens")


async def run_load(
    cfg: LoadConfig, workload: list[Conversation], concurrency: int,
    on_done: Callable[[RequestRecord], None] = lambda r: None,
) -> list[RequestRecord]:
    """Run every conversation (turns in order), at most ``concurrency`` requests in flight."""
    gate = asyncio.Semaphore(concurrency)
    offsets = arrival_offsets(len(workload), cfg.request_rate, cfg.burstiness, cfg.seed)
    records: list[RequestRecord] = []
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    timeout = httpx.Timeout(cfg.timeout_s, connect=30.0)
    start = time.perf_counter()

    async with httpx.AsyncClient(limits=limits, timeout=timeout, headers=headers) as client:

        async def converse(conv: Conversation, offset: float) -> None:
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            conv.history = []
            for turn, user in enumerate(conv.turns):
                async with gate:
                    record = await send_one(client, cfg, conv, user)
                record.turn = turn
                records.append(record)
                on_done(record)
                if not record.ok:
                    return
                conv.history += [{"role": "user", "content": user},
                                 {"role": "assistant", "content": record.output_text}]

        await asyncio.gather(*(converse(c, o) for c, o in zip(workload, offsets, strict=True)))
    return records
