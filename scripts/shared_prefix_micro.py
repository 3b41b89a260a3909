"""Per-layer decode attention for rows sharing a prefix: per-row copies vs the prefix read once.

    python scripts/shared_prefix_micro.py --shape 8b [--json OUT]    # the H200 (bf16, Llama-3-8B layer)
    python scripts/shared_prefix_micro.py --shape cpu [--json OUT]   # 2 CPU cores, scaled down (float32)

One decode step (one query per row) of one attention layer, for each case
(rows x shared prefix + own tokens per row; "own" cases share nothing):

- ``copies_masked``: MLX's fused attention over per-row copies [prefix ; tail]
  with the rows' left-padding mask (what mlx-lm runs on every backend);
- ``copies_kernel``: mlxq's CUDA decode kernel on the same copies (one
  block per row and query head: kv/decode_kernel.py; CUDA only);
- ``copies_gqa``: kv/gqa_decode_kernel.py on the same copies (one block per
  row and KV head, 16-byte loads; CUDA only), ``gqa_diff`` its max
  difference to ``copies_masked``, ``gqa_tbps`` the K/V bytes it read per
  second (TB/s);
- ``shared_ops``: kv/shared_prefix_attention.py as plain MLX operations;
- ``shared_compiled``: the same under ``mx.compile`` (fewer launches);
- ``shared_full``: kv/shared_prefix_kernel.py, one CUDA kernel (CUDA only);
- ``shared_split``: kv/tail_merge_kernel.py, prefix GEMMs + one kernel for
  the tails and the merge (CUDA only);
- ``shared_gqa``: kv/gqa_decode_kernel.py, one block per (row, KV head) over
  the prefix then the tail (CUDA only);
- ``shared_mma``: kv/prefix_mma_kernel.py, the prefix on tensor cores in
  splits, then the split path's tail-and-merge kernel (CUDA, bf16 only);
  ``mma_by_target`` the same per ``--mma-targets`` value (blocks per
  launch the splits aim at, and warps per block after a colon: the one-tile
  cut of that many warps),
  ``mma_prefix_ms`` the prefix kernel alone;
- ``shared_mma_gqa``: the same prefix levels merged by the GQA decode
  kernel walking the tails;
- ``shared_metal``: kv/metal_decode_kernel.py, one threadgroup per (row,
  KV head) over the prefix then the tail (Metal only; never run yet: on a
  Mac, ``--shape 8b`` or ``--shape cpu`` times it beside the plain path).

Each timing is the mean of ``reps`` calls evaluated together after one
warm-up; ``diff`` / ``full_diff`` / ``split_diff`` are each path's max
|difference| to ``copies_masked``. On CUDA the kernels' self-checks against
the plain path (float32, bf16) are printed first, on Metal the Metal
kernel's.
Tails are left-padded with per-row starts spread over 0..own/2 (rows of a
batch differ in length).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass

import mlx.core as mx

from mlxq.kv import metal_decode_kernel, shared_prefix_decode
from mlxq.kv.shared_prefix_attention import shared_prefix_attention


@dataclass(frozen=True)
class Shape:
    heads: int  # query heads
    kv_heads: int
    dim: int  # head_dim
    dtype: str
    cases: tuple[tuple[int, int, int], ...]  # (rows, shared prefix tokens, own tokens per row)
    reps: int


SHAPES = {
    "8b": Shape(32, 8, 128, "bfloat16",
                ((64, 2048, 300), (64, 16384, 300), (16, 12288, 300), (8, 2048, 300), (64, 0, 2048),
                 (4, 2048, 300), (16, 2048, 300), (32, 2048, 300), (64, 512, 300), (16, 512, 300)), 20),
    "cpu": Shape(8, 4, 64, "float32",
                 ((16, 512, 64), (16, 2048, 64), (4, 1536, 64), (2, 512, 64), (16, 0, 512)), 5),
    "smoke": Shape(4, 2, 64, "float32", ((4, 64, 8), (2, 0, 16)), 1),  # tests/test_scripts.py
}


@dataclass(frozen=True)
class Row:
    rows: int
    prefix: int
    own: int
    kv_mb: float  # per-row copies' K+V bytes for this layer, MB
    copies_masked_ms: float
    copies_kernel_ms: float | None
    copies_gqa_ms: float | None
    shared_ops_ms: float | None
    shared_compiled_ms: float | None
    shared_full_ms: float | None
    shared_split_ms: float | None
    diff: float | None  # plain shared path vs copies_masked, max abs
    full_diff: float | None
    split_diff: float | None
    gqa_diff: float | None = None
    gqa_tbps: float | None = None
    shared_gqa_ms: float | None = None
    shared_gqa_diff: float | None = None
    shared_mma_ms: float | None = None
    shared_mma_diff: float | None = None
    mma_by_target: dict[str, float] | None = None
    mma_prefix_ms: float | None = None
    shared_mma_gqa_ms: float | None = None
    shared_mma_gqa_diff: float | None = None
    shared_metal_ms: float | None = None
    shared_metal_diff: float | None = None


def timed(fn, reps: int) -> float:
    mx.eval(fn())
    start = time.perf_counter()
    mx.eval([fn() for _ in range(reps)])
    return 1000 * (time.perf_counter() - start) / reps


def copies(prefix: mx.array, tail: mx.array, starts: mx.array) -> mx.array:
    """Per-row copies as the batch lane holds them: [left padding ; prefix ; own tokens], right-aligned."""
    rows = []
    for b, start in enumerate(starts.tolist()):
        rows.append(mx.concatenate([tail[b:b + 1, :, :start], prefix, tail[b:b + 1, :, start:]], axis=2))
    return mx.concatenate(rows, axis=0)


def measure(shape: Shape, rows: int, prefix: int, own: int, mma_targets: tuple[str, ...] = ()) -> Row:
    dtype = getattr(mx, shape.dtype)
    scale = shape.dim**-0.5
    q = mx.random.normal((rows, shape.heads, 1, shape.dim)).astype(dtype)
    tail_k, tail_v = (mx.random.normal((rows, shape.kv_heads, own, shape.dim)).astype(dtype) for _ in range(2))
    starts = mx.array([(i * 37) % (own // 2 + 1) for i in range(rows)])
    if prefix:
        pk, pv = (mx.random.normal((1, shape.kv_heads, prefix, shape.dim)).astype(dtype) for _ in range(2))
        keys, values = (copies(p, t, starts) for p, t in ((pk, tail_k), (pv, tail_v)))
    else:
        keys, values = tail_k, tail_v
    mask = (mx.arange(prefix + own)[None, :] >= starts[:, None])[:, None, None, :]
    mx.eval(q, keys, values, mask, tail_k, tail_v)
    masked = timed(lambda: mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask), shape.reps)
    kernel = gqa = gqa_diff = ops = compiled = diff = None
    paths: dict[str, tuple[float, float]] = {}
    if mx.cuda.is_available():
        from mlxq.kv.decode_kernel import masked_decode_attention
        from mlxq.kv.gqa_decode_kernel import gqa_decode_attention

        kernel = timed(lambda: masked_decode_attention(q, keys, values, starts, scale), shape.reps)
        try:
            gqa = timed(lambda: gqa_decode_attention(q, keys, values, starts, scale), shape.reps)
            want = mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask)
            got = gqa_decode_attention(q, keys, values, starts, scale)
            gqa_diff = mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max().item()
        except Exception as exc:  # a kernel that does not build must not cost the other columns
            print(f"GQA decode kernel failed: {type(exc).__name__}: {str(exc)[:2000]}", flush=True)
    if prefix:
        mx.eval(pk, pv)

        def shared():
            return shared_prefix_attention(q, pk, pv, tail_k, tail_v, starts, scale)

        fused = mx.compile(shared_prefix_attention)
        ops = timed(shared, shape.reps)
        compiled = timed(lambda: fused(q, pk, pv, tail_k, tail_v, starts, scale), shape.reps)
        want = mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask)
        diff = mx.abs(shared().astype(mx.float32) - want.astype(mx.float32)).max().item()
        for path in ("full", "split", "gqa", "mma", "mma_gqa") if mx.cuda.is_available() else ():
            try:
                with shared_prefix_decode.forced(path):
                    got = shared_prefix_decode.attention(q, pk, pv, tail_k, tail_v, starts, scale)
                    paths[path] = (timed(lambda: shared_prefix_decode.attention(  # noqa: B023
                        q, pk, pv, tail_k, tail_v, starts, scale), shape.reps),
                        mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max().item())
            except Exception as exc:  # a kernel that does not build must not cost the other columns
                print(f"shared path {path} failed: {type(exc).__name__}: {str(exc)[:2000]}", flush=True)
        if metal_decode_kernel.on_metal() and metal_decode_kernel.can_run(q, pk, tail_k, tail_v):
            try:
                got = metal_decode_kernel.metal_shared_prefix_decode(q, pk, pv, tail_k, tail_v, starts, scale)
                paths["metal"] = (timed(lambda: metal_decode_kernel.metal_shared_prefix_decode(
                    q, pk, pv, tail_k, tail_v, starts, scale), shape.reps),
                    mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max().item())
            except Exception as exc:
                print(f"Metal decode kernel failed: {type(exc).__name__}: {str(exc)[:2000]}", flush=True)
    kv_mb = (keys.nbytes + values.nbytes) / 1e6
    full, split = paths.get("full", (None, None)), paths.get("split", (None, None))
    shared_gqa, shared_mma = paths.get("gqa", (None, None)), paths.get("mma", (None, None))
    by_target = mma_sweep(q, pk, pv, tail_k, tail_v, starts, scale, mma_targets, shape.reps) if prefix else None
    prefix_only = by_target.pop("prefix", None) if by_target else None
    mma_gqa = paths.get("mma_gqa", (None, None))
    tbps = None if gqa is None else round(kv_mb / 1e6 / (gqa / 1e3), 2)
    return Row(rows, prefix, own, round(kv_mb, 1), masked, kernel, gqa, ops, compiled, full[0], split[0], diff,
               full[1], split[1], gqa_diff, tbps, shared_gqa[0], shared_gqa[1], shared_mma[0], shared_mma[1],
               by_target, prefix_only, mma_gqa[0], mma_gqa[1], *paths.get("metal", (None, None)))


def mma_sweep(q, pk, pv, tail_k, tail_v, starts, scale, targets, reps) -> dict[str, float] | None:
    """The mma path's time per target number of blocks (how finely the prefix is split); under key 0
    the prefix kernel alone at its default target."""
    if not targets or not mx.cuda.is_available():
        return None
    from mlxq.kv.prefix_mma_kernel import Tiling, prefix_partials
    from mlxq.kv.tail_merge_kernel import tails_and_merge

    def run(spec):
        target, *warps = (int(x) for x in str(spec).split(":")[:2])
        stats = prefix_partials(q, pk, pv, scale, target, Tiling(warps=warps[0]) if warps else None)
        return tails_and_merge(q, tail_k, tail_v, starts, scale, None, stats, None)

    try:
        times = {str(t): timed(lambda: run(t), reps) for t in targets}  # noqa: B023
        return times | {"prefix": timed(lambda: prefix_partials(q, pk, pv, scale), reps)}
    except Exception as exc:
        print(f"mma sweep failed: {type(exc).__name__}: {str(exc)[:2000]}", flush=True)
        return None


def float32_check() -> float:
    """Max |shared - per-row copies| in float32 on this device over a few group shapes (sinks included)."""
    worst = 0.0
    for rows, heads, kv_heads, prefix, own in ((3, 8, 2, 100, 9), (16, 32, 8, 700, 40), (1, 4, 4, 5, 1)):
        q = mx.random.normal((rows, heads, 1, 64))
        pk, pv = (mx.random.normal((1, kv_heads, prefix, 64)) for _ in range(2))
        tk, tv = (mx.random.normal((rows, kv_heads, own, 64)) for _ in range(2))
        starts = mx.array([i % own for i in range(rows)])
        sinks = mx.random.normal((heads,))
        keys, values = copies(pk, tk, starts), copies(pv, tv, starts)
        mask = (mx.arange(prefix + own)[None, :] >= starts[:, None])[:, None, None, :]
        want = mx.fast.scaled_dot_product_attention(q, keys, values, scale=0.125, mask=mask, sinks=sinks)
        got = shared_prefix_attention(q, pk, pv, tk, tv, starts, 0.125, sinks)
        worst = max(worst, mx.abs(got - want).max().item())
    return worst


def quantized_check(rows: int = 8, prefix: int = 2048, tail: int = 40) -> dict[int, float]:
    """Max |quantized shared - mlx-lm's quantized attention over per-row copies| in bf16, per bits."""
    from mlx_lm.models import base

    from mlxq.kv.shared_prefix_attention import Quant

    q = mx.random.normal((rows, 32, 1, 128)).astype(mx.bfloat16)
    pk, pv = (mx.random.normal((1, 8, prefix, 128)).astype(mx.bfloat16) for _ in range(2))
    tk, tv = (mx.random.normal((rows, 8, tail, 128)).astype(mx.bfloat16) for _ in range(2))
    starts = mx.array([i % 7 for i in range(rows)])
    columns = mx.arange(prefix + tail)[None, :]
    mask = ((columns < prefix) | (columns >= (prefix + starts)[:, None]))[:, None, None, :]
    out = {}
    for bits in (4, 8):
        qpk, qpv, qtk, qtv = (tuple(mx.quantize(x, group_size=64, bits=bits)) for x in (pk, pv, tk, tv))
        got = shared_prefix_attention(q, qpk, qpv, qtk, qtv, starts, 0.088, quant=Quant(64, bits))
        keys, values = (tuple(mx.concatenate([mx.repeat(a, rows, 0), b], axis=2) for a, b in zip(p, t, strict=True))
                        for p, t in ((qpk, qtk), (qpv, qtv)))
        want = base.quantized_scaled_dot_product_attention(mx.array(q), keys, values, 0.088, mask, 64, bits)
        out[bits] = mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max().item()
    return out


