"""Model loading (local dir / HF cache, offline), the tiny-model factory, the embedded default."""

from mlxq.models.loader import LoadedModel, ModelNotFoundError, load_model, resolve_model_path

__all__ = ["LoadedModel", "ModelNotFoundError", "load_model", "resolve_model_path"]
