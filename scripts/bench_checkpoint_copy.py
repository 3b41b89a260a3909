"""What staging one checkpoint link costs the engine thread: per-row views vs the one-pass copy.

    python scripts/bench_checkpoint_copy.py --layers 32 --rows 32 --tokens 1280 --span 256 --out OUT

A batch of plain full-attention caches (mlx-lm's BatchKVCache, random KV,
``--rows`` rows of ``--tokens`` tokens, an 8B model's shape by default) and,
``--repeats`` times, one row's link of ``--span`` tokens staged as the batch
lane stages it: ``views`` copies it through a view of the row, array by
array (engine/checkpoint_rows.py's per-row path); ``spans`` copies it in one
pass (engine/checkpoint_spans.py: the kernel on CUDA, MLX operations
elsewhere). ``--links N`` stages N rows' links in one step instead. Per
path: the engine thread's time to build and submit the copies
(``engine_ms``, what a decode step pays) and the time until they are on the
host (``done_ms``), medians; and (one link) whether both paths' bytes are equal.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

from mlxq.engine.checkpoint_spans import RowSpan, copy_spans, span_arrays
from mlxq.engine.checkpointing import link_layers
from mlxq.kv.batch_ops import view_row
from mlxq.store.checkpoint_pack import stage_packs

DTYPES = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}


def batch_caches(args) -> list:
    caches = []
    for _ in range(args.layers):
        cache = BatchKVCache([0] * args.rows)
        shape = (args.rows, args.heads, args.tokens, args.dim)
        cache.update_and_fetch(mx.random.normal(shape).astype(args.dtype), mx.random.normal(shape).astype(args.dtype))
        caches.append(cache)
    mx.eval([c.keys for c in caches] + [c.values for c in caches])
    return caches


def stage_views(caches: list, rows: list[int], start: int) -> list:
    paddings = [c.left_padding.tolist() for c in caches]
    packs = []
    for i in rows:
        packs += stage_packs(link_layers(view_row(caches, i, paddings), start), 32 * 2**20, True)[1]
    return packs


def stage_spans(caches: list, rows: list[int], start: int) -> list:
    arrays = span_arrays(caches)
    return copy_spans(arrays, [RowSpan(i, start, caches[0]._idx - start) for i in rows], host_side=True)[1]


def timed(stage, caches, args) -> tuple[dict, list]:
    engine, done, packs = [], [], []
    for r in range(args.repeats + 1):
        rows = [(r * args.links + k) % args.rows for k in range(args.links)]
        begin = time.perf_counter()
        packs = stage(caches, rows, args.tokens - args.span)
        mx.async_eval(*(a for p in packs for a in p.arrays))
        submitted = time.perf_counter()
        for p in packs:
            p.host()
        if r:  # the first run compiles
            engine.append(1000 * (submitted - begin))
            done.append(1000 * (time.perf_counter() - begin))
    return {"engine_ms": round(statistics.median(engine), 3), "done_ms": round(statistics.median(done), 3)}, packs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=1280)
    ap.add_argument("--span", type=int, default=256)
    ap.add_argument("--links", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    args.dtype = DTYPES[args.dtype]
    caches = batch_caches(args)
    views, view_packs = timed(stage_views, caches, args)
    spans, span_packs = timed(stage_spans, caches, args)
    same = None  # several links: the kernel's Packs hold them in another order
    if args.links == 1:
        same = b"".join(bytes(p.host()) for p in view_packs) == b"".join(bytes(p.host()) for p in span_packs)
    summary = {"device": "cuda" if mx.cuda.is_available() else "cpu", "layers": args.layers, "rows": args.rows,
               "tokens": args.tokens, "span": args.span, "links": args.links, "dtype": str(args.dtype),
               "link_mb": round(sum(p.nbytes for p in span_packs) / args.links / 2**20, 2),
               "views": views, "spans": spans, "same_bytes": same}
    print(json.dumps(summary), flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"checkpoint-copy-l{args.links}.json").write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
