"""Attention for rows that share one prefix: the prefix read once per group, merged by log-sum-exp.

A group of B rows attends over [shared prefix (P keys)] + [its own tail]. The
prefix part does not depend on the row, so all rows' queries are stacked as
one matrix per KV head ([B * group * L, D] against the prefix's [P, D]: one
GEMM that reads the prefix once instead of B times). Each row's tail (its
own tokens, left-padded like mlx-lm's BatchKVCache) is attended separately
with its mask. Each part is a *partial*: its unnormalized softmax-weighted
values plus its running max and sum of exponentials, in float32; partials
combine exactly (the online-softmax identity, as in FlashInfer's merge_state
and vLLM's cascade attention). Attention sinks (gpt_oss) are one more
partial with a logit per head and no values.

The merge is float32 throughout and every partial keeps its own max: a level
with no visible keys (a fully masked padding query) has max -inf and weighs
exactly zero, never 0 * inf. vLLM's cascade path made itself opt-in after
accuracy reports that came from reading LSE tensors with the wrong strides
and from mixed-precision merges; here every partial is a fresh contiguous
float32 array.

Quantized K/V (``--kv-quant``: each of keys and values a triple of packed
data, scales and biases, as mlx-lm's QuantizedKVCache holds them) take the
same path with ``mx.quantized_matmul`` in place of both products (``quant``
names the group size and bits), as mlx-lm's quantized attention does.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

_NEG_INF = -float("inf")
# The most float32 scores one product materializes: a prefill chunk of 64 rows x 56 queries x 32 heads
# on a 14.5k prefix would be 6.6 GB per layer at once, so longer ones go in blocks of query rows
# (each row's softmax is its own: a block changes only the summation order a BLAS picks for a product
# of fewer rows, ~1e-6 in float32 under MKL). 2**26 scores are 256 MB.
SCORE_BLOCK = 1 << 26

KV = mx.array | tuple[mx.array, mx.array, mx.array]  # plain, or a quantized triple


@dataclass(frozen=True)
class Quant:
    group_size: int
    bits: int


def _map(x: KV, fn) -> KV:
    return tuple(fn(a) for a in x) if isinstance(x, (tuple, list)) else fn(x)


def _shape(x: KV) -> tuple[int, ...]:
    return x[0].shape if isinstance(x, (tuple, list)) else x.shape


def _times_keys(q: mx.array, keys: KV, quant: Quant | None) -> mx.array:
    if quant is None:
        return q @ keys.swapaxes(-1, -2)
    return mx.quantized_matmul(q, *keys, transpose=True, group_size=quant.group_size, bits=quant.bits)


def _times_values(weights: mx.array, values: KV, quant: Quant | None, dtype) -> mx.array:
    if quant is None:
        return (weights.astype(values.dtype) @ values).astype(mx.float32)
    return mx.quantized_matmul(weights.astype(dtype), *values, transpose=False, group_size=quant.group_size,
                               bits=quant.bits).astype(mx.float32)


@dataclass(frozen=True)
class Partial:
    """One level's attention before normalization (all float32)."""

    weighted: mx.array  # [B, Hq, L, Dv]: sum_j exp(s_j - peak) v_j
    peak: mx.array  # [B, Hq, L, 1]: max_j s_j (-inf when no key is visible)
    total: mx.array  # [B, Hq, L, 1]: sum_j exp(s_j - peak)


def _stats(scores: mx.array, guard: bool = True) -> tuple[mx.array, mx.array, mx.array]:
    """exp(scores - peak), peak and total over the last axis, in float32; -inf scores weigh 0.

    ``guard=False`` when every row has a visible key (a prefix): its peak is finite."""
    scores = scores.astype(mx.float32)
    peak = scores.max(axis=-1, keepdims=True)
    safe = mx.where(peak == _NEG_INF, mx.array(0.0, mx.float32), peak) if guard else peak
    weights = mx.exp(scores - safe)
    return weights, peak, weights.sum(axis=-1, keepdims=True)


