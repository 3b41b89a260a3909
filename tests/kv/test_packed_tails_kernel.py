"""The packed tails' kernel's contract (kv/packed_tails_kernel.py), on the CPU: its plain reference is the
shared-prefix attention of the rows' padded layout, packed; the packed cache hands the kernel what that
reference reads; the kernel is taken only where it fits. The kernel itself runs on CUDA only: the server's
start-up check compares it with this reference on the model's heads before it may run."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import BatchKVCache

from mlxq.kv import packed_tails_kernel, shared_prefix_decode
from mlxq.kv.packed_tails import PackedTailsCache, Packing, packed_positions
from mlxq.kv.shared_prefix_attention import shared_prefix_attention
from mlxq.kv.shared_prefix_cache import SharedPrefixBatchCache

LENS = [5, 1, 9, 3, 9, 2]


def normal(*shape, seed):
    return mx.random.normal(shape, key=mx.random.key(seed))


def test_the_reference_is_the_padded_rows_shared_prefix_attention_packed():
    """Tails of 14 columns whose rows start reading before their chunk (leased tokens), at it, or at 0."""
    heads, kv_heads, dim, span = 4, 2, 16, 14
    packing = Packing.of([max(LENS) - n for n in LENS], LENS)
    starts = mx.array([0, 8, 2, 11, 5, 12], mx.int32)
    q = normal(packing.tokens, heads, 1, dim, seed=1)
    pk, pv = normal(1, kv_heads, 37, dim, seed=2), normal(1, kv_heads, 37, dim, seed=3)
    tk, tv = normal(len(LENS), kv_heads, span, dim, seed=4), normal(len(LENS), kv_heads, span, dim, seed=5)
    want = packing.packed(shared_prefix_attention(packing.padded(q), pk, pv, tk, tv, starts, 0.25))
    positions = packing.columns + (span - packing.width)
    got = packed_tails_kernel.reference(q, pk, pv, tk, tv, packing.rows, positions, starts, 0.25)
    assert got.shape == q.shape
    assert mx.allclose(want, got, rtol=0, atol=1e-6).item()
    # Each token sees its own row only: another row's keys moved change nothing of this row's tokens.
    moved = tk.at[1].add(1.0)
    again = packed_tails_kernel.reference(q, pk, pv, moved, tv, packing.rows, positions, starts, 0.25)
    own = (packing.rows != 1)[:, None, None, None]
    assert mx.array_equal(mx.where(own, again, 0), mx.where(own, got, 0)).item()
    assert not mx.array_equal(again, got).item()


def packed_cache(kv_heads=2, dim=16, leased_shift=0.0):
    padding = [max(LENS) - n for n in LENS]
    packing = Packing.of(padding, LENS)
    # Three columns written before the chunk, so each row's own tokens start 3 columns before its chunk's
    # first real one: every row reads 3 leased tokens (a row's start is its left padding).
    tail = BatchKVCache(padding)
    tail.keys, tail.values = normal(len(LENS), kv_heads, 64, dim, seed=6), normal(len(LENS), kv_heads, 64, dim, seed=7)
    tail.keys[:, :, :3] += leased_shift
    tail._idx = 3
    tail.offset = tail.offset + 3
    prefix = (normal(1, kv_heads, 37, dim, seed=8), normal(1, kv_heads, 37, dim, seed=9))
    target = SharedPrefixBatchCache.grouped([prefix], tail, [0] * len(LENS))
    return PackedTailsCache(target, packing, packed_positions(target, packing)), prefix


def test_the_packed_cache_hands_the_kernel_what_its_reference_reads(monkeypatch):
    """With the kernel on, the packed cache's attention is the kernel's; here the kernel is stood in for by
    its reference (the CPU has no CUDA), whose output must equal the cache's own plain attention."""
    def fetched(leased_shift=0.0):
        cache, prefix = packed_cache(leased_shift=leased_shift)
        tokens = cache.packing.tokens
        return (cache, prefix, *cache.update_and_fetch(normal(tokens, 2, 1, 16, seed=11),
                                                       normal(tokens, 2, 1, 16, seed=12)))

    cache, (pk, pv), keys, values = fetched()
    q = normal(cache.packing.tokens, 4, 1, 16, seed=10)
    plain = cache.attend(q, keys, values, 0.25)
    calls = []

    def kernel(*args):
        calls.append(args)
        return packed_tails_kernel.reference(*args)

    monkeypatch.setattr(shared_prefix_decode, "_kernels", frozenset({"mma_prefill", "mma_packed"}))
    monkeypatch.setattr(packed_tails_kernel, "fits", lambda *args: True)
    monkeypatch.setattr(packed_tails_kernel, "packed_attention", kernel)
    got = cache.attend(q, keys, values, 0.25)
    assert len(calls) == 1 and calls[0][3] is keys and calls[0][1] is pk and calls[0][2] is pv
    assert mx.allclose(plain, got, rtol=0, atol=1e-6).item()
    # The leased columns are read: moving them moves the output (a start at the chunk would not see them).
    moved, _, moved_keys, moved_values = fetched(leased_shift=5.0)
    assert not mx.allclose(got, moved.attend(q, moved_keys, moved_values, 0.25), rtol=0, atol=1e-3).item()
    assert len(calls) == 2
    calls.pop()
    with shared_prefix_decode.forced("mma_prefill"):  # another path forced: the three parts
        cache.attend(q, keys, values, 0.25)
    assert len(calls) == 1


@pytest.mark.parametrize(("tokens", "prefix", "positions", "sinks", "dtype", "fits"), [
    (3584, 16000, 1, False, mx.bfloat16, True),   # a 64-agent burst on a 16k prefix: one split
    (64, 16000, 1, False, mx.bfloat16, False),    # a few tokens: the prefix in several splits
    (3584, 16000, 1, True, mx.bfloat16, False),   # sinks: one more level
    (3584, 16000, 7, False, mx.bfloat16, False),  # several queries per row: not packed
    (3584, 16000, 1, False, mx.float32, False),   # the tensor-core kernel is bf16's
])
def test_the_kernel_takes_a_bursts_one_query_rows_in_one_split_only(tokens, prefix, positions, sinks, dtype, fits):
    q = mx.zeros((tokens, 32, positions, 128), dtype)
    pk = mx.zeros((1, 8, prefix, 128), dtype)
    tk = mx.zeros((64, 8, 80, 128), dtype)
    assert packed_tails_kernel.fits(q, pk, tk, mx.zeros((32,)) if sinks else None) is fits


@pytest.mark.skipif(not mx.cuda.is_available(), reason="needs MLX's CUDA backend")
def test_the_kernel_equals_its_reference_on_cuda():
    assert packed_tails_kernel.self_check() < shared_prefix_decode.AGREEMENT
    assert packed_tails_kernel.self_check(heads=32, kv_heads=8) < shared_prefix_decode.AGREEMENT
