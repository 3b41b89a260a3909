"""A burst's tails run packed (kv/packed_tails.py): every real token a row of one position, no padding.

The padded forward (tails left-padded to one width, engine/tail_placement.py's layout) is the oracle:
on the CPU in float32 the packed forward of the same tiny model gives the same logits at the real
cells and leaves the same K/V, offsets and write index in every layer's tail, for tails recomputed
from empty and for tails placed holding each row's own leased tokens (their padding columns kept).
"""

from __future__ import annotations

import random
from contextlib import nullcontext

import mlx.core as mx
import pytest
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

from mlxq.engine.prefix_gather import RowPrefix, own_piece
from mlxq.engine.tail_placement import layout_for, place_rows, tails_in_place
from mlxq.kv import attention_route
from mlxq.kv import shared_prefix_attention as spa
from mlxq.kv.packed_tails import PackedTailsCache, Packing, packed_positions
from mlxq.kv.shared_prefix_cache import SharedPrefixBatchCache

LENS = [7, 12, 3, 9, 12, 1]
OWN = [2, 0, 5, 1, 3, 4]  # placed tails: each row's leased tokens past the prefix, before the chunk
PREFIX = 40


@pytest.fixture
def routed(load_tiny):
    """arch -> model, its attention routed (installed after the load: the module must be imported)."""
    def load(arch):
        model = load_tiny(arch)[0]
        attention_route.install(check=False)
        return model
    try:
        yield load
    finally:
        attention_route.uninstall()


def test_a_packing_maps_tokens_to_padded_cells_and_back():
    pk = Packing.of([12 - n for n in LENS], LENS)
    assert (pk.tokens, pk.batch, pk.width) == (44, 6, 12)
    assert pk.rows.tolist() == [b for b, n in enumerate(LENS) for _ in range(n)]
    assert pk.columns.tolist() == [c for n in LENS for c in range(12 - n, 12)]
    assert pk.ends.tolist() == [6, 18, 21, 30, 42, 43]
    x = mx.random.normal((44, 3, 1, 5), key=mx.random.key(1))
    padded = pk.padded(x)
    assert padded.shape == (6, 3, 12, 5)
    assert mx.array_equal(pk.packed(padded), x).item()
    for t, (b, c) in enumerate(zip(pk.rows.tolist(), pk.columns.tolist(), strict=True)):
        assert mx.array_equal(padded[b, :, c], x[t, :, 0]).item()
    same = Packing.of([0, 0, 0], [4, 4, 4])
    assert same.columns.tolist() == [0, 1, 2, 3] * 3 and same.cells.tolist() == list(range(12))
    one = Packing.of([0], [5])
    assert one.rows.tolist() == [0] * 5 and one.ends.tolist() == [4] and one.batch == 1
    y = mx.random.normal((5, 2, 1, 3), key=mx.random.key(2))
    assert mx.array_equal(one.packed(one.padded(y)), y).item()
    with pytest.raises(ValueError):
        Packing.of([0, 1], [4, 4])  # rows ending at 4 and 5
    with pytest.raises(ValueError):
        Packing.of([4, 0], [0, 4])  # an empty row
    with pytest.raises(ValueError):
        Packing.of([-1, 0], [5, 4])  # a row longer than the grid


def prefix_kv(model, tokens):
    """Per layer the solo run's (keys, values) [1, Hkv, P, D] of ``tokens``."""
    solo = make_prompt_cache(model)
    model(mx.array([tokens]), cache=solo)
    mx.eval([c.state for c in solo])
    return [(c.keys[..., : len(tokens), :], c.values[..., : len(tokens), :]) for c in solo], solo


