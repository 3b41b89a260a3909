"""Shared-prefix decode split in two: the prefix as GEMMs, the tails and the merge in one CUDA kernel.

kv/shared_prefix_kernel.py walks the prefix once per (row, head) block: the
prefix comes from L2 rather than device memory for most rows, but every
block still does the prefix's multiply-adds one key at a time, so at 64 rows
it costs what per-row copies cost (docs/benchmarks.md, "H200: shared-prefix
attention per layer"). Here the prefix part stays the plain path's stacked
GEMM per KV head (cuBLAS: each prefix key is read once and used for every
row's queries) and its partial (weighted values, peak, total; float32, in
the stacked layout, so no reshuffle) goes into this kernel, which walks
each row's own tail like kv/decode_kernel.py and merges the prefix level,
its warps' levels and the sink in its epilogue. About a dozen launches per
layer instead of ~55 for the plain path.
"""

from __future__ import annotations

import mlx.core as mx

from mlxq.kv import prefix_mma_kernel
from mlxq.kv.decode_kernel import splice
from mlxq.kv.kernel_inputs import row_shares, row_starts, scale_array, sinks_array
from mlxq.kv.shared_prefix_attention import RowGroups, grouped_prefix_stats, stacked_prefix_stats
from mlxq.kv.shared_prefix_kernel import HEADER, KEY_STEP

_WARPS = 32

_SOURCE = splice("""
    constexpr int E = D / 32;
    const int b = blockIdx.x;
    const int h = blockIdx.y;
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int heads = queries_shape[1];
    const int group = heads / tail_keys_shape[1];
    const int g = h / group;
    const int tail_len = tail_keys_shape[2];
    const int splits = prefix_peak_shape[1];
    const int stacked = prefix_peak_shape[2];
    const int64_t level = (int64_t)g * splits * stacked + (int64_t)b * group + h % group;  // split 0
    const T* q = queries + ((int64_t)b * heads + h) * D + lane * E;
    const T* tk = tail_keys + b * tail_keys_strides[0] + g * tail_keys_strides[1] + lane * E;
    const T* tv = tail_values + b * tail_values_strides[0] + g * tail_values_strides[1] + lane * E;
LOAD_QUERY
    for (int j = starts[b] + warp; j < tail_len; j += W) {
        const T* kj = tk + j * tail_keys_strides[2];
        const T* vj = tv + j * tail_values_strides[2];
        STEP
    }
SPILL_WARPS
    const int t = threadIdx.x;
    if (t < D) {
        const float sink = HAS_SINKS ? static_cast<float>(sinks[h]) : NEG_INF;
        const int seen = shares[b] ? splits : 0;  // outside the group: no prefix
        float mx_all = sink;
        for (int p = 0; p < seen; p++) {
            mx_all = fmaxf(mx_all, prefix_peak[level + p * stacked]);
        }
        for (int w = 0; w < W; w++) {
            mx_all = fmaxf(mx_all, warp_max[w]);
        }
        float denom = HAS_SINKS ? expf(sink - mx_all) : 0.0f;
        float acc = 0.0f;
        for (int p = 0; p < seen; p++) {
            const int64_t at = level + p * stacked;
            const float pf = expf(prefix_peak[at] - mx_all);
            denom += prefix_total[at] * pf;
            acc += prefix_weighted[at * D + t] * pf;
        }
        for (int w = 0; w < W; w++) {
            const float f = warp_max[w] == NEG_INF ? 0.0f : expf(warp_max[w] - mx_all);
            denom += warp_total[w] * f;
            acc += warp_out[w][t] * f;
        }
        out[((int64_t)b * heads + h) * D + t] = static_cast<T>(acc / denom);
    }
""".replace("STEP", KEY_STEP))

# Compiled once per (rows, prefix length, scale): a group's shapes stay put while its tails grow.
_prefix_stats = mx.compile(stacked_prefix_stats)
_kernel = None


def split_shared_prefix_decode(queries, prefix_keys, prefix_values, tail_keys, tail_values, tail_starts,
                               scale: float, sinks: mx.array | None = None,
                               shares: mx.array | None = None) -> mx.array:
    """kv/shared_prefix_attention.shared_prefix_attention for one query per row: prefix GEMMs + one kernel."""
    stats = _prefix_stats(queries, prefix_keys, prefix_values, scale)
    return tails_and_merge(queries, tail_keys, tail_values, tail_starts, scale, sinks, stats, shares)


def split_grouped_decode(queries, prefixes, tail_keys, tail_values, tail_starts, scale: float,
                         sinks: mx.array | None, layout: RowGroups) -> mx.array:
    """The same for a batch of several groups: each group's rows against its own prefix (its GEMMs
    on those rows only), the partials in row order, then the one kernel."""
    stats = grouped_prefix_stats(queries, prefixes, layout, scale)
    return tails_and_merge(queries, tail_keys, tail_values, tail_starts, scale, sinks, stats, layout.in_group)


def mma_shared_prefix_decode(queries, prefix_keys, prefix_values, tail_keys, tail_values, tail_starts,
                             scale: float, sinks: mx.array | None = None,
                             shares: mx.array | None = None) -> mx.array:
    """The same with the prefix on tensor cores (kv/prefix_mma_kernel.py): one level per split."""
    stats = prefix_mma_kernel.prefix_partials(queries, prefix_keys, prefix_values, scale)
    return tails_and_merge(queries, tail_keys, tail_values, tail_starts, scale, sinks, stats, shares)


def tails_and_merge(queries, tail_keys, tail_values, tail_starts, scale: float, sinks: mx.array | None,
                    stats: tuple[mx.array, mx.array, mx.array], shares: mx.array | None) -> mx.array:
    """Each row's tail walked by the kernel, merged with its prefix levels: ``stats`` in the stacked
    layout, [Hkv, rows x group, n] (one level) or [Hkv, splits, rows x group, n] (one per split)."""
    global _kernel
    if _kernel is None:
        _kernel = mx.fast.cuda_kernel(
            name="mlxq_tail_merge_splits",
            input_names=["queries", "tail_keys", "tail_values", "starts", "scale", "sinks",
                         "prefix_weighted", "prefix_peak", "prefix_total", "shares"],
            output_names=["out"], source=_SOURCE, header=HEADER, ensure_row_contiguous=False)
    weighted, peak, total = (x if x.ndim == 4 else x[:, None] for x in stats)
    batch, heads, _, dim = queries.shape
    return _kernel(
        inputs=[mx.contiguous(queries), tail_keys, tail_values, row_starts(tail_starts), scale_array(scale),
                sinks_array(sinks),
                mx.contiguous(weighted), mx.contiguous(peak), mx.contiguous(total),
                row_shares(shares, batch)],
        template=[("T", queries.dtype), ("D", dim), ("W", _WARPS), ("HAS_SINKS", sinks is not None)],
        grid=(batch * _WARPS * 32, heads, 1),
        threadgroup=(_WARPS * 32, 1, 1),
        output_shapes=[queries.shape],
        output_dtypes=[queries.dtype],
    )[0]
