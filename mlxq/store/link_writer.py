"""Checkpoint links hashed and written by a helper process, so the writer thread barely needs the GIL.

The checkpoint writer thread runs beside the engine thread, which bounds a
batch's decode speed on a GPU and needs the GIL to build each step. Hashing
and writing a link in the thread takes the GIL back once per tensor (64 per
link of an 8B model; python-xxhash even holds it while it hashes), and each
time the engine thread may wait for it. Here the thread copies the link's
bytes into shared memory (one copy per contiguous run of tensors, numpy
releases the GIL for it), sends the file's plan to a helper process and
waits for its answer holding no GIL; the helper (``python -m
mlxq.store.link_writer``: numpy and xxhash, no MLX) hashes every tensor,
writes the file exactly as ``mlxkv.write_file`` does (tmp, fsync, rename,
directory fsync) and answers ok or the OSError's errno and text. So a link
costs the engine thread a handful of GIL hand-offs instead of ~130.

The shared memory is a memfd made before the helper starts (inherited by
it, sized to the largest link the store queues: pages are only allocated
where written), so nothing is left behind when either process dies; the
helper exits when the server's end of its pipe closes or the server dies
(``PR_SET_PDEATHSIG``). Linux only (``os.memfd_create``); elsewhere, or
when the helper cannot start, the thread writes itself (``write_file``).
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import struct
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np

from mlxq.store import xxh3

# The .mlxkv layout (store/mlxkv.py, which imports MLX: the helper does not); checked equal at first use.
MAGIC = b"MLXQKV\r\n"
FORMAT_VERSION = 2
ALIGN = 16 * 1024
_PREAMBLE = struct.Struct("<8sII32s")
_LENGTH = struct.Struct("<Q")
_IOV_MAX = 512
_RELEASE_BYTES = 64 * 2**20  # a link larger than this gives its shared pages back once written


def available() -> bool:
    return sys.platform.startswith("linux") and hasattr(os, "memfd_create")


class LinkWriterProcess:
    """The server's side: ``write`` a link file through the helper (any one thread at a time)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes  # the largest link: the shared memory's size
        self._proc: subprocess.Popen | None = None
        self._fd = self._requests = self._replies = -1
        self._view: np.ndarray | None = None
        self._lock = threading.Lock()

    def __del__(self) -> None:
        for fd in (self._requests, self._replies, self._fd):  # the helper sees its pipe close and exits
            if fd >= 0:
                os.close(fd)

    def write(self, path: Path, header: dict, layers: list) -> None:
        """Write the link file (``layers``' tensors: PackedTensors, store/checkpoint_pack.py); OSError when
        the helper or the disk fails (the caller drops the link)."""
        from mlxq.store import mlxkv

        plan = mlxkv._Plan(header, layers)
        runs = _runs(plan.arrays)
        nbytes = sum(size for _, _, size, _ in runs)
        if nbytes > self.max_bytes:
            raise OSError(f"a checkpoint link of {nbytes} bytes exceeds the writer's {self.max_bytes}")
        with self._lock:
            self._start()
            parts, at = [None] * len(plan.tensors), 0
            for pack, offset, size, members in runs:
                if size:
                    src = np.frombuffer(pack.host(), dtype=np.uint8, count=size, offset=offset)
                    np.copyto(self._view[at : at + size], src)  # numpy releases the GIL for the copy
                for i, tensor in members:
                    parts[i] = [plan.data_start + plan.tensors[i]["offset"], at + tensor.offset - offset,
                                tensor.nbytes]
                at += size
            reply = self._call({"path": str(path), "header": plan.full, "header_len": plan.header_len,
                                "data_start": plan.data_start, "end": plan.end, "parts": parts,
                                "release": at if at > _RELEASE_BYTES else 0})
        if "error" in reply:
            raise OSError(reply.get("errno") or 0, reply["error"])

    def _start(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            return
        self.close()
        from mlxq.store import mlxkv

        assert (MAGIC, FORMAT_VERSION, ALIGN, _PREAMBLE.format) == (
            mlxkv.MAGIC, mlxkv.FORMAT_VERSION, mlxkv.ALIGN, mlxkv._PREAMBLE.format), "the .mlxkv layout changed"
        self._fd = os.memfd_create("mlxq-checkpoint-links")
        os.ftruncate(self._fd, max(self.max_bytes, 1))
        self._view = np.frombuffer(mmap.mmap(self._fd, max(self.max_bytes, 1)), dtype=np.uint8)
        requests_r, self._requests = os.pipe()
        self._replies, replies_w = os.pipe()
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "mlxq.store.link_writer", str(requests_r), str(replies_w), str(self._fd),
                 str(max(self.max_bytes, 1)), str(os.getpid())],
                pass_fds=(requests_r, replies_w, self._fd), stdin=subprocess.DEVNULL, close_fds=True)
        finally:
            os.close(requests_r)
            os.close(replies_w)

    def _call(self, message: dict) -> dict:
        body = json.dumps(message, separators=(",", ":")).encode()
        try:
            _write_all(self._requests, _LENGTH.pack(len(body)) + body)
            reply = _read_message(self._replies)
        except OSError as exc:
            self.close()
            raise OSError(f"the checkpoint link writer process is gone ({exc})") from None
        if reply is None:
            self.close()
            raise OSError("the checkpoint link writer process ended")
        return reply

    def close(self) -> None:
        """Stop the helper (it exits when its pipe closes) and let the shared memory go."""
        for fd in (self._requests, self._replies, self._fd):
            if fd >= 0:
                os.close(fd)
        self._fd = self._requests = self._replies = -1
        self._view = None
        if self._proc is not None:
            try:
                self._proc.wait(5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None


def _runs(tensors: list) -> list:
    """The tensors (file order) as runs adjacent in one Pack: (pack, offset, bytes, [(index, tensor)])."""
    runs: list = []
    for i, t in enumerate(tensors):
        last = runs[-1] if runs else None
        if last is not None and last[0] is t.pack and last[1] + last[2] == t.offset:
            last[2] += t.nbytes
            last[3].append((i, t))
        else:
            runs.append([t.pack, t.offset, t.nbytes, [(i, t)]])
    return [tuple(run) for run in runs]


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _read_exactly(fd: int, n: int) -> bytes | None:
    chunks, left = [], n
    while left:
        chunk = os.read(fd, left)  # releases the GIL while it waits
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _read_message(fd: int) -> dict | None:
    head = _read_exactly(fd, _LENGTH.size)
    if head is None:
        return None
    body = _read_exactly(fd, _LENGTH.unpack(head)[0])
    return None if body is None else json.loads(body)


# --- the helper process ---------------------------------------------------------------
def _encode_header(header: dict) -> bytes:
    return json.dumps(header, separators=(",", ":"), sort_keys=True).encode()


def _write_file(message: dict, shared: memoryview) -> None:
    """The link file of ``message``, as mlxkv.write_file writes it."""
    header, parts = message["header"], message["parts"]
    tensors = [t for layer in header["layers"] for t in layer["tensors"]]
    path = Path(message["path"])
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            pieces = []
            for record, (offset, at, nbytes) in zip(tensors, parts, strict=True):
                data = shared[at : at + nbytes]
                record["xxh3"] = xxh3.hexdigest(data)
                if nbytes:
                    pieces.append((offset, data))
            _write_pieces(f.fileno(), pieces)
            f.truncate(message["data_start"] + message["end"])
            body = _encode_header(header)
            if len(body) != message["header_len"]:
                raise ValueError("the header changed length")
            f.seek(0)
            f.write(_PREAMBLE.pack(MAGIC, FORMAT_VERSION, len(body), xxh3.hexdigest(body).encode()))
            f.write(body)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _write_pieces(fd: int, pieces: list) -> None:
    i = 0
    while i < len(pieces):
        at, buffers, end = pieces[i][0], [], pieces[i][0]
        while i < len(pieces) and len(buffers) < _IOV_MAX:
            offset, data = pieces[i]
            if offset != end:
                if offset - end > ALIGN:
                    break
                buffers.append(memoryview(bytes(offset - end)))
                end = offset
            buffers.append(data)
            end += data.nbytes
            i += 1
        while buffers:
            done = os.pwritev(fd, buffers, at)
            if done <= 0:
                raise OSError("pwritev wrote nothing")
            at += done
            while buffers and done >= buffers[0].nbytes:
                done -= buffers[0].nbytes
                buffers.pop(0)
            if buffers and done:
                buffers[0] = buffers[0][done:]


def _die_with(parent: int) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG, SIGKILL
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:
        os._exit(0)


def main(argv: list[str]) -> None:
    requests, replies, memfd, size, parent = (int(a) for a in argv)
    _die_with(parent)
    region = mmap.mmap(memfd, size)
    shared = memoryview(region)
    while (message := _read_message(requests)) is not None:
        try:
            _write_file(message, shared)
            reply: dict = {"ok": True}
        except OSError as exc:
            reply = {"errno": exc.errno, "error": str(exc)}
        except Exception as exc:  # a bug: the server logs it and drops the link
            reply = {"errno": None, "error": f"{type(exc).__name__}: {exc}"}
        if message.get("release"):
            region.madvise(mmap.MADV_REMOVE, 0, message["release"])
        body = json.dumps(reply).encode()
        _write_all(replies, _LENGTH.pack(len(body)) + body)


if __name__ == "__main__":
    main(sys.argv[1:])
