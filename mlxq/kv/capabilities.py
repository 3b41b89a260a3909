"""One table of what mlxq does with each cache class: an explicit registry, never a guess.

Every cache a model makes is looked up by its exact class, and every module
that needs a rule about a class (batch surgery, the prompt cache's spans and
snapshots, byte accounting, quantization) reads it from this table instead
of testing classes itself; adding a kind is one entry. A class that is not
registered raises ``UnknownCacheKind`` (reference kv-cache.md §2.4: an
"unknown" that silently routes is how a batch once dropped a layer's ring).
The engine asks once at start-up, so a model with an unknown cache class is
served serially *with the reason named in /stats*, and the batch lane itself
never meets one.

The ``.mlxkv`` encoding of each class is store/layer_codec.py's (the file
format's own versioned registry); ``mlxkv_tag`` here names the tag it
writes (a test holds the two together), so a new entry in this table shows
what the file format must learn too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from mlx_lm.models.cache import (
    ArraysCache,
    BatchKVCache,
    BatchRotatingKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
)

from mlxq.kv.quantized import (
    BatchQuantizedKVCache,
    BatchQuantizedRotatingKVCache,
    QuantizedRotatingKVCache,
    quantize_rotating,
)
from mlxq.kv.shared_prefix_cache import SharedPrefixBatchCache


class CacheKind(str, Enum):
    FULL = "full"  # full attention: grows by one token per step
    ROTATING = "rotating"  # sliding window: a ring of max_size tokens
    RECURRENT = "recurrent"  # fixed-size state (SSM / gated delta-net conv + state)


class Stored(str, Enum):
    """How the prompt cache keeps a layer, and so how it lends it."""

    SPANS = "spans"  # cut along the token axis; lent as the concatenation of a path's spans (a copy)
    SNAPSHOT = "snapshot"  # the whole state at a node's end; lent copy-on-write (views)


class UnknownCacheKind(TypeError):
    """A cache class the batch lane has no join/filter/extract operations for."""


@dataclass(frozen=True)
class KindOps:
    """The rules for one cache class."""

    kind: CacheKind
    batch_class: type | None  # solo classes: what they merge into (merge / extend / filter / extract)
    stored: Stored | None  # solo classes: how the prompt cache holds them; None for batched classes
    quantized_class: type | None = None  # what --kv-quant converts a populated one to (kv/scheme.py)
    mlxkv_tag: str | None = None  # the kind tag store/layer_codec.py writes for it
    quantize: Callable | None = None  # (cache, group_size, bits) -> a ``quantized_class`` holding the same tokens

    @property
    def trimmable(self) -> bool:
        """Any prefix of its state serves a prompt (full attention): stored at finish, cut at will."""
        return self.stored is Stored.SPANS

    def holds(self, offset: int, n: int) -> bool:
        """Does a cache at ``offset`` hold the state after exactly (rings) or at least (spans) n tokens?
        A recurrent state carries no offset: whoever stores it knows its token count."""
        if self.kind is CacheKind.RECURRENT:
            return True
        return offset >= n if self.trimmable else offset == n


def _quantize_full(cache, group_size: int, bits: int):
    # The class's method, not the instance's: an instance may carry a hook armed by kv/scheme.py.
    return KVCache.to_quantized(cache, group_size=group_size, bits=bits)


_TABLE: dict[type, KindOps] = {
    KVCache: KindOps(CacheKind.FULL, BatchKVCache, Stored.SPANS, QuantizedKVCache, "kv", _quantize_full),
    RotatingKVCache: KindOps(CacheKind.ROTATING, BatchRotatingKVCache, Stored.SNAPSHOT, QuantizedRotatingKVCache,
                             "rotating", quantize_rotating),
    ArraysCache: KindOps(CacheKind.RECURRENT, ArraysCache, Stored.SNAPSHOT, None, "arrays"),
    QuantizedKVCache: KindOps(CacheKind.FULL, BatchQuantizedKVCache, Stored.SPANS, None, "qkv"),
    QuantizedRotatingKVCache: KindOps(CacheKind.ROTATING, BatchQuantizedRotatingKVCache, Stored.SNAPSHOT, None,
                                      "rotating-qkv"),
    # Batched classes: what a running batch holds (never stored, never quantized again).
    BatchKVCache: KindOps(CacheKind.FULL, None, None),
    SharedPrefixBatchCache: KindOps(CacheKind.FULL, None, None),  # rows' tails over one referenced prefix
    BatchRotatingKVCache: KindOps(CacheKind.ROTATING, None, None),
    BatchQuantizedKVCache: KindOps(CacheKind.FULL, None, None),
    BatchQuantizedRotatingKVCache: KindOps(CacheKind.ROTATING, None, None),
}
# ArraysCache is both: mlx-lm's recurrent state stacks rows in the same class.


def ops_of(cache) -> KindOps:
    """The table's entry for this cache; UnknownCacheKind for a class it does not list."""
    ops = _TABLE.get(type(cache))
    if ops is None:
        raise UnknownCacheKind(f"no batch operations for cache class {type(cache).__name__}")
    return ops


