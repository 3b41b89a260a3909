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

The pool's concatenation is itself a copy kernel per piece: a cached burst
under ``--shared-prefix-attention auto`` gathers only its rows' own tokens
(64 pieces of a token or two each), so it launched ~4k copies of a few KB
(32 layers x keys and values x 64 pieces: 17-23 ms on the H200, "CPU and
H200: a cached burst's engine work around its prefill"). From
``MIN_SLOTTED`` up to ``SLOTS`` pieces the kernel reads them in place
instead, each one of its inputs (MLX's kernels take no array of buffers, so
a form with ``SLOTS`` inputs, the unused ones repeating the first piece),
the index naming (piece, column): one launch per layer's keys or values.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

log = logging.getLogger("mlxq.scheduler")

_THREADS = 256
SLOTS = 128  # pieces one launch reads in place (its inputs); more go through the pool's concatenation
MIN_SLOTTED = 3  # fewer pieces: the pool (one piece is the pool itself, two are one small copy more)
_COLUMN_BITS = 24  # a slotted index holds (piece << _COLUMN_BITS) | column: pieces of up to 16M tokens


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
    index = _Index(_column_index(prefixes, offsets, padding, capacity), [p.width for p in pieces])
    return [tuple(_gather([p.spans[layer][i] for p in pieces], index) for i in (0, 1))
            for layer in range(len(pieces[0].spans))]


class _Index:
    """The column index on the host, and its device forms, each made once for every layer."""

    def __init__(self, columns: np.ndarray, widths: list[int]):
        self.columns = columns
        self.widths = widths  # per piece, in pool order: its tokens (every layer alike)
        self._made: dict[tuple, mx.array] = {}

    def slotted(self) -> tuple[mx.array, mx.array]:
        """[rows, capacity] int32 of (piece << _COLUMN_BITS) | column within it (-1 for zeros), and
        [SLOTS] int32 of the pieces' widths, as the slotted kernel reads them."""
        if ("slotted",) not in self._made:
            starts = np.cumsum([0, *self.widths[:-1]])
            piece = np.searchsorted(starts, self.columns, side="right") - 1
            own = self.columns - starts[np.maximum(piece, 0)]
            coded = np.where(self.columns < 0, -1, (piece << _COLUMN_BITS) | own).astype(np.int32)
            widths = np.zeros(SLOTS, np.int32)
            widths[: len(self.widths)] = self.widths
            self._made[("slotted",)] = mx.array(coded)
            self._made[("widths",)] = mx.array(widths)
        return self._made[("slotted",)], self._made[("widths",)]

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


def _gather(parts: list[mx.array], index: _Index) -> mx.array:
    """One layer's keys or values: ``parts`` are its pieces' arrays in pool order."""
    first = parts[0]
    if _kernel_applies(first) and _kernel_checked(first.dtype, first.shape[3]):
        if MIN_SLOTTED <= len(parts) <= SLOTS and _slotted_checked(first.dtype, first.shape[3]):
            return _by_slots(parts, index)
        pool = _pool(parts)
        return _by_kernel(pool, index) if _kernel_applies(pool) else _by_take(pool, index)
    return _by_take(_pool(parts), index)


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

# The same copy reading each piece where it lies: the index names (piece, column), a switch picks the
# piece's input (one per slot, generated), its width gives the head's stride.
_SLOTTED_SOURCE = """
    const int plane = blockIdx.y;
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    const int heads = sizes[0];
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
        const int piece = src >> COLUMN_BITS;
        const int column = src & ((1 << COLUMN_BITS) - 1);
        const uint4* base;
        switch (piece) {
%s
        default: base = reinterpret_cast<const uint4*>(p0);
        }
        value = base[((size_t)h * widths[piece] + column) * WORDS + w];
    }
    reinterpret_cast<uint4*>(out)[(size_t)plane * capacity * WORDS + i] = value;
"""

_kernel = None
_slotted_kernel = None


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


def _by_slots(parts: list[mx.array], index: _Index) -> mx.array:
    """The copy kernel reading each of ``parts`` (up to SLOTS) in place: no pool concatenated."""
    global _slotted_kernel
    if _slotted_kernel is None:
        cases = "\n".join(f"        case {k}: base = reinterpret_cast<const uint4*>(p{k}); break;"
                          for k in range(SLOTS))
        _slotted_kernel = mx.fast.cuda_kernel(
            name="mlxq_prefix_gather_slotted", input_names=[*(f"p{k}" for k in range(SLOTS)), "columns", "widths",
                                                            "sizes"],
            output_names=["out"], source=_SLOTTED_SOURCE % cases, ensure_row_contiguous=True)
    first = parts[0]
    _, heads, _, dim = first.shape
    rows, capacity = index.columns.shape
    words = dim * first.dtype.size // 16
    columns, widths = index.slotted()
    inputs = [*parts, *([first] * (SLOTS - len(parts))), columns, widths, index.sizes(heads, 0)]
    return _slotted_kernel(inputs=inputs, template=[("WORDS", words), ("COLUMN_BITS", _COLUMN_BITS)],
                           grid=(-(-capacity * words // _THREADS) * _THREADS, rows * heads, 1),
                           threadgroup=(_THREADS, 1, 1), output_shapes=[(rows, heads, capacity, dim)],
                           output_dtypes=[first.dtype])[0]


_checked: dict[tuple[mx.Dtype, int], bool] = {}
_slotted_ok: dict[tuple[mx.Dtype, int], bool] = {}


def _slotted_checked(dtype: mx.Dtype, dim: int) -> bool:
    """Whether the slotted kernel gathers as ``take`` does (checked once per dtype and width; one that
    fails or does not build leaves the pool's form in use)."""
    key = (dtype, dim)
    if key not in _slotted_ok:
        try:
            _slotted_ok[key] = kernel_agrees(dtype, dim, slotted=True)
        except Exception:
            log.exception("the slotted prefix gather kernel failed; gathering from a concatenated pool")
            _slotted_ok[key] = False
        if not _slotted_ok[key]:
            log.error("the slotted prefix gather kernel disagrees with MLX's take; using the pool")
    return _slotted_ok[key]


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
            _slotted_checked(dtype, dim)  # compiled now too (the warm-up's placed tails come here first)
        else:
            log.error("the prefix gather kernel disagrees with MLX's take; using take")
    return _checked[key]


def kernel_agrees(dtype: mx.Dtype, dim: int = 64, slotted: bool = False) -> bool:
    """Kernel and ``take`` equal bit for bit: five rows from three pieces, one row shorter than its
    pieces, one skipping the first piece whole, one reading the last piece alone (``slotted``: the
    form reading the pieces in place)."""
    a, b, c = (mx.random.normal((1, 2, n, dim)).astype(dtype) for n in (37, 5, 3))
    first, second, third = Piece([(a, a)]), Piece([(b, b)]), Piece([(c, c)])
    prefixes = [RowPrefix((first, second), 42), RowPrefix((first,), 30), RowPrefix((second,), 5),
                RowPrefix((first, second), 3, skip=38), RowPrefix((first, third), 2, skip=37)]
    pieces, offsets = _distinct(prefixes)
    index = _Index(_column_index(prefixes, offsets, [0, 14, 40, 2, 60], 64), [p.width for p in pieces])
    parts = [p.spans[0][0] for p in pieces]
    kernel = _by_slots(parts, index) if slotted else _by_kernel(_pool(parts), index)
    return bool(mx.array_equal(kernel, _by_take(_pool(parts), index)).item())
