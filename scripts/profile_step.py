"""Where a batch decode step's time goes: cProfile of the engine's decode loop at B rows.

    python scripts/profile_step.py --model DIR --rows 64 --out $OUT

Admits B greedy rows (ignore_eos), waits until all have joined, then profiles
the decode steps until they finish. Writes profile.txt (top functions by
internal and cumulative time) and profile.json (steps, wall time, tok/s, and
host Python time per step vs time inside the decode step itself, where the
one-per-step token read-back waits for the device). ``--anatomy`` times one
decode forward by KV length against its no-cache floor (anatomy.json).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

from mlxq.engine.scheduler import BatchScheduler, SchedulerConfig
from mlxq.engine.types import Request, SamplingParams
from mlxq.kv.projection import measure_footprint
from mlxq.models.loader import load_model


def _prompt(lm, i: int, length: int) -> list[int]:
    """Row ``i``'s synthetic prompt: distinct per row, inside the vocabulary (tiny models too)."""
    span = min(20000, lm.model.args.vocab_size - 1001)
    return [1000 + (i * 31 + j * 7) % span for j in range(length)]


def decode_run(lm, footprint, rows: int, prompt_tokens: int, max_tokens: int, profile=None):
    """Admit ``rows`` rows, wait for all to join, then time (and optionally profile) decode to the end."""
    sched = BatchScheduler(lm.model, lm.tokenizer, footprint, SchedulerConfig(rows, rows, 2048, None))
    for i in range(rows):
        request = Request(f"r{i}", _prompt(lm, i, prompt_tokens), SamplingParams(), max_tokens, ignore_eos=True)
        sched.add(request, lambda e: None)
    while sched.num_rows < rows:
        sched.step()
    steps, start = 0, time.perf_counter()
    if profile:
        profile.enable()
    while not sched.is_idle:
        sched.step()
        steps += 1
    if profile:
        profile.disable()
    return steps, time.perf_counter() - start


def waves_run(lm, footprint, rows: int, total: int, prompt_tokens: int, max_tokens: int, profile=None):
    """``total`` requests through ``rows`` slots, the next admitted as soon as one fits (a closed-loop load)."""
    sched = BatchScheduler(lm.model, lm.tokenizer, footprint, SchedulerConfig(rows, 8, 2048, None))
    queue = [Request(f"w{i}", _prompt(lm, i, prompt_tokens), SamplingParams(), max_tokens, ignore_eos=True)
             for i in range(total)]
    start = time.perf_counter()
    if profile:
        profile.enable()
    while queue or not sched.is_idle:
        while queue and sched.can_admit(queue[0]):
            sched.add(queue.pop(0), lambda e: None)
        sched.step()
    if profile:
        profile.disable()
    return total * max_tokens / (time.perf_counter() - start)


@contextlib.contextmanager
def float32_attention(model):
    """Within: the model's attention computed in float32 (plain MLX operations)."""
    import mlx.core as mx

    from mlxq.kv.cuda_attention import ops_attention

    def fp32(queries, keys, values, cache, scale, mask, sinks=None):
        up = [x.astype(mx.float32) for x in (queries, keys, values)]
        return ops_attention(*up, scale, mask).astype(queries.dtype)

    module = sys.modules[type(model).__module__]
    saved = module.scaled_dot_product_attention
    module.scaled_dot_product_attention = fp32
    try:
        yield
    finally:
        module.scaled_dot_product_attention = saved


