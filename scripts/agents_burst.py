"""Agents in bursts on one shared system prompt: per-request first-token times, with every outlier explained.

Each wave sends ``--agents`` chat requests at once: one shared system prompt
(``--prefix-words``) and each agent's own question (``--question-words``),
streaming, greedy, EOS ignored. The first wave finds nothing cached (a burst on
a cold prefix); later waves reuse the system prompt with fresh questions (the
prefix is cached) and their finished agents pile up in the RAM tier. While a
wave runs, ``/stats`` is read every ``--poll-ms``; the server's request log
(JSON lines, when this script starts the server) gives each request's queue
time. A request whose first token came more than ``--outlier-factor`` times
the wave's median (and at least ``--outlier-min-ms``) after it was sent is an
outlier; the report names its cause: admission held it in the queue (and what
was full: rows, prompt concurrency, the KV budget, a row cap lowered by memory
faults), a memory fault preempted it, or it prefilled its own prompt.

    python scripts/agents_burst.py --model /tmp/m8 --agents 64 --prefix-words 1700 --question-words 40 \\
        --max-tokens 128 --waves 4 --out /tmp/burst -- --batch 128

Writes ``summary.json`` (per wave: TTFT p50/p95/max, output tok/s, cached
share, RAM tier entries and bytes, outliers with causes) and ``requests.json``
(every request's timings; not for git), after every wave.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from mlxq.bench.datasets import _text, corpus_words
from mlxq.bench.servers import free_port, wait_healthy


@dataclass
class Sample:
    """One reading of /stats.batch (and the prompt cache), at ``t`` seconds into the wave."""

    t: float
    active: int
    prefilling: int
    pending: int
    preempted: int
    row_cap: int
    kv_bytes: int
    kv_budget: int | None
    preemptions: int
    cache_entries: int
    active_bytes: int  # MLX's active memory
    limit_bytes: int  # MLX's memory limit: a newcomer waits while its KV would not fit below 95% of it


@dataclass
class Record:
    wave: int
    id: str
    sent_s: float  # into the wave
    ttft_ms: float
    e2e_s: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    queue_ms: float | None = None  # the server's: submit -> engine pickup (from its request log)
    outlier: str | None = None  # the cause, for an outlier


async def one_request(client: httpx.AsyncClient, url: str, system: str, question: str, max_tokens: int,
                      wave: int, t0: float) -> Record:
    body = {"model": "m", "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
            "max_tokens": max_tokens, "stream": True, "ignore_eos": True, "temperature": 0,
            "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    first, usage, rid = None, {}, ""
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            rid = chunk.get("id", rid)
            if first is None and chunk.get("choices") and chunk["choices"][0]["delta"].get("content") is not None:
                first = time.perf_counter()
            usage = chunk.get("usage") or usage
    end = time.perf_counter()
    return Record(wave, rid, sent - t0, ((first or end) - sent) * 1000, end - sent, usage.get("prompt_tokens", 0),
                  (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
                  usage.get("completion_tokens", 0))


async def read_stats(client: httpx.AsyncClient, url: str) -> dict:
    return (await client.get(f"{url}/stats")).json()


def sample_of(stats: dict, t: float) -> Sample:
    batch, cache, memory = stats.get("batch") or {}, stats.get("prompt_cache") or {}, stats.get("memory") or {}
    return Sample(t, batch.get("active_rows", 0), batch.get("prefilling_rows", 0), stats["engine"]["waiting"],
                  batch.get("preempted_rows", 0), batch.get("row_cap", 0), batch.get("kv_bytes", 0),
                  batch.get("kv_budget_bytes"), (batch.get("faults") or {}).get("preemptions", 0),
                  cache.get("entries", 0), memory.get("mlx_active_bytes", 0), memory.get("mlx_memory_limit_bytes", 0))


async def poll(client: httpx.AsyncClient, url: str, t0: float, every_s: float, out: list[Sample],
               stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            out.append(sample_of(await read_stats(client, url), time.perf_counter() - t0))
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        try:
            await asyncio.wait_for(stop.wait(), every_s)
        except TimeoutError:
            pass


async def run_wave(url: str, wave: int, system: str, questions: list[str], args) -> tuple[list[Record], list[Sample],
                                                                                          float]:
    samples: list[Sample] = []
    stop = asyncio.Event()
    limits = httpx.Limits(max_connections=len(questions) + 4)
    async with httpx.AsyncClient(timeout=args.timeout_s, limits=limits) as client:
        t0 = time.perf_counter()
        poller = asyncio.create_task(poll(client, url, t0, args.poll_ms / 1000, samples, stop))
        records = await asyncio.gather(*(one_request(client, url, system, q, args.max_tokens, wave, t0)
                                         for q in questions))
        wall = time.perf_counter() - t0
        stop.set()
        await poller
    return list(records), samples, wall


def explain(record: Record, samples: list[Sample], batch: int, prompt_concurrency: int) -> str:
    """Why this request's first token came late, from the server's state while it waited."""
    during = [s for s in samples if record.sent_s <= s.t <= record.sent_s + record.ttft_ms / 1000] or samples[-1:]
    if not during:
        return "no /stats reading while it waited"
    faults = during[-1].preemptions - during[0].preemptions
    if record.queue_ms is not None and record.queue_ms >= record.ttft_ms / 2:
        admitted = record.sent_s + record.queue_ms / 1000
        at = ([s for s in during if s.t <= admitted] or during)[-1]  # the last reading before admission
        return f"queued {record.queue_ms:.0f} ms before admission: {held_by(at, batch, prompt_concurrency)}"
    if faults > 0 or max(s.preempted for s in during) > 0:
        return f"memory faults while it waited: {faults} preemptions (KV dropped and recomputed)"
    uncached = record.prompt_tokens - record.cached_tokens
    return f"prefill after admission: {uncached} uncached prompt tokens, beside {max(s.active for s in during)} rows"


def held_by(at: Sample, batch: int, prompt_concurrency: int) -> str:
    """What kept the queue's head out, as one /stats reading shows it."""
    if at.row_cap < batch:
        return f"row cap lowered to {at.row_cap} by memory faults"
    if at.active + at.prefilling >= at.row_cap:
        return f"all {at.row_cap} rows were taken"
    if at.kv_budget and at.kv_bytes > 0.9 * at.kv_budget:
        return f"the KV budget was full ({at.kv_bytes / 1e9:.2f} of {at.kv_budget / 1e9:.2f} GB)"
    if at.preempted:
        return f"{at.preempted} preempted rows go first"
    room = 0.95 * at.limit_bytes - at.active_bytes
    if at.limit_bytes and room < 0.05 * at.limit_bytes:
        return (f"memory room while busy: {room / 1e9:.2f} GB left under 95% of MLX's "
                f"{at.limit_bytes / 1e9:.1f} GB limit (the RAM tier and the rows' KV hold the rest)")
    if at.prefilling >= prompt_concurrency:
        return f"{at.prefilling} joiners were prefilling (--prompt-concurrency {prompt_concurrency})"
    return (f"not visible in /stats ({at.pending} waiting, {at.prefilling} prefilling, {at.active} rows, "
            f"{room / 1e9:.2f} GB memory room)")


