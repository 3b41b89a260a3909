"""Row surgery preserves every row's bytes: merge, append, keep, extract, ring wrap included."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import (
    ArraysCache,
    BatchKVCache,
    ChunkedKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
)

from mlxq.kv.batch_ops import extend_batch, extract_row, keep_rows, merge_solo_rows
from mlxq.kv.capabilities import (
    CacheKind,
    Stored,
    UnknownCacheKind,
    batch_class,
    cache_kind,
    can_cache,
    is_trimmable,
    quantized_class,
    stored_as,
)
from mlxq.kv.projection import GROWTH_STEP, KvFootprint, LayerFootprint
from mlxq.kv.quantized import QuantizedRotatingKVCache

H, D = 2, 8


def filled(cache, length: int, seed: int, chunk: int = 5, dim: int = D):
    """Write ``length`` tokens of distinct values, in chunks (as a prefill would), then a few one by one."""
    key = mx.random.key(seed)
    written = 0
    while written < length:
        n = min(chunk, length - written) if written < length - 3 else 1
        k = mx.random.normal((1, H, n, dim), key=mx.random.split(key, written + 1)[written])
        cache.update_and_fetch(k, k * 2)
        written += n
    return cache


def temporal(cache) -> mx.array:
    """A solo cache's keys in token order (rings unrolled); quantized: the packed data, scales, biases."""
    keys = cache.state[0]
    if isinstance(cache, RotatingKVCache):
        keys = cache._temporal_order(keys)
        cut = lambda x: x[..., -min(cache.offset, cache.max_size):, :]  # noqa: E731
    else:
        cut = lambda x: x[..., : cache.offset, :]  # noqa: E731
    if isinstance(keys, (list, tuple)):
        return mx.concatenate([cut(x).astype(mx.float32) for x in keys], axis=-1)
    return cut(keys)


def make(kind: str, length: int, seed: int):
    if kind == "full":
        return filled(KVCache(), length, seed)
    if kind == "qfull":
        return filled(QuantizedKVCache(group_size=32, bits=4), length, seed, dim=64)
    if kind == "qrotating":
        return filled(QuantizedRotatingKVCache(16, 0, group_size=32, bits=8), length, seed, dim=64)
    return filled(RotatingKVCache(max_size=16), length, seed)


@pytest.mark.parametrize("kind", ["full", "rotating", "qfull", "qrotating"])
@pytest.mark.parametrize("lengths", [(5, 9, 3), (20, 7, 33), (40, 41, 16)])
def test_merge_append_keep_extract_roundtrip(kind, lengths):
    solos = [make(kind, n, seed=i) for i, n in enumerate(lengths)]
    expected = [temporal(make(kind, n, seed=i)) for i, n in enumerate(lengths)]
    batch = merge_solo_rows([[solos[0]], [solos[1]]])
    extend_batch(batch, merge_solo_rows([[solos[2]]]))
    for row in range(3):
        assert mx.array_equal(temporal(extract_row(batch, row)[0]), expected[row]), row
    keep_rows(batch, [0, 2])
    assert mx.array_equal(temporal(extract_row(batch, 0)[0]), expected[0])
    assert mx.array_equal(temporal(extract_row(batch, 1)[0]), expected[2])


def test_recurrent_state_rows_survive_surgery():
    def state(seed):
        c = ArraysCache(2)
        c[0] = mx.random.normal((1, 3, 4), key=mx.random.key(seed))
        c[1] = mx.random.normal((1, 5), key=mx.random.key(seed + 100))
        return c

    batch = merge_solo_rows([[state(0)], [state(1)]])
    extend_batch(batch, merge_solo_rows([[state(2)]]))
    keep_rows(batch, [0, 2])
    for row, seed in ((0, 0), (1, 2)):
        solo = extract_row(batch, row)[0]
        assert mx.array_equal(solo[0], state(seed)[0]) and mx.array_equal(solo[1], state(seed)[1])


def test_unknown_cache_classes_are_errors_not_routes():
    with pytest.raises(UnknownCacheKind):
        cache_kind(ChunkedKVCache(chunk_size=8))
    with pytest.raises(UnknownCacheKind):
        cache_kind(RotatingKVCache(max_size=16, keep=4))
    assert cache_kind(KVCache()) is CacheKind.FULL


