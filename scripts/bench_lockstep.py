"""What the ranks' per-iteration exchange costs a decode step: one process vs `--tensor-parallel 2`.

Starts each server in turn (``--mode pipeline``: `--pipeline-parallel`), sends ``--requests`` greedy
completions at each concurrency (EOS ignored), and prints one JSON line per server and concurrency,
from the difference of the servers' own counters before and after the load:

- ``cycle_ms``: decode step start to the next step's start (`/stats.batch.decode_timing`);
- ``exchange_ms``: time in the lockstep exchange per loop iteration (`/stats.distributed`);
- ``collectives``: the exchange's collectives per iteration;
- ``tok_s``: generated tokens per second of wall time.

    python scripts/bench_lockstep.py --model /tmp/tiny --concurrency 1,4 --max-tokens 64 --requests 4
    python scripts/bench_lockstep.py --model /tmp/tiny --servers 1,2 --code before=/tmp/before --rounds 3 \
        --one-at-a-time
    python scripts/bench_lockstep.py --model /tmp/m8 --concurrency 1,64 --max-tokens 128 --requests 4 \
        --serve-args "--batch 64 --memory-limit 60GB --warmup off"
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mlxq.bench.servers import free_port, wait_healthy  # noqa: E402

PROMPT = "Tensor parallel serving splits every layer of the model over several processes. " * 4


def counters(url: str) -> dict:
    stats = httpx.get(f"{url}/stats", timeout=30).json()
    timing = stats["batch"]["decode_timing"]["totals"]
    ranks = stats.get("distributed", {})
    totals = ranks.get("totals", {})
    return {"cycles": timing["cycles"], "cycle_s": timing["cycle_s"], "iterations": ranks.get("iterations", 0),
            "exchange_s": totals.get("exchange_s", ranks.get("exchange_ms_per_iteration", 0) * ranks.get(
                "iterations", 0) / 1e3), "collectives": totals.get("collectives", 0),
            "generated": stats["engine"]["generated_tokens"]}


def load(url: str, concurrency: int, requests: int, max_tokens: int) -> float:
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}

    def one(_):
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
        response.raise_for_status()

    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, range(requests)))
    return time.perf_counter() - started


def measure(url: str, concurrency: int, args) -> dict:
    load(url, concurrency, concurrency, 8)  # warm: the batch shapes at this concurrency
    before = counters(url)
    wall = load(url, concurrency, max(args.requests, concurrency), args.max_tokens)
    after = counters(url)
    delta = {k: after[k] - before[k] for k in before}
    per_iteration = (lambda v: round(v / delta["iterations"], 3)) if delta["iterations"] else (lambda v: None)
    return {"concurrency": concurrency, "tok_s": round(delta["generated"] / wall, 1),
            "cycle_ms": round(1e3 * delta["cycle_s"] / delta["cycles"], 3) if delta["cycles"] else None,
            "iterations_per_step": round(delta["iterations"] / max(delta["cycles"], 1), 2),
            "exchange_ms": per_iteration(1e3 * delta["exchange_s"]),
            "collectives": per_iteration(delta["collectives"])}


def start(model: str, world: int, code: Path, args) -> tuple[str, subprocess.Popen]:
    """`mlxq serve` from ``code`` (its own checkout: ``python -m`` imports from the working directory)."""
    port = free_port()
    extra = [f"--{args.mode}-parallel", str(world)] if world > 1 else []
    cmd = [sys.executable, "-m", "mlxq.cli.main", "serve", "--model", model, "--port", str(port),
           "--log-level", "warning", *args.serve_args.split(), *extra]
    env = {"CUDA_VISIBLE_DEVICES": "0"} if world == 1 else {}  # one GPU; the launcher gives each rank one
    env["PYTHONPATH"] = str(code)
    proc = subprocess.Popen(cmd, cwd=code, env={**os.environ, **env}, stdout=subprocess.DEVNULL)
    return f"http://127.0.0.1:{port}", proc


def run_servers(specs: list[tuple[str, Path, int]], round_: int | None, args) -> list[dict]:
    """Start ``specs`` (label, code, world) together and measure each in turn: ``args.rounds`` rounds,
    or the one round ``round_``."""
    servers = {(label, world): start(args.model, world, code, args) for label, code, world in specs}
    rows = []
    try:
        for url, proc in servers.values():
            wait_healthy(url, proc, timeout_s=300)
        for r in range(args.rounds) if round_ is None else [round_]:
            for (label, world), (url, _) in servers.items():
                for concurrency in [int(c) for c in args.concurrency.split(",")]:
                    rows.append({"code": label, "world": world, "round": r, **measure(url, concurrency, args)})
                    print(json.dumps(rows[-1]), flush=True)
    finally:
        for _, proc in servers.values():
            proc.terminate()
        for _, proc in servers.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--concurrency", default="1,4")
    parser.add_argument("--requests", type=int, default=4, help="per concurrency level (at least the level)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--serve-args", default="--warmup off")
    parser.add_argument("--servers", default="1,2", help="world sizes to run (1: one process)")
    parser.add_argument("--mode", choices=("tensor", "pipeline"), default="tensor")
    parser.add_argument("--code", action="append", default=[], metavar="LABEL=DIR",
                        help="also serve another checkout's mlxq (e.g. before=/tmp/before), side by side")
    parser.add_argument("--rounds", type=int, default=1, help="rounds over every server, alternating")
    parser.add_argument("--one-at-a-time", action="store_true", help="start each server for its turn only")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # a stopped run still stops its servers
    codes = [("this", ROOT)] + [(label, Path(d).resolve()) for label, d in (c.split("=", 1) for c in args.code)]
    specs = [(label, code, world) for label, code in codes for world in [int(w) for w in args.servers.split(",")]]
    rows = []
    if args.one_at_a_time:  # idle servers' other ranks poll (ring backend): none beside the one measured
        for round_ in range(args.rounds):
            for spec in specs:
                rows += run_servers([spec], round_, args)
    else:
        rows = run_servers(specs, None, args)
    for key in sorted({(r["code"], r["world"], r["concurrency"]) for r in rows}):
        mine = [r for r in rows if (r["code"], r["world"], r["concurrency"]) == key]
        print(json.dumps({"median": dict(zip(("code", "world", "concurrency"), key, strict=True)),
                          **{k: statistics.median(r[k] for r in mine) if mine[0][k] is not None else None
                             for k in ("tok_s", "cycle_ms", "exchange_ms", "collectives")}}))


if __name__ == "__main__":
    main()