def targets(model, prefix, placed):
    """(per layer a SharedPrefixBatchCache over ``prefix``, layout): tails empty (recomputed) or placed
    holding each row's OWN tokens past the prefix, as engine/shared_tails.py builds them."""
    kv = prefix_kv(model, prefix)[0]
    if placed:
        rows = [RowPrefix((own_piece(prefix_kv(model, prefix + list(range(200, 200 + n)))[1]),), n, skip=PREFIX)
                for n in OWN]
        tails, layout = place_rows(rows, LENS, BatchKVCache.step)
    else:
        layout = layout_for([0] * len(LENS), LENS, BatchKVCache.step)
        tails = []
        for k, v in kv:
            tail = BatchKVCache(layout.padding)
            tail.keys, tail.values = (mx.zeros((len(LENS), a.shape[1], layout.capacity, a.shape[3])) for a in (k, v))
            tails.append(tail)
    mx.eval([(t.keys, t.values) for t in tails])
    return [SharedPrefixBatchCache.grouped([layer], tail, [0] * len(LENS)) for layer, tail in zip(kv, tails,
                                                                                                   strict=True)], layout


@pytest.mark.parametrize("placed", [False, True])
def test_each_token_gets_the_position_the_padded_forward_gives_its_cell(load_tiny, placed):
    caches, layout = targets(load_tiny("llama")[0], list(range(10, 10 + PREFIX)), placed)
    pk = Packing.of(layout.chunk_padding, LENS)
    own = OWN if placed else [0] * len(LENS)
    want = [PREFIX + own[b] + j for b, n in enumerate(LENS) for j in range(n)]  # the row's solo positions
    target = caches[0]
    assert packed_positions(target, pk).tolist() == want
    assert want == [target.offset[b].item() + c for b, c in zip(pk.rows.tolist(), pk.columns.tolist(), strict=True)]


def forwards(model, placed, tails):
    """(padded logits, packed logits) at the real cells, both forwards' caches (each on fresh targets),
    the layout, the packing and the packed targets' tails as they were before the forward."""
    prefix = list(range(10, 10 + PREFIX))
    padded, layout = targets(model, prefix, placed)
    packed, _ = targets(model, prefix, placed)
    pk = Packing.of(layout.chunk_padding, LENS)
    tokens = mx.array([[0] * p + t for p, t in zip(layout.chunk_padding, tails, strict=True)])
    with tails_in_place([c.tail for c in padded], layout) if placed else nullcontext():
        lp = model(tokens, cache=padded)
    positions = packed_positions(packed[0], pk)
    before = [(mx.array(c.tail.keys), mx.array(c.tail.values)) for c in packed]
    with tails_in_place([c.tail for c in packed], layout) if placed else nullcontext():
        lk = model(mx.array([[x] for t in tails for x in t]), cache=[PackedTailsCache(c, pk, positions)
                                                                     for c in packed])
    mx.eval(lp, lk, [(c.tail.keys, c.tail.values) for c in padded + packed])
    return lp[pk.rows, pk.columns], lk[:, 0], padded, packed, layout, pk, before


def tails_of(seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(n)] for n in LENS]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("placed", [False, True])
def test_the_packed_forward_is_the_padded_forward(routed, arch, placed):
    model = routed(arch)
    want, got, padded, packed, layout, pk, before = forwards(model, placed, tails_of())
    assert mx.array_equal(want, got).item(), mx.abs(want - got).max().item()
    real = lambda x: x[pk.rows, :, pk.columns + layout.start, :]  # noqa: E731
    for a, b, kept in zip(padded, packed, before, strict=True):
        assert a.tail.offset.tolist() == b.tail.offset.tolist() and a.tail._idx == b.tail._idx
        assert mx.array_equal(real(a.tail.keys), real(b.tail.keys)).item()
        assert mx.array_equal(real(a.tail.values), real(b.tail.values)).item()
        if placed:  # every cell, the padding columns (the leased tokens) included
            assert mx.array_equal(a.tail.keys, b.tail.keys).item()
            assert mx.array_equal(a.tail.values, b.tail.values).item()
            for row, pad in enumerate(layout.chunk_padding):  # the chunk's padding kept what it held
                cut = slice(layout.start, layout.start + pad)
                assert all(mx.array_equal(x[row, :, cut], y[row, :, cut]).item()
                           for x, y in zip((b.tail.keys, b.tail.values), kept, strict=True))


