"""The RAM prompt cache: longest prefix, lending without corruption, supersede, LRU under a byte cap."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from mlxq.store.prompt_cache import PromptCache

H, D = 2, 8


def cache_with(tokens: list[int], layers: int = 2) -> list[KVCache]:
    """KV caches whose keys encode the token ids (so contents can be checked exactly)."""
    out = []
    for layer in range(layers):
        c = KVCache()
        k = mx.array(tokens, dtype=mx.float32).reshape(1, 1, -1, 1) * mx.ones((1, H, 1, D)) + layer
        c.update_and_fetch(k, -k)
        out.append(c)
    return out


def held_tokens(c: KVCache) -> list[int]:
    return [int(x) for x in c.keys[0, 0, : c.offset, 0].tolist()]


def test_take_returns_the_longest_shared_prefix_capped_below_the_prompt():
    pc = PromptCache(1 << 30)
    pc.put("", [1, 2, 3, 4, 5, 6], cache_with([1, 2, 3, 4, 5, 6]))
    pc.put("", [1, 2, 9], cache_with([1, 2, 9]))
    caches, n = pc.take("", [1, 2, 3, 4, 7, 8])
    assert n == 4 and held_tokens(caches[0]) == [1, 2, 3, 4]
    # A prompt identical to an entry still leaves one token to compute.
    caches, n = pc.take("", [1, 2, 3, 4, 5, 6])
    assert n == 5
    assert pc.take("", [7, 7, 7]) == (None, 0)
    assert pc.take("adapter-x", [1, 2, 3, 4, 5, 6]) == (None, 0)  # namespaces never mix
    assert pc.stats.hits == 2 and pc.stats.hit_tokens == 9 and pc.stats.queries == 4


def test_borrowers_never_write_into_the_stored_entry():
    pc = PromptCache(1 << 30)
    pc.put("", [1, 2, 3, 4], cache_with([1, 2, 3, 4]))
    a, _ = pc.take("", [1, 2, 3, 4, 5])
    b, _ = pc.take("", [1, 2, 3, 4, 6])
    for caches, token in ((a, 50), (b, 60)):
        for c in caches:
            k = mx.full((1, H, 1, D), float(token))
            c.update_and_fetch(k, -k)
    assert held_tokens(a[0])[-1] == 50 and held_tokens(b[0])[-1] == 60
    again, n = pc.take("", [1, 2, 3, 4, 9])
    assert n == 4 and held_tokens(again[0]) == [1, 2, 3, 4]


def test_put_supersedes_prefixes_and_duplicates():
    pc = PromptCache(1 << 30)
    pc.put("", [1, 2], cache_with([1, 2]))
    pc.put("", [1, 2, 3], cache_with([1, 2, 3]))
    pc.put("", [1, 2, 3], cache_with([1, 2, 3]))
    assert len(pc) == 1
    pc.put("", [1, 5], cache_with([1, 5]))
    assert len(pc) == 2  # a sibling, not a prefix


def test_byte_cap_evicts_least_recently_used_and_counts_real_bytes():
    one = cache_with(list(range(10)))
    per_entry = sum(c.keys[..., :10, :].nbytes + c.values[..., :10, :].nbytes for c in one)
    pc = PromptCache(2 * per_entry)
    pc.put("", list(range(10)), cache_with(list(range(10))))
    pc.put("", list(range(100, 110)), cache_with(list(range(100, 110))))
    assert pc.bytes == 2 * per_entry  # compact copies: no spare 256-token capacity counted or kept
    pc.take("", list(range(10)) + [5])  # touch the first: the second is now least recently used
    pc.put("", list(range(200, 210)), cache_with(list(range(200, 210))))
    assert len(pc) == 2 and pc.bytes <= pc.max_bytes and pc.stats.evictions == 1
    assert pc.take("", list(range(100, 110)) + [1]) == (None, 0)
    assert pc.take("", list(range(10)) + [5])[1] == 10


def ring_with(tokens: list[int], window: int = 4) -> list:
    from mlx_lm.models.cache import RotatingKVCache

    c = RotatingKVCache(max_size=window)
    for t in tokens:  # one token at a time, as decode writes: the ring wraps in place
        k = mx.full((1, H, 1, D), float(t))
        c.update_and_fetch(k, -k)
    return [c]


def test_rings_serve_only_exact_prefixes_and_keep_their_ancestors():
    pc = PromptCache(1 << 30)
    pc.put("", [1, 2, 3, 4, 5, 6], ring_with([1, 2, 3, 4, 5, 6]))
    assert pc.take("", [1, 2, 3, 4, 9, 9])[1] == 0  # sharing 4 tokens is not enough for a ring
    assert pc.take("", [1, 2, 3, 4, 5, 6, 7])[1] == 6
    pc.put("", [1, 2, 3, 4, 5, 6, 7, 8], ring_with([1, 2, 3, 4, 5, 6, 7, 8]))
    assert len(pc) == 2  # the longer ring cannot serve the shorter prompt: both stay


def test_lent_rings_and_states_never_change_the_entry():
    from mlx_lm.models.cache import ArraysCache

    pc = PromptCache(1 << 30)
    state = ArraysCache(1)
    state[0] = mx.ones((1, 3))
    pc.put("", [1, 2, 3], ring_with([1, 2, 3]) + [state])
    lent, n = pc.take("", [1, 2, 3, 4])
    assert n == 3
    for t in (40, 41, 42, 43, 44):  # wrap the borrowed ring, and replace the borrowed state
        lent[0].update_and_fetch(mx.full((1, H, 1, D), float(t)), mx.zeros((1, H, 1, D)))
    lent[1][0] = mx.zeros((1, 3))
    again, _ = pc.take("", [1, 2, 3, 4])
    keys = again[0].keys[0, 0, :, 0].tolist()
    assert sorted(int(k) for k in keys[: again[0].offset]) == [1, 2, 3]
    assert again[1][0].tolist() == [[1.0, 1.0, 1.0]]
