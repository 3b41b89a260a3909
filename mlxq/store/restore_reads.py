"""How a restore's layers get from the node files into MLX arrays: two placements, one per kind of memory.

- ``HostRows`` (CPU, and Metal's unified memory): each full-attention tensor
  is allocated at its final length and every file's rows are read straight
  into place, hashed as they land: one copy from the page cache, nothing
  concatenated (fastest where host memory is the arrays' home: 9.7 GB/s
  against 3.8 for ``DeviceLoads`` on the 2-core CPU VM, docs/benchmarks.md).
- ``DeviceLoads`` (CUDA): MLX's own loader puts each file's tensors in device
  memory (store/tensor_view.py: a host buffer, then one copy), the reads split
  over threads, and the files' rows are joined on the device; every checksum
  is computed meanwhile by a thread pool (store/verify_pool.py). Filling fresh
  arrays on the host instead touches unified memory page by page, which
  bounded the restore on the H200 (docs/benchmarks.md).

Both read every tensor of every file in ``files`` and check its checksum; a
layer is ``{name: array}`` of ``end`` tokens: the base's rows, then each
file's rows up to the next file's fork point.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np
from mlx.utils import tree_map

from mlxq.store import xxh3
from mlxq.store.mlxkv import DTYPES, EntryHeader, MlxkvError, read_exactly
from mlxq.store.ssd_tree import FileNode
from mlxq.store.tensor_view import TensorPiece, load_pieces, read_pool
from mlxq.store.verify_pool import TensorCheck, Verification

if TYPE_CHECKING:
    from mlxq.store.ssd_restore import PendingRestore


class FileFailed(Exception):
    """A file of the chain is bad (truncated, or a checksum failed): the restore is a miss."""

    def __init__(self, node: FileNode, error: Exception):
        super().__init__(str(error))
        self.node, self.error = node, error


def cut(span, lo: int, hi: int):
    """Rows [lo, hi) of every tensor of a span (a view, or the tensor itself when it is all of it)."""
    return tree_map(lambda a: a if lo == 0 and a.shape[-2] == hi else a[..., lo:hi, :], span)


def part(span, k: int) -> mx.array:
    """The k-th tensor of a span in file order: keys, values; or keys.data/scales/biases, values.*."""
    flat = [a for side in span for a in (side if isinstance(side, tuple | list) else (side,))]
    return flat[k]


class LayerReads:
    """What both placements share: the files, their headers and open descriptors, the rows' layout."""

    def __init__(self, pending: PendingRestore, headers: dict[FileNode, EntryHeader], fds: dict[FileNode, int],
                 end: int):
        self.pending, self.headers, self.fds, self.end = pending, headers, fds, end
        self.files = pending.files
        self.starts = [pending.spans[node][0] for node in self.files] + [end]  # each file's rows begin here

    def check(self) -> None:
        """Raise FileFailed for a failure found so far (between layers)."""

    def finish(self) -> None:
        """Raise FileFailed unless every tensor of every file matched its checksum."""

    def close(self) -> None:
        """Stop what still runs on the files (before their descriptors close)."""


class HostRows(LayerReads):
    def whole(self, layer: int) -> dict[str, mx.array]:
        """A ring / recurrent layer: the last file's tensors as they are."""
        node = self.files[-1]
        return {t["name"]: _read_whole(self.fds[node], self.headers[node], t, node)
                for t in self.headers[node].layers[layer]["tensors"]}

    def spans(self, layer: int) -> dict[str, mx.array]:
        tensors = self.headers[self.files[-1]].layers[layer]["tensors"]
        return {t["name"]: self._assemble(layer, k, t) for k, t in enumerate(tensors)}

    def _assemble(self, layer: int, k: int, last_t: dict) -> mx.array:
        end = self.end
        shape = [*last_t["shape"][:-2], end, last_t["shape"][-1]]
        dtype = DTYPES[last_t["dtype"]]
        out = mx.zeros(shape, dtype, stream=mx.cpu)  # filled and read on the host
        mx.eval(out)
        outer, row = math.prod(shape[:-2]), shape[-1] * dtype.size
        rows = np.frombuffer(memoryview(out).cast("B"), dtype=np.uint8).reshape(outer, end * row) if out.nbytes \
            else np.zeros((outer, 0), np.uint8)
        for first, span in self.pending.base.pieces(layer):
            piece = mx.contiguous(part(span, k))
            mx.eval(piece)
            n = piece.shape[-2]
            src = np.frombuffer(memoryview(piece).cast("B"), dtype=np.uint8).reshape(outer, n * row)
            rows[:, first * row : (first + n) * row] = src
        for node in self.files:  # a file's rows past its child's fork point are overwritten by the child
            _read_rows(self.fds[node], self.headers[node], layer, k, node, self.pending.spans[node][0], rows, row,
                       end)
        return out


