"""What parsing an agent's chat request costs the server (before it reaches the engine), with and without
the system heads kept (server/system_heads.py; with them, where chats are cut for tokenizing:
server/head_split.py), side by side.

    python scripts/bench_request_parse.py --model DIR --system-words 1300 --requests 64 --rounds 3 [--threads 40]
    python scripts/bench_request_parse.py --model DIR --system-words 14500 --requests 64 --rounds 5 --as-served

``--as-served`` parses each round's bodies at once on an event loop as the server's routes do
(``offload.off_loop_unless_small``: on the loop, or in Starlette's thread pool, whichever the imported
code picks for the body's size) from their JSON bytes, heads kept, and prints the round's wall time and
each body's time to its parsed request (p50 / p95); run it with PYTHONPATH on two checkouts to compare.

Each round parses ``--requests`` chat bodies (one shared system prompt, each its own 40-word question)
with ``protocol.parse_generation`` twice: once clearing the kept heads before every request (each
renders its system messages again, as before), once keeping them; prints ms per request.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import time
from concurrent.futures import ThreadPoolExecutor

from mlxq.bench.datasets import _text, corpus_words
from mlxq.models.loader import load_model
from mlxq.server import system_heads
from mlxq.server.protocol import parse_generation


def per_request_ms(bodies: list[dict], lm, keep: bool) -> float:
    forget()
    start = time.perf_counter()
    for body in bodies:
        if not keep:
            forget()
        parse_generation(body, "chat", lm)
    return round(1000 * (time.perf_counter() - start) / len(bodies), 2)


def burst_ms(bodies: list[dict], lm, threads: int) -> dict:
    """Every body parsed at once in ``threads`` worker threads (as the server's thread pool takes a burst),
    heads kept: the burst's wall time and its slowest parse, ms."""
    done = []

    def parse(body: dict) -> None:
        start = time.perf_counter()
        parse_generation(body, "chat", lm)
        done.append(time.perf_counter() - start)

    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(parse, bodies))
    return {"burst_wall_ms": round(1000 * (time.perf_counter() - start), 1), "slowest_ms": round(1000 * max(done), 1)}


def as_served_ms(raws: list[bytes], lm) -> dict:
    """Every body parsed at once on an event loop, the way the server's routes parse them (heads kept)."""
    import asyncio

    from mlxq.server import offload
    from mlxq.server.json_body import parse_json_body

    def parse(raw: bytes):
        return parse_generation(parse_json_body(raw), "chat", lm)

    async def one(raw: bytes, start: float) -> float:
        await asyncio.sleep(0)  # every route starts before the first parses, as in a burst
        await offload.off_loop_unless_small(len(raw), parse, raw)
        return time.perf_counter() - start

    async def burst() -> list[float]:
        start = time.perf_counter()
        return await asyncio.gather(*(one(raw, start) for raw in raws))

    done = sorted(asyncio.run(burst()))
    ms = [1000 * d for d in done]
    return {"wall_ms": round(ms[-1], 1), "p50_ms": round(ms[len(ms) // 2], 1),
            "p95_ms": round(ms[min(len(ms) - 1, int(0.95 * len(ms)))], 1)}


def forget() -> None:
    """Nothing kept: the system head rendered and the whole chat tokenized again (server/head_split.py)."""
    system_heads._heads.clear()
    getattr(system_heads, "_splits", {}).clear()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--system-words", type=int, default=1300)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="also parse a round's bodies at once in this many threads")
    ap.add_argument("--as-served", action="store_true", help="only: parse each round's bodies at once as routes do")
    args = ap.parse_args()
    lm = load_model(args.model)
    words, rng = corpus_words(), random.Random(0)
    system = "You are one of many agents. " + _text(rng, words, args.system_words)
    bodies = [{"model": "m", "max_tokens": 64, "messages": [{"role": "system", "content": system},
                                                            {"role": "user", "content": _text(rng, words, 40)}]}
              for _ in range(args.requests)]
    parse_generation(bodies[0], "chat", lm)  # first-use costs
    gc.freeze()  # as the server does once its model is loaded (server/run.py)
    if args.as_served:
        raws = [json.dumps(body | {"stream": True}).encode() for body in bodies]
        as_served_ms(raws, lm)  # the split and the head found, first-use costs
        for round_no in range(args.rounds):
            print(json.dumps({"round": round_no, "body_bytes": len(raws[0])} | as_served_ms(raws, lm)), flush=True)
        return
    for round_no in range(args.rounds):
        fresh, kept = per_request_ms(bodies, lm, keep=False), per_request_ms(bodies, lm, keep=True)
        burst = burst_ms(bodies, lm, args.threads) if args.threads else {}
        print(json.dumps({"round": round_no, "rendered_each_time_ms": fresh, "heads_kept_ms": kept,
                          "ratio": round(kept / fresh, 3)} | burst), flush=True)


if __name__ == "__main__":
    main()
