"""The batch lane's checkpoint copies in one pass: every staged row's new span of every layer at once.

Staging a link row by row made one view and one copy per K/V array: for
an 8B model 64 copies, each an operation the engine thread builds and
submits (about 6 ms per link on the H200, docs/benchmarks.md), and the
engine thread is what bounds a batch's decode there. When every layer is a
plain full-attention batch cache (one shape and dtype), a step's staged
rows instead go in one pass: on CUDA a kernel that reads each row's span
``[index, :, first:first + length, :]`` of up to ``CHUNK`` arrays where
they lie (strided, no copy first) and writes them one after the other,
row by row, into one buffer: one launch per ``CHUNK`` arrays (two for an 8B model) for all the
step's rows. Elsewhere the same layout comes from MLX operations (a
stacked copy per row, store/checkpoint_pack.py's).

The kernel is checked against the operations (byte for byte, on a batch
with strided arrays and rows of different spans) the first time it meets
an array count and dtype, which also compiles it (engine warm-up does that
before serving): a kernel that disagrees is never used.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache

from mlxq.store.checkpoint_pack import Pack, PackedTensor, host_side_pack

log = logging.getLogger("mlxq.checkpoints")

CHUNK = 32  # arrays per launch: each brings a pointer and its strides (88 bytes): 2.8 KiB, under CUDA's 4 KiB
_THREADS = 256


@dataclass(frozen=True)
class RowSpan:
    """One row's span to copy: ``[index, :, first:first + length, :]`` of every array."""

    index: int  # the row in the batch
    first: int  # where the span starts along the arrays' token axis
    length: int  # its tokens


def span_arrays(caches: list) -> list[mx.array] | None:
    """The batch's K and V arrays, layer by layer, when every layer is a plain full-attention batch cache
    whose rows sit alike (one left padding, one end) and whose arrays share heads, head size and dtype:
    what the one-pass copy handles; None otherwise."""
    if not caches or any(type(c) is not BatchKVCache or c.keys is None for c in caches):
        return None
    arrays = [a for c in caches for a in (c.keys, c.values)]
    first = arrays[0]
    if any(a.ndim != 4 or (a.shape[1], a.shape[3], a.dtype) != (first.shape[1], first.shape[3], first.dtype)
           for a in arrays):
        return None
    if any(c._idx != caches[0]._idx for c in caches):
        return None
    return arrays


def by_kernel(arrays: list[mx.array]) -> bool:
    """Whether ``copy_spans`` copies these arrays with the kernel (CUDA, and the kernel checked)."""
    return _kernel_checked(len(arrays), arrays[0].dtype)


def copy_spans(arrays: list[mx.array], spans: list[RowSpan], host_side: bool = False
               ) -> tuple[list[list[PackedTensor]], list[Pack]]:
    """Per span, each array's span as a PackedTensor (shape ``(1, heads, length, dim)``), and the Packs
    holding them, not evaluated yet (``host_side``: as store/checkpoint_pack.stage_packs)."""
    if by_kernel(arrays):
        return _by_kernel(arrays, spans, host_side)
    return _by_operations(arrays, spans, host_side)


