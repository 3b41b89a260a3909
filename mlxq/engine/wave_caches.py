"""Joiners' batched caches for one forward, built once: with room to write into, kept for the join.

A burst of agents on a cached system prompt turns into joiners whose caches
each hold a copy of the prefix (the lease's spans). Advancing their tails
together merges those caches into one batched cache per layer; each copy of
that batch costs a new buffer as large as all the rows' prefixes (~290 MB a
row on the 8B shape at 2.2k tokens), and a new buffer on a GPU is paid again
on first touch. Two copies are avoided here, and a third made cheap:

- ``merge_with_room``: the merged full-attention layers get capacity for
  what the forward will write (and, when the rows join next, for the decode
  steps after it), so the forward's first write does not grow the buffer by
  copying it whole (mlx-lm's ``BatchKVCache.update_and_fetch`` grows by
  concatenation);
- ``PrefilledTogether``: when the forward was every row's last chunk, the
  batched caches are kept and the rows join the running batch with them
  (adopted as they are into an empty batch), instead of each row being
  extracted (a copy) and merged again (another copy). The joiners' own
  caches become views into the kept batch, which the prompt cache reads to
  store their prompt boundary;
- ``finalize_chunks``: tails of different lengths are right-padded, then
  each row is moved right by its padding; mlx-lm does that with a
  ``take_along_axis`` over the whole batch, here one ``take`` of whole
  head vectors moves every row.

The values written are the ones mlx-lm's merge writes (zeros where rows are
padded), so every row computes what it computes alone.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from mlxq.kv.batch_ops import merge_solo_rows
from mlxq.kv.shared_prefix_cache import SharedPrefixBatchCache


@dataclass
class RowCopies:
    """Rows' caches copied whole into or out of batched caches around joins (/stats.batch.row_copies):
    each is a new buffer of the row's whole KV, the cost a burst of agents pays per row."""

    kept: int = 0  # rows that joined in the batch their last chunk ran in (no copy)
    referenced: int = 0  # of those, rows whose tails ran on their shared prefix by reference (no prefix copy)
    broadcast: int = 0  # rows merged from the row before them (the same stored prefix): no copy kernel of their own
    gathered: int = 0  # rows merged into a new batch to join (copied)
    extracted: int = 0  # rows copied out of a batch: after a chunk that was not their last, or leaving it to be stored
    batch_extends: int = 0  # joins into a running batch: each copies every running row once more
    extended_rows: int = 0  # the running rows those joins copied

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(eq=False)
class PrefilledTogether:
    """The batched caches of joiners whose last chunk ran in one forward, rows in ``joiners``' order."""

    joiners: tuple
    caches: list
    shared: object = None  # engine/shared_tails.SharedTails when the tails read their prefix by reference

    def serves(self, joiners: list) -> bool:
        """These caches hold exactly ``joiners``' rows, in that order."""
        return len(joiners) == len(self.joiners) and all(a is b for a, b in zip(joiners, self.joiners, strict=True))


def merge_with_room(rows: list[list], room: int, sources: list | None = None) -> list:
    """Per layer, one batched cache of ``rows`` (solo cache lists), as ``merge_solo_rows``; plain
    full-attention layers are allocated ``room`` tokens past the longest row. ``sources``: per row,
    what its caches hold (equal and not None: the same K/V, e.g. one stored prefix lent as it is);
    a run of neighbouring rows with one source is written from its first row, broadcast: one copy
    per run and layer, not one per row."""
    sources = sources or [None] * len(rows)
    merged = []
    for column in zip(*rows, strict=True):
        if all(type(c) is KVCache for c in column) and any(c.keys is not None for c in column):
            merged.append(_merge_kv(column, room, sources))
        else:
            merged.append(merge_solo_rows([[c] for c in column])[0])
    return merged


