"""A group's queries against its shared prefix on tensor cores: flash-decoding partials per split.

The split path (kv/tail_merge_kernel.py) computes the prefix level as
stacked GEMMs per KV head (cuBLAS) with the softmax between them as plain
MLX operations: the [rows x group, prefix] score matrix goes to device
memory in float32 and back three times, and at 64 rows on a 16k prefix
that traffic, not the 64 MB of prefix K/V, bounds the layer (0.88 ms on the
H200, docs/benchmarks.md). The gqa path walks the prefix per row on CUDA
cores: ~17 GFLOP per layer at 64 x 16k, too many multiply-adds for them.

Here one kernel does both products on tensor cores (``mma.sync`` m16n8k16,
bf16 in, float32 accumulate) with the online softmax in registers between
them, FlashAttention-2's shape turned to decode: the rows' queries of one
KV head are the M axis (row b's query head kv * group + i is row
b * group + i), the prefix is split into chunks of keys (flash-decoding),
and one block walks one chunk for its query rows (``Tiling``: warps of
one or two 16-row tiles each, so a warp's staged key and value fragments
serve both; the queries held in registers or read from shared memory),
``keys`` at a time staged in shared memory by ``cp.async`` in ``stages``
buffers (the next blocks load while this one is multiplied; one barrier
per step). Each split writes its partial level (weighted values, peak,
total; float32, natural log units) and kv/tail_merge_kernel.py merges the
splits with each row's tail and the sink in its epilogue (a prefill:
``one_level``). The probabilities enter the second product rounded to
bf16, as the plain path's ``weights.astype(values.dtype) @ values`` does;
their sums stay float32. A prefill chunk (64 rows x 58 queries x 4 heads
of a group: ~15k query rows per KV head on a 16k prefix, ~31 TFLOP for an
8B shape's 32 layers) and a decode step take different cuts
(``default_tiling``).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from mlxq.kv.kernel_inputs import constant, scale_array
from mlxq.kv.shared_prefix_attention import stacked_prefix_stats

HEAD_DIMS = (64, 128)
KEYS_PER_BLOCK = 64  # a split's keys come in whole multiples of this (every cut's ``keys`` divides it)
# Blocks per launch the splits aim at: two per SM of an H200 (132 SMs). Against 528 blocks and 8 warps
# per block it was the fastest in all four 8B cases measured (docs/benchmarks.md, 2026-12-01).
TARGET_BLOCKS = 264

_HEADER = """
#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ unsigned shared_address(const void* p) {
    unsigned address;
    asm volatile("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(address) : "l"(p));
    return address;
}

// 16 bytes global -> shared, zero-filled when ``valid`` is false (``src`` must still be a valid address).
__device__ __forceinline__ void copy16_async(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(shared_address(dst)), "l"(src),
                 "r"(valid ? 16 : 0));
}

__device__ __forceinline__ void commit_async() { asm volatile("cp.async.commit_group;"); }

__device__ __forceinline__ void load_matrices(unsigned (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(shared_address(p)));
}

__device__ __forceinline__ void load_matrices_transposed(unsigned (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(shared_address(p)));
}

