"""xxh3-128 of a buffer without holding the GIL (the same digest as ``xxhash.xxh3_128_hexdigest``).

python-xxhash holds the GIL while it hashes (its one-shot functions and
``update`` alike: 64 MiB takes ~8 ms, and another thread running Python
waits that long). A writer thread hashing checkpoint links beside the
engine thread would take the GIL from it for every tensor it hashes. The
xxhash extension exports the C library's ``XXH3_128bits_withSeed``; called
through ctypes, which releases the GIL for the call, the hash runs on
another core while the engine thread goes on. Where the symbol is missing
or its digest disagrees with python-xxhash's on a sample, python-xxhash
hashes (GIL held, same digest).
"""

from __future__ import annotations

import ctypes
import os

import numpy as np
import xxhash

__all__ = ["GIL_FREE", "hexdigest"]

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


_XXH3_128 = _load()
GIL_FREE = _XXH3_128 is not None


def hexdigest(data) -> str:
    """The xxh3-128 hex digest of ``data`` (any contiguous buffer); large buffers hash without the GIL."""
    view = memoryview(data)
    if _XXH3_128 is None or view.nbytes < MIN_GIL_FREE_BYTES:
        return xxhash.xxh3_128_hexdigest(view)
    flat = np.frombuffer(view.cast("B") if view.format != "B" or view.ndim != 1 else view, dtype=np.uint8)
    digest = _XXH3_128(flat.ctypes.data, flat.nbytes, 0)  # ctypes releases the GIL for the call
    return f"{digest.high64:016x}{digest.low64:016x}"
