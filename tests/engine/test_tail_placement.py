"""Tails of different lengths written where they stay (engine/tail_placement.py), on the real model.

Rows holding prefixes of different lengths advance tails of different
lengths in one forward; each row's K/V after it must be its solo run's
(the tail fed on its own cache of the prefix), and the rows a joiner reads later
(``PlacedRows``) must be the batch as it was after that forward, whatever
the batch is written with afterwards.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from mlxq.engine.tail_placement import PlacedRows, layout_for, merge_for_tails, tails_in_place

PREFIXES = [list(range(40, 60)), list(range(70, 95)), list(range(10, 40))]
TAILS = [[7, 8, 9, 10, 11], list(range(100, 109)), [3, 4, 5]]


def solo(model, tokens: list[int]) -> list:
    caches = make_prompt_cache(model)
    model(mx.array([tokens]), cache=caches)
    mx.eval([c.state for c in caches])
    return caches


def placed(model):
    rows = [solo(model, p) for p in PREFIXES]
    caches, layout = merge_for_tails(rows, [len(t) for t in TAILS], 256)
    tokens = mx.array([[0] * pad + t for pad, t in zip(layout.chunk_padding, TAILS, strict=True)])
    with tails_in_place(caches, layout):
        model(tokens, cache=caches)
    mx.eval([(c.keys, c.values) for c in caches])
    return caches, layout


def test_the_layout_ends_every_row_at_one_column_with_room_after():
    layout = layout_for([20, 25, 30], [5, 9, 3], 256)
    assert layout.start + layout.width == 34  # the longest prefix + tail
    assert [layout.start + layout.width - p for p in layout.padding] == [25, 34, 33]  # each row's length
    assert layout.chunk_padding == [4, 0, 6] and layout.capacity % 256 == 0 and layout.capacity >= 34 + 256


def test_each_placed_row_holds_its_solo_runs_keys_and_values(load_tiny):
    model, _ = load_tiny("llama")
    caches, layout = placed(model)
    for i, (prefix, tail) in enumerate(zip(PREFIXES, TAILS, strict=True)):
        alone = solo(model, prefix)  # the serial lane's way: the prefix cached, then the tail on it
        model(mx.array([tail]), cache=alone)
        mx.eval([c.state for c in alone])
        for batch, own in zip(caches, alone, strict=True):
            n = len(prefix) + len(tail)
            start = layout.padding[i]
            assert batch._idx - start == n and batch.offset[i].item() == n
            row_keys = batch.keys[i : i + 1, :, start : start + n]
            # Float32 on the CPU: a batched matmul may round apart from the solo one in the last place
            # (tests/engine/test_wave_join.py checks that every row's tokens are the serial lane's).
            assert mx.allclose(row_keys, own.keys[..., :n, :], rtol=1e-5, atol=1e-5).item()
            assert mx.allclose(batch.values[i : i + 1, :, start : start + n], own.values[..., :n, :], rtol=1e-5,
                               atol=1e-5).item()
        assert "update_and_fetch" not in vars(caches[0])  # the masked write was this forward's only


def test_rows_read_later_are_the_batch_as_it_was_after_the_forward(load_tiny):
    model, _ = load_tiny("llama")
    caches, layout = placed(model)
    rows = PlacedRows(caches, layout)
    before = [(mx.array(c.keys), mx.array(c.values)) for c in caches]
    model(mx.array([[1], [2], [3]]), cache=caches)  # a decode step writes into the batch
    mx.eval([(c.keys, c.values) for c in caches])
    for i in range(len(PREFIXES)):
        for layer, view in enumerate(rows.row(i)):
            start, n = layout.padding[i], layout.start + layout.width - layout.padding[i]
            assert view.offset == n
            assert mx.array_equal(view.keys, before[layer][0][i : i + 1, :, start : start + n]).item()
            assert mx.array_equal(view.values, before[layer][1][i : i + 1, :, start : start + n]).item()


def test_a_forward_submitted_by_layers_writes_what_it_writes_whole(load_tiny):
    """Handing every other layer's K/V to the device while the rest is built changes nothing written,
    and each cache's own ``update_and_fetch`` (tails_in_place's, here) is back afterwards."""
    from mlxq.engine.tail_placement import submitted_by_layers

    model, _ = load_tiny("llama")
    whole, layout = placed(model)
    rows = [solo(model, p) for p in PREFIXES]
    caches, _ = merge_for_tails(rows, [len(t) for t in TAILS], 256)
    tokens = mx.array([[0] * pad + t for pad, t in zip(layout.chunk_padding, TAILS, strict=True)])
    submitted = []
    with tails_in_place(caches, layout):
        keeping = [vars(c)["update_and_fetch"] for c in caches]
        with submitted_by_layers(caches, lambda arrays: submitted.append(mx.async_eval(arrays)), every=2):
            model(tokens, cache=caches)
        assert [vars(c)["update_and_fetch"] for c in caches] == keeping
    assert len(submitted) == (len(caches) - 1) // 2 > 0
    assert all("update_and_fetch" not in vars(c) for c in caches)
    for a, b in zip(caches, whole, strict=True):
        assert mx.array_equal(a.keys[..., : a._idx, :], b.keys[..., : b._idx, :]).item()
        assert mx.array_equal(a.values[..., : a._idx, :], b.values[..., : b._idx, :]).item()
