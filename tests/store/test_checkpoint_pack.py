"""A link's tensors packed in one buffer: each comes back with its bytes, shape and dtype."""

from __future__ import annotations

import threading

import mlx.core as mx
import numpy as np

from mlxq.store.checkpoint_pack import Pack, PackedTensor, pack_layers, stage_packs


def test_packed_tensors_keep_their_bytes_shapes_and_dtypes():
    keys = mx.arange(2 * 3 * 8 * 4, dtype=mx.float32).reshape(2, 3, 8, 4)[..., 2:5, :]  # a strided slice
    halves = mx.random.normal((1, 2, 5, 4)).astype(mx.bfloat16)
    state = mx.array([[7, 8, 9]], dtype=mx.uint32)
    layers = [("kv", {"offset": 3}, [("keys", keys), ("values", halves)]), ("arrays", {}, [("0", state)]),
              ("absent", {}, [])]
    packed = pack_layers(layers)
    assert [(kind, meta, [n for n, _ in named]) for kind, meta, named in packed] == \
        [(kind, meta, [n for n, _ in named]) for kind, meta, named in layers]
    for (_, _, named), (_, _, originals) in zip(packed, layers, strict=True):
        for (_, tensor), (_, original) in zip(named, originals, strict=True):
            assert (tensor.nbytes, tensor.shape, tensor.dtype) == (original.nbytes, original.shape, original.dtype)
            assert mx.array_equal(tensor.array(), original).item()
            as_bytes = np.asarray(mx.contiguous(original.view(mx.uint8) if original.dtype == mx.bfloat16
                                                else original)).tobytes()
            assert bytes(tensor.host_bytes()) == as_bytes


def test_staged_packs_stay_under_their_size_and_move_to_the_host_only_when_asked():
    arrays = [mx.full((4, 8), float(i)) for i in range(5)] + [mx.full((40, 8), 9.0)]  # 128 B each, one 1280 B
    layers = [("kv", {}, [("keys", a)]) for a in arrays]
    packed, packs = stage_packs(layers, max_pack_bytes=300)
    assert [p.nbytes for p in packs] == [256, 256, 128, 1280]  # two to a pack; the large one alone
    assert not any(p.on_host for p in packs)
    for (_, _, [(_, tensor)]), a in zip(packed, arrays, strict=True):
        assert mx.array_equal(tensor.array(), a).item()
        assert bytes(tensor.host_bytes()) == np.asarray(a).tobytes()
    assert all(p.on_host for p in packs)


def test_a_pack_moved_by_the_cpu_stream_reads_every_byte():
    """What CUDA's host-side Packs go through: scheduled on one thread (the engine's), read on another (the
    writer's) through a read of one byte by that thread's CPU stream, then the buffer itself."""
    flat = (mx.arange(256 * 3) % 256).astype(mx.uint8)
    pack = Pack(flat, host_side=True)
    mx.async_eval(*pack.arrays)
    assert pack.arrays == [flat] and not pack.on_host
    read: list = []
    writer = threading.Thread(target=lambda: read.append(bytes(pack.host())))
    writer.start()
    writer.join()
    assert read == [bytes(range(256)) * 3] and pack.on_host


def test_a_host_side_pack_read_by_two_threads_and_restored_gives_its_bytes():
    """The writer reads a Pack while the engine thread restores from it (a client that came back while its
    link was still queued): one of them moves it, both see every byte."""
    values = mx.arange(4 * 64, dtype=mx.float32).reshape(1, 4, 64)
    flat = mx.contiguous(values).reshape(-1).view(mx.uint8) + 0
    pack = Pack(flat, host_side=True)
    mx.async_eval(*pack.arrays)
    reads: list = []
    threads = [threading.Thread(target=lambda: reads.append(bytes(pack.host()))) for _ in range(2)]
    for t in threads:
        t.start()
    restored = PackedTensor(pack, 0, values.nbytes, tuple(values.shape), mx.float32).array()
    for t in threads:
        t.join()
    assert reads == [np.asarray(values).tobytes()] * 2 and mx.array_equal(restored, values).item()


def test_spans_of_one_shape_pack_to_the_same_bytes():
    """A link's K/V spans (strided slices of one shape and dtype) take the stacked copy: same bytes."""
    cache = mx.random.normal((2, 3, 16, 4)).astype(mx.bfloat16)
    spans = [cache[1:2, :, 5:11, :], cache[0:1, :, 2:8, :], (cache * 2)[1:2, :, 5:11, :]]
    packed, [pack] = stage_packs([("kv", {}, [(str(i), a)]) for i, a in enumerate(spans)])
    assert pack.nbytes == sum(a.nbytes for a in spans)
    for (_, _, [(_, tensor)]), a in zip(packed, spans, strict=True):
        assert mx.array_equal(tensor.array(), a).item() and tensor.array().dtype == mx.bfloat16
        assert bytes(tensor.host_bytes()) == np.asarray(mx.contiguous(a).view(mx.uint8)).tobytes()
