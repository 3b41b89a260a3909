"""Decode throughput with LoRA adapters: mixed-adapter batches vs base-only, side by side on one server.

Writes ``--adapters`` random rank ``--rank`` adapters on every linear layer of the
model (models/tiny_adapter.py), starts ``mlxq serve --batch C --adapter ...``
and runs C closed-loop clients (each sends its next request when the last one
returns, for --seconds) in these mixes, rounds interleaved so machine noise
hits each alike:

- base:      every client on the base model (no adapter arithmetic at all)
- one:       every client on adapter 0: the steady state of grouping by
             adapter (one adapter per batch), an upper bound for that
             policy, which also drains between groups
- mixed:     clients spread over all adapters (client i on adapter i mod N):
             every step applies each row's own low-rank update
- mixed+base: clients spread over the base and all adapters

Requests: a short prompt, greedy, ignore_eos, ``--max-tokens`` each: decode-bound.
Throughput is completion tokens / wall time of the loop; decode step ms from /stats.

    python scripts/bench_adapters.py [--model PATH] [--concurrency 8[,16...]] [--adapters 2] [--rank 16]
                                     [--rounds 3] [--seconds 20] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from bench_structured import cpu_seconds  # scripts/ is on the path when run as a script

from mlxq.bench.servers import ServeProcess

BASE = "base"


def one(url: str, model: str, i: int, max_tokens: int) -> int:
    body = {"model": model, "prompt": f"Record {i}: the adapter says", "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0.0}
    r = httpx.post(url + "/v1/completions", json=body, timeout=600)
    r.raise_for_status()
    return r.json()["usage"]["completion_tokens"]


def run_round(url: str, models: list[str], seconds: float, max_tokens: int) -> float:
    """Closed loop: client i sends requests for models[i] back to back; completion tokens per second."""
    start = time.perf_counter()

    def client(i: int) -> int:
        tokens, n = 0, 0
        while time.perf_counter() - start < seconds:
            tokens += one(url, models[i], 1000 * n + i, max_tokens)
            n += 1
        return tokens

    with ThreadPoolExecutor(len(models)) as pool:
        total = sum(pool.map(client, range(len(models))))
    return total / (time.perf_counter() - start)


def decode_counters(url: str) -> tuple[int, float]:
    timing = httpx.get(url + "/stats").json()["batch"]["decode_timing"]
    return timing["steps"], timing["totals"]["step_s"]


def measured(url: str, pid: int, models: list[str], seconds: float, max_tokens: int) -> dict:
    """One round, with the decode step's mean time and tokens per second of the server's CPU time
    (on a shared host wall time swings with the neighbours' load; CPU time far less)."""
    steps, step_s = decode_counters(url)
    cpu, start = cpu_seconds(pid), time.perf_counter()
    tok_s = run_round(url, models, seconds, max_tokens)
    wall = time.perf_counter() - start
    steps2, step_s2 = decode_counters(url)
    out = {"tok_s": tok_s, "step_ms": 1e3 * (step_s2 - step_s) / max(steps2 - steps, 1)}
    if cpu is not None:
        out["tok_per_cpu_s"] = tok_s * wall / max(cpu_seconds(pid) - cpu, 1e-9)
    return out


def mixes(concurrency: int, names: list[str]) -> dict[str, list[str]]:
    everyone = [BASE, *names]
    return {"base": [BASE] * concurrency, "one": [names[0]] * concurrency,
            "mixed": [names[i % len(names)] for i in range(concurrency)],
            "mixed+base": [everyone[i % len(everyone)] for i in range(concurrency)]}


def summary(runs: list[dict], base_runs: list[dict]) -> dict:
    def median(key: str, of: list[dict]) -> float:
        return statistics.median(s.get(key, 0.0) for s in of)

    row = {key: median(key, runs) for key in ("tok_s", "step_ms", "tok_per_cpu_s")}
    row["vs_base"] = row["tok_s"] / median("tok_s", base_runs)
    if row["tok_per_cpu_s"]:
        row["cpu_vs_base"] = row["tok_per_cpu_s"] / median("tok_per_cpu_s", base_runs)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model directory (default: the embedded tiny model)")
    parser.add_argument("--concurrency", default="8", help="comma-separated levels, e.g. 32,64 (one server)")
    parser.add_argument("--adapters", type=int, default=2)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--warmup-seconds", type=float, default=1.0)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here (after each level)")
    parser.add_argument("--serve-arg", action="append", default=[], help="extra `mlxq serve` flag")
    args = parser.parse_args()
    from mlxq.models.default import ensure_default_model
    from mlxq.models.tiny_adapter import make_tiny_adapter

    model = Path(args.model) if args.model else ensure_default_model()
    work = Path(tempfile.mkdtemp(prefix="mlxq-adapters-"))
    names = [f"a{i}" for i in range(args.adapters)]
    flags = []
    for i, name in enumerate(names):
        made = make_tiny_adapter(model, work / name, seed=i, rank=args.rank)
        flags += ["--adapter", f"{name}={made}"]
    levels = [int(c) for c in args.concurrency.split(",")]
    serve = ["--model", str(model), "--served-model-name", BASE, "--batch", str(max(levels)), "--prompt-cache", "0",
             *flags, *args.serve_arg]
    results: dict = {"adapters": args.adapters, "rank": args.rank, "max_tokens": args.max_tokens, "levels": {}}
    with ServeProcess(*serve, timeout_s=900) as server:
        for c in levels:
            results["levels"][c] = run_level(server, c, names, args)
            if args.out:
                args.out.write_text(json.dumps(results, indent=2) + "\n")


def run_level(server: ServeProcess, c: int, names: list[str], args) -> dict:
    """Every mix at concurrency ``c``, rounds interleaved; prints the table as it goes."""
    plan = mixes(c, names)
    for models in plan.values():  # warm-up: every path once at this batch size
        run_round(server.url, models, args.warmup_seconds, 8)
    samples: dict[str, list[dict]] = {name: [] for name in plan}
    for _ in range(args.rounds):
        for name, models in plan.items():
            samples[name].append(measured(server.url, server.proc.pid, models, args.seconds, args.max_tokens))
    print(f"| mix (c={c}, {args.adapters} adapters, rank {args.rank}) | tok/s (median of {args.rounds}) "
          "| vs base | decode step ms | tok per server CPU s | vs base |", flush=True)
    print("|---|---|---|---|---|---|", flush=True)
    out = {}
    for name, runs in samples.items():
        out[name] = row = summary(runs, samples["base"])
        print(f"| {name} | {row['tok_s']:.1f} | {row['vs_base']:.2f}x | {row['step_ms']:.2f} | "
              f"{row.get('tok_per_cpu_s', 0):.1f} | {row.get('cpu_vs_base', 0):.2f}x |", flush=True)
    return out


if __name__ == "__main__":
    main()