def _has_sink(cache) -> bool:
    # mlx-lm's BatchRotatingKVCache has no "keep" (attention-sink) prefix, and a ring with one
    # cannot be rebuilt from a snapshot of its window either.
    return ops_of(cache).kind is CacheKind.ROTATING and bool(getattr(cache, "keep", 0))


def layer_kind(cache) -> CacheKind:
    """What a cache holds (for byte accounting), whether or not the batch lane can join it."""
    ops = _TABLE.get(type(cache))
    if ops is None:
        raise UnknownCacheKind(f"unknown cache class {type(cache).__name__}")
    return ops.kind


def cache_kind(cache) -> CacheKind:
    """The kind the batch lane joins by; UnknownCacheKind when it cannot batch this cache."""
    if _has_sink(cache):
        raise UnknownCacheKind(f"RotatingKVCache with keep={cache.keep} cannot be batched")
    return ops_of(cache).kind


def model_cache_kinds(caches: list) -> list[CacheKind]:
    """Kinds of a fresh ``make_prompt_cache(model)``; raises UnknownCacheKind."""
    return [cache_kind(c) for c in caches]


def batch_class(solo) -> type:
    """The batched class a solo cache merges into."""
    cache_kind(solo)
    cls = ops_of(solo).batch_class
    if cls is None:
        raise UnknownCacheKind(f"{type(solo).__name__} is already a batched cache")
    return cls


def stored_as(cache) -> Stored | None:
    """How the prompt cache keeps this layer; None when it cannot (unknown, batched, a ring with sinks)."""
    ops = _TABLE.get(type(cache))
    if ops is None or _has_sink(cache):
        return None
    return ops.stored


def is_spans(cache) -> bool:
    """A full-attention solo layer: the prompt cache cuts it into token spans."""
    return stored_as(cache) is Stored.SPANS


def is_trimmable(caches: list) -> bool:
    """Every layer full attention: any stored prefix is servable, so a lane stores at finish."""
    return all(is_spans(c) for c in caches)


def can_cache(caches: list) -> bool:
    """Cache classes the prompt cache knows how to store and lend."""
    return all(stored_as(c) is not None for c in caches)


def quantized_class(cache) -> type | None:
    """What --kv-quant turns this populated cache into; None when it stays as it is."""
    ops = _TABLE.get(type(cache))
    return None if ops is None else ops.quantized_class


def quantized(cache, group_size: int, bits: int):
    """The cache quantized as --kv-quant does; the cache itself when it stays as it is
    (already quantized, recurrent state)."""
    ops = _TABLE.get(type(cache))
    return cache if ops is None or ops.quantize is None else ops.quantize(cache, group_size, bits)
