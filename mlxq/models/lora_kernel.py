"""A sibling group's LoRA update in two CUDA kernels (``mx.fast.cuda_kernel``), for the H200.

On the GPU an adapter step is host-bound: every graph node costs host time
(building it, and evaluating it: a cuBLAS matmul also queries its heuristic
on every call), whatever its size. The ops path (models/multi_lora.py) adds
per sibling group one shrink matmul (plus the mask for mixed rows) and per
layer one ``addmm``: about 15 nodes per llama block. Here a group costs two
nodes, whatever the number of siblings:

- ``shrink``: ``h = (x @ A^T) * mask`` in one kernel (``A`` row-major ``[C, D]``,
  every sibling's columns; the mask keeps each row's own adapter's columns);
- ``expand``: every sibling's ``out_m = base_m + h[:, m*R:(m+1)*R] @ B_m`` in one
  kernel with one output per sibling (the base outputs come from the base
  layers, computed as without adapters).

Both accumulate in float32 and round once, as cuBLAS does; ``self_check``
compares them with the ops path.
"""

from __future__ import annotations

import mlx.core as mx

THREADS = 256
ROWS = 8  # rows of a tile, both kernels
COLUMNS = 8  # shrink columns of a tile

_SHRINK = """
    const int N = x_shape[0];
    const int D = x_shape[1];
    const int C = a_shape[0];
    const int c0 = blockIdx.x * COLS;
    const int n0 = blockIdx.y * ROWS;
    const int t = threadIdx.x;
    float acc[ROWS][COLS];
    #pragma unroll
    for (int i = 0; i < ROWS; i++) {
        #pragma unroll
        for (int j = 0; j < COLS; j++) {
            acc[i][j] = 0.0f;
        }
    }
    for (int d = t; d < D; d += THREADS) {
        float xv[ROWS];
        #pragma unroll
        for (int i = 0; i < ROWS; i++) {
            xv[i] = n0 + i < N ? static_cast<float>(x[(int64_t)(n0 + i) * D + d]) : 0.0f;
        }
        #pragma unroll
        for (int j = 0; j < COLS; j++) {
            const float av = c0 + j < C ? static_cast<float>(a[(int64_t)(c0 + j) * D + d]) : 0.0f;
            #pragma unroll
            for (int i = 0; i < ROWS; i++) {
                acc[i][j] += xv[i] * av;
            }
        }
    }
    __shared__ float partial[THREADS / 32][ROWS * COLS];
    const int warp = t / 32;
    const int lane = t % 32;
    #pragma unroll
    for (int i = 0; i < ROWS; i++) {
        #pragma unroll
        for (int j = 0; j < COLS; j++) {
            float v = acc[i][j];
            for (int off = 16; off > 0; off /= 2) {
                v += __shfl_xor_sync(0xffffffff, v, off);
            }
            if (lane == 0) {
                partial[warp][i * COLS + j] = v;
            }
        }
    }
    __syncthreads();
    if (t < ROWS * COLS) {
        const int n = n0 + t / COLS;
        const int c = c0 + t % COLS;
        if (n < N && c < C) {
            float v = 0.0f;
            for (int w = 0; w < THREADS / 32; w++) {
                v += partial[w][t];
            }
            if (HAS_MASK) {
                v *= static_cast<float>(mask[(int64_t)n * C + c]);
            }
            h[(int64_t)n * C + c] = static_cast<T>(v);
        }
    }
"""

_EXPAND_HEADER = """
template <typename T, int ROWS>
__device__ void mlxq_lora_expand_rows(const T* h, int h_width, int first, int rank, const T* base, const T* b,
                                      T* out, int width, int j, int n0, int N) {
    for (int i = 0; i < ROWS; i++) {
        const int n = n0 + i;
        if (n >= N) {
            return;
        }
        float acc = static_cast<float>(base[(int64_t)n * width + j]);
        const T* hr = h + (int64_t)n * h_width + first;
        for (int c = 0; c < rank; c++) {
            acc += static_cast<float>(hr[c]) * static_cast<float>(b[(int64_t)c * width + j]);
        }
        out[(int64_t)n * width + j] = static_cast<T>(acc);
    }
}
"""

_EXPAND_MEMBER = """
    {
        const int width = baseM_shape[1];
        if (j < width) {
            mlxq_lora_expand_rows<T, ROWS>(h, h_width, M * rank, rank, baseM, bM, outM, width, j, n0, N);
            return;
        }
        j -= width;
    }
"""


def _expand_source(members: int) -> str:
    body = """
    const int N = h_shape[0];
    const int h_width = h_shape[1];
    const int rank = h_width / MEMBERS;
    const int n0 = blockIdx.y * ROWS;
    int j = blockIdx.x * THREADS + threadIdx.x;
"""
    for m in range(members):
        body += _EXPAND_MEMBER.replace("baseM", f"base{m}").replace("bM", f"b{m}").replace(
            "outM", f"out{m}").replace("M * rank", f"{m} * rank")
    return body


