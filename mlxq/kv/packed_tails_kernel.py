"""A packed tails' forward's whole attention in one kernel: the prefix, each token's own tail, normalized.

Packed (kv/packed_tails.py), a burst's tails run as T rows of one query
each. Through plain operations their attention is three parts: the prefix
level from the tensor-core kernel (kv/prefix_mma_kernel.py), each row's tail
attended in the padded layout, and the two merged by log-sum-exp, with the
queries moved to the padded layout and the tail's three partials moved back
(on the H200, 64 rows x 56 tokens on a 16k prefix: ~3.65 ms a layer for the
prefix kernel and ~1.6-2 ms more for everything else). Here the prefix
kernel's walk goes on over the tails: after the prefix's last staged block,
each block of query rows (consecutive tokens, so one to a few rows of the
burst) stages those rows' tails a block of keys at a time and feeds them to
the same online softmax, every score of a token of another row or of a key
after the token's own position masked; the epilogue divides by the total
and writes each token's heads in the queries' layout and dtype. No level
leaves the kernel, nothing is merged after it.

The contract, in plain operations, is ``reference``: the start-up check
(kv/shared_prefix_decode.py ``enable``) compares the kernel with it on the
served model's heads before the kernel may run, and the tests compare it
with the packed cache's own attention on the CPU.

It takes the prefill's cut (``PREFILL_TILING``) in one split of the prefix
only (the epilogue normalizes: no split's level is left to merge), so it
runs where the split plan gives one split (a burst's thousands of tokens);
fewer tokens keep the three-part path. No attention sinks (one more level:
the three-part path).
"""

from __future__ import annotations

import mlx.core as mx

from mlxq.kv import prefix_mma_kernel
from mlxq.kv.kernel_inputs import constant, scale_array
from mlxq.kv.prefix_mma_kernel import (
    _EACH_OUTPUT_ROW,
    _HEADER,
    _HEADER_STAGING,
    _PREFIX_LOOP_END,
    _PREFIX_LOOP_HEAD,
    _PREFIX_MASK,
    _SCORES,
    _SETUP,
    _SOFTMAX_VALUES,
    PREFILL_TILING,
    kernel_body,
    split_plan,
)
from mlxq.kv.shared_prefix_attention import merge, prefix_partial, tail_partial

# The tails' walk: stacked row m is token m / group (one query position per row), its head kvh * group +
# m % group. A row's tokens are consecutive (``token_rows`` never decreases), so this block's tokens belong
# to the rows from its first token's to its last token's.
_TAILS_HEAD = r"""
    wait_pending<0>();
    __syncthreads();  // every warp done with the prefix's stages, none in flight
    {
        const int block_first = row_first + blockIdx.x * ROWS;
        const int last_token = (min(block_first + ROWS, row_end) - 1) / group;
        const int last_row = token_rows[last_token];
        const int tail_length = tail_keys_shape[2];
        for (int row = token_rows[block_first / group]; row <= last_row; row++) {
            const int tail_first = row_starts[row];
            // Keys after the block's last token's position are nobody's here; a row before the last ends
            // its tokens at the tail's end.
            const int tail_end = row == last_row ? token_positions[last_token] + 1 : tail_length;
            const __nv_bfloat16* tkbase = tail_keys + row * tail_keys_strides[0] + kvh * tail_keys_strides[1];
            const __nv_bfloat16* tvbase = tail_values + row * tail_values_strides[0] + kvh * tail_values_strides[1];
            for (int block = tail_first; block < tail_end; block += KB) {
                stage_rows<D, KB, PAD, NT>(key_tiles, tkbase, tail_keys_strides[2], block, tail_end);
                stage_rows<D, KB, PAD, NT>(value_tiles, tvbase, tail_values_strides[2], block, tail_end);
                commit_async();
                wait_pending<0>();
                __syncthreads();
#pragma unroll 1
                for (int sub = 0; sub < KB; sub += SUB) {
                    const int at = block + sub;
                    if (at >= tail_end) {
                        break;
                    }
                    const __nv_bfloat16* key_tile = key_tiles + sub * PAD;
                    const __nv_bfloat16* value_tile = value_tiles + sub * PAD;
"""

