"""Time to first token of short prompts at the engine, against the forward it cannot beat.

Serving meets a new prompt length with almost every request. For each of
``--lengths`` distinct lengths this times, in one process:

  floor        one mlx-lm forward of the prompt on fresh caches and its argmax, synced:
               the least a first token costs on this device (mlx-lm's own attention)
  mlxq_first   the batch lane's TTFT (submit -> token 0 sampled) the first time it meets
               that length, scheduled as ``mlxq serve`` does on this device (attention
               routing, warm-up, token-0 placement)
  mlxq_again   the same length again, another prompt: what is left once the shape is known

The floor runs on lengths one off from mlxq's, so each column meets its lengths
new. The gap first - again is per-shape first-use cost; again - floor is what the
scheduler adds around the forward.

    python scripts/ttft_probe.py --model /tmp/mlxq-models/llama3-8b --out results/
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from mlxq.engine.engine import _on_gpu
from mlxq.engine.scheduler import BatchScheduler, SchedulerConfig
from mlxq.engine.types import Request, SamplingParams
from mlxq.engine.warmup import warm_up
from mlxq.kv.cuda_attention import install, mlx_lm_only
from mlxq.kv.projection import measure_footprint
from mlxq.models.loader import load_model


def floor_ms(model, prompt: list[int]) -> float:
    mx.synchronize()
    start = time.perf_counter()
    with mlx_lm_only():
        logits = model(mx.array(prompt)[None], cache=make_prompt_cache(model))
        mx.eval(mx.argmax(logits[:, -1], axis=-1))
    return 1000 * (time.perf_counter() - start)


def engine_ttft_ms(scheduler: BatchScheduler, done: dict, prompt: list[int]) -> float:
    scheduler.add(Request(f"p{random.random()}", prompt, SamplingParams(), 2, ignore_eos=True), lambda e: None)
    while not scheduler.is_idle:
        scheduler.step()
    return 1000 * done["usage"].ttft_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--lengths", default=",".join(str(n) for n in range(120, 200, 6)))
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    lm = load_model(args.model)
    routed = install()
    footprint = measure_footprint(lm.model)
    config = SchedulerConfig(8, 8, 2048, None, token0_in_decode=_on_gpu())
    done = {}
    scheduler = BatchScheduler(lm.model, lm.tokenizer, footprint, config,
                               on_finish=lambda row: done.update(usage=row.output.usage()))
    warmup_s = warm_up(lm.model, lm.tokenizer, scheduler.scheme, 2048, scheduler)
    rng = random.Random(0)
    vocab = len(lm.tokenizer.vocab)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(vocab // 4, vocab - 1) for _ in range(n)]

    floor_ms(lm.model, prompt(64))  # the plain forward once, as the warm-up did for the engine
    rows = []
    for n in (int(x) for x in args.lengths.split(",")):
        row = {"length": n, "mlxq_first": engine_ttft_ms(scheduler, done, prompt(n)), "floor_first": floor_ms(
            lm.model, prompt(n + 1))}
        row["mlxq_again"] = engine_ttft_ms(scheduler, done, prompt(n))
        row["floor_again"] = floor_ms(lm.model, prompt(n + 1))
        rows.append(row)
        print({k: round(v, 1) for k, v in row.items()}, flush=True)
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k != "length"}
    doc = {"device": str(mx.default_device()), "routed_attention": routed, "token0_in_decode": config.token0_in_decode,
           "warmup_s": warmup_s, "median_ms": med, "rows": rows}
    (args.out / "ttft-probe.json").write_text(json.dumps(doc, indent=1))
    print("medians (ms):", {k: round(v, 1) for k, v in med.items()}, flush=True)


if __name__ == "__main__":
    main()
