"""Which model and runtime a stored KV entry belongs to.

A cache entry is only valid for the exact weights, config and tokenizer that
produced it, computed by the same MLX build on the same kind of device (the
same weights give different KV bytes across MLX versions or backends, so a
runtime change must select another directory, not restore "nearly right"
state). The fingerprint hashes:

- config.json and the tokenizer files, byte for byte;
- for each weight shard: its name, size, and xxh3 of three 1 MiB samples
  (start, middle, end). Hashing every byte of a 16 GB model at start-up would
  cost seconds; a rebuilt or replaced shard changes its header or sampled
  data. In the Hugging Face cache a shard is a blob named by its content hash,
  and that name is used instead;
- the MLX version and the default device type.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import mlx.core as mx
import xxhash

_SAMPLE = 1 << 20
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt",
                    "chat_template.jinja")


def _shard_identity(path: Path) -> str:
    real = path.resolve()
    if real.parent.name == "blobs":  # HF cache: the blob's name is its content hash
        return real.name
    size = real.stat().st_size
    h = xxhash.xxh3_128()
    with open(real, "rb") as f:
        for at in sorted({0, max(0, size // 2 - _SAMPLE // 2), max(0, size - _SAMPLE)}):
            f.seek(at)
            h.update(f.read(_SAMPLE))
    return f"{size}:{h.hexdigest()}"


def file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def model_fingerprint(model_dir: Path) -> str:
    """A 16-hex-digit id of (weights, config, tokenizer, MLX runtime)."""
    parts: dict[str, str] = {
        "config": file_digest(model_dir / "config.json"),
        "mlx": mx.__version__,
        "device": str(mx.default_device().type),
    }
    for name in _TOKENIZER_FILES:
        if (model_dir / name).exists():
            parts[f"tokenizer/{name}"] = file_digest(model_dir / name)
    for shard in sorted(model_dir.glob("*.safetensors")):
        parts[f"weights/{shard.name}"] = _shard_identity(shard)
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def namespace_dir(namespace: str) -> str:
    """Directory name of a namespace (any string, so hashed)."""
    return hashlib.sha256(namespace.encode()).hexdigest()[:16]

