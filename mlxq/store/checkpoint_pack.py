"""A checkpoint link's tensors packed in a few buffers, and how they reach host memory.

On the CUDA backend an array lives in device memory until the host first
reads it; that first read (MLX's buffer protocol) moves the whole buffer to
unified memory with a synchronous copy made holding the GIL. Made by the
writer thread, it held the engine thread (which needs the GIL to build its
next step) once per tensor; made by the engine thread, it stalled decoding
for the copy. Packed, a link's tensors are copied on the device into a few
byte buffers of bounded size (the copy the writer needs anyway: the live
caches go on being updated in place). The batch lane only queues that copy
(``stage_packs(host_side=True)``); the writer, when it reads a Pack, first
has MLX's CPU stream read one byte of it (``Pack.host``): MLX's CPU worker
thread waits for the device copy and moves the whole buffer to host memory
holding no GIL, while the writer waits for it without the GIL; then the
writer reads the buffer in place. The engine thread never takes part in the
move: had it queued the CPU stream's read itself, in the same evaluation as
the copy, MLX would have made it wait on the host, in that evaluation, for
the device to finish everything queued before the copy (a cross-device
fence), the decode step in flight included. The serial lane evaluates and
moves at once (``pack_layers``). On the CPU and Metal a buffer is read in
place.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import mlx.core as mx


@dataclass(eq=False)
class Pack:
    """The bytes of many arrays, one after the other, in one uint8 array (evaluated, and on the host,
    once ``host`` was called)."""

    flat: mx.array
    host_side: bool = False  # CUDA: the host reads it through MLX's CPU stream (see above)
    _host: memoryview | None = field(default=None, repr=False)
    _moving: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def nbytes(self) -> int:
        return self.flat.nbytes

    @property
    def on_host(self) -> bool:
        return self._host is not None

    @property
    def arrays(self) -> list[mx.array]:
        """What evaluating the Pack on the device takes: its bytes (the move to the host comes later)."""
        return [self.flat]

    def host(self) -> memoryview:
        """The whole buffer on the host (the first call waits for its copy and its move there). Any
        thread; one moves it (two CPU workers moving one buffer at once would each free the other's)."""
        with self._moving:
            if self._host is None:
                if self.host_side:
                    mx.eval(_read_on_cpu_stream(self.flat))  # no GIL held: MLX's CPU worker moves the buffer
                self._host = memoryview(self.flat).cast("B")
            return self._host


@dataclass(eq=False, slots=True)
class PackedTensor:
    """One array inside a Pack: what a writer needs of an array (nbytes, shape, dtype, its bytes). Not
    changed once made; not frozen because a frozen dataclass sets each field through ``object.__setattr__``
    (the batch lane makes 64 per row of an 8B model at each publish, on the engine thread)."""

    pack: Pack
    offset: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: mx.Dtype

    def host_bytes(self) -> memoryview:
        return self.pack.host()[self.offset : self.offset + self.nbytes]

    def array(self) -> mx.array:
        """An array of its own holding the tensor (a copy: the caller may update it in place). A host-side
        Pack is moved first: the writer may move it at any time, and a device read of its old buffer then
        would read freed memory."""
        if self.pack.host_side:
            self.pack.host()
        part = self.pack.flat[self.offset : self.offset + self.nbytes]
        return mx.array(part.view(self.dtype).reshape(self.shape))


def stage_packs(layers: list, max_pack_bytes: int | None = None, host_side: bool = False
                ) -> tuple[list, list[Pack]]:
    """Encoded layers [(kind, meta, [(name, array)])] with their arrays copied into Packs of at most
    ``max_pack_bytes`` each (an array larger than that gets a Pack of its own; None: one Pack), and
    those Packs, not evaluated yet: the copies are only described here. ``host_side``: on CUDA each
    Pack is brought to host memory by MLX's CPU stream (see above)."""
    groups: list[list[mx.array]] = [[]]
    size = 0
    for _, _, named in layers:
        for _, a in named:
            if not a.nbytes:
                continue
            if groups[-1] and max_pack_bytes is not None and size + a.nbytes > max_pack_bytes:
                groups.append([])
                size = 0
            groups[-1].append(a)
            size += a.nbytes
    packs = [host_side_pack(_flat(group), host_side) for group in groups]
    out, pack_index, offset = [], 0, 0
    for kind, meta, named in layers:
        packed = []
        for name, a in named:
            if a.nbytes and offset == packs[pack_index].nbytes:
                pack_index, offset = pack_index + 1, 0
            packed.append((name, PackedTensor(packs[pack_index], offset, a.nbytes, tuple(a.shape), a.dtype)))
            offset += a.nbytes
        out.append((kind, meta, packed))
    return out, packs


def _flat(arrays: list[mx.array]) -> mx.array:
    """The arrays' bytes one after the other, always a copy (one array alone is copied too): the live
    caches go on being updated in place."""
    if not arrays:
        return mx.zeros((0,), mx.uint8)
    first = arrays[0]
    if len(arrays) > 1 and all(a.shape == first.shape and a.dtype == first.dtype for a in arrays):
        # A link's K/V spans are strided slices of one shape: stacked, each is copied once, straight
        # into the buffer (flattened first, each would be copied twice, by two kernels).
        return mx.concatenate([a[None] for a in arrays]).reshape(-1).view(mx.uint8)
    parts = [a.reshape(-1).view(mx.uint8) for a in arrays]
    return mx.concatenate(parts) if len(parts) > 1 else mx.array(parts[0])


def host_side_pack(flat: mx.array, host_side: bool) -> Pack:
    """A Pack of ``flat``; when ``host_side`` and on CUDA, moved to host memory by MLX's CPU stream when
    the host first reads it (see above)."""
    return Pack(flat, bool(host_side and flat.nbytes and mx.cuda.is_available()))


def _read_on_cpu_stream(flat: mx.array) -> mx.array:
    """One byte of ``flat`` read by this thread's CPU stream: to read it, MLX's CPU worker thread waits
    for the device copy (an event, already signalled when the copy is done) and moves the whole buffer
    to host memory, in place. A gather, which reads its source's data: a view (a slice, or ``take``
    with an int index) would read nothing. The caller then reads ``flat`` itself: no second copy, and
    no second buffer of host memory (each one MLX's CUDA allocator later frees with a device-wide
    synchronizing ``cudaFree``). Call it after ``flat`` was scheduled (``mx.async_eval``): a thread
    can wait for another's scheduled arrays, never evaluate them."""
    return mx.take(flat, mx.array([0], dtype=mx.uint32), axis=0, stream=mx.cpu)


def pack_layers(layers: list) -> list:
    """Encoded layers with every array copied into one Pack, evaluated and moved to the host here (on
    the engine thread, right after the evaluation drained the device)."""
    out, packs = stage_packs(layers)
    settle(packs)
    return out


def settle(packs: list) -> None:
    """Evaluate ``packs`` and move each to the host at once, on this thread (right after the
    evaluation drained the device)."""
    mx.eval(*(a for pack in packs for a in pack.arrays))
    for pack in packs:
        pack.host()
