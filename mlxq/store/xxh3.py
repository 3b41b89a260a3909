"""xxh3-128 of a buffer without holding the GIL (the same digest as ``xxhash.xxh3_128_hexdigest``).

python-xxhash holds the GIL while it hashes (its one-shot functions and
``update`` alike: 64 MiB takes ~8 ms, and another thread running Python
waits that long). A writer thread hashing checkpoint links beside the
engine thread would take the GIL from it for every tensor it hashes. The
xxhash extension exports the C library's ``XXH3_128bits_withSeed``; called
through ctypes, which releases the GIL for the call, the hash runs on
another core while the engine thread goes on. Where the symbol is missing
or its digest disagrees with python-xxhash's on a sample, python-xxhash
hashes (GIL held, same digest). ``Hasher`` does the same for a digest fed
in parts (a restore's checksum threads hash each tensor as they read it),
through the library's streaming state.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import xxhash

__all__ = ["GIL_FREE", "Hasher", "hexdigest"]

# Below this the ctypes call's own cost (a few microseconds) outweighs the GIL it frees.
MIN_GIL_FREE_BYTES = 64 * 1024


class _Hash128(ctypes.Structure):
    _fields_ = [("low64", ctypes.c_uint64), ("high64", ctypes.c_uint64)]

    def hex(self) -> str:
        return f"{self.high64:016x}{self.low64:016x}"  # python-xxhash's byte order


@dataclass(frozen=True)
class _Streaming:
    """The library's streaming calls."""

    create: Callable
    free: Callable
    reset: Callable
    update: Callable
    digest: Callable


def _library():
    """The xxhash extension's shared library (its C functions), or None."""
    try:
        from xxhash import _xxhash

        return ctypes.CDLL(_xxhash.__file__)
    except (ImportError, OSError):
        return None


def _sample() -> np.ndarray:
    return np.frombuffer(os.urandom(3 * MIN_GIL_FREE_BYTES + 13), dtype=np.uint8)


def _flat(data) -> np.ndarray:
    """Any contiguous buffer as its bytes, without a copy."""
    view = memoryview(data)
    return np.frombuffer(view.cast("B") if view.format != "B" or view.ndim != 1 else view, dtype=np.uint8)


def _load(lib):
    """``XXH3_128bits_withSeed``, checked against python-xxhash; None if unusable."""
    fn = getattr(lib, "XXH3_128bits_withSeed", None)
    if fn is None:
        return None
    fn.restype = _Hash128
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint64]
    sample = _sample()
    return fn if fn(sample.ctypes.data, sample.nbytes, 0).hex() == xxhash.xxh3_128_hexdigest(sample) else None


def _load_streaming(lib) -> _Streaming | None:
    """The streaming calls (state, reset, update, digest), checked against python-xxhash on a sample fed in
    two parts; None if unusable."""
    try:
        calls = _Streaming(lib.XXH3_createState, lib.XXH3_freeState, lib.XXH3_128bits_reset_withSeed,
                           lib.XXH3_128bits_update, lib.XXH3_128bits_digest)
    except AttributeError:
        return None
    calls.create.restype, calls.create.argtypes = ctypes.c_void_p, []
    calls.free.restype, calls.free.argtypes = ctypes.c_int, [ctypes.c_void_p]
    calls.reset.restype, calls.reset.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.c_uint64]
    calls.update.restype = ctypes.c_int
    calls.update.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    calls.digest.restype, calls.digest.argtypes = _Hash128, [ctypes.c_void_p]
    sample = _sample()
    state = calls.create()
    if not state:
        return None
    try:
        calls.reset(state, 0)
        calls.update(state, sample[:1000].ctypes.data, 1000)
        calls.update(state, sample[1000:].ctypes.data, sample.nbytes - 1000)
        got = calls.digest(state).hex()
    finally:
        calls.free(state)
    return calls if got == xxhash.xxh3_128_hexdigest(sample) else None


_LIB = _library()
_XXH3_128 = None if _LIB is None else _load(_LIB)
GIL_FREE = _XXH3_128 is not None
_STREAMING = None if _LIB is None else _load_streaming(_LIB)


def hexdigest(data) -> str:
    """The xxh3-128 hex digest of ``data`` (any contiguous buffer); large buffers hash without the GIL."""
    view = memoryview(data)
    if _XXH3_128 is None or view.nbytes < MIN_GIL_FREE_BYTES:
        return xxhash.xxh3_128_hexdigest(view)
    flat = _flat(view)
    return _XXH3_128(flat.ctypes.data, flat.nbytes, 0).hex()  # ctypes releases the GIL for the call


class Hasher:
    """An xxh3-128 digest fed in parts (``update``, then ``hexdigest``), as ``xxhash.xxh3_128()``; parts
    hash without the GIL. Not shared between threads."""

    def __init__(self) -> None:
        self._state = _STREAMING.create() if _STREAMING is not None else None
        if self._state:
            _STREAMING.reset(self._state, 0)
        self._fallback = None if self._state else xxhash.xxh3_128()

    def update(self, data) -> None:
        if self._fallback is not None:
            self._fallback.update(memoryview(data))
            return
        flat = _flat(data)
        if flat.nbytes:
            _STREAMING.update(self._state, flat.ctypes.data, flat.nbytes)  # ctypes releases the GIL for the call

    def hexdigest(self) -> str:
        if self._fallback is not None:
            return self._fallback.hexdigest()
        return _STREAMING.digest(self._state).hex()

    def __del__(self) -> None:
        if getattr(self, "_state", None):
            _STREAMING.free(self._state)
            self._state = None
