"""B=1 batch-lane decode on the main thread vs on a worker thread, alternating rounds.

The server's engine is a long-lived worker thread. mlx-lm's generation stream
is thread-local, so a thread's first steps run on a new stream (first-use
costs of its own); ``--fresh-threads`` starts a new thread per run to show
that cost, the default keeps one worker thread as the server does.

    python scripts/thread_probe.py --model /tmp/mlxq-models/llama3-8b --json out.json
"""

from __future__ import annotations

import argparse
import json
import queue
import statistics
import threading
from pathlib import Path

from bench_b1 import batch_lane

from mlxq.kv.cuda_attention import install
from mlxq.kv.projection import measure_footprint
from mlxq.models.loader import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--fresh-threads", action="store_true", help="a new thread per run")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    lm = load_model(args.model)
    print(f"CUDA attention routing: {install()}", flush=True)  # as the engine does (CUDA only)
    footprint = measure_footprint(lm.model)
    prompt = [1000 + i for i in range(180)]

    def run():
        tok_s, _, timing = batch_lane(lm, footprint, prompt, args.tokens)
        return tok_s, timing

    jobs: queue.Queue = queue.Queue()
    results: queue.Queue = queue.Queue()

    def worker():
        while jobs.get():
            results.put(run())

    if not args.fresh_threads:
        threading.Thread(target=worker, daemon=True).start()

    def on_thread():
        if args.fresh_threads:
            box = {}
            thread = threading.Thread(target=lambda: box.update(r=run()))
            thread.start()
            thread.join()
            return box["r"]
        jobs.put(True)
        return results.get()

    lanes = {"main": run, "thread": on_thread}
    run()
    on_thread()
    out: dict[str, list[dict]] = {"main": [], "thread": []}
    for r in range(args.rounds):
        for name in ("main", "thread") if r % 2 == 0 else ("thread", "main"):
            tok_s, timing = lanes[name]()
            out[name].append({"tok_s": tok_s, **{k: timing[k] for k in ("step_ms", "build_ms", "submit_ms",
                                                                          "device_wait_ms")}})
            print(name, out[name][-1], flush=True)
    medians = {name: statistics.median(x["tok_s"] for x in runs) for name, runs in out.items()}
    print("median tok/s:", medians)
    if args.json:
        args.json.write_text(json.dumps({"fresh_threads": args.fresh_threads, "median_tok_s": medians,
                                         "runs": out}, indent=1))


if __name__ == "__main__":
    main()
