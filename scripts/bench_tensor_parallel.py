"""One GPU vs `--tensor-parallel 2`, side by side: two servers on one host, the same load on each.

Starts `mlxq serve` on one GPU (CUDA_VISIBLE_DEVICES=0; on the CPU: one process) and
`mlxq serve --tensor-parallel 2` (its launcher gives each rank its own GPU), waits for
both, then runs `mlxq bench serving-load --compare` at each concurrency (alternating
servers), printing each table as it comes and writing the summaries under --out.

    python scripts/bench_tensor_parallel.py --model /tmp/m8 --out $OUT --levels 1:4,64:128
    python scripts/bench_tensor_parallel.py --model random:llama3-70b --out $OUT --tp-only \
        --levels 1:4,8:16,32:64,64:128 --serve-args "--batch 64 --warmup off" --ready-timeout 300

(``random:llama3-70b``: the 70B shape's weights drawn on each rank at load, none on disk.)
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlxq.bench.servers import free_port, wait_healthy  # noqa: E402


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def start(model: str, out: Path, label: str, extra: list[str], env: dict) -> tuple[str, subprocess.Popen]:
    port = free_port()
    cmd = [sys.executable, "-m", "mlxq.cli.main", "serve", "--model", model, "--port", str(port),
           "--log-level", "warning", *extra]
    proc = subprocess.Popen(cmd, env={**os.environ, **env}, stdout=open(out / f"{label}.log", "w"),
                            stderr=subprocess.STDOUT)
    return f"http://127.0.0.1:{port}", proc


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--levels", default="1:4,64:128", help="concurrency:num_requests, comma-separated")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=150)
    parser.add_argument("--serve-args", default="--batch 64 --memory-limit 60GB --warmup off")
    parser.add_argument("--level-timeout", type=float, default=120)
    parser.add_argument("--ready-timeout", type=float, default=240)
    parser.add_argument("--tp-only", action="store_true",
                        help="only the --tensor-parallel 2 server (a model that does not fit one GPU)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    serve = args.serve_args.split()
    started = time.monotonic()
    servers = {} if args.tp_only else {"1 GPU": start(args.model, args.out, "one", serve,
                                                       {"CUDA_VISIBLE_DEVICES": "0"})}
    servers["tensor-parallel 2"] = start(args.model, args.out, "tp2", [*serve, "--tensor-parallel", "2"], {})
    try:
        for url, proc in servers.values():
            wait_healthy(url, proc, timeout_s=args.ready_timeout)
        log(f"servers ready in {time.monotonic() - started:.0f}s")
        for level in args.levels.split(","):
            concurrency, num = level.split(":")
            log(f"c={concurrency}: {num} requests per server")
            subprocess.run(load_command(servers, args, concurrency, num), timeout=args.level_timeout, check=False)
    finally:
        for _, proc in servers.values():
            proc.terminate()
        for _, proc in servers.values():
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()


def load_command(servers: dict, args, concurrency: str, num: str) -> list[str]:
    """`mlxq bench serving-load` on the first server, alternating with the second when there is one."""
    (label, (url, _)), *rest = servers.items()
    cmd = [sys.executable, "-m", "mlxq.cli.main", "bench", "serving-load", "--url", url, "--label", label,
           "--endpoint", "completions", "--concurrency", concurrency, "--num-requests", num,
           "--max-tokens", str(args.max_tokens), "--ignore-eos", "--prompt-len", str(args.prompt_len),
           "--warmup", "2", "--json", str(args.out / f"c{concurrency}.json")]
    for label, (url, _) in rest:
        cmd += ["--compare", url, "--compare-label", label]
    return cmd


if __name__ == "__main__":
    main()
