"""A batch cache kind for rows that reference one shared prefix plus their own tails.

Per full-attention layer: the prefix's keys and values once ([1, Hkv, P, D],
referenced, never copied per row: e.g. the spans of a prompt-cache node
chain) and a BatchKVCache ``tail`` holding each row's own tokens after the
prefix, left-padded and right-aligned as mlx-lm's batch lane keeps them.
What the model sees stays per row: ``offset`` (RoPE positions) is the
prefix length plus the row's tail offset, and ``make_mask`` is the tail's.

``update_and_fetch`` writes the tail only and returns the tail's keys and
values; the model then calls mlx-lm's ``scaled_dot_product_attention`` with
this cache, which kv/attention_route.py sends to ``attend`` (the prefix
read once for the group, merged with each row's tail by log-sum-exp). A
model that computed attention from the returned keys by hand would see the
tail alone: kv/sharing_plan.py probes a model once and declines sharing for
it when any shared layer's attention does not come through the seam.

``filter``/``extend`` move the tail rows and keep the prefix reference;
``extract`` gives one row as a plain mlx-lm KVCache (prefix + its tail: the
one copy, made when a row leaves the group).
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache, _BaseCache

from mlxq.kv import shared_prefix_decode


class PrefixMismatch(ValueError):
    """Two groups with different prefixes cannot be joined into one cache."""


class SharedPrefixBatchCache(_BaseCache):
    def __init__(self, prefix_keys: mx.array, prefix_values: mx.array, tail: BatchKVCache):
        if prefix_keys.ndim != 4 or prefix_keys.shape[0] != 1 or prefix_keys.shape[2] == 0:
            raise ValueError(f"prefix keys must be [1, kv_heads, P>0, dim], got {prefix_keys.shape}")
        self.prefix_keys = prefix_keys
        self.prefix_values = prefix_values
        self.prefix_length = prefix_keys.shape[2]
        self.tail = tail
        self._fetched = None  # the tail arrays update_and_fetch last returned (see attend)

    @classmethod
    def from_tails(cls, prefix_keys: mx.array, prefix_values: mx.array, tails: list[KVCache]):
        """The group of rows whose own tokens after the prefix are ``tails`` (solo caches, possibly empty)."""
        return cls(prefix_keys, prefix_values, BatchKVCache.merge(tails))

    @property
    def offset(self) -> mx.array:
        return self.tail.offset + self.prefix_length

    @property
    def left_padding(self) -> mx.array:
        return self.tail.left_padding

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        self._fetched = self.tail.update_and_fetch(keys, values)
        return self._fetched

    def make_mask(self, N: int, return_array: bool = False, **kwargs):
        return self.tail.make_mask(N, return_array=return_array, **kwargs)

    def fetched(self, keys: mx.array) -> bool:
        """Whether ``keys`` are the tail keys this cache last handed out (unchanged by the model)."""
        return self._fetched is not None and keys is self._fetched[0]

    def attend(self, queries: mx.array, keys: mx.array, values: mx.array, scale: float,
               sinks: mx.array | None = None) -> mx.array:
        """Attention of the rows' queries over [prefix ; own tail]; ``keys``/``values`` are the fetched tail."""
        if not self.fetched(keys):
            raise ValueError("shared-prefix attention needs the keys update_and_fetch returned, unchanged")
        return shared_prefix_decode.attention(queries, self.prefix_keys, self.prefix_values, keys, values,
                                              self.tail.left_padding, scale, sinks)

    def prepare(self, **kwargs):
        self.tail.prepare(**kwargs)

    def finalize(self):
        self.tail.finalize()

    def filter(self, batch_indices) -> None:
        self.tail.filter(batch_indices)

    def extend(self, other: SharedPrefixBatchCache) -> None:
        if other.prefix_keys is not self.prefix_keys or other.prefix_values is not self.prefix_values:
            raise PrefixMismatch("rows sharing different prefixes cannot join one group")
        self.tail.extend(other.tail)

    def extract(self, idx: int) -> KVCache:
        """Row ``idx`` as a solo KVCache over prefix + its own tail (a copy it owns)."""
        cache = KVCache()
        if self.tail.keys is None:
            keys, values = self.prefix_keys, self.prefix_values
        else:
            own_keys, own_values = self.tail.extract(idx).state[:2]
            keys = mx.concatenate([self.prefix_keys, own_keys], axis=2)
            values = mx.concatenate([self.prefix_values, own_values], axis=2)
        cache.keys, cache.values = mx.contiguous(keys), mx.contiguous(values)
        cache.offset = cache.keys.shape[2]
        return cache

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        return self.tail.trim(n)  # the shared prefix is never trimmed from under the group

    def size(self) -> int:
        return self.prefix_length + self.tail.size()

    def empty(self) -> bool:
        return False

    @property
    def nbytes(self) -> int:
        """The rows' own bytes: the prefix belongs to whoever lent it (counted once there)."""
        return self.tail.nbytes

    @property
    def prefix_nbytes(self) -> int:
        return self.prefix_keys.nbytes + self.prefix_values.nbytes

    @property
    def state(self):
        raise TypeError("a shared-prefix cache is not saved whole: extract its rows first")

    @state.setter
    def state(self, v):
        raise TypeError("a shared-prefix cache is built from a prefix and tails, not restored")
