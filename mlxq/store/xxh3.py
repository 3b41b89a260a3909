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

import numpy as np
import xxhash

__all__ = ["GIL_FREE", "Hasher", "hexdigest"]

# Below this the ctypes call's own cost (a few microseconds) outweighs the GIL it frees.
MIN_GIL_FREE_BYTES = 64 * 1024


class _Hash128(ctypes.Structure):
    _fields_ = [("low64", ctypes.c_uint64), ("high64", ctypes.c_uint64)]


def _load():
    """``XXH3_128bits_withSeed`` of the xxhash extension, checked against python-xxhash; None if unusable."""
    try:
        from xxhash import _xxhash

        fn = ctypes.CDLL(_xxhash.__file__).XXH3_128bits_withSeed
    except (ImportError, OSError, AttributeError):
        return None
    fn.restype = _Hash128
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint64]
    sample = np.frombuffer(os.urandom(3 * MIN_GIL_FREE_BYTES + 13), dtype=np.uint8)
    digest = fn(sample.ctypes.data, sample.nbytes, 0)
    if f"{digest.high64:016x}{digest.low64:016x}" != xxhash.xxh3_128_hexdigest(sample):
        return None
    return fn


def _load_streaming():
    """The library's streaming calls (state, reset, update, digest), checked against python-xxhash on a
    sample fed in two parts; None if unusable."""
    if _XXH3_128 is None:
        return None
    try:
        from xxhash import _xxhash

        lib = ctypes.CDLL(_xxhash.__file__)
        calls = (lib.XXH3_createState, lib.XXH3_freeState, lib.XXH3_128bits_reset_withSeed,
                 lib.XXH3_128bits_update, lib.XXH3_128bits_digest)
    except (ImportError, OSError, AttributeError):
        return None
    create, free, reset, update, digest = calls
    create.restype, create.argtypes = ctypes.c_void_p, []
    free.restype, free.argtypes = ctypes.c_int, [ctypes.c_void_p]
    reset.restype, reset.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.c_uint64]
    update.restype, update.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    digest.restype, digest.argtypes = _Hash128, [ctypes.c_void_p]
    sample = np.frombuffer(os.urandom(3 * MIN_GIL_FREE_BYTES + 13), dtype=np.uint8)
    state = create()
    if not state:
        return None
    try:
        reset(state, 0)
        update(state, sample[:1000].ctypes.data, 1000)
        update(state, sample[1000:].ctypes.data, sample.nbytes - 1000)
        got = digest(state)
    finally:
        free(state)
    if f"{got.high64:016x}{got.low64:016x}" != xxhash.xxh3_128_hexdigest(sample):
        return None
    return calls


_XXH3_128 = _load()
GIL_FREE = _XXH3_128 is not None
_STREAMING = _load_streaming()


def hexdigest(data) -> str:
    """The xxh3-128 hex digest of ``data`` (any contiguous buffer); large buffers hash without the GIL."""
    view = memoryview(data)
    if _XXH3_128 is None or view.nbytes < MIN_GIL_FREE_BYTES:
        return xxhash.xxh3_128_hexdigest(view)
    flat = np.frombuffer(view.cast("B") if view.format != "B" or view.ndim != 1 else view, dtype=np.uint8)
    digest = _XXH3_128(flat.ctypes.data, flat.nbytes, 0)  # ctypes releases the GIL for the call
    return f"{digest.high64:016x}{digest.low64:016x}"


class Hasher:
    """An xxh3-128 digest fed in parts (``update``, then ``hexdigest``), as ``xxhash.xxh3_128()``; large parts
    hash without the GIL. Not shared between threads."""

    def __init__(self) -> None:
        self._state = None
        if _STREAMING is not None:
            self._state = _STREAMING[0]()
            if self._state:
                _STREAMING[2](self._state, 0)
        self._fallback = None if self._state else xxhash.xxh3_128()

    def update(self, data) -> None:
        view = memoryview(data)
        if self._fallback is not None:
            self._fallback.update(view)
            return
        if not view.nbytes:
            return
        flat = np.frombuffer(view.cast("B") if view.format != "B" or view.ndim != 1 else view, dtype=np.uint8)
        _STREAMING[3](self._state, flat.ctypes.data, flat.nbytes)  # ctypes releases the GIL for the call

    def hexdigest(self) -> str:
        if self._fallback is not None:
            return self._fallback.hexdigest()
        got = _STREAMING[4](self._state)
        return f"{got.high64:016x}{got.low64:016x}"

    def __del__(self) -> None:
        if getattr(self, "_state", None):
            _STREAMING[1](self._state)
            self._state = None
