"""The tails' prefill on a shared prefix (several queries per row): the route, bounded score blocks,
the tensor-core path's composition, and tails cut from a lease's spans without a copy of the prefix.

On the CPU the plain path is the oracle (it equals MLX's attention over per-row copies:
tests/kv/test_shared_prefix_attention.py). Products longer than SCORE_BLOCK scores go in blocks of
query rows: each row's softmax is its own, so blocks change nothing but the summation order the BLAS
picks for a product of fewer rows (MKL: up to 5e-6 here; the reference BLAS: the same bits). The ``mma_prefill``
path's CUDA kernel cannot run here: its contract (one level per split of the prefix, in the stacked
layout) is played by the plain stacked GEMMs on 64-key chunks, which checks everything the path
does around the kernel; the kernel itself is compared with the plain path on CUDA (and at start-up).
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlxq.kv import prefix_mma_kernel
from mlxq.kv import shared_prefix_attention as spa
from mlxq.kv import shared_prefix_decode as decode
from mlxq.kv.shared_prefix_decode import CallShape, route
from mlxq.kv.sharing_plan import tail_from_spans
from tests.kv.test_shared_prefix_attention import make_group, reference

ALL = frozenset({"full", "split", "gqa", "mma", "mma_gqa", "mma_prefill"})


def decode_shape(rows, prefix, **kw):
    return CallShape(**{"rows": rows, "queries": 1, "prefix": prefix, "quantized": False, "one_kernel": True,
                        "gqa_tails": True, "mma_prefix": True, **kw})


@pytest.mark.parametrize("shape, kernels, path", [
    # whole-model decode steps on the H200 (docs/benchmarks.md): mma_gqa from 64 x 2k (131,072 group tokens) on
    (decode_shape(64, 2048), ALL, "mma_gqa"),
    (decode_shape(64, 16384), ALL, "mma_gqa"),
    (decode_shape(16, 12288), ALL, "mma_gqa"),
    (decode_shape(64, 2047), ALL, "gqa"),
    (decode_shape(32, 2048), ALL, "gqa"),
    (decode_shape(8, 2048), ALL, "gqa"),
    (decode_shape(64, 16384, gqa_tails=False), ALL, "mma"),
    (decode_shape(64, 16384, mma_prefix=False), ALL, "split"),  # float32: no tensor-core prefix
    (decode_shape(64, 16384), ALL - {"mma_gqa"}, "mma"),
    (decode_shape(8, 2048), frozenset({"full", "split"}), "full"),
    (decode_shape(16, 2048), frozenset({"full", "split"}), "split"),
    (decode_shape(64, 2048, quantized=True), ALL, "ops"),
    (decode_shape(64, 2048), frozenset(), "ops"),  # CPU, Metal, before the self-check
    # the tails' prefill: the tensor-core prefix whatever the group's size, plain blocks otherwise
    (decode_shape(64, 14500, queries=56, one_kernel=False, gqa_tails=False), ALL, "mma_prefill"),
    (decode_shape(2, 48, queries=9, one_kernel=False, gqa_tails=False), ALL, "mma_prefill"),
    (decode_shape(64, 14500, queries=56, one_kernel=False, gqa_tails=False, mma_prefix=False), ALL, "ops"),
    (decode_shape(64, 14500, queries=56, one_kernel=False, gqa_tails=False), ALL - {"mma_prefill"}, "ops"),
    (decode_shape(64, 14500, queries=56, quantized=True), ALL, "ops"),
])
def test_the_route_is_decided_from_the_call_shape(shape, kernels, path):
    assert route(shape, kernels) == path


def test_a_call_becomes_its_shape():
    q = mx.zeros((64, 32, 56, 128), mx.bfloat16)
    pk = mx.zeros((1, 8, 2048, 128), mx.bfloat16)
    tk = mx.zeros((64, 8, 60, 128), mx.bfloat16)
    assert decode.call_shape(q, pk, tk, tk) == CallShape(64, 56, 2048, False, False, False, True)
    assert decode.call_shape(q[:, :, :1], pk, tk, tk) == CallShape(64, 1, 2048, False, True, True, True)
    assert not decode.call_shape(q.astype(mx.float32), pk.astype(mx.float32), tk, tk).mma_prefix


@pytest.mark.parametrize("length", [1, 5])
def test_prefix_scores_in_blocks_agree_with_one_product(monkeypatch, length):
    q, pk, pv, *_ = make_group(5, 2, 4, 37, 4, length, 32, [0] * 5, seed=11)
    whole = spa.stacked_prefix_stats(q, pk, pv, 0.2)
    monkeypatch.setattr(spa, "SCORE_BLOCK", 2 * 37 * 3)  # 3 stacked rows per block: blocks end mid-row
    blocked = spa.stacked_prefix_stats(q, pk, pv, 0.2)
    assert all(mx.allclose(a, b, rtol=0, atol=1e-5).item() for a, b in zip(whole, blocked, strict=True))


def test_tail_scores_in_blocks_agree_with_one_product(monkeypatch):
    q, _, _, tk, tv, starts = make_group(5, 2, 4, 8, 9, 4, 32, [0, 2, 5, 8, 1], seed=12)
    mask = spa.tail_mask(starts, 4, 9)
    whole = spa.tail_partial(q, tk, tv, 0.2, mask)
    monkeypatch.setattr(spa, "SCORE_BLOCK", 8 * 4 * 9 * 2)  # two rows per block
    blocked = spa.tail_partial(q, tk, tv, 0.2, mask)
    for field in ("weighted", "peak", "total"):
        # row 3's first queries see no key: peak -inf in both
        assert mx.allclose(getattr(whole, field), getattr(blocked, field), rtol=0, atol=1e-5).item()


def test_a_long_prefill_chunk_in_blocks_equals_attention_over_copies(monkeypatch):
    """Shared prefill through the blocked plain path, every row's queries causal over its tail."""
    monkeypatch.setattr(spa, "SCORE_BLOCK", 500)
    q, pk, pv, tk, tv, starts = make_group(4, 2, 2, 60, 12, 7, 16, [0, 3, 5, 0], seed=13)
    shares = mx.array([True, True, False, True])
    got = spa.shared_prefix_attention(q, pk, pv, tk, tv, starts, 0.25, shares=shares)
    assert mx.abs(got - reference(q, pk, pv, tk, tv, starts, 0.25, None, shares)).max().item() < 1e-5


