"""The SSD tier, measured: restart TTFT, write-behind cost, and a multi-turn agent workload.

    python scripts/bench_ssd.py --preset small --prompt-tokens 8000 --out docs/results/ssd-cpu

1. Restart TTFT: a long prompt cold, then flush, SIGTERM, a new process, and
   the same prompt again (restored from the SSD tier; the file's pages are
   dropped from the OS page cache first with posix_fadvise, so this is a
   disk read), then once more (a RAM hit).
2. Write-behind: two servers, one with MLXQ_SSD_WRITE_BEHIND=0, the same
   load with idle gaps (Poisson arrivals at 2/s, fresh prompts each round,
   the servers' order alternating): decode tok/s, TPOT and ITL ratios.
3. Agents: shared system prompt, 8 concurrent conversations, 5 turns each;
   TTFT p50 of turns 2-5 vs turn 1.
4. Restore speed (``--parts restore-speed``), in process: a prefix of
   ``--restore-tokens`` tokens of a model shape (``--restore-shape``: the
   Llama-3-8B KV shape, bf16, by default) put into the RAM tier and written
   as node files (a shared prefix and a tail), then read back by a fresh RAM
   tier over the same directory, files in the OS page cache: GB/s of the
   store's read path (each tensor read straight into its MLX array) against
   the previous path (read into host memory, then copied into MLX) on the same
   files, fresh memory each time (``mx.clear_cache``, as in a new process).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import xxhash

from mlxq.bench.client import LoadConfig, run_load
from mlxq.bench.datasets import corpus_words, make_workload
from mlxq.bench.metrics import summarize
from mlxq.bench.servers import ServeProcess
from mlxq.models.tiny import build_tiny_model


def ttft_ms(url: str, prompt: str) -> tuple[float, dict]:
    """Time to the first streamed token of a greedy completion, and its usage."""
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first, usage = None, {}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk.get("choices") and chunk["choices"][0].get("text"):
                first = time.perf_counter()
            usage = chunk.get("usage") or usage
    return round((first - start) * 1000, 1), usage


def drop_page_cache(directory: Path) -> None:
    for path in directory.rglob("*.mlxkv"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def long_prompt(tokens: int) -> str:
    words = corpus_words()
    return " ".join(words[(i * 7919) % len(words)] for i in range(int(tokens * 0.8)))


def restart_ttft(model: Path, prompt_tokens: int, ssd: Path, logs: Path) -> dict:
    prompt = long_prompt(prompt_tokens)
    args = ("--model", str(model), "--ssd-cache", str(ssd), "--log-level", "info")
    with ServeProcess(*args, log_path=str(logs / "restart-1.log")) as server:
        cold, usage = ttft_ms(server.url, prompt)
        t = time.perf_counter()
        flush = httpx.post(server.url + "/admin/cache/flush", timeout=600).json()
        flush_ms = (time.perf_counter() - t) * 1000
        server.proc.send_signal(signal.SIGTERM)
        exit_code = server.proc.wait(120)
    drop_page_cache(ssd)
    with ServeProcess(*args, log_path=str(logs / "restart-2.log")) as server:
        restored, usage2 = ttft_ms(server.url, prompt)
        ram, usage3 = ttft_ms(server.url, prompt)
        ssd_stats = httpx.get(server.url + "/stats").json()["ssd_cache"]
    return {
        "prompt_tokens": usage["prompt_tokens"], "cold_ttft_ms": cold, "ssd_restored_ttft_ms": restored,
        "ram_hit_ttft_ms": ram, "restored_over_cold": round(restored / cold, 4),
        "cached_tokens_after_restart": usage2["prompt_tokens_details"]["cached_tokens"],
        "cached_tokens_ram": usage3["prompt_tokens_details"]["cached_tokens"],
        "flush": flush, "flush_ms": round(flush_ms, 1), "exit_code": exit_code,
        "file_bytes": ssd_stats["bytes"], "restore_ms_server": ssd_stats["restore_ms_last"],
    }


def bench_cli(*args: str) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        subprocess.run([sys.executable, "-m", "mlxq.cli.main", "bench", "serving-load", *args, "--json", f.name,
                        "--quiet"], check=True)
        return json.loads(Path(f.name).read_text())


def write_behind(model: Path, tmp: Path, logs: Path, rounds: int) -> dict:
    """Fresh prompts every round (a repeat would be a cache hit); the order of the servers alternates."""
    on = ServeProcess("--model", str(model), "--ssd-cache", str(tmp / "wb-on"), log_path=str(logs / "wb-on.log"))
    off = ServeProcess("--model", str(model), "--ssd-cache", str(tmp / "wb-off"), log_path=str(logs / "wb-off.log"),
                       env={"MLXQ_SSD_WRITE_BEHIND": "0"})
    keys = ("output_throughput_tok_s", "ttft_ms", "itl_ms", "tpot_ms")
    runs: dict[str, list] = {"on": [], "off": []}
    with on, off:
        for r in range(rounds):
            workload = make_workload("random", 16, 400, seed=1000 + r)
            order = [("on", on), ("off", off)] if r % 2 == 0 else [("off", off), ("on", on)]
            for name, server in order:
                cfg = LoadConfig(server.url, endpoint="completions", max_tokens=64, ignore_eos=True,
                                 request_rate=2.0, seed=r)
                summary = summarize(asyncio.run(run_load(cfg, copy.deepcopy(workload), 4)))
                runs[name].append({k: summary[k] for k in keys} | {"failed": summary["failed"]})
        stats = httpx.get(on.url + "/stats").json()["ssd_cache"]

    def median(name: str, pick) -> float:
        return statistics.median(pick(run) for run in runs[name])

    ratios = {
        "output_tok_s": median("on", lambda x: x["output_throughput_tok_s"])
        / median("off", lambda x: x["output_throughput_tok_s"]),
        "tpot_p50": median("on", lambda x: x["tpot_ms"]["p50"]) / median("off", lambda x: x["tpot_ms"]["p50"]),
        "itl_p50": median("on", lambda x: x["itl_ms"]["p50"]) / median("off", lambda x: x["itl_ms"]["p50"]),
        "ttft_p50": median("on", lambda x: x["ttft_ms"]["p50"]) / median("off", lambda x: x["ttft_ms"]["p50"]),
    }
    return {"runs": runs, "on_over_off": {k: round(v, 3) for k, v in ratios.items()}, "ssd_cache_on": stats}


def agents(model: Path, tmp: Path, logs: Path) -> dict:
    with ServeProcess("--model", str(model), "--ssd-cache", str(tmp / "agents"),
                      log_path=str(logs / "agents.log")) as server:
        doc = bench_cli("--url", server.url, "--dataset", "agents", "--prompt-len", "1000", "--turns", "5",
                        "--num-requests", "40", "--concurrency", "8", "--max-tokens", "32", "--ignore-eos")
        stats = httpx.get(server.url + "/stats").json()
    return {"runs": doc, "prompt_cache": stats["prompt_cache"], "ssd_cache": stats["ssd_cache"]}


SHAPES = {"llama3-8b": (32, 8, 128, "bfloat16"), "small": (8, 4, 64, "float32")}  # layers, KV heads, dim


def restore_speed(tmp: Path, tokens: int, shape: str, rounds: int) -> dict:
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import KVCache

    from mlxq.store.cold_tier import ColdTier
    from mlxq.store.mlxkv import Identity, read_header
    from mlxq.store.prompt_cache import PromptCache
    from mlxq.store.ssd_store import SsdStore

    layers, heads, dim, dtype = SHAPES[shape]
    ids = list(range(tokens))
    caches = []
    for _ in range(layers):
        c = KVCache()
        k = mx.random.normal((1, heads, tokens, dim)).astype(getattr(mx, dtype))
        c.update_and_fetch(k, -k)
        caches.append(c)
    root, identity = tmp / "restore", Identity("f" * 16, "native", "")

    def tier() -> ColdTier:
        store = SsdStore(root, identity)
        store.scan()
        return ColdTier(store, PromptCache(1 << 40))

    writer = tier()
    shared = tokens * 7 // 8  # a system prompt, then an agent's own tail: two node files
    for end in (shared, tokens):
        writer.ram.put("", ids[:end], caches)
        while writer.has_work():
            writer.step()
    del caches, writer
    files = sorted(root.rglob("*.mlxkv"))
    nbytes = sum(f.stat().st_size for f in files)
    for f in files:
        f.read_bytes()  # into the OS page cache
    store_runs, previous_runs = [], []
    for _ in range(rounds):
        mx.clear_cache()
        fresh = tier()
        start = time.perf_counter()
        pending = fresh.begin_restore("", ids + [0], 0)
        while not fresh.advance_restore(pending):
            pass
        mx.eval([c.state for c in pending.entry.caches])
        store_runs.append(time.perf_counter() - start)
        del pending, fresh
        mx.clear_cache()
        start = time.perf_counter()
        held = []
        for f in files:  # the previous path: host bytes, then a copy into MLX
            header = read_header(f)
            data_start = -(-(48 + _header_length(f)) // 16384) * 16384
            with open(f, "rb") as fh:
                for layer in header.layers:
                    for t in layer["tensors"]:
                        fh.seek(data_start + t["offset"])
                        host = np.empty(t["nbytes"], dtype=np.uint8)
                        fh.readinto(memoryview(host))
                        xxhash.xxh3_128_hexdigest(host)
                        array = mx.array(host).view(getattr(mx, t["dtype"])).reshape(t["shape"])
                        mx.eval(array)
                        held.append(array)
        previous_runs.append(time.perf_counter() - start)
        del held
    store_s, previous_s = statistics.median(store_runs), statistics.median(previous_runs)
    return {"tokens": tokens, "shape": shape, "files": len(files), "bytes": nbytes, "rounds": rounds,
            "store_read_s": round(store_s, 4), "store_gb_s": round(nbytes / store_s / 1e9, 2),
            "previous_read_s": round(previous_s, 4), "previous_gb_s": round(nbytes / previous_s / 1e9, 2),
            "store_over_previous_speed": round(previous_s / store_s, 2)}


def _header_length(path: Path) -> int:
    with open(path, "rb") as f:
        return int.from_bytes(f.read(16)[12:16], "little")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--arch", default="llama")
    parser.add_argument("--prompt-tokens", type=int, default=8000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--parts", default="restart,write-behind,agents")
    parser.add_argument("--restore-tokens", type=int, default=12_000)
    parser.add_argument("--restore-shape", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        model = build_tiny_model(args.arch, tmp / "model", preset=args.preset)
        result = {"preset": args.preset, "arch": args.arch, "machine": os.uname().nodename,
                  "date": time.strftime("%Y-%m-%d"), "cpu_count": os.cpu_count()}
        parts = args.parts.split(",")
        if "restart" in parts:
            result["restart"] = restart_ttft(model, args.prompt_tokens, tmp / "ssd", args.out)
            print(json.dumps(result["restart"], indent=2), flush=True)
        if "write-behind" in parts:
            result["write_behind"] = write_behind(model, tmp, args.out, args.rounds)
            print(json.dumps(result["write_behind"]["on_over_off"], indent=2), flush=True)
        if "restore-speed" in parts:
            result["restore_speed"] = restore_speed(tmp, args.restore_tokens, args.restore_shape, args.rounds)
            print(json.dumps(result["restore_speed"], indent=2), flush=True)
        if "agents" in parts:
            result["agents"] = agents(model, tmp, args.out)
            print(json.dumps(result["agents"]["runs"]["a"][0]["ttft_by_turn_ms"], indent=2), flush=True)
    (args.out / "ssd.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
