"""Which layers of a model can read a shared prefix once per group, and the group's caches.

``plan_sharing(model)`` decides once per model, as plain data: a layer
shares when its cache is a full-attention ``KVCache`` *and* a probe
forward shows its attention arrives at the routing seam with the keys the
cache handed out. Its rows may hold it as ``KVCache`` or, under
``--kv-quant``, ``QuantizedKVCache``: the group then shares quantized
triples, on the CPU only. On the H200 the quantized shared path differed
from mlx-lm's quantized attention over copies by up to 0.29 in bf16 (0.02
on the CPU, 1.5e-7 in float32), unexplained, so GPU backends keep
quantized layers per row. Everything else keeps per-row caches, as the
batch lane has them today:

- sliding-window layers (rings: each row's window is its own),
- recurrent layers (per-row state),
- and the whole model when any full-attention layer computes attention by
  hand (it would see the tail alone): ``declined`` names why.

``share_prefix(plan, rows, prefix_length)`` then builds one batched cache
list for rows that begin with the same ``prefix_length`` tokens.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache, QuantizedKVCache, make_prompt_cache

from mlxq.kv import attention_route, shared_prefix_decode
from mlxq.kv.batch_ops import merge_solo_rows
from mlxq.kv.packed_tails_probe import probe_disagreement
from mlxq.kv.shared_prefix_cache import SharedPrefixBatchCache

log = logging.getLogger("mlxq.kv")


@dataclass(frozen=True)
class SharingPlan:
    shared: tuple[bool, ...]  # per layer: the prefix is read once for the whole group
    declined: str | None  # why no layer shares (None when at least one does)
    quantized: bool = False  # QuantizedKVCache layers share too (measured equal on the CPU only)
    # Why a tails' forward on a shared prefix does not run packed (kv/packed_tails.py; None: it does).
    packed_tails_declined: str | None = "not probed"

    @property
    def can_share(self) -> bool:
        return self.declined is None


class _Probe(SharedPrefixBatchCache):
    """Records whether the model's attention for this layer came through the seam unchanged."""

    def __init__(self):
        super().__init__(mx.zeros((1, 1, 1, 1)), mx.zeros((1, 1, 1, 1)), BatchKVCache([0]))
        self.routed = False
        self.layout: shared_prefix_decode.Layout | None = None

    def attend(self, queries, keys, values, scale, sinks=None):
        self.routed = self.routed or self.fetched(keys)
        self.layout = shared_prefix_decode.Layout(queries.dtype, queries.shape[1], keys.shape[1], queries.shape[-1],
                                                  sinks is not None)
        return mx.zeros((*queries.shape[:-1], values.shape[-1]), queries.dtype)


def plan_sharing(model) -> SharingPlan:
    """Probe ``model`` once (one traced token, nothing evaluated) and decide per layer; where some
    layer shares, check the shared-prefix kernels (CUDA) on the layout the probe saw, and where every
    layer does, whether its tails' forward may run packed (kv/packed_tails_probe.py: three small
    forwards, evaluated)."""
    caches = make_prompt_cache(model)
    candidates = [type(c) is KVCache for c in caches]
    if not any(candidates):
        return SharingPlan(tuple(candidates), "no full-attention KVCache layer")
    probes = [_Probe() if share else cache for share, cache in zip(candidates, caches, strict=True)]
    attention_route.install(check=False)
    model(mx.array([[0]]), cache=probes)
    bypassed = [i for i, p in enumerate(probes) if isinstance(p, _Probe) and not p.routed]
    if bypassed:
        return SharingPlan((False,) * len(caches),
                           f"layers {bypassed} compute attention outside mlx-lm's scaled_dot_product_attention")
    layouts = {p.layout for p in probes if isinstance(p, _Probe)}
    shared_prefix_decode.enable(layouts.pop() if len(layouts) == 1 else None)  # layers alike, else every variant
    packed = probe_disagreement(model) if all(candidates) else "not every layer shares"
    if packed is not None:
        log.info("the tails' forward on a shared prefix stays padded: %s", packed)
    return SharingPlan(tuple(candidates), None, quantized=mx.default_device() == mx.cpu, packed_tails_declined=packed)


def _layer_shares(plan: SharingPlan, layer: int, column: list) -> bool:
    kinds = {type(c) for c in column}
    return plan.can_share and plan.shared[layer] and (kinds == {KVCache}
                                                      or (plan.quantized and kinds == {QuantizedKVCache}))


@dataclass(frozen=True)
class PrefixSpec:
    """One group's prefix: its length, and per layer its (keys, values) when given (e.g. a node
    chain's spans; None: the group's first row's own view)."""

    length: int
    prefix: list[tuple | None] | None = None


def share_prefix(plan: SharingPlan, rows: list[list], prefix_length: int,
                 prefix: list[tuple[mx.array, mx.array] | None] | None = None,
                 shares: list[bool] | None = None) -> list:
    """Per layer, one batched cache for ``rows`` (solo cache lists; those with ``shares`` True, all
    by default, begin with the same ``prefix_length`` tokens): shared layers reference the prefix
    once (``prefix[layer]`` as ([1, Hkv, P, D] keys, values), e.g. from a prompt-cache node
    chain's spans, else the first sharing row's own view) plus each row's tail (a row outside the
    group: its whole history); the other layers merge per-row caches as the batch lane does."""
    shares = [True] * len(rows) if shares is None else list(shares)
    if len(shares) != len(rows):
        raise ValueError("shares names one flag per row")
    return share_groups(plan, rows, [PrefixSpec(prefix_length, prefix)], [0 if s else -1 for s in shares])


