"""The cost of generation checkpoints on decode throughput: on vs off, side by side, same load.

    python scripts/bench_checkpoints.py --preset small --tokens 2048 --rounds 5 --out docs/results/checkpoints-cpu

Two servers on the same model and flags, one with ``--checkpoint-interval``
(default 256) and one with 0, both with ``--ssd-cache`` (each its own
directory), started at once. Each round sends the same load to both:
``--rows`` concurrent streamed greedy requests of ``--tokens`` tokens
(``ignore_eos``), distinct prompts per round so no checkpoint is ever
restored. Decode tok/s per request is measured at the client from the first
to the last token; the summary is the median per server and the on/off
ratio, how many checkpoints the "on" server wrote (from /stats; and how many
of them the one-pass CUDA kernel copied, ``checkpoint_kernel_links``), and each
server's decode steps in their parts (/stats ``batch.decode_timing``, the
difference over the mode's rounds). ``--batch 1`` runs the serial lane; a
larger ``--batch`` the batch lane.

``--mode sequential`` (the default) loads one server at a time, the order
alternating (on, off, off, on, ...): on a dedicated machine the fair side by
side, since with both loaded at once on one GPU any stall of one server
hands device time to the other, and the ratio counts it about twice.
``--mode together`` (or ``--together``) loads both at once in each round: on
a shared, busy machine both then see the same background load. ``--mode
both`` runs the sequential rounds, then the together rounds, on the same two
servers.

``--resume N``: instead, the time a resumed request takes: one greedy
request of ``--tokens`` run to the end (wall time), then the same request
again, interrupted after N streamed tokens by a flush and ``kill -9``, and
sent once more to a new server, which resumes it from its checkpoint.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx

from mlxq.bench.servers import ServeProcess
from mlxq.models.tiny import build_tiny_model


def stream_tok_s(url: str, prompt: str, tokens: int, out: list) -> None:
    """Decode tok/s of one streamed request, first token to last (appended to ``out``)."""
    body = {"prompt": prompt, "max_tokens": tokens, "ignore_eos": True, "temperature": 0, "stream": True}
    first = last = None
    seen = 0
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=3600) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                seen += 1
                last = time.perf_counter()
                first = first or last
    if seen > 1 and last > first:
        out.append((seen - 1) / (last - first))


def one_round(url: str, rows: int, tokens: int, tag: str) -> list[float]:
    rates: list[float] = []
    threads = [threading.Thread(target=stream_tok_s, args=(url, f"Round {tag}, story {i}:", tokens, rates))
               for i in range(rows)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return rates


def measure(servers: dict, args, together: bool) -> dict[str, list[float]]:
    """Per-request decode tok/s of each server over the rounds."""
    rates: dict[str, list[float]] = {name: [] for name in servers}
    mode = "together" if together else "sequential"
    for r in range(args.rounds):
        order = list(servers) if r % 2 == 0 else list(servers)[::-1]
        if together:
            loads = [threading.Thread(target=lambda n=name, tag=f"{mode}{r}-{name}": rates[n].extend(
                one_round(servers[n].url, args.rows, args.tokens, tag))) for name in order]
            for t in loads:
                t.start()
            for t in loads:
                t.join()
        else:
            for name in order:
                rates[name] += one_round(servers[name].url, args.rows, args.tokens, f"{mode}{r}-{name}")
        print(f"{mode} round {r}: " + ", ".join(f"{n} {statistics.median(v[-args.rows:]):.1f} tok/s"
                                                for n, v in rates.items()), flush=True)
    return rates


def decode_totals(url: str) -> dict:
    timing = httpx.get(url + "/stats").json()["batch"]["decode_timing"] or {}
    return {"steps": timing.get("steps", 0), **{k: v for k, v in timing.get("totals", {}).items() if k.endswith("_s")}}


def per_step_ms(before: dict, after: dict) -> dict:
    """Each part of a decode step, ms per step, over the steps between ``before`` and ``after``."""
    steps = after["steps"] - before["steps"]
    if not steps:
        return {"steps": 0}
    ms = {k[:-2] + "_ms": 1000 * (after[k] - before[k]) / steps for k in after if k.endswith("_s") and k != "cycle_s"}
    ms["output_ms"] = ms["step_ms"] - ms["build_ms"] - ms["submit_ms"] - ms["device_wait_ms"]  # publishes are here
    return {"steps": steps, **{k: round(v, 3) for k, v in ms.items()}}


def run_mode(servers: dict, args, together: bool) -> dict:
    """One mode's rounds: tok/s per request, their medians and ratio, checkpoints and decode steps."""
    before = {n: decode_totals(s.url) for n, s in servers.items()}
    written_before = httpx.get(servers["on"].url + "/stats").json()["checkpoints"]
    rates = measure(servers, args, together)
    steps = {n: per_step_ms(before[n], decode_totals(s.url)) for n, s in servers.items()}
    written = httpx.get(servers["on"].url + "/stats").json()["checkpoints"]
    median = {name: round(statistics.median(v), 2) for name, v in rates.items()}
    summary = {"per_request_tok_s": {n: [round(x, 2) for x in v] for n, v in rates.items()},
               "decode_tok_s_median": median, "on_over_off": round(median["on"] / median["off"], 4),
               "decode_step": steps}
    summary.update({f"checkpoints_{k}": written[k] - written_before[k] for k in ("written", "dropped")})
    summary["checkpoint_kernel_links"] = written.get("kernel_links", 0) - written_before.get("kernel_links", 0)
    summary["checkpoint_bytes_written"] = written["written_bytes"] - written_before["written_bytes"]
    print(json.dumps({k: v for k, v in summary.items() if k != "per_request_tok_s"}), flush=True)
    return summary


