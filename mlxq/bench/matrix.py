"""`mlxq bench matrix features`: a composition matrix over live SSE, with conformance gates.

Two servers on the same model: the one under test (continuous batching) and
a `--batch 1` reference. Each cell sends its requests concurrently to the
server under test (timed: TTFT p50/p95 at the first content chunk,
wall-clock aggregate tok/s) and, one at a time, to the reference; its gate
checks the outputs:

- plain-greedy, shared-prefix, mixed: every greedy output equals the
  `--batch 1` output (text and finish reason). Sampled outputs are not
  compared: with an optimized BLAS a batched row's logits differ from its
  solo run at float32 rounding (docs/architecture.md, "Numerics"), which a
  sampler can turn into a different token at a near tie;
- stop-seeded: no output contains its stop string;
- logprobs: every token carries a logprob <= 0 and sorted top alternatives,
  and greedy picks the most likely one;
- quantized-kv: both servers run ``--kv-quant 8 --prompt-cache 0`` (a pair
  of their own); every greedy output equals the ``--batch 1`` output under
  the same scheme. Without a prompt cache: a request that starts from a
  cached prefix attends its first chunk to quantized KV where a cold run
  attends it in full precision (mlx-lm's conversion point), so the cache
  state, not the batch, would decide some tokens.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from mlxq.bench.client import stream_request
from mlxq.bench.datasets import corpus_words
from mlxq.bench.metrics import RequestRecord, summarize


@dataclass(frozen=True)
class Cell:
    name: str
    bodies: list[dict]  # chat completion bodies (without "stream")
    gate: str  # "reference" | "logprobs" | "skip"
    note: str = ""
    serve_args: tuple[str, ...] = ()  # this cell needs both servers started with these flags


def _text(rng: random.Random, n: int) -> str:
    words = corpus_words()
    return " ".join(rng.choice(words) for _ in range(n))


def _chat(content: str, system: str | None = None, **extra) -> dict:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]
    return {"messages": messages, **extra}


def make_cells(requests: int, max_tokens: int, seed: int = 0) -> list[Cell]:
    rng = random.Random(seed)
    shared = _text(rng, 300)
    base = {"max_tokens": max_tokens}
    plain = [_chat(_text(rng, 40), **base) for _ in range(requests)]
    prefix = [_chat(_text(rng, 12), system=shared, **base) for _ in range(requests)]
    stops = [_chat(_text(rng, 30), temperature=0.8, top_p=0.95, seed=1000 + i,
                   stop=[rng.choice(["th", "an", "er", "in"])], **base) for i in range(requests)]
    logprobs = [_chat(_text(rng, 20), logprobs=True, top_logprobs=3, **base) for _ in range(requests)]
    quantized = [_chat(_text(rng, 60 + 20 * (i % 3)), system=shared if i % 2 else None, **base)
                 for i in range(requests)]
    mixed = []
    for i in range(requests):
        extra = [{}, {"temperature": 0.7, "seed": 7 + i}, {"deterministic": True},
                 {"repetition_penalty": 1.2, "presence_penalty": 0.3}][i % 4]
        mixed.append(_chat(_text(rng, 10 + 17 * (i % 5)), max_tokens=max_tokens // 2 + 5 * (i % 5), **extra))
    return [
        Cell("plain-greedy", plain, "reference"),
        Cell("shared-prefix", prefix, "reference", "long shared system prompt: prompt-cache reuse"),
        Cell("stop-seeded", stops, "reference", "seeded sampling with stop strings"),
        Cell("quantized-kv", quantized, "reference", "--kv-quant 8 --prompt-cache 0 on both servers",
             ("--kv-quant", "8", "--prompt-cache", "0")),
        Cell("logprobs", logprobs, "logprobs", "top_logprobs=3"),
        Cell("mixed", mixed, "reference", "greedy, seeded, penalties and serial-lane requests together"),
    ]


async def _send_all(url: str, bodies: list[dict], concurrency: int) -> list[RequestRecord]:
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=30)) as client:

        async def one(body):
            async with gate:
                return await stream_request(client, url + "/v1/chat/completions", {**body, "stream": True})

        return list(await asyncio.gather(*(one(b) for b in bodies)))


def _gate_reference(cell: Cell, got: list[RequestRecord], ref: list[RequestRecord]) -> list[str]:
    problems = []
    for i, (g, r) in enumerate(zip(got, ref, strict=True)):
        body = cell.bodies[i]
        if not g.ok or not r.ok:
            problems.append(f"request {i} failed: {g.error or r.error}")
        elif not body.get("temperature") and (g.output_text, g.finish_reason) != (r.output_text, r.finish_reason):
            problems.append(f"request {i} differs from --batch 1: {g.output_text[:40]!r} vs {r.output_text[:40]!r}")
        for stop in body.get("stop", []):
            if stop in g.output_text:
                problems.append(f"request {i}: stop string {stop!r} in the output")
    return problems


def _gate_logprobs(got: list[RequestRecord]) -> list[str]:
    problems = []
    for i, g in enumerate(got):
        if not g.ok or not g.logprobs:
            problems.append(f"request {i}: {g.error or 'no logprobs'}")
            continue
        for entry in g.logprobs:
            tops = [t["logprob"] for t in entry["top_logprobs"]]
            if entry["logprob"] > 0 or len(tops) != 3 or tops != sorted(tops, reverse=True) \
                    or abs(entry["logprob"] - tops[0]) > 1e-6:
                problems.append(f"request {i}: malformed logprob entry {entry}")
                break
    return problems


def run_cell(cell: Cell, url: str, reference_url: str, concurrency: int,
             on_progress: Callable[[str], None] = lambda s: None) -> dict:
    if cell.gate == "skip":
        return {"cell": cell.name, "status": "skipped", "note": cell.note}
    on_progress(cell.name)
    got = asyncio.run(_send_all(url, cell.bodies, concurrency))
    summary = summarize(got)
    if cell.gate == "reference":
        ref = asyncio.run(_send_all(reference_url, cell.bodies, 1))
        problems = _gate_reference(cell, got, ref)
    else:
        problems = _gate_logprobs(got)
    return {
        "cell": cell.name, "status": "pass" if not problems else "fail", "note": cell.note,
        "problems": problems[:5], "requests": len(cell.bodies), "ttft_ms": summary["ttft_ms"],
        "output_throughput_tok_s": summary["output_throughput_tok_s"], "failed": summary["failed"],
        "cached_token_ratio": summary["cached_token_ratio"],
    }