def test_projection_pads_rows_to_the_longest_and_caps_windows():
    fp = KvFootprint((LayerFootprint(CacheKind.FULL, 100, 0, None),
                      LayerFootprint(CacheKind.ROTATING, 100, 0, 16),
                      LayerFootprint(CacheKind.RECURRENT, 0, 7, None)), prefill_chunk=64)
    # Two rows, the longest 300 tokens -> padded to 512 for full layers, 16 for the ring.
    assert fp.batch_bytes([10, 300]) == 2 * 512 * 100 + 2 * 16 * 100 + 2 * 7
    assert fp.row_bytes(1, prompt_tokens=1) == GROWTH_STEP * 100 + 16 * 100 + 7 + 1 * 100
    # While a prompt prefills, its ring also holds one chunk (capped by the prompt).
    assert fp.prefill_bytes(1000) == 64 * 100 and fp.prefill_bytes(10) == 10 * 100
    assert fp.batch_bytes([]) == 0


def test_measured_footprint_matches_a_real_cache(load_tiny):
    from mlx_lm.models.cache import make_prompt_cache

    from mlxq.kv.projection import measure_footprint

    model, _ = load_tiny("gemma3_text")
    fp = measure_footprint(model, prefill_chunk=2048)
    caches = make_prompt_cache(model)
    model(mx.array([list(range(1, 200))]), cache=caches)
    mx.eval([c.state for c in caches])
    # A 199-token prompt in one chunk: full layers hold one 256-token granule, rings the whole chunk.
    actual = sum(c.nbytes for c in caches)
    assert fp.row_bytes(199, prompt_tokens=199) >= actual
    assert [layer.kind for layer in fp.layers] == [cache_kind(c) for c in caches]


@pytest.mark.parametrize("kind", ["rotating", "qrotating"])
def test_rings_wrap_inside_the_batch_and_extract_exactly(kind):
    """Rows decode together past the window; each extracted row equals its solo ring fed the same tokens."""
    lengths = (9, 14, 30)
    dim = 64 if kind == "qrotating" else D
    solos = [make(kind, n, seed=i) for i, n in enumerate(lengths)]
    batch = merge_solo_rows([[c] for c in [make(kind, n, seed=i) for i, n in enumerate(lengths)]])
    for step in range(21):  # more than the 16-token window
        k = mx.random.normal((len(lengths), H, 1, dim), key=mx.random.key(100 + step))
        batch[0].update_and_fetch(k, k * 2)
        for row, solo in enumerate(solos):
            solo.update_and_fetch(k[row : row + 1], k[row : row + 1] * 2)
    for row, solo in enumerate(solos):
        assert mx.array_equal(temporal(extract_row(batch, row)[0]), temporal(solo)), row


def test_one_table_answers_every_rule_and_unknown_classes_fail_closed():
    assert stored_as(KVCache()) is Stored.SPANS and stored_as(QuantizedKVCache()) is Stored.SPANS
    assert stored_as(RotatingKVCache(max_size=16)) is Stored.SNAPSHOT and stored_as(ArraysCache(2)) is Stored.SNAPSHOT
    assert is_trimmable([KVCache(), QuantizedKVCache()]) and not is_trimmable([KVCache(), ArraysCache(2)])
    assert batch_class(KVCache()) is BatchKVCache and batch_class(ArraysCache(2)) is ArraysCache
    assert quantized_class(KVCache()) is QuantizedKVCache and quantized_class(ArraysCache(2)) is None
    # A class the table does not list, or a ring with attention sinks: never stored, never batched.
    assert not can_cache([KVCache(), ChunkedKVCache(chunk_size=8)])
    assert not can_cache([RotatingKVCache(max_size=16, keep=4)])
    with pytest.raises(UnknownCacheKind):
        batch_class(ChunkedKVCache(chunk_size=8))
    with pytest.raises(UnknownCacheKind):
        batch_class(BatchKVCache([0]))  # already batched


def test_the_tables_mlxkv_tags_are_what_the_file_format_writes():
    from mlxq.kv.capabilities import ops_of
    from mlxq.kv.quantized import quantize_rotating
    from mlxq.store.layer_codec import encode_layer

    kv = mx.random.normal((1, 2, 8, 32))
    full, ring, state = KVCache(), RotatingKVCache(max_size=16), ArraysCache(2)
    full.update_and_fetch(kv, kv)
    ring.update_and_fetch(kv, kv)
    state[0] = kv
    caches = [full, ring, state, full.to_quantized(group_size=32, bits=8), quantize_rotating(ring, 32, 8)]
    for cache in caches:
        assert encode_layer(cache)[0] == ops_of(cache).mlxkv_tag, type(cache).__name__