def _read_whole(fd: int, header: EntryHeader, t: dict, node: FileNode) -> mx.array:
    array = mx.zeros(t["shape"], DTYPES[t["dtype"]], stream=mx.cpu)  # filled and read on the host
    mx.eval(array)
    view = memoryview(array).cast("B") if t["nbytes"] else memoryview(bytearray())
    if read_exactly(fd, view, header.data_start + t["offset"]) != t["nbytes"]:
        raise FileFailed(node, MlxkvError(f"tensor {t['name']!r} is truncated"))
    if xxh3.hexdigest(view) != t["xxh3"]:
        raise FileFailed(node, MlxkvError(f"tensor {t['name']!r} fails its checksum"))
    return array


def _read_rows(fd: int, header: EntryHeader, layer: int, k: int, node: FileNode, start: int, rows: np.ndarray,
               row: int, end: int) -> None:
    """A file's k-th tensor of ``layer`` into rows [start, ...) of ``rows`` (what fits before ``end``),
    hashing every byte of it in file order."""
    t = header.layers[layer]["tensors"][k]
    span = t["shape"][-2]
    fits = min(span, end - start)
    hasher = xxh3.Hasher()
    at = header.data_start + t["offset"]
    spill = np.empty((span - fits) * row, np.uint8)
    for o in range(rows.shape[0]):
        into = rows[o, start * row : (start + fits) * row]
        for buf in (into, spill):
            if read_exactly(fd, memoryview(buf), at) != buf.nbytes:
                raise FileFailed(node, MlxkvError(f"tensor {t['name']!r} of layer {layer} is truncated"))
            hasher.update(buf)
            at += buf.nbytes
    if hasher.hexdigest() != t["xxh3"]:
        raise FileFailed(node, MlxkvError(f"tensor {t['name']!r} of layer {layer} fails its checksum"))


class DeviceLoads(LayerReads):
    def __init__(self, *args):
        super().__init__(*args)
        self.checks = Verification([
            TensorCheck(node, f"{t['name']} of layer {i}", self.fds[node], self.headers[node].data_start + t["offset"],
                        t["nbytes"], t["xxh3"])
            for node in self.files for i, layer in enumerate(self.headers[node].layers) for t in layer["tensors"]])

    def check(self) -> None:
        _raise(self.checks.failure())

    def finish(self) -> None:
        _raise(self.checks.wait())

    def close(self) -> None:
        self.checks.close()

    def whole(self, layer: int) -> dict[str, mx.array]:
        return self._load(self.files[-1], layer)

    def spans(self, layer: int) -> dict[str, mx.array]:
        loaded = {node: self._load(node, layer) for node in self.files}
        first_read = self.starts[0]
        base = [(first, span) for first, span in self.pending.base.pieces(layer) if first < first_read]
        out = {}
        for k, t in enumerate(self.headers[self.files[-1]].layers[layer]["tensors"]):
            parts = [cut(part(span, k), 0, min(first_read - first, part(span, k).shape[-2])) for first, span in base]
            parts += [cut(loaded[node][t["name"]], 0, self.starts[j + 1] - self.starts[j])
                      for j, node in enumerate(self.files)]
            out[t["name"]] = mx.contiguous(parts[0]) if len(parts) == 1 else mx.concatenate(parts, axis=-2)
        return out

    def _load(self, node: FileNode, layer: int) -> dict[str, mx.array]:
        header = self.headers[node]
        pieces = [TensorPiece(t["name"], self.fds[node], header.data_start + t["offset"], t["nbytes"],
                              tuple(t["shape"]), t["dtype"]) for t in header.layers[layer]["tensors"]]
        arrays, short = load_pieces(pieces, read_pool())
        if short:
            raise FileFailed(node, MlxkvError(f"tensor {short[0]!r} of layer {layer} is truncated"))
        return arrays


def _raise(failure: tuple[FileNode, str] | None) -> None:
    if failure is not None:
        raise FileFailed(failure[0], MlxkvError(failure[1]))


def placement() -> type[LayerReads]:
    """The reads for this process's device: device memory behind a copy (CUDA), or host memory."""
    return DeviceLoads if mx.cuda.is_available() else HostRows
