"""The RAM tier: a byte-capped LRU of prompt prefixes and their KV caches.

Keyed by (namespace, exact token prefix). ``take`` finds the entry sharing
the longest prefix with a new prompt (capped at len(prompt) - 1, so at least
one token is always computed and sampled from fresh logits) and *lends* its
caches: the borrower gets new cache objects over views of the stored arrays,
and its first write re-allocates, so a borrower never changes what is stored
and many borrowers can share one prefix. ``put`` stores a finished request's
caches, replacing exact duplicates and dropping entries that are strict
prefixes of the new one (a longer entry serves every prompt they served).

Entries of full-attention models (every layer a ``KVCache``) are trimmable:
one entry serves any shorter common prefix. Sliding-window rings
(``RotatingKVCache``) and recurrent state (``ArraysCache``) cannot be cut
back, so their entries serve only prompts they are an exact prefix of; the
lanes store those as *prompt-boundary snapshots* (the state after a
prompt's last-but-one token), which is what the next turn of a conversation
or another agent with the same system prompt starts with. Such an entry
keeps its shorter ancestors: a longer one cannot serve them.

With a cold tier attached (store.cold_tier), every put is reported to it
(write-behind to SSD), every removal says why (an evicted entry that is not
yet on disk is spilled), and ``take`` asks it for a strictly longer usable
prefix than RAM holds, which it restores into RAM before lending.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache, RotatingKVCache

from mlxq.kv.quantized import QuantizedRotatingKVCache
from mlxq.store.prefix import usable_prefix


@dataclass
class CacheEntry:
    tokens: tuple[int, ...]  # the exact prefix whose state the caches hold
    caches: list  # one cache per layer, private to the entry (copied in), never written
    nbytes: int
    trimmable: bool  # every layer a KVCache: the entry also serves shorter prefixes
    namespace: str = ""
    last_used: float = field(default_factory=time.monotonic)


@dataclass
class PromptCacheStats:
    queries: int = 0  # take() calls
    hits: int = 0  # take() calls that lent a prefix
    hit_tokens: int = 0  # prompt tokens served from the cache
    puts: int = 0
    evictions: int = 0


def _rebuild(cache, n: int, *, copy: bool):
    """A new cache object over the state of ``cache``: views (``copy=False``, lending) or compact
    copies (``copy=True``, storing). Trimmable caches keep their first ``n`` tokens.

    mlx-lm caches write in place through their own handles (``self.keys[...] = ...``); MLX
    arrays have value semantics, so a write through a new handle never changes what another
    handle sees, and a view with no spare capacity re-allocates on its first update.
    """
    own = mx.contiguous if copy else (lambda a: a[...])

    def whole(x):
        return None if x is None else tree_map(own, x)

    def head(x):
        return tree_map(lambda a: own(a[..., :n, :]), x)

    kind = type(cache)
    if kind is KVCache:
        out = KVCache()
        out.state = (head(cache.keys), head(cache.values), n)
    elif kind is QuantizedKVCache:
        out = QuantizedKVCache(cache.group_size, cache.bits)
        out.keys, out.values, out.offset = head(cache.keys), head(cache.values), n
    elif kind in (RotatingKVCache, QuantizedRotatingKVCache):
        if kind is QuantizedRotatingKVCache:
            out = QuantizedRotatingKVCache(cache.max_size, cache.keep, cache.group_size, cache.bits)
        else:
            out = RotatingKVCache(cache.max_size, cache.keep)
        out.keys, out.values = whole(cache.keys), whole(cache.values)
        out.offset, out._idx = cache.offset, cache._idx
    else:
        out = ArraysCache(len(cache.cache))
        out.cache = [whole(a) for a in cache.cache]
    return out


def _lend(cache, n: int):
    """A borrower's copy-on-write view of a stored cache."""
    return _rebuild(cache, n, copy=False)


def _copy_in(cache, n: int):
    """The entry's own compact copy of ``cache`` (which keeps being written by its row)."""
    return _rebuild(cache, n, copy=True)


def _state_arrays(cache) -> list:
    if isinstance(cache, ArraysCache):
        return [a for a in cache.cache if a is not None]
    return [cache.keys, cache.values]


def _holds(cache, n: int) -> bool:
    """Does ``cache`` hold state for exactly (untrimmable) or at least (KVCache) n tokens?"""
    if type(cache) in (KVCache, QuantizedKVCache):
        return cache.offset >= n
    if type(cache) in (RotatingKVCache, QuantizedRotatingKVCache):
        return cache.offset == n
    return isinstance(cache, ArraysCache)


# Snapshot a prompt boundary only when the prefix is worth a lookup.
MIN_SNAPSHOT_TOKENS = 32


def is_trimmable(caches: list) -> bool:
    """Full-attention only: store at finish (any shorter prefix is servable). Else: snapshots."""
    return all(type(c) in (KVCache, QuantizedKVCache) for c in caches)


