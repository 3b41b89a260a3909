"""Prefill attention on MLX's CPU backend: the same values as MLX's, with less of its softmax.

On the CPU, ``mx.fast.scaled_dot_product_attention`` runs MLX's fallback:
scores = (q * scale) k^T, the mask applied, a softmax, then the weights
times v. Its softmax is the expensive part: MLX's CPU softmax computes every
``exp`` on one thread, ~15-30 ns an element on the project's 2-core VM
(docs/benchmarks.md, "CPU: agents on one shared prompt vs mlx_lm.server"),
while the two matrix products run on MKL's threads. A causal prefill of L
tokens evaluates L x L exponentials per head, half of them for masked
positions whose weight is exactly zero.

``attention`` computes the same operations, except the softmax: the
queries are cut into blocks, and each block's softmax reads only the key
columns any of its queries may attend to (a causal mask hides the rest);
the weights past them are written as zeros. For one row of scores this is
the same arithmetic in the same order: MLX writes a masked score as the
dtype's lowest value, whose ``exp`` after the row's maximum is subtracted
is exactly 0, the maximum ignores them and the normalizer adds them last as
exact zeros (every causal row attends to at least its own position). The
matrix products see the same operands as MLX's fallback (full rows of
weights, zeros included), so the result is equal to
``mx.fast.scaled_dot_product_attention`` bit for bit (tests/kv/test_cpu_attention.py
checks it shape by shape, and a model's logits through it). A causal
prefill of L tokens then evaluates about L x L / 2 exponentials. With
``MLXQ_CPU_ATTENTION=two`` the blocks alternate between two CPU streams (the
same values; on the 2-core VM no faster, MKL's threads hold the cores).

``install()`` routes mlx-lm's attention entry point (the
``scaled_dot_product_attention`` every mlx-lm model module imports) through
``route`` on the CPU backend only. Quantized caches, attention sinks,
additive masks, dtypes other than float32 and short query chunks (decode
steps) go to mlx-lm's own function. ``MLXQ_CPU_ATTENTION=mlx`` turns it off.
"""

from __future__ import annotations

import logging
import os

import mlx.core as mx
from mlx_lm.models import base

from mlxq.kv.model_modules import rebind

log = logging.getLogger("mlxq.kv")

MIN_QUERIES = 16  # shorter chunks (decode steps, a token or two of a prompt) keep mlx-lm's call
BLOCK = 64  # queries per softmax block
MAX_BLOCKS = 16
STREAMS = 1  # ``MLXQ_CPU_ATTENTION=two``: every other block (or half the rows) on a second CPU stream

_mlx_lm_attention = base.scaled_dot_product_attention
_installed = False
_second: mx.Stream | None = None


def _second_stream() -> mx.Stream:
    global _second
    if _second is None:
        _second = mx.new_stream(mx.cpu)
    return _second


def applies(queries: mx.array, keys: mx.array, mask) -> bool:
    """What ``attention`` computes exactly as MLX does: float32, a boolean, causal or no mask."""
    if isinstance(mask, str):
        known = mask == "causal"
    else:
        known = mask is None or mask.dtype == mx.bool_
    return (known and queries.dtype == keys.dtype == mx.float32 and queries.shape[2] >= MIN_QUERIES
            and queries.shape[1] % keys.shape[1] == 0)


def attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask) -> mx.array:
    """softmax(q k^T * scale, masked) v, equal to ``mx.fast.scaled_dot_product_attention`` on the CPU
    (``applies``). ``mask``: None, "causal" (the queries are the last positions of the keys) or a
    boolean array (True = attend) broadcastable to [B, Hq, L, S]."""
    batch, heads, length, dim = queries.shape
    kv_heads, span = keys.shape[1], keys.shape[2]
    group = heads // kv_heads
    q = queries * mx.array(scale, queries.dtype)
    k, v = keys, values
    if group > 1:
        q = q.reshape(batch, kv_heads, group, length, dim)
        k, v = mx.expand_dims(keys, 2), mx.expand_dims(values, 2)
    scores = q @ mx.swapaxes(k, -1, -2)
    causal = isinstance(mask, str)
    if causal:
        mask = mx.arange(span - length, span)[:, None] >= mx.arange(span)[None, :]
    if mask is not None:
        if group > 1 and mask.ndim >= 3:
            mask = (mx.expand_dims(mask, -3) if mask.shape[-3] == 1
                    else mask.reshape(*mask.shape[:-3], kv_heads, group, *mask.shape[-2:]))
        scores = mx.where(mask, scores, mx.array(mx.finfo(scores.dtype).min, scores.dtype))
    weights = _softmax(scores, span - length if causal else None)
    out = weights @ v
    return out.reshape(batch, heads, length, dim) if group > 1 else out


def _softmax(scores: mx.array, causal_offset: int | None) -> mx.array:
    """MLX's softmax over the last axis. With ``causal_offset`` (query i sits at key position
    offset + i): by blocks of queries (axis -2), a block [a, b) reading the key columns
    [0, offset + b), the rest of its rows zeros (with ``STREAMS`` 2, every other block on the second
    stream). Without: MLX's call as it is (with two streams, the rows in two halves, one per stream)."""
    length, span = scores.shape[-2], scores.shape[-1]
    second = _second_stream() if STREAMS > 1 else None
    if causal_offset is None:
        if second is None:
            return mx.softmax(scores, axis=-1, precise=True)
        rows = scores.reshape(-1, span)  # contiguous (the mask's ``where`` wrote it): halves need no copy
        half = rows.shape[0] // 2
        return mx.concatenate([mx.softmax(rows[:half], axis=-1, precise=True),
                               mx.softmax(rows[half:], axis=-1, precise=True, stream=second)]).reshape(scores.shape)
    count = min(MAX_BLOCKS, -(-length // BLOCK))
    if count < 2:
        return mx.softmax(scores, axis=-1, precise=True)
    bounds = [length * i // count for i in range(count + 1)]
    parts = []
    for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        end = min(span, causal_offset + b)
        stream = second if i % 2 else None
        block = mx.softmax(scores[..., a:b, :end], axis=-1, precise=True, stream=stream)
        if end < span:
            block = mx.pad(block, [(0, 0)] * (block.ndim - 1) + [(0, span - end)], stream=stream)
        parts.append(block)
    return mx.concatenate(parts, axis=-2)


def route(queries, keys, values, cache, scale, mask, sinks=None):
    """mlx-lm's attention entry point, with float32 prefill chunks computed by ``attention``."""
    if sinks is None and not hasattr(cache, "bits") and applies(queries, keys, mask):
        return attention(queries, keys, values, scale, mask)
    return _mlx_lm_attention(queries, keys, values, cache, scale, mask, sinks)


def install() -> bool:
    """Route mlx-lm's attention through ``route`` (MLX's CPU backend only); True when it is on.

    Call after the model is loaded: the model's module must already be imported."""
    global _installed, STREAMS
    wanted = os.environ.get("MLXQ_CPU_ATTENTION", "").lower()
    if wanted == "mlx" or mx.default_device() != mx.cpu:
        return False
    STREAMS = 2 if wanted == "two" else 1
    if not _installed:
        _installed = True
        log.info("CPU attention routing on (prefill softmax by blocks of queries, %d stream(s))", STREAMS)
    rebind(_mlx_lm_attention, route)
    return True
