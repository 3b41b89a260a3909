"""Agents in bursts on one shared system prompt: per-request first-token times, with every outlier explained.

Each wave sends ``--agents`` chat requests at once: one shared system prompt
(``--prefix-words``) and each agent's own question (``--question-words``),
streaming, greedy, EOS ignored. The first wave finds nothing cached (a burst on
a cold prefix); later waves reuse the system prompt with fresh questions (the
prefix is cached) and their finished agents pile up in the RAM tier. While a
wave runs, ``/stats`` is read every ``--poll-ms``; the server's request log
(JSON lines, when this script starts the server) gives each request's queue
time and its way from admission to the first token in phases
(engine/ttft_phases.py), summarized as p50 / p95 per wave and over the
cached waves. Outliers (more than ``--outlier-factor`` times the wave's median first-
token time, and at least ``--outlier-min-ms``) are named with their cause
(mlxq/bench/burst_causes.py).

    python scripts/agents_burst.py --model /tmp/m8 --agents 64 --prefix-words 1950 --question-words 40 \\
        --max-tokens 128 --waves 6 --cold-waves 2 --batch 128 --client-procs 8 --out /tmp/burst

``--client-procs N`` sends each wave from N client processes, as separate
agents would (mlxq/bench/burst_clients.py); the default, 1, sends all of a
wave from this process, whose own event loop then delays the later requests'
sending (docs/benchmarks.md has both). Each request's time to the server is
split in the client's part, the kernel and the server loop's read, and the
loop's queue before its route (``client_ms``, ``wire_ms``, ``route_ms``).

Writes ``summary.json`` (per wave: TTFT p50/p95/max, output tok/s, cached
share, RAM tier entries and bytes, outliers with causes) and ``requests.json``
(every request's timings; not for git), after every wave.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import httpx

from mlxq.bench.burst_causes import Record, Sample, mark_outliers, overall_summary, sample_of, wave_summary
from mlxq.bench.burst_clients import ClientProcs, one_request
from mlxq.bench.datasets import _text, corpus_words
from mlxq.bench.servers import free_port, wait_healthy


async def read_stats(client: httpx.AsyncClient, url: str) -> dict:
    return (await client.get(f"{url}/stats")).json()


async def poll(client: httpx.AsyncClient, url: str, t0: float, every_s: float, out: list[Sample],
               stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            out.append(sample_of(await read_stats(client, url), time.monotonic() - t0))
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        try:
            await asyncio.wait_for(stop.wait(), every_s)
        except TimeoutError:
            pass


async def run_wave(url: str, wave: int, system: str, questions: list[str], args,
                   procs: ClientProcs | None) -> tuple[list[Record], list[Sample], float]:
    samples: list[Sample] = []
    stop = asyncio.Event()
    limits = httpx.Limits(max_connections=len(questions) + 4)
    async with httpx.AsyncClient(timeout=args.timeout_s, limits=limits) as client:
        if procs is None:  # every request from this process's event loop
            t0 = time.monotonic()
            poller = asyncio.create_task(poll(client, url, t0, args.poll_ms / 1000, samples, stop))
            records = await asyncio.gather(*(one_request(client, url, system, q, args.max_tokens, wave, t0)
                                             for q in questions))
        else:  # each client process sends its share at one start time
            parts = procs.parts(url, system, questions, args.max_tokens, wave, args.timeout_s)
            t0 = parts[0].start_at
            poller = asyncio.create_task(poll(client, url, t0, args.poll_ms / 1000, samples, stop))
            records = await procs.send(parts)
        wall = time.monotonic() - t0
        stop.set()
        await poller
    return list(records), samples, wall


def server_request_log(log_path: Path | None) -> dict[str, dict]:
    """request id -> its request-log fields (queue_ms, ttft_<phase>_ms, ...), from the server's JSON request log."""
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
            out[fields["id"]] = fields
    return out


def phases_of(fields: dict) -> dict[str, float] | None:
    """The request's time from admission to token 0 in phases (engine/ttft_phases.py), None if not logged."""
    phases = {key[5:-3]: value for key, value in fields.items()
              if key.startswith("ttft_") and key.endswith("_ms") and key != "ttft_ms"}
    return phases or None


