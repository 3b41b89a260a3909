"""GPU measurements for mlxq (one command on the GPU machine; results under --out).

Phases (pick with --phases, default all):
  build      random-weight model at a real shape (tiny factory, --fast-init on the GPU)
  bandwidth  a large elementwise copy: the achievable bytes/s of this device
  b1         B=1 decode tok/s: mlx-lm stream_generate, mlxq serial lane, mlxq batch lane
             (one row), and the fraction of the bandwidth roofline
  prefill    prefill tok/s for long prompts through the serial lane
  restore    TTFT of the same long prompt cold, restored from the RAM prompt cache, and restored
             from the SSD tier after a flush and a fresh store (as after a restart): from the
             disk (page cache dropped), then with the files in the OS page cache
  kvquant    decode tok/s per KV scheme (off, 8, 4) at B=1 and B=8, KV bytes per token
  http       concurrency sweep over HTTP: mlxq serve vs mlx_lm.server (bench serving-load)

    python scripts/gpu_bench.py --preset llama3-8b --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlxq  # noqa: E402,F401

MODELS = Path(os.environ.get("MLXQ_BENCH_MODELS", "/tmp/mlxq-models"))


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def phase_build(args, results):
    from mlxq.models.tiny import build_tiny_model, read_manifest

    path = MODELS / args.preset
    if not (path / "mlxq-model.json").exists():
        t = time.perf_counter()
        build_tiny_model("llama", path, preset=args.preset, fast_init=True)
        log(f"built {path} in {time.perf_counter() - t:.0f}s")
    results["model"] = read_manifest(path) | {"path": str(path)}


def phase_bandwidth(args, results):
    import mlx.core as mx

    n = 1 << 30  # 1 Gi bf16 elements = 2 GiB
    a = mx.random.uniform(shape=(n,)).astype(mx.bfloat16)
    mx.eval(a)
    for _ in range(3):
        mx.eval(a * 2)
    reps, t = 20, time.perf_counter()
    for _ in range(reps):
        mx.eval(a * 2)
    dt = (time.perf_counter() - t) / reps
    results["bandwidth"] = {"bytes_moved": 2 * a.nbytes, "seconds": dt, "tb_s": 2 * a.nbytes / dt / 1e12}
    log(f"copy bandwidth {results['bandwidth']['tb_s']:.2f} TB/s")


def _weight_bytes_per_step(model, config) -> int:
    from mlx.utils import tree_flatten

    total = 0
    for name, p in tree_flatten(model.parameters()):
        if name.endswith("embed_tokens.weight") and not config.get("tie_word_embeddings"):
            continue  # an untied embedding is gathered (one row per token), not streamed
        total += p.nbytes
    return total


def phase_b1(args, results):
    import mlx.core as mx
    import mlx_lm
    from bench_b1 import batch_lane, serial

    from mlxq.kv.projection import measure_footprint
    from mlxq.models.loader import load_model

    lm = load_model(str(MODELS / args.preset))
    footprint = measure_footprint(lm.model)
    prompt = [1000 + i for i in range(args.prompt_tokens)]
    n = args.max_tokens

    def oracle():
        last = None
        for r in mlx_lm.stream_generate(lm.model, lm.tokenizer, mx.array(prompt), max_tokens=n):
            last = r
        return last.generation_tps

    oracle()
    runs = {"mlx_lm_stream_generate": [], "mlxq_serial": [], "mlxq_batch_lane": []}
    timings = []
    for r in range(args.rounds):
        runs["mlx_lm_stream_generate"].append(oracle())
        runs["mlxq_serial"].append(serial(lm, prompt, n)[0])
        tok_s, _, timing = batch_lane(lm, footprint, prompt, n)
        runs["mlxq_batch_lane"].append(tok_s)
        timings.append(timing)
        log(f"b1 round {r}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in runs.items()))
    med = {k: statistics.median(v) for k, v in runs.items()}
    step_bytes = _weight_bytes_per_step(lm.model, lm.config)
    bw = results.get("bandwidth", {}).get("tb_s")
    results["b1"] = {
        "tok_s_median": med, "runs": runs, "prompt_tokens": len(prompt), "max_tokens": n,
        "weight_bytes_per_step": step_bytes,
        "weight_tb_s": {k: v * step_bytes / 1e12 for k, v in med.items()},
        "roofline_fraction": {k: v * step_bytes / 1e12 / bw for k, v in med.items()} if bw else None,
        "serial_vs_mlx_lm": med["mlxq_serial"] / med["mlx_lm_stream_generate"],
        "batch_lane_vs_serial": med["mlxq_batch_lane"] / med["mlxq_serial"],
        "batch_lane_decode_timing": timings,
    }
    log(f"b1 medians {med}")


def phase_prefill(args, results):
    from mlxq.engine.serial import run_serial
    from mlxq.engine.types import Request, SamplingParams
    from mlxq.models.loader import load_model

    lm = load_model(str(MODELS / args.preset))
    out = {}
    for length in (4096, 16384):
        prompt = [1000 + (i * 7) % 100000 for i in range(length)]
        ttfts = []
        for _ in range(2):
            o = run_serial(lm.model, lm.tokenizer, Request("p", prompt, SamplingParams(), 1), lambda e: None,
                           prefill_step_size=2048)
            ttfts.append(o.usage().ttft_s)
        best = min(ttfts)
        out[str(length)] = {"ttft_s": ttfts, "prefill_tok_s": length / best}
        log(f"prefill {length}: {length / best:.0f} tok/s")
    results["prefill"] = out


def phase_restore(args, results):
    """TTFT of a long prompt cold, restored from the RAM prompt cache, and restored from the SSD tier
    (flushed, then a fresh store over the same directory as after a restart, page cache dropped)."""
    import shutil
    import tempfile

    from bench_ssd import drop_page_cache

    from mlxq.engine.serial import run_serial
    from mlxq.engine.types import Request, SamplingParams
    from mlxq.models.loader import load_model
    from mlxq.store.cold_tier import ColdTier
    from mlxq.store.mlxkv import Identity
    from mlxq.store.prompt_cache import PromptCache
    from mlxq.store.ssd_store import SsdStore

    lm = load_model(str(MODELS / args.preset))
    warm = [1000 + i for i in range(2048)]  # compile and allocate once, so "cold" means an uncached prompt
    run_serial(lm.model, lm.tokenizer, Request("w", warm, SamplingParams(), 2), lambda e: None,
               prefill_step_size=2048)
    out = {}
    for length in args.restore_lengths:
        root = Path(tempfile.mkdtemp(prefix="mlxq-ssd-"))
        identity = Identity("gpu-bench", "native", "")
        store = SsdStore(root, identity)
        cache = PromptCache(64 * 10**9)
        tier = ColdTier(store, cache, write_behind=False)
        prompt = [1000 + (i * 7) % 100000 for i in range(length)]

        def ttft(ids, cache):
            o = run_serial(lm.model, lm.tokenizer, Request("r", ids, SamplingParams(), 1), lambda e: None,
                           prefill_step_size=2048, prompt_cache=cache)
            return o.usage().ttft_s, o.usage().cached_tokens, o.tokens

        cold, _, _ = ttft(prompt, cache)
        warm, cached, ram_tokens = ttft(prompt + [7], cache)  # the same prompt plus one token: all but one from RAM
        t = time.perf_counter()
        tier.begin_flush()
        while tier.has_work(flushing=True):
            tier.step()
        flush_s = time.perf_counter() - t
        durable = tier.flush_result().durable
        runs = {}
        for placement in args.restore_placements or [None]:
            _use_placement(placement)
            for pages in ("dropped", "cached"):  # from the disk, then with the files in the OS page cache
                if pages == "dropped":
                    drop_page_cache(root)
                restarted = PromptCache(64 * 10**9)
                fresh = SsdStore(root, identity)
                fresh.scan()
                ColdTier(fresh, restarted)
                run = pages if placement is None else f"{pages}_{placement}"
                ssd, ssd_cached, ssd_tokens = ttft(prompt + [7], restarted)
                read_s = fresh.stats.restore_ms_last / 1e3
                runs[run] = {"ssd_ttft_s": ssd, "ssd_cached_tokens": ssd_cached, "ssd_over_cold": ssd / cold,
                             "ssd_restore_ms": fresh.stats.restore_ms_last, "read_gb_s": fresh.bytes / read_s / 1e9,
                             "verify_wait_ms": getattr(fresh.stats, "restore_verify_wait_ms_last", None),
                             "same_token_as_ram_hit": ssd_tokens == ram_tokens}
                log(f"restore {length} (page cache {run}): SSD {ssd * 1e3:.1f} ms = {ssd / cold:.3f}x cold, "
                    f"read {runs[run]['read_gb_s']:.2f} GB/s, restore {fresh.stats.restore_ms_last:.0f} ms")
        _use_placement(None)
        out[str(length)] = {"cold_ttft_s": cold, "ram_ttft_s": warm, "cached_tokens": cached,
                            "entry_bytes": cache.bytes, "flush_s": flush_s, "durable": durable,
                            "file_bytes": fresh.bytes, "files": len(fresh.files),
                            "ssd_ttft_s": next(iter(runs.values()))["ssd_ttft_s"], **{f"page_cache_{k}": v for k, v in
                                                                           runs.items()}}
        log(f"restore {length}: cold {cold * 1e3:.0f} ms, RAM hit {warm * 1e3:.1f} ms "
            f"({fresh.bytes / 1e9:.2f} GB, flush {flush_s:.2f}s)")
        shutil.rmtree(root, ignore_errors=True)
    results["restore"] = out


def _use_placement(name: str | None) -> None:
    """Restores read as ``name`` says (store/restore_reads.py: host, device), or as this device does (None)."""
    from mlxq.store import restore_reads, ssd_restore

    if not hasattr(restore_reads, "placement"):
        return  # a tree from before the placements: its one read path
    chosen = {"host": restore_reads.HostRows, "device": restore_reads.DeviceLoads}.get(name)
    ssd_restore.placement = (lambda: chosen) if chosen else restore_reads.placement


def phase_kvquant(args, results):
    """Decode tok/s per KV scheme at B=1 (serial lane) and B=8 (batch lane), and KV bytes per token."""
    from bench_kv_quant import SCHEMES, b1_tok_s, b8_tok_s

    from mlxq.kv.projection import measure_footprint
    from mlxq.kv.scheme import head_dims, probe_caches, resolve_scheme
    from mlxq.models.loader import load_model

    lm = load_model(str(MODELS / args.preset))
    probe = probe_caches(lm.model)
    schemes = {q: resolve_scheme(q, 64, lm.path, probe, head_dims(probe)) for q in SCHEMES}
    prompts = [[1000 + (i * 7 + s * 13) % 100000 for i in range(args.kv_prompt_tokens)] for s in range(8)]
    b1 = {q: [] for q in SCHEMES}
    b8 = {q: [] for q in SCHEMES}
    b1_tok_s(lm.model, lm.tokenizer, schemes["off"], prompts[0], 16)
    for r in range(args.rounds):
        for q in SCHEMES if r % 2 == 0 else tuple(reversed(SCHEMES)):
            b1[q].append(b1_tok_s(lm.model, lm.tokenizer, schemes[q], prompts[0], args.max_tokens))
            b8[q].append(b8_tok_s(lm.model, lm.tokenizer, schemes[q], prompts, args.max_tokens))
            log(f"kvquant {q}: B=1 {b1[q][-1]:.1f}, B=8 {b8[q][-1]:.1f}")
    out = {"prompt_tokens": args.kv_prompt_tokens, "max_tokens": args.max_tokens}
    for q in SCHEMES:
        fp = measure_footprint(lm.model, 2048, schemes[q])
        out[q] = {"key": schemes[q].key, "kv_bytes_per_token": sum(x.bytes_per_token for x in fp.layers),
                  "b1": b1[q], "b8": b8[q], "b1_median": statistics.median(b1[q]),
                  "b8_median": statistics.median(b8[q])}
    for q in SCHEMES:
        out[q]["b1_vs_off"] = out[q]["b1_median"] / out["off"]["b1_median"]
        out[q]["b8_vs_off"] = out[q]["b8_median"] / out["off"]["b8_median"]
    results["kvquant"] = out


_LATENCIES = ("time_to_first_token_seconds", "request_queue_time_seconds", "request_prefill_time_seconds")


def _latency_sums(url: str) -> dict[str, float]:
    """The _sum and _count of mlxq's latency histograms from /metrics (warm-up requests included)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    wanted = {f"mlxq:{name}{part}" for name in _LATENCIES for part in ("_sum", "_count")}
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {sample.name.removeprefix("mlxq:"): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples if sample.name in wanted}


