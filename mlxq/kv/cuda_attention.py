"""Where attention runs on MLX's CUDA backend: two costs the fused calls hide.

Measured on the H200 with MLX 0.32.4 (docs/benchmarks.md, "H200: attention routing on CUDA"):

- Prefill attention (more than one query) goes to cuDNN, which builds a graph
  for every new (batch, query length, key length, mask) shape: 37-60 ms for
  a causal call, 0.76-1.5 s with an array mask, then ~0.15 ms once built.
  Serving sees a new shape with nearly every prompt (lengths vary, cached
  prefixes vary), so a 150-token prompt paid ~50 ms of graph building in its
  time to first token. Short chunks therefore run as plain MLX operations
  (matmul, softmax, matmul: cuBLAS, no per-shape build); long ones, where the
  build is small next to the work and the scores would be large, stay on
  cuDNN.
- Batched one-token decode carries a left-padding mask, which sends MLX's
  CUDA attention to its unfused fallback: kv/gqa_decode_kernel.py serves it
  (one block per row and KV head) where it takes the shape and its own
  self-check agrees with MLX, else kv/decode_kernel.py (one block per row
  and query head).

``install()`` routes mlx-lm's attention entry point (the
``scaled_dot_product_attention`` every mlx-lm model module imports) through
``route`` — only on the CUDA backend, and only after the kernel's self-check
agrees with MLX. Quantized caches and attention sinks always go to mlx-lm's
own function, as does everything on the CPU and Metal (so every parity test
there runs mlx-lm's path). ``MLXQ_CUDA_ATTENTION=mlx`` turns it off.
"""

from __future__ import annotations

import contextlib
import logging
import os

import mlx.core as mx
from mlx_lm.models import base
from mlx_lm.models.cache import BatchKVCache

from mlxq.kv import gqa_decode_kernel
from mlxq.kv.decode_kernel import HEAD_DIMS, masked_decode_attention, self_check
from mlxq.kv.model_modules import rebind

log = logging.getLogger("mlxq.kv")

# Prefill chunks whose score matrix (query x key positions) is at most this run as plain
# operations: the scores of a 2048 x 2048 chunk are 32 heads x 16 MB in float32, and its
# work (~70 ms for an 8B model) dwarfs a one-time graph build.
OPS_MAX_SCORES = 1024 * 2048

_mlx_lm_attention = base.scaled_dot_product_attention
_installed = False
_gqa = False  # kv/gqa_decode_kernel.py passed its self-check: decode steps run it where it takes the shape
_bypass = False  # set inside mlx_lm_only(): every call goes to mlx-lm's function


def ops_attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask) -> mx.array:
    """softmax(q k^T * scale + mask) v as MLX operations (MLX's own fallback, grouped-query aware).

    ``mask``: None, "causal" (queries are the last positions of the keys), a boolean
    array (True = attend) or an additive array, broadcastable to [B, Hq, L, S].
    """
    batch, heads, length, dim = queries.shape
    kv_heads, span = keys.shape[1], keys.shape[2]
    group = heads // kv_heads
    q = (queries * mx.array(scale, queries.dtype)).reshape(batch, kv_heads, group, length, dim)
    scores = q @ keys[:, :, None].swapaxes(-1, -2)  # [B, Hkv, group, L, S]
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unsupported mask {mask!r}")
        rows = mx.arange(span - length, span)[:, None]
        mask = rows >= mx.arange(span)[None, :]
    if mask is not None:
        if mask.ndim == 4:  # [B or 1, Hq or 1, L, S] -> split the head axis like the queries
            mask = mask.reshape(mask.shape[0], -1, 1 if mask.shape[1] == 1 else group, length, span)
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.array(-float("inf"), scores.dtype))
        else:
            scores = scores + mask.astype(scores.dtype)
    weights = mx.softmax(scores, axis=-1, precise=True)
    return (weights @ values[:, :, None]).reshape(batch, heads, length, dim)


def route(queries, keys, values, cache, scale, mask, sinks=None):
    """mlx-lm's attention entry point, with the two CUDA cases above sent elsewhere."""
    if not _bypass and sinks is None and not hasattr(cache, "bits") and keys.dtype == queries.dtype:
        length = queries.shape[2]
        if length == 1:
            dim = queries.shape[-1]
            if (type(cache) is BatchKVCache and isinstance(mask, mx.array) and dim in HEAD_DIMS
                    and keys.shape[-1] == values.shape[-1] == dim and queries.shape[1] % keys.shape[1] == 0):
                if _gqa and gqa_decode_kernel.can_run(queries, keys, values):
                    return gqa_decode_kernel.gqa_decode_attention(queries, keys, values, cache.left_padding, scale)
                return masked_decode_attention(queries, keys, values, cache.left_padding, scale)
        elif length * keys.shape[2] <= OPS_MAX_SCORES:
            return ops_attention(queries, keys, values, scale, mask)
    return _mlx_lm_attention(queries, keys, values, cache, scale, mask, sinks)


@contextlib.contextmanager
def mlx_lm_only():
    """Within: every attention call takes mlx-lm's own path (for side-by-side checks)."""
    global _bypass
    _bypass = True
    try:
        yield
    finally:
        _bypass = False


def _enable_gqa() -> None:
    global _gqa
    try:
        error = gqa_decode_kernel.self_check()
    except Exception as exc:
        log.warning("GQA decode kernel unavailable (%s: %s); using the per-head kernel", type(exc).__name__, exc)
        return
    _gqa = error < 2e-2
    if not _gqa:
        log.warning("GQA decode kernel disagrees with MLX (max diff %g); using the per-head kernel", error)


def install() -> bool:
    """Route mlx-lm's attention through ``route`` (CUDA only); True when it is on.

    Call after the model is loaded: the model's module must already be imported."""
    global _installed
    if not _installed:
        if os.environ.get("MLXQ_CUDA_ATTENTION", "").lower() == "mlx" or not mx.cuda.is_available():
            return False
        try:
            error = self_check()
        except Exception as exc:  # no compiler, an unsupported GPU: MLX's path stays
            log.warning("decode attention kernel unavailable (%s: %s); using MLX's attention",
                        type(exc).__name__, exc)
            return False
        if not error < 2e-2:  # bf16 outputs of order 1: a few ulps
            log.warning("decode attention kernel disagrees with MLX (max diff %g); using MLX's attention", error)
            return False
        _installed = True
        log.info("CUDA attention routing on (decode kernel self-check max diff %.2g)", error)
        _enable_gqa()
    rebind(_mlx_lm_attention, route, include_base=True)
    return True