_kernels: dict = {}
_no_mask: dict = {}  # dtype -> a one-element stand-in for the mask input, made once (not a node per call)


def _shrink_kernel():
    if "shrink" not in _kernels:
        _kernels["shrink"] = mx.fast.cuda_kernel(
            name="mlxq_lora_shrink", input_names=["x", "a", "mask"], output_names=["h"], source=_SHRINK)
    return _kernels["shrink"]


def _expand_kernel(members: int):
    if members not in _kernels:
        inputs = ["h"] + [f"{kind}{m}" for m in range(members) for kind in ("base", "b")]
        _kernels[members] = mx.fast.cuda_kernel(
            name=f"mlxq_lora_expand{members}", input_names=inputs,
            output_names=[f"out{m}" for m in range(members)], source=_expand_source(members),
            header=_EXPAND_HEADER)
    return _kernels[members]


def _blocks(count: int, per_block: int) -> int:
    return (count + per_block - 1) // per_block


def shrink(x: mx.array, a: mx.array, mask: mx.array | None) -> mx.array:
    """``(x @ a.T) * mask``: x ``[N, D]``, a ``[C, D]``, mask ``[N, C]`` or None; ``[N, C]`` in x's dtype."""
    rows, columns = x.shape[0], a.shape[0]
    if mask is None and x.dtype not in _no_mask:
        _no_mask[x.dtype] = mx.zeros((1,), x.dtype)
        mx.eval(_no_mask[x.dtype])
    return _shrink_kernel()(
        inputs=[x, a, mask if mask is not None else _no_mask[x.dtype]],
        template=[("T", x.dtype), ("ROWS", ROWS), ("COLS", COLUMNS), ("THREADS", THREADS),
                  ("HAS_MASK", mask is not None)],
        grid=(_blocks(columns, COLUMNS) * THREADS, _blocks(rows, ROWS), 1), threadgroup=(THREADS, 1, 1),
        output_shapes=[(rows, columns)], output_dtypes=[x.dtype])[0]


def expand(h: mx.array, bases: list[mx.array], bs: list[mx.array]) -> list[mx.array]:
    """Every member's ``base_m + h[:, m*R:(m+1)*R] @ b_m``: h ``[N, members * R]``, base_m
    ``[N, out_m]``, b_m ``[R, out_m]``; one output per member, in h's dtype."""
    rows, members = h.shape[0], len(bases)
    width = sum(base.shape[1] for base in bases)
    return _expand_kernel(members)(
        inputs=[h] + [array for pair in zip(bases, bs, strict=True) for array in pair],
        template=[("T", h.dtype), ("ROWS", ROWS), ("THREADS", THREADS), ("MEMBERS", members)],
        grid=(_blocks(width, THREADS) * THREADS, _blocks(rows, ROWS), 1), threadgroup=(THREADS, 1, 1),
        output_shapes=[base.shape for base in bases], output_dtypes=[h.dtype] * members)


def shrink_reference(x: mx.array, a: mx.array, mask: mx.array | None) -> mx.array:
    """What ``shrink`` computes, in MLX ops."""
    h = x @ a.T
    return h if mask is None else h * mask


def expand_reference(h: mx.array, bases: list[mx.array], bs: list[mx.array]) -> list[mx.array]:
    """What ``expand`` computes, in MLX ops."""
    rank = h.shape[1] // len(bases)
    return [mx.addmm(base, h[:, m * rank : (m + 1) * rank], b) for m, (base, b) in enumerate(zip(bases, bs,
                                                                                               strict=True))]


def self_check(rows: int = 64, dtype=mx.bfloat16) -> dict[str, float]:
    """Max |kernel - ops| over an 8B-shaped q/k/v group (D 4096, 2 adapters of rank 16), relative to
    the largest output; the two differ in summation order only."""
    mx.random.seed(0)
    dim, rank, outs = 4096, 32, (4096, 1024, 1024)
    x = mx.random.normal((rows, dim)).astype(dtype)
    a = (0.05 * mx.random.normal((len(outs) * rank, dim))).astype(dtype)
    mask = mx.tile((mx.arange(rank)[None, :] < 16) == (mx.arange(rows)[:, None] % 2 == 0), (1, len(outs)))
    mask = mask.astype(dtype)
    bases = [mx.random.normal((rows, out)).astype(dtype) for out in outs]
    bs = [(0.05 * mx.random.normal((rank, out))).astype(dtype) for out in outs]
    want_h = shrink_reference(x, a, mask)

    def error(got, want):
        got, want = got.astype(mx.float32), want.astype(mx.float32)
        return (mx.abs(got - want).max() / mx.abs(want).max()).item()

    expanded = zip(expand(want_h, bases, bs), expand_reference(want_h, bases, bs), strict=True)
    return {"shrink": error(shrink(x, a, mask), want_h), "shrink_unmasked": error(shrink(x, a, None), x @ a.T),
            "expand": max(error(got, want) for got, want in expanded)}
