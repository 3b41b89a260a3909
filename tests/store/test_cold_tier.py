"""The SSD tier behind the RAM cache, on real files: write-behind, restore, spills, flush, failures."""

from __future__ import annotations

import os
from pathlib import Path

import mlx.core as mx
import pytest

from mlxq.store.cold_tier import ColdTier
from mlxq.store.mlxkv import Identity, read_header
from mlxq.store.prompt_cache import PromptCache
from mlxq.store.ssd_store import SsdStore
from tests.store.test_prompt_cache import cache_with, held_tokens

IDENTITY = Identity("a" * 16, "native", "")

pytestmark = pytest.mark.usefixtures("restore_placement")  # each test: host reads, then device loads


def tier(root: Path, ram_bytes: int = 1 << 30, **kw) -> ColdTier:
    store = SsdStore(root, IDENTITY, kw.pop("max_bytes", None), "test")
    store.scan()
    return ColdTier(store, PromptCache(ram_bytes), **kw)


def drain(t: ColdTier, flushing: bool = False) -> int:
    steps = 0
    while t.has_work(flushing=flushing):
        t.step()
        steps += 1
    return steps


def flush(t: ColdTier):
    t.begin_flush()
    drain(t, flushing=True)
    return t.flush_result()


def stored_bytes(tokens: int) -> int:
    """What one entry of ``tokens`` tokens holds in the RAM tier (compact, no growth slack)."""
    probe = PromptCache(1 << 30)
    probe.put("", list(range(tokens)), cache_with(list(range(tokens))))
    return probe.bytes


def whole(caches: list):
    """``SsdStore.write_steps``'s caches_from for an entry written into a store that holds none of it."""
    def caches_from(start: int) -> list:
        assert start == 0, "the store already held part of this entry"
        return caches
    return caches_from


def files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.mlxkv"))


def test_write_behind_persists_one_tensor_per_step_and_a_new_process_restores(tmp_path):
    t = tier(tmp_path)
    t.ram.put("", [1, 2, 3, 4, 5], cache_with([1, 2, 3, 4, 5], layers=3))
    assert t.has_work() and not files(tmp_path)
    assert drain(t) == 3 * 2 + 1  # keys and values of 3 layers, then the commit
    assert len(files(tmp_path)) == 1 and t.flush_result().durable
    # A fresh store over the same directory (a restart): the prefix comes back from disk.
    again = tier(tmp_path)
    caches, n = again.ram.take("", [1, 2, 3, 4, 9, 9])
    assert n == 4 and held_tokens(caches[0]) == [1, 2, 3, 4] and held_tokens(caches[2]) == [3, 4, 5, 6]
    assert again.store.stats.restores == 1 and len(again.ram) == 1  # restored into RAM
    caches, n = again.ram.take("", [1, 2, 3, 4, 5, 6])  # now a RAM hit
    assert n == 5 and again.store.stats.restores == 1


