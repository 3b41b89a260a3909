"""Shared-prefix attention end to end: two servers, `--shared-prefix-attention on` vs `off`, side by side.

Both servers run at once on one device (each with its own --memory-limit)
and `mlxq bench serving-load --compare` alternates them per round. Each
part is one serving-load call under its own timeout; its summary line is
printed and serving.json rewritten as soon as it ends, so a run cut short
keeps what it measured.

    python scripts/shared_prefix_serving.py --out $OUT                       # 8B shape, default parts
    python scripts/shared_prefix_serving.py --preset tiny --memory-limit 2GB \
        --parts shared:2000:4,fresh:300:4 --max-tokens 8 --out /tmp/sp   # a CPU dry run

A part is DATASET:WORDS:CONCURRENCY[:REQUESTS[:ROUNDS]] (``shared``: one
group of agents on a system prompt of WORDS words, each with
--question-len own words, a new system prompt every round; ``cached``: the
same, keeping the system prompt every round, so from round 2 on the prefix
is in the prompt cache and only the questions are new; ``fresh``: unrelated
prompts of WORDS words); it
sends REQUESTS requests (default --per-level x CONCURRENCY) per server and
round (default --rounds); a part ending in ``@on`` runs on the `on` server
alone (e.g. 64 agents on 14.5k, which the `off` server's per-row copies
would not fit beside a side-by-side fresh part). With the 8B preset's tokenizer 2,000 words are
~2,200 tokens. Per part it records both servers' throughput, TTFT
and ITL (medians over --rounds), per round the `on` server's TTFT
from its request log in phases (queue, then admission -> token 0:
engine/ttft_phases.py; p50/p95 ms), and the `on` server's shared-prefix
counters (/stats.batch.shared_prefix) before and after, and per server
what the part left (RAM prompt cache entries, faults, memory peak).
``--modes on`` starts the `on` server alone (an absolute target, no
side-by-side ratio); ``--modes auto,off`` (or ``auto``) starts the first
server with ``--shared-prefix-attention auto`` instead (still labelled
`on` in the output).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from mlxq.bench.request_phases import logged_requests, round_summary, split_rounds, summary_line
from mlxq.bench.servers import ServeProcess

DATASETS = {"shared": "shared-prefix", "cached": "shared-prefix", "fresh": "random"}
DEFAULT_PARTS = "shared:2000:16,shared:2000:32,shared:2000:64,fresh:300:64,shared:14500:64:64:1"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def build_model(preset: str) -> Path:
    model = Path("/tmp/mlxq-models") / preset
    if not (model / "mlxq-model.json").exists():
        # In a child process: the builder's own memory must not count against the servers.
        build = (f"from mlxq.models.tiny import build_tiny_model as b; "
                 f"b('llama', {str(model)!r}, preset={preset!r}, fast_init=True)")
        subprocess.run([sys.executable, "-c", build], check=True)
    return model


def sharing_counters(url: str) -> dict:
    try:
        return httpx.get(url + "/stats", timeout=10).json()["batch"]["shared_prefix"]
    except (httpx.HTTPError, KeyError, ValueError) as e:
        return {"error": repr(e)}


def server_snapshot(url: str) -> dict:
    """What a part left behind on a server: its RAM prompt cache, faults and memory peak."""
    try:
        stats = httpx.get(url + "/stats", timeout=10).json()
    except (httpx.HTTPError, ValueError) as e:
        return {"error": repr(e)}
    cache = stats.get("prompt_cache") or {}
    return {"prompt_cache": {k: cache.get(k) for k in ("entries", "bytes", "hits", "hit_tokens", "evictions")},
            "faults": stats.get("batch", {}).get("faults"),
            "mlx_peak_bytes": stats.get("memory", {}).get("mlx_peak_bytes"),
            "requests_failed": stats.get("engine", {}).get("requests_failed")}


def run_part(part: str, on: str, off: str | None, args, scratch: Path, on_log: Path) -> dict:
    spec, _, alone = part.partition("@")
    off = None if alone == "on" else off
    dataset, words, level, *rest = spec.split(":")
    requests = rest[0] if rest else str(args.per_level * int(level))
    rounds = rest[1] if len(rest) > 1 else str(args.rounds)
    path = scratch / f"{spec.replace(':', '-')}.json"
    versus = ["--compare", off, "--compare-label", "off"] if off else []
    cmd = [sys.executable, "-m", "mlxq.cli.main", "bench", "serving-load", "--url", on, *versus,
           "--label", "on", "--dataset", DATASETS[dataset], "--num-groups", "1",
           "--prompt-len", words, "--question-len", str(args.question_len), "--concurrency", level,
           "--num-requests", requests, "--max-tokens", str(args.max_tokens),
           "--ignore-eos", "--rounds", rounds, "--quiet", "--json", str(path),
           *(["--keep-systems"] if dataset == "cached" else [])]
    before, log_from = sharing_counters(on), on_log.stat().st_size if on_log.exists() else 0
    t = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.part_timeout)
        error = None if path.exists() else (done.stderr or done.stdout)[-2000:]
    except subprocess.TimeoutExpired:
        error = f"timed out after {args.part_timeout}s"
    result = {"part": part, "wall_s": round(time.perf_counter() - t, 1), "sharing_before": before,
              "sharing_after": sharing_counters(on), "on_server": server_snapshot(on),
              "off_server": server_snapshot(off) if off else {}}
    time.sleep(0.3)  # the request log's last lines
    logged = split_rounds(logged_requests(on_log, log_from), int(requests), warmup=1)
    result["on_phases_ms"] = [round_summary(records) for records in logged if records]
    if error:
        return result | {"error": error}
    doc = json.loads(path.read_text())
    return result | {"on": summarize(doc["a"]), "off": summarize(doc["b"]), "ratios_off_over_on": doc["ratios"]}


def summarize(runs: list[dict]) -> list[dict]:
    keys = ("completed", "failed", "output_throughput_tok_s", "duration_s", "total_prompt_tokens",
            "cached_token_ratio")
    return [{k: r.get(k) for k in keys} | {"ttft_ms": _pick(r["ttft_ms"]), "itl_ms": _pick(r["itl_ms"]),
                                           "server_timing": r.get("server_timing")}  # decode step split, busy shares
            for r in runs]


def _pick(stats: dict) -> dict:
    return {k: stats.get(k) for k in ("p50", "p95")}


def line(result: dict) -> str:
    if "error" in result:
        return f"{result['part']}: ERROR {result['error'][-300:]}"
    sides = [s for s in ("on", "off") if result[s]]
    med = lambda side, f: sorted(f(r) for r in result[side])[len(result[side]) // 2]  # noqa: E731
    tok = {s: med(s, lambda r: r["output_throughput_tok_s"]) for s in sides}
    p95 = {s: med(s, lambda r: r["ttft_ms"]["p95"]) for s in sides}
    steps = result["sharing_after"].get("steps", 0) - result["sharing_before"].get("steps", 0)
    failed = sum(r["failed"] or 0 for s in sides for r in result[s])
    shed = {s: (result[f"{s}_server"].get("faults") or {}).get("preemptions") for s in sides}
    rounds = {s: "/".join(f"{r['output_throughput_tok_s']:.0f}:{r['ttft_ms']['p95']:.0f}" for r in result[s])
              for s in sides}
    each = lambda f: ", ".join(f"{s} {f(s)}" for s in sides)  # noqa: E731
    ratio = f" (x{tok['on'] / tok['off']:.2f})" if "off" in tok else ""
    return (f"{result['part']}: tok/s {each(lambda s: f'{tok[s]:.0f}')}{ratio}; "
            f"TTFT p95 {each(lambda s: f'{p95[s]:.0f} ms')}; per round tok/s:TTFT p95 ms {each(rounds.get)}; "
            f"shared steps {steps}; failed {failed}; preemptions so far {each(shed.get)}; {result['wall_s']}s"
            + _declined(result))


def _declined(result: dict) -> str:
    """The `on` (or `auto`) server's joins left ungrouped by auto's gate in this part, and the last reason."""
    after, before = result["sharing_after"], result["sharing_before"]
    joins = after.get("auto_declined_joins", 0) - before.get("auto_declined_joins", 0)
    return f"; auto declined {joins} join(s): {after.get('auto_last_declined')}" if joins else ""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llama3-8b")
    ap.add_argument("--model", type=Path, help="an existing model directory (default: build --preset)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--scratch", type=Path, default=Path("/tmp/mlxq-shared-serving"))
    ap.add_argument("--parts", default=DEFAULT_PARTS)
    ap.add_argument("--per-level", type=int, default=2, help="requests per part, times its concurrency")
    ap.add_argument("--question-len", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--memory-limit", default="55GB",
                    help="per server: both share one device, and MLX's limit is a soft cap (65GB each overran 141GB)")
    ap.add_argument("--part-timeout", type=float, default=120)
    ap.add_argument("--deadline-s", type=float, default=500, help="start no part after this many seconds")
    ap.add_argument("--modes", default="on,off",
                    help="servers to start: on,off (or auto,off) side by side, or on (auto) alone")
    args = ap.parse_args()
    # A timeout's SIGTERM unwinds like an error: the servers this run started are stopped, not left running.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args.out.mkdir(parents=True, exist_ok=True)
    args.scratch.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    model = args.model or build_model(args.preset)
    log(f"model {model} ready after {time.monotonic() - began:.0f}s")
    common = ("--model", str(model), "--batch", str(args.batch), "--memory-limit", args.memory_limit,
              "--log-level", "info", "--log-format", "json")  # the request log: TTFT phases per round
    results = {"date": time.strftime("%Y-%m-%d"), "preset": args.preset, "args": vars(args) | {
        "out": str(args.out), "scratch": str(args.scratch), "model": str(model)}, "parts": []}
    # Both start at once (loading and warm-up overlap); each waits for /health on entry.
    modes = args.modes.split(",")
    if modes not in (["on", "off"], ["on"], ["auto", "off"], ["auto"]):
        ap.error("--modes is on,off, auto,off, on or auto (the first server is labelled on)")
    servers = [ServeProcess(*common, "--shared-prefix-attention", mode, log_path=str(args.scratch / f"{mode}.log"),
                            timeout_s=600) for mode in modes]
    with contextlib.ExitStack() as stack:
        for server in servers:
            stack.push(server.__exit__)  # both stop at the end, also when one fails to come up
        on, off = [server.__enter__().url for server in servers] + [None] * (2 - len(servers))
        log(f"servers up after {time.monotonic() - began:.0f}s; on: {sharing_counters(on)}")
        for part in args.parts.split(","):
            if time.monotonic() - began > args.deadline_s:
                results["parts"].append({"part": part, "skipped": "deadline"})
                continue
            result = run_part(part, on, off, args, args.scratch, args.scratch / f"{modes[0]}.log")
            results["parts"].append(result)
            log(line(result))
            for r, phases in enumerate(result["on_phases_ms"]):
                log(f"  on round {r + 1} server ms p50/p95: {summary_line(phases)}")
            for r, run in enumerate(result.get("on", [])):
                log(f"  on round {r + 1} decode steps: {run['server_timing']}")
            (args.out / "serving.json").write_text(json.dumps(results, indent=1))
    for name in modes:
        lines = (args.scratch / f"{name}.log").read_text(errors="replace").splitlines()
        tail = [text for text in lines if '"queue_ms"' not in text][-15:]  # not the request log
        results[f"{name}_log_tail"] = tail
    (args.out / "serving.json").write_text(json.dumps(results, indent=1))
    log("done")


if __name__ == "__main__":
    main()