// c += a (16x16, row-major fragment) * b (16x8, column-major fragment), bf16 in, float32 accumulate.
__device__ __forceinline__ void mma_bf16(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ unsigned pack_bf16(float low, float high) {
    __nv_bfloat162 v = __floats2bfloat162_rn(low, high);
    return *reinterpret_cast<unsigned*>(&v);
}

// Query row m of KV head kvh in the stacked layout (b, i, p): row b's head kvh * group + i, its query p of
// ``positions`` (m = (b * group + i) * positions + p; one query per row in a decode step).
__device__ __forceinline__ unsigned query_word(const __nv_bfloat16* queries, int m, int rows, int group,
                                               int positions, int heads, int kvh, int dim, int column) {
    if (m >= rows) {
        return 0u;
    }
    const int per_row = group * positions;
    const int head = kvh * group + (m % per_row) / positions;
    const int64_t at = (((int64_t)(m / per_row) * heads + head) * positions + m % positions) * dim + column;
    return *reinterpret_cast<const unsigned*>(queries + at);
}
"""

_HEADER_STAGING = r"""
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// Stage rows [first, first + KB) of one head into shared rows of PAD elements; rows past ``end`` are zeros.
template <int D, int KB, int PAD, int NT>
__device__ __forceinline__ void stage_rows(__nv_bfloat16* dst, const __nv_bfloat16* src, int64_t stride, int first,
                                           int end) {
    constexpr int PER_ROW = D / 8;
#pragma unroll
    for (int c = threadIdx.x; c < KB * PER_ROW; c += NT) {
        const int row = c / PER_ROW;
        const int piece = c % PER_ROW;
        const bool valid = first + row < end;
        const __nv_bfloat16* from = src + (valid ? (int64_t)(first + row) * stride + piece * 8 : 0);
        copy16_async(dst + row * PAD + piece * 8, from, valid);
    }
}

template <int N>
__device__ __forceinline__ void wait_pending() { asm volatile("cp.async.wait_group %0;" :: "n"(N)); }
"""

# The kernel body in pieces (the packed tails' kernel, kv/packed_tails_kernel.py, reuses them): the set-up,
# the queries staged, the prefix's first stages in flight, the accumulators.
_SETUP = r"""
    // Template: D, WARPS, MT (16-row tiles per warp), KB (keys per stage), STAGES, QSMEM, SUB (keys per
    // softmax step: KB / SUB steps per staged block).
    constexpr int NT = 32 * WARPS;
    constexpr int ROWS = 16 * MT * WARPS;  // query rows per block
    constexpr int PAD = D + 8;
    constexpr int KSTEPS = D / 16;
    constexpr int DTILES = D / 8;
    constexpr int NTILES = SUB / 8;
    constexpr int TILE = KB * PAD;  // elements of one staged K (or V) block
    constexpr float LOG2E = 1.4426950408889634f;
    extern __shared__ __align__(16) unsigned char shared_bytes[];
    __nv_bfloat16* key_tiles = reinterpret_cast<__nv_bfloat16*>(shared_bytes);
    __nv_bfloat16* value_tiles = key_tiles + STAGES * TILE;
    __nv_bfloat16* query_tile = value_tiles + STAGES * TILE;  // ROWS x PAD when QSMEM
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int kvh = blockIdx.z;
    const int split = blockIdx.y;
    const int splits = gridDim.y;
    const int heads = queries_shape[1];
    const int group = heads / prefix_keys_shape[1];
    const int positions = queries_shape[2];
    const int rows = queries_shape[0] * group * positions;
    const int row_first = chunk[1];  // this launch's stacked rows: [row_first, row_first + chunk[2])
    const int row_end = min(rows, row_first + chunk[2]);
    const int length = prefix_keys_shape[2];
    const int first = split * chunk[0];
    const int end = min(first + chunk[0], length);
    const int row0 = row_first + blockIdx.x * ROWS + warp * MT * 16;  // this warp's first row
    const float scale2 = scale[0] * LOG2E;  // scores in log2 units
    const __nv_bfloat16* kbase = prefix_keys + kvh * prefix_keys_strides[1];
    const __nv_bfloat16* vbase = prefix_values + kvh * prefix_values_strides[1];
    const int64_t kstride = prefix_keys_strides[2];
    const int64_t vstride = prefix_values_strides[2];
    const int per_row = group * positions;

    unsigned qa[QSMEM ? 1 : MT][QSMEM ? 1 : KSTEPS][4];
    if constexpr (QSMEM) {
        constexpr int PER_ROW = D / 8;
        for (int c = threadIdx.x; c < ROWS * PER_ROW; c += NT) {
            const int r = c / PER_ROW;
            const int m = row_first + blockIdx.x * ROWS + r;
            const int piece = c % PER_ROW;
            const bool valid = m < row_end;
            int64_t at = 0;
            if (valid) {
                const int head = kvh * group + (m % per_row) / positions;
                at = (((int64_t)(m / per_row) * heads + head) * positions + m % positions) * D + piece * 8;
            }
            copy16_async(query_tile + r * PAD + piece * 8, queries + at, valid);
        }
    } else {
#pragma unroll
        for (int j = 0; j < MT; j++) {
#pragma unroll
            for (int k = 0; k < KSTEPS; k++) {
                const int column = k * 16 + (lane % 4) * 2;
                const int r0 = row0 + j * 16 + lane / 4;
                qa[j][k][0] = query_word(queries, r0, row_end, group, positions, heads, kvh, D, column);
                qa[j][k][1] = query_word(queries, r0 + 8, row_end, group, positions, heads, kvh, D, column);
                qa[j][k][2] = query_word(queries, r0, row_end, group, positions, heads, kvh, D, column + 8);
                qa[j][k][3] = query_word(queries, r0 + 8, row_end, group, positions, heads, kvh, D, column + 8);
            }
        }
    }
    // Prologue: stages 0 .. STAGES - 2 in flight (one commit group each, the queries in the first).
#pragma unroll
    for (int s = 0; s < STAGES - 1; s++) {
        if (first + s * KB < end) {
            stage_rows<D, KB, PAD, NT>(key_tiles + s * TILE, kbase, kstride, first + s * KB, end);
            stage_rows<D, KB, PAD, NT>(value_tiles + s * TILE, vbase, vstride, first + s * KB, end);
        }
        commit_async();
    }

    float o[MT][DTILES][4];
#pragma unroll
    for (int j = 0; j < MT; j++) {
#pragma unroll
        for (int t = 0; t < DTILES; t++) {
            o[j][t][0] = o[j][t][1] = o[j][t][2] = o[j][t][3] = 0.0f;
        }
    }
    float peak[MT][2];  // raw (unscaled) scores
    float total[MT][2];
#pragma unroll
    for (int j = 0; j < MT; j++) {
        peak[j][0] = peak[j][1] = NEG_INF;
        total[j][0] = total[j][1] = 0.0f;
    }

"""

# The walk over the prefix: a staged block per step, ``SUB`` keys at a time (``key_tile``, ``value_tile`` at ``at``).
_PREFIX_LOOP_HEAD = r"""
    int stage = 0;
    for (int block = first; block < end; block += KB) {
        wait_pending<STAGES - 2>();  // this block's keys and values (and the queries)
        __syncthreads();  // visible to all; every warp is done with the stage about to be refilled
        {
            const int ahead = block + (STAGES - 1) * KB;
            const int refill = (stage + STAGES - 1) % STAGES;
            if (ahead < end) {
                stage_rows<D, KB, PAD, NT>(key_tiles + refill * TILE, kbase, kstride, ahead, end);
                stage_rows<D, KB, PAD, NT>(value_tiles + refill * TILE, vbase, vstride, ahead, end);
            }
            commit_async();
        }
#pragma unroll 1
        for (int sub = 0; sub < KB; sub += SUB) {
            const int at = block + sub;
            if (at >= end) {
                break;
            }
            const __nv_bfloat16* key_tile = key_tiles + stage * TILE + sub * PAD;
            const __nv_bfloat16* value_tile = value_tiles + stage * TILE + sub * PAD;
"""

# One step's scores s = q k^T for the warp's tiles (``key_tile``: SUB staged keys).
_SCORES = r"""
            float s[MT][NTILES][4];
#pragma unroll
            for (int j = 0; j < MT; j++) {
#pragma unroll
                for (int n = 0; n < NTILES; n++) {
                    s[j][n][0] = s[j][n][1] = s[j][n][2] = s[j][n][3] = 0.0f;
                }
            }
#pragma unroll
            for (int k = 0; k < KSTEPS; k += 2) {
                unsigned a[MT][2][4];
                if constexpr (QSMEM) {
#pragma unroll
                    for (int j = 0; j < MT; j++) {
                        const __nv_bfloat16* q = query_tile + (warp * MT * 16 + j * 16 + lane % 16) * PAD
                                                 + (lane / 16) * 8;
                        load_matrices(a[j][0], q + k * 16);
                        load_matrices(a[j][1], q + k * 16 + 16);
                    }
                }
#pragma unroll
                for (int n = 0; n < NTILES; n++) {
                    unsigned b[4];
                    load_matrices(b, key_tile + (n * 8 + lane % 8) * PAD + k * 16 + (lane / 8) * 8);
#pragma unroll
                    for (int j = 0; j < MT; j++) {
                        if constexpr (QSMEM) {
                            mma_bf16(s[j][n], a[j][0], b[0], b[1]);
                            mma_bf16(s[j][n], a[j][1], b[2], b[3]);
                        } else {
                            mma_bf16(s[j][n], qa[j][k], b[0], b[1]);
                            mma_bf16(s[j][n], qa[j][k + 1], b[2], b[3]);
                        }
                    }
                }
            }
"""

# Keys past the prefix chunk's ``end`` weigh nothing.
_PREFIX_MASK = r"""
            if (at + SUB > end) {  // the chunk's last block is partial: keys past ``end`` weigh nothing
#pragma unroll
                for (int n = 0; n < NTILES; n++) {
                    const int key = at + n * 8 + (lane % 4) * 2;
#pragma unroll
                    for (int j = 0; j < MT; j++) {
#pragma unroll
                        for (int i = 0; i < 4; i++) {
                            s[j][n][i] = key + (i & 1) < end ? s[j][n][i] : NEG_INF;
                        }
                    }
                }
            }
"""

# The online softmax over the step's scores, then o += p v (``value_tile``).
_SOFTMAX_VALUES = r"""
            unsigned p[MT][SUB / 16][4];
#pragma unroll
            for (int j = 0; j < MT; j++) {
                float top[2] = {peak[j][0], peak[j][1]};
#pragma unroll
                for (int n = 0; n < NTILES; n++) {
                    top[0] = fmaxf(top[0], fmaxf(s[j][n][0], s[j][n][1]));
                    top[1] = fmaxf(top[1], fmaxf(s[j][n][2], s[j][n][3]));
                }
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    top[h] = fmaxf(top[h], __shfl_xor_sync(0xffffffff, top[h], 1));
                    top[h] = fmaxf(top[h], __shfl_xor_sync(0xffffffff, top[h], 2));
                }
                const float t0 = top[0] * scale2;  // every block has a key in range: top is finite
                const float t1 = top[1] * scale2;
                const float f0 = fast_exp2(peak[j][0] * scale2 - t0);
                const float f1 = fast_exp2(peak[j][1] * scale2 - t1);
                total[j][0] *= f0;
                total[j][1] *= f1;
#pragma unroll
                for (int n = 0; n < NTILES; n++) {
                    s[j][n][0] = fast_exp2(fmaf(s[j][n][0], scale2, -t0));
                    s[j][n][1] = fast_exp2(fmaf(s[j][n][1], scale2, -t0));
                    s[j][n][2] = fast_exp2(fmaf(s[j][n][2], scale2, -t1));
                    s[j][n][3] = fast_exp2(fmaf(s[j][n][3], scale2, -t1));
                    total[j][0] += s[j][n][0] + s[j][n][1];
                    total[j][1] += s[j][n][2] + s[j][n][3];
                }
                // A peak that did not move scales by exactly 1: the warp skips it when none of its rows' moved.
                if (__any_sync(0xffffffff, top[0] != peak[j][0] || top[1] != peak[j][1])) {
#pragma unroll
                    for (int t = 0; t < DTILES; t++) {
                        o[j][t][0] *= f0;
                        o[j][t][1] *= f0;
                        o[j][t][2] *= f1;
                        o[j][t][3] *= f1;
                    }
                }
                peak[j][0] = top[0];
                peak[j][1] = top[1];
#pragma unroll
                for (int k = 0; k < SUB / 16; k++) {
                    p[j][k][0] = pack_bf16(s[j][2 * k][0], s[j][2 * k][1]);
                    p[j][k][1] = pack_bf16(s[j][2 * k][2], s[j][2 * k][3]);
                    p[j][k][2] = pack_bf16(s[j][2 * k + 1][0], s[j][2 * k + 1][1]);
                    p[j][k][3] = pack_bf16(s[j][2 * k + 1][2], s[j][2 * k + 1][3]);
                }
            }
#pragma unroll
            for (int k = 0; k < SUB / 16; k++) {
#pragma unroll
                for (int t = 0; t < DTILES; t += 2) {
                    unsigned b[4];
                    load_matrices_transposed(b, value_tile + (k * 16 + lane % 8 + ((lane / 8) % 2) * 8) * PAD + t * 8
                                                 + (lane / 16) * 8);
#pragma unroll
                    for (int j = 0; j < MT; j++) {
                        mma_bf16(o[j][t], p[j][k], b[0], b[1]);
                        mma_bf16(o[j][t + 1], p[j][k], b[2], b[3]);
                    }
                }
            }
"""

# The step's end, the next stage.
_PREFIX_LOOP_END = r"""
        }
        stage = (stage + 1) % STAGES;
    }
