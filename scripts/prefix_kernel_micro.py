"""The tensor-core prefix kernel's cuts side by side: time, TFLOP/s and error per query shape (CUDA).

    python scripts/prefix_kernel_micro.py --json out.json
    python scripts/prefix_kernel_micro.py --cases prefill:64x16018+58 --variants w4,t4.2.32.3.1

kv/prefix_mma_kernel.py's ``prefix_partials`` for every case (rows x prefix + queries per row: 58 is
a burst's tails' prefill, 1 a decode step; 8B shape: 32 query heads on 8 KV heads, head dim 128,
bf16) and variant:

- ``d``: the build's own cut for the query shape (any build: the script runs on main's too);
- ``w4`` / ``w8``: one 16-row tile per warp, 4 / 8 warps per block (main's kernel);
- ``tW.M.K.S.Q[.B[.U]]``: the tiled kernel (``Tiling(W, M, K, S, Q, B, U)``: warps, 16-row tiles per
  warp, keys per stage, stages, queries in shared memory, blocks per SM for ``__launch_bounds__``, keys
  per softmax step); ``@N`` after a variant: its target blocks per launch.

Prefill cases time ``one_level`` over the partials (what the prefill path runs), decode cases the
partials alone. Each variant is wrapped: one that fails to compile or run is reported and the others
go on. The error is max |normalized level - plain stacked GEMMs| over the first and the last rows
(bf16 inputs).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import mlx.core as mx

from mlxq.kv.prefix_mma_kernel import one_level, prefix_partials
from mlxq.kv.shared_prefix_attention import stacked_prefix_stats

CASES = "prefill:64x16018+58,prefill:5x1000+9,prefill:64x2048+58,decode:64x2048+1,decode:64x16384+1"
VARIANTS = ("w4,w8,t4.1.64.2.0,t4.1.64.2.0.3,t4.1.64.2.1.3,t8.1.64.2.0,t4.2.32.2.1,t4.2.32.3.1,t4.2.64.2.1,"
            "t4.2.64.2.1.0.32,t8.2.32.2.1,t8.2.64.2.1.0.32,t4.2.32.3.1@2000,t4.2.32.3.1@2800,t4.1.32.3.1.3")


def parse_variant(text: str) -> tuple:
    """(tiling, warps, target blocks) of ``w4``, ``t4.2.32.3.1@528`` and the like."""
    name, _, target = text.partition("@")
    target = int(target) if target else 264
    if name == "d":
        return None, None, target
    from mlxq.kv import prefix_mma_kernel

    if name.startswith("w"):
        if not hasattr(prefix_mma_kernel, "Tiling"):  # main's kernel: warps per block
            return None, int(name[1:]), target
        return prefix_mma_kernel.Tiling(warps=int(name[1:])), None, target
    Tiling = prefix_mma_kernel.Tiling  # noqa: N806
    warps, tiles, keys, stages, shared, *blocks = (int(x) for x in name[1:].split("."))
    return Tiling(warps, tiles, keys, stages, bool(shared), *blocks), None, target


def timed(fn, reps: int, inner: int) -> float:
    """Median ms of one call, ``inner`` calls per timed evaluation."""
    mx.eval(fn())
    times = []
    for _ in range(reps):
        mx.synchronize()
        start = time.perf_counter()
        mx.eval([fn() for _ in range(inner)])
        mx.synchronize()
        times.append((time.perf_counter() - start) * 1e3 / inner)
    return statistics.median(times)


def run_case(kind: str, rows: int, prefix: int, queries: int, variants: list[str], reps: int,
             heads: int = 32, kv_heads: int = 8, dim: int = 128) -> dict:
    mx.random.seed(0)
    q = mx.random.normal((rows, queries, heads, dim)).astype(mx.bfloat16).swapaxes(1, 2)
    kv = mx.random.normal((2, 1, kv_heads, prefix, dim)).astype(mx.bfloat16)
    keys, values = kv[0], kv[1]
    mx.eval(q, keys, values)
    scale = dim**-0.5
    check_rows = min(rows, 4)
    stacked = check_rows * heads // kv_heads * queries
    want = [(w / t).astype(mx.float32) for w, _, t in (stacked_prefix_stats(q[:check_rows], keys, values, scale),
                                                       stacked_prefix_stats(q[-check_rows:], keys, values, scale))]
    mx.eval(want)
    flop = 4 * rows * heads * queries * prefix * dim
    inner = 3 if kind == "prefill" else 20
    result = {"case": f"{kind}:{rows}x{prefix}+{queries}", "gflop": round(flop / 1e9, 1), "variants": {}}
    for spec in variants:
        tiling, warps, target = parse_variant(spec)
        try:
            def partials(target=target, warps=warps, tiling=tiling):
                if tiling is None:  # positional: any build's signature
                    return prefix_partials(q, keys, values, scale, target, *([warps] if warps else []))
                return prefix_partials(q, keys, values, scale, target, tiling=tiling)

            fn = (lambda partials=partials: one_level(*partials())) if kind == "prefill" else partials
            got = fn() if kind == "prefill" else one_level(*fn())
            got = got[0] / got[2]
            error = max(mx.abs(got[:, :stacked] - want[0]).max().item(),
                        mx.abs(got[:, -stacked:] - want[1]).max().item())
            ms = timed(fn, reps, inner)
            row = {"ms": round(ms, 4), "tflops": round(flop / ms / 1e9, 1), "error": error}
        except Exception as exc:  # one variant failing must not stop the others
            row = {"failed": f"{type(exc).__name__}: {str(exc)[:1500]}"}
        result["variants"][spec] = row
        print(f"{result['case']} {spec}: {row}", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=CASES, help="kind:rows x prefix + queries per row, comma-separated")
    parser.add_argument("--variants", default=VARIANTS)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--heads", default="32:8:128", help="query heads:KV heads:head dim")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    heads, kv_heads, dim = (int(x) for x in args.heads.split(":"))
    results = []
    for case in args.cases.split(","):
        kind, shape = case.split(":")
        rows, rest = shape.split("x")
        prefix, queries = rest.split("+")
        results.append(run_case(kind, int(rows), int(prefix), int(queries), args.variants.split(","), args.reps,
                                heads, kv_heads, dim))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": str(mx.default_device()), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
