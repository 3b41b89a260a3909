"""Host work per batch decode step, counted: Python function calls per step (cProfile), by row count.

    PYTHONPATH=TREE python scripts/bench_step_calls.py --model DIR

A count rather than a time: on a shared 2-core machine wall and CPU times of a
decode step vary several-fold between runs, while the number of Python calls
the scheduler makes per step is the same every run. Run it once per tree
(PYTHONPATH) to compare the host work of two versions of the batch lane.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats

from mlxq.engine.scheduler import BatchScheduler, SchedulerConfig
from mlxq.engine.types import Request, SamplingParams
from mlxq.kv.projection import measure_footprint
from mlxq.models.loader import load_model


def calls_per_step(lm, footprint, rows: int, prompt_tokens: int, max_tokens: int) -> float:
    """Admit ``rows`` greedy rows, wait until all joined, then count the calls of every decode step to the end."""
    sched = BatchScheduler(lm.model, lm.tokenizer, footprint, SchedulerConfig(rows, rows, 2048, None))
    span = min(20000, lm.model.args.vocab_size - 1001)
    for i in range(rows):
        prompt = [1000 + (i * 31 + j * 7) % span for j in range(prompt_tokens)]
        sched.add(Request(f"r{i}", prompt, SamplingParams(), max_tokens, ignore_eos=True), lambda e: None)
    while sched.num_rows < rows:
        sched.step()
    profile, steps = cProfile.Profile(), 0
    profile.enable()
    while not sched.is_idle:
        sched.step()
        steps += 1
    profile.disable()
    return pstats.Stats(profile).total_calls / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args()
    lm = load_model(args.model)
    footprint = measure_footprint(lm.model)
    out = {rows: round(calls_per_step(lm, footprint, rows, args.prompt_tokens, args.max_tokens), 1)
           for rows in (int(x) for x in args.rows.split(","))}
    print(json.dumps({"calls_per_step_by_rows": out}))


if __name__ == "__main__":
    main()