def mark_outliers(records: list[Record], samples: list[Sample], args) -> None:
    median = statistics.median(r.ttft_ms for r in records)
    for r in records:
        if r.ttft_ms > max(args.outlier_factor * median, args.outlier_min_ms):
            r.outlier = explain(r, samples, args.batch, args.prompt_concurrency)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def wave_summary(records: list[Record], samples: list[Sample], wall: float, stats: dict) -> dict:
    ttfts = [r.ttft_ms for r in records]
    cache = stats.get("prompt_cache") or {}
    return {"requests": len(records), "wall_s": round(wall, 3),
            "ttft_ms": {"p50": round(pct(ttfts, 0.5), 1), "p95": round(pct(ttfts, 0.95), 1),
                        "max": round(max(ttfts), 1)},
            "out_tok_s": round(sum(r.completion_tokens for r in records) / wall, 1),
            "prompt_tokens_mean": round(statistics.mean(r.prompt_tokens for r in records), 1),
            "cached_share": round(sum(r.cached_tokens for r in records) / max(1, sum(r.prompt_tokens for r in records)),
                                  3),
            "ram_tier": {k: cache.get(k) for k in ("entries", "nodes", "bytes", "max_bytes", "evictions", "puts")},
            "shared_prefills": (stats.get("batch") or {}).get("shared_prefills"),
            "preemptions": (stats.get("batch") or {}).get("faults", {}).get("preemptions"),
            "max_pending": max((s.pending for s in samples), default=0),
            "outliers": [{"id": r.id, "ttft_ms": round(r.ttft_ms), "cause": r.outlier} for r in records if r.outlier]}