def _chunked_partials(queries, keys, values, scale, *_, **__):
    """The tensor-core kernel's contract in plain operations: one level per 64-key split, stacked."""
    levels = [spa.stacked_prefix_stats(queries, keys[:, :, a:a + 64], values[:, :, a:a + 64], scale)
              for a in range(0, keys.shape[2], 64)]
    return tuple(mx.stack([level[i] for level in levels], axis=1) for i in range(3))


@pytest.mark.parametrize("with_sinks", [False, True])
def test_the_prefill_path_around_the_kernel_equals_attention_over_copies(monkeypatch, with_sinks):
    monkeypatch.setattr(prefix_mma_kernel, "prefix_level",
                        lambda *args, **kwargs: prefix_mma_kernel.one_level(*_chunked_partials(*args, **kwargs)))
    q, pk, pv, tk, tv, starts = make_group(5, 2, 4, 150, 10, 6, 32, [0, 2, 4, 9, 1], seed=14)
    sinks = mx.random.normal((8,)) if with_sinks else None
    shares = mx.array([True, False, True, True, True])
    with decode.forced("mma_prefill"):
        got = decode.attention(q, pk, pv, tk, tv, starts, 0.2, sinks, None, shares)
    assert mx.abs(got - reference(q, pk, pv, tk, tv, starts, 0.2, sinks, shares)).max().item() < 1e-5


@pytest.mark.skipif(not mx.cuda.is_available(), reason="needs MLX's CUDA backend")
def test_the_tensor_core_prefix_takes_prefill_chunks():
    assert prefix_mma_kernel.self_check(rows=5, positions=9) < 2e-2
    assert prefix_mma_kernel.self_check(rows=64, positions=56, length=2048) < 2e-2
    assert decode.self_check()["mma_prefill"] < 2e-2


def _chain(lengths, heads=4, dim=64, seed=15):
    mx.random.seed(seed)
    spans = [tuple(mx.random.normal((1, heads, n, dim)) for _ in range(2)) for n in lengths]
    mx.eval(spans)
    return spans


@pytest.mark.parametrize("skip", [0, 100, 3000, 3001, 3100, 3101])
def test_a_tail_from_a_chains_spans_equals_the_cut_of_their_concatenation(skip):
    spans = _chain([3000, 100, 1])
    tail = tail_from_spans(spans, skip)
    whole = mx.concatenate([k for k, _ in spans], axis=2)
    assert tail.offset == 3101 - skip
    if tail.offset:
        assert mx.array_equal(tail.keys, whole[:, :, skip:]).item()
        assert mx.array_equal(tail.values, mx.concatenate([v for _, v in spans], axis=2)[:, :, skip:]).item()


def test_a_tail_from_spans_holds_no_copy_of_the_prefix():
    """The cut of a lease's assembled cache (a lazy concatenation of the whole chain) computes and keeps
    the whole chain: a copy of the prefix per row. The tail from the spans holds its own tokens only."""
    spans = [(mx.ones((1, 4, n, 64)), mx.ones((1, 4, n, 64))) for n in (60_000, 40)]  # 123 MB
    mx.eval(spans)
    base = mx.get_active_memory()
    tail = tail_from_spans(spans, 60_000)
    mx.eval(tail.keys, tail.values)
    assert mx.get_active_memory() - base < 4 * (tail.keys.nbytes + tail.values.nbytes)
    del tail
    cut = _cut_tail(spans, 60_000)
    assert mx.get_active_memory() - base > 60_000 * 4 * 64 * 4 and cut[0].shape[2] == 40  # what sharing avoids


def _cut_tail(spans, skip):
    keys, values = (mx.concatenate([span[i] for span in spans], axis=2) for i in (0, 1))
    cut = keys[:, :, skip:], values[:, :, skip:]
    mx.eval(cut)
    return cut
