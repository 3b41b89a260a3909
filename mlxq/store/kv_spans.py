"""Per-layer KV pieces the prefix tree stores, and how a row's caches are rebuilt from them.

A full-attention layer (``KVCache``, ``QuantizedKVCache``) is stored as
*spans*: the keys and values of one run of tokens, cut along the token axis
(axis -2; a quantized layer cuts all three arrays of each triple the same
way, since every token is quantized on its own). A row's cache for ``n``
tokens is the concatenation of the spans on its path, so a prefix shared by
many agents is held once.

A sliding-window ring or a recurrent state cannot be cut into spans: it is
stored as a *snapshot*, the layer's whole state after a known token count,
copied in and lent out as it always was.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache, RotatingKVCache

from mlxq.kv.capabilities import is_spans
from mlxq.kv.quantized import QuantizedRotatingKVCache


@dataclass(frozen=True)
class LayerLayout:
    """How one layer is stored: as spans (full attention) or as snapshots; and how to rebuild it."""

    spans: bool
    cls: type
    group_size: int = 0  # quantized full attention only
    bits: int = 0


def layout_of(caches: list) -> tuple[LayerLayout, ...]:
    out = []
    for c in caches:
        quantized = type(c) is QuantizedKVCache
        out.append(LayerLayout(is_spans(c), type(c),
                               c.group_size if quantized else 0, c.bits if quantized else 0))
    return tuple(out)


Span = tuple  # (keys, values), each an array or a quantized triple, [B, H, tokens, ...]


def cut_span(cache, start: int, end: int) -> Span:
    """A compact copy of tokens [start, end) of a full-attention layer."""
    return tree_map(lambda a: mx.contiguous(a[..., start:end, :]), (cache.keys, cache.values))


def split_span(span: Span, at: int) -> tuple[Span, Span]:
    """Two compact spans: the first ``at`` tokens and the rest (so evicting either frees its bytes).
    Unevaluated: the caller evaluates every layer's halves at once, and lets go of the whole then."""
    head = tree_map(lambda a: mx.contiguous(a[..., :at, :]), span)
    tail = tree_map(lambda a: mx.contiguous(a[..., at:, :]), span)
    return head, tail


def nbytes(tree) -> int:
    return sum(a.nbytes for _, a in tree_flatten(tree))


def arrays(tree) -> list:
    return [a for _, a in tree_flatten(tree)]


def assemble_layer(layout: LayerLayout, spans: list[Span], n: int, skip: int = 0):
    """A cache the row owns, holding ``n`` tokens of the concatenated ``spans`` after the first ``skip``."""
    def join(*parts):
        whole = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-2)
        return whole[..., skip : skip + n, :]

    keys, values = tree_map(join, *spans)
    out = QuantizedKVCache(layout.group_size, layout.bits) if layout.cls is QuantizedKVCache else KVCache()
    out.keys, out.values, out.offset = keys, values, n
    return out


def _rebuild(cache, *, copy: bool):
    """A new ring or recurrent-state object over ``cache``'s state: views (lending) or compact copies.

    mlx-lm caches write in place through their own handles; MLX arrays have value semantics,
    so a write through a new handle never changes what another handle sees.
    """
    own = mx.contiguous if copy else (lambda a: a[...])

    def whole(x):
        return None if x is None else tree_map(own, x)

    kind = type(cache)
    if kind in (RotatingKVCache, QuantizedRotatingKVCache):
        if kind is QuantizedRotatingKVCache:
            out = QuantizedRotatingKVCache(cache.max_size, cache.keep, cache.group_size, cache.bits)
        else:
            out = RotatingKVCache(cache.max_size, cache.keep)
        out.keys, out.values = whole(cache.keys), whole(cache.values)
        out.offset, out._idx = cache.offset, cache._idx
        return out
    out = ArraysCache(len(cache.cache))
    out.cache = [whole(a) for a in cache.cache]
    return out


def take_snapshot(cache):
    """The stored copy of a ring or recurrent layer (its row keeps writing the original)."""
    return _rebuild(cache, copy=True)


def lend_snapshot(cache):
    """A borrower's copy-on-write view of a stored snapshot."""
    return _rebuild(cache, copy=False)


def snapshot_arrays(cache) -> list:
    if isinstance(cache, ArraysCache):
        return [a for a in cache.cache if a is not None]
    return arrays((cache.keys, cache.values))


def snapshot_nbytes(snapshot: list) -> int:
    return sum(a.nbytes for s in snapshot if s is not None for a in snapshot_arrays(s))


def lend(cache, n: int):
    """A borrower's view of any cacheable layer's first ``n`` tokens (full attention) or whole state."""
    if is_spans(cache):
        return assemble_layer(layout_of([cache])[0], [(cache.keys, cache.values)], n)
    return lend_snapshot(cache)
