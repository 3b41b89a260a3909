"""The ``.mlxkv`` file: one prompt-cache entry on disk (docs/mlxkv-format.md).

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
``rotating-qkv``); a kind
this reader does not know makes the whole file unusable, never half-restored.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
import xxhash
from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache, RotatingKVCache

from mlxq.kv.quantized import QuantizedRotatingKVCache

MAGIC = b"MLXQKV\r\n"
FORMAT_VERSION = 1
ALIGN = 16 * 1024
_PREAMBLE = struct.Struct("<8sII32s")  # magic, version, header length, header checksum
_HASH_PLACEHOLDER = "0" * 32

_DTYPES = {name: getattr(mx, name) for name in (
    "bool_", "uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64",
    "float16", "bfloat16", "float32", "float64")}
_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


class MlxkvError(ValueError):
    """The file is not a usable ``.mlxkv`` entry (bad magic, version, checksum, kind...)."""


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
    identity: Identity
    tokens: tuple[int, ...]
    trimmable: bool
    created: float
    layers: list  # [{"kind", "meta", "tensors": [{"name","offset","nbytes","shape","dtype","xxh3"}]}]
    model: str  # the served model name, for humans (`mlxq cache ls`)

    @property
    def tensor_bytes(self) -> int:
        return sum(t["nbytes"] for layer in self.layers for t in layer["tensors"])


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


# --- cache kinds --------------------------------------------------------------------
def encode_layer(cache) -> tuple[str, dict, list[tuple[str, mx.array]]]:
    """(kind, meta, named tensors) of one stored cache."""
    if type(cache) is KVCache:
        n = cache.offset
        return "kv", {"offset": n}, [("keys", cache.keys[..., :n, :]), ("values", cache.values[..., :n, :])]
    if type(cache) is RotatingKVCache:
        meta = {"offset": cache.offset, "idx": cache._idx, "max_size": cache.max_size, "keep": cache.keep}
        return "rotating", meta, [("keys", cache.keys), ("values", cache.values)]
    if type(cache) is ArraysCache:
        slots = [i for i, a in enumerate(cache.cache) if a is not None]
        return "arrays", {"size": len(cache.cache)}, [(str(i), cache.cache[i]) for i in slots]
    if type(cache) is QuantizedKVCache:
        n = cache.offset
        meta = {"offset": n, "group_size": cache.group_size, "bits": cache.bits}
        return "qkv", meta, _triples(cache, lambda x: x[..., :n, :])
    if type(cache) is QuantizedRotatingKVCache:
        meta = {"offset": cache.offset, "idx": cache._idx, "max_size": cache.max_size, "keep": cache.keep,
                "group_size": cache.group_size, "bits": cache.bits}
        return "rotating-qkv", meta, _triples(cache, lambda x: x)
    raise MlxkvError(f"no .mlxkv encoding for cache class {type(cache).__name__}")


_TRIPLE = ("data", "scales", "biases")


def _triples(cache, cut) -> list[tuple[str, mx.array]]:
    """A quantized cache's six arrays: keys.data, keys.scales, keys.biases, then values.*."""
    return [(f"{side}.{part}", cut(getattr(cache, side)[i]))
            for side in ("keys", "values") for i, part in enumerate(_TRIPLE)]


def _triple(tensors: dict[str, mx.array], side: str) -> tuple:
    return tuple(tensors[f"{side}.{part}"] for part in _TRIPLE)


KINDS = ("kv", "rotating", "arrays", "qkv", "rotating-qkv")


def decode_layer(kind: str, meta: dict, tensors: dict[str, mx.array]):
    if kind == "kv":
        cache = KVCache()
        cache.state = (tensors["keys"], tensors["values"], meta["offset"])
        return cache
    if kind == "rotating":
        cache = RotatingKVCache(meta["max_size"], meta["keep"])
        cache.keys, cache.values = tensors["keys"], tensors["values"]
        cache.offset, cache._idx = meta["offset"], meta["idx"]
        return cache
    if kind == "arrays":
        cache = ArraysCache(meta["size"])
        for name, array in tensors.items():
            cache.cache[int(name)] = array
        return cache
    if kind == "qkv":
        cache = QuantizedKVCache(meta["group_size"], meta["bits"])
        cache.keys, cache.values, cache.offset = _triple(tensors, "keys"), _triple(tensors, "values"), meta["offset"]
        return cache
    if kind == "rotating-qkv":
        cache = QuantizedRotatingKVCache(meta["max_size"], meta["keep"], meta["group_size"], meta["bits"])
        cache.keys, cache.values = _triple(tensors, "keys"), _triple(tensors, "values")
        cache.offset, cache._idx = meta["offset"], meta["idx"]
        return cache
    raise MlxkvError(f"unknown cache kind {kind!r}")


