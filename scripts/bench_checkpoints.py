"""The cost of generation checkpoints on decode throughput: on vs off, side by side, same load.

    python scripts/bench_checkpoints.py --preset small --tokens 2048 --rounds 5 --out docs/results/checkpoints-cpu

Two servers on the same model and flags, one with ``--checkpoint-interval``
(default 256) and one with 0, both with ``--ssd-cache`` (each its own
directory), started at once. Each round sends the same load to both:
``--rows`` concurrent streamed greedy requests of ``--tokens`` tokens
(``ignore_eos``), distinct prompts per round so no checkpoint is ever
restored. Decode tok/s per request is measured at the client from the first
to the last token.

A round is one such load on each server. ``--mode sequential`` (the
default) loads one server at a time, the order alternating round by round
(on, off / off, on / on, off ...: ABBA, so a drift of the machine over the
run weighs on both alike), each load followed by its server's flush
(``--settle``, the default: what a server writes behind once its load is
done must not land in the other server's load): on a dedicated machine
the fair side by side, since with both loaded at once on one GPU any
stall of one server hands device time to the other, and the ratio counts
it about twice. ``--mode
together`` (or ``--together``) loads both at once in each round: on a
shared, busy machine both then see the same background load. ``--mode
both`` runs the sequential rounds, then the together rounds, on the same
two servers.

Per round: each server's median tok/s per request, its decode steps in
their parts over its load (/stats ``batch.decode_timing``, the difference
across the load), the on/off ratio of the two, and the links the "on"
server wrote in it (how many by the one-pass CUDA kernel, dropped, bytes).
The summary gives the median of the per-round ratios with their spread
(min, quartiles, max), the same for the decode step (off/on ms per step),
and the totals. More, shorter rounds pin the ratio better than a few long
ones: make each round long enough to cross a few intervals, and
``--seconds`` stops starting rounds that would end past the budget (the
JSON is rewritten after every round, so a run cut by a time limit keeps its
rounds). The servers' logs go to ``OUT/server-on.log`` and
``OUT/server-off.log``. ``--batch 1`` runs the serial lane (no batch
decode steps: the tok/s only); a larger ``--batch`` the batch lane.

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


def server_totals(url: str, checkpoints: bool) -> dict:
    """The server's cumulative decode-step totals (/stats batch.decode_timing) and, for the "on" server,
    its checkpoint counters."""
    stats = httpx.get(url + "/stats").json()
    timing = (stats.get("batch") or {}).get("decode_timing") or {}
    totals = {"steps": timing.get("steps", 0), **timing.get("totals", {})}
    if checkpoints:
        totals["checkpoints"] = stats["checkpoints"]
    return totals


def per_step_ms(before: dict, after: dict) -> dict:
    """Each part of a decode step, ms per step, over the steps between ``before`` and ``after``."""
    steps = after["steps"] - before["steps"]
    if not steps:
        return {"steps": 0}
    ms = {k[:-2] + "_ms": 1000 * (after[k] - before[k]) / steps for k in after
          if k.endswith("_s") and k != "cycle_s"}
    ms["output_ms"] = ms["step_ms"] - ms["build_ms"] - ms["submit_ms"] - ms["device_wait_ms"]  # publishes are here
    cycles = after.get("cycles", 0) - before.get("cycles", 0)
    if cycles:
        ms["cycle_ms"] = 1000 * (after["cycle_s"] - before["cycle_s"]) / cycles
    return {"steps": steps, **{k: round(v, 3) for k, v in ms.items()}}


def checkpoint_delta(before: dict, after: dict) -> dict:
    a, b = after["checkpoints"], before["checkpoints"]
    return {"written": a["written"] - b["written"], "dropped": a["dropped"] - b["dropped"],
            "kernel_links": a.get("kernel_links", 0) - b.get("kernel_links", 0),
            "bytes": a["written_bytes"] - b["written_bytes"]}


def settle(url: str) -> dict:
    """Flush a server's SSD tier (``POST /admin/cache/flush``, the durability barrier) once its load is done:
    each server writes its finished requests' entries behind (while its engine is idle), and a server that
    wrote behind into the next server's load slowed that load (by up to a quarter on the H200: in ABBA
    rounds, whichever server ran after the checkpoint-less one was slow). The flush's time and the bytes it
    wrote, so the write-behind each load leaves is on record."""
    before = httpx.get(url + "/stats").json().get("ssd_cache") or {}
    start = time.perf_counter()
    flushed = httpx.post(url + "/admin/cache/flush", timeout=600)
    flushed.raise_for_status()
    after = httpx.get(url + "/stats").json().get("ssd_cache") or {}
    return {"flush_s": round(time.perf_counter() - start, 3), "durable": flushed.json().get("durable"),
            "written_bytes": after.get("written_bytes", 0) - before.get("written_bytes", 0)}


def load_servers(servers: dict, names: list[str], args, tag: str) -> dict:
    """One load (``--rows`` requests of ``--tokens``) on each server in ``names`` at once; per server its
    requests' decode tok/s and its decode steps over the load, then (``--settle``) its flush."""
    before = {n: server_totals(servers[n].url, n == "on") for n in names}
    rates: dict[str, list[float]] = {n: [] for n in names}
    loads = [threading.Thread(target=lambda n=n: rates[n].extend(
        one_round(servers[n].url, args.rows, args.tokens, f"{tag}-{n}"))) for n in names]
    for t in loads:
        t.start()
    for t in loads:
        t.join()
    out = {}
    for n in names:
        after = server_totals(servers[n].url, n == "on")
        out[n] = {"tok_s": round(statistics.median(rates[n]), 2) if rates[n] else None,
                  "per_request_tok_s": [round(x, 2) for x in rates[n]], "step": per_step_ms(before[n], after)}
        if n == "on":
            out[n]["checkpoints"] = checkpoint_delta(before[n], after)
    if args.settle:
        for n in names:
            out[n]["settle"] = settle(servers[n].url)
    return out


