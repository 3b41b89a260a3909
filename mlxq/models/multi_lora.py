"""Many adapters on one set of base weights, rows of one batch each on its own adapter.

Each linear layer some adapter touches becomes a ``MultiLoRALinear``
(models/lora_linear.py; module replacement after load, mlx-lm's model files
are untouched). It holds the base layer once and every adapter's low-rank
pieces side by side (R: the sum of the adapters' ranks; adapter k owns
columns ``offsets[k]:offsets[k] + r_k`` of each shrink, zeros where it does
not touch the layer), each adapter's ``scale`` folded into B, all in the
base layer's dtype. Sibling layers that read one input (q/k/v, gate/up)
share one shrink (models/lora_shrink.py). What a forward computes comes from
the shared ``AdapterRouting`` (models/lora_routing.py), which the engine sets
around every model call (``adapter_rows``):

- every row on the base: the base layer alone (no cost);
- otherwise the base matmul once for all rows, with each row's own
  adapter's update: decode rows pick their adapter's A by one gathered
  matrix-vector product per sibling group, and a dense base's weight
  carries B, so ``[x | h]`` times it is the base product and the expand in
  one matmul. Mixing adapters costs what one adapter costs.

For the 1-4 adapters a server carries, R is a few dozen columns. On the
H200 the adapter step is host-bound (every node costs host time, a cuBLAS
matmul most): what a layer adds is counted in graph nodes and matmuls
(benchmarks.md, "LoRA adapters").
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from mlxq.models.adapters import LowRank
from mlxq.models.lora_linear import MultiLoRALinear
from mlxq.models.lora_routing import BASE, AdapterRouting, Route
from mlxq.models.lora_shrink import SharedShrink

__all__ = ["BASE", "AdapterRouting", "MultiLoRALinear", "Route", "SharedShrink", "adapter_names", "adapter_rows",
           "attach_adapters", "install_adapters"]

ROUTING_ATTRIBUTE = "mlxq_adapter_routing"  # set on the model object by install_adapters
# Layers the models (mlx-lm's) call on the same input object, one after another.
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("in_proj_qkvz", "in_proj_ba"))


def adapter_rows(model, names: Sequence[str]):
    """Context for a forward of ``model`` whose rows use these adapters ("" = none, in row order)."""
    routing = getattr(model, ROUTING_ATTRIBUTE, None)
    return nullcontext() if routing is None else routing.rows(names)


def adapter_names(model) -> list[str]:
    """The adapters installed on ``model``, in slot order (none: [])."""
    routing = getattr(model, ROUTING_ATTRIBUTE, None)
    return [] if routing is None else list(routing.slots)


def _compute_dtype(linear: nn.Module):
    """The dtype a linear layer computes in (a quantized layer's scales carry it)."""
    return linear.scales.dtype if isinstance(linear, nn.QuantizedLinear) else linear.weight.dtype


def install_adapters(model: nn.Module, names: Sequence[str], adapters: Sequence[dict[str, LowRank]]) -> AdapterRouting:
    """Replace every linear layer any adapter touches; the adapters' slots follow ``names``."""
    modules = dict(model.named_modules())
    paths = sorted({path for pieces in adapters for path in pieces})
    ranks = [next(iter(pieces.values())).lora_a.shape[1] for pieces in adapters]
    routing = AdapterRouting(names, ranks, _compute_dtype(modules[paths[0]]))
    replaced = []
    for group in _sibling_groups(paths, adapters):
        shrink = SharedShrink([_a_block([pieces.get(path) for pieces in adapters], routing) for path in group],
                              routing)
        for member, path in enumerate(group):
            replaced.append((path, MultiLoRALinear(modules[path], routing, [pieces.get(path) for pieces in adapters],
                                                   shrink, member)))
    model.update_modules(tree_unflatten(replaced))
    mx.eval(model.parameters())
    setattr(model, ROUTING_ATTRIBUTE, routing)
    return routing


def _sibling_groups(paths: list[str], adapters: Sequence[dict[str, LowRank]]) -> list[list[str]]:
    """Adapted layers that read one input: one of ``SIBLINGS`` under one parent module, one input
    width. (o_proj has q_proj's width and parent but reads the attention output: sharing with it
    would compute the group twice.) Any other layer is a group of its own."""
    groups: dict[tuple[str, int, str], list[str]] = {}
    for path in paths:
        piece = next(pieces[path] for pieces in adapters if path in pieces)
        parent, _, leaf = path.rpartition(".")
        kind = next((names[0] for names in SIBLINGS if leaf in names), leaf)
        groups.setdefault((parent, piece.lora_a.shape[0], kind), []).append(path)
    return list(groups.values())


def _a_block(pieces: Sequence[LowRank | None], routing: AdapterRouting) -> mx.array:
    """One layer's A for every adapter, ``[R, input_dims]`` (zeros where an adapter leaves the layer)."""
    in_dims = next(p for p in pieces if p is not None).lora_a.shape[0]
    return mx.concatenate([(p.lora_a.T if p else mx.zeros((r, in_dims))).astype(routing.dtype)
                           for p, r in zip(pieces, routing.ranks, strict=True)])


def attach_adapters(loaded, specs: Sequence) -> object:
    """The hook after load: serve ``specs`` (AdapterSpec) on ``loaded`` (models.loader.LoadedModel)."""
    from mlxq.models.adapters import check_adapter_dir, check_model_ids, read_adapter

    if not specs:
        return loaded
    check_model_ids([spec.name for spec in specs], loaded.name)
    infos = [check_adapter_dir(spec) for spec in specs]
    pieces = [read_adapter(loaded.model, info) for info in infos]
    install_adapters(loaded.model, [info.name for info in infos], pieces)
    loaded.adapters = {info.name: info for info in infos}
    return loaded
