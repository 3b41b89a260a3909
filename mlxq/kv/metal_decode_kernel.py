"""A shared-prefix group's decode step on Metal: every query head of a KV head's group in one threadgroup.

The Metal counterpart of kv/gqa_decode_kernel.py, written with
``mx.fast.metal_kernel`` in the idioms of MLX's own one-query SDPA kernel
(``sdpa_vector``): one threadgroup per (KV head, row) of ``SIMDGROUPS``
simdgroups of 32 threads. A key is read by one whole simdgroup, each lane
holding ``D / 32`` contiguous dimensions of it and of the G queries of the
group (scaled, in float32); ``simd_sum`` gives each head's score, and each
simdgroup keeps one online softmax per head (peak, total, weighted values
in float32) over the keys it walks: simdgroup s takes keys s, s + SG, ...
of the shared prefix (rows that see it) and then of the row's own tail
(from ``starts[b]``, left padding before). So every key and value is read
once for all G query heads. At the end the simdgroups' partials meet in
threadgroup memory (peaks and totals, then each head's SG x D weighted
values in turn), every thread merging some output dimensions, with an
attention sink per head as one more level. ``sdpa_vector`` uses 32
simdgroups (1,024 threads) holding one query each; here a thread holds
the G queries and outputs of its dimensions (up to 2 x 32 floats), so a
threadgroup has 8 (256 threads): a pipeline whose registers do not allow
1,024 threads per threadgroup refuses such a launch. Peaks start at the
lowest finite float rather than -inf (the kernels compile with fast math,
which assumes no infinities); a row with no visible key and no sink
writes 0, as MLX's kernel does.

Same inputs and result as kv/shared_prefix_attention.shared_prefix_attention
for one query per row (bf16, float16 or float32; keys and values read where
they lie, strided cache views with a contiguous last axis, as mlx-lm's
caches hold them). Nothing of it was run on a Metal device here: no Mac was
at hand. It runs only after kv/shared_prefix_decode.enable_metal's start-up
check (``self_check``) agreed with the plain path on the device itself, and
its speed was never measured (docs/benchmarks.md, "Metal: the shared-prefix
decode kernel, not measured").
"""

from __future__ import annotations

import mlx.core as mx

from mlxq.kv.kernel_inputs import prefix_inputs, row_shares, row_starts, scale_array, sinks_array
from mlxq.kv.shared_prefix_attention import shared_prefix_attention

SIMDGROUPS = 8  # per threadgroup (256 threads; not measured: see the module docstring)
LANES = 32  # threads per simdgroup on every Apple GPU
MAX_WIDTH = 32  # G x D / 32: floats a thread keeps per query set and per output set (registers)
# Largest |kernel - plain path| the start-up check accepts, per dtype (outputs of order 1): float32 a few
# rounding steps of the exponentials, float16 and bf16 the plain path's own bounds against float32.
BOUNDS = {mx.float32: 1e-4, mx.float16: 4e-3, mx.bfloat16: 2e-2}

_HEADER = """
#define MLXQ_FINITE_MIN (-3.402823466e+38f)

// Keys [first, end) of one (row, KV head), walked by simdgroup `sg` (keys sg, sg + SG, ...): one score
// per query head by simd_sum, one online softmax per head in float32.
template <int G, int E, int SG, typename PK, typename PV>
inline void walk_keys(PK kp, PV vp, int64_t ks, int64_t vs, int first, int end, uint sg, uint lane,
                      thread float* q, thread float* o, thread float* m, thread float* l) {
    kp += lane * E;
    vp += lane * E;
    for (int j = first + int(sg); j < end; j += SG) {
        float k[E];
        float v[E];
        for (int i = 0; i < E; i++) {
            k[i] = static_cast<float>(kp[j * ks + i]);
            v[i] = static_cast<float>(vp[j * vs + i]);
        }
        for (int h = 0; h < G; h++) {
            float s = 0.0f;
            for (int i = 0; i < E; i++) {
                s += q[h * E + i] * k[i];
            }
            s = metal::simd_sum(s);
            const float peak = metal::max(m[h], s);
            const float f = metal::precise::exp(m[h] - peak);
            const float e = metal::precise::exp(s - peak);
            m[h] = peak;
            l[h] = l[h] * f + e;
            for (int i = 0; i < E; i++) {
                o[h * E + i] = o[h * E + i] * f + e * v[i];
            }
        }
    }
}
"""