def test_prefix_and_tails_in_score_blocks_give_the_same_logits(routed, monkeypatch):
    model = routed("llama")
    whole = forwards(model, False, tails_of(1))[0]
    monkeypatch.setattr(spa, "SCORE_BLOCK", 64)  # one stacked row (or one tail row) per block
    want, got = forwards(model, False, tails_of(1))[:2]
    assert mx.array_equal(want, got).item()  # the padded forward cut in the same blocks: the same bits
    # Against the unblocked product only 1e-5, not 1e-6: a BLAS product of one or two stacked rows
    # rounds apart from one of all rows (here 3.6e-6 in the logits, the padded forward's as much; as in
    # tests/kv/test_shared_prefix_prefill.py's blocked prefix scores), nothing the packing does.
    assert mx.allclose(whole, got, rtol=0, atol=1e-5).item()


def unit(kv_heads=2, heads=4, dim=16):
    """(fresh target maker, packing, queries, keys, values, prefix) of random arrays for one layer."""
    normal = lambda *shape, seed: mx.random.normal(shape, key=mx.random.key(seed))  # noqa: E731
    layout = layout_for([0] * len(LENS), LENS, 256)
    prefix = (normal(1, kv_heads, 37, dim, seed=5), normal(1, kv_heads, 37, dim, seed=6))

    def target(prefixes=(prefix,), row_groups=None):
        row_groups = row_groups or [0] * len(LENS)
        tail = BatchKVCache(layout.padding)
        tail.keys, tail.values = (mx.zeros((len(LENS), kv_heads, layout.capacity, dim)) for _ in "kv")
        return SharedPrefixBatchCache.grouped(list(prefixes), tail, list(row_groups))

    tokens = sum(LENS)
    return (target, Packing.of(layout.chunk_padding, LENS), normal(tokens, heads, 1, dim, seed=7),
            normal(tokens, kv_heads, 1, dim, seed=8), normal(tokens, kv_heads, 1, dim, seed=9), prefix)


def test_attention_with_sinks_is_the_padded_rows_at_their_real_cells():
    target, pk, q, k, v, _ = unit()
    sinks = mx.random.normal((4,), key=mx.random.key(10))
    padded = target()
    keys, values = padded.update_and_fetch(pk.padded(k), pk.padded(v))
    want = pk.packed(padded.attend(pk.padded(q), keys, values, 0.25, sinks))
    cache = PackedTailsCache(target(), pk, packed_positions(padded, pk))
    keys, values = cache.update_and_fetch(k, v)
    got = cache.attend(q, keys, values, 0.25, sinks)
    assert got.shape == q.shape and mx.array_equal(want, got).item()
    assert not mx.allclose(got, cache.attend(q, keys, values, 0.25), rtol=0, atol=1e-3).item()  # sinks count


def test_only_one_group_of_sharing_rows_and_its_own_fetched_keys_are_taken():
    target, pk, q, k, v, prefix = unit()
    positions = mx.zeros((pk.tokens,), mx.int32)
    other = tuple(a + 1 for a in prefix)
    with pytest.raises(ValueError):
        PackedTailsCache(target((prefix, other), (0, 1, 0, 0, 1, 0)), pk, positions)
    with pytest.raises(ValueError):
        PackedTailsCache(target(row_groups=(0, -1, 0, 0, 0, 0)), pk, positions)
    cache = PackedTailsCache(target(), pk, positions)
    with pytest.raises(ValueError):  # nothing fetched yet
        cache.attend(q, pk.padded(k), pk.padded(v), 0.25)
    keys, values = cache.update_and_fetch(k, v)
    assert keys.shape == (len(LENS), 2, 12, 16) and cache.make_mask(1) is None
    with pytest.raises(ValueError):
        cache.attend(q, mx.array(keys), values, 0.25)  # equal values, another array


def test_the_route_sends_packed_tails_to_their_attention(monkeypatch):
    target, pk, q, k, v, _ = unit()
    cache = PackedTailsCache(target(), pk, mx.zeros((pk.tokens,), mx.int32))
    keys, values = cache.update_and_fetch(k, v)

    def elsewhere(*args, **kwargs):
        raise AssertionError("a packed tails' attention went past its cache")

    monkeypatch.setattr(attention_route, "_previous", lambda: elsewhere)
    got = attention_route.route(q, keys, values, cache=cache, scale=0.25, mask=None)
    assert mx.array_equal(got, cache.attend(q, keys, values, 0.25)).item()
