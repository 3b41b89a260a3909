"""Adapters on a tensor-parallel model: each adapter split the way its base layer is.

The adapters are read at full size before the model is sharded (mlx-lm's
``load_adapters`` checks every shape against the whole layers), then each
rank keeps its part of every low-rank pair:

- a layer sharded on its outputs (q/k/v, gate/up: ``AllToShardedLinear``)
  sees the whole input and writes a slice of the outputs: the rank keeps the
  whole ``A`` and its slice of ``B``'s output axis;
- a layer sharded on its inputs (o_proj, down_proj: ``ShardedToAllLinear``)
  sees a slice of the input and all_sums its partial products: the rank keeps
  its slice of ``A``'s input axis, and its low-rank partial ``(x_r @ A_r) @ B``
  is added before the layer's all_sum. The sum over ranks of
  ``x_r @ A_r`` is ``x @ A`` (per-row masks of mixed batches scale columns,
  so they commute with it): exact, as the base layer's own split is.

Layers no adapter touches stay mlx-lm's. DoRA is refused: its magnitude
divides by the norm of whole weight rows, which no rank holds.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import AllToShardedLinear, ShardedToAllLinear
from mlx.utils import tree_unflatten

from mlxq.models.adapters import AdapterError, AdapterInfo, LowRank, check_adapter_dir, check_model_ids, read_adapter
from mlxq.models.multi_lora import install_adapters


class PartialLinear(nn.Module):
    """A ``ShardedToAllLinear``'s own product, before its all_sum and bias."""

    def __init__(self, sharded: ShardedToAllLinear):
        super().__init__()
        self.weight = sharded.weight

    def __call__(self, x: mx.array) -> mx.array:
        return x @ self.weight.T


class SumAcrossRanks(nn.Module):
    """``inner``'s partial products (base and low-rank) summed over the ranks, then the bias."""

    def __init__(self, inner: nn.Module, group, bias: mx.array | None):
        super().__init__()
        self.inner = inner
        self.group = group
        if bias is not None:
            self.bias = bias

    def __call__(self, x: mx.array) -> mx.array:
        out = mx.distributed.all_sum(self.inner(x), group=self.group)
        return out + self.bias if "bias" in self else out


def read_full_adapters(model, specs: Sequence) -> tuple[list[AdapterInfo], list[dict[str, LowRank]]]:
    """Every ``--adapter`` read against the whole (not yet sharded, lazy) model."""
    infos = [check_adapter_dir(spec) for spec in specs]
    for info in infos:
        if info.kind != "lora":
            raise AdapterError(f"--adapter {info.name}: {info.kind} adapters are not available with "
                               "--tensor-parallel (only LoRA splits across ranks)")
    return infos, [read_adapter(model, info) for info in infos]


def install_sharded_adapters(model, infos: Sequence[AdapterInfo], pieces: Sequence[dict[str, LowRank]],
                             group, model_name: str) -> None:
    """Install ``pieces`` (full size) on the sharded ``model``: each rank's parts, summed where its layer sums."""
    check_model_ids([info.name for info in infos], model_name)
    modules = dict(model.named_modules())
    split = [{path: _rank_part(path, modules[path], piece, group) for path, piece in adapter.items()}
             for adapter in pieces]
    install_adapters(model, [info.name for info in infos], split)
    adapted = dict(model.named_modules())
    wrapped = []
    for path in sorted({path for adapter in pieces for path in adapter}):
        base = modules[path]
        if isinstance(base, ShardedToAllLinear):
            multi = adapted[path]
            multi.base = PartialLinear(base)
            wrapped.append((path, SumAcrossRanks(multi, base.group, base.get("bias"))))
    model.update_modules(tree_unflatten(wrapped))


def _rank_part(path: str, layer: nn.Module, piece: LowRank, group) -> LowRank:
    rank, size = group.rank(), group.size()
    if isinstance(layer, AllToShardedLinear):
        width = piece.lora_b.shape[1] // size
        return LowRank(piece.lora_a, piece.lora_b[:, rank * width:(rank + 1) * width], piece.scale, None)
    if isinstance(layer, ShardedToAllLinear):
        width = piece.lora_a.shape[0] // size
        return LowRank(piece.lora_a[rank * width:(rank + 1) * width], piece.lora_b, piece.scale, None)
    if type(layer) is nn.Linear:
        return piece  # not split: every rank computes it whole
    raise AdapterError(f"{path}: a {type(layer).__name__} layer cannot take an adapter with --tensor-parallel "
                       "(quantized sharded layers are not supported)")
