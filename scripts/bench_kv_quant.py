"""KV quantization, measured: bytes per token, rows that fit a budget, decode tok/s at B=1 and B=8.

    python scripts/bench_kv_quant.py --preset small --out docs/results/kv-quant-cpu

Per scheme (off, 8, 4) on one model, in one process, schemes alternating
over --rounds:
- KV bytes per token (measured from real caches) and how many rows of
  prompt + max_tokens fit a fixed --kv-budget (the budget is what 8 rows
  need at full precision), exactly as admission projects them;
- B=1 decode tok/s on the serial lane (mlx-lm's generate_step);
- B=8 aggregate decode tok/s on the batch lane (8 rows joined, then timed
  until they finish).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from mlxq.bench.datasets import corpus_words
from mlxq.engine.scheduler import BatchScheduler, SchedulerConfig
from mlxq.engine.serial import run_serial
from mlxq.engine.types import Request, SamplingParams
from mlxq.kv.projection import measure_footprint
from mlxq.kv.scheme import head_dims, probe_caches, resolve_scheme
from mlxq.models.tiny import build_tiny_model

SCHEMES = ("off", "8", "4")


def prompt_ids(tokenizer, n: int, seed: int) -> list[int]:
    words = corpus_words()
    text = " ".join(words[(seed * 131 + i * 7919) % len(words)] for i in range(n))
    return tokenizer.encode(text)[:n]


def rows_that_fit(footprint, budget: int, tokens: int) -> int:
    rows = 0
    while footprint.batch_bytes([tokens] * (rows + 1)) <= budget:
        rows += 1
    return rows


def b1_tok_s(model, tokenizer, scheme, prompt: list[int], max_tokens: int) -> float:
    request = Request("b1", prompt, SamplingParams(), max_tokens, ignore_eos=True)
    out = run_serial(model, tokenizer, request, lambda e: None, prefill_step_size=2048, scheme=scheme)
    return out.usage().decode_tok_s


def b8_tok_s(model, tokenizer, scheme, prompts: list[list[int]], max_tokens: int) -> float:
    footprint = measure_footprint(model, 2048, scheme)
    scheduler = BatchScheduler(model, tokenizer, footprint, SchedulerConfig(len(prompts), len(prompts), 2048, None),
                               scheme=scheme)
    for i, p in enumerate(prompts):
        scheduler.add(Request(f"r{i}", p, SamplingParams(), max_tokens, ignore_eos=True), lambda e: None)
    while scheduler.num_rows < len(prompts):
        scheduler.step()
    steps, start = 0, time.perf_counter()
    while not scheduler.is_idle:
        scheduler.step()
        steps += 1
    return steps * len(prompts) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--arch", default="llama")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    import mlx_lm  # after mlxq (imported above), which loads the fast BLAS before mlx

    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_model(args.arch, Path(tmp) / "m", preset=args.preset)
        model, tokenizer = mlx_lm.load(str(path))
        probe = probe_caches(model)
        schemes = {q: resolve_scheme(q, 64, path, probe, head_dims(probe)) for q in SCHEMES}
    row_tokens = args.prompt_tokens + args.max_tokens
    native = measure_footprint(model, 2048, schemes["off"])
    budget = native.batch_bytes([row_tokens] * 8)
    result = {"preset": args.preset, "arch": args.arch, "date": time.strftime("%Y-%m-%d"),
              "machine": os.uname().nodename, "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
              "kv_budget_bytes": budget, "schemes": {}}
    prompts = [prompt_ids(tokenizer, args.prompt_tokens, s) for s in range(8)]
    b1 = {q: [] for q in SCHEMES}
    b8 = {q: [] for q in SCHEMES}
    b1_tok_s(model, tokenizer, schemes["off"], prompts[0], 16)  # warm-up
    for r in range(args.rounds):
        order = SCHEMES if r % 2 == 0 else tuple(reversed(SCHEMES))
        for q in order:
            b1[q].append(b1_tok_s(model, tokenizer, schemes[q], prompts[0], args.max_tokens))
            b8[q].append(b8_tok_s(model, tokenizer, schemes[q], prompts, args.max_tokens))
            print(q, round(b1[q][-1], 1), round(b8[q][-1], 1), flush=True)
    for q in SCHEMES:
        fp = measure_footprint(model, 2048, schemes[q])
        per_token = sum(layer.bytes_per_token for layer in fp.layers)
        result["schemes"][q] = {
            "key": schemes[q].key, "kv_bytes_per_token": per_token,
            "rows_in_budget": rows_that_fit(fp, budget, row_tokens),
            "b1_decode_tok_s": b1[q], "b8_decode_tok_s": b8[q],
            "b1_median": statistics.median(b1[q]), "b8_median": statistics.median(b8[q]),
        }
    off = result["schemes"]["off"]
    for q in SCHEMES:
        s = result["schemes"][q]
        s["rows_vs_off"] = round(s["rows_in_budget"] / off["rows_in_budget"], 3)
        s["b1_vs_off"] = round(s["b1_median"] / off["b1_median"], 3)
        s["b8_vs_off"] = round(s["b8_median"] / off["b8_median"], 3)
        print(q, {k: v for k, v in s.items() if not isinstance(v, list)})
    (args.out / "kv_quant.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
