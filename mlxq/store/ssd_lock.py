"""One server per SSD cache directory: an advisory lock held for the life of the process.

Two servers writing one directory would each index, evict and supersede the
other's files behind its back. The first takes ``DIR/server.lock`` with
``flock`` and writes its pid into it; a second is refused at start-up with
the holder's pid. The kernel drops the lock when the holder exits, however
it exits (``kill -9`` included), so a stale lock file is simply taken over.
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import time
from pathlib import Path

LOCK_NAME = "server.lock"

log = logging.getLogger("mlxq.ssd")


class SsdDirectoryBusy(ValueError):
    """Another live process holds the directory."""


class SsdLock:
    def __init__(self, directory: Path):
        self.path = Path(directory).expanduser() / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> SsdLock:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:  # a read-only or missing volume: the tier degrades to "not stored" anyway
            log.warning("SSD cache: cannot take %s (%s); not guarding against a second server", self.path, exc)
            return self
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown process"
            os.close(fd)
            raise SsdDirectoryBusy(f"--ssd-cache {self.path.parent} is in use by another mlxq server ({holder}); "
                                   "give each server its own directory") from None
        os.ftruncate(fd, 0)
        note = f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%dT%H:%M:%S')}"
        os.pwrite(fd, note.encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock; the file stays (taking it over is the same step)
            self._fd = None
