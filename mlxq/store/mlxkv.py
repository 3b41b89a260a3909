"""The ``.mlxkv`` file: one node of the SSD tier's prefix tree on disk (docs/mlxkv-format.md).

A file holds one *span*: the tokens ``[start, start + len(tokens))`` of a
prefix whose earlier tokens its *parent* file holds (named by digest; ``""``
for a root), the span's full-attention KV per layer, and, where ``snapshot``
is set, the state of every ring / recurrent layer at the span's end. Its
name is its digest: the hash chain of the whole prefix it ends (the parent's
hash state extended by the span's tokens), so the name says which prefix a
file completes however the path above it is cut into files.

Layout::

    0      magic b"MLXQKV\\r\\n" (8 bytes)
    8      format version, u32 little-endian
    12     header length H, u32
    16     header checksum, 32 ASCII hex chars (xxh3-128 of the header bytes)
    48     header: H bytes of UTF-8 JSON
    ...    tensors, each at a 16 KiB-aligned offset, raw row-major bytes

The header is sized before any tensor is written: tensor checksums are
fixed-width hex, so a placeholder header has the final length. The writer
then materializes, hashes and writes one tensor at a time (peak host
transient: one tensor), patches the header last, fsyncs, renames the
``.tmp`` into place and fsyncs the directory. A reader never sees a partial
file under the final name. 16 KiB alignment is a page on arm64 and four on
x86-64, so a tensor can be read or mapped without straddling pages of others.

Layers are encoded by cache kind (``kv``, ``rotating``, ``arrays``, ``qkv``,
``rotating-qkv``, and ``absent`` for a snapshot layer a span does not carry); a
kind this reader does not know makes the whole file unusable, never
half-restored. Reading copies each tensor once, from the file straight into
the buffer of the MLX array that keeps it.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
import xxhash

from mlxq.store import xxh3
from mlxq.store.layer_codec import ABSENT, KINDS, MlxkvError, decode_layer, encode_layer

__all__ = ["ABSENT", "KINDS", "EntryHeader", "FormatVersionError", "Identity", "MlxkvError", "decode_layer",
           "encode_layer", "extend", "prefix_digest", "prefix_hasher", "read_caches", "read_header", "verify_file",
           "write_file", "write_steps"]

MAGIC = b"MLXQKV\r\n"
FORMAT_VERSION = 2
ALIGN = 16 * 1024
_PREAMBLE = struct.Struct("<8sII32s")  # magic, version, header length, header checksum
_HASH_PLACEHOLDER = "0" * 32

_DTYPES = {name: getattr(mx, name) for name in (
    "bool_", "uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64",
    "float16", "bfloat16", "float32", "float64")}
_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}
DTYPES = _DTYPES  # name -> MLX dtype, for readers of tensor records


class FormatVersionError(MlxkvError):
    """A file of another format version (an older mlxq's cache): never read, safe to remove."""


@dataclass(frozen=True)
class Identity:
    """What a file must match to be served: the model and the KV representation."""

    fingerprint: str  # model weights + config + tokenizer + runtime (store.fingerprint)
    kv_scheme: str  # how KV is represented: "native" (the model's own caches) or a --kv-quant scheme's key
    namespace: str  # prompt-cache partition (adapter)

    @property
    def directory(self) -> str:
        """The store's directory name: one per (model, KV scheme), so a scheme change never
        restores (or removes) another scheme's files."""
        return f"{self.fingerprint}-{self.kv_scheme}"


@dataclass(frozen=True)
class EntryHeader:
    """One node file's header: where its span sits in the tree, and its layers' tensors."""

    identity: Identity
    digest: str  # prefix_digest of the prefix the span ends: the file's name
    parent: str  # prefix_digest of the prefix before the span (its parent file's name); "" at the root
    start: int  # tokens before the span (its fork point inside the parent's chain)
    tokens: tuple[int, ...]  # the span's own tokens
    trimmable: bool  # every layer is full attention: any prefix along the chain is servable
    snapshot: bool  # ring / recurrent layers hold their state at the span's end (else kind "absent")
    created: float
    layers: list  # [{"kind", "meta", "tensors": [{"name","offset","nbytes","shape","dtype","xxh3"}]}]
    model: str  # the served model name, for humans (`mlxq cache ls`)
    data_start: int = 0  # where tensor offsets count from (bytes from the file's start)
    checkpoint: dict | None = None  # a generation checkpoint's record (store/checkpoints.py); None: a prompt node

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    @property
    def tensor_bytes(self) -> int:
        return sum(t["nbytes"] for layer in self.layers for t in layer["tensors"])


def prefix_hasher(tokens=()) -> hashlib.blake2b:
    """The hash state of a token prefix; ``extend`` it with the next span's tokens (a hash chain)."""
    return extend(hashlib.blake2b(digest_size=16), tokens)


def extend(hasher: hashlib.blake2b, tokens) -> hashlib.blake2b:
    hasher.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return hasher


def prefix_digest(tokens) -> str:
    """The name of the file that ends the prefix ``tokens``."""
    return prefix_hasher(tokens).hexdigest()


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


# --- writing ------------------------------------------------------------------------
def _host_bytes(array: mx.array) -> memoryview:
    array = mx.contiguous(array)
    mx.eval(array)
    return memoryview(array).cast("B")


def write_steps(path: Path, header: dict, layers: list, host_bytes=None) -> Iterator[None]:
    """Write ``layers`` ([(kind, meta, [(name, array)])]) to ``path`` atomically, one tensor per step.

    A generator so the caller decides when each tensor's work happens (the engine
    runs one step per idle turn). Raises OSError on I/O failure, leaving no
    ``.tmp`` behind. The file exists under ``path`` only after the last step.
    ``host_bytes``: how a tensor's bytes are read (default: made contiguous and evaluated here; a
    writer off the engine thread passes arrays already evaluated and reads them as they are).
    """
    host_bytes = host_bytes or _host_bytes
    plan = _Plan(header, layers)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            for record, array in zip(plan.tensors, plan.arrays, strict=True):
                data = host_bytes(array)
                record["xxh3"] = xxh3.hexdigest(data)
                f.seek(plan.data_start + record["offset"])
                f.write(data)
                del data
                yield
            plan.finish(f)
        _rename_durable(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_file(path: Path, header: dict, layers: list, host_bytes) -> None:
    """``write_steps`` in one call, for a writer thread beside the engine thread: the same file, but the
    tensors' bytes go to the file in a few ``os.pwritev`` calls, and each is hashed without the GIL
    (store/xxh3.py), so the writer takes the GIL back once per tensor instead of twice and holds it a few
    microseconds each time. ``host_bytes``: a tensor's bytes, already on the host (all of a file's are
    held until it is written: the caller owns them anyway)."""
    plan = _Plan(header, layers)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            parts = []  # (file offset, bytes), in file order
            for record, array in zip(plan.tensors, plan.arrays, strict=True):
                data = host_bytes(array)
                record["xxh3"] = xxh3.hexdigest(data)
                if record["nbytes"]:
                    parts.append((plan.data_start + record["offset"], data))
            _write_parts(f.fileno(), parts)
            plan.finish(f)
        _rename_durable(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


_IOV_MAX = 512  # buffers per pwritev call (Linux allows 1,024)


def _write_parts(fd: int, parts: list) -> None:
    """Write ``parts`` ((offset, buffer), ascending, not overlapping) with as few ``pwritev`` calls as the
    gaps between them allow (a gap is the alignment's padding: zeros, as a sparse hole reads)."""
    i = 0
    while i < len(parts):
        at, buffers, end = parts[i][0], [], parts[i][0]
        while i < len(parts) and len(buffers) < _IOV_MAX:
            offset, data = parts[i]
            if offset != end:
                if offset - end > ALIGN:
                    break
                buffers.append(bytes(offset - end))
                end = offset
            buffers.append(data)
            end += memoryview(data).nbytes
            i += 1
        _pwritev_all(fd, buffers, at)


def _pwritev_all(fd: int, buffers: list, at: int) -> None:
    views = [memoryview(b).cast("B") for b in buffers]
    while views:
        done = os.pwritev(fd, views, at)  # releases the GIL
        if done <= 0:
            raise OSError("pwritev wrote nothing")
        at += done
        while views and done >= views[0].nbytes:
            done -= views[0].nbytes
            views.pop(0)
        if views and done:
            views[0] = views[0][done:]


class _Plan:
    """A file's header with placeholder checksums, and where each tensor goes."""

    def __init__(self, header: dict, layers: list) -> None:
        records, self.arrays = [], []
        offset = self.end = 0
        for kind, meta, named in layers:
            tensors = []
            for name, array in named:
                tensors.append({"name": name, "offset": offset, "nbytes": array.nbytes, "shape": list(array.shape),
                                "dtype": _DTYPE_NAMES[array.dtype], "xxh3": _HASH_PLACEHOLDER})
                self.arrays.append(array)
                self.end = offset + array.nbytes
                offset = _align(self.end)
            records.append({"kind": kind, "meta": meta, "tensors": tensors})
        self.full = dict(header, layers=records)
        self.header_len = len(_encode_header(self.full))
        self.data_start = _align(_PREAMBLE.size + self.header_len)
        self.tensors = [t for record in records for t in record["tensors"]]

    def finish(self, f) -> None:
        """Trim the file after its last tensor, write the header (checksums filled in), fsync."""
        f.truncate(self.data_start + self.end)  # no padding after the last tensor
        body = _encode_header(self.full)
        assert len(body) == self.header_len, "the header changed length"
        f.seek(0)
        f.write(_PREAMBLE.pack(MAGIC, FORMAT_VERSION, self.header_len, xxhash.xxh3_128_hexdigest(body).encode()))
        f.write(body)
        f.flush()
        os.fsync(f.fileno())


def _rename_durable(tmp: Path, path: Path) -> None:
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _encode_header(header: dict) -> bytes:
    return json.dumps(header, separators=(",", ":"), sort_keys=True).encode()


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --- reading ------------------------------------------------------------------------
def read_header(path: Path) -> EntryHeader:
    """Parse and check the header (magic, version, checksum, fields); tensors are not read."""
    with open(path, "rb") as f:
        pre = f.read(_PREAMBLE.size)
        if len(pre) < _PREAMBLE.size:
            raise MlxkvError("truncated preamble")
        magic, version, length, checksum = _PREAMBLE.unpack(pre)
        if magic != MAGIC:
            raise MlxkvError("not an .mlxkv file (bad magic)")
        if version != FORMAT_VERSION:
            raise FormatVersionError(f"format version {version}; this mlxq reads version {FORMAT_VERSION} "
                                     "(a cache: remove it with `mlxq cache verify --delete-bad`)")
        body = f.read(length)
    if len(body) != length or xxhash.xxh3_128_hexdigest(body).encode() != checksum:
        raise MlxkvError("header checksum mismatch")
    try:
        h = json.loads(body)
        identity = Identity(h["fingerprint"], h["kv_scheme"], h["namespace"])
        header = EntryHeader(identity, str(h["digest"]), str(h["parent"]), int(h["start"]), tuple(h["tokens"]),
                             bool(h["trimmable"]), bool(h["snapshot"]), float(h["created"]), h["layers"],
                             h.get("model", ""), _align(_PREAMBLE.size + length), h.get("checkpoint"))
    except (ValueError, KeyError, TypeError) as exc:
        raise MlxkvError(f"malformed header: {exc}") from None
    if header.start < 0 or (header.start == 0) != (header.parent == ""):
        raise MlxkvError(f"a span starting at {header.start} with parent {header.parent!r}")
    data_start = header.data_start
    size = os.path.getsize(path)
    for layer in header.layers:
        if layer.get("kind") not in KINDS:
            raise MlxkvError(f"unknown cache kind {layer.get('kind')!r}")
        for t in layer["tensors"]:
            if t["dtype"] not in _DTYPES or data_start + t["offset"] + t["nbytes"] > size:
                raise MlxkvError(f"tensor {t['name']!r} out of bounds or of unknown dtype")
    return header


def read_exactly(fd: int, into: memoryview, at: int) -> int:
    """Read ``len(into)`` bytes at offset ``at`` (a short count only at the end of the file)."""
    done = 0
    while done < len(into):
        got = os.preadv(fd, [into[done:]], at + done)
        if got <= 0:
            break
        done += got
    return done


def read_arrays_steps(path: Path, header: EntryHeader) -> Generator[None, None, list[dict[str, mx.array]]]:
    """Every tensor, one per step, read straight into the buffer of the MLX array that keeps it and
    checked against its checksum there (one copy: page cache -> array). Returns {name: array} per layer;
    MlxkvError on a short read or a checksum mismatch."""
    start = header.data_start
    tensors: list[dict[str, mx.array]] = [{} for _ in header.layers]
    fd = os.open(path, os.O_RDONLY)
    try:
        for i, layer in enumerate(header.layers):
            for t in layer["tensors"]:
                array = mx.zeros(t["shape"], _DTYPES[t["dtype"]], stream=mx.cpu)
                mx.eval(array)
                view = memoryview(array).cast("B") if t["nbytes"] else memoryview(b"")
                if read_exactly(fd, view, start + t["offset"]) != t["nbytes"]:
                    raise MlxkvError(f"tensor {t['name']!r} of layer {i} is truncated")
                if xxhash.xxh3_128_hexdigest(view) != t["xxh3"]:
                    raise MlxkvError(f"tensor {t['name']!r} of layer {i} fails its checksum")
                del view
                tensors[i][t["name"]] = array
                yield
    finally:
        os.close(fd)
    return tensors


def read_caches_steps(path: Path, header: EntryHeader) -> Generator[None, None, list]:
    """The file's layers as caches (``None`` for an absent layer), one tensor read per step."""
    tensors = yield from read_arrays_steps(path, header)
    return [decode_layer(layer["kind"], layer["meta"], tensors[i]) for i, layer in enumerate(header.layers)]


def run_steps(steps: Generator):
    """Drive a step generator to the end; its return value."""
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value


def read_caches(path: Path, header: EntryHeader) -> list:
    return run_steps(read_caches_steps(path, header))


def verify_file(path: Path) -> EntryHeader:
    """Check the header and every tensor checksum; raises MlxkvError naming what is wrong."""
    header = read_header(path)
    run_steps(read_arrays_steps(path, header))
    return header
