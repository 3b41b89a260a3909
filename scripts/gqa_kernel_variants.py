"""The GQA decode kernel's load width side by side with the per-head kernel and the split path (CUDA).

    python scripts/gqa_kernel_variants.py --cases 64x0+2048,64x2048+300 [--json OUT]

For each case (rows x shared prefix + own tokens per row; 8B layer: 32 query
heads, 8 KV heads, head_dim 128, bf16) one decode step of one attention
layer, ms (mean of ``--reps`` calls after a warm-up):

- ``per_head``: kv/decode_kernel.py over per-row copies [prefix ; own];
- ``gqa{n}``: kv/gqa_decode_kernel.py over the copies, ``n`` 16-byte loads
  per thread and key (``LOADS``);
- ``split``: the shared path kv/tail_merge_kernel.py (prefix GEMMs + one kernel);
- ``shared_gqa{n}``: the shared path of kv/gqa_decode_kernel.py.

Each kernel's max |difference| to MLX masked attention over the copies goes
with it; the self-checks (float32 and bf16, four head layouts) come first.
"""

from __future__ import annotations

import argparse
import json

import mlx.core as mx

from mlxq.kv import gqa_decode_kernel as gqa
from mlxq.kv import shared_prefix_decode
from scripts.shared_prefix_micro import copies, parse_case, timed

LAYOUTS = ((32, 8, 128), (8, 8, 64), (16, 2, 256), (28, 4, 128))
DEFAULT_LOADS = gqa.LOADS


def checks() -> dict:
    out = {}
    for loads in (1, 2):
        gqa.LOADS = loads
        out[loads] = {f"{h}/{k}x{d}": (gqa.self_check(mx.bfloat16, h, k, d),
                                       gqa.self_check(mx.float32, h, k, d) if gqa.block_threads(
                                           mx.float32, d, h // k) else None) for h, k, d in LAYOUTS}
        out[loads]["shared"] = shared_prefix_decode.self_check(mx.float32)["gqa"]
    gqa.LOADS = DEFAULT_LOADS
    return out


def measure(rows: int, prefix: int, own: int, reps: int) -> dict:
    dtype, scale = mx.bfloat16, 128**-0.5
    q = mx.random.normal((rows, 32, 1, 128)).astype(dtype)
    tk, tv = (mx.random.normal((rows, 8, own, 128)).astype(dtype) for _ in range(2))
    starts = mx.array([(i * 37) % (own // 2 + 1) for i in range(rows)])
    pk, pv = (mx.random.normal((1, 8, max(prefix, 1), 128)).astype(dtype) for _ in range(2))
    keys, values = ((copies(p, t, starts) for p, t in ((pk, tk), (pv, tv))) if prefix else (tk, tv))
    mask = (mx.arange(prefix + own)[None, :] >= starts[:, None])[:, None, None, :]
    mx.eval(q, tk, tv, pk, pv, keys, values, mask)
    want = mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask).astype(mx.float32)
    out = {"rows": rows, "prefix": prefix, "own": own, "kv_mb": round((keys.nbytes + values.nbytes) / 1e6, 1)}

    def record(name, fn):
        try:
            out[name] = round(timed(fn, reps), 4)
            out[name + "_diff"] = mx.abs(fn().astype(mx.float32) - want).max().item()
        except Exception as exc:  # a variant that does not build must not cost the others
            out[name] = f"{type(exc).__name__}: {str(exc)[:1500]}"

    from mlxq.kv.decode_kernel import masked_decode_attention
    from mlxq.kv.tail_merge_kernel import split_shared_prefix_decode

    record("per_head", lambda: masked_decode_attention(q, keys, values, starts, scale))
    for loads in (1, 2):
        gqa.LOADS = loads
        record(f"gqa{loads}", lambda: gqa.gqa_decode_attention(q, keys, values, starts, scale))
        if prefix:
            record(f"shared_gqa{loads}", lambda: gqa.gqa_shared_prefix_decode(q, pk, pv, tk, tv, starts, scale))
    gqa.LOADS = DEFAULT_LOADS
    if prefix:
        record("split", lambda: split_shared_prefix_decode(q, pk, pv, tk, tv, starts, scale))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="64x0+2048,64x2048+300,64x2048+50,8x2048+300,16x12288+300")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--json", help="write the results here as JSON")
    args = parser.parse_args()
    if not mx.cuda.is_available():
        print("needs MLX's CUDA backend")
        return
    mx.random.seed(0)
    try:
        result = {"checks": checks(), "rows": []}
    except Exception as exc:  # still time the variants: each records its own failure
        result = {"checks": f"{type(exc).__name__}: {str(exc)[:3000]}", "rows": []}
    print(json.dumps(result["checks"]), flush=True)
    for case in args.cases.split(","):
        row = measure(*parse_case(case), args.reps)
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
