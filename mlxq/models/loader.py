"""Resolve and load a model: a local directory or a repo id in the local HF cache.

Loading is always offline. A repo id that is not in the Hugging Face cache is
an error that names every place we looked, never a download attempt.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlxq.models.random_model import draws_weights, eval_by_layer, is_random_spec, load_random, random_model_dir
from mlxq.models.tiny import read_manifest


class ModelNotFoundError(FileNotFoundError):
    """The model spec names nothing loadable on this machine."""


@dataclass
class LoadedModel:
    """A model ready for the engine; created once at start-up."""

    model: Any  # the mlx-lm nn.Module
    tokenizer: Any  # mlx_lm TokenizerWrapper
    config: dict  # config.json as loaded by mlx-lm
    path: Path  # the directory the weights came from
    name: str  # the id /v1/models reports
    description: str  # one line for logs: what this model is
    adapters: dict = field(default_factory=dict)  # model id -> models.adapters.AdapterInfo (--adapter)

    @property
    def vocab_size(self) -> int:
        """Width of the model's output layer (may exceed the tokenizer's vocabulary)."""
        return int(self.config.get("vocab_size") or self.config.get("text_config", {})["vocab_size"])

    @property
    def context_length(self) -> int | None:
        """The longest sequence the model was configured for, when it says."""
        for key in ("max_position_embeddings", "max_sequence_length", "n_positions"):
            value = self.config.get(key) or self.config.get("text_config", {}).get(key)
            if value:
                return int(value)
        return None


def _hf_cache_dir() -> Path:
    from huggingface_hub.constants import HF_HUB_CACHE

    return Path(HF_HUB_CACHE)


def resolve_model_path(spec: str) -> Path:
    """Map a local path or a cached HF repo id to a directory, offline (``random:...``: models/random_model.py)."""
    if is_random_spec(spec):
        try:
            return random_model_dir(spec)
        except ValueError as exc:
            raise ModelNotFoundError(f"--model {spec}: {exc}") from None
    local = Path(spec).expanduser()
    if local.is_file():
        raise ModelNotFoundError(f"{local} is a file; pass the directory that holds it ({local.parent})")
    if local.is_dir():
        if not (local / "config.json").exists():
            raise ModelNotFoundError(f"{local} is a directory but has no config.json")
        return local
    looked = [str(local.resolve())]
    if spec.count("/") == 1 and not spec.startswith((".", "/", "~")):
        from huggingface_hub import try_to_load_from_cache

        looked.append(f"Hugging Face cache {_hf_cache_dir()}")
        # The snapshot that holds the repo's config.json at its main ref. Not snapshot_download
        # (local_files_only): it refuses a snapshot fetched with file patterns, which is how a
        # model is usually fetched (`mlxq model pull`, `hf download --include ...`).
        config = try_to_load_from_cache(spec, "config.json")
        if isinstance(config, str):
            return Path(config).parent
    raise ModelNotFoundError(
        f"model {spec!r} not found; looked in: {'; '.join(looked)}. `mlxq serve` never downloads: "
        "pass a local model directory, or fetch the repo first, e.g. "
        "`mlxq model pull mlx-community/Qwen3-4B-4bit` (or `hf download mlx-community/Qwen3-4B-4bit`)"
    )


def load_model(spec: str, *, name: str | None = None, chat_template: str | None = None,
               shard: Callable[[Any], None] | None = None) -> LoadedModel:
    """Load weights + tokenizer through mlx-lm's loader; ``chat_template`` (Jinja text) replaces the
    model's own, as mlx_lm.server's --chat-template does. ``shard`` splits the model in place before
    its weights are read (tensor parallel: each rank then holds only its slices)."""
    import mlx.core as mx
    import mlx_lm

    path = resolve_model_path(spec)
    # Belt and braces: nothing below may reach the network.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    tokenizer_config = {"chat_template": chat_template} if chat_template is not None else None
    drawn = draws_weights(path)
    if drawn:
        model, tokenizer, config = load_random(path, tokenizer_config)
    else:
        model, tokenizer, config = mlx_lm.load(str(path), tokenizer_config=tokenizer_config, return_config=True,
                                               lazy=shard is not None)
    if shard is not None:
        shard(model)
    if drawn:
        eval_by_layer(model)  # a layer's draws at a time: the peak stays near this process's share
    elif shard is not None:
        mx.eval(model.parameters())
    manifest = read_manifest(path)
    if manifest:
        model_name = name or manifest["name"]
        what = (
            f"{manifest['name']}: {manifest['num_params'] / 1e6:.1f}M-parameter {manifest['arch']} "
            f"with random weights (mlxq tiny-model factory, seed {manifest['seed']})"
        )
    else:
        model_name = name or spec
        what = f"{config.get('model_type', '?')} model from {path}"
    return LoadedModel(model, tokenizer, config, path, model_name, what)
