"""The checkpoint store on real files: newest only, retire, corruption, queue cap, scan."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache

from mlxq.engine.checkpointing import owned_layers
from mlxq.store.checkpoints import CheckpointRecord, CheckpointStore
from mlxq.store.mlxkv import Identity

IDENTITY = Identity("f" * 16, "native", "")


def caches(tokens: int, fill: float) -> list:
    kv = KVCache()
    kv.update_and_fetch(mx.full((1, 2, tokens, 4), fill), mx.full((1, 2, tokens, 4), -fill))
    state = ArraysCache(2)
    state.cache[0] = mx.full((1, 3), fill)
    return [kv, state]


def record(key: str, emitted: tuple[int, ...], pending: int = 9) -> CheckpointRecord:
    return CheckpointRecord(key, 3, emitted, pending, (1, 2), 0.0)


def publish(store: CheckpointStore, key: str, emitted: tuple[int, ...], fill: float = 1.0) -> bool:
    tokens = [1, 2, 3, *emitted]
    return store.publish(record(key, emitted), tokens, owned_layers(caches(len(tokens), fill)), False)


def test_only_the_newest_checkpoint_of_a_request_is_kept_and_it_restores(tmp_path):
    store = CheckpointStore(tmp_path, IDENTITY)
    assert publish(store, "a" * 32, (4,), 1.0)
    assert publish(store, "a" * 32, (4, 5), 2.0)
    assert store.flush(10).durable
    assert [p.name for p in tmp_path.iterdir()] == ["a" * 32 + ".mlxkv"]
    loaded, restored = store.load("a" * 32)
    assert loaded.emitted == (4, 5) and loaded.pending == 9 and loaded.rng_key == (1, 2)
    assert restored[0].offset == 5 and mx.array_equal(restored[0].state[0], mx.full((1, 2, 5, 4), 2.0)).item()
    assert mx.array_equal(restored[1].cache[0], mx.full((1, 3), 2.0)).item()


def test_a_retired_key_is_never_found_and_its_file_goes(tmp_path):
    store = CheckpointStore(tmp_path, IDENTITY)
    publish(store, "b" * 32, (4,))
    store.flush(10)
    store.retire("b" * 32)
    assert store.find("b" * 32) is None
    store.flush(10)
    assert not list(tmp_path.iterdir()) and store.counters.deleted == 1
    publish(store, "b" * 32, (4,))  # a new attempt of the same request is not erased by the old cleanup
    store.flush(10)
    assert store.find("b" * 32) is not None


def test_a_restart_finds_checkpoints_reaps_cut_writes_and_removes_bad_files(tmp_path):
    store = CheckpointStore(tmp_path, IDENTITY)
    publish(store, "c" * 32, (4,))
    publish(store, "d" * 32, (4,))
    store.flush(10)
    (tmp_path / ("e" * 32 + ".mlxkv.tmp")).write_bytes(b"cut")
    bad = tmp_path / ("d" * 32 + ".mlxkv")
    data = bytearray(bad.read_bytes())
    data[-1] ^= 0xFF  # a tensor's last byte: the header is fine, the checksum is not
    bad.write_bytes(bytes(data))
    again = CheckpointStore(tmp_path, IDENTITY)
    again.scan()
    assert not (tmp_path / ("e" * 32 + ".mlxkv.tmp")).exists()
    assert again.load("d" * 32) is None and not bad.exists() and again.counters.corrupt_removed == 1
    assert again.load("c" * 32) is not None
    other = CheckpointStore(tmp_path, Identity("0" * 16, "native", ""))
    other.scan()  # another model's directory would never be this one; a foreign file is removed, not served
    assert other.find("c" * 32) is None


def test_publishes_over_the_queue_cap_or_the_byte_cap_are_dropped(tmp_path):
    store = CheckpointStore(tmp_path, IDENTITY, queue_bytes=1)
    assert not publish(store, "f" * 32, (4,))
    capped = CheckpointStore(tmp_path, IDENTITY, max_bytes=10)
    assert not publish(capped, "f" * 32, (4,))
    result = capped.flush(10)
    assert not result.durable and result.dropped == 1 and store.counters.dropped == 1
    assert capped.flush(10).durable  # dropped counts once, at the next flush


def test_a_publish_not_written_yet_restores_from_memory(tmp_path):
    """A client that left and came back at once: its newest checkpoint is still queued, the file older."""
    store = CheckpointStore(tmp_path, IDENTITY)
    publish(store, "g" * 32, (4,), 1.0)
    store.flush(10)
    with store._cond:  # the writer cannot take the next publish from the queue meanwhile
        publish(store, "g" * 32, (4, 5, 6), 3.0)
        loaded, restored = store.load("g" * 32)
        assert store.counters.written == 1  # the file still holds the first one
    assert loaded.emitted == (4, 5, 6)
    assert mx.array_equal(restored[0].state[0], mx.full((1, 2, 6, 4), 3.0)).item()
    assert mx.array_equal(restored[1].cache[0], mx.full((1, 3), 3.0)).item()
    assert store.flush(10).durable and store.load("g" * 32)[0].emitted == (4, 5, 6)
    store.retire("g" * 32)
    assert store.load("g" * 32) is None
