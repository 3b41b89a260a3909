"""Joiners' tails of different lengths in one forward, each written where it stays: no row moved after.

A burst of agents on a cached system prompt advances its tails (40-64 tokens
each) in one forward over the merged prefixes. mlx-lm's way right-pads the
chunks, so after the forward every row is moved right by its padding
(``BatchKVCache.finalize``; here ``wave_caches.finalize_chunks``): a second
copy of the whole batch (~290 MB a row on the 8B shape at 2.2k tokens, and a
fresh buffer as large as every row's KV). Here each row's prefix is merged
where it must end for its tail to end at the batch's last column, the
chunks are left-padded, and the forward writes a row's padding columns with
what the merged cache already holds there (the end of its prefix), so the
K/V the forward leaves are the row's prefix and tail, contiguous and
right-aligned, as after mlx-lm's roll:

    row i: prefix P_i, tail t_i, W = max t, E = max(P + t)
    merged:  left padding E - P_i - t_i, prefix up to column E - t_i
    chunk:   written at [E - W, E); row i's real tokens at [E - t_i, E)
    offset:  E - W - padding_i = P_i - (W - t_i): the real tokens' positions are P_i, P_i + 1, ...

The padding queries compute rows nobody reads (their K/V are never
written, their logits never sampled); every real query attends to its own
prefix and tail only (the batch mask's left padding and causality), so each
row computes what it computes alone. Every row's prefix is written by one
gather per layer from the stored spans it leased (engine/prefix_gather.py).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from mlxq.engine.prefix_gather import RowPrefix, gather_prefixes, own_piece
from mlxq.kv.batch_ops import view_row


@dataclass(frozen=True)
class TailLayout:
    """Where a group's rows go in their merged caches, decided from their lengths alone."""

    padding: list[int]  # each row's left padding in the merged caches
    chunk_padding: list[int]  # each row's left padding in the chunk (the longest tail less its own)
    start: int  # the column the forward's chunk starts at (the merged caches' ``_idx``)
    width: int  # the chunk's width (the longest tail)
    capacity: int  # the merged buffers' length: a whole number of mlx-lm's growth steps


