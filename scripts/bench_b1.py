"""B=1 on the batch lane vs the serial lane: decode tok/s, paired in one process.

The batch lane's single row should run the serial lane's graph (adopted
solo caches), so the ratio should sit at ~1.0. Rounds alternate lanes.

    python scripts/bench_b1.py --preset small --tokens 128 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import mlxq  # noqa: F401  (fast BLAS before mlx)
from mlxq.engine.scheduler import BatchScheduler, SchedulerConfig
from mlxq.engine.serial import run_serial
from mlxq.engine.types import Request, SamplingParams
from mlxq.kv.projection import measure_footprint
from mlxq.models.loader import load_model
from mlxq.models.tiny import build_tiny_model


def serial(lm, prompt, n):
    out = run_serial(lm.model, lm.tokenizer, Request("s", prompt, SamplingParams(), n, ignore_eos=True),
                     lambda e: None, prefill_step_size=2048)
    return out.usage().decode_tok_s, out.tokens


def batch_lane(lm, footprint, prompt, n):
    done = {}
    scheduler = BatchScheduler(lm.model, lm.tokenizer, footprint, SchedulerConfig(8, 4, 2048, None),
                               on_finish=lambda row: done.update(row=row))
    scheduler.add(Request("b", prompt, SamplingParams(), n, ignore_eos=True), lambda e: None)
    while not scheduler.is_idle:
        scheduler.step()
    output = done["row"].output
    return output.usage().decode_tok_s, output.tokens, scheduler.timing.as_dict()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--arch", default="llama")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args()
    path = args.model or build_tiny_model(args.arch, Path(tempfile.mkdtemp()) / "m", preset=args.preset)
    lm = load_model(str(path))
    footprint = measure_footprint(lm.model)
    prompt = [1 + i % 1000 for i in range(64)]
    serial(lm, prompt, 8)
    runs = {"serial": [], "batch": []}
    for r in range(args.rounds):
        order = ("serial", "batch") if r % 2 == 0 else ("batch", "serial")
        for lane in order:
            tps, tokens = serial(lm, prompt, args.tokens) if lane == "serial" else batch_lane(
                lm, footprint, prompt, args.tokens)[:2]
            runs[lane].append({"tok_s": tps, "tokens": tokens})
    same = all(a["tokens"] == b["tokens"] for a, b in zip(runs["serial"], runs["batch"], strict=True))
    s = statistics.median(x["tok_s"] for x in runs["serial"])
    b = statistics.median(x["tok_s"] for x in runs["batch"])
    print(f"serial {s:.1f} tok/s   batch-lane B=1 {b:.1f} tok/s   ratio {b / s:.3f}   identical tokens: {same}")
    if args.json:
        Path(args.json).write_text(json.dumps({"serial_tok_s": s, "batch_tok_s": b, "ratio": b / s,
                                               "identical_tokens": same, "runs": {
                                                   k: [x["tok_s"] for x in v] for k, v in runs.items()}},
                                              indent=1))


if __name__ == "__main__":
    main()
