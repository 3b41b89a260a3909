"""Where a lone stream loses speed between the scheduler and the HTTP server: one layer at a time.

One process, one loaded model, rounds alternating between:

- ``stream_generate``: mlx-lm's own loop, the reference of the c=1 goal;
- ``scheduler``: the batch scheduler stepped on the main thread (bench_b1's batch lane);
- ``engine``: the server's Engine in-process (its worker thread, warm-up, prompt cache),
  requests submitted one at a time, tokens handed to a no-op;
- ``engine+loop``: the same Engine with the server's bridge to an asyncio loop on the main
  thread, each batch of events encoded as an SSE chunk (the server minus its sockets);
- ``http``: a real ``mlxq serve`` child process on the same model, driven by
  ``mlxq bench serving-load`` at concurrency 1 (``--no-http`` leaves it out).

Each reports decode tok/s and the scheduler's split of a decode step (graph building,
async_eval, token read) and the loop's cycle, so a difference between two layers shows up
in the part of the step it lives in.

    python scripts/server_gap_probe.py --model /tmp/mlxq-models/llama3-8b --out $OUT
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench_b1 import batch_lane

from mlxq.bench.server_timing import split
from mlxq.bench.servers import ServeProcess
from mlxq.engine.engine import Engine, EngineConfig
from mlxq.engine.types import Request, SamplingParams
from mlxq.kv.projection import measure_footprint
from mlxq.models.loader import load_model
from mlxq.server.bridge import stream_event_batches


def totals(timing) -> dict:
    """The scheduler's cumulative counters in the shape bench/server_timing.split reads."""
    return {"steps": timing.steps, **timing.as_dict()["totals"]}


