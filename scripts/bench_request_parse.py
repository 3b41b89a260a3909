"""What parsing an agent's chat request costs the server (before it reaches the engine), with and without
the system heads kept (server/system_heads.py; with them, where chats are cut for tokenizing:
server/head_split.py), side by side.

    python scripts/bench_request_parse.py --model DIR --system-words 1300 --requests 64 --rounds 3

Each round parses ``--requests`` chat bodies (one shared system prompt, each its own 40-word question)
with ``protocol.parse_generation`` twice: once clearing the kept heads before every request (each
renders its system messages again, as before), once keeping them; prints ms per request.
"""

from __future__ import annotations

import argparse
import json
import random
import time

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


def forget() -> None:
    """Nothing kept: the system head rendered and the whole chat tokenized again (server/head_split.py)."""
    system_heads._heads.clear()
    system_heads._splits.clear()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--system-words", type=int, default=1300)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    lm = load_model(args.model)
    words, rng = corpus_words(), random.Random(0)
    system = "You are one of many agents. " + _text(rng, words, args.system_words)
    bodies = [{"model": "m", "max_tokens": 64, "messages": [{"role": "system", "content": system},
                                                            {"role": "user", "content": _text(rng, words, 40)}]}
              for _ in range(args.requests)]
    parse_generation(bodies[0], "chat", lm)  # first-use costs
    for round_no in range(args.rounds):
        fresh, kept = per_request_ms(bodies, lm, keep=False), per_request_ms(bodies, lm, keep=True)
        print(json.dumps({"round": round_no, "rendered_each_time_ms": fresh, "heads_kept_ms": kept,
                          "ratio": round(kept / fresh, 3)}), flush=True)


if __name__ == "__main__":
    main()
