"""The checkpoint store on real files: chains of links, retire, corruption, queue cap, scan."""

from __future__ import annotations

import dataclasses
import json

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache

from mlxq.engine.checkpointing import owned_layers
from mlxq.store.checkpoints import CheckpointRecord, CheckpointStore
from mlxq.store.layout import layout_of
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


def publish(store: CheckpointStore, key: str, emitted: tuple[int, ...], fill: float = 1.0, start: int = 0) -> bool:
    tokens = [1, 2, 3, *emitted]
    return store.publish(record(key, emitted), tokens, owned_layers(caches(len(tokens), fill), start), False, start)


def test_each_link_holds_only_its_span_and_the_chain_restores_whole(tmp_path):
    store = CheckpointStore(tmp_path, IDENTITY, layout=layout_of(caches(1, 0.0)))
    assert publish(store, "a" * 32, (4,), 1.0)
    assert publish(store, "a" * 32, (4, 5, 6), 2.0, start=4)  # tokens 4 and 5 only: 0-3 are in the first link
    assert store.flush(10).durable
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a" * 32 + "-4.mlxkv", "a" * 32 + "-6.mlxkv"]
    loaded, restored = store.load("a" * 32)
    assert loaded.emitted == (4, 5, 6) and loaded.pending == 9 and loaded.rng_key == (1, 2)
    keys = mx.concatenate([mx.full((1, 2, 4, 4), 1.0), mx.full((1, 2, 2, 4), 2.0)], axis=2)
    assert restored[0].offset == 6 and mx.array_equal(restored[0].state[0], keys).item()
    assert mx.array_equal(restored[1].cache[0], mx.full((1, 3), 2.0)).item()  # recurrent state: the newest
    assert store.as_dict()["requests"] == 1 and store.as_dict()["files"] == 2
    again = CheckpointStore(tmp_path, IDENTITY, layout=layout_of(caches(1, 0.0)))
    again.scan()  # each link's header checked against the model's layout: its span, the state at its end
    assert again.load("a" * 32)[0].emitted == (4, 5, 6) and again.counters.corrupt_removed == 0


def test_a_new_first_link_supersedes_the_older_chain_once_durable(tmp_path):
    store = CheckpointStore(tmp_path, IDENTITY)
    publish(store, "h" * 32, (4,), 1.0)
    publish(store, "h" * 32, (4, 5), 1.0, start=4)
    assert not publish(store, "h" * 32, (4, 5, 6), 1.0, start=6)  # no link ends at 6: dropped
    assert publish(store, "h" * 32, (4, 5, 6), 3.0)  # a new chain
    store.flush(10)
    assert [p.name for p in tmp_path.iterdir()] == ["h" * 32 + "-6.mlxkv"] and store.counters.superseded == 2
    assert mx.array_equal(store.load("h" * 32)[1][0].state[0], mx.full((1, 2, 6, 4), 3.0)).item()


def test_a_missing_or_corrupt_middle_link_is_a_miss(tmp_path):
    store = CheckpointStore(tmp_path, IDENTITY)
    for n, start in ((1, 0), (2, 4), (3, 5)):
        publish(store, "k" * 32, tuple(range(4, 4 + n)), 1.0, start)
    store.flush(10)
    middle = tmp_path / ("k" * 32 + "-5.mlxkv")
    data = bytearray(middle.read_bytes())
    data[-1] ^= 0xFF
    middle.write_bytes(bytes(data))
    assert store.load("k" * 32) is None and store.counters.corrupt_removed == 2  # it and the link above it
    assert [p.name for p in tmp_path.iterdir()] == ["k" * 32 + "-4.mlxkv"]
    assert store.load("k" * 32)[0].emitted == (4,)  # the intact first link: an older checkpoint


def test_a_restart_removes_links_whose_chain_is_cut(tmp_path):
    store = CheckpointStore(tmp_path, IDENTITY)
    for n, start in ((1, 0), (2, 4), (3, 5)):
        publish(store, "m" * 32, tuple(range(4, 4 + n)), 1.0, start)
    store.flush(10)
    (tmp_path / ("m" * 32 + "-5.mlxkv")).unlink()
    again = CheckpointStore(tmp_path, IDENTITY)
    again.scan()
    assert [p.name for p in tmp_path.iterdir()] == ["m" * 32 + "-4.mlxkv"] and again.counters.corrupt_removed == 1


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
    bad = tmp_path / ("d" * 32 + "-4.mlxkv")
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
        publish(store, "g" * 32, (4, 5, 6), 3.0, start=4)
        loaded, restored = store.load("g" * 32)  # the first link from its file, the second from memory
        assert store.counters.written == 1
    assert loaded.emitted == (4, 5, 6)
    keys = mx.concatenate([mx.full((1, 2, 4, 4), 1.0), mx.full((1, 2, 2, 4), 3.0)], axis=2)
    assert mx.array_equal(restored[0].state[0], keys).item()
    assert mx.array_equal(restored[1].cache[0], mx.full((1, 3), 3.0)).item()
    assert store.flush(10).durable and store.load("g" * 32)[0].emitted == (4, 5, 6)
    store.retire("g" * 32)
    assert store.load("g" * 32) is None


def test_a_link_removed_under_a_running_store_is_a_miss_not_an_error(tmp_path):
    store = CheckpointStore(tmp_path, IDENTITY)
    for n, start in ((1, 0), (2, 4), (3, 5)):
        publish(store, "n" * 32, tuple(range(4, 4 + n)), 1.0, start)
    store.flush(10)
    (tmp_path / ("n" * 32 + "-5.mlxkv")).unlink()
    assert store.load("n" * 32) is None and store.counters.corrupt_removed == 0
    assert (tmp_path / ("n" * 32 + "-6.mlxkv")).exists()  # a vanished file condemns nothing else by itself


def test_a_record_header_holds_every_field_and_reads_back_equal():
    rec = CheckpointRecord("r" * 32, 5, (4, 5, 6), 7, (11, 12), 123.5)
    header = rec.as_header()
    assert set(header) == {f.name for f in dataclasses.fields(CheckpointRecord)} | {"version"}
    assert CheckpointRecord.from_header(json.loads(json.dumps(header))) == rec
