"""Split a loaded model across the tensor-parallel group with mlx-lm's own ``shard()``."""

from __future__ import annotations

from typing import Any


class NotShardableError(ValueError):
    """The model has no tensor-parallel ``shard()`` in mlx-lm."""


def check_shardable(model: Any, size: int) -> None:
    """Refuse a model mlx-lm cannot split ``size`` ways: no ``shard()``, or heads that do not divide."""
    args = getattr(model, "args", None)
    kind = getattr(args, "model_type", type(model).__module__)
    if not hasattr(model, "shard"):
        raise NotShardableError(f"--tensor-parallel: mlx-lm has no shard() for model type {kind!r} "
                                "(pipeline parallelism is not available yet)")
    for name in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(args, name, None)
        if isinstance(heads, int) and heads % size:
            raise NotShardableError(f"--tensor-parallel {size}: the model's {name} ({heads}) does not divide "
                                    f"into {size} ranks")


def shard_model(model: Any, group: Any) -> None:
    """Shard ``model`` in place (weights still lazy: each rank then reads only its slices)."""
    check_shardable(model, group.size())
    model.shard(group)
