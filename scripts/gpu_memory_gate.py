"""The memory gate on a GPU: the mixed sweep on fresh servers with memory traced (issue: memory on the GPU).

For each run (a fresh `mlxq serve`): fresh prompts and agents at each
concurrency level, while a thread reads /stats and nvidia-smi every 0.5 s.
Per run it records failed requests, preemptions and memory faults, and the
peaks of MLX's active and cached memory and of the device's memory in use,
against the memory limit the server planned (its configured share).

    python scripts/gpu_memory_gate.py --out $OUT                    # default budgets, 3 runs
    python scripts/gpu_memory_gate.py --runs over --out $OUT        # KV budget above what fits
    python scripts/gpu_memory_gate.py --runs default,over,default,default --per-level 1 \
        --max-tokens 64 --over-max-tokens 400 --out $OUT             # all four in ~5 minutes

Writes memory-gate.json (summaries) and trace-RUN.json (the 0.5 s samples) under --out; the
per-level benchmark JSON and server logs go to --scratch.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from mlxq.bench.servers import ServeProcess


@dataclass(frozen=True)
class Run:
    flags: tuple[str, ...] = ()  # extra `mlxq serve` flags
    datasets: tuple[tuple[str, int], ...] = (("random", 130), ("agents", 1000))  # (dataset, prompt words)
    levels: tuple[int, ...] | None = None  # None: --levels
    per_level: int = 2  # requests per level, times the level
    max_tokens: int | None = None  # None: --max-tokens
    ballast_gb: int = 0  # device memory another process holds while the server runs


RUNS = {
    "default": Run(),
    # A KV budget far above what fits: another process holds 70 GB of the device, and 128 rows of
    # ~2.7k prompt + 1600 tokens need ~72 GB of KV (8B: 128 KiB per token) next to 16 GB of weights.
    # Faults must turn into preemptions, not failed requests.
    "over": Run(("--kv-budget", "400GB"), (("random", 2000),), (128,), 1, 1600, 70),
}
BALLAST = ("import mlx.core as mx, sys, time; n = int(sys.argv[1]); "
           "held = [mx.zeros((2**30,), dtype=mx.uint8) for _ in range(n)]; mx.eval(held); "
           "print('holding', n, 'GiB', flush=True); time.sleep(3600)")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Tracer(threading.Thread):
    """/stats and nvidia-smi every ``interval`` seconds until stopped."""

    def __init__(self, url: str, interval: float = 0.5):
        super().__init__(daemon=True)
        self.url, self.interval, self.samples = url, interval, []
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.is_set():
            sample = {"t": time.time(), "gpu_used_bytes": _gpu_used()}
            try:
                stats = httpx.get(self.url + "/stats", timeout=5).json()
                memory, batch = stats["memory"], stats["batch"]
                sample |= {"active": memory["mlx_active_bytes"], "cache": memory["mlx_cache_bytes"],
                           "rows": batch["active_rows"], "prefilling": batch["prefilling_rows"],
                           "preempted": batch["preempted_rows"], "row_cap": batch["row_cap"],
                           "preemptions": batch["faults"]["preemptions"]}
            except (httpx.HTTPError, KeyError, ValueError):
                pass
            self.samples.append(sample)
            self._done.wait(self.interval)

    def stop(self) -> list[dict]:
        self._done.set()
        self.join(10)
        return self.samples


def _gpu_used() -> int | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=5).stdout
        return int(out.split()[0]) * 2**20
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None


def bench(url: str, dataset: str, words: int, level: int, requests: int, max_tokens: int, path: Path) -> dict:
    cmd = [sys.executable, "-m", "mlxq.cli.main", "bench", "serving-load", "--url", url, "--dataset", dataset,
           "--prompt-len", str(words), "--concurrency", str(level), "--num-requests", str(requests),
           "--max-tokens", str(max_tokens), "--ignore-eos", "--fresh-prompts", "--quiet", "--json", str(path)]
    if dataset == "agents":
        cmd += ["--turns", "3"]
    subprocess.run(cmd, check=False, capture_output=True)
    if not path.exists():
        return {"error": "no result"}
    doc = json.loads(path.read_text())["a"][0]
    return {key: doc.get(key) for key in ("completed", "failed", "output_throughput_tok_s", "ttft_ms", "duration_s")}


def one_run(name: str, model: Path, args, out: Path, index: int) -> dict:
    spec = RUNS[name]
    flags = spec.flags
    ballast = None
    if spec.ballast_gb:
        ballast = subprocess.Popen([sys.executable, "-c", BALLAST, str(spec.ballast_gb)], stdout=subprocess.PIPE,
                                   text=True)
        log(f"ballast: {ballast.stdout.readline().strip()}")
    log(f"run {index} ({name}): starting a fresh server {' '.join(flags)}")
    try:
        return _serve_and_sweep(name, spec, model, args, out, index)
    finally:
        if ballast is not None:
            ballast.kill()
            ballast.wait()


def _serve_and_sweep(name: str, spec: Run, model: Path, args, out: Path, index: int) -> dict:
    flags = spec.flags
    with ServeProcess("--model", str(model), "--batch", "128", "--prompt-concurrency", "8", *flags,
                      log_path=str(args.scratch / f"serve-{index}.log"), timeout_s=600) as server:
        start = httpx.get(server.url + "/stats").json()["memory"]
        tracer = Tracer(server.url)
        tracer.start()
        levels = {}
        for level in spec.levels or args.levels:
            for dataset, words in spec.datasets:
                t = time.perf_counter()
                per_level = args.per_level or spec.per_level
                max_tokens = (args.over_max_tokens if spec.ballast_gb else None) or spec.max_tokens or args.max_tokens
                levels[f"{dataset}-c{level}"] = result = bench(server.url, dataset, words, level,
                                                               per_level * level, max_tokens,
                                                               args.scratch / f"bench-{index}-{dataset}-c{level}.json")
                log(f"  {dataset} c={level}: {result.get('completed')} done, {result.get('failed')} failed "
                    f"in {time.perf_counter() - t:.0f}s")
        samples = tracer.stop()
        stats = httpx.get(server.url + "/stats").json()
    (out / f"trace-{index}.json").write_text(json.dumps(samples))
    peak = lambda key: max((s[key] for s in samples if s.get(key) is not None), default=None)  # noqa: E731
    return {
        "run": name, "flags": list(flags), "ballast_gb": spec.ballast_gb, "plan": start, "levels": levels,
        "failed_requests": stats["engine"]["requests_failed"], "finished": stats["engine"]["requests_finished"],
        "faults": stats["batch"]["faults"], "decode_steps": stats["batch"]["decode_timing"],
        "peak_gpu_used_bytes": peak("gpu_used_bytes"), "peak_mlx_active_bytes": peak("active"),
        "peak_mlx_cache_bytes": peak("cache"), "mlx_peak_bytes": stats["memory"]["mlx_peak_bytes"],
        "min_row_cap": min((s["row_cap"] for s in samples if "row_cap" in s), default=None),
        "server_log_tail": (args.scratch / f"serve-{index}.log").read_text(errors="replace").splitlines()[-25:],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llama3-8b")
    ap.add_argument("--model", type=Path, help="an existing model directory (default: build --preset)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--scratch", type=Path, default=Path("/tmp/mlxq-memory-gate"))
    ap.add_argument("--runs", default="default,default,default")
    ap.add_argument("--levels", type=lambda s: [int(x) for x in s.split(",")], default=[8, 32, 64, 128])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--per-level", type=int, help="requests per level, times the level (default: the run's)")
    ap.add_argument("--over-max-tokens", type=int, help="tokens per request in the over-budget run (default 1600)")
    ap.add_argument("--deadline-s", type=float, default=540, help="start no run after this many seconds")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    args.scratch.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    model = args.model or Path("/tmp/mlxq-models") / args.preset
    if not (model / "mlxq-model.json").exists():
        # In a child process: the builder's own MLX memory must not count against the servers.
        build = (f"from mlxq.models.tiny import build_tiny_model as b; "
                 f"b('llama', {str(model)!r}, preset={args.preset!r}, fast_init=True)")
        subprocess.run([sys.executable, "-c", build], check=True)
        log(f"built {model} in {time.monotonic() - began:.0f}s")
    results = {"date": time.strftime("%Y-%m-%d"), "preset": args.preset, "levels": args.levels,
               "max_tokens": args.max_tokens, "per_level": args.per_level, "over_max_tokens": args.over_max_tokens,
               "runs": []}
    for index, name in enumerate(args.runs.split(",")):
        if time.monotonic() - began > args.deadline_s:
            results["runs"].append({"run": name, "skipped": "deadline"})
            continue
        results["runs"].append(one_run(name, model, args, args.out, index))
        (args.out / "memory-gate.json").write_text(json.dumps(results, indent=1))
    (args.out / "memory-gate.json").write_text(json.dumps(results, indent=1))
    log("done")


if __name__ == "__main__":
    main()
