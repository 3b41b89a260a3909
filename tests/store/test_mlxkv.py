"""The .mlxkv file: exact round trips per cache kind, atomic writes, every corruption refused."""

from __future__ import annotations

import struct
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

from mlxq.store import mlxkv

HEADER = {"fingerprint": "f" * 16, "kv_scheme": "native", "namespace": "ns", "tokens": [1, 2, 3],
          "digest": mlxkv.prefix_digest([1, 2, 3]), "parent": "", "start": 0, "snapshot": True,
          "trimmable": False, "created": 0.0, "model": "m"}


def kv(n: int, dtype=mx.bfloat16, dim: int = 8) -> KVCache:
    c = KVCache()
    k = mx.random.normal((1, 2, n, dim)).astype(dtype)
    c.update_and_fetch(k, k * 2)
    return c


def ring_past_wrap(window: int = 8, fed: int = 13) -> RotatingKVCache:
    c = RotatingKVCache(window)
    for _ in range(fed):  # one token at a time: the ring wraps and _idx moves
        k = mx.random.normal((1, 2, 1, 8))
        c.update_and_fetch(k, -k)
    return c


def recurrent() -> ArraysCache:
    c = ArraysCache(3)
    c[0] = mx.random.normal((1, 3, 16))
    c[2] = mx.random.normal((1, 2, 4, 4)).astype(mx.float16)  # slot 1 stays None
    return c


def write(path: Path, caches: list) -> None:
    for _ in mlxkv.write_steps(path, HEADER, [mlxkv.encode_layer(c) for c in caches]):
        pass


def same_state(a, b) -> bool:
    if isinstance(a, ArraysCache):
        return all((x is None and y is None) or (x.dtype == y.dtype and mx.array_equal(x, y).item())
                   for x, y in zip(a.cache, b.cache, strict=True))
    n = a.offset if type(a) is KVCache else a.keys.shape[2]
    same = all(mx.array_equal(x[..., :n, :], y[..., :n, :]).item() and x.dtype == y.dtype
               for x, y in ((a.keys, b.keys), (a.values, b.values)))
    return same and a.offset == b.offset and getattr(a, "_idx", None) == getattr(b, "_idx", None)


def test_every_cache_kind_round_trips_bit_exactly(tmp_path):
    caches = [kv(5), kv(300, mx.float32), ring_past_wrap(), recurrent()]
    path = tmp_path / "e.mlxkv"
    write(path, caches)
    header = mlxkv.read_header(path)
    assert header.tokens == (1, 2, 3) and header.identity == mlxkv.Identity("f" * 16, "native", "ns")
    assert [layer["kind"] for layer in header.layers] == ["kv", "kv", "rotating", "arrays"]
    for layer in header.layers:
        for t in layer["tensors"]:
            assert t["offset"] % mlxkv.ALIGN == 0
    restored = mlxkv.read_caches(path, header)
    assert [type(c) for c in restored] == [type(c) for c in caches]
    assert all(same_state(a, b) for a, b in zip(caches, restored, strict=True))
    # Restored caches keep working: the ring continues past its wrap exactly like the original.
    k = mx.ones((1, 2, 1, 8))
    a, _ = caches[2].update_and_fetch(k, k)
    b, _ = restored[2].update_and_fetch(k, k)
    assert mx.array_equal(a, b).item()
    assert not list(tmp_path.glob("*.tmp"))


def test_quantized_kinds_round_trip_bit_exactly(tmp_path):
    from mlx_lm.models.cache import QuantizedKVCache

    from mlxq.kv.quantized import QuantizedRotatingKVCache, quantize_rotating

    full = kv(40, dim=64).to_quantized(group_size=64, bits=4)
    ring = quantize_rotating(ring_past_wrap_64(), 32, 8)
    path = tmp_path / "q.mlxkv"
    write(path, [full, ring])
    header = mlxkv.read_header(path)
    assert [layer["kind"] for layer in header.layers] == ["qkv", "rotating-qkv"]
    got_full, got_ring = mlxkv.read_caches(path, header)
    assert type(got_full) is QuantizedKVCache and (got_full.bits, got_full.group_size, got_full.offset) == (4, 64, 40)
    assert type(got_ring) is QuantizedRotatingKVCache and (got_ring._idx, got_ring.offset) == (ring._idx, ring.offset)
    for a, b in ((full.keys, got_full.keys), (full.values, got_full.values)):
        assert all(mx.array_equal(x[..., :40, :], y).item() for x, y in zip(a, b, strict=True))
    for a, b in ((ring.keys, got_ring.keys), (ring.values, got_ring.values)):
        assert all(mx.array_equal(x, y).item() for x, y in zip(a, b, strict=True))
    # The restored ring keeps decoding exactly like the original.
    step = mx.random.normal((1, 2, 1, 64))
    a_keys, _ = ring.update_and_fetch(step, step)
    b_keys, _ = got_ring.update_and_fetch(step, step)
    assert all(mx.array_equal(x, y).item() for x, y in zip(a_keys, b_keys, strict=True))