def test_ssd_wins_only_with_a_strictly_longer_prefix(tmp_path):
    t = tier(tmp_path)
    t.ram.put("", [1, 2, 3, 4, 5, 6], cache_with([1, 2, 3, 4, 5, 6]))
    drain(t)
    t2 = tier(tmp_path)
    t2.ram.put("", [1, 2, 3, 4, 5, 6, 7, 8], cache_with([1, 2, 3, 4, 5, 6, 7, 8]))
    _, n = t2.ram.take("", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert n == 8 and t2.store.stats.restores == 0


def spans(t: ColdTier) -> list[tuple[int, int]]:
    """(fork point, span length) of every node file, sorted."""
    return sorted((node.start, len(node.tokens)) for node in t.store.files.values())


def test_an_extension_is_written_as_a_child_holding_only_its_new_tokens(tmp_path):
    t = tier(tmp_path)
    t.ram.put("", [1, 2, 3], cache_with([1, 2, 3]))
    drain(t)
    t.ram.put("", [1, 2, 3, 4, 5], cache_with([1, 2, 3, 4, 5]))
    drain(t)
    assert spans(t) == [(0, 3), (3, 2)] and t.store.longest_prefix == 5
    (child,) = [n for n in t.store.files.values() if n.start == 3]
    assert child.parent.end == 3 and child.path.stem == child.digest
    t.ram.put("", [1, 2, 3, 4, 5], cache_with([1, 2, 3, 4, 5]))  # an exact duplicate writes nothing
    drain(t)
    assert len(files(tmp_path)) == 2 and t.store.stats.writes == 2
    caches, n = tier(tmp_path).ram.take("", [1, 2, 3, 4, 5, 6])  # restored along the chain
    assert n == 5 and held_tokens(caches[0]) == [1, 2, 3, 4, 5]


def test_evicted_dirty_entries_spill_and_flush_makes_them_durable(tmp_path):
    entry_bytes = stored_bytes(10)
    t = tier(tmp_path, ram_bytes=entry_bytes, write_behind=False)
    for start in range(0, 40, 10):
        t.ram.put("", list(range(start, start + 10)), cache_with(list(range(start, start + 10))))
    assert len(t.ram) == 1 and t.counters.spills == 3 and t.has_work()
    result = flush(t)
    assert result.durable and result.pending == 0 and result.entries == 4 and len(files(tmp_path)) == 4


def test_over_the_spill_cap_the_oldest_spill_drops_and_the_next_flush_says_so(tmp_path):
    entry_bytes = stored_bytes(10)
    t = tier(tmp_path, ram_bytes=entry_bytes, write_behind=False, spill_queue_bytes=entry_bytes)
    for start in range(0, 40, 10):
        t.ram.put("", list(range(start, start + 10)), cache_with(list(range(start, start + 10))))
    assert t.counters.dropped == 2 and t.pending_spill_bytes <= entry_bytes
    first = flush(t)
    assert not first.durable and first.dropped == 2 and first.pending == 0
    assert flush(t).durable  # the loss was reported once; what is left is on disk


def test_an_unwritable_directory_degrades_to_not_stored(tmp_path):
    root = tmp_path / "not-a-dir"
    root.write_text("a file where the cache directory should be")
    t = tier(root)
    t.ram.put("", [1, 2, 3], cache_with([1, 2, 3]))
    drain(t)  # one failed attempt, then no busy retry loop
    assert t.counters.failed == 1 and not t.has_work()
    caches, n = t.ram.take("", [1, 2, 3, 4])  # serving from RAM goes on
    assert n == 3
    result = flush(t)  # a flush retries once and reports the failure
    assert not result.durable and result.failed == 1 and result.pending == 1


def test_the_byte_cap_removes_least_recently_used_files(tmp_path):
    size = stored_bytes(10)
    t = tier(tmp_path, max_bytes=3 * (size + 2 * 16384))
    for start in range(0, 60, 10):
        t.ram.put("", list(range(start, start + 10)), cache_with(list(range(start, start + 10))))
        drain(t)
    assert t.store.bytes <= t.store.max_bytes and len(files(tmp_path)) < 6
    assert t.store.find("", list(range(50, 61)), 0) is not None  # the newest survived
    one_file = max(f.stat().st_size for f in files(tmp_path))
    smaller = tier(tmp_path, max_bytes=one_file)  # a lower cap at the next start applies at once
    assert len(files(tmp_path)) == 1 and smaller.store.find("", list(range(50, 61)), 0) is not None


def test_scan_reaps_tmp_removes_corrupt_and_ignores_foreign_fingerprints(tmp_path):
    t = tier(tmp_path)
    t.ram.put("", [1, 2, 3, 4], cache_with([1, 2, 3, 4]))
    t.ram.put("", [7, 8, 9], cache_with([7, 8, 9]))
    drain(t)
    good, bad = files(tmp_path)
    data = bytearray(bad.read_bytes())
    data[50] ^= 1  # the header
    bad.write_bytes(bytes(data))
    orphan = good.with_name("orphan.mlxkv.tmp")
    orphan.write_bytes(b"half a write")
    foreign = tmp_path / ("b" * 16) / "x" / "other.mlxkv"
    foreign.parent.mkdir(parents=True)
    foreign.write_bytes(b"another model's entry")
    fresh = tier(tmp_path)
    assert len(fresh.store.files) == 1 and fresh.store.stats.reaped_tmp == 1
    assert fresh.store.stats.corrupt_removed == 1
    assert not orphan.exists() and not bad.exists() and good.exists() and foreign.exists()


@pytest.mark.parametrize("where", ["first", "last"])
def test_a_file_corrupted_after_the_scan_is_skipped_at_restore(tmp_path, where):
    t = tier(tmp_path)
    t.ram.put("", [1, 2, 3, 4, 5], cache_with([1, 2, 3, 4, 5]))
    drain(t)
    fresh = tier(tmp_path)
    (path,) = files(tmp_path)
    data = bytearray(path.read_bytes())
    # the first layer's first tensor (its check may end before the layers load) or the last tensor's bytes
    data[read_header(path).data_start if where == "first" else -1] ^= 0x10
    path.write_bytes(bytes(data))
    assert fresh.ram.take("", [1, 2, 3, 4, 5, 6]) == (None, 0)
    assert not path.exists() and fresh.store.stats.corrupt_removed == 1


def test_idle_entries_leave_ram_once_they_are_on_disk(tmp_path):
    t = tier(tmp_path, demote_idle_s=10)
    t.ram.put("", [1, 2, 3], cache_with([1, 2, 3]))
    t.ram.put("", [4, 5, 6], cache_with([4, 5, 6]))
    t.step()  # the first write has started, not finished: nothing is on disk yet
    later = t.ram._entries[("", (1, 2, 3))].last_used + 11
    t.housekeep(later)
    assert len(t.ram) == 2 and t.counters.demotions == 0
    drain(t)
    t.housekeep(later + 2)
    assert len(t.ram) == 0 and t.counters.demotions == 2
    _, n = t.ram.take("", [1, 2, 3, 4])  # still served, from disk
    assert n == 3 and t.store.stats.restores == 1


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_a_read_only_directory_counts_failures(tmp_path):
    tmp_path.chmod(0o500)
    try:
        t = tier(tmp_path)
        t.ram.put("", [1, 2, 3], cache_with([1, 2, 3]))
        drain(t)
        assert t.counters.failed == 1
    finally:
        tmp_path.chmod(0o700)


def test_restored_arrays_equal_what_was_stored(tmp_path):
    t = tier(tmp_path)
    stored = cache_with([3, 1, 4, 1, 5, 9, 2, 6])
    t.ram.put("", [3, 1, 4, 1, 5, 9, 2, 6], stored)
    drain(t)
    caches, n = tier(tmp_path).ram.take("", [3, 1, 4, 1, 5, 9, 2, 6, 5])
    assert n == 8
    for a, b in zip(stored, caches, strict=True):
        assert mx.array_equal(a.keys[..., :8, :], b.keys[..., :8, :]).item()
        assert mx.array_equal(a.values[..., :8, :], b.values[..., :8, :]).item()


def test_a_restore_that_would_lose_to_recomputing_is_skipped(tmp_path):
    t = tier(tmp_path)
    t.ram.put("", list(range(600)), cache_with(list(range(600))))
    drain(t)
    fresh = tier(tmp_path)
    fresh.note_prefill(100, 1.0)  # below the sample floor: ignored
    assert fresh.prefill_tok_s is None
    _, n = fresh.ram.take("", list(range(601)))  # rates unknown: restore, and measure the read
    assert n == 600 and fresh.read_bytes_per_s > 0
    slow_disk = tier(tmp_path)
    slow_disk.read_bytes_per_s = 1.0  # one byte per second
    slow_disk.note_prefill(10_000, 1.0)
    assert slow_disk.ram.take("", list(range(601))) == (None, 0)
    assert slow_disk.counters.restores_skipped_slower == 1 and slow_disk.store.stats.restores == 0
    fast_disk = tier(tmp_path)
    fast_disk.read_bytes_per_s = 1e12
    fast_disk.note_prefill(10_000, 1.0)
    assert fast_disk.ram.take("", list(range(601)))[1] == 600
    assert fast_disk.as_dict()["prefill_tok_s"] == 10_000.0


def test_a_repeated_put_of_what_disk_holds_is_not_written_again(tmp_path):
    t = tier(tmp_path)
    tokens = list(range(1, 9))
    t.ram.put("", tokens, cache_with(tokens))
    drain(t)
    (path,) = files(tmp_path)
    inode, writes = path.stat().st_ino, t.store.stats.writes
    for _ in range(3):  # an exact repeat, and a shorter prefix the trimmable file already serves
        t.ram.put("", tokens, cache_with(tokens))
        t.ram.put("", tokens[:5], cache_with(tokens[:5]))
        assert not t.has_work()
    assert t.store.stats.writes == writes and files(tmp_path) == [path] and path.stat().st_ino == inode
    t.ram.put("", tokens + [9], cache_with(tokens + [9]))  # an extension is new: its one token is written
    drain(t)
    assert t.store.stats.writes == writes + 1 and t.store.longest_prefix == 9 and spans(t) == [(0, 8), (8, 1)]


def test_a_put_during_the_write_of_the_same_key_is_not_queued_again(tmp_path):
    t = tier(tmp_path)
    tokens = list(range(1, 9))
    t.ram.put("", tokens, cache_with(tokens))
    t.step()  # the write has begun
    t.ram.put("", tokens, cache_with(tokens))
    drain(t)
    assert t.store.stats.writes == 1 and t.flush_result().durable


def test_n_choices_store_their_shared_prompt_once(tmp_path):
    t = tier(tmp_path)
    prompt = list(range(100, 140))
    for choice in range(4):  # same prompt, each choice its own 6 generated tokens
        tail = [choice] * 6
        t.ram.put("", prompt + tail, cache_with(prompt + tail))
    drain(t)
    # The prompt is split off the first choice's file as the second choice arrives (as the RAM tree
    # splits its node): one file holds the prompt, each choice's file only its own tail.
    assert spans(t) == [(0, 40)] + [(40, 6)] * 4 and t.flush_result().durable
    again = tier(tmp_path)
    for choice in (2, 0):
        _, n = again.ram.take("", prompt + [choice] * 6 + [7])
        assert n == len(prompt) + 6
    assert again.store.stats.read_files == 3  # the prompt's file once, then each choice's own tail


def test_a_new_ssd_directory_is_announced_at_start(tmp_path, caplog):
    """The log says the tier is on even when it starts with nothing on disk."""
    store = SsdStore(tmp_path / "new", Identity("f" * 16, "native", ""))
    with caplog.at_level("INFO", logger="mlxq"):
        store.scan()
    assert any("empty (new)" in r.getMessage() and str(tmp_path / "new") in r.getMessage() for r in caplog.records)
