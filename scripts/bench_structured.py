"""Grammar-constrained decode throughput vs unconstrained, side by side on one server.

Starts ``mlxq serve`` (the embedded default model unless --model) with
``--batch C``; C closed-loop clients (each sends its next request when the
last one returns, for --seconds) in three mixes, rounds interleaved so
machine noise hits each alike:

- free:    C unconstrained requests (ignore_eos; max_tokens spread evenly
           over 0.5-1.5x a mean that is by default the grammar requests'
           mean length in a warm-up round: both kinds join the batch as
           often and at staggered steps, as JSON of varying length does, so
           the ratio measures the cost per token, not the cost of shorter
           requests or of rows that join out of step)
- grammar: C requests with a json_schema response_format
- mixed:   C/2 of each, batched together (are free rows slowed by grammar rows?)

Throughput is completion tokens / wall time of the loop (decode-dominated:
short prompts); the per-kind columns split it by the clients' kind. On a
shared host wall time swings with the neighbours' load, so each mix also
reports tokens per second of the server process's CPU time (Linux), a
ratio that load moves far less. Per
mix, from /stats read around each round: the decode step's mean time and
host time computing masks per step (/stats.batch.decode_timing,
/stats.grammar).

    python scripts/bench_structured.py [--concurrency 8] [--rounds 3] [--model PATH] [--free-tokens N]
"""

from __future__ import annotations

import argparse
import os
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
GRAMMAR_MAX_TOKENS = 400
GOLDEN = 0.6180339887  # i * GOLDEN mod 1 spreads request i's length evenly, the same in every run


def body(i: int, grammar: bool, free_tokens: int) -> dict:
    out = {"messages": [{"role": "user", "content": f"Write record number {i}."}], "temperature": 0.8, "seed": i}
    if grammar:
        out |= {"max_tokens": GRAMMAR_MAX_TOKENS, "response_format": {
            "type": "json_schema", "json_schema": {"name": "record", "schema": SCHEMA, "strict": True}}}
    else:
        out |= {"max_tokens": max(1, round(free_tokens * (0.5 + (i * GOLDEN) % 1.0))), "ignore_eos": True}
    return out


def one(url: str, payload: dict) -> tuple[int, float]:
    start = time.perf_counter()
    r = httpx.post(url + "/v1/chat/completions", json=payload, timeout=600)
    r.raise_for_status()
    return r.json()["usage"]["completion_tokens"], time.perf_counter() - start


def run_round(url: str, kinds: list[bool], seconds: float, free_tokens: int) -> dict:
    """Closed loop: client i sends requests of kind kinds[i] (True: grammar) back to back for ``seconds``,
    so the batch stays full whatever each request's length. Returns tok/s overall and per kind, and the
    grammar requests' mean completion tokens."""
    start = time.perf_counter()

    def client(i: int) -> tuple[int, int]:
        tokens, n = 0, 0
        while time.perf_counter() - start < seconds:
            tokens += one(url, body(1000 * n + i, kinds[i], free_tokens))[0]
            n += 1
        return tokens, n

    with ThreadPoolExecutor(len(kinds)) as pool:
        done = list(pool.map(client, range(len(kinds))))
    wall = time.perf_counter() - start
    tokens = [t for t, _ in done]
    grammar_requests = sum(n for (_, n), k in zip(done, kinds, strict=True) if k)
    out = {"all": sum(tokens) / wall,
           "grammar_request_tokens": sum(t for t, k in zip(tokens, kinds, strict=True) if k) / max(grammar_requests, 1)}
    for label, flag in (("grammar", True), ("free", False)):
        mine = [n for n, k in zip(tokens, kinds, strict=True) if k == flag]
        if mine:
            out[label] = sum(mine) / wall
    return out


