"""The batch lane's checkpoint links in flight: staged without being evaluated, moved to the host a bounded
number of bytes per step (oldest first), published with the pending token their step drew and the row's
key; a link whose row ended meanwhile is never published."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from mlxq.engine.checkpoint_moves import HostMoves, LinkInFlight
from mlxq.engine.checkpointing import Checkpointing, RowCheckpoint
from mlxq.engine.output import RequestOutput
from mlxq.engine.types import FinishReason, Request, SamplingParams
from mlxq.store.checkpoints import CheckpointStore
from mlxq.store.mlxkv import Identity

LAYERS, HEADS, DIM = 3, 2, 8


def row_caches(tokens: int, fill: float) -> list:
    caches = []
    for layer in range(LAYERS):
        cache = KVCache()
        cache.update_and_fetch(mx.full((1, HEADS, tokens, DIM), fill + layer), mx.full((1, HEADS, tokens, DIM), -fill))
        caches.append(cache)
    return caches


def test_links_move_in_bounded_slices_and_publish_with_their_pending_token(load_tiny, tmp_path):
    _, tokenizer = load_tiny("llama")
    store = CheckpointStore(tmp_path, Identity("f" * 16, "native", ""))
    checkpointing = Checkpointing(store, 4, "native")
    moves, rows = HostMoves(), []
    next_tokens = mx.array([11, 12, 13])  # the step's draws: each row's pending token
    keys = [mx.array([5, 6], dtype=mx.uint32), None, None]
    for i in range(3):
        request = Request(f"r{i}", [1, 2, 3 + i], SamplingParams(), 16, ignore_eos=True)
        output = RequestOutput(request, tokenizer, lambda event: None)
        for token in (7, 8, 9, 10):
            output.add_token(token)
        checkpoint = RowCheckpoint(checkpointing, f"{i}" * 32)
        caches = row_caches(3 + 4, float(i))
        layer_bytes = 2 * HEADS * 7 * DIM * 4  # keys and values of one layer, float32
        link = checkpoint.stage(output, caches, max_pack_bytes=layer_bytes)
        assert len(link.packs) == LAYERS and not any(p.on_host for p in link.packs)
        assert checkpoint.last == 4 and not checkpoint.is_due(output)  # staged: not due again
        moves.add(LinkInFlight(checkpoint, link, next_tokens, i, keys[i]))
        rows.append((output, caches))
    rows[1][0].finish(FinishReason.CANCELLED)  # it ended before its link moved: never published

    assert moves.advance(limit=layer_bytes) == []  # one layer per step: row 0 needs three
    assert moves.bytes() == (3 * LAYERS - 1) * layer_bytes
    ready = moves.advance(limit=2 * layer_bytes)
    assert [item.index for item in ready] == [0] and (ready[0].pending, ready[0].rng_key) == (11, (5, 6))
    assert moves.advance(limit=layer_bytes) == []  # row 1 dropped unmoved, one layer of row 2
    assert len(moves) == 1 and moves.bytes() == (LAYERS - 1) * layer_bytes
    ready += moves.advance(limit=10 * layer_bytes)
    assert [(item.index, item.pending, item.rng_key) for item in ready] == [(0, 11, (5, 6)), (2, 13, None)]
    assert len(moves) == 0 and moves.bytes() == 0
    for item in ready:
        item.checkpoint.commit(item.link, item.pending, item.rng_key)
    assert store.flush(10).durable and store.find("1" * 32) is None
    for i in (0, 2):
        record, restored = store.load(f"{i}" * 32)
        assert (record.emitted, record.pending) == ((7, 8, 9, 10), 11 + i)
        for cache, original in zip(restored, rows[i][1], strict=True):
            assert cache.offset == original.offset == 7
            assert mx.array_equal(cache.keys[..., :7, :], original.keys[..., :7, :]).item()
            assert mx.array_equal(cache.values[..., :7, :], original.values[..., :7, :]).item()
