"""Tensors of ``.mlxkv`` files loaded by MLX itself: a safetensors view over pieces of real files.

``mx.load`` of a safetensors stream is MLX's own fast path from bytes to an
array: it allocates the result where the device wants it and copies the bytes
in (on CUDA: a host buffer, then one copy to the device's memory; measured in
docs/benchmarks.md against filling fresh unified-memory arrays on the host,
whose first touch bounded the restore). ``SafetensorsView`` is a read-only
file object whose bytes are a safetensors header followed by the named pieces
of other files, so no byte is staged or copied by Python: each of MLX's reads
lands in MLX's buffer straight from the page cache, split across a thread
pool when one is given (``os.preadv`` releases the GIL).

The view never raises inside MLX's read (an exception there would cross
MLX's evaluation): a short or failed read is zero-filled and named in
``short``, which the caller checks after the load.
"""

from __future__ import annotations

import io
import json
import os
import struct
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass

import mlx.core as mx

from mlxq.store.mlxkv import DTYPES

# The width-preserving safetensors name MLX loads each dtype as; float64 has none, so it travels as U64.
_ST_NAMES = {"bool_": "BOOL", "uint8": "U8", "uint16": "U16", "uint32": "U32", "uint64": "U64", "int8": "I8",
             "int16": "I16", "int32": "I32", "int64": "I64", "float16": "F16", "bfloat16": "BF16",
             "float32": "F32", "float64": "U64"}
READ_CHUNK = 4 << 20  # bytes per thread-pool read: large and sequential, enough of them to spread
READ_THREADS = max(1, min(8, os.cpu_count() or 1))  # H200 host: 8 threads 5.9 GB/s, one 3.2; 16 no faster


def process_pool(threads: int, name: str) -> Callable[[], ThreadPoolExecutor]:
    """A getter of one process-wide thread pool, made on first use (under a lock: two restores may
    start on two threads at once)."""
    lock, made = threading.Lock(), []

    def get() -> ThreadPoolExecutor:
        with lock:
            if not made:
                made.append(ThreadPoolExecutor(threads, thread_name_prefix=name))
            return made[0]

    return get


read_pool = process_pool(READ_THREADS, "mlxq-load")  # the process's load threads


@dataclass(frozen=True)
class TensorPiece:
    """One tensor's bytes inside a real file."""

    name: str
    fd: int  # an open file, read with os.preadv (no shared offset)
    offset: int  # bytes from the file's start
    nbytes: int
    shape: tuple[int, ...]
    dtype: str  # a name of mlxkv.DTYPES


class SafetensorsView(io.RawIOBase):
    """A safetensors file made of ``pieces`` (in order), for ``mx.load(view, format="safetensors")``."""

    def __init__(self, pieces: Sequence[TensorPiece], pool: Executor | None = None):
        super().__init__()
        header, at, self._spans = {}, 0, []
        for piece in pieces:
            header[piece.name] = {"dtype": _ST_NAMES[piece.dtype], "shape": list(piece.shape),
                                  "data_offsets": [at, at + piece.nbytes]}
            self._spans.append((at, piece))
            at += piece.nbytes
        body = json.dumps(header, separators=(",", ":")).encode()
        self._head = struct.pack("<Q", len(body)) + body
        self._size = len(self._head) + at
        self._pos = 0
        self._pool = pool
        self.short: list[str] = []  # pieces a read found shorter than their record

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, buffer) -> int:
        view = memoryview(buffer).cast("B")
        n, head = len(view), len(self._head)
        if self._pos < head:
            n = min(n, head - self._pos)
            view[:n] = self._head[self._pos : self._pos + n]
        else:
            self._read_piece(view, self._pos - head)
        self._pos += n
        return n

    def _read_piece(self, view: memoryview, at: int) -> None:
        """MLX reads one tensor at a time, from its start: ``view`` lies inside one piece."""
        if not len(view):
            return
        for start, piece in self._spans:
            if start <= at < start + piece.nbytes:
                if at + len(view) > start + piece.nbytes:  # past its piece: never another tensor's bytes
                    self.short.append(piece.name)
                    view[:] = bytes(len(view))
                    return
                at = piece.offset + at - start
                break
        else:
            self.short.append(f"offset {at}")
            view[:] = bytes(len(view))
            return
        fd = piece.fd

        def read(lo: int) -> bool:
            return _read_fully(fd, view[lo : lo + READ_CHUNK], at + lo)

        chunks = range(0, len(view), READ_CHUNK)
        done = list(self._pool.map(read, chunks)) if self._pool is not None and len(chunks) > 1 \
            else [read(lo) for lo in chunks]
        if not all(done):
            self.short.append(piece.name)


def _read_fully(fd: int, into: memoryview, at: int) -> bool:
    """Fill ``into`` from ``at``; False (the rest zero-filled) if the file ends first or cannot be read."""
    done = 0
    while done < len(into):
        try:
            got = os.preadv(fd, [into[done:]], at + done)
        except OSError:  # an I/O error must not cross MLX's evaluation: the piece is reported short
            got = 0
        if got <= 0:
            into[done:] = bytes(len(into) - done)
            return False
        done += got
    return True


def load_pieces(pieces: Sequence[TensorPiece], pool: Executor | None = None,
                stream=None) -> tuple[dict[str, mx.array], list[str]]:
    """The pieces as evaluated MLX arrays on ``stream`` (default: the default device's), and the names of
    those whose file ended early (their arrays hold zeros past the end)."""
    if not pieces:
        return {}, []
    view = SafetensorsView(pieces, pool)
    loaded = mx.load(view, format="safetensors", stream=stream)
    arrays = {}
    for piece in pieces:
        array = loaded[piece.name]
        if piece.dtype == "float64":
            array = array.view(DTYPES["float64"])
        arrays[piece.name] = array
    return arrays, view.short
