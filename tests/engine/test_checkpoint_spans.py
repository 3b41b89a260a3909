"""The batch lane's one-pass checkpoint copy: each row's span of every layer, byte for byte as the row's
own view would give it, and only for batches of plain full-attention caches."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import BatchKVCache, KVCache, RotatingKVCache

from mlxq.engine.checkpoint_spans import CHUNK, RowSpan, copy_spans, kernel_agrees, span_arrays, span_layers
from mlxq.engine.checkpointing import link_layers
from mlxq.kv.batch_ops import view_row

LAYERS, HEADS, DIM = 3, 2, 8


def batch(paddings: list[int], tokens: int, dtype=mx.float32) -> list:
    caches = []
    for layer in range(LAYERS):
        cache = BatchKVCache(paddings)
        shape = (len(paddings), HEADS, tokens, DIM)
        cache.update_and_fetch(mx.random.normal(shape).astype(dtype), mx.random.normal(shape).astype(dtype) + layer)
        caches.append(cache)
    return caches


def test_each_row_gets_the_bytes_of_its_own_view_of_every_layer():
    caches = batch([3, 0, 5, 2], 20)
    for cache in caches:
        cache.filter([0, 2, 3])  # row 1 left: the others' shared padding is cut, a strided view remains
    assert caches[0].left_padding.tolist() == [1, 3, 0]
    starts = {0: 4, 2: 0}  # row 0 chains on a link ending at token 4; row 2 starts its chain
    paddings = caches[0].left_padding.tolist()
    spans = [RowSpan(i, paddings[i] + start, caches[0]._idx - paddings[i] - start) for i, start in starts.items()]
    tensors, packs = copy_spans(span_arrays(caches), spans)
    mx.eval(*(a for pack in packs for a in pack.arrays))
    for (i, start), span, row in zip(starts.items(), spans, tensors, strict=True):
        expected = link_layers(view_row(caches, i), start)
        got = span_layers(row, span.length)
        assert [(kind, meta) for kind, meta, _ in got] == [(kind, meta) for kind, meta, _ in expected]
        for (_, _, named), (_, _, want) in zip(got, expected, strict=True):
            for (name, tensor), (want_name, array) in zip(named, want, strict=True):
                assert name == want_name and tensor.shape == array.shape and tensor.dtype == array.dtype
                assert bytes(tensor.host_bytes()) == np.asarray(mx.contiguous(array)).tobytes()


def test_only_batches_of_plain_full_attention_caches_of_one_shape_take_it():
    caches = batch([0, 1], 6)
    assert len(span_arrays(caches)) == 2 * LAYERS
    assert span_arrays([*caches, RotatingKVCache(16)]) is None
    assert span_arrays([*caches, KVCache()]) is None
    assert span_arrays([*caches, BatchKVCache([0, 1])]) is None  # no keys yet
    other = batch([0, 1], 6, mx.bfloat16)
    assert span_arrays([caches[0], other[0]]) is None  # two dtypes
    other[1]._idx += 1
    assert span_arrays(other[:2]) is None  # layers that do not end together


@pytest.mark.skipif(not mx.cuda.is_available(), reason="the copy kernel is CUDA's")
@pytest.mark.parametrize("count, dtype", [(2 * 32, mx.bfloat16), (CHUNK + 3, mx.float16), (3, mx.float32)])
def test_the_kernel_copies_what_the_operations_copy(count, dtype):
    assert kernel_agrees(count, dtype)


def test_the_kernel_layout_of_several_launches_lands_each_tensor_where_its_packed_tensor_says(monkeypatch):
    """_by_kernel's bookkeeping on any backend: each launch's output (here built by MLX operations, in the
    kernel's layout: rows one after the other, each row's arrays in order) joined, the tensors found
    where their offsets say."""
    from mlxq.engine import checkpoint_spans

    def launch(chunk, spans, heads, dim):
        parts = [a[s.index, :, s.first : s.first + s.length, :].reshape(-1) for s in spans for a in chunk]
        return mx.concatenate(parts)

    monkeypatch.setattr(checkpoint_spans, "_launch", launch)
    monkeypatch.setattr(checkpoint_spans, "CHUNK", 2)
    caches = batch([2, 0, 1, 0], 11)
    arrays = span_arrays(caches)[:5]  # three launches: 2, 2 and 1 arrays
    spans = [RowSpan(2, 3, 6), RowSpan(1, 2, 7)]  # launched on views of rows 1-2, tokens 2-8: spans within them
    tensors, [pack] = checkpoint_spans._by_kernel(arrays, spans, host_side=True)
    mx.eval(*pack.arrays)
    for span, row in zip(spans, tensors, strict=True):
        for a, tensor in zip(arrays, row, strict=True):
            want = a[span.index : span.index + 1, :, span.first : span.first + span.length, :]
            assert tensor.shape == want.shape and bytes(tensor.host_bytes()) == np.asarray(want).tobytes()