_SOURCE = """
    constexpr int E = D / 32;
    threadgroup float part_peak[SG * G];
    threadgroup float part_total[SG * G];
    threadgroup float exchange[SG * D];
    const int kvh = int(threadgroup_position_in_grid.x);
    const int b = int(threadgroup_position_in_grid.y);
    const uint sg = simdgroup_index_in_threadgroup;
    const uint lane = thread_index_in_simdgroup;
    const int heads = queries_shape[1];
    const float s = scale[0];
    float q[G * E];
    float o[G * E];
    float m[G];
    float l[G];
    for (int h = 0; h < G; h++) {
        const int64_t at = ((int64_t)b * heads + kvh * G + h) * D + lane * E;
        for (int i = 0; i < E; i++) {
            q[h * E + i] = static_cast<float>(queries[at + i]) * s;
            o[h * E + i] = 0.0f;
        }
        m[h] = MLXQ_FINITE_MIN;
        l[h] = 0.0f;
    }
    if (HAS_PREFIX && shares[b] != 0) {
        walk_keys<G, E, SG>(prefix_keys + kvh * prefix_keys_strides[1], prefix_values + kvh * prefix_values_strides[1],
                            prefix_keys_strides[2], prefix_values_strides[2], 0, prefix_keys_shape[2], sg, lane,
                            q, o, m, l);
    }
    walk_keys<G, E, SG>(keys + b * keys_strides[0] + kvh * keys_strides[1],
                        values + b * values_strides[0] + kvh * values_strides[1],
                        keys_strides[2], values_strides[2], starts[b], keys_shape[2], sg, lane, q, o, m, l);

    if (lane == 0) {
        for (int h = 0; h < G; h++) {
            part_peak[sg * G + h] = m[h];
            part_total[sg * G + h] = l[h];
        }
    }
    metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);
    const int t = int(sg) * 32 + int(lane);
    for (int h = 0; h < G; h++) {
        const float sink = HAS_SINKS ? static_cast<float>(sinks[kvh * G + h]) : MLXQ_FINITE_MIN;
        float peak = sink;
        for (int k = 0; k < SG; k++) {
            peak = metal::max(peak, part_peak[k * G + h]);
        }
        float factor[SG];
        float total = HAS_SINKS ? metal::precise::exp(sink - peak) : 0.0f;
        for (int k = 0; k < SG; k++) {
            factor[k] = metal::precise::exp(part_peak[k * G + h] - peak);
            total += part_total[k * G + h] * factor[k];
        }
        for (int i = 0; i < E; i++) {
            exchange[sg * D + lane * E + i] = o[h * E + i];
        }
        metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);
        const int64_t row = ((int64_t)b * heads + kvh * G + h) * D;
        for (int d = t; d < D; d += SG * 32) {
            float acc = 0.0f;
            for (int k = 0; k < SG; k++) {
                acc += exchange[k * D + d] * factor[k];
            }
            out[row + d] = static_cast<T>(total == 0.0f ? acc : acc / total);
        }
        metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);
    }
"""

_kernel = None


def on_metal() -> bool:
    """MLX runs on Metal here (the backend predicate kv/shared_prefix_decode.py and the engine read)."""
    return mx.metal.is_available() and mx.default_device() == mx.gpu


