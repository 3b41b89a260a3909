"""Every row's copy of its prefix written by one gather per layer, read straight from the pieces it is made of.

A burst of agents on a cached system prompt merges its rows for one forward
over their tails (engine/tail_placement.py). Each row's prefix is the
concatenation of the prompt cache's spans along its chain (the system
prompt's node, then a token or two of another agent's stored question):
building the merged batch row by row costs, per row and layer, the lease's
concatenation of those spans and a write of it into the batch (~4k copies
for 64 rows x 32 layers, and 97-149 ms of leases alone on the H200 for a
2.2k-token prefix). Here the distinct pieces the rows name (a node's spans,
or a row's own cache) are laid end to end once per layer (a pool a few
thousand tokens long), and one gather writes every row's prefix at its
left padding, zeros elsewhere: a column index per row and column, built
once on the host, says where each head vector comes from.

On CUDA the gather is a copy kernel moving 16-byte words (one index read per
head vector), checked against MLX's ``take`` on its first use per dtype;
elsewhere, and where it does not apply, MLX's ``take`` of whole head vectors.
The values are the pieces' own: each row holds exactly its solo prefix.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

log = logging.getLogger("mlxq.scheduler")

_THREADS = 256


@dataclass(frozen=True, eq=False)
class Piece:
    """Consecutive tokens of prefixes: ``spans[layer]`` is (keys, values), each [1, heads, tokens, dim].
    Rows naming the same ``spans`` list share these arrays (a stored node's spans, lent as they are)."""

    spans: list

    @property
    def width(self) -> int:
        return self.spans[0][0].shape[2]


@dataclass(frozen=True)
class RowPrefix:
    """What a row holds: ``length`` tokens of its pieces laid end to end, after their first ``skip``
    (a row's own tail past a prefix it reads by reference)."""

    pieces: tuple[Piece, ...]
    length: int
    skip: int = 0

    def read(self) -> tuple[list[Piece], int]:
        """The pieces the row reads and how many tokens of the first it skips: none wholly inside
        ``skip`` (a tail past a shared prefix of ~2k tokens never copies that prefix into the pool)."""
        if not self.length:
            return [], 0
        out, skip, end = [], self.skip, self.skip + self.length
        at = 0
        for piece in self.pieces:
            if at + piece.width > self.skip and at < end:
                out.append(piece)
            elif at + piece.width <= self.skip:
                skip -= piece.width
            at += piece.width
        return out, skip


def own_piece(caches: list) -> Piece:
    """A row's own solo caches as a piece (past their offset the arrays hold nothing the index reads)."""
    return Piece([(c.keys, c.values) for c in caches])


def gather_prefixes(prefixes: list[RowPrefix], padding: list[int], capacity: int) -> list[tuple[mx.array, mx.array]]:
    """Per layer (keys, values) of [rows, heads, capacity, dim]: row b's prefix at columns
    [padding[b], padding[b] + length), zeros elsewhere. At least one row names a piece."""
    pieces, offsets = _distinct(prefixes)
    if not pieces:  # every row skips all it names (tails with nothing past a shared prefix yet): zeros
        named = next(p for prefix in prefixes for p in prefix.pieces)
        return [tuple(mx.zeros((len(prefixes), a.shape[1], capacity, a.shape[3]), a.dtype) for a in span)
                for span in named.spans]
    index = _Index(_column_index(prefixes, offsets, padding, capacity))
    out = []
    for layer in range(len(pieces[0].spans)):
        keys, values = (_pool([p.spans[layer][i] for p in pieces]) for i in (0, 1))
        out.append((_gather(keys, index), _gather(values, index)))
    return out


class _Index:
    """The column index on the host, and its device forms, each made once for every layer."""

    def __init__(self, columns: np.ndarray):
        self.columns = columns
        self._made: dict[tuple, mx.array] = {}

    def device(self) -> mx.array:
        """[rows, capacity] int32, as the kernel reads it."""
        if ("device",) not in self._made:
            self._made[("device",)] = mx.array(self.columns)
        return self._made[("device",)]

    def sizes(self, heads: int, width: int) -> mx.array:
        """The kernel's (heads, pool width, capacity) as int32, once for every layer's keys and values."""
        if ("sizes", heads, width) not in self._made:
            self._made[("sizes", heads, width)] = mx.array([heads, width, self.columns.shape[1]], dtype=mx.int32)
        return self._made[("sizes", heads, width)]

    def flat(self, heads: int, width: int) -> mx.array:
        """[rows x heads x capacity] int32: each output head vector's row in the pool flattened to
        [heads x (width + 1), dim], whose last column per head is zeros (for -1)."""
        if (heads, width) not in self._made:
            columns = np.where(self.columns < 0, width, self.columns)
            flat = np.arange(heads, dtype=np.int64)[None, :, None] * (width + 1) + columns[:, None, :]
            self._made[(heads, width)] = mx.array(flat.reshape(-1).astype(np.int32))
        return self._made[(heads, width)]


def _distinct(prefixes: list[RowPrefix]) -> tuple[list[Piece], dict[int, int]]:
    """The pieces rows read in first-use order, and where each starts in the pool (by ``id`` of its spans)."""
    pieces, offsets, at = [], {}, 0
    for prefix in prefixes:
        for piece in prefix.read()[0]:
            if id(piece.spans) not in offsets:
                offsets[id(piece.spans)] = at
                pieces.append(piece)
                at += piece.width
    return pieces, offsets


def _column_index(prefixes: list[RowPrefix], offsets: dict[int, int], padding: list[int], capacity: int
                  ) -> np.ndarray:
    """[rows, capacity] int32: the pool column each output column copies, -1 for zeros."""
    index = np.full((len(prefixes), capacity), -1, dtype=np.int32)
    for row, (prefix, pad) in enumerate(zip(prefixes, padding, strict=True)):
        pieces, skip = prefix.read()
        if not pieces:
            continue
        columns = np.concatenate([np.arange(offsets[id(p.spans)], offsets[id(p.spans)] + p.width, dtype=np.int32)
                                  for p in pieces])[skip : skip + prefix.length]
        index[row, pad : pad + prefix.length] = columns
    return index


def _pool(parts: list[mx.array]) -> mx.array:
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=2)


