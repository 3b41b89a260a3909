"""Row surgery on per-layer caches: join rows into a batch, drop rows, take one out.

mlx-lm's batched caches already implement the operations by layer kind
(BatchKVCache: left-padded full attention; BatchRotatingKVCache: per-row
rings, ring wrap included; ArraysCache: row-stacked recurrent state). These
functions route each layer by the class table (capabilities.py: quantized
triples merge into mlxq's batch classes, the same surgery on all three
arrays) and keep
the invariant the scheduler relies on: after a join every row's next write
lands in the same column (rows are right-aligned), so one advancing offset
serves all rows, with per-row left padding masked and per-row RoPE offsets.
"""

from __future__ import annotations

from mlx_lm.models.cache import BatchKVCache, KVCache

from mlxq.kv.capabilities import CacheKind, batch_class, cache_kind


def merge_solo_rows(rows: list[list]) -> list:
    """Per layer, one batched cache holding ``rows`` (each a solo cache list) in order."""
    num_layers = len(rows[0])
    merged = []
    for layer in range(num_layers):
        column = [row[layer] for row in rows]
        classes = {type(c) for c in column}
        if len(classes) > 1:
            raise TypeError(f"layer {layer}: cannot merge {sorted(c.__name__ for c in classes)}")
        merged.append(batch_class(column[0]).merge(column))
    return merged


def check_extendable(batch: list, joiners: list) -> None:
    """Raise before anything changes when ``joiners`` cannot extend ``batch`` (layer by layer)."""
    for layer, (running, joining) in enumerate(zip(batch, joiners, strict=True)):
        if type(running) is not type(joining):
            raise TypeError(f"layer {layer}: cannot join {type(joining).__name__} to {type(running).__name__}")


def extend_batch(batch: list, joiners: list) -> list:
    """``batch`` extended in place with the rows of another batched cache list (right-aligned)."""
    check_extendable(batch, joiners)
    for running, joining in zip(batch, joiners, strict=True):
        running.extend(joining)
    return batch


def keep_rows(batch: list, keep: list[int]) -> None:
    """Drop every row not in ``keep`` (indices into the current batch), in place."""
    for cache in batch:
        cache_kind(cache)
        cache.filter(keep)


def extract_row(batch: list, index: int) -> list:
    """A solo cache list for one row (a copy): the B=1 step runs on it as the serial lane does."""
    out = []
    for cache in batch:
        kind = cache_kind(cache)
        solo = cache.extract(index)
        if kind is CacheKind.RECURRENT:
            solo.left_padding = None
            solo.lengths = None
        out.append(solo)
    return out


def view_rows(batch: list, rows: int) -> list[list]:
    """Each of the batch's ``rows`` rows as a solo cache list to build other batched caches from at once: plain
    full-attention layers as views into the batch's arrays (no copy: the caches built from them
    copy what they keep, so the batch's KV is never held twice while they are), other layers
    extracted as ``extract_row`` does."""
    out: list[list] = [[] for _ in range(rows)]
    for cache in batch:
        if type(cache) is BatchKVCache and cache.keys is not None:
            for index, (row, padding) in enumerate(zip(out, cache.left_padding.tolist(), strict=True)):
                row.append(_view(cache, index, padding))
            continue
        for index, row in enumerate(out):
            row.append(extract_row([cache], index)[0])
    return out


def view_row(batch: list, index: int, paddings: list | None = None) -> list:
    """One row as a solo cache list to read a part of at once: plain full-attention layers as views into
    the batch's arrays (no copy), other layers extracted as ``extract_row`` does. ``paddings``: each
    layer's left paddings already read (a list, or None for a layer without); else they are read here,
    whole (``tolist``: indexing one runs an operation and waits for it)."""
    out = []
    for layer, cache in enumerate(batch):
        if type(cache) is BatchKVCache and cache.keys is not None:
            padding = (paddings[layer] if paddings is not None else cache.left_padding.tolist())[index]
            out.append(_view(cache, index, padding))
        else:
            out.append(extract_row([cache], index)[0])
    return out


def _view(cache: BatchKVCache, index: int, padding: int) -> KVCache:
    solo = KVCache()
    solo.keys = cache.keys[index : index + 1, :, padding : cache._idx]
    solo.values = cache.values[index : index + 1, :, padding : cache._idx]
    solo.offset = cache._idx - padding
    return solo
