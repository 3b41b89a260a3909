"""Batched one-token attention without a mask array: a CUDA kernel.

A batch of rows with different histories is left-padded (mlx-lm's
BatchKVCache), so every decode step hands attention a [B, 1, 1, L] mask.
MLX 0.32's CUDA backend has a fused one-query kernel (``sdpa_vector``) only
for calls *without* an array mask; with one it falls back to unfused
matmul + softmax + matmul: on the H200, 0.30 ms vs this kernel's 0.10 ms for
64 rows of 300 tokens (docs/benchmarks.md, "H200: attention routing on CUDA").

The mask only says "row b starts at column left_padding[b]". This kernel
takes that start per row instead: one block per (row, query head), 32 warps
striding over the row's real keys with an online softmax, lanes holding
head_dim/32 values each, then one combine across warps (the shape of MLX's
own fused kernel). Keys and values are read where they lie (strided views of
the cache's buffer; no copy). kv/cuda_attention.py decides where it runs.
"""

from __future__ import annotations

import mlx.core as mx

from mlxq.kv.kernel_inputs import row_starts, scale_array

HEAD_DIMS = (64, 128, 256)
_WARPS = 32

# Kernel pieces shared with the shared-prefix kernels (kv/shared_prefix_kernel.py,
# kv/tail_merge_kernel.py): each lane loads its slice of the scaled query and starts an
# empty online softmax; after its keys each warp spills (max, total, output) to shared memory.
LOAD_QUERY = """
    const float s = scale[0];
    float qr[E];
    float o[E];
    for (int i = 0; i < E; i++) {
        qr[i] = static_cast<float>(q[i]) * s;
        o[i] = 0.0f;
    }
    float m = NEG_INF;
    float total = 0.0f;
"""
SPILL_WARPS = """
    __shared__ float warp_max[W];
    __shared__ float warp_total[W];
    __shared__ float warp_out[W][D];
    if (lane == 0) {
        warp_max[warp] = m;
        warp_total[warp] = total;
    }
    for (int i = 0; i < E; i++) {
        warp_out[warp][lane * E + i] = o[i];
    }
    __syncthreads();
"""


def splice(source: str) -> str:
    """``source`` with the LOAD_QUERY and SPILL_WARPS placeholders filled in."""
    return source.replace("LOAD_QUERY\n", LOAD_QUERY[1:]).replace("SPILL_WARPS\n", SPILL_WARPS[1:])


_HEADER = """
#define NEG_INF __int_as_float(0xff800000)
"""

_SOURCE = splice("""
    constexpr int E = D / 32;  // head dimensions per lane
    const int b = blockIdx.y;
    const int h = blockIdx.x;
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int heads = queries_shape[1];
    const int length = keys_shape[2];
    const int g = h / (heads / keys_shape[1]);
    const T* q = queries + ((int64_t)b * heads + h) * D + lane * E;
    const T* kb = keys + b * keys_strides[0] + g * keys_strides[1] + lane * E;
    const T* vb = values + b * values_strides[0] + g * values_strides[1] + lane * E;
LOAD_QUERY
    for (int j = starts[b] + warp; j < length; j += W) {
        const T* kj = kb + j * keys_strides[2];
        float score = 0.0f;
        for (int i = 0; i < E; i++) {
            score += qr[i] * static_cast<float>(kj[i]);
        }
        for (int off = 16; off > 0; off /= 2) {
            score += __shfl_xor_sync(0xffffffff, score, off);
        }
        const float m_new = fmaxf(m, score);
        const float f = expf(m - m_new);
        const float e = expf(score - m_new);
        total = total * f + e;
        const T* vj = vb + j * values_strides[2];
        for (int i = 0; i < E; i++) {
            o[i] = o[i] * f + e * static_cast<float>(vj[i]);
        }
        m = m_new;
    }
SPILL_WARPS
    const int t = threadIdx.x;
    if (t < D) {
        float mx_all = NEG_INF;
        for (int w = 0; w < W; w++) {
            mx_all = fmaxf(mx_all, warp_max[w]);
        }
        float denom = 0.0f;
        float acc = 0.0f;
        for (int w = 0; w < W; w++) {
            const float f = warp_max[w] == NEG_INF ? 0.0f : expf(warp_max[w] - mx_all);
            denom += warp_total[w] * f;
            acc += warp_out[w][t] * f;
        }
        out[((int64_t)b * heads + h) * D + t] = static_cast<T>(acc / denom);
    }
""")

_kernel = None


def masked_decode_attention(queries: mx.array, keys: mx.array, values: mx.array, starts: mx.array,
                            scale: float) -> mx.array:
    """softmax(q k^T * scale) v for one query per row, over keys[b, :, starts[b]:, :]."""
    global _kernel
    if _kernel is None:
        _kernel = mx.fast.cuda_kernel(
            name="mlxq_masked_decode_attention",
            input_names=["queries", "keys", "values", "starts", "scale"],
            output_names=["out"],
            source=_SOURCE,
            header=_HEADER,
            ensure_row_contiguous=False,
        )
    batch, heads, _, dim = queries.shape
    return _kernel(
        inputs=[mx.contiguous(queries), keys, values, row_starts(starts), scale_array(scale)],
        template=[("T", queries.dtype), ("D", dim), ("W", _WARPS)],
        grid=(heads * _WARPS * 32, batch, 1),
        threadgroup=(_WARPS * 32, 1, 1),
        output_shapes=[queries.shape],
        output_dtypes=[queries.dtype],
    )[0]


def self_check(dtype=mx.bfloat16) -> float:
    """Max |kernel - MLX masked attention| on random rows with random left padding."""
    return max_error_vs_mlx(masked_decode_attention, dtype, heads=8, kv_heads=2, dim=128)


def max_error_vs_mlx(attention, dtype, heads: int, kv_heads: int, dim: int) -> float:
    """Max |attention(q, k, v, starts, scale) - MLX masked attention| on six rows with random left padding."""
    batch, length = 6, 300
    q = mx.random.normal((batch, heads, 1, dim)).astype(dtype)
    buffer = mx.random.normal((2, batch, kv_heads, length + 44, dim)).astype(dtype)
    keys, values = buffer[0, :, :, :length], buffer[1, :, :, :length]  # strided, like the cache's views
    starts = mx.array([0, 1, 37, 150, 299, 5])
    mask = (mx.arange(length)[None, :] >= starts[:, None])[:, None, None, :]
    scale = dim**-0.5
    want = mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask)
    got = attention(q, keys, values, starts, scale)
    return mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max().item()