def finalize_chunks(cache, shifts: list[int]) -> None:
    """``cache.finalize()`` after a right-padded chunk: each row moved right by its padding so that
    every row's next write lands in the same column. For plain full-attention layers (and the tails
    of a shared-prefix layer, kv/shared_prefix_cache.py) the rows are moved by ``roll_rows`` instead
    of mlx-lm's ``dynamic_roll``: a ``take_along_axis`` over the whole batch that took 540 ms for 40
    rows of a 2.2k-token prefix on the 8B shape on an H200 (the forward: 121 ms), and whose first
    use in a process cost 6.3 s of kernel compilation there (a shared-prefix burst's first tails);
    the values are the same. ``shifts``: each row's right padding, as the caller gave it to ``prepare``."""
    target = cache.tail if isinstance(cache, SharedPrefixBatchCache) else cache
    padding = getattr(target, "_right_padding", None)
    if type(target) is not BatchKVCache or padding is None or target.keys is None:
        cache.finalize()
        return
    keys, values = target.keys, target.values
    index = _roll_index(keys.shape, shifts)  # keys and values share it unless their widths differ
    if index is not None:
        target.keys = _take_rolled(keys, index)
        target.values = _take_rolled(values, index if values.shape[:3] == keys.shape[:3]
                                     else _roll_index(values.shape, shifts))
    target.offset = target.offset - padding
    target.left_padding = target.left_padding + padding
    target._right_padding = None


def roll_rows(x: mx.array, shifts: list[int]) -> mx.array:
    """``dynamic_roll(x, shifts, axis=2)``: row b rolled right by ``shifts[b]`` along the token axis.

    One ``take`` of x's [dim]-long vectors (one kernel, each element copied once), not a run of
    slices per row: with 64 rows of different shifts those were ~12k operations per forward, 100 ms
    of host time on the H200."""
    index = _roll_index(x.shape, shifts)
    return x if index is None else _take_rolled(x, index)


def _roll_index(shape: tuple, shifts: list[int]) -> mx.array | None:
    """Where each of ``roll_rows``' output vectors comes from (None: no row moves)."""
    rows, heads, n, _ = shape
    offsets = [s % n for s in shifts]
    if not any(offsets):
        return None
    columns = (mx.arange(n)[None, :] - mx.array(offsets)[:, None]) % n  # [rows, n]: where each column comes from
    starts = mx.arange(rows * heads).reshape(rows, heads, 1) * n
    return (starts + columns[:, None, :]).reshape(-1)


def _take_rolled(x: mx.array, index: mx.array) -> mx.array:
    rows, heads, n, dim = x.shape
    return mx.take(x.reshape(rows * heads * n, dim), index, axis=0).reshape(rows, heads, n, dim)


def same_as_previous(sources: list) -> int:
    """Rows that ``merge_with_room`` writes by broadcast from the row before them."""
    return sum(s is not None and s == prev for prev, s in zip(sources, sources[1:], strict=False))


def _merge_kv(column: tuple, room: int, sources: list) -> BatchKVCache:
    """mlx-lm's ``BatchKVCache.merge`` (rows right-aligned, left padding zero) into a larger buffer, its
    length a whole number of mlx-lm's growth steps (so a burst like the last one reuses its freed buffers)."""
    longest = max(c.size() for c in column)
    padding = [longest - c.size() for c in column]
    step = BatchKVCache.step
    capacity = -(-(longest + room) // step) * step
    out = BatchKVCache(padding)
    out.keys, out.values = (_rows_into(column, name, padding, capacity, sources) for name in ("keys", "values"))
    out.offset += longest
    out._idx = longest
    return out


def _rows_into(column: tuple, name: str, padding: list[int], capacity: int, sources: list) -> mx.array:
    """One [rows, heads, capacity, dim] buffer holding each row's ``name`` array, right-aligned."""
    sample = next(getattr(c, name) for c in column if c.keys is not None)
    rows, heads, dim = len(column), sample.shape[1], sample.shape[3]
    out = mx.zeros((rows, heads, capacity, dim), dtype=sample.dtype)
    start = 0
    for end in range(1, rows + 1):
        if end < rows and sources[end] is not None and sources[end] == sources[start]:
            continue  # the same K/V as the run's first row (and so the same length and padding)
        cache, pad = column[start], padding[start]
        if cache.keys is not None:
            n = cache.offset
            row = getattr(cache, name)[..., :n, :]
            out[start:end, :, pad : pad + n] = row if end - start == 1 else mx.broadcast_to(row, (end - start, heads,
                                                                                                n, dim))
        start = end
    return out
