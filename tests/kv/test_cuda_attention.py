"""CUDA attention routing (kv/cuda_attention.py): the plain-operations attention it uses for
short prefill chunks equals MLX's attention for every mask kind, and on a machine without
CUDA nothing is rerouted (so every other test here runs mlx-lm's own attention)."""

from __future__ import annotations

import sys

import mlx.core as mx
import pytest
from mlx_lm.models import base

from mlxq.kv import cpu_attention, cuda_attention


def _qkv(batch=2, heads=8, kv_heads=2, length=5, span=9, dim=32, seed=0):
    mx.random.seed(seed)
    q = mx.random.normal((batch, heads, length, dim))
    k = mx.random.normal((batch, kv_heads, span, dim))
    v = mx.random.normal((batch, kv_heads, span, dim))
    return q, k, v


def _masks(batch, length, span):
    rows = mx.arange(span - length, span)[:, None]
    causal = rows >= mx.arange(span)[None, :]
    starts = mx.array([0, 3])[:batch]
    padded = causal[None, None] & (mx.arange(span)[None, None, None, :] >= starts[:, None, None, None])
    additive = mx.where(padded, 0.0, -1e9)
    return {"none": None, "causal": "causal", "bool": padded, "additive": additive,
            "bool-2d": causal}


@pytest.mark.parametrize("kind", ["none", "causal", "bool", "additive", "bool-2d"])
@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (4, 4)])
def test_ops_attention_equals_mlx_attention(kind, heads, kv_heads):
    q, k, v = _qkv(heads=heads, kv_heads=kv_heads)
    mask = _masks(2, 5, 9)[kind]
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.3, mask=mask)
    got = cuda_attention.ops_attention(q, k, v, 0.3, mask)
    assert got.shape == want.shape
    assert mx.abs(got - want).max().item() < 1e-5


def test_ops_attention_single_query_with_history():
    q, k, v = _qkv(length=1, span=12)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.2, mask="causal")
    assert mx.abs(cuda_attention.ops_attention(q, k, v, 0.2, "causal") - want).max().item() < 1e-5


@pytest.mark.skipif(mx.cuda.is_available(), reason="checks the machine without CUDA")
def test_nothing_is_rerouted_without_cuda():
    import mlx_lm.models.llama  # noqa: F401  (a model module that imports the entry point)

    assert cuda_attention.install() is False
    # mlx-lm's own function, or the CPU backend's exact router where an engine in this process installed it
    assert sys.modules["mlx_lm.models.llama"].scaled_dot_product_attention in (base.scaled_dot_product_attention,
                                                                              cpu_attention.route)
    assert base.scaled_dot_product_attention is not cuda_attention.route


@pytest.mark.skipif(not mx.cuda.is_available(), reason="needs MLX's CUDA backend")
def test_decode_kernel_matches_mlx_on_cuda():
    from mlxq.kv.decode_kernel import self_check

    assert self_check(mx.float32) < 1e-5
    assert self_check(mx.bfloat16) < 2e-2


def test_route_sends_each_call_where_it_belongs(monkeypatch):
    """Short prefill chunks -> plain ops; long chunks, quantized caches and sinks -> mlx-lm's function."""
    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    calls = []

    def mlx_lm_attention(queries, keys, values, cache, scale, mask, sinks=None):
        calls.append(queries.shape[2])
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)

    monkeypatch.setattr(cuda_attention, "_mlx_lm_attention", mlx_lm_attention)
    q, k, v = _qkv(length=5, span=9)
    out = cuda_attention.route(q, k, v, KVCache(), 0.3, "causal")
    assert calls == []  # ran as plain operations
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.3, mask="causal")
    assert mx.abs(out - want).max().item() < 1e-5

    monkeypatch.setattr(cuda_attention, "OPS_MAX_SCORES", 5 * 9 - 1)
    cuda_attention.route(q, k, v, KVCache(), 0.3, "causal")
    assert calls == [5]  # a chunk over the limit stays on MLX's attention (cuDNN on CUDA)
    monkeypatch.setattr(cuda_attention, "OPS_MAX_SCORES", 1 << 30)
    cuda_attention.route(q, k, v, KVCache(), 0.3, "causal", sinks=mx.zeros((8,)))
    cuda_attention.route(q, k, v, QuantizedKVCache(), 0.3, "causal")
    one = _qkv(length=1, span=9)
    cuda_attention.route(*one, KVCache(), 0.3, None)  # a solo decode step: MLX's fused kernel
    assert calls == [5, 5, 5, 1]


def test_mlx_lm_only_bypasses_the_routing(monkeypatch):
    from mlx_lm.models.cache import KVCache

    calls = []
    monkeypatch.setattr(cuda_attention, "_mlx_lm_attention", lambda *a, **k: calls.append(1) or a[0])
    q, k, v = _qkv(length=5, span=9)
    with cuda_attention.mlx_lm_only():
        cuda_attention.route(q, k, v, KVCache(), 0.3, "causal")
    assert calls == [1]
    cuda_attention.route(q, k, v, KVCache(), 0.3, "causal")
    assert calls == [1]  # routed again once outside


@pytest.mark.skipif(not mx.cuda.is_available(), reason="needs MLX's CUDA backend")
@pytest.mark.parametrize("heads,kv_heads,dim", [(32, 8, 128), (8, 8, 64), (16, 2, 256), (28, 4, 128)])
def test_gqa_decode_kernel_matches_mlx_on_cuda(heads, kv_heads, dim):
    from mlxq.kv.gqa_decode_kernel import block_threads, self_check

    assert self_check(mx.bfloat16, heads, kv_heads, dim) < 2e-2
    if block_threads(mx.float32, dim, heads // kv_heads):
        assert self_check(mx.float32, heads, kv_heads, dim) < 1e-5


def test_gqa_decode_kernel_takes_the_shapes_it_can_hold():
    """One block per (row, KV head): its slots' partials must fit a block's shared memory, a key's
    values whole 16-byte loads within one warp."""
    from mlxq.kv.gqa_decode_kernel import block_threads, can_run

    assert block_threads(mx.bfloat16, 128, 4, loads=1) == 256  # Llama-3-8B: 16 keys in flight, 33 KB of partials
    assert block_threads(mx.bfloat16, 128, 4, loads=2) == 128  # the same 16 keys, 8 threads a key
    assert block_threads(mx.bfloat16, 256, 8, loads=1) == 128
    assert block_threads(mx.float32, 256, 4, loads=1) is None  # 64 threads a key
    assert block_threads(mx.float32, 256, 4, loads=2) == 256
    assert block_threads(mx.bfloat16, 128, 32) is None  # too many query heads per KV head
    q, k, v = (mx.zeros((2, 32, 1, 128), mx.bfloat16), mx.zeros((2, 8, 10, 128), mx.bfloat16),
               mx.zeros((2, 8, 10, 128), mx.bfloat16))
    assert can_run(q, k, v)
    assert not can_run(q, k.astype(mx.float32), v)
    assert not can_run(mx.zeros((2, 32, 3, 128), mx.bfloat16), k, v)  # a prefill chunk