def step_counters(url: str) -> dict:
    """Cumulative decode steps and their seconds, and mask-computing steps and their host seconds."""
    stats = httpx.get(url + "/stats").json()
    decode, grammar = stats["batch"]["decode_timing"], stats["grammar"]
    return {"decode_steps": decode["steps"], "decode_s": decode["totals"]["step_s"],
            "tokens": stats["engine"]["generated_tokens"],
            # servers before /stats.grammar.steps: every decode step of a grammar-only round computes masks
            "mask_steps": grammar.get("steps", decode["steps"]), "masks": grammar["masks"],
            "mask_s": grammar["mask_ms_mean"] * grammar["masks"] / 1e3}


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of process ``pid`` (all its threads), from /proc; None elsewhere."""
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measured_round(url: str, pid: int, kinds: list[bool], seconds: float, free_tokens: int) -> dict:
    """``run_round`` plus what /stats saw during it (decode ms per step, mask host ms per step) and
    completion tokens per second of the server's CPU time."""
    before, cpu = step_counters(url), cpu_seconds(pid)
    start = time.perf_counter()
    out = run_round(url, kinds, seconds, free_tokens)
    wall = time.perf_counter() - start
    if cpu is not None:
        out["tok_per_cpu_s"] = out["all"] * wall / (cpu_seconds(pid) - cpu)
    delta = {k: v - before[k] for k, v in step_counters(url).items()}
    out["step_ms"] = 1e3 * delta["decode_s"] / max(delta["decode_steps"], 1)
    out["rows_per_step"] = delta["tokens"] / max(delta["decode_steps"], 1)  # token 0s included: an estimate
    out["mask_ms_step"] = 1e3 * delta["mask_s"] / max(delta["mask_steps"], 1)
    out["masks"] = delta["masks"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=20.0, help="length of one mix's closed loop")
    parser.add_argument("--model", default=None)
    parser.add_argument("--free-tokens", type=int, default=0,
                        help="free requests' max_tokens (0: the grammar requests' mean length in the warm-up)")
    args = parser.parse_args()
    c = args.concurrency
    mixes = {"free": [False] * c, "grammar": [True] * c, "mixed": [i % 2 == 0 for i in range(c)]}
    serve = ["--batch", str(c), "--log-level", "warning"] + (["--model", args.model] if args.model else [])
    with ServeProcess(*serve) as server:
        # Warm-up (compile paths, build llguidance's tokenizer), which also measures the grammar requests' length.
        warm = run_round(server.url, mixes["grammar"], 1.0, 1)
        free_tokens = args.free_tokens or max(1, round(warm["grammar_request_tokens"]))
        run_round(server.url, mixes["mixed"], 1.0, free_tokens)
        print(f"free requests: {free_tokens} tokens on average (the grammar requests' mean in the warm-up)",
              flush=True)
        print(f"| mix (c={c}) | tok/s (median of {args.rounds}) | vs free | free clients' tok/s "
              "| grammar clients' tok/s | decode step ms | mask host ms per step | masks "
              "| tok per server CPU s | vs free | rows per step |", flush=True)
        print("|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
        samples: dict[str, list[dict]] = {name: [] for name in mixes}
        for r in range(args.rounds):
            for name, kinds in mixes.items():
                samples[name].append(measured_round(server.url, server.proc.pid, kinds, args.seconds, free_tokens))
                if r == args.rounds - 1:  # each row as soon as it is final: a run cut short keeps what it has
                    print(table_row(name, samples[name], samples["free"]), flush=True)
    lengths = [s["grammar_request_tokens"] for name in ("grammar", "mixed") for s in samples[name]]
    print(f"\ngrammar requests: {statistics.mean(lengths):.1f} tokens on average")


def table_row(name: str, runs: list[dict], free_runs: list[dict]) -> str:
    def median(key: str) -> float | None:
        return statistics.median(s[key] for s in runs) if key in runs[0] else None

    base = statistics.median(s["all"] for s in free_runs)
    med, free, gram = median("all"), median("free"), median("grammar")
    cells = [name, f"{med:.1f}", f"{med / base:.2f}x", f"{free:.1f}" if free else "-",
             f"{gram:.1f}" if gram else "-", f"{median('step_ms'):.2f}",
             f"{median('mask_ms_step'):.3f}" if name != "free" else "-", str(sum(s["masks"] for s in runs))]
    per_cpu, base_cpu = median("tok_per_cpu_s"), statistics.median(s.get("tok_per_cpu_s", 0) for s in free_runs)
    cells += [f"{per_cpu:.1f}", f"{per_cpu / base_cpu:.2f}x"] if per_cpu and base_cpu else ["-", "-"]
    cells.append(f"{median('rows_per_step'):.2f}")
    return "| " + " | ".join(cells) + " |"

if __name__ == "__main__":
    main()
