"""Every row's prefix written by one gather per layer from the stored pieces it is made of (engine/prefix_gather.py).

The merged batch a cached burst's tails run on must hold, for each row, exactly
its prefix (the concatenation of its pieces, cut to its length) at its left
padding and zeros elsewhere; in the scheduler, rows that lease different
chains of the prompt cache's tree are read from the chains' spans (the lease's
own caches never built), and every row's greedy tokens are still the serial
lane's.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from mlxq.engine import tail_placement
from mlxq.engine.prefix_gather import Piece, RowPrefix, _distinct, gather_prefixes, own_piece
from mlxq.store import prompt_cache
from tests.engine.test_shared_prefill import serial_with_cache
from tests.engine.test_wave_join import run_wave, token0_scheduler, wave


def _piece(tokens: int, layers: int = 2) -> Piece:
    return Piece([(mx.random.normal((1, 3, tokens, 8)), mx.random.normal((1, 3, tokens, 8))) for _ in range(layers)])


def test_each_row_holds_its_pieces_cut_to_its_length_at_its_padding_and_zeros_elsewhere():
    system, a, b = _piece(11), _piece(4), _piece(6)
    prefixes = [RowPrefix((system, a), 13), RowPrefix((system,), 9), RowPrefix((system, b), 17),
                RowPrefix((b,), 6), RowPrefix((), 0)]
    padding, capacity = [5, 0, 2, 1, 0], 24
    out = gather_prefixes(prefixes, padding, capacity)
    assert len(out) == 2
    for layer, (keys, values) in enumerate(out):
        assert keys.shape == values.shape == (5, 3, capacity, 8)
        for row, (prefix, pad) in enumerate(zip(prefixes, padding, strict=True)):
            for name, got in ((0, keys), (1, values)):
                parts = [p.spans[layer][name] for p in prefix.pieces]
                want = mx.zeros((1, 3, capacity, 8))
                if parts:
                    whole = mx.concatenate(parts, axis=2)[..., : prefix.length, :]
                    want[..., pad : pad + prefix.length, :] = whole
                assert mx.array_equal(got[row : row + 1], want).item(), (layer, row, name)


def test_rows_past_a_prefix_they_skip_read_only_the_pieces_after_it():
    system, a, b = _piece(11), _piece(4), _piece(6)
    prefixes = [RowPrefix((system, a), 3, skip=12), RowPrefix((system, b), 6, skip=11),
                RowPrefix((system, a), 5, skip=9)]
    padding, capacity = [3, 0, 1], 8
    assert [p.width for p in _distinct(prefixes)[0]] == [4, 6, 11]  # the system prompt pooled once, after a, b
    assert [p.width for p in _distinct(prefixes[:2])[0]] == [4, 6]  # ... and not at all when no row reads it
    nothing = gather_prefixes([RowPrefix((system,), 0, skip=11), RowPrefix((system, a), 0, skip=15)], [0, 0], 4)
    assert [k.shape for k, _ in nothing] == [(2, 3, 4, 8)] * 2 and not any(mx.any(k).item() for k, _ in nothing)
    for layer, (keys, _) in enumerate(gather_prefixes(prefixes, padding, capacity)):
        for row, (prefix, pad) in enumerate(zip(prefixes, padding, strict=True)):
            whole = mx.concatenate([p.spans[layer][0] for p in prefix.pieces], axis=2)
            want = mx.zeros((1, 3, capacity, 8))
            want[..., pad : pad + prefix.length, :] = whole[..., prefix.skip : prefix.skip + prefix.length, :]
            assert mx.array_equal(keys[row : row + 1], want).item(), (layer, row)


def test_a_rows_own_caches_are_a_piece_read_up_to_its_offset(load_tiny):
    model, _ = load_tiny("llama")
    caches = make_prompt_cache(model)
    model(mx.array([[5, 6, 7, 8, 9]]), cache=caches)
    mx.eval([c.state for c in caches])
    out = gather_prefixes([RowPrefix((own_piece(caches),), 5)], [3], 16)
    for (keys, values), cache in zip(out, caches, strict=True):
        assert mx.array_equal(keys[0:1, :, 3:8], cache.keys[..., :5, :]).item()
        assert mx.array_equal(values[0:1, :, 3:8], cache.values[..., :5, :]).item()
        assert not mx.any(keys[:, :, :3]).item() and not mx.any(keys[:, :, 8:]).item()


def test_rows_leasing_different_stored_chains_are_read_from_their_spans_and_match_the_serial_lane(load_tiny,
                                                                                                  monkeypatch):
    model, tokenizer, shared, scheduler, finished = token0_scheduler(load_tiny)
    # The second wave's questions begin as the first wave's do ("Agent number ..."): each row leases the
    # system prompt plus part of a stored question, a different chain of the tree per row.
    cold, cached = wave(tokenizer, shared, "cold", 4, "Agent"), wave(tokenizer, shared, "cached", 4, "Agent")
    run_wave(scheduler, cold)
    gathered = []
    real = tail_placement.gather_prefixes
    monkeypatch.setattr(tail_placement, "gather_prefixes", lambda *args: gathered.append(args[0]) or real(*args))
    built = []
    assemble = prompt_cache.assemble
    monkeypatch.setattr(prompt_cache, "assemble", lambda *args: built.append(args[3]) or assemble(*args))
    run_wave(scheduler, cached)
    assert len(gathered) == 1  # one merge for the wave's tails
    assert built == []  # no lease's caches were built: the gather read the stored spans
    prefixes = gathered[0]
    cached_tokens = [finished[r.request_id][1] for r in cached]
    assert [p.length for p in prefixes] == cached_tokens
    assert len({p.length for p in prefixes}) > 1 and min(cached_tokens) > len(shared)  # different chains
    system = prefixes[0].pieces[0]
    for prefix in prefixes:
        assert len(prefix.pieces) > 1 and prefix.pieces[0].spans is system.spans  # the stored nodes' spans, one shared
        node_spans = {id(p.spans) for p in prefix.pieces}
        assert len(node_spans) == len(prefix.pieces)
    expected = serial_with_cache(model, tokenizer, cold + cached)
    for r in cold + cached:
        assert finished[r.request_id][0] == expected[r.request_id][0], r.request_id


def test_the_slotted_index_names_each_columns_piece_and_its_column_within_it():
    """The index the in-place kernel reads ((piece << bits) | column, -1 for zeros) points at the same
    head vector as the pool's column index, for pieces of many widths (decoded here as the kernel does)."""
    import numpy as np

    from mlxq.engine import prefix_gather as g

    own = [_piece(1 + r % 3, layers=1) for r in range(40)]
    system = _piece(23, layers=1)
    prefixes = [RowPrefix((system, o), 2 + r % 3, skip=22) for r, o in enumerate(own)] + [RowPrefix((system,), 23)]
    padding = [r % 4 for r in range(len(prefixes))]
    pieces, offsets = _distinct(prefixes)
    index = g._Index(g._column_index(prefixes, offsets, padding, 32), [p.width for p in pieces])
    coded, widths = (np.array(a) for a in index.slotted())
    assert widths.shape == (g.SLOTS,) and list(widths[: len(pieces)]) == [p.width for p in pieces]
    pool = np.array(mx.concatenate([p.spans[0][0] for p in pieces], axis=2))
    for row, col in zip(*np.nonzero(index.columns >= 0), strict=True):
        piece, column = coded[row, col] >> g._COLUMN_BITS, coded[row, col] & ((1 << g._COLUMN_BITS) - 1)
        assert column < widths[piece]
        assert np.array_equal(np.array(pieces[piece].spans[0][0])[0, :, column], pool[0, :, index.columns[row, col]])
    assert ((coded < 0) == (index.columns < 0)).all()


def test_on_cuda_the_in_place_kernel_equals_take_for_a_cached_bursts_pieces():
    import pytest

    from mlxq.engine import prefix_gather as g

    if not mx.cuda.is_available():
        pytest.skip("needs MLX's CUDA backend")
    assert g.kernel_agrees(mx.bfloat16, 128, slotted=True)
    system = Piece([tuple(mx.random.normal((1, 8, 300, 128)).astype(mx.bfloat16) for _ in range(2))])
    own = [Piece([tuple(mx.random.normal((1, 8, 2, 128)).astype(mx.bfloat16) for _ in range(2))]) for _ in range(70)]
    for prefixes in ([RowPrefix((system, o), 302) for o in own], [RowPrefix((system, o), 2, skip=300) for o in own]):
        padding = [r % 5 for r in range(len(prefixes))]
        got = gather_prefixes(prefixes, padding, 320)[0][0]
        pieces, offsets = _distinct(prefixes)
        index = g._Index(g._column_index(prefixes, offsets, padding, 320), [p.width for p in pieces])
        assert mx.array_equal(got, g._by_take(g._pool([p.spans[0][0] for p in pieces]), index)).item()