def layout_for(sizes: list[int], tails: list[int], room: int) -> TailLayout:
    """Rows holding ``sizes`` tokens, advancing ``tails`` tokens each, with ``room`` columns after."""
    end = max(s + t for s, t in zip(sizes, tails, strict=True))
    width = max(tails)
    capacity = -(-(end + room) // BatchKVCache.step) * BatchKVCache.step
    return TailLayout([end - s - t for s, t in zip(sizes, tails, strict=True)], [width - t for t in tails],
                      end - width, width, capacity)


def can_place(rows: list[list | None]) -> bool:
    """Every layer of every row a plain full-attention cache, the first row holding tokens: what the
    placement knows how to merge. None: a row read from its lease's plain stored spans (both hold)."""
    first = rows[0] is None or any(c.keys is not None for c in rows[0])
    return first and all(type(c) is KVCache for row in rows if row is not None for c in row)


def merge_for_tails(rows: list[list | None], tails: list[int], room: int, prefixes: list[RowPrefix] | None = None
                    ) -> tuple[list[BatchKVCache], TailLayout]:
    """Per layer one BatchKVCache of ``rows`` (solo cache lists, ``can_place``) laid out for ``tails``
    (``layout_for``), and that layout. ``prefixes``: per row, the pieces its caches hold
    (engine/prefix_gather.py: a lease's stored spans, read without its concatenation; a row given
    as None is read only so); by default each row's own caches."""
    if prefixes is None:
        sizes = [row[0].offset if row[0].keys is not None else 0 for row in rows]
        prefixes = [RowPrefix((own_piece(row),) if size else (), size) for row, size in zip(rows, sizes, strict=True)]
    return place_rows(prefixes, tails, room)


def place_rows(prefixes: list[RowPrefix], tails: list[int], room: int) -> tuple[list[BatchKVCache], TailLayout]:
    """Per layer one BatchKVCache holding each row's ``prefixes`` entry laid out for ``tails``: every
    layer written by one gather of all rows."""
    layout = layout_for([p.length for p in prefixes], tails, room)
    merged = []
    for keys, values in gather_prefixes(prefixes, layout.padding, layout.capacity):
        out = BatchKVCache(layout.padding)
        out.keys, out.values = keys, values
        out.offset += layout.start
        out._idx = layout.start
        merged.append(out)
    return merged, layout


class PlacedRows:
    """A placed batch's rows as solo cache lists, each built when first read: views into the batch as it
    was after the forward (``view_row``; the decode steps after the join write into its arrays)."""

    def __init__(self, caches: list[BatchKVCache], layout: TailLayout):
        self._layers = []
        for cache in caches:
            kept = copy.copy(cache)
            kept.keys, kept.values = cache.keys[..., : cache._idx, :], cache.values[..., : cache._idx, :]
            self._layers.append(kept)
        self._paddings = [layout.padding] * len(caches)  # every layer's rows are placed alike

    def row(self, index: int) -> list:
        return view_row(self._layers, index, self._paddings)


@contextmanager
def tails_in_place(caches: list[BatchKVCache], layout: TailLayout, evaluate=mx.eval) -> Iterator[None]:
    """During one forward of left-padded chunks (``layout.chunk_padding``): each cache's write keeps
    what the padding columns held (the rows' prefixes), so only real tokens' K/V are written.
    ``evaluate(arrays)``: how the merge is evaluated first (the scheduler's, which turns an allocation
    failure into a MemoryFault)."""
    pad = mx.array(layout.chunk_padding)
    keep = (mx.arange(layout.width)[None, :] < pad[:, None])[:, None, :, None]  # [rows, 1, width, 1]
    end = layout.start + layout.width
    # What the chunk's columns hold, copied out (and the merge done) before the forward: read inside it,
    # or kept as views, the buffer its write goes into would have a second reader, and the write would
    # copy that buffer whole instead of writing in place.
    kept = [(mx.contiguous(c.keys[..., layout.start : end, :]), mx.contiguous(c.values[..., layout.start : end, :]))
            for c in caches]
    evaluate([kept, [(c.keys, c.values) for c in caches]])
    for cache, (keys, values) in zip(caches, kept, strict=True):
        cache.update_and_fetch = _keeping(cache, keep, keys, values)  # this instance, this forward only
    try:
        yield
    finally:
        for cache in caches:
            vars(cache).pop("update_and_fetch", None)


def _keeping(cache: BatchKVCache, keep: mx.array, old_keys: mx.array, old_values: mx.array):
    def update_and_fetch(keys: mx.array, values: mx.array):
        return BatchKVCache.update_and_fetch(cache, mx.where(keep, old_keys, keys), mx.where(keep, old_values, values))
    return update_and_fetch


SUBMIT_EVERY = 4  # layers of a placed forward built between submissions to the device


@contextmanager
def submitted_by_layers(caches: list, submit, every: int | None = None) -> Iterator[None]:
    """During one forward on ``caches`` (one per layer, in order): every ``every`` layers the K/V just
    written are handed to ``submit`` (the scheduler's fault-handled ``async_eval``), so the device
    runs the first layers while the host still builds the later ones' graph; without it, a burst's
    tails' forward (~30 operations per layer) reaches the device only once all 32 layers are built.
    The values are the same: only when their evaluation starts changes."""
    every = every or SUBMIT_EVERY
    wrapped = []
    for index, cache in enumerate(caches[:-1]):
        if (index + 1) % every:
            continue
        before = vars(cache).get("update_and_fetch")
        inner = cache.update_and_fetch

        def update_and_fetch(keys: mx.array, values: mx.array, inner=inner):
            out = inner(keys, values)
            submit(list(out))
            return out

        cache.update_and_fetch = update_and_fetch  # this instance, this forward only
        wrapped.append((cache, before))
    try:
        yield
    finally:
        for cache, before in wrapped:
            if before is None:
                vars(cache).pop("update_and_fetch", None)
            else:
                cache.update_and_fetch = before
