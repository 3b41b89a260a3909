"""``write_file`` (the checkpoint writer's one-call write) makes the bytes ``write_steps`` makes, and the
GIL-free xxh3 gives python-xxhash's digest."""

from __future__ import annotations

import os

import mlx.core as mx
import numpy as np
import xxhash
from mlx_lm.models.cache import ArraysCache, KVCache

from mlxq.store import mlxkv, xxh3

HEADER = {"fingerprint": "f" * 16, "kv_scheme": "native", "namespace": "ns", "tokens": [1, 2, 3],
          "digest": mlxkv.prefix_digest([1, 2, 3]), "parent": "", "start": 0, "snapshot": True,
          "trimmable": False, "created": 0.0, "model": "m"}


def _host(array: mx.array) -> memoryview:
    array = mx.contiguous(array)
    mx.eval(array)
    return memoryview(array).cast("B")


def _layers() -> list:
    big = KVCache()  # tensors past the GIL-free threshold, and not multiples of the 16 KiB alignment
    k = mx.random.normal((1, 2, 1000, 40)).astype(mx.float32)
    big.update_and_fetch(k, -k)
    small = KVCache()
    s = mx.random.normal((1, 2, 3, 8)).astype(mx.bfloat16)
    small.update_and_fetch(s, s * 2)
    rec = ArraysCache(2)
    rec[0] = mx.random.normal((1, 3, 16))  # slot 1 stays None: an empty tensor
    return [mlxkv.encode_layer(c) for c in (big, small, rec, big)]


def test_write_file_makes_the_same_file_as_write_steps(tmp_path):
    layers = _layers()
    stepped, whole = tmp_path / "a.mlxkv", tmp_path / "b.mlxkv"
    for _ in mlxkv.write_steps(stepped, HEADER, layers):
        pass
    mlxkv.write_file(whole, HEADER, layers, _host)
    assert stepped.read_bytes() == whole.read_bytes()
    assert not list(tmp_path.glob("*.tmp"))
    mlxkv.verify_file(whole)


def test_gil_free_digest_equals_python_xxhash():
    for n in (0, 5, xxh3.MIN_GIL_FREE_BYTES - 1, xxh3.MIN_GIL_FREE_BYTES, 3 * 2**20 + 7):
        data = os.urandom(n)
        assert xxh3.hexdigest(data) == xxhash.xxh3_128_hexdigest(data)
    shaped = np.arange(2**17, dtype=np.float32).reshape(256, 512)  # a 2-D buffer of 512 KiB
    assert xxh3.hexdigest(shaped) == xxhash.xxh3_128_hexdigest(shaped.tobytes())
    assert xxh3.GIL_FREE  # the xxhash extension exports XXH3_128bits_withSeed here


def test_streamed_digest_equals_python_xxhash():
    data = os.urandom(9 * 2**20 + 11)
    for cuts in ((), (1,), (1000, 5 * 2**20), tuple(range(0, len(data), 4 << 20))):
        hasher, reference, start = xxh3.Hasher(), xxhash.xxh3_128(), 0
        for end in (*cuts, len(data)):
            hasher.update(memoryview(data)[start:end])
            reference.update(data[start:end])
            start = end
        assert hasher.hexdigest() == reference.hexdigest()
    shaped = np.arange(2**17, dtype=np.float32).reshape(256, 512)
    hasher = xxh3.Hasher()
    hasher.update(shaped)
    assert hasher.hexdigest() == xxhash.xxh3_128_hexdigest(shaped.tobytes())
    assert xxh3.Hasher()._state  # the extension exports the streaming calls here: the GIL-free path runs

