"""Decode-step time with a full batch: free rows, grammar rows, half and half (in process, no HTTP).

The batch scheduler of the server, stepped on this thread: ROWS requests
join, then STEPS decode steps are timed per mix (rounds interleaved). Free
rows ignore EOS; grammar rows follow bench_structured.py's schema, and a row
that completes its JSON is replaced so the batch stays full. Prints one JSON
line per mix: wall and process CPU ms per step (CPU time is steadier on a
shared host), rows per step, host ms computing masks per step.

    python scripts/profile_grammar_step.py [--model PATH] --rows 64 --steps 40
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import llguidance
import mlx_lm
from bench_structured import SCHEMA  # scripts/ is on sys.path when run as a script

from mlxq.engine.grammar_timing import GrammarTiming
from mlxq.engine.scheduler import BatchScheduler, SchedulerConfig
from mlxq.engine.types import GrammarSpec, Request, SamplingParams
from mlxq.kv.projection import measure_footprint
from mlxq.kv.scheme import NATIVE
from mlxq.models.default import ensure_default_model


def make_request(tokenizer, grammar: GrammarSpec | None, n: int) -> Request:
    prompt = tokenizer.encode(f"Write record number {n}.")
    params = SamplingParams(temperature=0.8, seed=n)
    if grammar is None:
        return Request(f"free-{n}", prompt, params, 10_000, ignore_eos=True)
    return Request(f"json-{n}", prompt, params, 400, grammar=grammar)


def time_mix(model, tokenizer, grammar: GrammarSpec, kinds: list[bool], steps: int, token0_in_decode: bool) -> dict:
    timing = GrammarTiming()
    config = SchedulerConfig(len(kinds), len(kinds), 2048, None, token0_in_decode)
    scheduler = BatchScheduler(model, tokenizer, measure_footprint(model, 2048, NATIVE), config, grammar_timing=timing)
    serial = iter(range(1_000_000))
    for kind in kinds:
        scheduler.add(make_request(tokenizer, grammar if kind else None, next(serial)), lambda e: None)
    while scheduler.num_rows < len(kinds):
        scheduler.step()
    for _ in range(3):  # settle: every row past its first token
        scheduler.step()
    # getattr: code before GrammarTiming.steps counted no steps (then every step of a grammar mix computes masks)
    rows, before = [], (getattr(timing, "steps", 0), timing.seconds)
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        missing = len(kinds) - scheduler.num_rows - scheduler.num_prefilling
        for _ in range(missing):  # a completed JSON row is replaced by a new grammar row
            scheduler.add(make_request(tokenizer, grammar, next(serial)), lambda e: None)
        rows.append(scheduler.num_rows)
        scheduler.step()
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    mask_steps, mask_s = getattr(timing, "steps", steps) - before[0], timing.seconds - before[1]
    running = scheduler.batch.rows if hasattr(scheduler, "batch") else scheduler._rows  # either scheduler layout
    for row in list(running):
        row.request.cancelled.set()
    while not scheduler.is_idle:
        scheduler.step()
    return {"ms_per_step": 1e3 * wall / steps, "cpu_ms_per_step": 1e3 * cpu / steps,
            "rows_per_step": statistics.mean(rows), "tok_s": sum(rows) / wall,
            "mask_ms_per_step": 1e3 * mask_s / max(mask_steps, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model directory (default: the embedded default model)")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--token0-in-decode", type=int, default=1)
    args = parser.parse_args()
    model, tokenizer = mlx_lm.load(args.model or str(ensure_default_model()))
    text = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA), defaults={"whitespace_flexible": False})
    grammar = GrammarSpec("json_schema", text)
    r = args.rows
    mixes = {"free": [False] * r, "grammar": [True] * r, "mixed": [i % 2 == 0 for i in range(r)]}
    time_mix(model, tokenizer, grammar, mixes["mixed"], 5, bool(args.token0_in_decode))  # warm-up
    for _ in range(args.rounds):
        for name, kinds in mixes.items():
            out = time_mix(model, tokenizer, grammar, kinds, args.steps, bool(args.token0_in_decode))
            print(json.dumps({"mix": name, "rows": r, **{k: round(v, 3) for k, v in out.items()}}), flush=True)


if __name__ == "__main__":
    main()
