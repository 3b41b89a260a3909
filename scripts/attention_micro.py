"""Attention micro-measurements behind kv/cuda_attention.py (run on the CUDA machine).

    python scripts/attention_micro.py

1. The decode kernel's self-check against MLX (bf16, float32), then one-query
   attention for 64 rows x 32 heads (8 KV heads, head_dim 128) over 300 /
   1,024 / 4,096 keys with a left-padding mask: MLX masked, MLX unmasked (the
   fused kernel, a lower bound), mlxq's kernel; 20 calls per timing.
2. Prefill attention, each shape timed on its first call and again: MLX's
   (cuDNN, which builds a graph per new shape) vs mlxq's plain operations.
"""

from __future__ import annotations

import time

import mlx.core as mx

from mlxq.kv import cuda_attention
from mlxq.kv.decode_kernel import masked_decode_attention, self_check


def timed(fn, reps: int = 20) -> float:
    mx.eval(fn())
    start = time.perf_counter()
    mx.eval([fn() for _ in range(reps)])
    return 1000 * (time.perf_counter() - start) / reps


def once(fn) -> float:
    start = time.perf_counter()
    mx.eval(fn())
    return 1000 * (time.perf_counter() - start)


def decode() -> None:
    print(f"decode kernel self-check max diff: bf16 {self_check():.3g}, fp32 {self_check(mx.float32):.3g}")
    rows, heads, kv_heads, dim = 64, 32, 8, 128
    for length in (300, 1024, 4096):
        q = mx.random.normal((rows, heads, 1, dim)).astype(mx.bfloat16)
        buffer = mx.random.normal((2, rows, kv_heads, length + 212, dim)).astype(mx.bfloat16)
        k, v = buffer[0, :, :, :length], buffer[1, :, :, :length]  # views into a larger buffer, as in the cache
        starts = mx.array([(i * 37) % 200 for i in range(rows)])
        mask = (mx.arange(length)[None, :] >= starts[:, None])[:, None, None, :]
        mx.eval(q, buffer, mask)
        scale = dim**-0.5
        masked = timed(lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask))  # noqa: B023
        fused = timed(lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale))  # noqa: B023
        kernel = timed(lambda: masked_decode_attention(q, k, v, starts, scale))  # noqa: B023
        print(f"decode {rows} rows x {length} keys: MLX masked {masked:.3f} ms, MLX unmasked {fused:.3f} ms, "
              f"mlxq kernel {kernel:.3f} ms")


def prefill() -> None:
    for length, span in ((150, 150), (64, 700), (1000, 1000)):
        q = mx.random.normal((1, 32, length, 128)).astype(mx.bfloat16)
        k = mx.random.normal((1, 8, span, 128)).astype(mx.bfloat16)
        v = mx.random.normal((1, 8, span, 128)).astype(mx.bfloat16)
        mx.eval(q, k, v)

        def mlx():
            return mx.fast.scaled_dot_product_attention(q, k, v, scale=0.088, mask="causal")  # noqa: B023

        def ops():
            return cuda_attention.ops_attention(q, k, v, 0.088, "causal")  # noqa: B023

        first_mlx, first_ops = once(mlx), once(ops)
        diff = mx.abs(mlx().astype(mx.float32) - ops().astype(mx.float32)).max().item()
        print(f"prefill {length} queries x {span} keys: MLX first {first_mlx:.1f} ms / again {once(mlx):.2f} ms, "
              f"ops first {first_ops:.1f} ms / again {once(ops):.2f} ms, max diff {diff:.3g}")


if __name__ == "__main__":
    decode()
    prefill()