def server_queue_times(log_path: Path | None) -> dict[str, float]:
    """request id -> queue_ms, from the server's JSON request log."""
    if log_path is None or not log_path.exists():
        return {}
    out = {}
    for line in log_path.read_text(errors="replace").splitlines():
        start = line.find("{")
        try:
            fields = json.loads(line[start:]) if start >= 0 else {}
        except ValueError:
            continue
        if "queue_ms" in fields and "id" in fields:
            out[fields["id"]] = fields["queue_ms"]
    return out


async def run(url: str, args, log_path: Path | None) -> None:
    words = corpus_words()
    rng = random.Random(args.seed)
    async with httpx.AsyncClient(timeout=args.timeout_s) as client:  # first-use costs: not part of any wave
        await one_request(client, url, "Warm-up.", _text(rng, words, 20), 4, -1, time.perf_counter())
    waves, all_records = [], []
    for wave in range(args.waves):
        if wave < max(1, args.cold_waves):  # a burst on a prompt nobody sent before
            system = f"You are one of many agents working on task {wave}. " + _text(rng, words, args.prefix_words)
        questions = [_text(rng, words, args.question_words) for _ in range(args.agents)]
        records, samples, wall = await run_wave(url, wave, system, questions, args)
        await asyncio.sleep(0.3)  # the request log's last lines
        queue = server_queue_times(log_path)
        for r in records:
            r.queue_ms = queue.get(r.id)
        mark_outliers(records, samples, args)
        async with httpx.AsyncClient(timeout=30) as client:
            stats = await read_stats(client, url)
        summary = wave_summary(records, samples, wall, stats)
        waves.append(summary)
        all_records += records
        print(f"wave {wave}: {json.dumps(summary)}", flush=True)
        for r in sorted(records, key=lambda r: r.sent_s):
            if r.outlier:
                print(f"  outlier {r.id}: ttft {r.ttft_ms:.0f} ms, queue {r.queue_ms} ms: {r.outlier}", flush=True)
        write_results(args, waves, all_records)  # after every wave: a cut-short run keeps what it measured


def write_results(args, waves: list[dict], records: list[Record]) -> None:
    out = Path(args.out)
    (out / "requests.json").write_text(json.dumps([asdict(r) for r in records]))
    (out / "summary.json").write_text(json.dumps({"config": vars(args), "waves": waves}, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="start `mlxq serve` on this model (else --url)")
    ap.add_argument("--url")
    ap.add_argument("--agents", type=int, default=64)
    ap.add_argument("--waves", type=int, default=3)
    ap.add_argument("--cold-waves", type=int, default=1, help="the first waves each get a new system prompt")
    ap.add_argument("--prefix-words", type=int, default=1700)
    ap.add_argument("--question-words", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=128, help="--batch of the server (also passed when started here)")
    ap.add_argument("--prompt-concurrency", type=int, default=4, help="--prompt-concurrency of the server")
    ap.add_argument("--poll-ms", type=float, default=100)
    ap.add_argument("--outlier-factor", type=float, default=3.0)
    ap.add_argument("--outlier-min-ms", type=float, default=1000)
    ap.add_argument("--timeout-s", type=float, default=600)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="agents-burst")
    ap.add_argument("serve_args", nargs="*", help="extra `mlxq serve` flags (after --)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.url:
        asyncio.run(run(args.url.rstrip("/"), args, None))
    else:
        serve_and_run(args, out)


def serve_and_run(args, out: Path) -> None:
    port, log_path = free_port(), out / "server.log"
    cmd = [sys.executable, "-m", "mlxq.cli.main", "serve", "--model", args.model, "--port", str(port),
           "--batch", str(args.batch), "--prompt-concurrency", str(args.prompt_concurrency),
           "--log-format", "json", "--log-level", "info", *args.serve_args]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_healthy(url, proc)
            asyncio.run(run(url, args, log_path))
        finally:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    main()
