"""A link's tensors packed in one buffer: each comes back with its bytes, shape and dtype."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mlxq.store.checkpoint_pack import pack_layers


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
