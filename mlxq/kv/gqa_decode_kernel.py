"""Batched one-token attention per KV head: every query head of a GQA group in one CUDA block.

kv/decode_kernel.py runs one block per (row, query head): with 32 query
heads on 8 KV heads every key and value is fetched by four blocks, each
lane loads 8 bytes at a time and a warp walks one key per step (five
shuffles a key): 1.17 TB/s on the H200 for 64 rows of 2k own tokens
(docs/benchmarks.md, "H200: shared-prefix attention per layer").

Here one block per (KV head, row) reads each key and value once for all G
query heads of its group: a key's D values are split over D/VEC threads
(VEC values = ``LOADS`` 16-byte loads each), so a warp holds 32*VEC/D
keys at a time and a block ``SLOTS`` keys, two of them per thread in
flight; each thread keeps its VEC dimensions of the G queries and outputs
in registers with one online softmax per head. The two keys' scores are
reduced together (independent shuffles) and enter the softmax in one step
(one rescale of the outputs for both). The slots' partials (peak, total,
weighted values) are merged in shared memory at the end. Every thread of
a block runs the same number of iterations (a slot past the row's end
computes and drops its lanes' values), so the shuffles always see the
whole warp. Same inputs and result as ``masked_decode_attention``:
softmax(q k^T * scale) v over keys[b, :, starts[b]:, :].
"""

from __future__ import annotations

import mlx.core as mx

from mlxq.kv.decode_kernel import max_error_vs_mlx
from mlxq.kv.kernel_inputs import constant, prefix_inputs, row_shares, row_starts, scale_array, sinks_array

LOADS = 2  # 16-byte loads per thread and key (its share of the head dimension): 2 measured faster than 1
_SHARED_BYTES = 40 * 1024  # the slots' partials, under the 48 KiB a block may take without opting in
_MAX_GROUP = 16

_HEADER = """
#define NEG_INF __int_as_float(0xff800000)

// Walk keys [first, end) of one (row, KV head): 16-byte loads, two keys a thread in flight, one
// online softmax per query head of the group. Every thread of a block runs the same iterations.
template <typename T, int D, int G, int NT, int LOADS>
__device__ void walk_keys(const T* kb, const T* vb, int64_t ks, int64_t vs, int first, int end, int slot,
                          float (&qr)[G][LOADS * 16 / sizeof(T)], float (&o)[G][LOADS * 16 / sizeof(T)],
                          float (&m)[G], float (&l)[G]) {
    constexpr int VEC = LOADS * 16 / sizeof(T);
    constexpr int TX = D / VEC;
    constexpr int SLOTS = NT / TX;
    for (int base = first; base < end; base += 2 * SLOTS) {
        int js[2] = {base + slot, base + SLOTS + slot};
        uint4 kraw[2][LOADS];
        uint4 vraw[2][LOADS];
        for (int u = 0; u < 2; u++) {
            const int j = js[u] < end ? js[u] : end - 1;  // past the end: a valid key, dropped below
            for (int r = 0; r < LOADS; r++) {
                kraw[u][r] = reinterpret_cast<const uint4*>(kb + j * ks)[r];
                vraw[u][r] = reinterpret_cast<const uint4*>(vb + j * vs)[r];
            }
        }
        float score[2][G];  // both keys' scores before any shuffle: independent chains to overlap
        for (int u = 0; u < 2; u++) {
            const T* kv = reinterpret_cast<const T*>(&kraw[u][0]);
            for (int h = 0; h < G; h++) {
                float acc = 0.0f;
                for (int i = 0; i < VEC; i++) {
                    acc += qr[h][i] * static_cast<float>(kv[i]);
                }
                score[u][h] = acc;
            }
        }
        for (int off = TX / 2; off > 0; off /= 2) {
            for (int u = 0; u < 2; u++) {
                for (int h = 0; h < G; h++) {
                    score[u][h] += __shfl_xor_sync(0xffffffff, score[u][h], off);
                }
            }
        }
        const T* v0 = reinterpret_cast<const T*>(&vraw[0][0]);
        const T* v1 = reinterpret_cast<const T*>(&vraw[1][0]);
        for (int h = 0; h < G; h++) {  // both keys in one online-softmax step: one rescale
            const float s0 = js[0] < end ? score[0][h] : NEG_INF;
            const float s1 = js[1] < end ? score[1][h] : NEG_INF;
            const float m_new = fmaxf(m[h], fmaxf(s0, s1));
            if (m_new == NEG_INF) {
                continue;  // this slot has seen no key yet
            }
            const float f = expf(m[h] - m_new);
            const float e0 = expf(s0 - m_new);
            const float e1 = expf(s1 - m_new);
            l[h] = l[h] * f + e0 + e1;
            for (int i = 0; i < VEC; i++) {
                o[h][i] = o[h][i] * f + e0 * static_cast<float>(v0[i]) + e1 * static_cast<float>(v1[i]);
            }
            m[h] = m_new;
        }
    }
}
"""

