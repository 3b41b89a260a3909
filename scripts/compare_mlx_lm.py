"""mlxq serve vs mlx_lm.server on the same model, machine and BLAS, side by side.

Builds (or reuses) a tiny-factory model, starts both servers on loopback
(mlx_lm.server in an interpreter that imported mlxq first, so it runs on the
same optimized BLAS), waits for both, then runs `mlxq bench serving-load
--compare` over a concurrency sweep with alternating rounds.

    python scripts/compare_mlx_lm.py --preset small --concurrency 1,4,8,16 \
        --num-requests 24 --prompt-len 150 --max-tokens 64 --rounds 2 --out docs/results/vs-mlx-lm

Extra mlxq serve flags go after `--`, e.g. `-- --batch 16`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from mlxq.bench.servers import free_port, wait_healthy


def server_command(kind: str, model: str, port: int, batch: int, max_tokens: int, mlxq_args=()) -> list[str]:
    """The command line that serves ``model`` on ``port``: kind "mlxq" or "mlx_lm"."""
    if kind == "mlxq":
        return [sys.executable, "-m", "mlxq.cli.main", "serve", "--model", model, "--port", str(port),
                "--log-level", "warning", "--batch", str(batch), *mlxq_args]
    # mlx_lm.server with mlxq imported first: the same BLAS for both.
    return [sys.executable, "-c", "import mlxq, sys; from mlx_lm.server import main; sys.argv[0] = "
            "'mlx_lm.server'; main()", "--model", model, "--port", str(port),
            "--decode-concurrency", str(batch), "--max-tokens", str(max_tokens), "--log-level", "WARNING"]


@contextlib.contextmanager
def servers(kinds: tuple[str, ...], model: str, batch: int, max_tokens: int, out: Path, mlxq_args=()):
    """Start the servers in ``kinds`` on ``model``; yield their URLs in that order; stop them."""
    ports = [free_port() for _ in kinds]
    logs = [open(out / f"{kind}.log", "w") for kind in kinds]
    procs = [subprocess.Popen(server_command(kind, model, port, batch, max_tokens, mlxq_args), stdout=log,
                              stderr=subprocess.STDOUT, env=os.environ.copy())
             for kind, port, log in zip(kinds, ports, logs, strict=True)]
    try:
        urls = [f"http://127.0.0.1:{port}" for port in ports]
        for url, proc in zip(urls, procs, strict=True):
            wait_healthy(url, proc)
        yield urls
    finally:
        for proc in procs:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()


@contextlib.contextmanager
def both_servers(model: str, batch: int, max_tokens: int, out: Path, mlxq_args=()):
    """Start mlxq serve and mlx_lm.server on ``model``; yield their URLs; stop both."""
    with servers(("mlxq", "mlx_lm"), model, batch, max_tokens, out, mlxq_args) as (a, b):
        yield a, b


def bench_command(a: str, b: str | None, concurrency: str, num_requests: int, prompt_len: int, max_tokens: int,
                  rounds: int, dataset: str, json_path: Path, plot_path: Path | None,
                  fresh_prompts: bool = False, dataset_args: tuple[str, ...] = ()) -> list[str]:
    cmd = [sys.executable, "-m", "mlxq.cli.main", "bench", "serving-load", "--url", a,
           *(["--compare", b, "--compare-label", "mlx_lm.server"] if b else []), "--concurrency", concurrency,
           "--num-requests", str(num_requests), "--prompt-len", str(prompt_len),
           "--max-tokens", str(max_tokens), "--rounds", str(rounds), "--dataset", dataset, "--ignore-eos",
           "--warmup", "2", "--label", "mlxq" if b else "server", "--json", str(json_path),
           "--quiet", *dataset_args]
    cmd += ["--fresh-prompts" if fresh_prompts else "--repeat-prompts"]
    return cmd + (["--plot", str(plot_path)] if plot_path else [])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", help="model directory (default: build --arch/--preset)")
    ap.add_argument("--arch", default="llama")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--concurrency", default="1,4,8,16")
    ap.add_argument("--num-requests", type=int, default=24)
    ap.add_argument("--prompt-len", type=int, default=150)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dataset", default="random")
    ap.add_argument("--num-groups", type=int, default=4, help="shared-prefix: agent groups")
    ap.add_argument("--question-len", type=int, default=16, help="words of each request's own text")
    ap.add_argument("--fresh-prompts", action="store_true", help="a new prompt set per level and round")
    ap.add_argument("--out", default="bench-out", help="folder for JSON, PNG and logs")
    ap.add_argument("mlxq_args", nargs="*", help="extra `mlxq serve` flags (after --)")
    args = ap.parse_args()

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = args.model
    if model is None:
        from mlxq.models.tiny import build_tiny_model

        model = str(build_tiny_model(args.arch, Path(tempfile.mkdtemp()) / f"{args.preset}-{args.arch}",
                                     preset=args.preset))
    levels = [int(x) for x in args.concurrency.split(",")]
    with both_servers(model, max(levels), args.max_tokens, out, args.mlxq_args) as (a, b):
        cmd = bench_command(a, b, args.concurrency, args.num_requests, args.prompt_len, args.max_tokens,
                            args.rounds, args.dataset, out / "serving-load.json", out / "serving-load.png",
                            args.fresh_prompts,
                            ("--num-groups", str(args.num_groups), "--question-len", str(args.question_len)))
        result = subprocess.run(cmd, env={**os.environ, "COLUMNS": "160"})
    sys.exit(result.returncode)


if __name__ == "__main__":
    main()