def can_run(queries: mx.array, prefix_keys: mx.array, keys: mx.array, values: mx.array) -> bool:
    """The kernel takes this call: one query per row, head width a multiple of 32 lanes, every
    array of the queries' dtype, at most MAX_WIDTH floats a thread per query set."""
    heads, dim = queries.shape[1], queries.shape[-1]
    kv_heads = keys.shape[1]
    if queries.shape[2] != 1 or heads % kv_heads or dim % LANES or prefix_keys.shape[1] != kv_heads:
        return False
    return (keys.shape[-1] == values.shape[-1] == prefix_keys.shape[-1] == dim
            and keys.dtype == values.dtype == prefix_keys.dtype == queries.dtype
            and queries.dtype in BOUNDS and heads // kv_heads * dim // LANES <= MAX_WIDTH)


def metal_shared_prefix_decode(queries, prefix_keys, prefix_values, tail_keys, tail_values, tail_starts,
                               scale: float, sinks: mx.array | None = None,
                               shares: mx.array | None = None) -> mx.array:
    """shared_prefix_attention for one query per row (``can_run`` shapes): queries [B, Hq, 1, D];
    prefix_* [1, Hkv, P, D]; tail_* [B, Hkv, T, D], row b's own keys from ``tail_starts[b]`` on;
    ``sinks`` [Hq]: one more level per head; ``shares`` [B] bool: the rows that see the prefix (None: all)."""
    return _launch(queries, tail_keys, tail_values, tail_starts, scale, sinks, shares, (prefix_keys, prefix_values))


def _launch(queries, keys, values, starts, scale: float, sinks=None, shares=None, prefix=None) -> mx.array:
    batch, heads, _, dim = queries.shape
    kv_heads = keys.shape[1]
    threads = SIMDGROUPS * LANES
    return _compiled()(
        inputs=[mx.contiguous(queries), *prefix_inputs(prefix, queries.dtype), keys, values, row_starts(starts),
                scale_array(scale), sinks_array(sinks), row_shares(shares, batch)],
        template=[("T", queries.dtype), ("D", dim), ("G", heads // kv_heads), ("SG", SIMDGROUPS),
                  ("HAS_PREFIX", prefix is not None), ("HAS_SINKS", sinks is not None)],
        grid=(kv_heads * threads, batch, 1),
        threadgroup=(threads, 1, 1),
        output_shapes=[queries.shape],
        output_dtypes=[queries.dtype],
    )[0]


def _compiled():
    global _kernel
    if _kernel is None:
        _kernel = mx.fast.metal_kernel(
            name="mlxq_shared_prefix_decode",
            input_names=["queries", "prefix_keys", "prefix_values", "keys", "values", "starts", "scale", "sinks",
                         "shares"],
            output_names=["out"],
            source=_SOURCE,
            header=_HEADER,
            ensure_row_contiguous=False,
        )
    return _kernel


def check_inputs(dtype, heads: int = 8, kv_heads: int = 2, dim: int = 128, rows: int = 6, prefix: int = 333,
                 own: int = 40, seed: int = 0):
    """A random group as the caches hand it over: tails as strided views of a longer buffer, rows
    left-padded by different amounts (one with a single own key), prefix not a multiple of 32."""
    parts = mx.random.split(mx.random.key(seed), 4)
    q = mx.random.normal((rows, heads, 1, dim), key=parts[0]).astype(dtype)
    pk, pv = (mx.random.normal((1, kv_heads, prefix, dim), key=parts[i]).astype(dtype) for i in (1, 2))
    buffer = mx.random.normal((2, rows, kv_heads, own + 24, dim), key=parts[3]).astype(dtype)
    starts = mx.array([min((0, 1, own - 1, 17, 5, own // 2)[b % 6], own - 1) for b in range(rows)])
    return q, pk, pv, buffer[0, :, :, :own], buffer[1, :, :, :own], starts, dim**-0.5


def max_error(dtype, heads: int = 8, kv_heads: int = 2, dim: int = 128, sinks: bool = False,
              shares: bool = False, **shape) -> float:
    """Max |kernel - plain path| on ``check_inputs``, with a sink per head and some rows outside the
    group where asked."""
    q, pk, pv, tk, tv, starts, scale = check_inputs(dtype, heads, kv_heads, dim, **shape)
    sink = mx.random.normal((heads,), key=mx.random.key(7)) if sinks else None
    rows = q.shape[0]
    marks = mx.array([b % 3 != 1 for b in range(rows)]) if shares else None
    want = shared_prefix_attention(q, pk, pv, tk, tv, starts, scale, sink, None, marks).astype(mx.float32)
    got = metal_shared_prefix_decode(q, pk, pv, tk, tv, starts, scale, sink, marks).astype(mx.float32)
    return mx.abs(got - want).max().item()


def self_check() -> dict[str, float]:
    """Max |kernel - plain path| per dtype the kernel takes: 4 query heads per KV head without sinks,
    and the widest group it holds at that head width (MAX_WIDTH floats a thread) with sinks and rows
    outside the group."""
    widest = MAX_WIDTH * LANES // 128  # query heads per KV head at D = 128
    return {str(dtype): max(max_error(dtype), max_error(dtype, heads=2 * widest, sinks=True, shares=True))
            for dtype in BOUNDS}


def disagreeing(errors: dict[str, float]) -> dict[str, float]:
    """The dtypes of ``self_check``'s result whose difference is not below their bound (NaN included)."""
    bounds = {str(dtype): bound for dtype, bound in BOUNDS.items()}
    return {name: error for name, error in errors.items() if not error < bounds[name]}