# One block per (KV head, row): the G queries' registers, the row's keys (a shared prefix first,
# where the row sees one), the slots' partials merged in shared memory (with a sink per head).
_SOURCE = """
    constexpr int VEC = LOADS * 16 / sizeof(T);
    constexpr int TX = D / VEC;
    constexpr int SLOTS = NT / TX;
    const int kvh = blockIdx.x;
    const int b = blockIdx.y;
    const int t = threadIdx.x;
    const int slot = t / TX;
    const int part = t % TX;
    const int heads = queries_shape[1];
    const float s = scale[0];
    float qr[G][VEC];
    float o[G][VEC];
    float m[G];
    float l[G];
    for (int h = 0; h < G; h++) {
        const T* q = queries + ((int64_t)b * heads + kvh * G + h) * D + part * VEC;
        for (int i = 0; i < VEC; i++) {
            qr[h][i] = static_cast<float>(q[i]) * s;
            o[h][i] = 0.0f;
        }
        m[h] = NEG_INF;
        l[h] = 0.0f;
    }
    if (HAS_PREFIX && shares[b]) {
        walk_keys<T, D, G, NT, LOADS>(prefix_keys + kvh * prefix_keys_strides[1] + part * VEC,
                               prefix_values + kvh * prefix_values_strides[1] + part * VEC,
                               prefix_keys_strides[2], prefix_values_strides[2], 0, prefix_keys_shape[2], slot,
                               qr, o, m, l);
    }
    walk_keys<T, D, G, NT, LOADS>(keys + b * keys_strides[0] + kvh * keys_strides[1] + part * VEC,
                           values + b * values_strides[0] + kvh * values_strides[1] + part * VEC,
                           keys_strides[2], values_strides[2], starts[b], keys_shape[2], slot, qr, o, m, l);
    __shared__ float slot_max[SLOTS][G];
    __shared__ float slot_total[SLOTS][G];
    __shared__ float slot_out[SLOTS][G][D];
    if (part == 0) {
        for (int h = 0; h < G; h++) {
            slot_max[slot][h] = m[h];
            slot_total[slot][h] = l[h];
        }
    }
    for (int h = 0; h < G; h++) {
        for (int i = 0; i < VEC; i++) {
            slot_out[slot][h][part * VEC + i] = o[h][i];
        }
    }
    __syncthreads();
    // Precomputed prefix levels (kv/prefix_mma_kernel.py: [Hkv, splits, rows x G, n], stacked rows).
    const int splits = HAS_LEVELS && shares[b] ? level_peak_shape[1] : 0;
    const int64_t stacked = level_peak_shape[2];
    for (int idx = t; idx < G * D; idx += NT) {
        const int h = idx / D;
        const int d = idx % D;
        const int64_t level = (int64_t)kvh * level_peak_shape[1] * stacked + (int64_t)b * G + h;
        const float sink = HAS_SINKS ? sinks[kvh * G + h] : NEG_INF;
        float peak = sink;
        for (int k = 0; k < SLOTS; k++) {
            peak = fmaxf(peak, slot_max[k][h]);
        }
        for (int p = 0; p < splits; p++) {
            peak = fmaxf(peak, level_peak[level + p * stacked]);
        }
        float denom = HAS_SINKS ? expf(sink - peak) : 0.0f;
        float acc = 0.0f;
        for (int k = 0; k < SLOTS; k++) {
            const float f = slot_max[k][h] == NEG_INF ? 0.0f : expf(slot_max[k][h] - peak);
            denom += slot_total[k][h] * f;
            acc += slot_out[k][h][d] * f;
        }
        for (int p = 0; p < splits; p++) {
            const int64_t at = level + p * stacked;
            const float f = expf(level_peak[at] - peak);
            denom += level_total[at] * f;
            acc += level_weighted[at * D + d] * f;
        }
        out[((int64_t)b * heads + kvh * G + h) * D + d] = static_cast<T>(acc / denom);
    }
"""

_kernel = None


