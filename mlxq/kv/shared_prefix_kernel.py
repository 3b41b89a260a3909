"""One-query shared-prefix attention as one CUDA kernel (the decode step of a group).

The plain-operations path (kv/shared_prefix_attention.py) stacks the rows'
queries into one GEMM per KV head, then merges partials: ~55 operations per
layer, whose launches bound it at small groups. This kernel is kv/decode_kernel.py's
shape with two key segments: one block per (row, query head), 32 warps
striding first over the shared prefix (the same device pointer for every
row: no per-row copy exists; skipped for a row outside the group) and then over the row's own tail from its
start, one online softmax across both, so the log-sum-exp merge happens in
registers and in the epilogue's combine across warps; a sink logit per head
(gpt_oss) joins that combine as one more level with no values.

Blocks are laid out rows-fastest (blockIdx.x = row), so the blocks resident
together are every row of the same heads and read the same prefix slice:
the prefix comes from device memory about once and from L2 for the other
rows (a 2k-token prefix of one KV head is 1 MB in bf16). But each block
still does the prefix's multiply-adds key by key: measured on the H200 it
costs what per-row copies cost at 64 rows, and wins only for small groups,
where launches dominate. kv/shared_prefix_decode.py picks the path.
"""

from __future__ import annotations

import mlx.core as mx

from mlxq.kv.decode_kernel import splice
from mlxq.kv.kernel_inputs import row_shares, row_starts, scale_array, sinks_array

HEAD_DIMS = (64, 128, 256)
_WARPS = 32

HEADER = """
#define NEG_INF __int_as_float(0xff800000)
"""

# Accumulates key j of a segment into this warp's running (m, total, o).
KEY_STEP = """
        {
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
            for (int i = 0; i < E; i++) {
                o[i] = o[i] * f + e * static_cast<float>(vj[i]);
            }
            m = m_new;
        }
"""

_SOURCE = splice("""
    constexpr int E = D / 32;
    const int b = blockIdx.x;
    const int h = blockIdx.y;
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int heads = queries_shape[1];
    const int g = h / (heads / prefix_keys_shape[1]);
    const int prefix_len = shares[b] ? prefix_keys_shape[2] : 0;
    const int tail_len = tail_keys_shape[2];
    const T* q = queries + ((int64_t)b * heads + h) * D + lane * E;
    const T* pk = prefix_keys + g * prefix_keys_strides[1] + lane * E;
    const T* pv = prefix_values + g * prefix_values_strides[1] + lane * E;
    const T* tk = tail_keys + b * tail_keys_strides[0] + g * tail_keys_strides[1] + lane * E;
    const T* tv = tail_values + b * tail_values_strides[0] + g * tail_values_strides[1] + lane * E;
LOAD_QUERY
    for (int j = warp; j < prefix_len; j += W) {
        const T* kj = pk + j * prefix_keys_strides[2];
        const T* vj = pv + j * prefix_values_strides[2];
        STEP
    }
    for (int j = starts[b] + warp; j < tail_len; j += W) {
        const T* kj = tk + j * tail_keys_strides[2];
        const T* vj = tv + j * tail_values_strides[2];
        STEP
    }
SPILL_WARPS
    const int t = threadIdx.x;
    if (t < D) {
        const float sink = HAS_SINKS ? static_cast<float>(sinks[h]) : NEG_INF;
        float mx_all = sink;
        for (int w = 0; w < W; w++) {
            mx_all = fmaxf(mx_all, warp_max[w]);
        }
        float denom = HAS_SINKS ? expf(sink - mx_all) : 0.0f;
        float acc = 0.0f;
        for (int w = 0; w < W; w++) {
            const float f = warp_max[w] == NEG_INF ? 0.0f : expf(warp_max[w] - mx_all);
            denom += warp_total[w] * f;
            acc += warp_out[w][t] * f;
        }
        out[((int64_t)b * heads + h) * D + t] = static_cast<T>(acc / denom);
    }
""".replace("STEP", KEY_STEP))

_kernel = None


def can_run(queries: mx.array, prefix_keys: mx.array, tail_keys: mx.array, tail_values: mx.array) -> bool:
    """One query per row, a head width the kernel has, keys and values alike, GQA-divisible heads."""
    dim = queries.shape[-1]
    return (queries.shape[2] == 1 and dim in HEAD_DIMS and prefix_keys.shape[-1] == tail_values.shape[-1] == dim
            and queries.shape[1] % prefix_keys.shape[1] == 0 and prefix_keys.dtype == queries.dtype
            and tail_keys.dtype == queries.dtype)


def shared_prefix_decode(queries, prefix_keys, prefix_values, tail_keys, tail_values, tail_starts, scale: float,
                         sinks: mx.array | None = None, shares: mx.array | None = None) -> mx.array:
    """kv/shared_prefix_attention.shared_prefix_attention for one query per row, as one kernel."""
    global _kernel
    if _kernel is None:
        _kernel = mx.fast.cuda_kernel(
            name="mlxq_shared_prefix_decode",
            input_names=["queries", "prefix_keys", "prefix_values", "tail_keys", "tail_values", "starts",
                         "scale", "sinks", "shares"],
            output_names=["out"], source=_SOURCE, header=HEADER, ensure_row_contiguous=False)
    batch, heads, _, dim = queries.shape
    return _kernel(
        inputs=[mx.contiguous(queries), prefix_keys, prefix_values, tail_keys, tail_values,
                row_starts(tail_starts), scale_array(scale), sinks_array(sinks), row_shares(shares, batch)],
        template=[("T", queries.dtype), ("D", dim), ("W", _WARPS), ("HAS_SINKS", sinks is not None)],
        grid=(batch * _WARPS * 32, heads, 1),
        threadgroup=(_WARPS * 32, 1, 1),
        output_shapes=[queries.shape],
        output_dtypes=[queries.dtype],
    )[0]