def span_layers(tensors: list[PackedTensor], length: int) -> list:
    """A row's encoded layers from its tensors (keys, values, layer by layer) as a link of ``length``
    tokens holds them (store/checkpoint_links.cut_layer)."""
    return [("kv", {"offset": length}, [("keys", tensors[2 * layer]), ("values", tensors[2 * layer + 1])])
            for layer in range(len(tensors) // 2)]


def _tensor_shape(arrays: list[mx.array], span: RowSpan) -> tuple[int, ...]:
    return (1, arrays[0].shape[1], span.length, arrays[0].shape[3])


def _by_operations(arrays, spans, host_side):
    out, packs = [], []
    for span in spans:
        parts = [a[span.index : span.index + 1, :, span.first : span.first + span.length, :] for a in arrays]
        pack = host_side_pack(mx.concatenate(parts).reshape(-1).view(mx.uint8), host_side)  # one copy each
        packs.append(pack)
        out.append(_tensors_in(pack, 0, arrays, span, len(arrays)))
    return out, packs


def _tensors_in(pack: Pack, offset: int, arrays: list[mx.array], span: RowSpan, count: int) -> list[PackedTensor]:
    """``count`` tensors of ``span``'s shape, one after the other in ``pack`` from byte ``offset``."""
    shape = _tensor_shape(arrays, span)
    nbytes = shape[1] * shape[2] * shape[3] * arrays[0].itemsize
    return [PackedTensor(pack, offset + t * nbytes, nbytes, shape, arrays[0].dtype) for t in range(count)]


def _by_kernel(arrays, spans, host_side):
    """One launch per ``CHUNK`` arrays, then their outputs joined: one buffer (and one host move) for the
    step's links. Per row its tensors in array order, rows one after the other in each launch's part."""
    heads, dim, itemsize = arrays[0].shape[1], arrays[0].shape[3], arrays[0].itemsize
    views, local = _around(arrays, spans)
    parts = [_launch(views[at : at + CHUNK], local, heads, dim) for at in range(0, len(arrays), CHUNK)]
    pack = host_side_pack((mx.concatenate(parts) if len(parts) > 1 else parts[0]).view(mx.uint8), host_side)
    out: list[list[PackedTensor]] = [[] for _ in spans]
    offset = 0
    for at in range(0, len(arrays), CHUNK):
        count = min(CHUNK, len(arrays) - at)
        for tensors, span in zip(out, spans, strict=True):
            tensors += _tensors_in(pack, offset, arrays, span, count)
            offset += count * heads * span.length * dim * itemsize
    return out, [pack]


def _around(arrays: list[mx.array], spans: list[RowSpan]) -> tuple[list[mx.array], list[RowSpan]]:
    """Views of the arrays cut to the rows and tokens the spans touch, and the spans within them: what a
    launch declares it reads. MLX's CUDA backend counts each input's extent towards a graph's size and
    ends the graph (one more task in flight, which MLX's evaluation may then wait for) past 1000 Mi
    elements: 32 whole arrays of a 32-row batch are about that; one row's span a few Mi."""
    lo, hi = min(s.index for s in spans), max(s.index for s in spans) + 1
    start, end = min(s.first for s in spans), max(s.first + s.length for s in spans)
    views = [a[lo:hi, :, start:end, :] for a in arrays]
    return views, [RowSpan(s.index - lo, s.first - start, s.length) for s in spans]


_SOURCE = """
    const int64_t heads = plan[0];
    const int64_t dim = plan[1];
    const int64_t* row = plan + 2 + 4 * blockIdx.z;
    const int64_t length = row[2];
    const int64_t n = heads * length * dim;
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) {
        return;
    }
    const int64_t d = i % dim;
    const int64_t j = row[1] + (i / dim) % length;
    const int64_t h = i / (dim * length);
    const int64_t b = row[0];
    T value;
    switch (blockIdx.y) {
CASES
    }
    out[row[3] + blockIdx.y * n + i] = value;
"""
_CASE = ("    case {t}: value = a{t}[b * a{t}_strides[0] + h * a{t}_strides[1] + j * a{t}_strides[2]"
         " + d * a{t}_strides[3]]; break;")

_kernels: dict[int, object] = {}


def _kernel(count: int):
    """The copy kernel for ``count`` arrays (compiled by MLX at its first launch for a dtype)."""
    if count not in _kernels:
        cases = "\n".join(_CASE.format(t=t) for t in range(count))
        _kernels[count] = mx.fast.cuda_kernel(
            name=f"mlxq_checkpoint_spans_{count}",
            input_names=[f"a{t}" for t in range(count)] + ["plan"],
            output_names=["out"],
            source=_SOURCE.replace("CASES", cases),
            ensure_row_contiguous=False,
        )
    return _kernels[count]


def _launch(chunk: list[mx.array], spans: list[RowSpan], heads: int, dim: int) -> mx.array:
    """Every span of every array in ``chunk``, row by row, each row's arrays one after the other."""
    plan, base, longest = [heads, dim], 0, 0
    for span in spans:
        plan += [span.index, span.first, span.length, base]
        base += len(chunk) * heads * span.length * dim
        longest = max(longest, heads * span.length * dim)
    if base == 0:
        return mx.zeros((0,), dtype=chunk[0].dtype)  # nothing to copy: a launch with an empty grid fails
    return _kernel(len(chunk))(
        inputs=[*chunk, mx.array(plan, dtype=mx.int64)],
        template=[("T", chunk[0].dtype)],
        grid=(-(-longest // _THREADS) * _THREADS, len(chunk), len(spans)),
        threadgroup=(_THREADS, 1, 1),
        output_shapes=[(base,)],
        output_dtypes=[chunk[0].dtype],
    )[0]


_checked: dict[tuple[int, mx.Dtype], bool] = {}


def _kernel_checked(count: int, dtype: mx.Dtype) -> bool:
    """Whether the kernel copies ``count`` arrays of ``dtype`` (CUDA only), checked once per pair."""
    if not mx.cuda.is_available():
        return False
    key = (count, dtype)
    if key not in _checked:
        _checked[key] = _check(count, dtype)
    return _checked[key]


def _check(count: int, dtype: mx.Dtype) -> bool:
    try:
        agrees = kernel_agrees(count, dtype)
    except Exception:
        log.exception("the checkpoint copy kernel failed; copying with MLX operations")
        return False
    if agrees:
        log.info("checkpoint copy kernel checked for %d arrays of %s: in use", count, dtype)
    else:
        log.error("the checkpoint copy kernel disagrees with MLX operations; copying with them instead")
    return agrees


def kernel_agrees(count: int, dtype: mx.Dtype) -> bool:
    """The kernel's Packs, moved to the host as the batch lane moves them, equal the operations' byte for
    byte: ``count`` arrays, strided like a batch cache after rows left (a view along the token axis),
    three rows of different spans."""
    buffer = mx.random.normal((count, 4, 2, 48, 16)).astype(dtype)
    arrays = [buffer[t, :, :, 5:, :] for t in range(count)]
    spans = [RowSpan(2, 3, 17), RowSpan(0, 0, 43), RowSpan(3, 40, 1)]
    kernel, packs = _by_kernel(arrays, spans, host_side=True)
    mx.async_eval(*(a for pack in packs for a in pack.arrays))
    ops, _ = _by_operations(arrays, spans, host_side=False)
    return all(bytes(k.host_bytes()) == bytes(o.host_bytes()) and k.shape == o.shape
               for row_k, row_o in zip(kernel, ops, strict=True) for k, o in zip(row_k, row_o, strict=True))


def warm(model) -> None:
    """Compile and check the kernel for ``model``'s batch caches (engine warm-up, with checkpoints on)."""
    if not mx.cuda.is_available():
        return
    caches = make_prompt_cache(model)
    floats = (a.dtype for _, a in tree_flatten(model.parameters()) if a.dtype in (mx.bfloat16, mx.float16, mx.float32))
    dtype = next(floats, None)
    if dtype is not None and caches and all(type(c) is KVCache for c in caches):
        _kernel_checked(2 * len(caches), dtype)
