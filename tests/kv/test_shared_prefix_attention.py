"""Shared-prefix attention (kv/shared_prefix_attention.py) equals attention over each row's own copy.

The oracle is MLX's attention (mlx-lm's entry point calls mx.fast.scaled_dot_product_attention) over
the concatenated per-row K/V [prefix ; row's tail] with the left padding masked, on CPU in float32.
A hypothesis sweep covers rows, heads, GQA ratios, prefix and tail lengths, query lengths (decode and
prefill chunks), padding, sinks and rows outside the group. Measured max difference over 300 random
shapes (prefix up to 300 keys): 8.3e-7; the bound is 1e-5.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlxq.kv.shared_prefix_attention import (
    merge,
    prefix_partial,
    shared_prefix_attention,
    stacked_prefix_stats,
    tail_partial,
)

TOLERANCE = 1e-5


def reference(queries, prefix_k, prefix_v, tail_k, tail_v, starts, scale, sinks=None, shares=None):
    """MLX's attention over every row's own copy of the prefix followed by its tail (rows with
    ``shares`` False: over their tail alone)."""
    rows = queries.shape[0]
    keys = mx.concatenate([mx.repeat(prefix_k, rows, axis=0), tail_k], axis=2)
    values = mx.concatenate([mx.repeat(prefix_v, rows, axis=0), tail_v], axis=2)
    length, prefix, span = queries.shape[2], prefix_k.shape[2], keys.shape[2]
    columns = mx.arange(span)
    causal = mx.arange(span - length, span)[:, None] >= columns[None, :]
    in_prefix = columns[None, :] < prefix
    if shares is not None:
        in_prefix = in_prefix & shares[:, None]
    own = in_prefix | (columns[None, :] >= (prefix + starts)[:, None])  # [B, S]
    mask = causal[None, None] & own[:, None, None, :]
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)


def make_group(rows, kv_heads, group, prefix, tail, length, dim, starts, seed, dtype=mx.float32):
    mx.random.seed(seed)
    q = mx.random.normal((rows, kv_heads * group, length, dim)).astype(dtype)
    pk, pv = (mx.random.normal((1, kv_heads, prefix, dim)).astype(dtype) for _ in range(2))
    tk, tv = (mx.random.normal((rows, kv_heads, tail, dim)).astype(dtype) for _ in range(2))
    return q, pk, pv, tk, tv, mx.array(starts)


@st.composite
def groups(draw):
    rows = draw(st.integers(1, 6))
    kv_heads = draw(st.integers(1, 3))
    group = draw(st.sampled_from([1, 2, 4]))
    prefix = draw(st.integers(1, 40))
    tail = draw(st.integers(1, 24))
    length = draw(st.integers(1, min(tail, 5)))
    # a row's own keys start anywhere at or before its first query (padding may reach into the queries)
    starts = draw(st.lists(st.integers(0, tail - 1), min_size=rows, max_size=rows))
    dim = draw(st.sampled_from([8, 32, 64]))
    sinks = draw(st.booleans())
    # rows outside the group (no prefix) see at least their own first query's key
    shares = draw(st.one_of(st.none(), st.lists(st.booleans(), min_size=rows, max_size=rows)))
    if shares is not None:
        starts = [s if share else min(s, tail - length) for s, share in zip(starts, shares, strict=True)]
    return rows, kv_heads, group, prefix, tail, length, dim, starts, sinks, shares, draw(st.integers(0, 1 << 16))


@settings(max_examples=60, deadline=None)
@given(groups())
def test_equals_attention_over_per_row_copies(case):
    rows, kv_heads, group, prefix, tail, length, dim, starts, with_sinks, shares, seed = case
    q, pk, pv, tk, tv, st_ = make_group(rows, kv_heads, group, prefix, tail, length, dim, starts, seed)
    sinks = mx.random.normal((kv_heads * group,)) if with_sinks else None
    shares = None if shares is None else mx.array(shares)
    scale = dim**-0.5
    got = shared_prefix_attention(q, pk, pv, tk, tv, st_, scale, sinks, shares=shares)
    want = reference(q, pk, pv, tk, tv, st_, scale, sinks, shares)
    assert got.shape == want.shape and got.dtype == q.dtype
    assert mx.abs(got - want).max().item() < TOLERANCE


def test_the_prefix_is_one_matrix_per_kv_head_for_the_whole_group():
    """The prefix partial of a group equals each row's own prefix partial (rows stacked, not looped)."""
    q, pk, pv, *_ = make_group(5, 2, 4, 33, 4, 1, 32, [0] * 5, seed=3)
    together = prefix_partial(q, pk, pv, 0.2)
    for row in range(5):
        alone = prefix_partial(q[row:row + 1], pk, pv, 0.2)
        for a, b in ((together.weighted, alone.weighted), (together.peak, alone.peak),
                     (together.total, alone.total)):
            assert mx.abs(a[row:row + 1] - b).max().item() < 1e-6