def parse_case(text: str) -> tuple[int, int, int]:
    rows, rest = text.split("x")
    prefix, own = rest.split("+")
    return int(rows), int(prefix), int(own)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="cpu")
    parser.add_argument("--json", help="write the rows here as JSON")
    parser.add_argument("--cases", help="only these cases, e.g. 64x2048+300,64x0+2048 (rows x prefix + own)")
    parser.add_argument("--mma-targets", default="", help="also time the mma path at these blocks per launch "
                        "[:warps per block], e.g. 132,264,264:8 (CUDA)")
    parser.add_argument("--quantized-check", action="store_true",
                        help="only compare quantized shared attention with mlx-lm's over copies (bf16)")
    args = parser.parse_args()
    if args.quantized_check:
        print(f"quantized shared vs mlx-lm quantized copies, max diff by bits: {quantized_check()}")
        return
    shape = SHAPES[args.shape]
    mx.random.seed(0)
    check = float32_check()
    print(f"float32 max |shared - copies|: {check:.3g}", flush=True)
    kernel_check = None
    if mx.cuda.is_available():
        kernel_check = {"float32": shared_prefix_decode.self_check(mx.float32),
                        "bfloat16": shared_prefix_decode.self_check(mx.bfloat16)}
        print(f"shared-prefix kernels' self-checks (max |kernel - plain|): {kernel_check}", flush=True)
    if mx.cuda.is_available():
        from mlxq.kv import gqa_decode_kernel, prefix_mma_kernel

        for name, kernel_self_check in (("GQA decode kernel", gqa_decode_kernel.self_check),
                            ("mma prefix kernel", prefix_mma_kernel.self_check)):
            try:
                print(f"{name} self-check (max |kernel - MLX|): {kernel_self_check():.3g}", flush=True)
            except Exception as exc:
                print(f"{name} self-check failed: {type(exc).__name__}: {str(exc)[:3000]}", flush=True)
    if metal_decode_kernel.on_metal():
        try:
            kernel_check = {"metal": metal_decode_kernel.self_check()}
            print(f"Metal decode kernel's check (max |kernel - plain| by dtype): {kernel_check}", flush=True)
        except Exception as exc:
            print(f"Metal decode kernel's check failed: {type(exc).__name__}: {str(exc)[:3000]}", flush=True)
    cases = shape.cases if not args.cases else [parse_case(c) for c in args.cases.split(",")]
    out = []
    for rows, prefix, own in cases:
        row = measure(shape, rows, prefix, own, tuple(t for t in args.mma_targets.split(",") if t))
        out.append(row)
        print(json.dumps(asdict(row)), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(mx.default_device()), "mlx": mx.__version__, "shape": asdict(shape),
                       "float32_check": check, "kernel_check": kernel_check,
                       "rows": [asdict(r) for r in out]}, f, indent=1)


if __name__ == "__main__":
    main()
