"""CPU an idle `mlxq serve --tensor-parallel N` spends, per process, while no request is open.

Starts the server (its launcher and its ranks), sends one short request so that every rank has served,
waits ``--settle`` seconds, then reads each process's CPU time (user + system, /proc/PID/stat) at the
start and end of ``--seconds`` of idle and prints one JSON line: the CPU seconds each process used and
that as a share of one core. Run it from the checkout whose code to measure (``--code DIR`` puts another
checkout first on PYTHONPATH, to compare two versions in one run).

    python scripts/bench_idle_ranks.py --model /tmp/tiny-default --seconds 10
    python scripts/bench_idle_ranks.py --model /tmp/tiny-default --code before=/tmp/main --code after=.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
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
    cmd = [sys.executable, "-m", "mlxq.cli.main", "serve", "--model", args.model, "--port", str(port),
           "--tensor-parallel", str(args.ranks), "--log-level", "warning", "--warmup", "off", *args.serve_args.split()]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(url, proc, timeout_s=180)
        body = {"prompt": "Idle ranks", "max_tokens": 8, "temperature": 0}
        httpx.post(f"{url}/v1/completions", json=body, timeout=120).raise_for_status()
        ranks = httpx.get(f"{url}/stats", timeout=30).json()["distributed"]["ranks"]
        pids = {"launcher": proc.pid, **{f"rank{r['rank']}": r["pid"] for r in ranks}}
        time.sleep(args.settle)
        before = {name: cpu_seconds(pid) for name, pid in pids.items()}
        started = time.monotonic()
        time.sleep(args.seconds)
        after = {name: cpu_seconds(pid) for name, pid in pids.items()}
        wall = time.monotonic() - started
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    used = {name: round(after[name] - before[name], 2) for name in pids}
    return {"code": label, "idle_s": round(wall, 2), "cpu_s": used,
            "core_share": {name: round(s / wall, 3) for name, s in used.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=10.0, help="idle time measured")
    parser.add_argument("--settle", type=float, default=3.0, help="idle time before measuring")
    parser.add_argument("--code", action="append", default=[], help="LABEL=DIR: a checkout to measure (repeat)")
    parser.add_argument("--serve-args", default="")
    args = parser.parse_args()
    for spec in args.code or [f"this={ROOT}"]:
        label, _, path = spec.partition("=")
        print(json.dumps(measure(label, Path(path).resolve(), args)), flush=True)


if __name__ == "__main__":
    main()