def share_groups(plan: SharingPlan, rows: list[list], specs: list[PrefixSpec], row_groups: list[int],
                 own_tails: list[list | None] | None = None) -> list:
    """``share_prefix`` for several groups: row b begins with group ``row_groups[b]``'s prefix
    (``specs[g]``; -1: it is in no group and keeps its whole history as its tail). ``own_tails[b]``,
    where given, holds per layer row b's tail past its prefix as a solo cache (or None: cut from its
    cache), e.g. ``tail_from_spans`` of its lease."""
    if any(spec.length <= 0 for spec in specs):
        raise ValueError("a shared prefix has at least one token")
    if len(row_groups) != len(rows) or any(not -1 <= g < len(specs) for g in row_groups):
        raise ValueError("row_groups names a group or -1 for each row")
    out = []
    for layer in range(len(rows[0])):
        column = [row[layer] for row in rows]
        if not _layer_shares(plan, layer, column):
            out.append(merge_solo_rows([[c] for c in column])[0])
            continue
        prefixes = [_group_prefix(layer, column, spec, [b for b, x in enumerate(row_groups) if x == g])
                    for g, spec in enumerate(specs)]
        given = [None if own_tails is None or own_tails[b] is None else own_tails[b][layer] for b in range(len(rows))]
        tails = [_tail(c, specs[g].length if g >= 0 else 0) if tail is None else tail
                 for c, g, tail in zip(column, row_groups, given, strict=True)]
        out.append(SharedPrefixBatchCache.grouped_from_tails(prefixes, tails, row_groups))
    return out


def _group_prefix(layer: int, column: list, spec: PrefixSpec, members: list[int]) -> tuple:
    if any(column[b].offset < spec.length for b in members):
        raise ValueError(f"layer {layer}: a sharing row holds fewer than {spec.length} tokens")
    given = spec.prefix[layer] if spec.prefix is not None else None
    if given is not None:
        return given
    if not members:
        raise ValueError(f"layer {layer}: shares but no prefix was given for a group without rows")
    donor = column[members[0]]
    return _head(donor.keys, spec.length), _head(donor.values, spec.length)


def prefix_from_spans(spans_per_layer: list[list[tuple] | None]) -> list[tuple | None]:
    """Per layer, a group's prefix (keys, values) from the spans of a prompt-cache node chain
    (``Node.spans[layer]`` root to leaf, each (keys, values) of [1, H, tokens, ...], arrays or
    quantized triples): one concatenation per group and layer, never one per row. ``None`` for
    layers without spans (rings, recurrent state)."""
    out = []
    for spans in spans_per_layer:
        if not spans:
            out.append(None)
            continue
        keys, values = (_cat([span[i] for span in spans]) for i in (0, 1))
        out.append((keys, values))
    return out


def tail_from_spans(spans: list[tuple], skip: int) -> KVCache:
    """A row's own tokens after the first ``skip`` of a node chain's spans (one layer's, root first,
    plain arrays), as a solo cache: only the spans past ``skip`` are concatenated. Cutting them from
    the lease's assembled cache instead would evaluate the concatenation of the whole chain (MLX
    slices a computed array): a copy of the prefix per row, the copy sharing exists to avoid."""
    parts, start = [], 0
    for keys, values in spans:
        end = start + keys.shape[2]
        if end > skip:
            cut = max(skip - start, 0)
            parts.append((keys[:, :, cut:], values[:, :, cut:]))
        start = end
    tail = KVCache()
    if parts:
        tail.keys, tail.values = (_cat([part[i] for part in parts]) for i in (0, 1))
        tail.offset = tail.keys.shape[2]
    return tail


def _cat(parts: list):
    if isinstance(parts[0], (tuple, list)):
        return tuple(mx.concatenate([p[i] for p in parts], axis=2) for i in range(len(parts[0])))
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=2)


def _head(x, n: int):
    """Row 0's first ``n`` tokens: a view (a compact copy for quantized triples, which CUDA's
    quantized_matmul cannot read strided)."""
    if isinstance(x, (tuple, list)):
        return tuple(mx.contiguous(a[:, :, :n]) for a in x)
    return x[:, :, :n]


def _tail(cache, prefix_length: int):
    """A row's own tokens after the prefix, as a solo cache of its class (views of its arrays)."""
    quantized = type(cache) is QuantizedKVCache
    tail = QuantizedKVCache(cache.group_size, cache.bits) if quantized else KVCache()
    if cache.offset > prefix_length:
        cut = slice(prefix_length, cache.offset)
        tail.keys, tail.values = ((tuple(a[:, :, cut] for a in x) if quantized else x[:, :, cut])
                                  for x in (cache.keys, cache.values))
        tail.offset = cache.offset - prefix_length
    return tail
