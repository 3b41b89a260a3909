"""What the batch lane can do with each cache class: an explicit registry, never a guess.

Every cache a model makes is looked up by its exact class. A class that is
not registered raises ``UnknownCacheKind`` (reference kv-cache.md §2.4: an
"unknown" that silently routes is how a batch once dropped a layer's ring).
The gateway asks once at start-up, so a model with an unknown cache class is
served serially *with the reason named in /stats*, and the scheduler itself
never meets one.
"""

from __future__ import annotations

from enum import Enum

from mlx_lm.models.cache import (
    ArraysCache,
    BatchKVCache,
    BatchRotatingKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
)

from mlxq.kv.quantized import BatchQuantizedKVCache, BatchQuantizedRotatingKVCache, QuantizedRotatingKVCache
from mlxq.kv.shared_prefix_cache import SharedPrefixBatchCache


class CacheKind(str, Enum):
    FULL = "full"  # full attention: grows by one token per step
    ROTATING = "rotating"  # sliding window: a ring of max_size tokens
    RECURRENT = "recurrent"  # fixed-size state (SSM / gated delta-net conv + state)


class UnknownCacheKind(TypeError):
    """A cache class the batch lane has no join/filter/extract operations for."""


# Solo classes (what a prefill makes) and the batched classes they merge into.
_KIND_BY_CLASS: dict[type, CacheKind] = {
    KVCache: CacheKind.FULL,
    BatchKVCache: CacheKind.FULL,
    SharedPrefixBatchCache: CacheKind.FULL,  # rows' tails over one referenced prefix
    RotatingKVCache: CacheKind.ROTATING,
    BatchRotatingKVCache: CacheKind.ROTATING,
    ArraysCache: CacheKind.RECURRENT,
    QuantizedKVCache: CacheKind.FULL,
    BatchQuantizedKVCache: CacheKind.FULL,
    QuantizedRotatingKVCache: CacheKind.ROTATING,
    BatchQuantizedRotatingKVCache: CacheKind.ROTATING,
}


def layer_kind(cache) -> CacheKind:
    """What a cache holds (for byte accounting), whether or not the batch lane can join it."""
    kind = _KIND_BY_CLASS.get(type(cache))
    if kind is None:
        raise UnknownCacheKind(f"unknown cache class {type(cache).__name__}")
    return kind


def cache_kind(cache) -> CacheKind:
    """The kind the batch lane joins by; UnknownCacheKind when it cannot batch this cache."""
    kind = _KIND_BY_CLASS.get(type(cache))
    if kind is None:
        raise UnknownCacheKind(f"no batch operations for cache class {type(cache).__name__}")
    if kind is CacheKind.ROTATING and getattr(cache, "keep", 0):
        # mlx-lm's BatchRotatingKVCache has no "keep" (attention-sink) prefix.
        raise UnknownCacheKind(f"RotatingKVCache with keep={cache.keep} cannot be batched")
    return kind


def model_cache_kinds(caches: list) -> list[CacheKind]:
    """Kinds of a fresh ``make_prompt_cache(model)``; raises UnknownCacheKind."""
    return [cache_kind(c) for c in caches]
