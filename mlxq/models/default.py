"""The embedded default model: what `mlxq serve` runs when no --model is given.

It is built by the tiny-model factory on first use (about a second) into the
user's cache directory and reused afterwards, so it needs no download.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from mlxq.models.presets import make_config
from mlxq.models.tiny import FACTORY_VERSION, build_tiny_model, read_manifest

DEFAULT_ARCH = "llama"
DEFAULT_PRESET = "default"
DEFAULT_SEED = 0


def cache_root() -> Path:
    base = os.environ.get("MLXQ_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "mlxq"
    )
    return Path(base)


def ensure_default_model() -> Path:
    """The default model's directory, built if missing or from an older factory.

    The directory name carries a digest of the config, so changing a preset's
    shape builds a new model instead of reusing a stale one.
    """
    config = json.dumps(make_config(DEFAULT_ARCH, DEFAULT_PRESET), sort_keys=True).encode()
    digest = hashlib.sha256(config).hexdigest()[:8]
    name = f"{DEFAULT_PRESET}-{DEFAULT_ARCH}-s{DEFAULT_SEED}-f{FACTORY_VERSION}-{digest}"
    path = cache_root() / "models" / name
    manifest = read_manifest(path) if path.exists() else None
    if manifest is None or manifest.get("factory_version") != FACTORY_VERSION:
        build_tiny_model(DEFAULT_ARCH, path, seed=DEFAULT_SEED, preset=DEFAULT_PRESET, force=True)
    return path