def stacked_prefix_stats(queries: mx.array, keys: KV, values: KV, scale: float,
                         quant: Quant | None = None) -> tuple[mx.array, mx.array, mx.array]:
    """Every row's queries against one shared prefix, as one matrix per KV head.

    queries [B, Hq, L, D]; keys [1, Hkv, P, D]; values [1, Hkv, P, Dv] (Hq a multiple of Hkv).
    Returns (weighted, peak, total) in the stacked layout [Hkv, B * group * L, Dv or 1], row
    b's head h = kv * group + i at position L at index (kv, (b * group + i) * L + position).
    """
    batch, heads, length, dim = queries.shape
    kv_heads, prefix = _shape(keys)[1], _shape(keys)[2]
    q = (queries * mx.array(scale, queries.dtype)).reshape(batch, kv_heads, heads // kv_heads * length, dim)
    stacked = q.swapaxes(0, 1).reshape(kv_heads, -1, dim)  # [Hkv, B*G*L, D]
    keys, values = _map(keys, lambda a: a[0]), _map(values, lambda a: a[0])
    rows = stacked.shape[1]
    step = max(1, SCORE_BLOCK // max(1, kv_heads * prefix))  # an empty prefix: one block
    if rows <= step:
        return _prefix_block(stacked, keys, values, quant, queries.dtype)
    blocks = [_prefix_block(stacked[:, start:start + step], keys, values, quant, queries.dtype)
              for start in range(0, rows, step)]
    return tuple(mx.concatenate([b[i] for b in blocks], axis=1) for i in range(3))


def _prefix_block(stacked: mx.array, keys: KV, values: KV, quant: Quant | None, dtype):
    scores = _times_keys(stacked, keys, quant)  # [Hkv, rows, P]
    weights, peak, total = _stats(scores, guard=False)
    return _times_values(weights, values, quant, dtype), peak, total


def prefix_partial(queries: mx.array, keys: KV, values: KV, scale: float, quant: Quant | None = None) -> Partial:
    """``stacked_prefix_stats`` in the rows' own layout [B, Hq, L, n]."""
    return unstacked(queries, _shape(keys)[1], stacked_prefix_stats(queries, keys, values, scale, quant))


def unstacked(queries: mx.array, kv_heads: int, stats: tuple[mx.array, mx.array, mx.array]) -> Partial:
    """A level in the stacked layout [Hkv, B*G*L, n] as a Partial in the rows' layout [B, Hq, L, n]."""
    batch, heads, length, _ = queries.shape
    return Partial(*(_unstack(x, kv_heads, batch, heads, length) for x in stats))


def _unstack(x: mx.array, kv_heads: int, batch: int, heads: int, length: int) -> mx.array:
    """[Hkv, B*G*L, n] -> [B, Hq, L, n]"""
    return x.reshape(kv_heads, batch, -1, x.shape[-1]).swapaxes(0, 1).reshape(batch, heads, length, -1)


def tail_partial(queries: mx.array, keys: KV, values: KV, scale: float, mask: mx.array | None,
                 quant: Quant | None = None) -> Partial:
    """Each row's queries against its own keys. keys [B, Hkv, T, D]; mask [B or 1, 1, L, T] bool or None.
    At most SCORE_BLOCK scores at once: more rows go in blocks of rows."""
    batch, heads, length, _ = queries.shape
    step = max(1, SCORE_BLOCK // max(1, heads * length * _shape(keys)[2]))  # no keys: one block
    if batch <= step:
        return _tail_block(queries, keys, values, scale, mask, quant)

    def rows(x, start):  # a mask of one row serves all
        return x if x is None or x.shape[0] == 1 else x[start:start + step]

    blocks = [_tail_block(rows(queries, start), _map(keys, lambda a, s=start: rows(a, s)),
                          _map(values, lambda a, s=start: rows(a, s)), scale, rows(mask, start), quant)
              for start in range(0, batch, step)]
    return Partial(*(mx.concatenate([getattr(b, f) for b in blocks]) for f in ("weighted", "peak", "total")))


def _tail_block(queries: mx.array, keys: KV, values: KV, scale: float, mask: mx.array | None,
                quant: Quant | None) -> Partial:
    batch, heads, length, dim = queries.shape
    kv_heads = _shape(keys)[1]
    group = heads // kv_heads
    q = (queries * mx.array(scale, queries.dtype)).reshape(batch, kv_heads, group, length, dim)
    scores = _times_keys(q, _map(keys, lambda a: a[:, :, None]), quant)  # [B, Hkv, G, L, T]
    if mask is not None:
        scores = mx.where(mask[:, :, None], scores, mx.array(_NEG_INF, scores.dtype))
    weights, peak, total = _stats(scores)
    weighted = _times_values(weights, _map(values, lambda a: a[:, :, None]), quant, queries.dtype)
    shape = (batch, heads, length, -1)
    return Partial(weighted.reshape(shape), peak.reshape(shape), total.reshape(shape))


def merge(partials: list[Partial], sinks: mx.array | None = None, dtype=mx.float32) -> mx.array:
    """softmax over the union of the partials' keys (and one sink logit per head), times values."""
    peak = partials[0].peak
    for p in partials[1:]:
        peak = mx.maximum(peak, p.peak)
    if sinks is not None:
        sink = sinks.astype(mx.float32).reshape(1, -1, 1, 1)
        peak = mx.maximum(peak, sink)
    weighted = total = None
    for p in partials:
        factor = mx.exp(p.peak - peak)  # 0 for a level whose peak is -inf
        weighted = p.weighted * factor if weighted is None else weighted + p.weighted * factor
        total = p.total * factor if total is None else total + p.total * factor
    if sinks is not None:
        total = total + mx.exp(sink - peak)
    return (weighted / total).astype(dtype)


@dataclass(frozen=True)
class RowGroups:
    """Which rows read which prefix, as index arrays (built once per batch change, host side)."""

    members: tuple[mx.array, ...]  # per group: its rows' indices
    strays: int  # rows in no group
    inverse: mx.array  # rows in group order (members..., strays) -> back to batch order
    in_group: mx.array  # [B] bool: the row reads a prefix

    @classmethod
    def of(cls, row_groups: list[int], groups: int) -> RowGroups:
        members = [[b for b, g in enumerate(row_groups) if g == group] for group in range(groups)]
        strays = [b for b, g in enumerate(row_groups) if g < 0]
        order = [b for rows in members for b in rows] + strays
        inverse = [0] * len(order)
        for position, b in enumerate(order):
            inverse[b] = position
        return cls(tuple(mx.array(rows) for rows in members), len(strays), mx.array(inverse),
                   mx.array([g >= 0 for g in row_groups]))


def grouped_prefix_stats(queries: mx.array, prefixes: list[tuple[KV, KV]], layout: RowGroups, scale: float,
                         quant: Quant | None = None) -> tuple[mx.array, mx.array, mx.array]:
    """``stacked_prefix_stats`` for several groups, in the same stacked layout [Hkv, B * group * L, n]:
    each group's rows against their own prefix (each prefix read once, for its rows only), rows in
    no group an empty level (weighted 0, peak -inf, total 0: it weighs 0 in the merge)."""
    batch, heads, length, _ = queries.shape
    kv_heads = _shape(prefixes[0][0])[1]
    per_row = heads // kv_heads * length
    parts = [stacked_prefix_stats(queries[rows], keys, values, scale, quant)
             for (keys, values), rows in zip(prefixes, layout.members, strict=True) if rows.size]
    if layout.strays:
        packed = _shape(prefixes[0][1])[-1]
        dim = packed * 32 // quant.bits if quant else packed  # quantized values pack 32 // bits per word
        empty = (kv_heads, layout.strays * per_row)
        parts.append((mx.zeros((*empty, dim), mx.float32), mx.full((*empty, 1), _NEG_INF, mx.float32),
                      mx.zeros((*empty, 1), mx.float32)))

    def in_row_order(x):  # group order -> batch order, along the stacked axis
        x = x.reshape(kv_heads, batch, per_row, x.shape[-1])[:, layout.inverse]
        return x.reshape(kv_heads, batch * per_row, -1)

    return tuple(in_row_order(mx.concatenate([p[i] for p in parts], axis=1)) for i in range(3))


def grouped_prefix_partial(queries: mx.array, prefixes: list[tuple[KV, KV]], layout: RowGroups, scale: float,
                           quant: Quant | None = None) -> Partial:
    """``grouped_prefix_stats`` in the rows' own layout [B, Hq, L, n]."""
    return unstacked(queries, _shape(prefixes[0][0])[1], grouped_prefix_stats(queries, prefixes, layout, scale, quant))


def tail_mask(starts: mx.array, length: int, span: int) -> mx.array:
    """[B, 1, L, T] bool: the last ``length`` of ``span`` tail positions see the keys from their row's start on."""
    columns = mx.arange(span)
    rows = mx.arange(span - length, span)[:, None]
    visible = (rows >= columns[None, :])[None, None]
    return visible & (columns[None, None, None, :] >= starts[:, None, None, None])


def shared_prefix_attention(queries: mx.array, prefix_keys: KV, prefix_values: KV, tail_keys: KV, tail_values: KV,
                            tail_starts: mx.array, scale: float, sinks: mx.array | None = None,
                            quant: Quant | None = None, shares: mx.array | None = None) -> mx.array:
    """softmax(q [prefix ; tail_b]^T * scale) [prefix ; tail_b] for every row b of a group.

    queries [B, Hq, L, D] are the last L positions of each row's tail; prefix_* [1, Hkv, P, D*];
    tail_* [B, Hkv, T, D*], row b's own keys being tail[b, :, tail_starts[b]:] (left padding before).
    With ``quant`` every K/V is a quantized triple. ``shares`` [B] bool: rows set False do not see
    the prefix (rows of the batch outside the group: their tail is their whole history).
    """
    prefix = prefix_partial(queries, prefix_keys, prefix_values, scale, quant)
    return with_tails(queries, prefix, tail_keys, tail_values, tail_starts, scale, sinks, quant, shares)


def with_tails(queries: mx.array, prefix: Partial, tail_keys: KV, tail_values: KV, tail_starts: mx.array,
               scale: float, sinks: mx.array | None = None, quant: Quant | None = None,
               shares: mx.array | None = None) -> mx.array:
    """``shared_prefix_attention`` from the prefix's partial (however it was computed): each row's
    tail, then the merge."""
    length, span = queries.shape[2], _shape(tail_keys)[2]
    if shares is not None:  # a level with peak -inf weighs exactly 0 in the merge
        prefix = Partial(prefix.weighted, mx.where(shares[:, None, None, None], prefix.peak, _NEG_INF), prefix.total)
    parts = [prefix, tail_partial(queries, tail_keys, tail_values, scale, tail_mask(tail_starts, length, span), quant)]
    return merge(parts, sinks, queries.dtype)


def grouped_shared_prefix_attention(queries: mx.array, prefixes: list[tuple[KV, KV]], tail_keys: KV,
                                    tail_values: KV, tail_starts: mx.array, scale: float, layout: RowGroups,
                                    sinks: mx.array | None = None, quant: Quant | None = None) -> mx.array:
    """``shared_prefix_attention`` for a batch of several groups: row b sees ``prefixes[g]`` for its
    group g (``layout``), or no prefix when it is in none."""
    length, span = queries.shape[2], _shape(tail_keys)[2]
    prefix = grouped_prefix_partial(queries, prefixes, layout, scale, quant)
    parts = [prefix, tail_partial(queries, tail_keys, tail_values, scale, tail_mask(tail_starts, length, span), quant)]
    return merge(parts, sinks, queries.dtype)
