"""Buffers the host has read, let go only where MLX's cache is cleared right after (CUDA).

On the CUDA backend a buffer the host reads becomes managed memory whose
pages then sit in host memory (store/checkpoint_pack.py). Freed, MLX's
allocator keeps it in its one buffer cache and hands it to the next
allocation of about its size, a device allocation included: the next
checkpoint copy of the same span length takes it, and the device then
faults every page of it back, in the decode stream, one link after the
other. So a checkpoint link's buffers, once on disk, wait here; the engine
thread lets them go right before it clears MLX's cache (the scheduler's
periodic ``mx.clear_cache()``), which then frees them instead of keeping
them for reuse. More than ``MAX_HELD_BYTES`` held: the engine lets them go
and clears the cache at once. Elsewhere (the CPU, Metal: one memory) they
are let go at once.
"""

from __future__ import annotations

import threading

MAX_HELD_BYTES = 4 * 2**30  # host memory held between cache clears: ~128 links of an 8B model


class SpentBuffers:
    def __init__(self, hold: bool | None = None) -> None:
        if hold is None:
            import mlx.core as mx

            hold = mx.cuda.is_available()
        self.hold = hold
        self._held: list = []
        self._bytes = 0
        self._lock = threading.Lock()

    def add(self, buffers: object, nbytes: int) -> None:
        """Hold ``buffers`` (anything keeping MLX arrays alive) until ``release``; any thread."""
        if not self.hold:
            return
        with self._lock:
            self._held.append(buffers)
            self._bytes += nbytes

    @property
    def nbytes(self) -> int:
        return self._bytes

    def over_cap(self) -> bool:
        return self._bytes > MAX_HELD_BYTES

    def release(self) -> int:
        """Let every held buffer go (call right before ``mx.clear_cache()``, on the thread that clears it);
        the bytes let go."""
        with self._lock:
            held, self._held = self._held, []
            nbytes, self._bytes = self._bytes, 0
        del held
        return nbytes