def _gather(pool: mx.array, index: _Index) -> mx.array:
    if _kernel_applies(pool) and _kernel_checked(pool.dtype, pool.shape[3]):
        return _by_kernel(pool, index)
    return _by_take(pool, index)


def _by_take(pool: mx.array, index: _Index) -> mx.array:
    """MLX's ``take`` of head vectors from the pool with one zero column appended (for -1)."""
    _, heads, width, dim = pool.shape
    padded = mx.concatenate([pool, mx.zeros((1, heads, 1, dim), pool.dtype)], axis=2)
    rows, capacity = index.columns.shape
    taken = mx.take(padded.reshape(heads * (width + 1), dim), index.flat(heads, width), axis=0)
    return taken.reshape(rows, heads, capacity, dim)


# One thread per 16-byte word of an output head vector: blockIdx.y is the (row, head) plane, x runs over
# its columns' words. 32-bit index arithmetic, and WORDS a compile-time constant (a shift, not a
# division): the first form divided 64-bit indices four times per word and moved 300-400 GB/s.
_SOURCE = """
    const int plane = blockIdx.y;
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    const int heads = sizes[0];
    const int width = sizes[1];
    const int capacity = sizes[2];
    if (i >= capacity * WORDS) {
        return;
    }
    const int c = i / WORDS;
    const int w = i - c * WORDS;
    const int b = plane / heads;
    const int h = plane - b * heads;
    const int src = columns[b * capacity + c];
    uint4 value = make_uint4(0, 0, 0, 0);
    if (src >= 0) {
        value = reinterpret_cast<const uint4*>(pool)[((size_t)h * width + src) * WORDS + w];
    }
    reinterpret_cast<uint4*>(out)[(size_t)plane * capacity * WORDS + i] = value;
"""

_kernel = None


def _kernel_applies(pool: mx.array) -> bool:
    """CUDA, whole 16-byte words per head vector, and every index within 32 bits."""
    return mx.cuda.is_available() and pool.shape[3] * pool.dtype.size % 16 == 0 and pool.size < 2**31


def _by_kernel(pool: mx.array, index: _Index) -> mx.array:
    """The copy kernel: each thread moves one 16-byte word of one output head vector."""
    global _kernel
    if _kernel is None:
        _kernel = mx.fast.cuda_kernel(name="mlxq_prefix_gather", input_names=["pool", "columns", "sizes"],
                                      output_names=["out"], source=_SOURCE, ensure_row_contiguous=True)
    _, heads, width, dim = pool.shape
    rows, capacity = index.columns.shape
    words = dim * pool.dtype.size // 16
    return _kernel(inputs=[pool, index.device(), index.sizes(heads, width)], template=[("WORDS", words)],
                   grid=(-(-capacity * words // _THREADS) * _THREADS, rows * heads, 1),
                   threadgroup=(_THREADS, 1, 1), output_shapes=[(rows, heads, capacity, dim)],
                   output_dtypes=[pool.dtype])[0]


_checked: dict[tuple[mx.Dtype, int], bool] = {}


def _kernel_checked(dtype: mx.Dtype, dim: int) -> bool:
    """Whether the kernel gathers ``dtype`` head vectors of ``dim`` as ``take`` does, checked once per
    pair (each is its own compiled form)."""
    key = (dtype, dim)
    if key not in _checked:
        try:
            _checked[key] = kernel_agrees(dtype, dim)
        except Exception:
            log.exception("the prefix gather kernel failed; gathering with MLX's take")
            _checked[key] = False
        if _checked[key]:
            log.info("prefix gather kernel checked for %s x %d: in use", dtype, dim)
        else:
            log.error("the prefix gather kernel disagrees with MLX's take; using take")
    return _checked[key]


def kernel_agrees(dtype: mx.Dtype, dim: int = 64) -> bool:
    """Kernel and ``take`` equal bit for bit: four rows from two pieces, one row shorter than its
    pieces, one skipping the first piece whole."""
    a, b = (mx.random.normal((1, 2, n, dim)).astype(dtype) for n in (37, 5))
    first, second = Piece([(a, a)]), Piece([(b, b)])
    prefixes = [RowPrefix((first, second), 42), RowPrefix((first,), 30), RowPrefix((second,), 5),
                RowPrefix((first, second), 3, skip=38)]
    pieces, offsets = _distinct(prefixes)
    index = _Index(_column_index(prefixes, offsets, [0, 14, 40, 2], 64))
    pool = _pool([p.spans[0][0] for p in pieces])
    kernel, ops = _by_kernel(pool, index), _by_take(pool, index)
    return bool(mx.array_equal(kernel, ops).item())
