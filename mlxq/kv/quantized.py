"""Quantized KV caches mlx-lm does not have: a sliding-window ring and batched caches for both kinds.

mlx-lm quantizes full-attention KV (``QuantizedKVCache``: each of keys and
values is a triple of packed uint32 data, scales and biases, grouped along
head_dim) but raises "RotatingKVCache Quantization NYI" for sliding windows
and refuses quantized caches in its batch generator. Both are possible
because quantization groups run along head_dim: every token is quantized
independently, so any surgery along the token axis (ring writes, trims,
temporal reordering, left padding, concatenating rows) moves whole
quantized tokens and is byte-exact. Here a triple takes the place of each
array, and the ring and batch logic is mlx-lm's, applied to all three.

Attention reads ``bits`` / ``group_size`` off the cache and runs mlx-lm's
``quantized_scaled_dot_product_attention``, in both lanes.
"""

from __future__ import annotations

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.models.cache import BatchKVCache, BatchRotatingKVCache, QuantizedKVCache, RotatingKVCache

Triple = tuple[mx.array, mx.array, mx.array]


def _tokens(t: Triple) -> int:
    return t[0].shape[2]


def _cat(parts: list[Triple]) -> Triple:
    return tuple(mx.concatenate([p[i] for p in parts], axis=2) for i in range(3))


def _zeros_like_tokens(t: Triple, n: int) -> Triple:
    return tuple(mx.zeros((*x.shape[:2], n, x.shape[3]), x.dtype) for x in t)