def resume_times(model: Path, tmp: Path, args) -> dict:
    """Wall time of a whole request, and of the same request resumed after a kill -9 at ``args.resume`` tokens."""
    flags = ("--model", str(model), "--batch", args.batch, "--ssd-cache", str(tmp / "resume"),
             "--checkpoint-interval", str(args.interval))
    body = {"prompt": "Resume me:", "max_tokens": args.tokens, "ignore_eos": True, "temperature": 0}
    env = {"MLXQ_SSE_COALESCE": "0"}
    with ServeProcess(*flags, env=env) as server:
        one_round(server.url, 1, 16, "warm")  # first-request costs out of the measurement
        start = time.perf_counter()
        whole = httpx.post(server.url + "/v1/completions", json=body, timeout=3600).json()
        whole_s = time.perf_counter() - start
        seen = 0
        with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=3600) as r:
            for line in r.iter_lines():
                seen += line.startswith("data: {")
                if seen >= args.resume:
                    break
        httpx.post(server.url + "/admin/cache/flush", timeout=600)
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait()
    with ServeProcess(*flags, env=env) as server:
        one_round(server.url, 1, 16, "warm")
        start = time.perf_counter()
        resumed = httpx.post(server.url + "/v1/completions", json=body, timeout=3600).json()
        resumed_s = time.perf_counter() - start
    same = resumed["choices"][0]["text"] == whole["choices"][0]["text"]
    restored = resumed["usage"].get("completion_tokens_details", {}).get("checkpoint_tokens", 0)
    return {"tokens": args.tokens, "interrupted_after": args.resume, "whole_s": round(whole_s, 3),
            "resumed_s": round(resumed_s, 3), "resumed_over_whole": round(resumed_s / whole_s, 4),
            "checkpoint_tokens": restored, "same_text": same}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="a model directory (default: build --preset)")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--batch", default="1")
    ap.add_argument("--interval", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--mode", choices=sorted(MODES), default="sequential")
    ap.add_argument("--together", action="store_const", const="together", dest="mode",
                    help="--mode together: each round loads both servers at once")
    ap.add_argument("--resume", type=int, default=0, help="measure a resume after this many tokens instead")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = Path(args.model) if args.model else build_tiny_model("llama", tmp / "model", preset=args.preset)
        if args.resume:
            summary = resume_times(model, tmp, args)
            (args.out / f"checkpoints-resume-b{args.batch}.json").write_text(json.dumps(summary, indent=2) + "\n")
            print(json.dumps(summary, indent=2))
            return
        common = ("--model", str(model), "--batch", args.batch, "--ssd-cache-max", "100GB")
        env = {"MLXQ_SSE_COALESCE": "0"}  # one chunk per token, so the client's count is the token count
        on_args = (*common, "--ssd-cache", str(tmp / "on"), "--checkpoint-interval", str(args.interval))
        off_args = (*common, "--ssd-cache", str(tmp / "off"), "--checkpoint-interval", "0")
        servers = {"on": ServeProcess(*on_args, env=env), "off": ServeProcess(*off_args, env=env)}  # both start
        try:
            with servers["on"], servers["off"]:
                for server in servers.values():
                    one_round(server.url, 1, 16, "warm")  # first-request costs out of the measured rounds
                modes = {m: run_mode(servers, args, m == "together") for m in MODES[args.mode]}
        finally:
            for server in servers.values():  # the other one too when one failed to start
                server.__exit__()
    summary = {"model": str(args.model or f"tiny llama {args.preset}"), "tokens": args.tokens, "rows": args.rows,
               "batch": args.batch, "interval": args.interval, "rounds": args.rounds, **modes}
    name = f"checkpoints-b{args.batch}-r{args.rows}-{args.mode}.json"
    (args.out / name).write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps({m: {k: v[k] for k in ("decode_tok_s_median", "on_over_off")} for m, v in modes.items()}))


MODES = {"sequential": ("sequential",), "together": ("together",), "both": ("sequential", "together")}


if __name__ == "__main__":
    main()