class Prompts:
    """Fresh random prompts, a sequence of its own per variant: the engine layers share one Engine and
    its prompt cache, so a prompt repeated across them would skip its prefill."""

    def __init__(self, length: int, vocab: int, seed: int = 0):
        self.length, self.seed, self.used = length, seed, {}
        self.ids = (min(1000, vocab // 4), min(30000, vocab))  # ordinary tokens, inside the vocabulary

    def next(self, variant: str) -> list[int]:
        i = self.used[variant] = self.used.get(variant, -1) + 1
        rng = random.Random(f"{self.seed}/{variant}/{i}")
        return [rng.randrange(*self.ids) for _ in range(self.length)]


def run_stream_generate(lm, prompts, requests, tokens) -> dict:
    """mlx-lm's own B=1 loop: the reference the c=1 goal is stated against (no split of its own)."""
    import mlx.core as mx
    import mlx_lm

    rates = []
    for _ in range(requests):
        stream = mlx_lm.stream_generate(lm.model, lm.tokenizer, mx.array(prompts.next("stream_generate")),
                                        max_tokens=tokens)
        *_, last = stream
        rates.append(last.generation_tps)
    return {"tok_s": statistics.median(rates), "split": None}


def run_scheduler(lm, footprint, prompts, requests, tokens) -> dict:
    rates, timings = [], []
    for _ in range(requests):
        tok_s, _, timing = batch_lane(lm, footprint, prompts.next("scheduler"), tokens)
        rates.append(tok_s)
        timings.append(timing["totals"] | {"steps": timing["steps"]})
    summed = {k: sum(t.get(k, 0) for t in timings) for k in timings[0]}
    return {"tok_s": statistics.median(rates), "split": split(dict.fromkeys(summed, 0), summed)}


def run_engine(engine, prompts, requests, tokens, variant: str, with_loop: bool) -> dict:
    before = totals(engine.scheduler.timing)
    rates = []
    for i in range(requests):
        request = Request(f"{variant}-{i}", prompts.next(variant), SamplingParams(), tokens, ignore_eos=True)
        if with_loop:
            usage = asyncio.run(_consume(engine, request))
        else:
            done = threading.Event()
            box = {}

            def emit(event, box=box, done=done):
                if event.finish_reason is not None:
                    box["usage"] = event.usage
                    done.set()

            engine.submit(request, emit)
            done.wait()
            usage = box["usage"]
        rates.append(usage.decode_tok_s)
    return {"tok_s": statistics.median(rates), "split": split(before, totals(engine.scheduler.timing))}


async def _consume(engine, request):
    """What the SSE writer does per batch of events, minus the socket."""
    usage = None
    async for batch in stream_event_batches(engine, request):
        text = "".join(event.text for event in batch)
        chunk = {"id": request.request_id, "object": "text_completion", "created": int(time.time()),
                 "model": "probe", "choices": [{"index": 0, "text": text, "logprobs": None,
                                                "finish_reason": None}]}
        _ = f"data: {json.dumps(chunk)}\n\n".encode()
        if batch[-1].finish_reason is not None:
            usage = batch[-1].usage
    return usage


def _with_switch_interval(seconds: float, measure):
    """The GIL hand-off interval between the engine thread and the loop (Python's default: 5 ms)."""
    default = sys.getswitchinterval()
    sys.setswitchinterval(seconds)
    try:
        return measure()
    finally:
        sys.setswitchinterval(default)


def run_http(url: str, requests: int, tokens: int, prompt_words: int, path: Path, seed: int) -> dict | None:
    cmd = [sys.executable, "-m", "mlxq.cli.main", "bench", "serving-load", "--url", url, "--endpoint",
           "completions", "--concurrency", "1", "--num-requests", str(requests), "--prompt-len", str(prompt_words),
           "--max-tokens", str(tokens), "--ignore-eos", "--warmup", "1", "--seed", str(seed), "--json", str(path),
           "--quiet"]
    subprocess.run(cmd, check=False)
    if not path.exists():
        return None
    level = json.loads(path.read_text())["a"][0]
    tpot = level["tpot_ms"]["p50"]  # the decode rate per request, as Usage.decode_tok_s is in-process
    return {"tok_s": 1000 / tpot if tpot else None, "output_tok_s": level["output_throughput_tok_s"],
            "ttft_p50_ms": level["ttft_ms"]["p50"], "split": level.get("server_timing")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=4, help="sequential requests per variant and round")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=180)
    ap.add_argument("--prompt-words", type=int, default=150, help="HTTP prompts (words, ~the same tokens)")
    ap.add_argument("--no-http", action="store_true")
    ap.add_argument("--only", help="comma-separated variants to run (stream_generate is always kept: the reference)")
    ap.add_argument("--switch-interval", type=float, action="append", default=[],
                    help="also run engine+loop under this sys.setswitchinterval (seconds); repeatable")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    lm = load_model(args.model)
    prompts = Prompts(args.prompt_tokens, lm.vocab_size)
    # A first forward on this thread: arrays the model leaves lazy (RoPE frequencies) are computed on its
    # stream; left for the engine thread, CUDA refuses them ("There is no Stream(gpu, 0) in current thread").
    run_stream_generate(lm, prompts, 1, 2)
    engine = Engine(lambda: lm, EngineConfig())  # the server's defaults: warm-up auto, prompt cache auto
    engine.start()
    while not engine.ready.wait(1):
        if engine.fatal_error:
            raise SystemExit(f"the engine failed to start: {engine.fatal_error}")
    if engine.scheduler is None:
        raise SystemExit(f"no batch lane for this model: {engine.fatal_error or engine.gateway.mode}")
    footprint = measure_footprint(lm.model)
    variants = {
        "stream_generate": lambda: run_stream_generate(lm, prompts, args.requests, args.tokens),
        "scheduler": lambda: run_scheduler(lm, footprint, prompts, args.requests, args.tokens),
        "engine": lambda: run_engine(engine, prompts, args.requests, args.tokens, "engine", False),
        "engine+loop": lambda: run_engine(engine, prompts, args.requests, args.tokens, "engine+loop", True),
    }
    for interval in args.switch_interval:
        variants[f"engine+loop si={interval * 1000:g}ms"] = lambda interval=interval: _with_switch_interval(
            interval, lambda: run_engine(engine, prompts, args.requests, args.tokens, "engine+loop", True))
    server = None
    if not args.no_http:
        server = ServeProcess("--model", args.model, log_path=str(args.out / "server.log"))
        server.__enter__()
        calls = iter(range(1_000_000))  # a new seed per call: fresh prompts, no prompt-cache hits

        def http():
            seed = next(calls)
            return run_http(server.url, args.requests, args.tokens, args.prompt_words, args.out / f"http-{seed}.json",
                            seed)

        variants["http"] = http
    if args.only:
        keep = {"stream_generate", *args.only.split(",")}
        variants = {name: fn for name, fn in variants.items() if name in keep}
    for name in variants:  # first use of each path, unrecorded
        if name != "http":
            variants[name]()
    results: dict[str, list] = {name: [] for name in variants}
    try:
        for r in range(args.rounds):
            order = list(variants) if r % 2 == 0 else list(reversed(variants))
            for name in order:
                results[name].append(variants[name]())
                print(f"round {r} {name}: {json.dumps(results[name][-1])}", flush=True)
    finally:
        if server is not None:
            server.__exit__()
    summary = {}
    for name, runs in results.items():
        runs = [x for x in runs if x]
        steps = [x["split"]["step_ms"] for x in runs if x.get("split")]  # none for stream_generate
        summary[name] = {"tok_s_median": statistics.median(x["tok_s"] for x in runs) if runs else None,
                         "step_ms_median": statistics.median(steps) if steps else None}
    for name, s in summary.items():
        # Paired: each round's rate over stream_generate's in the same round (the device drifts between rounds).
        ratios = [x["tok_s"] / ref["tok_s"] for x, ref in zip(results[name], results["stream_generate"], strict=True)
                  if x and x["tok_s"] and ref["tok_s"]]
        s["vs_stream_generate_paired"] = round(statistics.median(ratios), 3) if ratios else None
        s["vs_stream_generate_range"] = [round(min(ratios), 3), round(max(ratios), 3)] if ratios else None
        print(f"{name:22s} {s['tok_s_median'] or 0:8.1f} tok/s  step {s['step_ms_median']} ms  "
              f"x{s['vs_stream_generate_paired']} of stream_generate (rounds {s['vs_stream_generate_range']})")
    (args.out / "server-gap-probe.json").write_text(json.dumps(
        {"model": args.model, "tokens": args.tokens, "prompt_tokens": args.prompt_tokens,
         "requests_per_round": args.requests, "summary": summary, "runs": results}, indent=1))
    engine.stop(10)


if __name__ == "__main__":
    main()