# Only this row's tokens see its keys, each up to its own position (read where used: registers are scarce).
_TAIL_MASK = r"""
#pragma unroll
            for (int j = 0; j < MT; j++) {
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const int m = row0 + j * 16 + lane / 4 + h * 8;
                    const int t = m / group;
                    const int last = m < row_end && token_rows[t] == row ? token_positions[t] : -1;
#pragma unroll
                    for (int n = 0; n < NTILES; n++) {
                        const int key = at + n * 8 + (lane % 4) * 2;
                        s[j][n][2 * h] = key <= last ? s[j][n][2 * h] : NEG_INF;
                        s[j][n][2 * h + 1] = key + 1 <= last ? s[j][n][2 * h + 1] : NEG_INF;
                    }
                }
            }
"""

_TAILS_END = r"""
                }
                __syncthreads();  // every warp done with this block before the next is staged over it
            }
        }
    }
"""

# Each token's heads normalized, in the queries' layout [T, Hq, 1, D] (bf16), one output row at a time.
_NORMALIZED_OUT_ROW = r"""
            const float inverse = 1.0f / sum;
            __nv_bfloat16* w = out + ((int64_t)(m / group) * heads + kvh * group + m % group) * D + (lane % 4) * 2;
#pragma unroll
            for (int t = 0; t < DTILES; t++) {
                *reinterpret_cast<unsigned*>(w + t * 8) = pack_bf16(o[j][t][2 * h] * inverse,
                                                                    o[j][t][2 * h + 1] * inverse);
            }
        }
    }
"""

_SOURCE = kernel_body(_SETUP, _PREFIX_LOOP_HEAD, _SCORES, _PREFIX_MASK, _SOFTMAX_VALUES, _PREFIX_LOOP_END,
                      _TAILS_HEAD, _SCORES, _TAIL_MASK, _SOFTMAX_VALUES, _TAILS_END, _EACH_OUTPUT_ROW,
                      _NORMALIZED_OUT_ROW)
_INPUTS = ["queries", "prefix_keys", "prefix_values", "scale", "chunk", "tail_keys", "tail_values", "token_rows",
           "token_positions", "row_starts"]
_kernel = None


def fits(queries: mx.array, prefix_keys: mx.array, tail_keys: mx.array, sinks: mx.array | None = None) -> bool:
    """Whether the kernel takes this call: the prefix kernel's shapes (bf16, a head width it has), one
    query per row, bf16 tails, no sinks, and enough rows that the prefix runs in one split."""
    if sinks is not None or queries.shape[2] != 1 or tail_keys.dtype != mx.bfloat16:
        return False
    if not prefix_mma_kernel.can_run(queries, prefix_keys):
        return False
    rows = queries.shape[0] * queries.shape[1] // prefix_keys.shape[1]
    return split_plan(rows, prefix_keys.shape[1], prefix_keys.shape[2], block_rows=PREFILL_TILING.rows)[1] == 1


