"""Split a loaded model across the group with mlx-lm's own ``shard()`` (tensor) or ``pipeline()``."""

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


def pipeline_model(model: Any, group: Any) -> None:
    """Keep only this rank's layers (mlx-lm's ``pipeline()``: rank 0 runs the last ones; every rank keeps
    the embeddings, the final norm and the head, and ends each forward with the last hidden state)."""
    inner = getattr(model, "model", None)
    kind = getattr(getattr(model, "args", None), "model_type", type(model).__module__)
    if not hasattr(inner, "pipeline"):
        raise NotShardableError(f"--pipeline-parallel: mlx-lm has no pipeline() for model type {kind!r}"
                                + (" (it has shard(): use --tensor-parallel)" if hasattr(model, "shard") else ""))
    if len(inner.layers) < group.size():
        raise NotShardableError(f"--pipeline-parallel {group.size()}: the model has {len(inner.layers)} layers")
    inner.pipeline(group)