"""

# Each split's partial level out: weighted values, peak, total (float32, natural log units).
_PARTIALS_OUT_HEAD = r"""
    constexpr float LN2 = 0.6931471805599453f;
    const int64_t level = ((int64_t)kvh * splits + split) * chunk[2] - row_first;  // output rows: the launch's
"""

# Each of the warp's output rows in turn: its total summed over its four lanes, rows past the end skipped.
_EACH_OUTPUT_ROW = r"""
#pragma unroll
    for (int j = 0; j < MT; j++) {
#pragma unroll
        for (int h = 0; h < 2; h++) {
            float sum = total[j][h];
            sum += __shfl_xor_sync(0xffffffff, sum, 1);
            sum += __shfl_xor_sync(0xffffffff, sum, 2);
            const int m = row0 + j * 16 + lane / 4 + h * 8;
            if (m >= row_end) {
                continue;
            }
"""

_PARTIALS_OUT_ROW = r"""
            if (lane % 4 == 0) {
                out_peak[level + m] = peak[j][h] * scale2 * LN2;
                out_total[level + m] = sum;
            }
            float* w = out_weighted + (level + m) * D + (lane % 4) * 2;
#pragma unroll
            for (int t = 0; t < DTILES; t++) {
                *reinterpret_cast<float2*>(w + t * 8) = make_float2(o[j][t][2 * h], o[j][t][2 * h + 1]);
            }
        }
    }
