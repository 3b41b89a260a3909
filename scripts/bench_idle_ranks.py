"""CPU an idle `mlxq serve --tensor-parallel N` spends, per process, while no request is open.

Starts the server (its launcher and its ranks), sends one short request so that every rank has served,
waits ``--settle`` seconds, then reads each process's CPU time (user + system, /proc/PID/stat) at the
start and end of ``--seconds`` of idle and prints one JSON line: the CPU seconds each process used and
that as a share of one core, then the latency of one-token requests each sent after 1.5 s of idle
(``--wake-samples``): what waking the ranks costs. Run it from the checkout whose code to measure
(``--code LABEL=DIR`` puts another checkout first on PYTHONPATH, to compare versions in one run).

    python scripts/bench_idle_ranks.py --model /tmp/tiny-default --seconds 10
    python scripts/bench_idle_ranks.py --model /tmp/tiny-default --code before=/tmp/main --code after=. --rounds 3
"""

from __future__ import annotations

import argparse
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

from mlxq.bench.servers import cpu_seconds, free_port, wait_healthy  # noqa: E402


def measure(label: str, code: Path, args: argparse.Namespace) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": f"{code}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    model = str(Path(args.model).resolve()) if Path(args.model).exists() else args.model
    cmd = [sys.executable, "-m", "mlxq.cli.main", "serve", "--model", model, "--port", str(port),
           "--tensor-parallel", str(args.ranks), "--log-level", "warning", "--warmup", "off", *args.serve_args.split()]
    # cwd: `python -m` puts it first on sys.path, ahead of PYTHONPATH
    proc = subprocess.Popen(cmd, env=env, cwd=code, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(url, proc, timeout_s=180)
        body = {"prompt": "Idle ranks", "max_tokens": 8, "temperature": 0}
        httpx.post(f"{url}/v1/completions", json=body, timeout=120).raise_for_status()
        ranks = httpx.get(f"{url}/stats", timeout=30).json()["distributed"].get("ranks", [])
        pids = {"launcher": proc.pid, **{f"rank{r['rank']}": r["pid"] for r in ranks}}  # --ranks 1: the server
        for rank in ranks if args.pin else ():  # every thread of rank r on core r
            subprocess.run(["taskset", "-a", "-p", "-c", str(rank["rank"] % os.cpu_count()), str(rank["pid"])],
                           check=True, capture_output=True)
        time.sleep(args.settle)
        before = {name: cpu_seconds(pid) for name, pid in pids.items()}
        started = time.monotonic()
        time.sleep(args.seconds)
        after = {name: cpu_seconds(pid) for name, pid in pids.items()}
        wall = time.monotonic() - started
        woken = []  # one-token requests, each after 1.5 s of idle (every rank asleep, where they sleep)
        for _ in range(args.wake_samples):
            time.sleep(1.5)
            sent = time.perf_counter()
            httpx.post(f"{url}/v1/completions", json={**body, "max_tokens": 1}, timeout=120).raise_for_status()
            woken.append(round(1e3 * (time.perf_counter() - sent), 1))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    used = {name: round(after[name] - before[name], 2) for name in pids}
    return {"code": label, "pinned": args.pin, "idle_s": round(wall, 2), "cpu_s": used,
            "core_share": {name: round(s / wall, 3) for name, s in used.items()}, "after_idle_ms": woken,
            "after_idle_ms_median": statistics.median(woken) if woken else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--ranks", type=int, default=2, help="1: one process, to compare with")
    parser.add_argument("--seconds", type=float, default=10.0, help="idle time measured")
    parser.add_argument("--settle", type=float, default=3.0, help="idle time before measuring")
    parser.add_argument("--code", action="append", default=[], help="LABEL=DIR: a checkout to measure (repeat)")
    parser.add_argument("--serve-args", default="")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--pin", action="store_true", help="pin rank r to core r (taskset), once it serves")
    parser.add_argument("--wake-samples", type=int, default=8, help="one-token requests timed after idle")
    args = parser.parse_args()
    for round_ in range(args.rounds):  # the versions alternate: the machine's load falls on each alike
        for spec in args.code or [f"this={ROOT}"]:
            label, _, path = spec.partition("=")
            print(json.dumps({"round": round_, **measure(label, Path(path).resolve(), args)}), flush=True)


if __name__ == "__main__":
    main()
