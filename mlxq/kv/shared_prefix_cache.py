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

Rows of the batch outside the group (``shares`` False: a stray in a batch
of agents) keep their whole history as their tail and never see the
prefix; their offsets are the tail's alone.

``filter``/``extend`` move the tail rows and keep the prefix reference;
``extract`` gives one row as a plain mlx-lm KVCache (prefix + its tail: the
one copy, made when a row leaves the group).

Quantized layers (``--kv-quant``) are the same with triples: the prefix as
(data, scales, biases) for keys and for values, the tails in a
BatchQuantizedKVCache, ``extract`` giving a QuantizedKVCache.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache, QuantizedKVCache, _BaseCache

from mlxq.kv import shared_prefix_decode
from mlxq.kv.quantized import BatchQuantizedKVCache, triple_nbytes
from mlxq.kv.shared_prefix_attention import KV, Quant


class PrefixMismatch(ValueError):
    """Two groups with different prefixes cannot be joined into one cache."""


class SharedPrefixBatchCache(_BaseCache):
    def __init__(self, prefix_keys: KV, prefix_values: KV, tail: BatchKVCache, shares: list[bool] | None = None):
        self.quant = Quant(tail.group_size, tail.bits) if isinstance(tail, BatchQuantizedKVCache) else None
        shape = prefix_keys[0].shape if self.quant else prefix_keys.shape
        if isinstance(prefix_keys, (tuple, list)) != (self.quant is not None):
            raise ValueError("a quantized tail needs a quantized (triple) prefix, and a plain one a plain prefix")
        if len(shape) != 4 or shape[0] != 1 or shape[2] == 0:
            raise ValueError(f"prefix keys must be [1, kv_heads, P>0, dim], got {shape}")
        self.prefix_keys = prefix_keys
        self.prefix_values = prefix_values
        self.prefix_length = shape[2]
        self.tail = tail
        rows = tail.left_padding.shape[0]
        self._set_shares([True] * rows if shares is None else list(shares))
        if len(self.row_shares) != rows:
            raise ValueError(f"shares names {len(self.row_shares)} rows, the tail holds {rows}")
        self._fetched = None  # the tail arrays update_and_fetch last returned (see attend)

    @classmethod
    def from_tails(cls, prefix_keys: KV, prefix_values: KV, tails: list, shares: list[bool] | None = None):
        """The group of rows whose own tokens after the prefix are ``tails`` (solo KVCache or
        QuantizedKVCache, possibly empty; a row outside the group: its whole history)."""
        batch_class = BatchQuantizedKVCache if type(tails[0]) is QuantizedKVCache else BatchKVCache
        return cls(prefix_keys, prefix_values, batch_class.merge(tails), shares)

    def _set_shares(self, row_shares: list[bool]) -> None:
        self.row_shares = [bool(x) for x in row_shares]  # per row: it sees the prefix (host side: no sync)
        self.shares = mx.array(self.row_shares)
        self._all_share = all(self.row_shares)

    @property
    def offset(self) -> mx.array:
        return self.tail.offset + mx.where(self.shares, self.prefix_length, 0)

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
                                              self.tail.left_padding, scale, sinks, self.quant,
                                              None if self._all_share else self.shares)

    def prepare(self, **kwargs):
        self.tail.prepare(**kwargs)

    def finalize(self):
        self.tail.finalize()

    def filter(self, batch_indices) -> None:
        self.tail.filter(batch_indices)
        indices = batch_indices.tolist() if isinstance(batch_indices, mx.array) else list(batch_indices)
        self._set_shares([self.row_shares[i] for i in indices])

    def extend(self, other: SharedPrefixBatchCache) -> None:
        if other.prefix_keys is not self.prefix_keys or other.prefix_values is not self.prefix_values:
            raise PrefixMismatch("rows sharing different prefixes cannot join one group")
        self.tail.extend(other.tail)
        self._set_shares(self.row_shares + other.row_shares)

    def extract(self, idx: int) -> KVCache | QuantizedKVCache:
        """Row ``idx`` as a solo cache over prefix + its own tail (a copy it owns)."""
        if not self.row_shares[idx]:
            return self.tail.extract(idx)  # outside the group: its tail is its whole history
        cache = QuantizedKVCache(self.quant.group_size, self.quant.bits) if self.quant else KVCache()
        keys, values = self.prefix_keys, self.prefix_values
        if self.tail.keys is not None:
            own = self.tail.extract(idx)
            keys, values = _join(keys, own.keys), _join(values, own.values)
        cache.keys, cache.values = _contiguous(keys), _contiguous(values)
        cache.offset = (cache.keys[0] if self.quant else cache.keys).shape[2]
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
        if self.quant:
            return triple_nbytes(self.prefix_keys) + triple_nbytes(self.prefix_values)
        return self.prefix_keys.nbytes + self.prefix_values.nbytes

    @property
    def state(self):
        raise TypeError("a shared-prefix cache is not saved whole: extract its rows first")

    @state.setter
    def state(self, v):
        raise TypeError("a shared-prefix cache is built from a prefix and tails, not restored")


def _join(prefix: KV, own: KV) -> KV:
    if isinstance(prefix, (tuple, list)):
        return tuple(mx.concatenate([p, o], axis=2) for p, o in zip(prefix, own, strict=True))
    return mx.concatenate([prefix, own], axis=2)


def _contiguous(x: KV) -> KV:
    return tuple(mx.contiguous(a) for a in x) if isinstance(x, (tuple, list)) else mx.contiguous(x)
