"""The RAM tier: a byte-capped LRU of prompt prefixes and their KV caches.

Keyed by (namespace, exact token prefix). ``take`` finds the entry sharing
the longest prefix with a new prompt (capped at len(prompt) - 1, so at least
one token is always computed and sampled from fresh logits) and *lends* its
caches: the borrower gets new cache objects over views of the stored arrays,
and its first write re-allocates, so a borrower never changes what is stored
and many borrowers can share one prefix. ``put`` stores a finished request's
caches, replacing exact duplicates and dropping entries that are strict
prefixes of the new one (a longer entry serves every prompt they served).

This slice holds full-attention caches only (``KVCache``: trimmable, so an
entry can serve any shorter common prefix). Models with sliding-window or
recurrent layers need prompt-boundary snapshots; the engine leaves the cache
off for them and says why in /stats.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.cache import KVCache


@dataclass
class CacheEntry:
    tokens: tuple[int, ...]  # the exact prefix whose KV the caches hold
    caches: list  # one KVCache per layer, holding exactly len(tokens) tokens, compact
    nbytes: int


@dataclass
class PromptCacheStats:
    queries: int = 0  # take() calls
    hits: int = 0  # take() calls that lent a prefix
    hit_tokens: int = 0  # prompt tokens served from the cache
    puts: int = 0
    evictions: int = 0


def _common_prefix(a: tuple[int, ...], b: list[int], limit: int) -> int:
    n = min(len(a), limit)
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _lend(cache: KVCache, n: int) -> KVCache:
    # New array handles over the first n tokens, with no spare capacity: the
    # borrower's first update_and_fetch re-allocates (KVCache grows by concat)
    # instead of writing into the stored buffer. mlx-lm's KVCache writes in
    # place through its own handle, so sharing the handle would leak writes.
    borrowed = KVCache()
    borrowed.state = (cache.keys[..., :n, :], cache.values[..., :n, :], n)
    return borrowed


def _compact(cache: KVCache, n: int) -> KVCache:
    """A KVCache holding exactly the first n tokens in its own buffer (no spare capacity)."""
    stored = KVCache()
    stored.state = (mx.contiguous(cache.keys[..., :n, :]), mx.contiguous(cache.values[..., :n, :]), n)
    return stored


class PromptCache:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[str, tuple[int, ...]], CacheEntry] = OrderedDict()  # LRU first
        self.bytes = 0
        self.stats = PromptCacheStats()

    def __len__(self) -> int:
        return len(self._entries)

    def take(self, namespace: str, prompt: list[int]) -> tuple[list | None, int]:
        """(lent caches, cached token count) for the longest usable prefix, or (None, 0)."""
        self.stats.queries += 1
        limit = len(prompt) - 1
        best_key, best_len = None, 0
        for key, entry in self._entries.items():
            if key[0] != namespace:
                continue
            n = _common_prefix(entry.tokens, prompt, limit)
            if n > best_len:
                best_key, best_len = key, n
        if best_key is None:
            return None, 0
        self._entries.move_to_end(best_key)
        entry = self._entries[best_key]
        self.stats.hits += 1
        self.stats.hit_tokens += best_len
        return [_lend(c, best_len) for c in entry.caches], best_len

    def put(self, namespace: str, tokens: list[int], caches: list) -> None:
        """Store ``caches`` (which hold at least len(tokens) tokens) under ``tokens``."""
        n = len(tokens)
        if n == 0 or any(not isinstance(c, KVCache) or c.offset < n for c in caches):
            return
        key = (namespace, tuple(tokens))
        for other in [k for k in self._entries if k[0] == namespace and len(k[1]) <= n and key[1][: len(k[1])] == k[1]]:
            self._remove(other)  # an exact duplicate, or a strict prefix this entry now serves
        stored = [_compact(c, n) for c in caches]
        mx.eval([(c.keys, c.values) for c in stored])
        entry = CacheEntry(key[1], stored, sum(c.nbytes for c in stored))
        if entry.nbytes > self.max_bytes:
            return
        self._entries[key] = entry
        self.bytes += entry.nbytes
        self.stats.puts += 1
        while self.bytes > self.max_bytes:
            self._remove(next(iter(self._entries)))
            self.stats.evictions += 1

    def _remove(self, key) -> None:
        entry = self._entries.pop(key)
        self.bytes -= entry.nbytes

    def as_dict(self) -> dict:
        s = self.stats
        return {"entries": len(self._entries), "bytes": self.bytes, "max_bytes": self.max_bytes,
                "queries": s.queries, "hits": s.hits, "hit_tokens": s.hit_tokens, "puts": s.puts,
                "evictions": s.evictions}
