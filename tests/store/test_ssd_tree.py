"""The SSD tier as a tree of node files: shared prefixes once, chains, bad nodes, orphans, old files."""

from __future__ import annotations

import logging
import struct

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from mlxq.store.mlxkv import FORMAT_VERSION, read_header
from tests.store.test_cold_tier import drain, files, spans, tier
from tests.store.test_prompt_cache import cache_with, held_tokens, ring_with

pytestmark = pytest.mark.usefixtures("restore_placement")  # each test: host reads, then device loads

SHARED = list(range(1000, 1064))  # a system prompt many agents share


def agent(i: int) -> list[int]:
    return SHARED + [i] * 4


def test_a_prefix_shared_by_eight_agents_is_written_and_restored_once(tmp_path):
    t = tier(tmp_path)
    for i in range(8):
        t.ram.put("", agent(i), cache_with(agent(i)))
    drain(t)
    assert spans(t) == [(0, 64)] + [(64, 4)] * 8  # the first agent's file split once the second arrived
    kv_bytes = [read_header(f).tensor_bytes for f in files(tmp_path)]
    assert sum(kv_bytes) == max(kv_bytes) * (64 + 8 * 4) // 64  # the shared prompt once, not 8 times

    again = tier(tmp_path)  # a restart: eight restores begun together, then advanced in turns
    ram = again.ram
    pending = [again.begin_restore("", agent(i) + [0], 0) for i in range(8)]
    while not all(p.entry is not None for p in pending):
        for p in pending:
            if p.entry is None:
                again.advance_restore(p)
    assert again.store.stats.read_files == 9  # the shared file once, then each agent's own
    assert again.counters.restores_joined == 7
    for i, p in enumerate(pending):
        caches = ram.adopt_restored("", p.entry, p.n, 0)
        assert p.n == 68 and held_tokens(caches[1]) == [x + 1 for x in agent(i)]
    assert again.store.stats.reread_bytes == 0
    assert ram.bytes < 2 * again.store.bytes  # RAM holds the shared span once too


def test_a_restore_following_an_abandoned_one_reads_the_shared_file_itself(tmp_path):
    t = tier(tmp_path)
    for i in range(2):
        t.ram.put("", agent(i), cache_with(agent(i)))
    drain(t)
    again = tier(tmp_path)
    first = again.begin_restore("", agent(0) + [0], 0)
    again.advance_restore(first)  # one tensor read, then its request leaves
    second = again.begin_restore("", agent(1) + [0], 0)
    assert second.leader is first
    again.abandon_restore(first)
    assert first.done and first.entry is None
    for _ in range(1000):  # without the abandonment the follower waits for the leader forever
        if again.advance_restore(second):
            break
    assert second.entry is not None and second.n == 68
    caches = again.ram.adopt_restored("", second.entry, second.n, 0)
    assert held_tokens(caches[1]) == [x + 1 for x in agent(1)]
    third = again.begin_restore("", agent(0) + [0], 0)  # a later restore of the same prefix waits on no one
    assert third is None or third.leader is None or third.leader.done


def test_a_bad_node_and_its_descendants_are_refused_and_the_rest_restore(tmp_path):
    t = tier(tmp_path)
    x, y, z = SHARED + [1] * 8, SHARED + [1] * 8 + [2] * 8, SHARED + [3] * 8
    for tokens in (SHARED, x, y, z):
        t.ram.put("", tokens, cache_with(tokens))
        drain(t)
    assert spans(t) == [(0, 64), (64, 8), (64, 8), (72, 8)]
    (bad,) = [n for n in t.store.files.values() if n.tokens == (1,) * 8]
    data = bytearray(bad.path.read_bytes())
    data[-1] ^= 0x08  # the last tensor's bytes: only a restore (or verify) sees it
    bad.path.write_bytes(bytes(data))

    again = tier(tmp_path)
    caches, n = again.ram.take("", y + [0])  # the bad node's chain: it and its child go, the root serves
    assert n == 64 and held_tokens(caches[0]) == SHARED
    assert again.store.stats.corrupt_removed == 1 and again.store.stats.orphans_removed == 1
    assert spans(again) == [(0, 64), (64, 8)] and len(files(tmp_path)) == 2
    caches, n = again.ram.take("", z + [0])  # a sibling chain is untouched
    assert n == 72 and held_tokens(caches[0]) == z