def block_threads(dtype: mx.Dtype, dim: int, group: int, loads: int | None = None) -> int | None:
    """Threads per block for this shape (None: the kernel does not take it)."""
    vec = (loads or LOADS) * 16 // dtype.size
    per_key = dim // vec
    if dim % vec or per_key > 32 or 32 % per_key or not 1 <= group <= _MAX_GROUP:
        return None
    slots = min(256 // per_key, max(1, _SHARED_BYTES // (group * (dim + 2) * 4)))
    slots -= slots % max(1, 32 // per_key)  # whole warps
    return slots * per_key if slots else None


def can_run(queries: mx.array, keys: mx.array, values: mx.array) -> bool:
    heads, dim = queries.shape[1], queries.shape[-1]
    kv_heads = keys.shape[1]
    return (queries.shape[2] == 1 and heads % kv_heads == 0 and keys.shape[-1] == values.shape[-1] == dim
            and keys.dtype == values.dtype == queries.dtype and queries.dtype in (mx.bfloat16, mx.float16, mx.float32)
            and block_threads(queries.dtype, dim, heads // kv_heads) is not None)


def gqa_decode_attention(queries: mx.array, keys: mx.array, values: mx.array, starts: mx.array,
                         scale: float) -> mx.array:
    """softmax(q k^T * scale) v for one query per row over keys[b, :, starts[b]:, :] (``can_run`` shapes).

    Keys and values are read where they lie (strided cache views), their last axis contiguous
    and 16-byte aligned, as mlx-lm's caches hold them."""
    return _launch(queries, keys, values, starts, scale)


def gqa_shared_prefix_decode(queries, prefix_keys, prefix_values, tail_keys, tail_values, tail_starts, scale: float,
                             sinks: mx.array | None = None, shares: mx.array | None = None) -> mx.array:
    """kv/shared_prefix_attention.shared_prefix_attention for one query per row: each row's block
    walks the prefix ([1, Hkv, P, D], read by every row's blocks at about the same time, so mostly
    from L2) then its own tail, one online softmax over both; ``shares`` [B] bool: rows that see the
    prefix (None: all); ``sinks`` [Hq]: one more level per head."""
    return _launch(queries, tail_keys, tail_values, tail_starts, scale, sinks, shares, prefix=(prefix_keys,
                                                                                               prefix_values))


def gqa_levels_decode(queries, tail_keys, tail_values, tail_starts, scale: float, sinks: mx.array | None,
                      levels: tuple[mx.array, mx.array, mx.array], shares: mx.array | None) -> mx.array:
    """Each row's tail walked by this kernel, merged in its epilogue with precomputed prefix levels
    (weighted, peak, total; [Hkv, splits, rows x group, n] float32, the stacked layout of
    kv/prefix_mma_kernel.prefix_partials) for the rows that ``shares`` marks (None: all)."""
    return _launch(queries, tail_keys, tail_values, tail_starts, scale, sinks, shares, levels=levels)


def _launch(queries, keys, values, starts, scale: float, sinks=None, shares=None, prefix=None,
            levels=None) -> mx.array:
    batch, heads, _, dim = queries.shape
    kv_heads = keys.shape[1]
    threads = block_threads(queries.dtype, dim, heads // kv_heads)
    no_levels = constant(("no levels",), lambda: mx.zeros((1, 1, 1, 1), mx.float32))
    return _compiled()(
        inputs=[mx.contiguous(queries), *prefix_inputs(prefix, queries.dtype), keys, values,
                row_starts(starts), scale_array(scale), sinks_array(sinks), row_shares(shares, batch),
                *(mx.contiguous(x) for x in levels or (no_levels,) * 3)],
        template=[("T", queries.dtype), ("D", dim), ("G", heads // kv_heads), ("NT", threads), ("LOADS", LOADS),
                  ("HAS_PREFIX", prefix is not None), ("HAS_SINKS", sinks is not None),
                  ("HAS_LEVELS", levels is not None)],
        grid=(kv_heads * threads, batch, 1),
        threadgroup=(threads, 1, 1),
        output_shapes=[queries.shape],
        output_dtypes=[queries.dtype],
    )[0]


def _compiled():
    global _kernel
    if _kernel is None:
        _kernel = mx.fast.cuda_kernel(
            name="mlxq_gqa_decode_levels",
            input_names=["queries", "prefix_keys", "prefix_values", "keys", "values", "starts", "scale", "sinks",
                         "shares", "level_weighted", "level_peak", "level_total"],
            output_names=["out"],
            source=_SOURCE,
            header=_HEADER,
            ensure_row_contiguous=False,
        )
    return _kernel


def self_check(dtype=mx.bfloat16, heads: int = 32, kv_heads: int = 8, dim: int = 128) -> float:
    """Max |kernel - MLX masked attention| on random rows with random left padding (strided views)."""
    return max_error_vs_mlx(gqa_decode_attention, dtype, heads=heads, kv_heads=kv_heads, dim=dim)