async def run(url: str, args, log_path: Path | None) -> None:
    procs = ClientProcs(args.client_procs) if args.client_procs > 1 else None
    try:
        await run_waves(url, args, log_path, procs)
    finally:
        if procs is not None:
            procs.close()


async def run_waves(url: str, args, log_path: Path | None, procs: ClientProcs | None) -> None:
    words = corpus_words()
    rng = random.Random(args.seed)
    async with httpx.AsyncClient(timeout=args.timeout_s) as client:  # first-use costs: not part of any wave
        await one_request(client, url, "Warm-up.", _text(rng, words, 20), 4, -1, time.monotonic())
    waves, all_records = [], []
    for wave in range(args.waves):
        if wave < max(1, args.cold_waves):  # a burst on a prompt nobody sent before
            system = f"You are one of many agents working on task {wave}. " + _text(rng, words, args.prefix_words)
        questions = [_text(rng, words, args.question_words) for _ in range(args.agents)]
        records, samples, wall = await run_wave(url, wave, system, questions, args, procs)
        await asyncio.sleep(0.3)  # the request log's last lines
        logged = server_request_log(log_path)
        for r in records:
            fields = logged.get(r.id, {})
            r.queue_ms, r.phases_ms = fields.get("queue_ms"), phases_of(fields)
            r.parse_ms, r.server_ttft_ms = fields.get("parse_ms"), fields.get("ttft_ms")
            received = fields.get("received_monotonic_s")  # a log read here: the server runs on this host
            r.send_ms = None if received is None else round((received - r.sent_at) * 1000, 1)
            r.read_at = fields.get("read_monotonic_s")
        mark_outliers(records, samples, args.outlier_factor, args.outlier_min_ms, args.batch, args.prompt_concurrency)
        async with httpx.AsyncClient(timeout=30) as client:
            stats = await read_stats(client, url)
        summary = wave_summary(records, samples, wall, stats)
        waves.append(summary)
        all_records += records
        print(f"wave {wave}: {json.dumps(summary)}", flush=True)
        outside = ("send_ms", "client_ms", "wire_ms", "route_ms", "parse_ms", "http_ms", "back_ms")
        print(f"  outside the engine (ms p50/p95): {phase_line({k: summary[k] for k in outside})}; "
              f"queue {phase_line({'': summary['queue_ms']})}", flush=True)
        print(f"  admission -> token 0 by phase (ms p50/p95): {phase_line(summary['ttft_phases_ms'])}", flush=True)
        for r in sorted(records, key=lambda r: r.sent_s):
            if r.outlier:
                print(f"  outlier {r.id}: ttft {r.ttft_ms:.0f} ms, queue {r.queue_ms} ms: {r.outlier}", flush=True)
        write_results(args, waves, all_records)  # after every wave: a cut-short run keeps what it measured


def phase_line(phases: dict) -> str:
    return ", ".join(f"{name} {v['p50']:.0f}/{v['p95']:.0f}".strip() for name, v in phases.items() if v) or "not logged"


def write_results(args, waves: list[dict], records: list[Record]) -> None:
    out = Path(args.out)
    (out / "requests.json").write_text(json.dumps([asdict(r) for r in records]))
    overall = overall_summary(records, waves, args.cold_waves)
    (out / "summary.json").write_text(json.dumps({"config": vars(args), "overall": overall, "waves": waves}, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="start `mlxq serve` on this model (else --url)")
    ap.add_argument("--url")
    ap.add_argument("--server-log", help="with --url: the server's request log (--log-format json) for queue times")
    ap.add_argument("--agents", type=int, default=64)
    ap.add_argument("--waves", type=int, default=3)
    ap.add_argument("--cold-waves", type=int, default=1, help="the first waves each get a new system prompt")
    ap.add_argument("--prefix-words", type=int, default=1700)
    ap.add_argument("--question-words", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=128, help="--batch of the server (also passed when started here)")
    ap.add_argument("--prompt-concurrency", type=int, default=4, help="--prompt-concurrency of the server")
    ap.add_argument("--client-procs", type=int, default=1,
                    help="send each wave from this many client processes (1: all from this one)")
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
        asyncio.run(run(args.url.rstrip("/"), args, Path(args.server_log) if args.server_log else None))
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
