"""Split a loaded model across the tensor-parallel group with mlx-lm's own ``shard()``."""

from __future__ import annotations

from typing import Any


class NotShardableError(ValueError):
    """The model has no tensor-parallel ``shard()`` in mlx-lm."""


def shard_model(model: Any, group: Any) -> None:
    """Shard ``model`` in place (weights still lazy: each rank then reads only its slices)."""
    if not hasattr(model, "shard"):
        kind = getattr(getattr(model, "args", None), "model_type", type(model).__module__)
        raise NotShardableError(f"--tensor-parallel: mlx-lm has no shard() for model type {kind!r} "
                                "(pipeline parallelism is not available yet)")
    model.shard(group)