def test_a_padding_query_that_sees_no_tail_key_weighs_the_tail_zero():
    """A fully masked tail level has peak -inf: the merge gives the prefix alone, never NaN."""
    q, pk, pv, tk, tv, _ = make_group(2, 1, 2, 9, 6, 3, 16, [0, 0], seed=5)
    none = mx.zeros((2, 1, 3, 6), mx.bool_)
    merged = merge([prefix_partial(q, pk, pv, 0.25), tail_partial(q, tk, tv, 0.25, none)])
    want = mx.fast.scaled_dot_product_attention(q, mx.repeat(pk, 2, 0), mx.repeat(pv, 2, 0), scale=0.25)
    assert not mx.isnan(merged).any().item()
    assert mx.abs(merged - want).max().item() < TOLERANCE


@pytest.mark.parametrize("dtype, bound", [(mx.bfloat16, 2e-2), (mx.float16, 4e-3)])
def test_half_precision_stays_at_rounding_level(dtype, bound):
    """Scores and values in the input dtype, softmax statistics and the merge in float32."""
    q, pk, pv, tk, tv, starts = make_group(4, 2, 4, 200, 20, 1, 64, [0, 3, 11, 19], seed=9, dtype=dtype)
    got = shared_prefix_attention(q, pk, pv, tk, tv, starts, 0.125).astype(mx.float32)
    want = reference(*(x.astype(mx.float32) for x in (q, pk, pv, tk, tv)), starts, 0.125)
    assert mx.abs(got - want).max().item() < bound


def test_the_path_is_decided_from_the_group_shape(monkeypatch):
    """Plain ops wherever the kernels are off (CPU, Metal, before the CUDA self-check); with them on,
    one kernel for small groups and prefix GEMMs + tail kernel from 32k group tokens (H200 figures);
    the scheduler's gate asks for 128k (16 x 2k lost end to end, 64 x 2k won in whole-model steps)."""
    from mlxq.kv import shared_prefix_decode as decode

    def shapes(rows, prefix):
        return mx.zeros((rows, 8, 1, 128)), mx.zeros((1, 2, prefix, 128)), mx.zeros((rows, 2, 5, 128))

    q, pk, tk = shapes(8, 2048)
    assert decode.choose(q, pk, tk, tk) == "ops" and not decode.worth_sharing(64, 16384)
    monkeypatch.setattr(decode, "_kernels", frozenset({"full", "split"}))
    assert decode.choose(q, pk, tk, tk) == "full" and not decode.worth_sharing(8, 2048)
    q, pk, tk = shapes(16, 2048)
    assert decode.choose(q, pk, tk, tk) == "split" and not decode.worth_sharing(16, 2048)
    assert decode.worth_sharing(64, 2048) and decode.worth_sharing(16, 12288)
    assert decode.choose(mx.zeros((16, 8, 2, 128)), pk, tk, tk) == "ops"  # a prefill chunk: two queries a row
    with pytest.raises(ValueError, match="unknown path"), decode.forced("fastest"):
        pass


