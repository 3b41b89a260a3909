"""The batch lane's checkpoint links staged in one step and published in the next, with the pending token
their step drew and the row's key; a link whose row ended meanwhile is never published."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from mlxq.engine.checkpoint_rows import SPREAD_STEPS, publishes_per_step
from mlxq.engine.checkpoint_staging import LeftPaddings, LinkInFlight, StagedLinks
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


def test_staged_links_publish_with_their_pending_token_and_key(load_tiny, tmp_path):
    _, tokenizer = load_tiny("llama")
    store = CheckpointStore(tmp_path, Identity("f" * 16, "native", ""))
    checkpointing = Checkpointing(store, 4, "native")
    staged, rows = StagedLinks(), []
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
        link = checkpoint.stage(output, caches, layer_bytes, host_side=True)
        assert len(link.packs) == LAYERS and not any(p.on_host for p in link.packs)
        assert checkpoint.last == 0 and checkpoint.is_due(output)  # described only: the row still due
        staged.stage([LinkInFlight(checkpoint, link, next_tokens, i, keys[i])])
        checkpoint.taken(output)
        assert checkpoint.last == 4 and not checkpoint.is_due(output)  # staged: not due again
        rows.append((output, caches))
    rows[1][0].finish(FinishReason.CANCELLED)  # it ended before its link was published: never published

    assert store.queued_bytes() == 0  # nothing reaches the writer in the step that staged
    assert staged.publish() == 2 * LAYERS * layer_bytes and len(staged) == 0
    assert staged.publish() == 0
    assert store.flush(10).durable and store.find("1" * 32) is None
    for i in (0, 2):
        record, restored = store.load(f"{i}" * 32)
        assert (record.emitted, record.pending, record.rng_key) == ((7, 8, 9, 10), 11 + i, (5, 6) if i == 0 else None)
        for cache, original in zip(restored, rows[i][1], strict=True):
            assert cache.offset == original.offset == 7
            assert mx.array_equal(cache.keys[..., :7, :], original.keys[..., :7, :]).item()
            assert mx.array_equal(cache.values[..., :7, :], original.values[..., :7, :]).item()


def test_left_paddings_are_read_once_per_array():
    layers = [BatchKVCache([2, 0, 1]), BatchKVCache([2, 0, 1]), KVCache()]
    paddings = LeftPaddings()
    first = paddings.of(layers)
    assert first == [[2, 0, 1], [2, 0, 1], None]
    assert all(a is b for a, b in zip(paddings.of(layers)[:2], first[:2], strict=True))  # not read again
    layers[1].left_padding = mx.array([1, 0])  # rows left: a new array
    again = paddings.of(layers)
    assert again[0] is first[0] and again[1] == [1, 0]


def test_a_batch_that_reaches_its_interval_at_once_stages_over_eight_steps():
    assert SPREAD_STEPS == 8
    for rows in (1, 2, 8, 9, 32, 64, 100):
        per_step = publishes_per_step(rows)
        assert per_step >= 1 and per_step * SPREAD_STEPS >= rows > (per_step - 1) * SPREAD_STEPS