def one_pair(servers: dict, args, r: int, together: bool) -> dict:
    """Round ``r``: the same load on both servers, at once (``together``) or one after the other, the order
    alternating on, off / off, on / on, off ... (ABBA): the per-round ratio and step times."""
    mode = "together" if together else "sequential"
    order = ["on", "off"] if r % 2 == 0 else ["off", "on"]
    start = time.perf_counter()
    if together:
        loaded = load_servers(servers, order, args, f"{mode}{r}")
    else:
        loaded = {}
        for name in order:
            loaded.update(load_servers(servers, [name], args, f"{mode}{r}"))
    on, off = loaded["on"], loaded["off"]
    record = {"round": r, "order": order, "seconds": round(time.perf_counter() - start, 2), "on": on, "off": off,
              "on_over_off": round(on["tok_s"] / off["tok_s"], 4) if on["tok_s"] and off["tok_s"] else None}
    if on["step"].get("step_ms") and off["step"].get("step_ms"):
        record["step_off_over_on"] = round(off["step"]["step_ms"] / on["step"]["step_ms"], 4)
    ck = on["checkpoints"]
    print(f"{mode} round {r} ({order[0]} first, {record['seconds']:.0f} s): "
          f"on {on['tok_s']} tok/s, {on['step'].get('step_ms')} ms/step (output {on['step'].get('output_ms')}); "
          f"off {off['tok_s']} tok/s, {off['step'].get('step_ms')} ms/step (output {off['step'].get('output_ms')}); "
          f"on/off {record['on_over_off']}, step off/on {record.get('step_off_over_on')}; "
          f"links {ck['written']} (kernel {ck['kernel_links']}, dropped {ck['dropped']})"
          + "".join(f"; {n} settled in {loaded[n]['settle']['flush_s']} s "
                    f"({loaded[n]['settle']['written_bytes'] / 2**20:.0f} MiB)"
                    for n in order if "settle" in loaded[n]),
          flush=True)
    return record


def spread(values: list[float]) -> dict:
    """Median, extremes and quartiles of per-round ratios."""
    values = sorted(v for v in values if v is not None)
    if not values:
        return {}
    out = {"median": round(statistics.median(values), 4), "min": values[0], "max": values[-1], "n": len(values)}
    if len(values) >= 2:
        q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
        out.update(q1=round(q1, 4), q3=round(q3, 4))
    return out