"""


def kernel_body(*pieces: str) -> str:
    """The pieces (each written from a new line) as one kernel source."""
    return "\n" + "".join(piece.removeprefix("\n") for piece in pieces)


_SOURCE = kernel_body(_SETUP, _PREFIX_LOOP_HEAD, _SCORES, _PREFIX_MASK, _SOFTMAX_VALUES, _PREFIX_LOOP_END,
                      _PARTIALS_OUT_HEAD, _EACH_OUTPUT_ROW, _PARTIALS_OUT_ROW)


def can_run(queries: mx.array, prefix_keys: mx.array) -> bool:
    """bf16 queries (any number per row) of a head width the kernel has, a non-empty bf16 prefix,
    GQA-divisible heads (the values are the keys' shape and dtype in every cache)."""
    dim = queries.shape[-1]
    return (dim in HEAD_DIMS and queries.dtype == prefix_keys.dtype == mx.bfloat16
            and prefix_keys.shape[-1] == dim and prefix_keys.shape[2] > 0
            and queries.shape[1] % prefix_keys.shape[1] == 0)


@dataclass(frozen=True)
class Tiling:
    """How the kernel cuts the work: ``warps`` per block, ``tiles`` of 16 query
    rows per warp (the staged keys' and values' fragments serve all of a warp's tiles), ``keys`` staged
    per step in ``stages`` buffers (loads ``stages - 1`` steps ahead, one barrier per step), and the
    queries in shared memory (``shared_queries``) or held in registers; ``min_blocks``: blocks per SM
    the compiler must leave room for (``__launch_bounds__``; 0: its own choice)."""

    warps: int = 4
    tiles: int = 1
    keys: int = 64
    stages: int = 2
    shared_queries: bool = False
    min_blocks: int = 0
    sub: int = 0  # keys per softmax step (0: ``keys``)

    @property
    def rows(self) -> int:
        """Query rows per block."""
        return 16 * self.tiles * self.warps

    def shared_bytes(self, dim: int) -> int:
        row = (dim + 8) * 2
        return 2 * self.stages * self.keys * row + (self.rows * row if self.shared_queries else 0)


def split_plan(rows: int, kv_heads: int, length: int, target_blocks: int = TARGET_BLOCKS,
               block_rows: int = 128) -> tuple[int, int]:
    """(keys per split, splits) for ``rows`` stacked query rows per KV head over ``length`` keys: enough
    splits that the launch has about ``target_blocks`` blocks of ``block_rows`` query rows, each a whole
    number of staged blocks."""
    tiles = -(-rows // block_rows) * kv_heads
    wanted = max(1, min(-(-target_blocks // tiles), -(-length // KEYS_PER_BLOCK)))
    chunk = -(-length // wanted)
    chunk = -(-chunk // KEYS_PER_BLOCK) * KEYS_PER_BLOCK
    return chunk, -(-length // chunk)


# The cut each query shape takes (docs/benchmarks.md, "H200: the prefix kernel's cuts"): 32 query rows
# per warp on 64 staged keys in a prefill chunk; in a decode step (fewer rows, the prefix split finer)
# 32-key steps in three stages.
PREFILL_TILING = Tiling(warps=4, tiles=2, keys=64, stages=2, shared_queries=True)
DECODE_TILING = Tiling(warps=4, tiles=2, keys=32, stages=3, shared_queries=True)
def default_tiling(positions: int) -> Tiling:
    """The cut for ``positions`` queries per row."""
    return PREFILL_TILING if positions > 1 else DECODE_TILING


_INPUTS = ["queries", "prefix_keys", "prefix_values", "scale", "chunk"]
_OUTPUTS = ["out_weighted", "out_peak", "out_total"]
_kernels: dict[tuple, object] = {}  # by shared memory, warps and blocks per SM


def _launch_bounds(threads: int, min_blocks: int) -> str:
    """The generated kernel's ``__global__`` with ``__launch_bounds__`` (MLX writes the signature; the header
    comes right before it): the register budget for ``min_blocks`` blocks of ``threads`` per SM."""
    if not min_blocks:
        return ""
    return (f"\n#undef __global__\n#define __global__ __attribute__((global)) "
            f"__attribute__((launch_bounds({threads}, {min_blocks})))\n")


def prefix_partials(queries: mx.array, prefix_keys: mx.array, prefix_values: mx.array, scale: float,
                    target_blocks: int = TARGET_BLOCKS, tiling: Tiling | None = None,
                    ) -> tuple[mx.array, mx.array, mx.array]:
    """Every row's queries against the prefix, one level per split (``can_run`` shapes).

    queries [B, Hq, L, D] (L = 1 in a decode step, a chunk's length in a prefill); prefix_* [1, Hkv,
    P, D] (last axis contiguous, rows 16-byte aligned, as caches hold them). Every query sees the
    whole prefix (it precedes them all). Returns (weighted [Hkv, S, B * group * L, D], peak and total
    [Hkv, S, B * group * L, 1]), float32, in the stacked row order of
    kv/shared_prefix_attention.stacked_prefix_stats. ``tiling``: the kernel's cut (None: the query
    shape's, ``default_tiling``)."""
    tiling = tiling or default_tiling(queries.shape[2])
    rows = _stacked_rows(queries, prefix_keys)
    chunk, splits = split_plan(rows, prefix_keys.shape[1], prefix_keys.shape[2], target_blocks, tiling.rows)
    return _launch(mx.contiguous(queries), prefix_keys, prefix_values, scale, tiling, chunk, splits, 0, rows)


def prefix_level(queries: mx.array, prefix_keys: mx.array, prefix_values: mx.array, scale: float,
                 tiling: Tiling | None = None) -> tuple[mx.array, mx.array, mx.array]:
    """``one_level(*prefix_partials(...))``: one unnormalized level [Hkv, rows, n], the prefill's form."""
    return one_level(*prefix_partials(queries, prefix_keys, prefix_values, scale, tiling=tiling))


def _stacked_rows(queries: mx.array, prefix_keys: mx.array) -> int:
    batch, heads, positions, _ = queries.shape
    return batch * heads // prefix_keys.shape[1] * positions


def _launch(queries: mx.array, prefix_keys: mx.array, prefix_values: mx.array, scale: float, tiling: Tiling,
            chunk: int, splits: int, first_row: int, launch_rows: int) -> tuple[mx.array, mx.array, mx.array]:
    """Stacked rows [first_row, first_row + launch_rows) of every KV head in ``splits`` chunks of keys."""
    kv_heads, dim = prefix_keys.shape[1], queries.shape[-1]
    level = (kv_heads, splits, launch_rows)
    shared = tiling.shared_bytes(dim)
    key = (shared, tiling.warps, tiling.min_blocks)
    if key not in _kernels:
        _kernels[key] = mx.fast.cuda_kernel(
            name=f"mlxq_prefix_mma_tiled_{tiling.warps}_{tiling.min_blocks}", input_names=_INPUTS,
            output_names=_OUTPUTS, source=_SOURCE,
            header=_HEADER + _HEADER_STAGING + _launch_bounds(32 * tiling.warps, tiling.min_blocks),
            ensure_row_contiguous=False, shared_memory=shared)
    plan = constant(("prefix plan", chunk, first_row, launch_rows),
                    lambda: mx.array([chunk, first_row, launch_rows], mx.int32))
    return tuple(_kernels[key](
        inputs=[queries, prefix_keys, prefix_values, scale_array(scale), plan],
        template=[("D", dim), ("WARPS", tiling.warps), ("MT", tiling.tiles), ("KB", tiling.keys),
                  ("STAGES", tiling.stages), ("QSMEM", tiling.shared_queries), ("SUB", tiling.sub or tiling.keys)],
        grid=(-(-launch_rows // tiling.rows) * 32 * tiling.warps, splits, kv_heads),
        threadgroup=(32 * tiling.warps, 1, 1),
        output_shapes=[(*level, dim), (*level, 1), (*level, 1)],
        output_dtypes=[mx.float32] * 3,
    ))


def one_level(weighted: mx.array, peak: mx.array, total: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """The splits' levels [Hkv, S, rows, n] as one unnormalized level [Hkv, rows, n] (plain MLX: float32,
    every split's peak finite)."""
    if weighted.shape[1] == 1:
        return weighted[:, 0], peak[:, 0], total[:, 0]
    top = peak.max(axis=1, keepdims=True)
    factor = mx.exp(peak - top)
    return (weighted * factor).sum(axis=1), top[:, 0], (total * factor).sum(axis=1)


def merged(weighted: mx.array, peak: mx.array, total: mx.array) -> mx.array:
    """The splits' levels as one normalized output [Hkv, rows, D] (plain MLX; the check's reference form)."""
    weighted, _, total = one_level(weighted, peak, total)
    return weighted / total


def self_check(rows: int = 19, heads: int = 32, kv_heads: int = 8, length: int = 1000, dim: int = 128,
               positions: int = 1, tiling: Tiling | None = None) -> float:
    """Max |kernel - plain stacked GEMMs| of the normalized prefix level, bf16, for one split (a chunk of
    many staged blocks, the last one partial) and for many; rows x group not a multiple of 64; the
    prefix a strided view of a longer buffer; ``positions`` queries per row (a prefill chunk), given
    as the strided view mlx-lm's models hand over ([B, L, Hq, D] transposed); ``tiling``: the cut
    checked (None: the query shape's)."""
    q = mx.random.normal((rows, positions, heads, dim)).astype(mx.bfloat16).swapaxes(1, 2)
    buffer = mx.random.normal((2, 1, kv_heads, length + 77, dim)).astype(mx.bfloat16)
    keys, values = buffer[0, :, :, 5:length + 5], buffer[1, :, :, 5:length + 5]
    scale = dim**-0.5
    weighted, _, total = stacked_prefix_stats(q, keys, values, scale)
    want = weighted / total
    worst = 0.0
    for target in (1, TARGET_BLOCKS):
        got = merged(*prefix_partials(q, keys, values, scale, target, tiling))
        worst = max(worst, mx.abs(got - want).max().item())
    return worst
