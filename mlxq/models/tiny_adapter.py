"""Random LoRA / DoRA adapters for a model directory, written the way mlx-lm writes them.

For tests and benchmarks: mlx-lm's own ``linear_to_lora_layers`` names the
layers and their shapes (on a model built from the config, no weights read),
and numpy's PCG64 fills them. Unlike a freshly initialised adapter, B is not
zero, so the adapter changes what the model says.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from mlxq.models.adapters import CONFIG_FILE, WEIGHTS_FILE

ALL_LINEAR_KEYS = None  # mlx-lm's default: every linear layer of each adapted block


def make_tiny_adapter(model_dir: Path, out_dir: Path, *, seed: int = 0, rank: int = 4, scale: float = 2.0,
                      kind: str = "lora", num_layers: int = -1, keys: list[str] | None = ALL_LINEAR_KEYS,
                      spread: float = 0.05) -> Path:
    """Write ``adapter_config.json`` + ``adapters.safetensors`` into ``out_dir``; returns it.

    ``num_layers`` -1 adapts every block; ``keys`` (mlx-lm's lora_parameters.keys, e.g.
    ["self_attn.q_proj"]) limits the layers, None means every linear layer; ``spread`` is
    the standard deviation of the random A and B entries."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import load_config, load_model

    config = load_config(Path(model_dir))
    model, _ = load_model(Path(model_dir), lazy=True)
    num_blocks = len(model.layers)
    lora_parameters = {"rank": rank, "scale": scale, "dropout": 0.0}
    if keys is not None:
        lora_parameters["keys"] = list(keys)
    layers = num_blocks if num_layers < 0 else num_layers
    linear_to_lora_layers(model, layers, lora_parameters, use_dora=kind == "dora")
    rng = np.random.Generator(np.random.PCG64(seed))
    weights = {}
    for name, value in tree_flatten(model.trainable_parameters()):
        leaf = name.rsplit(".", 1)[-1]
        if leaf in ("lora_a", "lora_b"):
            weights[name] = mx.array(rng.normal(0.0, spread, size=value.shape).astype(np.float32))
        elif leaf == "m":  # DoRA's magnitude: the base row norms, each moved by up to 10%
            norms = np.array(value.astype(mx.float32))
            weights[name] = mx.array((norms * rng.uniform(0.9, 1.1, size=norms.shape)).astype(np.float32))
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out_dir / WEIGHTS_FILE), weights)
    adapter_config = {"fine_tune_type": kind, "num_layers": layers, "lora_parameters": lora_parameters,
                      "model": config.get("model_type"), "seed": seed}
    (out_dir / CONFIG_FILE).write_text(json.dumps(adapter_config, indent=2) + "\n")
    return out_dir
