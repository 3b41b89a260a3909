"""A CUDA restore's checksums, computed by a thread pool while the restore loads the same bytes.

Every tensor of every file a restore reads is hashed (xxh3-128, as written)
from its own read of the file, on a pool of threads: ``os.preadv`` and the
hash (store/xxh3.py: python-xxhash would hold the GIL) release the GIL, so
the hashing runs on other cores while the engine thread
loads the tensors into MLX (store/tensor_view.py) and keeps serving. Both
reads see the same bytes: a node file is never rewritten in place (a new file
is renamed over it, and an open descriptor keeps the old one). The restore's
result is used only once every checksum has matched; a mismatch or a short
file is a clean miss, as before.

Reads go through one reused scratch buffer per thread (no fresh pages to
touch, and no map of the file that a truncation could turn into SIGBUS).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field

from mlxq.store import xxh3
from mlxq.store.tensor_view import READ_CHUNK, process_pool

THREADS = max(1, min(8, os.cpu_count() or 1))  # hashing runs at ~10 GB/s per core: 8 outrun any page cache
_scratch = threading.local()
# The process's checksum threads, apart from the load's read threads, so a queue of checks never holds up a load.
verify_pool = process_pool(THREADS, "mlxq-verify")


@dataclass(frozen=True)
class TensorCheck:
    """One tensor's bytes in an open file, and the checksum they must have."""

    key: object  # what a failure names (the restore's file node)
    name: str  # for the error message
    fd: int
    offset: int  # bytes from the file's start
    nbytes: int
    xxh3: str


@dataclass
class Verification:
    """The checks of one restore, running; ``failure()`` polls, ``wait()`` blocks. ``close()`` before the
    files' descriptors are closed."""

    checks: list[TensorCheck]
    futures: list[Future] = field(default_factory=list)

    def __post_init__(self):
        self.futures = [verify_pool().submit(_check, c) for c in self.checks]

    def failure(self) -> tuple[object, str] | None:
        """The first failed check among those finished: (key, message)."""
        for future in self.futures:
            if future.done() and future.result() is not None:
                return future.result()
        return None

    def wait(self) -> tuple[object, str] | None:
        """Every check's end; the first failure in file order, or None when all matched."""
        return next((r for r in (f.result() for f in self.futures) if r is not None), None)

    def close(self) -> None:
        """Cancel the checks not started and wait for the running ones (they read the open files)."""
        for future in self.futures:
            future.cancel()
        for future in self.futures:
            if not future.cancelled():
                future.exception()


def _check(check: TensorCheck) -> tuple[object, str] | None:
    try:
        return _hash_and_compare(check)
    except Exception as exc:  # a check that cannot run fails its file: a miss, never a used restore
        return check.key, f"tensor {check.name!r} could not be checked ({type(exc).__name__})"


def _hash_and_compare(check: TensorCheck) -> tuple[object, str] | None:
    scratch = getattr(_scratch, "buffer", None)
    if scratch is None:
        scratch = _scratch.buffer = memoryview(bytearray(READ_CHUNK))
    hasher = xxh3.Hasher()
    done = 0
    while done < check.nbytes:
        want = scratch[: min(READ_CHUNK, check.nbytes - done)]
        try:
            got = os.preadv(check.fd, [want], check.offset + done)
        except OSError as exc:  # a file that cannot be read is a bad file, like a short one
            return check.key, f"tensor {check.name!r} cannot be read ({exc.strerror})"
        if got <= 0:
            return check.key, f"tensor {check.name!r} is truncated"
        hasher.update(want[:got])
        done += got
    if hasher.hexdigest() != check.xxh3:
        return check.key, f"tensor {check.name!r} fails its checksum"
    return None
