"""Grammar-constrained decode throughput vs unconstrained, side by side on one server.

Starts ``mlxq serve`` (the embedded default model unless --model) with
``--batch C`` and runs rounds of C concurrent chat requests in three mixes,
interleaved so machine noise hits each alike:

- free:    C unconstrained requests (ignore_eos, max_tokens fixed)
- grammar: C requests with a json_schema response_format
- mixed:   C/2 of each, batched together (are free rows slowed by grammar rows?)

Throughput is completion tokens / wall time of the round (decode-dominated:
short prompts). Mask time per step comes from /stats.grammar.

    python scripts/bench_structured.py [--concurrency 8] [--rounds 3] [--model PATH]
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from mlxq.bench.servers import ServeProcess

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "items": {"type": "array", "items": {"type": "string", "minLength": 8, "maxLength": 24},
                  "minItems": 6, "maxItems": 6},
        "score": {"type": "integer", "minimum": 0, "maximum": 1000},
        "kind": {"enum": ["alpha", "beta", "gamma"]},
    },
    "required": ["title", "items", "score", "kind"],
    "additionalProperties": False,
}
FREE_TOKENS = 128


def body(i: int, grammar: bool) -> dict:
    out = {"messages": [{"role": "user", "content": f"Write record number {i}."}], "temperature": 0.8, "seed": i}
    if grammar:
        out |= {"max_tokens": 400, "response_format": {
            "type": "json_schema", "json_schema": {"name": "record", "schema": SCHEMA, "strict": True}}}
    else:
        out |= {"max_tokens": FREE_TOKENS, "ignore_eos": True}
    return out


def one(url: str, payload: dict) -> tuple[int, float]:
    start = time.perf_counter()
    r = httpx.post(url + "/v1/chat/completions", json=payload, timeout=600)
    r.raise_for_status()
    return r.json()["usage"]["completion_tokens"], time.perf_counter() - start


def run_round(url: str, kinds: list[bool]) -> dict:
    """kinds[i]: request i has a grammar. Returns tok/s overall and per kind (tokens / that kind's wall)."""
    start = time.perf_counter()
    with ThreadPoolExecutor(len(kinds)) as pool:
        results = list(pool.map(lambda a: one(url, body(*a)), enumerate(kinds)))
    wall = time.perf_counter() - start
    out = {"all": sum(n for n, _ in results) / wall}
    for label, flag in (("grammar", True), ("free", False)):
        mine = [(n, s) for (n, s), k in zip(results, kinds, strict=True) if k == flag]
        if mine:
            out[label] = sum(n for n, _ in mine) / max(s for _, s in mine)
    return out


def grammar_stats(url: str) -> dict:
    return httpx.get(url + "/stats").json()["grammar"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default=None)
    args = parser.parse_args()
    c = args.concurrency
    mixes = {"free": [False] * c, "grammar": [True] * c, "mixed": [i % 2 == 0 for i in range(c)]}
    serve = ["--batch", str(c), "--log-level", "warning"] + (["--model", args.model] if args.model else [])
    with ServeProcess(*serve) as server:
        run_round(server.url, mixes["mixed"])  # warm-up: compile paths, build llguidance's tokenizer
        samples: dict[str, list[dict]] = {name: [] for name in mixes}
        before = grammar_stats(server.url)
        for _ in range(args.rounds):
            for name, kinds in mixes.items():
                samples[name].append(run_round(server.url, kinds))
        after = grammar_stats(server.url)
    base = statistics.median(s["all"] for s in samples["free"])
    print(f"| mix (c={c}) | tok/s (median of {args.rounds}) | vs free | free rows' tok/s | grammar rows' tok/s |")
    print("|---|---|---|---|---|")
    for name, rounds in samples.items():
        med = statistics.median(s["all"] for s in rounds)
        free = statistics.median(s["free"] for s in rounds) if "free" in rounds[0] else None
        gram = statistics.median(s["grammar"] for s in rounds) if "grammar" in rounds[0] else None
        cells = [name, f"{med:.1f}", f"{med / base:.2f}x",
                 f"{free:.1f}" if free else "-", f"{gram:.1f}" if gram else "-"]
        print("| " + " | ".join(cells) + " |")
    masks = after["masks"] - before["masks"]
    ms = (after["mask_ms_mean"] * after["masks"] - before["mask_ms_mean"] * before["masks"]) / max(masks, 1)
    print(f"\nmasks computed: {masks}, mean host time per row-mask: {ms:.3f} ms")


if __name__ == "__main__":
    main()
