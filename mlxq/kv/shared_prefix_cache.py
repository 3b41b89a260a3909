"""A batch cache kind for rows that reference a shared prefix plus their own tails.

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

A batch may hold several groups (``grouped``: agents of two system
prompts): ``prefixes[g]`` per group and ``row_groups`` per row (-1 for a
stray); each row's offset adds its own group's prefix length, and the
attention reads each prefix once for its group's rows
(``shared_prefix_decode.grouped_attention``).

``filter``/``extend`` move the tail rows and keep the prefix references
(``extend`` with a prefix this cache does not hold adds a group; a group
no row reads any more is dropped); ``extract`` gives one row as a plain
mlx-lm KVCache (its prefix + its tail: the one copy, made when a row
leaves the group).

Quantized layers (``--kv-quant``) are the same with triples: the prefix as
(data, scales, biases) for keys and for values, the tails in a
BatchQuantizedKVCache, ``extract`` giving a QuantizedKVCache.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache, QuantizedKVCache, _BaseCache

from mlxq.kv import shared_prefix_decode
from mlxq.kv.quantized import BatchQuantizedKVCache, triple_nbytes
from mlxq.kv.shared_prefix_attention import KV, Quant, RowGroups


class SharedPrefixBatchCache(_BaseCache):
    def __init__(self, prefix_keys: KV, prefix_values: KV, tail: BatchKVCache, shares: list[bool] | None = None):
        rows = tail.left_padding.shape[0]
        shares = [True] * rows if shares is None else list(shares)
        self._setup([(prefix_keys, prefix_values)], tail, [0 if s else -1 for s in shares])

    @classmethod
    def grouped(cls, prefixes: list[tuple[KV, KV]], tail: BatchKVCache, row_groups: list[int]):
        """Several groups in one batch: ``prefixes[g]`` is group g's (keys, values), ``row_groups[b]``
        row b's group (-1: outside every group)."""
        cache = cls.__new__(cls)
        cache._setup(list(prefixes), tail, list(row_groups))
        return cache

    def _setup(self, prefixes: list[tuple[KV, KV]], tail: BatchKVCache, row_groups: list[int]) -> None:
        self.quant = Quant(tail.group_size, tail.bits) if isinstance(tail, BatchQuantizedKVCache) else None
        if not prefixes:
            raise ValueError("a shared-prefix cache holds at least one prefix")
        for keys, _ in prefixes:
            shape = keys[0].shape if self.quant else keys.shape
            if isinstance(keys, (tuple, list)) != (self.quant is not None):
                raise ValueError("a quantized tail needs a quantized (triple) prefix, and a plain one a plain prefix")
            if len(shape) != 4 or shape[0] != 1 or shape[2] == 0:
                raise ValueError(f"prefix keys must be [1, kv_heads, P>0, dim], got {shape}")
        self.prefixes = prefixes
        self.tail = tail
        rows = tail.left_padding.shape[0]
        if len(row_groups) != rows or any(not -1 <= g < len(prefixes) for g in row_groups):
            raise ValueError(f"row_groups must name a group or -1 for each of the tail's {rows} rows")
        self._set_groups(row_groups)
        self._fetched = None  # the tail arrays update_and_fetch last returned (see attend)

    @classmethod
    def from_tails(cls, prefix_keys: KV, prefix_values: KV, tails: list, shares: list[bool] | None = None):
        """The group of rows whose own tokens after the prefix are ``tails`` (solo KVCache or
        QuantizedKVCache, possibly empty; a row outside the group: its whole history)."""
        batch_class = BatchQuantizedKVCache if type(tails[0]) is QuantizedKVCache else BatchKVCache
        return cls(prefix_keys, prefix_values, batch_class.merge(tails), shares)

    @classmethod
    def grouped_from_tails(cls, prefixes: list[tuple[KV, KV]], tails: list, row_groups: list[int]):
        """``from_tails`` for several groups (``grouped``'s ``prefixes`` and ``row_groups``)."""
        batch_class = BatchQuantizedKVCache if type(tails[0]) is QuantizedKVCache else BatchKVCache
        return cls.grouped(prefixes, batch_class.merge(tails), row_groups)

    def _set_groups(self, row_groups: list[int]) -> None:
        """Per row its group (host side: no sync), dropping prefixes no row reads any more."""
        used = sorted({g for g in row_groups if g >= 0})
        if used and len(used) < len(self.prefixes):
            self.prefixes = [self.prefixes[g] for g in used]
            renumber = {g: i for i, g in enumerate(used)}
            row_groups = [renumber.get(g, -1) for g in row_groups]
        self.row_groups = [int(g) for g in row_groups]
        self.prefix_lengths = [_length(keys) for keys, _ in self.prefixes]
        self.shares = mx.array(self.row_shares)
        self._own_prefix = mx.array([self.prefix_lengths[g] if g >= 0 else 0 for g in self.row_groups])
        self._layout = RowGroups.of(self.row_groups, len(self.prefixes)) if len(self.prefixes) > 1 else None
        self._all_share = all(g >= 0 for g in self.row_groups)
        self._route = shared_prefix_decode.RouteMemo()  # its prefix may have changed: the route is worked out again

    @property
    def row_shares(self) -> list[bool]:
        """Per row: it sees a prefix (is in a group)."""
        return [g >= 0 for g in self.row_groups]

    @property
    def prefix_keys(self) -> KV:
        return self.prefixes[0][0]  # the first group's (the only one unless built ``grouped``)

    @property
    def prefix_values(self) -> KV:
        return self.prefixes[0][1]

    @property
    def prefix_length(self) -> int:
        return self.prefix_lengths[0]

    @property
    def offset(self) -> mx.array:
        return self.tail.offset + self._own_prefix

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
        """Attention of the rows' queries over [their group's prefix ; own tail]; ``keys``/``values``
        are the fetched tail."""
        if not self.fetched(keys):
            raise ValueError("shared-prefix attention needs the keys update_and_fetch returned, unchanged")
        if self._layout is not None:
            return shared_prefix_decode.grouped_attention(queries, self.prefixes, keys, values,
                                                          self.tail.left_padding, scale, sinks, self.quant,
                                                          self._layout)
        return shared_prefix_decode.attention(queries, self.prefix_keys, self.prefix_values, keys, values,
                                              self.tail.left_padding, scale, sinks, self.quant,
                                              None if self._all_share else self.shares, self._route)

    def prepare(self, **kwargs):
        self.tail.prepare(**kwargs)

    def finalize(self):
        self.tail.finalize()

    def filter(self, batch_indices) -> None:
        self.tail.filter(batch_indices)
        indices = batch_indices.tolist() if isinstance(batch_indices, mx.array) else list(batch_indices)
        self._set_groups([self.row_groups[i] for i in indices])

    def extend(self, other: SharedPrefixBatchCache) -> None:
        """Append ``other``'s rows; a prefix both hold (the same arrays) stays one group, another
        prefix becomes one more group."""
        renumber = {}
        prefixes = list(self.prefixes)
        for g, (keys, values) in enumerate(other.prefixes):
            same = [i for i, (k, v) in enumerate(prefixes) if k is keys and v is values]
            renumber[g] = same[0] if same else len(prefixes)
            if not same:
                prefixes.append((keys, values))
        self.tail.extend(other.tail)
        self.prefixes = prefixes
        self._set_groups(self.row_groups + [renumber[g] if g >= 0 else -1 for g in other.row_groups])

    def extract(self, idx: int) -> KVCache | QuantizedKVCache:
        """Row ``idx`` as a solo cache over its group's prefix + its own tail (a copy it owns)."""
        group = self.row_groups[idx]
        if group < 0:
            return self.tail.extract(idx)  # outside the groups: its tail is its whole history
        cache = QuantizedKVCache(self.quant.group_size, self.quant.bits) if self.quant else KVCache()
        keys, values = self.prefixes[group]
        if self.tail.keys is not None:
            own = self.tail.extract(idx)
            keys, values = _join(keys, own.keys), _join(values, own.values)
        cache.keys, cache.values = _contiguous(keys), _contiguous(values)
        cache.offset = (cache.keys[0] if self.quant else cache.keys).shape[2]
        return cache

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        return self.tail.trim(n)  # a shared prefix is never trimmed from under its group

    def size(self) -> int:
        return max(self.prefix_lengths) + self.tail.size()

    def empty(self) -> bool:
        return False

    @property
    def nbytes(self) -> int:
        """The rows' own bytes: the prefixes belong to whoever lent them (counted once there)."""
        return self.tail.nbytes

    @property
    def prefix_nbytes(self) -> int:
        if self.quant:
            return sum(triple_nbytes(k) + triple_nbytes(v) for k, v in self.prefixes)
        return sum(k.nbytes + v.nbytes for k, v in self.prefixes)

    @property
    def state(self):
        raise TypeError("a shared-prefix cache is not saved whole: extract its rows first")

    @state.setter
    def state(self, v):
        raise TypeError("a shared-prefix cache is built from a prefix and tails, not restored")


def _length(keys: KV) -> int:
    return (keys[0] if isinstance(keys, (tuple, list)) else keys).shape[2]


def _join(prefix: KV, own: KV) -> KV:
    if isinstance(prefix, (tuple, list)):
        return tuple(mx.concatenate([p, o], axis=2) for p, o in zip(prefix, own, strict=True))
    return mx.concatenate([prefix, own], axis=2)


def _contiguous(x: KV) -> KV:
    return tuple(mx.contiguous(a) for a in x) if isinstance(x, (tuple, list)) else mx.contiguous(x)