def can_cache(caches: list) -> bool:
    """Cache classes the prompt cache knows how to copy and lend."""
    return all(type(c) in (KVCache, QuantizedKVCache, ArraysCache)
               or (type(c) in (RotatingKVCache, QuantizedRotatingKVCache) and not c.keep) for c in caches)


Key = tuple[str, tuple[int, ...]]  # (namespace, exact tokens)


class PromptCache:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._entries: OrderedDict[Key, CacheEntry] = OrderedDict()  # LRU first
        self.bytes = 0
        self.stats = PromptCacheStats()
        self.cold = None  # store.cold_tier.ColdTier, when an SSD tier is configured

    def __len__(self) -> int:
        return len(self._entries)

    def take(self, namespace: str, prompt: list[int], cold: bool = True) -> tuple[list | None, int]:
        """(lent caches, cached token count) for the longest usable prefix, or (None, 0).

        ``cold=False`` looks in RAM only (the batch lane restores from disk step by step,
        then calls ``adopt_restored``)."""
        self.stats.queries += 1
        best_key, best_len = None, 0
        for key, entry in self._entries.items():
            if key[0] != namespace:
                continue
            n = usable_prefix(entry.tokens, entry.trimmable, prompt)
            if n > best_len:
                best_key, best_len = key, n
        if self.cold is not None and cold:
            restored = self.cold.restore(namespace, prompt, better_than=best_len)
            if restored is not None:
                entry, n = restored
                return self.adopt_restored(namespace, entry, n, previous=0), n
        if best_key is None:
            return None, 0
        self._entries.move_to_end(best_key)
        entry = self._entries[best_key]
        entry.last_used = time.monotonic()
        self.stats.hits += 1
        self.stats.hit_tokens += best_len
        return [_lend(c, best_len) for c in entry.caches], best_len

    def adopt_restored(self, namespace: str, entry: CacheEntry, n: int, previous: int) -> list:
        """Hold an entry read from disk (already durable; kept only if it fits the tier) and lend its
        first ``n`` tokens to the request that asked for it, which had ``previous`` tokens from RAM."""
        self._insert((namespace, entry.tokens), entry, durable=True)
        if not previous:
            self.stats.hits += 1
        self.stats.hit_tokens += n - previous
        return [_lend(c, n) for c in entry.caches]

    def put(self, namespace: str, tokens: list[int], caches: list) -> None:
        """Store a copy of ``caches`` (their state after exactly ``tokens``; KVCaches may hold more)."""
        n = len(tokens)
        if n == 0 or not all(_holds(c, n) for c in caches):
            return
        trimmable = is_trimmable(caches)
        key = (namespace, tuple(tokens))
        for other, entry in list(self._entries.items()):
            if other[0] != namespace or len(other[1]) > n or key[1][: len(other[1])] != other[1]:
                continue
            if other[1] == key[1] or (trimmable and entry.trimmable):
                self._remove(other, "superseded")  # an exact duplicate, or a prefix this entry now serves
        stored = [_copy_in(c, n) for c in caches]
        mx.eval([_state_arrays(c) for c in stored])
        entry = CacheEntry(key[1], stored, sum(c.nbytes for c in stored), trimmable, namespace)
        if self._insert(key, entry, durable=False) is not None:
            self.stats.puts += 1

    def _insert(self, key: Key, entry: CacheEntry, *, durable: bool) -> Key | None:
        """Hold ``entry`` (evicting LRU entries to fit); None when it is larger than the whole tier."""
        if entry.nbytes > self.max_bytes:
            return None
        if key in self._entries:
            self._remove(key, "superseded")
        self._entries[key] = entry
        self.bytes += entry.nbytes
        if self.cold is not None and not durable:
            self.cold.on_put(key, entry)
        while self.bytes > self.max_bytes:
            self._remove(next(iter(self._entries)), "evicted")
            self.stats.evictions += 1
        return key

    def _remove(self, key: Key, reason: str) -> None:
        entry = self._entries.pop(key)
        self.bytes -= entry.nbytes
        if self.cold is not None:
            self.cold.on_removed(key, entry, reason)

    def drop(self, key: Key) -> None:
        """Let go of an entry that is safe on SSD (idle demotion)."""
        if key in self._entries:
            self._remove(key, "demoted")

    def idle_keys(self, older_than: float) -> list[Key]:
        """Keys of entries not taken or put since the monotonic time ``older_than``."""
        return [k for k, e in self._entries.items() if e.last_used < older_than]

    def as_dict(self) -> dict:
        s = self.stats
        return {"entries": len(self._entries), "bytes": self.bytes, "max_bytes": self.max_bytes,
                "queries": s.queries, "hits": s.hits, "hit_tokens": s.hit_tokens, "puts": s.puts,
                "evictions": s.evictions}