def summarize(rounds: list[dict], servers: dict, before: dict, args) -> dict:
    rates = {n: [x for rec in rounds for x in rec[n]["per_request_tok_s"]] for n in ("on", "off")}
    after = {n: server_totals(s.url, n == "on") for n, s in servers.items()}
    summary = {
        "rounds_done": len(rounds),
        "on_over_off": spread([rec["on_over_off"] for rec in rounds]),  # per-round ratios: the gate's number
        "step_off_over_on": spread([rec.get("step_off_over_on") for rec in rounds]),
        "decode_tok_s_median": {n: round(statistics.median(v), 2) if v else None for n, v in rates.items()},
        "decode_step": {n: per_step_ms(before[n], after[n]) for n in servers},  # over the mode's rounds
        "rounds": rounds,
    }
    ck = checkpoint_delta(before["on"], after["on"])
    summary.update({"checkpoints_written": ck["written"], "checkpoints_dropped": ck["dropped"],
                    "checkpoint_kernel_links": ck["kernel_links"], "checkpoint_bytes_written": ck["bytes"]})
    return summary


def run_mode(servers: dict, args, together: bool, deadline: float, save) -> dict:
    """One mode's rounds (at most ``--rounds``; none started that would end past ``deadline``): each round's
    ratio and steps, and their median and spread."""
    before = {n: server_totals(s.url, n == "on") for n, s in servers.items()}
    rounds: list[dict] = []
    longest = 0.0
    for r in range(args.rounds):
        if rounds and time.monotonic() + longest > deadline:
            print(f"time budget: stopping after {len(rounds)} rounds", flush=True)
            break
        rounds.append(one_pair(servers, args, r, together))
        longest = max(longest, rounds[-1]["seconds"])
        save(summarize(rounds, servers, before, args))
    summary = summarize(rounds, servers, before, args)
    print(json.dumps({k: v for k, v in summary.items() if k != "rounds"}), flush=True)
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
    ap.add_argument("--rounds", type=int, default=6, help="at most this many rounds per mode")
    ap.add_argument("--seconds", type=float, default=0,
                    help="time budget from the start (servers' start-up included): no round starts that "
                         "would end past it (0: none)")
    ap.add_argument("--mode", choices=sorted(MODES), default="sequential")
    ap.add_argument("--together", action="store_const", const="together", dest="mode",
                    help="--mode together: each round loads both servers at once")
    ap.add_argument("--settle", action=argparse.BooleanOptionalAction, default=True,
                    help="flush each server's SSD tier after its load, before the next load starts (default)")
    ap.add_argument("--resume", type=int, default=0, help="measure a resume after this many tokens instead")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
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
        logs = {n: str(args.out / f"server-{n}.log") for n in ("on", "off")}
        servers = {"on": ServeProcess(*on_args, env=env, log_path=logs["on"]),  # both start at once
                   "off": ServeProcess(*off_args, env=env, log_path=logs["off"])}
        name = f"checkpoints-b{args.batch}-r{args.rows}-{args.mode}.json"
        head = {"model": str(args.model or f"tiny llama {args.preset}"), "tokens": args.tokens, "rows": args.rows,
                "batch": args.batch, "interval": args.interval, "rounds": args.rounds, "settle": args.settle}
        modes: dict = {}

        def save(partial: dict | None = None, mode: str | None = None) -> None:
            """The summary so far, after every round: a run cut by its time limit keeps its rounds."""
            doc = {**head, **modes, **({mode: partial} if mode else {})}
            (args.out / name).write_text(json.dumps(doc, indent=2) + "\n")

        try:
            with servers["on"], servers["off"]:
                for server in servers.values():  # first-request costs out of the measured rounds
                    one_round(server.url, 1, 16, "warm")
                    one_round(server.url, args.rows, 32, "warm-rows")  # the batch at its width once
                    if args.settle:
                        settle(server.url)
                print(f"servers up and warm in {time.monotonic() - t0:.0f} s", flush=True)
                deadline = t0 + args.seconds if args.seconds else float("inf")
                for m in MODES[args.mode]:
                    modes[m] = run_mode(servers, args, m == "together", deadline,
                                        lambda partial, m=m: save(partial, m))
                    save()
        finally:
            for server in servers.values():  # the other one too when one failed to start
                server.__exit__()
    print(json.dumps({m: {k: v[k] for k in ("decode_tok_s_median", "on_over_off", "step_off_over_on")}
                      for m, v in modes.items()}))


MODES = {"sequential": ("sequential",), "together": ("together",), "both": ("sequential", "together")}


if __name__ == "__main__":
    main()
