"""``--model random:PRESET[:ARCH]``: a benchmarking model whose random weights are drawn in memory, never on disk.

A Llama-3-70B shape in bf16 is ~141 GB of weights: more than a two-GPU
machine's disk may hold, and minutes to write and read back. This spec
draws the weights where they are used instead. mlx-lm builds the model
class from the preset's config (lazily: nothing is allocated), every
parameter is replaced by the tiny-model factory's MLX draw of it (a
generator keyed by (seed, model type, parameter name): identical weights on
every rank and in every process, and the same bytes as ``mlxq model tiny
--preset PRESET --fast-init`` builds on the same device); under tensor
parallelism mlx-lm's ``shard()`` then slices the still-lazy weights, and the
model is evaluated one layer at a time, so a rank's peak memory is its own
share plus about one whole layer.

The config, the tokenizer (the factory's) and a manifest are written once to
a directory under the system's temp directory, which the rest of mlxq treats
as the model's directory (identity checks between ranks, the SSD tier's
fingerprint). The output is meaningless text: this is for speed and memory
measurements only.
"""

from __future__ import annotations

import json
import tempfile
import zlib
from pathlib import Path

from mlxq.models.presets import make_config
from mlxq.models.tiny import FACTORY_VERSION, MANIFEST, fast_param, write_model_dir

PREFIX = "random:"
SEED = 0


def is_random_spec(spec: str) -> bool:
    return spec.startswith(PREFIX)


def draws_weights(path: Path) -> bool:
    """Is ``path`` a directory from ``random_model_dir`` (its weights drawn at load)?"""
    manifest = Path(path) / MANIFEST
    return manifest.exists() and json.loads(manifest.read_text()).get("drawn_at_load") is True


def parse_random_spec(spec: str) -> tuple[str, str]:
    """(arch, preset) of ``random:PRESET[:ARCH]`` (ARCH defaults to llama); ValueError names the choices."""
    preset, _, arch = spec.removeprefix(PREFIX).partition(":")
    arch = arch or "llama"
    make_config(arch, preset)  # raises on an unknown arch or preset, naming the known ones
    return arch, preset


def random_model_dir(spec: str) -> Path:
    """The directory standing for ``spec``: config.json, tokenizer files, manifest; no weights."""
    arch, preset = parse_random_spec(spec)
    out = Path(tempfile.gettempdir()) / "mlxq-random" / f"{arch}-{preset}-seed{SEED}-v{FACTORY_VERSION}-drawn"
    if (out / MANIFEST).exists():
        return out
    manifest = {"name": f"random-{preset}-{arch}", "arch": arch, "preset": preset, "seed": SEED, "init": "mlx",
                "factory_version": FACTORY_VERSION, "drawn_at_load": True,
                "note": "random weights drawn in memory at load (--model random:...); output is meaningless text"}
    return write_model_dir(out, make_config(arch, preset), manifest)  # several ranks may race: same bytes


def load_random(path: Path, tokenizer_config: dict | None):
    """(model with lazy random weights, tokenizer, config) for a directory from ``random_model_dir``."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model, load_tokenizer

    model, config = load_model(path, lazy=True, strict=False)
    model_type = config["model_type"]
    unit_norm = 0.0 if model_type.startswith("gemma") else 1.0
    dtype = getattr(mx, config["torch_dtype"])
    draws = [(name, fast_param(name, tuple(p.shape), [SEED, zlib.crc32(model_type.encode()),
                                                        zlib.crc32(name.encode())], unit_norm, dtype))
             for name, p in tree_flatten(model.parameters())]
    model.load_weights(draws)
    tokenizer = load_tokenizer(path, tokenizer_config, eos_token_ids=config.get("eos_token_id"))
    return model, tokenizer, config


def eval_by_layer(model) -> None:
    """Materialize the weights one layer at a time (each draw's transient is one tensor of one layer)."""
    import mlx.core as mx

    for layer in getattr(model, "layers", []):
        if layer is not None:  # a pipeline rank's layers of other ranks
            mx.eval(layer.parameters())
    mx.eval(model.parameters())