def ring_past_wrap_64(window: int = 8, fed: int = 13) -> RotatingKVCache:
    c = RotatingKVCache(window)
    for _ in range(fed):
        k = mx.random.normal((1, 2, 1, 64))
        c.update_and_fetch(k, -k)
    return c


def test_only_the_used_part_of_a_kv_buffer_is_stored(tmp_path):
    c = kv(3)  # mlx-lm allocates 256-token steps; only 3 are state
    path = tmp_path / "e.mlxkv"
    write(path, [c])
    assert mlxkv.read_header(path).tensor_bytes == 2 * 2 * 3 * 8 * 2


def test_an_interrupted_write_leaves_no_entry_under_the_final_name(tmp_path):
    path = tmp_path / "e.mlxkv"
    steps = mlxkv.write_steps(path, HEADER, [mlxkv.encode_layer(kv(4)), mlxkv.encode_layer(kv(4))])
    next(steps)  # one tensor written, then the writer is abandoned (as in a crash)
    assert not path.exists() and (tmp_path / "e.mlxkv.tmp").exists()
    steps.close()  # a clean abort removes its .tmp
    assert not path.exists() and not (tmp_path / "e.mlxkv.tmp").exists()


def flip_byte(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x40
    path.write_bytes(bytes(data))


def test_a_flipped_tensor_byte_is_named_and_never_restored(tmp_path):
    path = tmp_path / "e.mlxkv"
    write(path, [kv(4), kv(4)])
    header = mlxkv.read_header(path)
    header_len = struct.unpack("<I", path.read_bytes()[12:16])[0]
    data_start = -(-(48 + header_len) // mlxkv.ALIGN) * mlxkv.ALIGN
    flip_byte(path, data_start + header.layers[1]["tensors"][1]["offset"] + 5)
    with pytest.raises(mlxkv.MlxkvError, match="'values' of layer 1 fails its checksum"):
        mlxkv.read_caches(path, mlxkv.read_header(path))
    with pytest.raises(mlxkv.MlxkvError):
        mlxkv.verify_file(path)


@pytest.mark.parametrize("damage, message", [
    (lambda p: flip_byte(p, 0), "bad magic"),
    (lambda p: flip_byte(p, 60), "header checksum"),
    (lambda p: p.write_bytes(p.read_bytes()[:30]), "truncated"),
    (lambda p: p.write_bytes(p.read_bytes()[:20000]), "out of bounds"),
    (lambda p: p.write_bytes(p.read_bytes()[:8] + struct.pack("<I", 99) + p.read_bytes()[12:]), "version 99"),
    (lambda p: p.write_bytes(p.read_bytes()[:8] + struct.pack("<I", 1) + p.read_bytes()[12:]),
     "version 1; this mlxq reads version 2 .*cache verify --delete-bad"),
])
def test_damaged_headers_are_refused_with_a_reason(tmp_path, damage, message):
    path = tmp_path / "e.mlxkv"
    write(path, [kv(300)])
    damage(path)
    with pytest.raises(mlxkv.MlxkvError, match=message):
        mlxkv.read_header(path)


def test_the_digest_names_the_prefix_however_it_is_cut_into_files(tmp_path):
    whole = mlxkv.prefix_digest([1, 2, 3, 4, 5])
    chained = mlxkv.extend(mlxkv.prefix_hasher([1, 2, 3]), [4, 5]).hexdigest()  # a parent's state, extended
    assert whole == chained != mlxkv.prefix_digest([1, 2, 3, 5, 4])
    path = tmp_path / "e.mlxkv"
    for _ in mlxkv.write_steps(path, dict(HEADER, start=2), [mlxkv.encode_layer(kv(3))]):
        pass
    with pytest.raises(mlxkv.MlxkvError, match="a span starting at 2 with parent ''"):
        mlxkv.read_header(path)


def test_an_absent_snapshot_layer_has_no_tensors(tmp_path):
    path = tmp_path / "e.mlxkv"
    for _ in mlxkv.write_steps(path, dict(HEADER, snapshot=False), [mlxkv.encode_layer(kv(3)), mlxkv.ABSENT]):
        pass
    header = mlxkv.read_header(path)
    assert header.snapshot is False and header.layers[1] == {"kind": "absent", "meta": {}, "tensors": []}
    restored = mlxkv.read_caches(path, header)
    assert restored[1] is None and restored[0].offset == 3
