"""One server at a time: `--shared-prefix-attention` modes in turn, each on the whole device.

For each mode of ``--modes`` (e.g. ``off,auto`` or ``off,auto,auto,off``)
this starts one `mlxq serve`, records its start-up (seconds to /health, then
one short request's latency, and /stats' shared-prefix kernel check), runs
the parts as `mlxq bench serving-load` does against it alone, stops it, and
only then starts the next: two servers up at once split the device's memory
and its time, which spoils a no-loss comparison. Results are written after
every part (a run cut short keeps what it measured); the last lines compare
each part's per-round medians across modes.

A part is DATASET:WORDS:CONCURRENCY[:REQUESTS[:ROUNDS]]: ``fresh``,
unrelated prompts of WORDS words; ``cached``, agents on one system prompt
of WORDS words (kept every round: from the second round on it is cached)
with --question-len own words each.

    python scripts/serve_in_turn.py --model /tmp/m8 --modes off,auto \\
        --parts fresh:300:64:64:3,cached:2000:8:8:4 --out $OUT
    python scripts/serve_in_turn.py --model /tmp/tiny --modes off,auto --parts fresh:40:4:4:2 \\
        --max-tokens 8 --memory-limit 2GB --out /tmp/sit                    # a CPU dry run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import statistics
import sys
import time
from pathlib import Path

import httpx
from shared_prefix_serving import sharing_counters  # scripts/ is on the path when run as a script

from mlxq.bench.client import LoadConfig
from mlxq.bench.servers import ServeProcess
from mlxq.bench.serving_load import Workload, sweep

DATASETS = {"cached": "shared-prefix", "fresh": "random"}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def first_request(url: str) -> float:
    """Seconds for one short chat request (8 tokens out) on the fresh server."""
    t = time.perf_counter()
    httpx.post(url + "/v1/chat/completions", timeout=120, json={
        "model": "default", "messages": [{"role": "user", "content": "Say hello to the new server."}],
        "max_tokens": 8, "temperature": 0}).raise_for_status()
    return round(time.perf_counter() - t, 3)


def run_part(part: str, url: str, args) -> dict:
    """One part as `mlxq bench serving-load` runs it, in this process (a child per part would pay the
    imports again: seconds each on a GPU machine)."""
    dataset, words, level, *rest = part.split(":")
    requests = int(rest[0]) if rest else int(level)
    rounds = int(rest[1]) if len(rest) > 1 else args.rounds
    cfg = LoadConfig(url=url, max_tokens=args.max_tokens, ignore_eos=True, timeout_s=args.part_timeout)
    work = Workload(DATASETS[dataset], requests, int(words), num_groups=1, question_len=args.question_len,
                    keep_systems=dataset == "cached")
    before, t = sharing_counters(url), time.perf_counter()
    try:
        runs = asyncio.run(asyncio.wait_for(sweep(cfg, work, [int(level)], None, rounds, True, ("server", "")),
                                            args.part_timeout))["a"]
        error = None
    except (TimeoutError, httpx.HTTPError, OSError) as e:
        runs, error = [], f"{type(e).__name__}: {e}"
    after = sharing_counters(url)
    result = {"part": part, "wall_s": round(time.perf_counter() - t, 1),
              "shared_steps": after.get("steps", 0) - before.get("steps", 0),
              "auto_declined_joins": after.get("auto_declined_joins", 0) - before.get("auto_declined_joins", 0),
              "auto_last_declined": after.get("auto_last_declined")}
    if error:
        return result | {"error": error}
    return result | {"rounds": [{"tok_s": r["output_throughput_tok_s"], "ttft_p50": r["ttft_ms"]["p50"],
                                 "ttft_p95": r["ttft_ms"]["p95"], "itl_p50": r["itl_ms"]["p50"],
                                 "completed": r["completed"], "failed": r["failed"]} for r in runs]}


def part_line(result: dict) -> str:
    if "error" in result:
        return f"{result['part']}: ERROR {result['error'][-300:]}"
    rounds = " | ".join(f"{r['tok_s']:.0f} tok/s, TTFT {r['ttft_p50']:.0f}/{r['ttft_p95']:.0f}, ITL "
                        f"{r['itl_p50']:.1f}" for r in result["rounds"])
    return (f"{result['part']}: {rounds}; shared steps {result['shared_steps']}, auto declined "
            f"{result['auto_declined_joins']} join(s); {result['wall_s']}s")


def serve_one(mode: str, turn: int, args, results: dict) -> None:
    scratch = args.scratch / f"{turn}-{mode}"
    scratch.mkdir(parents=True, exist_ok=True)
    server_log = scratch / "server.log"
    entry: dict = {"mode": mode, "turn": turn, "parts": []}
    results["servers"].append(entry)
    began = time.perf_counter()
    server = ServeProcess("--model", str(args.model), "--batch", str(args.batch), "--memory-limit", args.memory_limit,
                          "--log-level", "info", "--log-format", "json", "--shared-prefix-attention", mode,
                          *args.serve_args, log_path=str(server_log), timeout_s=args.start_timeout)
    with open(args.scratch / "pids", "a") as pids:  # for a caller whose hard limit may cut this script short
        pids.write(f"{server.proc.pid}\n")
    try:
        with server:
            entry["ready_s"] = round(time.perf_counter() - began, 1)
            entry["first_request_s"] = first_request(server.url)
            entry["shared_prefix"] = sharing_counters(server.url)
            log(f"{mode} (turn {turn}): ready after {entry['ready_s']}s, first request {entry['first_request_s']}s, "
                f"kernel checks {(entry['shared_prefix'].get('kernels') or {}).get('check')}, declined "
                f"{entry['shared_prefix'].get('declined')}")
            args.out.joinpath("serve_in_turn.json").write_text(json.dumps(results, indent=1))
            for part in args.parts.split(","):
                if time.monotonic() - args.began > args.deadline_s:
                    entry["parts"].append({"part": part, "skipped": "deadline"})
                    continue
                result = run_part(part, server.url, args)
                entry["parts"].append(result)
                log(f"  {mode}: {part_line(result)}")
                args.out.joinpath("serve_in_turn.json").write_text(json.dumps(results, indent=1))
    except (RuntimeError, TimeoutError) as e:
        entry["error"] = repr(e)
        log(f"{mode} (turn {turn}): {e!r}")
    lines = server_log.read_text(errors="replace").splitlines() if server_log.exists() else []
    entry["log"] = [text for text in lines if '"queue_ms"' not in text][-args.log_lines:]  # not the request log
    args.out.joinpath("serve_in_turn.json").write_text(json.dumps(results, indent=1))


def compare(results: dict) -> list[str]:
    """Per part and mode: the median over turns and rounds (the first round of each part left out
    when there are several) of tok/s and TTFT p50/p95, and each mode's ratio to the first mode."""
    modes = list(dict.fromkeys(s["mode"] for s in results["servers"]))
    out = []
    parts = list(dict.fromkeys(p["part"] for s in results["servers"] for p in s["parts"]))
    for part in parts:
        medians = {}
        for mode in modes:
            rounds = [r for s in results["servers"] if s["mode"] == mode for p in s["parts"]
                      if p["part"] == part and "rounds" in p for r in (p["rounds"][1:] or p["rounds"])]
            if rounds:
                medians[mode] = {k: statistics.median(r[k] for r in rounds) for k in ("tok_s", "ttft_p50", "ttft_p95")}
        if not medians:
            continue
        base = medians.get(modes[0])
        cells = []
        for mode, m in medians.items():
            ratio = f" (x{m['tok_s'] / base['tok_s']:.3f} tok/s)" if base and mode != modes[0] else ""
            cells.append(f"{mode} {m['tok_s']:.0f} tok/s, TTFT {m['ttft_p50']:.0f}/{m['ttft_p95']:.0f} ms{ratio}")
        out.append(f"{part}: " + "; ".join(cells))
    for s in results["servers"]:
        out.append(f"start-up {s['mode']} (turn {s['turn']}): ready {s.get('ready_s')} s, first request "
                   f"{s.get('first_request_s')} s")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--modes", default="off,auto", help="one server per mode, in this order")
    ap.add_argument("--parts", default="fresh:300:64:64:3,cached:2000:8:8:4")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--scratch", type=Path, default=Path("/tmp/mlxq-serve-in-turn"))
    ap.add_argument("--question-len", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--memory-limit", default="auto")
    ap.add_argument("--start-timeout", type=float, default=300)
    ap.add_argument("--part-timeout", type=float, default=120)
    ap.add_argument("--deadline-s", type=float, default=600, help="start no part after this many seconds")
    ap.add_argument("--log-lines", type=int, default=40, help="server log lines kept per server")
    ap.add_argument("serve_args", nargs="*", help="extra `mlxq serve` flags (after --)")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout stops the running server too
    args.began = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    results = {"date": time.strftime("%Y-%m-%d"), "args": {k: str(v) for k, v in vars(args).items()}, "servers": []}
    for turn, mode in enumerate(args.modes.split(",")):
        if time.monotonic() - args.began > args.deadline_s:
            break
        serve_one(mode, turn, args, results)
    results["comparison"] = compare(results)
    args.out.joinpath("serve_in_turn.json").write_text(json.dumps(results, indent=1))
    for text in results["comparison"]:
        log(text)


if __name__ == "__main__":
    main()