def test_bf16_groups_from_the_mma_threshold_take_the_tensor_core_prefix(monkeypatch):
    """The mma prefix once its self-checks passed: bf16 only (float32 keeps the other kernels), one query
    per row, from MMA_MIN_GROUP_TOKENS group tokens on; its tails through the gqa kernel (measured faster
    on the H200 at every such shape) where that path's check passed and the kernel takes the head group,
    else through the split path's tail kernel."""
    from mlxq.kv import shared_prefix_decode as decode

    def shapes(rows, prefix, dtype=mx.bfloat16, heads=32):
        return (mx.zeros((rows, heads, 1, 128), dtype), mx.zeros((1, 8, prefix, 128), dtype),
                mx.zeros((rows, 8, 5, 128), dtype))

    monkeypatch.setattr(decode, "_kernels", frozenset({"full", "split", "gqa", "mma", "mma_gqa"}))
    rows = 64
    q, pk, tk = shapes(rows, decode.MMA_MIN_GROUP_TOKENS // rows)
    assert decode.choose(q, pk, tk, tk) == "mma_gqa"
    q, pk, tk = shapes(rows, decode.MMA_MIN_GROUP_TOKENS // rows - 64)
    assert decode.choose(q, pk, tk, tk) == "gqa"
    q, pk, tk = shapes(16, 12288)
    assert decode.choose(q, pk, tk, tk) == "mma_gqa"
    q, pk, tk = shapes(rows, 16384, mx.float32)
    assert decode.choose(q, pk, tk, tk) == "split"
    q, pk, tk = shapes(rows, 16384, heads=8 * 32)  # 32 query heads per KV head: wider than the gqa kernel holds
    assert decode.choose(q, pk, tk, tk) == "mma"
    monkeypatch.setattr(decode, "_kernels", frozenset({"full", "split", "gqa", "mma"}))
    q, pk, tk = shapes(rows, 16384)
    assert decode.choose(q, pk, tk, tk) == "mma"
    monkeypatch.setattr(decode, "_kernels", frozenset({"full", "split"}))
    assert decode.choose(q, pk, tk, tk) == "split"


def test_a_caches_route_is_worked_out_again_only_when_its_inputs_change(monkeypatch):
    """``RouteMemo`` (one per shared-prefix cache) gives what ``choose`` gives: again for a new shape
    of the queries (rows, or a prefill chunk) or a new set of passing kernels, and ``forced`` wins."""
    from mlxq.kv import shared_prefix_decode as decode

    def shapes(rows, own=5):
        return (mx.zeros((rows, 32, 1, 128), mx.bfloat16), mx.zeros((1, 8, 2048, 128), mx.bfloat16),
                mx.zeros((rows, 8, own, 128), mx.bfloat16))

    memo = decode.RouteMemo()
    q, pk, tk = shapes(64)
    assert memo.choose(q, pk, tk, tk) == "ops"  # the kernels are off
    monkeypatch.setattr(decode, "_kernels", frozenset({"full", "split", "gqa", "mma", "mma_gqa"}))
    assert memo.choose(q, pk, tk, tk) == decode.choose(q, pk, tk, tk) == "mma_gqa"
    q, _, tk = shapes(64, own=6)  # the next step: only the tails grew
    assert memo.choose(q, pk, tk, tk) == "mma_gqa"
    q, _, tk = shapes(16)
    assert memo.choose(q, pk, tk, tk) == decode.choose(q, pk, tk, tk) == "gqa"
    chunk = mx.zeros((16, 32, 3, 128), mx.bfloat16)
    assert memo.choose(chunk, pk, tk, tk) == decode.choose(chunk, pk, tk, tk) == "ops"
    with decode.forced("split"):
        assert memo.choose(q, pk, tk, tk) == "split"
    assert memo.choose(q, pk, tk, tk) == "gqa"


@pytest.mark.parametrize("errors, mma_partials, passed", [
    ({"full": 0.005, "split": 0.004, "gqa": 0.006, "mma": 0.006, "mma_gqa": 0.005}, True,
     {"full", "split", "gqa", "mma", "mma_gqa"}),
    ({"full": 0.005, "split": 0.004, "gqa": 0.006, "mma": 0.006, "mma_gqa": float("inf")}, True,
     {"full", "split", "gqa", "mma"}),  # the gqa kernel did not build with levels: the others stay
    ({"full": 0.005, "split": 0.004, "gqa": 0.5, "mma": 0.006, "mma_gqa": 0.005}, True, {"full", "split", "mma"}),
    ({"full": 0.005, "split": 0.004, "gqa": 0.006, "mma": 0.006, "mma_gqa": 0.005}, False,
     {"full", "split", "gqa"}),  # the tensor-core kernel's own check failed
    ({"full": 0.005, "split": 0.004, "gqa": 0.006}, True, {"full", "split", "gqa"}),  # float16: no mma
    ({"full": 0.5, "split": 0.004, "gqa": 0.006, "mma": 0.006, "mma_gqa": 0.005}, True, set()),
])
def test_each_kernel_path_runs_only_where_its_self_check_passed(errors, mma_partials, passed):
    from mlxq.kv.shared_prefix_decode import passing_paths

    assert passing_paths(errors, mma_partials) == passed


def test_the_start_up_self_check_covers_every_kernel_path():
    """enable() checks bf16 (the serving dtype) on every kernel path ``choose`` may return, and all of
    them passing enables all of them; on the CPU nothing is enabled."""
    from mlxq.kv import shared_prefix_decode as decode

    kernel_paths = set(decode.PATHS) - {"ops"}
    assert set(decode.checked_paths(mx.bfloat16)) == kernel_paths
    assert decode.passing_paths(dict.fromkeys(decode.checked_paths(mx.bfloat16), 0.0), True) == kernel_paths
    assert "mma_gqa" not in decode.checked_paths(mx.float32)  # the tensor-core kernel takes bf16 only
    if not mx.cuda.is_available():
        assert not decode.enable() and not decode.is_enabled()


@pytest.mark.parametrize("block_rows", [64, 128, 256])
@pytest.mark.parametrize("rows, kv_heads, length, target", [
    (256, 8, 2048, 264), (256, 8, 16384, 264), (64, 8, 12288, 264), (4, 2, 333, 264), (76, 8, 1000, 1),
    (2048, 8, 64, 264), (1, 1, 1, 264), (14848, 8, 16018, 264)])
def test_the_prefix_splits_cover_every_key_once_in_whole_staged_blocks(rows, kv_heads, length, target, block_rows):
    """Every split of the tensor-core kernel has a key (its peak is finite), chunks are whole blocks of
    staged keys, and the launch stays near its target number of blocks unless the prefix is too short."""
    from mlxq.kv.prefix_mma_kernel import KEYS_PER_BLOCK, split_plan

    chunk, splits = split_plan(rows, kv_heads, length, target, block_rows=block_rows)
    assert chunk % KEYS_PER_BLOCK == 0 and (splits - 1) * chunk < length <= splits * chunk
    blocks = splits * -(-rows // block_rows) * kv_heads
    assert blocks <= max(target, -(-rows // block_rows) * kv_heads) * 2
    assert splits == 1 or blocks >= target // 2 or chunk == KEYS_PER_BLOCK


def test_the_kernel_cuts_fit_a_block():
    """Every cut the kernel takes by default stages whole softmax steps of whole 16-key products, the
    keys of a chunk in whole staged blocks, and fits the H200's shared memory per block (227 KiB)."""
    from mlxq.kv.prefix_mma_kernel import DECODE_TILING, HEAD_DIMS, KEYS_PER_BLOCK, PREFILL_TILING, Tiling

    for tiling in (PREFILL_TILING, DECODE_TILING, Tiling()):
        sub = tiling.sub or tiling.keys
        assert sub % 16 == 0 and tiling.keys % sub == 0 and KEYS_PER_BLOCK % tiling.keys == 0
        assert tiling.stages >= 2 and tiling.rows == 16 * tiling.tiles * tiling.warps
        assert all(tiling.shared_bytes(dim) <= 227 * 1024 for dim in HEAD_DIMS)
    assert Tiling(4, 2, 32, 3, True).shared_bytes(128) == (2 * 3 * 32 + 128) * 136 * 2


@pytest.mark.skipif(not mx.cuda.is_available(), reason="needs MLX's CUDA backend")
def test_the_cuda_kernels_match_the_plain_path():
    """Measured on the H200: float32 9.2e-5 (one kernel) / 1.5e-7 (split) / 9.2e-5 (gqa); bf16 4.9e-3 /
    2.0e-3 / 4.9e-3."""
    from mlxq.kv import shared_prefix_decode

    assert max(shared_prefix_decode.self_check(mx.float32).values()) < 2e-4
    assert max(shared_prefix_decode.self_check(mx.bfloat16).values()) < 2e-2
    assert shared_prefix_decode.grouped_self_check(mx.float32) < 2e-4  # not run on a device yet
    assert shared_prefix_decode.grouped_self_check(mx.bfloat16) < 2e-2


@pytest.mark.skipif(not mx.cuda.is_available(), reason="needs MLX's CUDA backend")
def test_the_tensor_core_prefix_kernel_matches_the_stacked_gemms():
    from mlxq.kv import prefix_mma_kernel

    assert prefix_mma_kernel.self_check() < 2e-2
    assert prefix_mma_kernel.self_check(rows=64, heads=32, kv_heads=8, length=2048) < 2e-2
    assert prefix_mma_kernel.self_check(rows=3, heads=8, kv_heads=2, length=100, dim=64) < 2e-2
    for tiling in (prefix_mma_kernel.PREFILL_TILING, prefix_mma_kernel.DECODE_TILING, prefix_mma_kernel.Tiling(),
                   prefix_mma_kernel.Tiling(warps=8, tiles=2, keys=64, sub=32)):
        assert prefix_mma_kernel.self_check(rows=70, tiling=tiling) < 2e-2
        assert prefix_mma_kernel.self_check(rows=3, heads=8, kv_heads=2, length=100, dim=64, tiling=tiling) < 2e-2
        assert prefix_mma_kernel.self_check(rows=5, positions=9, tiling=tiling) < 2e-2


@pytest.mark.skipif(not mx.cuda.is_available(), reason="needs MLX's CUDA backend")
def test_the_mma_path_with_gqa_tails_matches_the_plain_path():
    """Measured on the H200 in the per-layer benchmark: 0.0005-0.002 in bf16, as the other paths."""
    from mlxq.kv import shared_prefix_decode

    q, pk, pv, tk, tv, starts, scale = shared_prefix_decode._check_inputs(mx.bfloat16)
    want = shared_prefix_attention(q, pk, pv, tk, tv, starts, scale).astype(mx.float32)
    with shared_prefix_decode.forced("mma_gqa"):
        got = shared_prefix_decode.attention(q, pk, pv, tk, tv, starts, scale).astype(mx.float32)
    assert mx.abs(got - want).max().item() < 2e-2


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_triples_equal_mlx_lm_quantized_attention_over_copies(bits):
    """--kv-quant: both products through mx.quantized_matmul; the oracle is mlx-lm's quantized
    attention over per-row concatenated triples with the padding masked (measured 1.5e-7)."""
    from mlx_lm.models import base

    from mlxq.kv.shared_prefix_attention import Quant

    rows, prefix, tail = 4, 90, 10
    q, pk, pv, tk, tv, starts = make_group(rows, 2, 2, prefix, tail, 1, 64, [0, 3, 9, 1], seed=11)
    pk, pv, tk, tv = (tuple(mx.quantize(x, group_size=64, bits=bits)) for x in (pk, pv, tk, tv))
    got = shared_prefix_attention(q, pk, pv, tk, tv, starts, 0.125, quant=Quant(64, bits))
    keys, values = (tuple(mx.concatenate([mx.repeat(a, rows, 0), b], axis=2) for a, b in zip(p, t, strict=True))
                    for p, t in ((pk, tk), (pv, tv)))
    columns = mx.arange(prefix + tail)[None, :]
    own = (columns < prefix) | (columns >= (prefix + starts)[:, None])
    want = base.quantized_scaled_dot_product_attention(mx.array(q), keys, values, 0.125, own[:, None, None, :],
                                                       64, bits)
    assert mx.abs(got - want).max().item() < TOLERANCE


def test_split_prefix_levels_merge_to_the_whole_prefix():
    """The flash-decoding identity the tensor-core kernel relies on: the prefix cut into chunks, each
    chunk's level (its own peak) stacked along a split axis, merges to the whole prefix's level."""
    from mlxq.kv.prefix_mma_kernel import merged
    from mlxq.kv.shared_prefix_attention import stacked_prefix_stats

    q, pk, pv, _, _, _ = make_group(5, 8, 2, 300, 4, 1, 64, [0, 1, 2, 3, 0], seed=4)
    weighted, _, total = stacked_prefix_stats(q, pk, pv, 0.125)
    levels = [stacked_prefix_stats(q, pk[:, :, a:a + 64], pv[:, :, a:a + 64], 0.125) for a in range(0, 300, 64)]
    got = merged(*(mx.stack([level[i] for level in levels], axis=1) for i in range(3)))
    assert mx.abs(got - weighted / total).max().item() < 1e-6


def _plain_launch(queries, keys, values, scale, tiling, chunk, splits, first_row, launch_rows):
    """The kernel launch's contract in plain operations: its rows' level per chunk of keys."""
    levels = [stacked_prefix_stats(queries, keys[:, :, s * chunk:(s + 1) * chunk],
                                   values[:, :, s * chunk:(s + 1) * chunk], scale) for s in range(splits)]
    return tuple(mx.stack([level[i][:, first_row:first_row + launch_rows] for level in levels], axis=1)
                 for i in range(3))


def test_the_self_check_compares_every_launch_it_makes(monkeypatch):
    """With the launches in plain operations the kernel's self-check finds only rounding (its
    bookkeeping: splits, the stacked order)."""
    from mlxq.kv import prefix_mma_kernel

    monkeypatch.setattr(prefix_mma_kernel, "_launch", _plain_launch)
    assert prefix_mma_kernel.self_check(rows=3, heads=8, kv_heads=2, length=100, dim=64) < 2e-2
    assert prefix_mma_kernel.self_check(rows=5, heads=8, kv_heads=2, length=300, dim=64, positions=9) < 2e-2