def test_a_child_whose_parent_is_gone_is_removed_at_scan(tmp_path, caplog):
    t = tier(tmp_path)
    for tokens in (SHARED, SHARED + [5] * 4, SHARED + [5] * 4 + [6] * 4):
        t.ram.put("", tokens, cache_with(tokens))
        drain(t)
    (root,) = [n for n in t.store.files.values() if n.start == 0]
    root.path.unlink()
    with caplog.at_level(logging.WARNING, logger="mlxq"):
        again = tier(tmp_path)
    assert again.store.stats.orphans_removed == 2 and not files(tmp_path)
    assert sum("parent file is missing" in r.getMessage() for r in caplog.records) == 2


def test_files_of_the_old_format_are_removed_with_one_log_line(tmp_path, caplog):
    t = tier(tmp_path)
    for i in range(3):
        t.ram.put("", agent(i), cache_with(agent(i)))
    drain(t)
    for path in files(tmp_path):
        data = bytearray(path.read_bytes())
        data[8:12] = struct.pack("<I", FORMAT_VERSION - 1)
        path.write_bytes(bytes(data))
    with caplog.at_level(logging.INFO, logger="mlxq"):
        again = tier(tmp_path)
    assert again.store.stats.old_format_removed == 4 and not files(tmp_path)  # the prompt's, and 3 agents'
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 1 and "4 files of another .mlxkv format version" in lines[0]


def test_the_byte_cap_removes_leaves_never_a_parent_children_need(tmp_path):
    t = tier(tmp_path)
    for i in range(3):
        t.ram.put("", agent(i), cache_with(agent(i)))
    drain(t)
    total = t.store.bytes
    smallest = min(n.nbytes for n in t.store.files.values())
    capped = tier(tmp_path, max_bytes=total - smallest)  # one leaf must go
    assert capped.store.stats.evicted_files == 1 and capped.store.bytes <= total - smallest
    assert [n.start for n in capped.store.files.values()].count(0) == 1  # the shared parent stays
    assert all(n.parent.digest == "" or n.parent.path.exists() for n in capped.store.files.values())


def mixed(tokens: list[int]) -> list:
    """A full-attention layer and a sliding-window ring: a tree that serves only at snapshots."""
    return cache_with(tokens, layers=1) + ring_with(tokens)


def test_rings_restore_only_chains_ending_at_a_snapshot(tmp_path):
    t = tier(tmp_path)
    short, long = SHARED, SHARED + [7] * 8
    t.ram.put("", short, mixed(short))
    t.ram.put("", long, mixed(long))
    drain(t)
    assert spans(t) == [(0, 64), (64, 8)]
    again = tier(tmp_path)
    assert again.ram.take("", SHARED + [7] * 4 + [0])[1] == 64  # mid-file: only the parent's end serves
    again = tier(tmp_path)
    caches, n = again.ram.take("", long + [0])
    assert n == 72 and held_tokens(caches[0]) == long
    ring = caches[1]
    assert ring.offset == 72 and mx.array_equal(ring.keys, mixed(long)[1].keys).item()


def test_a_restore_builds_on_ram_even_when_ram_splits_its_nodes_meanwhile(tmp_path):
    t = tier(tmp_path)
    for i in (1, 2):
        t.ram.put("", agent(i) + [i] * 4, cache_with(agent(i) + [i] * 4))
    drain(t)
    again = tier(tmp_path)
    again.ram.put("", agent(1), cache_with(agent(1)))  # RAM holds the shared prompt (one node of 68 tokens)
    prompt = agent(2) + [2] * 4 + [0]
    _, held = again.ram.held_path("", prompt)
    pending = again.begin_restore("", prompt, held)
    assert held == 64 and [node.start for node in pending.files] == [64]  # only the agent's own file
    again.ram.put("", SHARED[:30] + [9] * 5, cache_with(SHARED[:30] + [9] * 5))  # splits RAM's node at 30
    while not again.advance_restore(pending):
        pass
    caches = again.ram.adopt_restored("", pending.entry, pending.n, held)
    assert pending.n == 72 and held_tokens(caches[0]) == agent(2) + [2] * 4


