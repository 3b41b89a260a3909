"""The attention seam on every backend: mlx-lm's models call one function, this decides where it runs.

Every mlx-lm model module imports ``scaled_dot_product_attention`` from
``mlx_lm.models.base`` and calls it as ``(queries, keys, values, cache=,
scale=, mask=)``. ``install()`` rebinds that name in each loaded model
module to ``route``, with no change to mlx-lm's files:

- a SharedPrefixBatchCache layer runs its ``attend`` (the shared prefix read
  once for the group; any backend), and so does a PackedTailsCache (the
  tails' forward with one position per row, kv/packed_tails.py);
- everything else goes where it went before: kv/cuda_attention.py's router
  when that is installed (CUDA), kv/cpu_attention.py's on the CPU backend,
  else mlx-lm's own function.

mlx-lm's quantized attention scales its ``queries`` argument in place
(``queries *= scale``): ``route`` hands it a fresh array object, so no
caller ever sees its queries scaled.

The batch lane routes only while its batch holds a group (``use_shared``,
set on every change of ``RunningBatch.groups``): with no group the model's
attention calls are exactly those of ``off``, with no extra call per layer.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models import base

from mlxq.kv import cpu_attention, cuda_attention, shared_prefix_decode
from mlxq.kv.model_modules import model_modules
from mlxq.kv.packed_tails import PackedTailsCache
from mlxq.kv.shared_prefix_cache import SharedPrefixBatchCache

_mlx_lm_attention = base.scaled_dot_product_attention
_routing = False  # ``install`` ran and ``uninstall`` did not since


def route(queries, keys, values, cache, scale, mask, sinks=None):
    if isinstance(cache, (SharedPrefixBatchCache, PackedTailsCache)):
        return cache.attend(queries, keys, values, scale, sinks)
    if hasattr(cache, "bits"):
        queries = mx.array(queries)  # the quantized path's in-place scaling stays on this copy
    return _previous()(queries, keys, values, cache, scale, mask, sinks)


def _previous():
    """The entry point the modules had before ``install``: a backend's router, else mlx-lm's own."""
    if cuda_attention._installed:
        return cuda_attention.route
    return cpu_attention.route if cpu_attention._installed else _mlx_lm_attention


def install(check: bool = True) -> None:
    """Route every loaded mlx-lm model module's attention through ``route`` (idempotent).

    Call after the model is loaded: its module must already be imported. On CUDA this also
    turns on the shared-prefix decode kernels once their self-checks pass (``check``; once per
    process: kv/sharing_plan.py runs them itself, on the layout its probe read)."""
    global _routing
    _routing = True
    if check:
        shared_prefix_decode.enable()
    for module in model_modules():
        if module.scaled_dot_product_attention in (_mlx_lm_attention, cuda_attention.route, cpu_attention.route):
            module.scaled_dot_product_attention = route


def uninstall() -> None:
    """Give each module back the function it had (the CUDA router where that is installed)."""
    global _routing
    _routing = False
    previous = _previous()
    for module in model_modules():
        if module.scaled_dot_product_attention is route:
            module.scaled_dot_product_attention = previous



def use_shared(groups: bool) -> None:
    """Route while some shared-prefix group runs, and not otherwise (decided per batch change)."""
    if groups != _routing:
        install() if groups else uninstall()
