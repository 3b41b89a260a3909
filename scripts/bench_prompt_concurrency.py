"""TTFT under a burst: the same mlxq server with --prompt-concurrency 1 vs K, side by side.

    python scripts/bench_prompt_concurrency.py --k 8 --concurrency 16 --num-requests 32 --out docs/results/pc-cpu
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from mlxq.bench.servers import ServeProcess
from mlxq.models.tiny import build_tiny_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--concurrency", default="16")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=150)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="bench-out")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = args.model or str(build_tiny_model("llama", Path(tempfile.mkdtemp()) / "m", preset=args.preset))
    batch = str(max(int(x) for x in args.concurrency.split(",")))
    with ServeProcess("--model", model, "--batch", batch, "--prompt-concurrency", "1") as one, \
            ServeProcess("--model", model, "--batch", batch, "--prompt-concurrency", str(args.k)) as many:
        cmd = [sys.executable, "-m", "mlxq.cli.main", "bench", "serving-load", "--url", one.url,
               "--compare", many.url, "--label", "K=1", "--compare-label", f"K={args.k}",
               "--concurrency", args.concurrency, "--num-requests", str(args.num_requests),
               "--prompt-len", str(args.prompt_len), "--max-tokens", str(args.max_tokens), "--ignore-eos",
               "--rounds", str(args.rounds), "--json", str(out / "serving-load.json"), "--quiet"]
        sys.exit(subprocess.run(cmd, env={**os.environ, "COLUMNS": "160"}).returncode)


if __name__ == "__main__":
    main()