def anatomy(lm, rows: int, lengths: list[int], reps: int = 20) -> dict:
    """Device time of one decode forward of ``rows`` rows, by KV length, against its floors.

    ``no_kv_ms``: the same forward without a cache (attention over one token: the
    weight-streaming floor); ``kv_ms[L]``: with mlx-lm's BatchKVCache holding L tokens
    per row (trimmed back after each forward, so L stays put); ``sample_ms``: the
    vectorized greedy sample over the vocabulary; ``logits_max_diff`` and
    ``greedy_agreement``: the same step's logits with attention routed
    (kv/cuda_attention.py), through mlx-lm's own, and through float32 attention,
    pairwise (with the logits' scale: bf16 rounding through 32 random layers is
    the noise floor any two bf16 paths share).
    """
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    from mlxq.kv.cuda_attention import mlx_lm_only

    model = lm.model
    tokens = mx.zeros((rows, 1), dtype=mx.uint32)

    def timed(fn) -> float:
        for _ in range(3):
            mx.eval(fn())
        start = time.perf_counter()
        for _ in range(reps):
            mx.eval(fn())
        return 1000 * (time.perf_counter() - start) / reps

    out = {"rows": rows, "no_kv_ms": timed(lambda: model(tokens)), "kv_ms": {}}
    args = model.args
    heads = getattr(args, "num_key_value_heads", None) or args.num_attention_heads
    head_dim = getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads
    for length in lengths:
        caches = [BatchKVCache([0] * rows) for _ in model.layers]
        for cache in caches:
            kv = mx.random.normal((rows, heads, length, head_dim)).astype(mx.bfloat16)
            cache.update_and_fetch(kv, kv)
        mx.eval([c.state[:2] for c in caches])

        def step(caches=caches):
            logits = model(tokens, cache=caches)
            for cache in caches:
                cache.trim(1)
            return logits

        out["kv_ms"][str(length)] = timed(step)
        # The same step through mlx-lm's attention, and through float32 attention (the closest
        # to exact; the rest of the model unchanged): how far each bf16 path is from it, by the
        # largest logit difference (against the logits' scale) and by greedy agreement.
        paths = {"routed": step()[:, -1].astype(mx.float32)}
        with mlx_lm_only():
            paths["mlx_lm"] = step()[:, -1].astype(mx.float32)
        with float32_attention(model):
            paths["fp32"] = step()[:, -1].astype(mx.float32)
        picks = {name: mx.argmax(x, axis=-1) for name, x in paths.items()}
        out.setdefault("logits_max_abs", {})[str(length)] = mx.abs(paths["fp32"]).max().item()
        for a, b in (("routed", "mlx_lm"), ("routed", "fp32"), ("mlx_lm", "fp32")):
            name = f"{a}_vs_{b}"
            diff = mx.abs(paths[a] - paths[b]).max().item()
            out.setdefault("logits_max_diff", {}).setdefault(name, {})[str(length)] = diff
            same = (picks[a] == picks[b]).astype(mx.float32).mean().item()
            out.setdefault("greedy_agreement", {}).setdefault(name, {})[str(length)] = same
    logits = model(tokens)[:, -1, :]
    mx.eval(logits)
    out["sample_ms"] = timed(lambda: mx.argmax(logits - mx.logsumexp(logits, axis=-1, keepdims=True), axis=-1))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=180)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--sequence", default="", help="Also time plain runs at these row counts, in order "
                                                    "(first-use costs of new shapes show up here).")
    ap.add_argument("--waves", type=int, default=0, help="Also run this many requests through --rows slots "
                                                         "(closed loop, prompt concurrency 8) and profile it.")
    ap.add_argument("--anatomy", default="", help="KV lengths (e.g. 32,256,1024,4096): time one --rows decode "
                                                  "forward at each, without a cache, and the greedy sample.")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    lm = load_model(args.model)
    from mlxq.kv.cuda_attention import install

    print(f"CUDA attention routing: {install()}", flush=True)  # as the engine does (CUDA only)
    footprint = measure_footprint(lm.model)

    def run(rows: int, profile=None):
        return decode_run(lm, footprint, rows, args.prompt_tokens, args.max_tokens, profile)

    run(min(args.rows, 4))  # warm-up: compile, allocate
    if args.anatomy:
        doc = anatomy(lm, args.rows, [int(x) for x in args.anatomy.split(",")])
        (args.out / "anatomy.json").write_text(json.dumps(doc, indent=2))
        print(json.dumps(doc), flush=True)
    if args.waves:
        waves_run(lm, footprint, args.rows, args.waves, args.prompt_tokens, args.max_tokens)  # warm-up
        tok_s = waves_run(lm, footprint, args.rows, args.waves, args.prompt_tokens, args.max_tokens)
        wprof = cProfile.Profile()
        waves_run(lm, footprint, args.rows, args.waves, args.prompt_tokens, args.max_tokens, wprof)
        text = io.StringIO()
        pstats.Stats(wprof, stream=text).sort_stats("cumulative").print_stats("scheduler|batch_ops|output", 25)
        (args.out / "waves.txt").write_text(f"closed loop: {tok_s:.0f} tok/s\n" + text.getvalue())
        print(f"closed loop {args.waves} requests through {args.rows} rows: {tok_s:.0f} tok/s", flush=True)
    sequence = []
    for rows in [int(x) for x in args.sequence.split(",") if x]:
        n, sec = run(rows)
        sequence.append({"rows": rows, "step_ms": 1000 * sec / n, "tok_s": n * rows / sec})
        print(sequence[-1], flush=True)
    plain_steps, plain_s = run(args.rows)
    prof = cProfile.Profile()
    steps, wall = run(args.rows, prof)
    stats = pstats.Stats(prof)
    text = io.StringIO()
    for key in ("tottime", "cumulative"):
        pstats.Stats(prof, stream=text).sort_stats(key).print_stats(30)
    (args.out / "profile.txt").write_text(text.getvalue())
    # MLX's C++ methods are invisible to cProfile: the blocking token read-back (and any
    # other wait for the device) lands in _decode_step's own time.
    waiting = sum(v[2] for k, v in stats.stats.items() if k[2] == "_decode_step")
    doc = {"rows": args.rows, "steps": plain_steps, "wall_s": plain_s, "tok_s": plain_steps * args.rows / plain_s,
           "step_ms": 1000 * plain_s / plain_steps, "profiled_step_ms": 1000 * wall / steps,
           "host_python_ms_per_step": 1000 * (wall - waiting) / steps,
           "decode_step_own_ms_per_step": 1000 * waiting / steps, "sequence": sequence}
    (args.out / "profile.json").write_text(json.dumps(doc, indent=2))
    print(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