def test_a_split_rewrites_one_file_and_leaves_the_files_below_it_alone(tmp_path):
    t = tier(tmp_path)
    first, turn = agent(1), agent(1) + [5] * 4
    for tokens in (first, turn):
        t.ram.put("", tokens, cache_with(tokens))
        drain(t)
    below = {p: p.stat().st_ino for p in files(tmp_path)}
    t.ram.put("", agent(2), cache_with(agent(2)))  # shares 64 of the first file's 68 tokens: a split
    drain(t)
    assert spans(t) == [(0, 64), (64, 4), (64, 4), (68, 4)]
    (turn_file,) = [n.path for n in t.store.files.values() if n.start == 68]
    assert below[turn_file] == turn_file.stat().st_ino  # the next turn's file was not touched
    again = tier(tmp_path)
    caches, n = again.ram.take("", turn + [0])
    assert n == 72 and held_tokens(caches[0]) == turn and again.store.stats.read_files == 3


def test_a_split_cut_short_by_a_crash_leaves_the_whole_file(tmp_path):
    t = tier(tmp_path)
    t.ram.put("", agent(1), cache_with(agent(1)))
    drain(t)
    t.ram.put("", agent(2), cache_with(agent(2)))
    while len(files(tmp_path)) < 2:  # the split's head is on disk; the split file is not rewritten yet
        t.step()
    t._job.steps.close()  # the process dies here (a clean close only removes the .tmp a kill would leave)
    again = tier(tmp_path)
    assert again.store.stats.unfinished_splits_removed == 1 and spans(again) == [(0, 68)]
    caches, n = again.ram.take("", agent(1) + [0])
    assert n == 68 and held_tokens(caches[0]) == agent(1)


def test_a_file_sharing_only_a_few_tokens_is_not_split(tmp_path):
    t = tier(tmp_path)
    one, other = [1] + list(range(100, 140)), [1] + list(range(200, 240))  # a shared BOS, nothing more
    for tokens in (one, other):
        t.ram.put("", tokens, cache_with(tokens))
        drain(t)
    assert spans(t) == [(0, 41), (0, 41)] and t.store.stats.writes == 2  # no rewrite for one token
    again = tier(tmp_path)
    for tokens in (one, other):
        caches, n = again.ram.take("", tokens + [0])
        assert n == 41 and held_tokens(caches[0]) == tokens


def quantized_with(tokens: list[int]) -> list:
    """8-bit quantized KV caches (mlx-lm's QuantizedKVCache) whose keys encode the token ids."""
    out = []
    for layer in range(2):
        c = KVCache()
        k = mx.array(tokens, dtype=mx.float32).reshape(1, 1, -1, 1) * mx.ones((1, 2, 1, 64)) + layer
        c.update_and_fetch(k, -k)
        out.append(c.to_quantized(group_size=64, bits=8))
    return out


def test_quantized_kv_along_a_chain_restores_bit_exactly(tmp_path):
    t = tier(tmp_path)
    tail = SHARED + [1] * 8
    for tokens in (SHARED, tail):
        t.ram.put("", tokens, quantized_with(tokens))
        drain(t)
    assert spans(t) == [(0, 64), (64, 8)]
    caches, n = tier(tmp_path).ram.take("", tail + [0])
    assert n == 72
    for got, want in zip(caches, quantized_with(tail), strict=True):
        assert type(got) is QuantizedKVCache and got.offset == 72
        for a, b in zip((*got.keys, *got.values), (*want.keys, *want.values), strict=True):
            assert mx.array_equal(a[..., :72, :], b[..., :72, :]).item()