# --- writing ------------------------------------------------------------------------
def _host_bytes(array: mx.array) -> memoryview:
    array = mx.contiguous(array)
    mx.eval(array)
    return memoryview(array).cast("B")


def write_steps(path: Path, header: dict, layers: list) -> Iterator[None]:
    """Write ``layers`` ([(kind, meta, [(name, array)])]) to ``path`` atomically, one tensor per step.

    A generator so the caller decides when each tensor's work happens (the engine
    runs one step per idle turn). Raises OSError on I/O failure, leaving no
    ``.tmp`` behind. The file exists under ``path`` only after the last step.
    """
    records, arrays = [], []
    offset = end = 0
    for kind, meta, named in layers:
        tensors = []
        for name, array in named:
            tensors.append({"name": name, "offset": offset, "nbytes": array.nbytes, "shape": list(array.shape),
                            "dtype": _DTYPE_NAMES[array.dtype], "xxh3": _HASH_PLACEHOLDER})
            arrays.append(array)
            end = offset + array.nbytes
            offset = _align(end)
        records.append({"kind": kind, "meta": meta, "tensors": tensors})
    full = dict(header, layers=records)
    header_len = len(_encode_header(full))
    data_start = _align(_PREAMBLE.size + header_len)
    flat = [t for record in records for t in record["tensors"]]
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            for record, array in zip(flat, arrays, strict=True):
                data = _host_bytes(array)
                record["xxh3"] = xxhash.xxh3_128_hexdigest(data)
                f.seek(data_start + record["offset"])
                f.write(data)
                del data
                yield
            f.truncate(data_start + end)  # no padding after the last tensor
            body = _encode_header(full)
            assert len(body) == header_len, "the header changed length"
            f.seek(0)
            f.write(_PREAMBLE.pack(MAGIC, FORMAT_VERSION, header_len, xxhash.xxh3_128_hexdigest(body).encode()))
            f.write(body)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


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
            raise MlxkvError(f"format version {version}; this mlxq reads version {FORMAT_VERSION}")
        body = f.read(length)
    if len(body) != length or xxhash.xxh3_128_hexdigest(body).encode() != checksum:
        raise MlxkvError("header checksum mismatch")
    try:
        h = json.loads(body)
        identity = Identity(h["fingerprint"], h["kv_scheme"], h["namespace"])
        header = EntryHeader(identity, tuple(h["tokens"]), bool(h["trimmable"]), float(h["created"]),
                             h["layers"], h.get("model", ""))
    except (ValueError, KeyError, TypeError) as exc:
        raise MlxkvError(f"malformed header: {exc}") from None
    data_start = _align(_PREAMBLE.size + length)
    size = os.path.getsize(path)
    for layer in header.layers:
        if layer.get("kind") not in KINDS:
            raise MlxkvError(f"unknown cache kind {layer.get('kind')!r}")
        for t in layer["tensors"]:
            if t["dtype"] not in _DTYPES or data_start + t["offset"] + t["nbytes"] > size:
                raise MlxkvError(f"tensor {t['name']!r} out of bounds or of unknown dtype")
    return header


def read_tensors(path: Path, header: EntryHeader) -> Iterator[tuple[int, str, np.ndarray]]:
    """(layer index, name, verified host bytes) for every tensor; MlxkvError on a checksum mismatch."""
    with open(path, "rb") as f:
        _, _, length, _ = _PREAMBLE.unpack(f.read(_PREAMBLE.size))
        start = _align(_PREAMBLE.size + length)
        for i, layer in enumerate(header.layers):
            for t in layer["tensors"]:
                f.seek(start + t["offset"])
                data = np.empty(t["nbytes"], dtype=np.uint8)
                if f.readinto(memoryview(data)) != t["nbytes"]:
                    raise MlxkvError(f"tensor {t['name']!r} of layer {i} is truncated")
                if xxhash.xxh3_128_hexdigest(data) != t["xxh3"]:
                    raise MlxkvError(f"tensor {t['name']!r} of layer {i} fails its checksum")
                yield i, t, data


def read_caches_steps(path: Path, header: EntryHeader) -> Generator[None, None, list]:
    """Restore the caches one tensor per step: each is copied into an MLX array and its host bytes
    dropped before the next is read (peak host transient: one tensor). Returns the caches."""
    tensors: list[dict[str, mx.array]] = [{} for _ in header.layers]
    for i, t, data in read_tensors(path, header):
        dtype = _DTYPES[t["dtype"]]
        array = mx.array(data).view(dtype).reshape(t["shape"]) if t["nbytes"] else mx.zeros(t["shape"], dtype)
        mx.eval(array)  # copy now, so the host transient is one tensor
        tensors[i][t["name"]] = array
        del data
        yield
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
    for _ in read_tensors(path, header):
        pass
    return header
