"""A checkpoint link's tensors packed in one buffer, moved to the host once, by the engine thread.

On the CUDA backend an array lives in device memory until the host first
reads it; that first read (MLX's buffer protocol) moves the whole buffer to
unified memory with a synchronous copy that waits for the device's queued
work, and it does so holding the GIL. Made by the writer thread, it held
the engine thread (which needs the GIL to build its next step) for the
device's step in flight and the copy, once per tensor (64 per row and link
for an 8B model). Packed, the engine thread copies every tensor of a link
into one byte buffer (one evaluation, the copy the writer needs anyway)
and reads it at once, while the device has nothing else queued: one move
per link that waits for no other work; the writer then reads host memory.
On the CPU and Metal the buffer is read in place.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx


@dataclass(eq=False)
class Pack:
    """The bytes of many arrays, one after the other, in one evaluated uint8 array (on the host once
    ``host`` was called)."""

    flat: mx.array
    _host: memoryview | None = field(default=None, repr=False)

    def host(self) -> memoryview:
        """The whole buffer on the host (the first call moves it there)."""
        if self._host is None:
            self._host = memoryview(self.flat).cast("B")
        return self._host


@dataclass(frozen=True, eq=False)
class PackedTensor:
    """One array inside a Pack: what a writer needs of an array (nbytes, shape, dtype, its bytes)."""

    pack: Pack
    offset: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: mx.Dtype

    def host_bytes(self) -> memoryview:
        return self.pack.host()[self.offset : self.offset + self.nbytes]

    def array(self) -> mx.array:
        """An array of its own holding the tensor (a copy: the caller may update it in place)."""
        part = self.pack.flat[self.offset : self.offset + self.nbytes]
        return mx.array(part.view(self.dtype).reshape(self.shape))


def pack_layers(layers: list) -> list:
    """Encoded layers [(kind, meta, [(name, array)])] with every array copied into one Pack, evaluated and
    moved to the host here (on the engine thread, right after the evaluation drained the device)."""
    arrays = [a for _, _, named in layers for _, a in named]
    parts = [a.reshape(-1).view(mx.uint8) for a in arrays if a.nbytes]
    # always a copy (one part alone is copied too): the live caches go on being updated in place
    flat = mx.concatenate(parts) if len(parts) > 1 else mx.array(parts[0]) if parts else mx.zeros((0,), mx.uint8)
    mx.eval(flat)
    pack, offset, out = Pack(flat), 0, []
    pack.host()
    for kind, meta, named in layers:
        packed = []
        for name, a in named:
            packed.append((name, PackedTensor(pack, offset, a.nbytes, tuple(a.shape), a.dtype)))
            offset += a.nbytes
        out.append((kind, meta, packed))
    return out