def packed_attention(queries: mx.array, prefix_keys: mx.array, prefix_values: mx.array, tail_keys: mx.array,
                     tail_values: mx.array, token_rows: mx.array, token_positions: mx.array, row_starts: mx.array,
                     scale: float) -> mx.array:
    """softmax(q [prefix ; own tail] ^ T * scale) [prefix ; own tail] for every token (``fits`` shapes).

    queries [T, Hq, 1, D]; prefix_* [1, Hkv, P, D]; tail_* [B, Hkv, S, D] (the rows' padded tails, last
    axis contiguous); token_rows [T] int32, non-decreasing: each token's row; token_positions [T]
    int32: its own column in its row's tail (it sees the row's keys up to it), rising within a row (a
    block's last row is walked up to its last token's position only); row_starts [B] int32, >= 0:
    each row's first tail column it reads. Returns [T, Hq, 1, D] in the queries' dtype."""
    global _kernel
    tiling = PREFILL_TILING
    dim, kv_heads, length = queries.shape[-1], prefix_keys.shape[1], prefix_keys.shape[2]
    rows = queries.shape[0] * queries.shape[1] // kv_heads
    if _kernel is None:
        _kernel = mx.fast.cuda_kernel(
            name="mlxq_packed_tails_attention", input_names=_INPUTS, output_names=["out"], source=_SOURCE,
            header=_HEADER + _HEADER_STAGING, ensure_row_contiguous=False, shared_memory=tiling.shared_bytes(dim))
    plan = constant(("prefix plan", length, 0, rows), lambda: mx.array([length, 0, rows], mx.int32))
    return _kernel(
        inputs=[mx.contiguous(queries), prefix_keys, prefix_values, scale_array(scale), plan, tail_keys, tail_values,
                *(x.astype(mx.int32) for x in (token_rows, token_positions, row_starts))],
        template=[("D", dim), ("WARPS", tiling.warps), ("MT", tiling.tiles), ("KB", tiling.keys),
                  ("STAGES", tiling.stages), ("QSMEM", tiling.shared_queries), ("SUB", tiling.sub or tiling.keys)],
        grid=(-(-rows // tiling.rows) * 32 * tiling.warps, 1, kv_heads),
        threadgroup=(32 * tiling.warps, 1, 1),
        output_shapes=[queries.shape],
        output_dtypes=[queries.dtype],
    )[0]


def reference(queries: mx.array, prefix_keys: mx.array, prefix_values: mx.array, tail_keys: mx.array,
              tail_values: mx.array, token_rows: mx.array, token_positions: mx.array, row_starts: mx.array,
              scale: float) -> mx.array:
    """``packed_attention`` in plain operations (float32 levels, merged by log-sum-exp): the prefix level
    for all tokens stacked, then each token against its own row's tail gathered (columns from its row's
    start up to its own position)."""
    prefix = prefix_partial(queries, prefix_keys, prefix_values, scale)
    columns = mx.arange(tail_keys.shape[2])
    visible = (columns[None] >= row_starts[token_rows][:, None]) & (columns[None] <= token_positions[:, None])
    tail = tail_partial(queries, tail_keys[token_rows], tail_values[token_rows], scale, visible[:, None, None, :])
    return merge([prefix, tail], None, queries.dtype)


def self_check(heads: int = 8, kv_heads: int = 2, dim: int = 128) -> float:
    """Max |kernel - reference| in bf16 on rows of 1-70 tokens (a block's tokens spanning several rows, a
    row's tokens spanning blocks), left-padded tails whose reads start before, at and after the chunk's
    columns, tails that are strided views of a longer buffer, a prefix of several staged blocks and a
    partial one, and enough tokens for one split."""
    lengths = [70, 1, 33, 9, 64, 2, 50, 17, 41, 65, 3, 28] * 4
    width = max(lengths)
    span, prefix_length = width + 11, 333
    batch = len(lengths)
    for _ in range(8):  # more tokens until the prefix runs in one split (a 128-head model: 5 doublings)
        if fits(mx.zeros((sum(lengths), heads, 1, dim), mx.bfloat16),
                mx.zeros((1, kv_heads, prefix_length, dim), mx.bfloat16), mx.zeros((1,), mx.bfloat16)):
            break
        lengths, batch = lengths * 2, batch * 2
    else:
        raise ValueError(f"the packed tails' kernel does not take {heads} query / {kv_heads} KV heads of {dim}")
    rows = [b for b, n in enumerate(lengths) for _ in range(n)]
    positions = [span - n + i for n in lengths for i in range(n)]
    starts = [(span - n - b % 3 * 4) if b % 4 else 0 for b, n in enumerate(lengths)]
    q = mx.random.normal((len(rows), heads, 1, dim)).astype(mx.bfloat16)
    pk, pv = (mx.random.normal((1, kv_heads, prefix_length, dim)).astype(mx.bfloat16) for _ in range(2))
    buffer = mx.random.normal((2, batch, kv_heads, span + 24, dim)).astype(mx.bfloat16)
    tk, tv = buffer[0, :, :, :span], buffer[1, :, :, :span]
    args = (q, pk, pv, tk, tv, mx.array(rows, mx.int32), mx.array(positions, mx.int32), mx.array(starts, mx.int32),
            dim**-0.5)
    got = packed_attention(*args).astype(mx.float32)
    want = reference(*args).astype(mx.float32)
    return mx.abs(got - want).max().item()
