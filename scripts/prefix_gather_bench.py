"""The prefix gather alone (engine/prefix_gather.py): a cached burst's rows written from stored pieces.

    python scripts/prefix_gather_bench.py --rows 64 --prefix 2195 --layers 32 --out gather.json

Every row reads one shared piece of ``--prefix`` tokens and a piece of
``--head`` tokens of its own (a stored chain of another round), as the rows
of a cached 64-agent burst on the 8B shape do (8 KV heads of 128, bf16).
``off``: each row's whole prefix is written at its left padding; ``auto``:
each row's own tokens past the shared prefix only (the tails of a group that
reads the prefix by reference). Each call gathers every layer's keys and
values and is timed between two evaluation fences; GB/s counts the bytes
written. ``--take`` times MLX's ``take`` path beside the kernel, ``--pool`` the
kernel over the pieces' concatenation (the form before it read up to
``prefix_gather.SLOTS`` pieces in place).
"""

from __future__ import annotations

import argparse
import json
import time

import mlx.core as mx

from mlxq.engine import prefix_gather
from mlxq.engine.prefix_gather import Piece, RowPrefix, gather_prefixes


def pieces(tokens: int, layers: int, heads: int, dim: int, dtype) -> Piece:
    spans = [tuple(mx.random.normal((1, heads, tokens, dim)).astype(dtype) for _ in range(2)) for _ in range(layers)]
    mx.eval(spans)
    return Piece(spans)


def timed(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        mx.synchronize()
        start = time.perf_counter()
        mx.eval(fn())
        mx.synchronize()
        out.append(round(1000 * (time.perf_counter() - start), 2))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--prefix", type=int, default=2195)
    ap.add_argument("--head", type=int, default=2)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--take", action="store_true", help="also time MLX's take (the kernel turned off)")
    ap.add_argument("--pool", action="store_true",
                    help="also time the kernel over the concatenated pool (the pieces never read in place)")
    ap.add_argument("--out", default="prefix-gather-bench.json")
    args = ap.parse_args()
    dtype = mx.bfloat16 if mx.cuda.is_available() else mx.float32
    system = pieces(args.prefix, args.layers, args.heads, args.dim, dtype)
    own = [pieces(args.head, args.layers, args.heads, args.dim, dtype) for _ in range(args.rows)]
    tails = [40 + (r * 7) % 25 for r in range(args.rows)]
    cases = {"off": [RowPrefix((system, o), args.prefix + args.head) for o in own],
             "auto": [RowPrefix((system, o), args.head, skip=args.prefix) for o in own]}
    results = {"rows": args.rows, "prefix": args.prefix, "layers": args.layers, "dtype": str(dtype), "cases": {}}
    paths = [("kernel", lambda pool: True)] + ([("kernel_pool", lambda pool: True)] if args.pool else []) \
        + ([("take", lambda pool: False)] if args.take else [])
    for name, prefixes in cases.items():
        end = max(p.length + t for p, t in zip(prefixes, tails, strict=True))
        capacity = -(-(end + 256) // 256) * 256
        padding = [end - p.length - t for p, t in zip(prefixes, tails, strict=True)]
        written = 2 * args.layers * args.rows * args.heads * capacity * args.dim * dtype.size
        for path, applies in paths:
            kept = prefix_gather._kernel_applies
            prefix_gather._kernel_applies = lambda pool, a=applies, k=kept: a(pool) and k(pool)
            slotted = prefix_gather.MIN_SLOTTED
            prefix_gather.MIN_SLOTTED = prefix_gather.SLOTS + 1 if path == "kernel_pool" else slotted
            try:
                ms = timed(lambda ps=prefixes, pd=padding, c=capacity: gather_prefixes(ps, pd, c), args.repeats)
            finally:
                prefix_gather._kernel_applies = kept
                prefix_gather.MIN_SLOTTED = slotted
            best = min(ms[1:] or ms)
            results["cases"][f"{name}/{path}"] = {"ms": ms, "best_ms": best, "gb_written": round(written / 1e9, 2),
                                                  "gb_s": round(written / 1e9 / (best / 1000), 1)}
            print(json.dumps({f"{name}/{path}": results["cases"][f"{name}/{path}"]}), flush=True)
    with open(args.out, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