def _mean_ms(before: dict, after: dict, name: str) -> float | None:
    count = after.get(name + "_count", 0) - before.get(name + "_count", 0)
    total = after.get(name + "_sum", 0) - before.get(name + "_sum", 0)
    return round(1000 * total / count, 2) if count else None


def phase_http(args, results):
    """The sweep. Both servers up at once, levels alternating (default), or with --isolate each
    server alone on the GPU (mlxq's levels, then mlx_lm.server's): two MLX processes on one GPU
    compete for its memory (each allocator keeps what it freed), which at c=128 ran both out."""
    from compare_mlx_lm import bench_command, both_servers, servers

    out = Path(args.out)
    levels = [int(x) for x in args.concurrency.split(",")]
    model = str(MODELS / args.preset)
    extra = ["--prompt-concurrency", "8"]

    def bench(a, b, level, path):
        num = max(16, 2 * level)
        cmd = bench_command(a, b, str(level), num, args.prompt_words, args.max_tokens, 1, "random", path, None)
        t = time.perf_counter()
        subprocess.run(cmd, env={**os.environ, "COLUMNS": "200"}, check=False)
        log(f"http c={level} done in {time.perf_counter() - t:.0f}s")
        return json.loads(path.read_text()) if path.exists() else None

    docs, server_side = {}, {}
    if args.isolate:
        alone = {}
        for kind in ("mlxq", "mlx_lm"):
            with servers((kind,), model, max(levels), args.max_tokens, out, extra) as (url,):
                for level in levels:
                    before = _latency_sums(url) if kind == "mlxq" else None
                    alone[kind, level] = doc = bench(url, None, level, out / f"http-{kind}-c{level}.json")
                    if before is not None:
                        after = _latency_sums(url)
                        server_side[str(level)] = {name: _mean_ms(before, after, name) for name in _LATENCIES}
                        # the scheduler's split of the measurement (bench/server_timing.py)
                        server_side[str(level)]["decode_step"] = doc["a"][0].get("server_timing") if doc else None
        for level in levels:
            a, b = alone["mlxq", level], alone["mlx_lm", level]
            if a and b:
                docs[level] = {"a": a["a"], "b": b["a"]}  # the side-by-side layout gpu_report.py reads
                (out / f"http-c{level}.json").write_text(json.dumps(docs[level]))
    else:
        with both_servers(model, max(levels), args.max_tokens, out, extra) as (a, b):
            for level in levels:
                docs[level] = bench(a, b, level, out / f"http-c{level}.json")
    if server_side:
        # TTFT as the engine saw it (submit -> token 0 sampled) and its parts, per level: what the
        # client's TTFT adds on top is HTTP, tokenization and the event loop. decode_step: host
        # work vs device wait per decode step (a wait near 0 means the host is the bottleneck).
        results["http_server_side_ms"] = server_side
        log(f"mlxq server-side means (ms): {server_side}")
    results["http"] = {
        str(level): {key: {k: v for k, v in doc[key][0].items() if k != "records"} for key in ("a", "b")}
        for level, doc in docs.items() if doc
    }


