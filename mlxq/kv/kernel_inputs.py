"""Small inputs every kernel of kv/ takes (CUDA and Metal), each device array made once per value.

The kernels read the softmax scale (and a few integers) from memory rather
than as template arguments, so one compiled kernel serves every model;
building those one-element arrays anew on every call would add an upload
per layer and step. Placeholders stand in for optional inputs a kernel
does not read (no sinks: its ``HAS_SINKS`` template flag is false).
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx

_made: dict[tuple, mx.array] = {}


def constant(key: tuple, make: Callable[[], mx.array]) -> mx.array:
    """``make()`` on the first call for ``key``, the same array after: evaluated at once, so that no
    later graph (on another thread's stream) inherits a lazy array from the one that made it."""
    if key not in _made:
        made = make()
        mx.eval(made)
        _made[key] = made
    return _made[key]


def scale_array(scale: float) -> mx.array:
    """[1] float32."""
    return constant(("scale", scale), lambda: mx.array([scale], mx.float32))


def int_array(value: int) -> mx.array:
    """[1] int32."""
    return constant(("int", value), lambda: mx.array([value], mx.int32))


def sinks_array(sinks: mx.array | None) -> mx.array:
    """[Hq] float32 attention sinks, or a [1] placeholder when the model has none."""
    if sinks is None:
        return constant(("no sinks",), lambda: mx.zeros((1,), mx.float32))
    return mx.contiguous(sinks.astype(mx.float32))


def row_starts(starts: mx.array) -> mx.array:
    """[B] int32: where each row's keys begin (left padding before)."""
    return mx.contiguous(starts.astype(mx.int32))


def row_shares(shares: mx.array | None, rows: int) -> mx.array:
    """[rows] int32: 1 where the row sees the prefix (None: every row)."""
    if shares is not None:
        return mx.contiguous(shares.astype(mx.int32))
    return constant(("everyone", rows), lambda: mx.ones((rows,), mx.int32))


def prefix_inputs(prefix: tuple[mx.array, mx.array] | None, dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
    """A decode kernel's prefix keys and values, or [1, 1, 1, 1] placeholders of ``dtype`` when it walks
    the rows' own keys only (its ``HAS_PREFIX`` template flag is false)."""
    if prefix is not None:
        return prefix
    none = constant(("no prefix", dtype), lambda: mx.zeros((1, 1, 1, 1), dtype))
    return none, none