def _quantized_zeros(shape: tuple[int, int, int], dim: int, dtype, group_size: int, bits: int) -> Triple:
    per_int = 32 // bits
    return (mx.zeros((*shape, dim // per_int), mx.uint32), mx.zeros((*shape, dim // group_size), dtype),
            mx.zeros((*shape, dim // group_size), dtype))


def triple_nbytes(t: Triple | None) -> int:
    return 0 if t is None else sum(x.nbytes for x in t)


def _join_right_aligned(first, second, max_idx: int) -> None:
    """``first`` += ``second``'s rows, both right-aligned at column ``max_idx`` (mlx-lm's extend, on triples)."""
    width = max(_tokens(c.keys) for c in (first, second) if c.keys is not None)

    def pad(c):
        left = max_idx - c._idx
        k, v = c.keys, c.values
        right = width - _tokens(k) - left
        if right < 0:
            k = tree_map(lambda x: x[..., :right, :], k)
            v = tree_map(lambda x: x[..., :right, :], v)
            right = 0
        if left or right:
            widths = [(0, 0), (0, 0), (left, right), (0, 0)]
            k = tree_map(lambda x: mx.pad(x, widths), k)
            v = tree_map(lambda x: mx.pad(x, widths), v)
        return k, v, c.offset, c.left_padding + left

    (k1, v1, o1, p1), (k2, v2, o2, p2) = pad(first), pad(second)
    first.keys = tuple(mx.concatenate([a, b]) for a, b in zip(k1, k2, strict=True))
    first.values = tuple(mx.concatenate([a, b]) for a, b in zip(v1, v2, strict=True))
    first.offset = mx.concatenate([o1, o2])
    first.left_padding = mx.concatenate([p1, p2])
    first._idx = max_idx


def _grow_ring(cache, keys: mx.array, values: mx.array, prev: int) -> None:
    """A ring that has not reached its window grows by one step of zero tokens (mlx-lm's rule)."""
    if cache.keys is not None and not (prev >= _tokens(cache.keys) and _tokens(cache.keys) < cache.max_size):
        return
    B, H, _, Dk = keys.shape
    n = min(cache.step, cache.max_size - prev)
    new_k = _quantized_zeros((B, H, n), Dk, keys.dtype, cache.group_size, cache.bits)
    new_v = _quantized_zeros((B, H, n), values.shape[3], values.dtype, cache.group_size, cache.bits)
    if cache.keys is not None:
        cache.keys, cache.values = _cat([cache.keys, new_k]), _cat([cache.values, new_v])
    else:
        cache.keys, cache.values = new_k, new_v
    cache._idx = prev


def _trim_to_window(cache) -> int:
    """A ring holding more than its window (after a long prefill chunk) drops the excess; how many."""
    trim_size = max(_tokens(cache.keys) - cache.max_size, 0)
    if trim_size:
        cache.keys = cache._trim(trim_size, cache.keys)
        cache.values = cache._trim(trim_size, cache.values)
        cache._idx = cache.max_size
    return trim_size


def _write(cache, at: int, keys: Triple, values: Triple) -> None:
    """Write quantized tokens into the cache's triples at column ``at``, in place."""
    n = _tokens(keys)
    for i in range(3):
        cache.keys[i][..., at : at + n, :] = keys[i]
        cache.values[i][..., at : at + n, :] = values[i]


def _keep_rows(cache, batch_indices) -> None:
    if cache.keys is not None:
        cache.keys = tree_map(lambda x: x[batch_indices], cache.keys)
        cache.values = tree_map(lambda x: x[batch_indices], cache.values)
    cache.offset = cache.offset[batch_indices]
    cache.left_padding = cache.left_padding[batch_indices]


class _Quantizes:
    """The quantization of a cache's tokens; attention reads ``bits`` and ``group_size`` off the cache."""

    group_size: int
    bits: int

    def _quantize(self, x: mx.array) -> Triple:
        return tuple(mx.quantize(x, group_size=self.group_size, bits=self.bits))


class QuantizedRotatingKVCache(_Quantizes, RotatingKVCache):
    """mlx-lm's RotatingKVCache over quantized triples (same ring, same positions, same masks)."""

    def __init__(self, max_size: int, keep: int = 0, group_size: int = 64, bits: int = 8):
        super().__init__(max_size, keep)
        self.group_size = group_size
        self.bits = bits

    def _trim(self, trim_size, v, append=None):
        if trim_size > 0:
            parts = [tree_map(lambda x: x[..., : self.keep, :], v),
                     tree_map(lambda x: x[..., trim_size + self.keep :, :], v)]
        else:
            parts = [v]
        if append is not None:
            parts.append(append)
        return _cat(parts)

    def _temporal_order(self, v):
        if self._idx == _tokens(v):
            return v
        if self._idx < self.offset:
            return _cat([tree_map(lambda x: x[..., : self.keep, :], v), tree_map(lambda x: x[..., self._idx:, :], v),
                         tree_map(lambda x: x[..., self.keep : self._idx, :], v)])
        return tree_map(lambda x: x[..., : self._idx, :], v)

    def _update_concat(self, keys, values):
        keys, values = self._quantize(keys), self._quantize(values)
        if self.keys is None:
            self.keys, self.values = keys, values
        else:
            self.keys = self._temporal_order(self.keys)
            self.values = self._temporal_order(self.values)
            self._idx = _tokens(self.keys)
            trim_size = self._idx - self.max_size + 1
            self.keys = self._trim(trim_size, self.keys, keys)
            self.values = self._trim(trim_size, self.values, values)
        self.offset += _tokens(keys)
        self._idx = _tokens(self.keys)
        return _maybe_contiguous(self.keys, self.values)

    def _update_in_place(self, keys, values):
        S = keys.shape[2]
        _grow_ring(self, keys, values, self.offset)
        _trim_to_window(self)
        if self._idx == self.max_size:
            self._idx = self.keep
        _write(self, self._idx, self._quantize(keys), self._quantize(values))
        self.offset += S
        self._idx += S
        return self.keys_and_values()

    def keys_and_values(self):
        if self.offset < _tokens(self.keys):
            cut = lambda x: x[..., : self.offset, :]  # noqa: E731
            return _maybe_contiguous(tree_map(cut, self.keys), tree_map(cut, self.values))
        return self.keys, self.values

    @property
    def state(self):
        return self.keys, self.values, self.offset, self.keep, self.max_size, self._idx

    @state.setter
    def state(self, v):
        self.keys, self.values, self.offset, self.keep, self.max_size, self._idx = v

    @property
    def nbytes(self):
        return triple_nbytes(self.keys) + triple_nbytes(self.values)

    def to_quantized(self, group_size: int = 64, bits: int = 4):  # already quantized: mlx-lm's hook skips it
        return self


def quantize_rotating(cache: RotatingKVCache, group_size: int, bits: int) -> QuantizedRotatingKVCache:
    """The same ring, quantized token by token (exactly what writing quantized tokens would have stored)."""
    out = QuantizedRotatingKVCache(cache.max_size, cache.keep, group_size, bits)
    out.offset, out._idx = cache.offset, cache._idx
    if cache.keys is not None:
        out.keys = tuple(mx.quantize(cache.keys, group_size=group_size, bits=bits))
        out.values = tuple(mx.quantize(cache.values, group_size=group_size, bits=bits))
    return out


class BatchQuantizedKVCache(_Quantizes, BatchKVCache):
    """mlx-lm's BatchKVCache (left-padded rows, one write column) over quantized triples."""

    def __init__(self, left_padding: list[int], group_size: int = 64, bits: int = 8):
        super().__init__(left_padding)
        self.group_size = group_size
        self.bits = bits

    def update_and_fetch(self, keys, values):
        prev = self._idx
        n = keys.shape[2]
        if self.keys is None or prev + n > _tokens(self.keys):
            B, H, _, Dk = keys.shape
            grow = (self.step + n - 1) // self.step * self.step
            new_k = _quantized_zeros((B, H, grow), Dk, keys.dtype, self.group_size, self.bits)
            new_v = _quantized_zeros((B, H, grow), values.shape[3], values.dtype, self.group_size, self.bits)
            if self.keys is not None:
                if prev % self.step != 0:
                    self.keys = tree_map(lambda x: x[..., :prev, :], self.keys)
                    self.values = tree_map(lambda x: x[..., :prev, :], self.values)
                self.keys, self.values = _cat([self.keys, new_k]), _cat([self.values, new_v])
            else:
                self.keys, self.values = new_k, new_v
        self.offset = self.offset + n
        self._idx += n
        _write(self, prev, self._quantize(keys), self._quantize(values))
        return self.keys_and_values()

    def keys_and_values(self):
        cut = lambda x: x[..., : self._idx, :]  # noqa: E731
        return _maybe_contiguous(tree_map(cut, self.keys), tree_map(cut, self.values))

    def filter(self, batch_indices):
        _keep_rows(self, batch_indices)
        min_left_pad = min(self.left_padding.tolist())
        if min_left_pad > 0:
            if self.keys is not None:
                self.keys = tree_map(lambda x: x[..., min_left_pad:, :], self.keys)
                self.values = tree_map(lambda x: x[..., min_left_pad:, :], self.values)
            self._idx -= min_left_pad
            self.left_padding -= min_left_pad

    def extend(self, other: BatchQuantizedKVCache) -> None:
        """Append ``other``'s rows, right-aligned at the common write column (as BatchKVCache.extend)."""
        _join_right_aligned(self, other, max(self._idx, other._idx))

    def extract(self, idx: int) -> QuantizedKVCache:
        cache = QuantizedKVCache(self.group_size, self.bits)
        padding = self.left_padding.tolist()[idx]
        cache.keys = tuple(mx.contiguous(x[idx : idx + 1, :, padding : self._idx]) for x in self.keys)
        cache.values = tuple(mx.contiguous(x[idx : idx + 1, :, padding : self._idx]) for x in self.values)
        cache.offset = _tokens(cache.keys)
        return cache

    @classmethod
    def merge(cls, caches: list[QuantizedKVCache]) -> BatchQuantizedKVCache:
        """Solo quantized caches -> one batch, each row right-aligned (left-padded with zero tokens)."""
        first = caches[0]
        lengths = [c.offset for c in caches]
        longest = max(lengths)
        out = cls([longest - n for n in lengths], first.group_size, first.bits)
        if longest == 0:
            return out
        ref = next(c for c in caches if c.keys is not None)
        rows_k, rows_v = [], []
        for c, n in zip(caches, lengths, strict=True):
            if c.keys is None:  # an empty row: all padding
                rows_k.append(_zeros_like_tokens(ref.keys, longest))
                rows_v.append(_zeros_like_tokens(ref.values, longest))
                continue
            k = tree_map(lambda x, n=n: x[..., :n, :], c.keys)
            v = tree_map(lambda x, n=n: x[..., :n, :], c.values)
            if n < longest:
                k, v = _cat([_zeros_like_tokens(k, longest - n), k]), _cat([_zeros_like_tokens(v, longest - n), v])
            rows_k.append(k)
            rows_v.append(v)
        out.keys = tuple(mx.concatenate([k[i] for k in rows_k]) for i in range(3))
        out.values = tuple(mx.concatenate([v[i] for v in rows_v]) for i in range(3))
        out._idx = longest
        out.offset = out.offset + longest  # per-row token counts (the constructor starts them at -padding)
        return out

    @property
    def nbytes(self):
        return triple_nbytes(self.keys) + triple_nbytes(self.values)


def _roll(t: Triple, shift: int) -> Triple:
    return tuple(mx.roll(x, shift, axis=2) for x in t)


def _depends(t: Triple, on: tuple) -> Triple:
    """Tie the cache's scalar bookkeeping into the graph, as mlx-lm's batch ring does."""
    return tuple(mx.depends(list(t), list(on)))


def _left_pad(t: Triple, n: int) -> Triple:
    return t if n == 0 else _cat([_zeros_like_tokens(t, n), t])


class BatchQuantizedRotatingKVCache(_Quantizes, BatchRotatingKVCache):
    """mlx-lm's BatchRotatingKVCache (per-row rings, left padding, ring wrap) over quantized triples.

    The ring's geometry (``_idx``, ``_offset``, ``rotated``, per-row ``offset`` and
    ``left_padding``) and its masks are mlx-lm's, untouched; only the storage
    operations (trim, roll, concatenate, pad, assign) act on three arrays instead
    of one. mlx-lm's right-padded prompt batching (``prepare``/``finalize``) is
    not used: the batch lane prefills every row alone and joins it by ``merge``.
    """

    def __init__(self, max_size: int, left_padding: list[int], group_size: int = 64, bits: int = 8):
        super().__init__(max_size, left_padding)
        self.group_size = group_size
        self.bits = bits

    def _trim(self, trim_size, v, append=None):
        if trim_size > 0:
            v = tree_map(lambda x: x[..., trim_size:, :], v)
        return _cat([v, append]) if append is not None else v

    def _temporal_order(self):
        if self.rotated:
            self.keys, self.values = _roll(self.keys, -self._idx), _roll(self.values, -self._idx)
            self._idx = _tokens(self.keys)
            self.rotated = False

    def _update_concat(self, keys, values):
        keys, values = self._quantize(keys), self._quantize(values)
        if self.keys is None:
            self.keys, self.values = keys, values
        else:
            self._temporal_order()
            if _tokens(self.keys) > self._idx:
                self.keys = tree_map(lambda x: x[..., : self._idx, :], self.keys)
                self.values = tree_map(lambda x: x[..., : self._idx, :], self.values)
            trim_size = self._idx - self.max_size + 1
            if trim_size > 0:
                self.left_padding -= trim_size
            self.keys = self._trim(trim_size, self.keys, keys)
            self.values = self._trim(trim_size, self.values, values)
        n = _tokens(keys)
        self.offset = self.offset + n
        self._offset += n
        self._idx = _tokens(self.keys)
        self.keys = _depends(self.keys, (self.left_padding, self.offset))
        return _maybe_contiguous(self.keys, self.values)

    def _update_in_place(self, keys, values):
        S = keys.shape[2]
        _grow_ring(self, keys, values, self._offset)
        if trimmed := _trim_to_window(self):
            self.left_padding -= trimmed
        if self._idx == self.max_size:
            self.rotated = True
            self._idx = 0
        if self.rotated:
            self.left_padding -= S
        _write(self, self._idx, self._quantize(keys), self._quantize(values))
        self._offset += S
        self.offset = self.offset + S
        self._idx += S
        self.keys = _depends(self.keys, (self.left_padding, self.offset))
        return self.keys_and_values()

    def keys_and_values(self):
        if self._offset < _tokens(self.keys):
            cut = lambda x: x[..., : self._offset, :]  # noqa: E731
            return _maybe_contiguous(tree_map(cut, self.keys), tree_map(cut, self.values))
        return _maybe_contiguous(self.keys, self.values)

    def filter(self, batch_indices):
        _keep_rows(self, batch_indices)

    def extend(self, other: BatchQuantizedRotatingKVCache) -> None:
        if self.rotated != other.rotated or self._idx != other._idx:
            self._temporal_order()
            other._temporal_order()
        offset = max(self._offset, other._offset)
        _join_right_aligned(self, other, max(self._idx, other._idx))
        self._offset = offset

    def extract(self, idx: int) -> QuantizedRotatingKVCache:
        mx.eval(self.left_padding, self.offset)
        padding = max(0, self.left_padding.tolist()[idx])
        k = tree_map(lambda x: x[idx : idx + 1], self.keys)
        v = tree_map(lambda x: x[idx : idx + 1], self.values)
        end = self._idx
        if self.rotated:
            k, v, end = _roll(k, -self._idx), _roll(v, -self._idx), self.max_size
        cache = QuantizedRotatingKVCache(self.max_size, 0, self.group_size, self.bits)
        cache.keys = tree_map(lambda x: mx.contiguous(x[:, :, padding:end]), k)
        cache.values = tree_map(lambda x: mx.contiguous(x[:, :, padding:end]), v)
        cache.offset = self.offset.tolist()[idx]
        cache._idx = _tokens(cache.keys)
        return cache

    @classmethod
    def merge(cls, caches: list[QuantizedRotatingKVCache]) -> BatchQuantizedRotatingKVCache:
        """Solo quantized rings -> one batch: each row's window in temporal order, right-aligned."""
        first = caches[0]
        if any(c.max_size != first.max_size for c in caches):
            raise ValueError("can only merge rings of the same window")
        lengths = [c.size() for c in caches]
        longest = max(lengths)
        if longest == 0:
            return cls(first.max_size, [0] * len(caches), first.group_size, first.bits)
        ref = next(c for c in caches if c.keys is not None)
        rows_k, rows_v = [], []
        for c, n in zip(caches, lengths, strict=True):
            if c.keys is None:
                rows_k.append(_zeros_like_tokens(ref.keys, longest))
                rows_v.append(_zeros_like_tokens(ref.values, longest))
                continue
            k = tree_map(lambda x, n=n: x[..., -n:, :], c._temporal_order(c.keys))
            v = tree_map(lambda x, n=n: x[..., -n:, :], c._temporal_order(c.values))
            rows_k.append(_left_pad(k, longest - n))
            rows_v.append(_left_pad(v, longest - n))
        out = cls(first.max_size, [longest - n for n in lengths], first.group_size, first.bits)
        out.keys = tuple(mx.concatenate([k[i] for k in rows_k]) for i in range(3))
        out.values = tuple(mx.concatenate([v[i] for v in rows_v]) for i in range(3))
        out.offset = mx.array([c.offset for c in caches])
        out._idx = out._offset = longest
        return out

    @property
    def nbytes(self):
        return triple_nbytes(self.keys) + triple_nbytes(self.values)


def _strided_quantized_matmul_missing() -> bool:
    """MLX's CUDA backend has no quantized_matmul for sliced (non-contiguous) quantized operands:
    "[quantized_matmul] No implementation for problem shape" (mlx 0.32.4, seen on an H200). Metal
    and CPU have one."""
    return mx.default_device() == mx.gpu and not mx.metal.is_available()


_contiguous_views = False


def use_contiguous_views() -> None:
    """Make every quantized cache hand attention contiguous arrays (CUDA only; values unchanged).

    mlx-lm's QuantizedKVCache returns ``x[..., :offset, :]`` slices of its 256-token buffers;
    on CUDA those cannot be multiplied. This patches its ``keys_and_values`` (and ours) to
    copy the slice: the same numbers, one extra read and write of the live KV per layer
    and step. Called once at start-up when a quantized scheme runs on CUDA.
    """
    global _contiguous_views
    if _contiguous_views or not _strided_quantized_matmul_missing():
        return
    _contiguous_views = True
    original = QuantizedKVCache.keys_and_values

    def keys_and_values(self):
        keys, values = original(self)
        return tree_map(mx.contiguous, keys), tree_map(mx.contiguous, values)

    QuantizedKVCache.keys_and_values = keys_and_values


def _maybe_contiguous(keys, values):
    if not _contiguous_views:
        return keys, values
    return tree_map(mx.contiguous, keys), tree_map(mx.contiguous, values)