PHASES = {"build": phase_build, "bandwidth": phase_bandwidth, "b1": phase_b1, "prefill": phase_prefill,
          "restore": phase_restore, "kvquant": phase_kvquant, "http": phase_http}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llama3-8b")
    ap.add_argument("--out", required=True)
    ap.add_argument("--phases", default="build,bandwidth,b1,prefill,http")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=180)
    ap.add_argument("--prompt-words", type=int, default=130)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--concurrency", default="1,8,32,64")
    ap.add_argument("--isolate", action="store_true", help="http: each server alone on the GPU, one after the other")
    ap.add_argument("--restore-lengths", type=lambda s: [int(x) for x in s.split(",")], default=[4096, 16384])
    ap.add_argument("--kv-prompt-tokens", type=int, default=2048)
    ap.add_argument("--restore-placements", type=lambda s: s.split(",") if s else [], default=[],
                    help="restore: measure each read path (host,device; store/restore_reads.py), not only the "
                         "device's own")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import mlx.core as mx

    results = {"date": time.strftime("%Y-%m-%d"), "device": str(mx.default_device()), "preset": args.preset,
               "mlx": mx.__version__}
    try:
        import mlx_lm

        results["mlx_lm"] = mlx_lm.__version__
        results["device_info"] = {k: str(v) for k, v in mx.device_info().items()} if hasattr(mx, "device_info") \
            else None
    except Exception as exc:  # informational only
        results["device_info_error"] = str(exc)
    for name in args.phases.split(","):
        log(f"phase {name}")
        PHASES[name](args, results)
        (out / f"gpu-bench-{args.preset}.json").write_text(json.dumps(results, indent=1, default=str))
    log("done")


if __name__ == "__main__":
    main()
