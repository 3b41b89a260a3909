"""Where goldens live: goldens/<suite>.json, overridden per machine by goldens/<machine>/<suite>.json."""

from __future__ import annotations

import json
import platform
from pathlib import Path

GOLDENS_DIR = Path(__file__).resolve().parents[2] / "goldens"


def machine_key() -> str:
    """Names what can change float results: OS, CPU arch, MLX device, BLAS."""
    import mlx.core as mx

    from mlxq.blas import active

    device = "gpu" if mx.default_device() == mx.gpu else "cpu"
    return f"{platform.system().lower()}-{platform.machine()}-{device}-{active().name}"


def golden_path(suite: str, root: Path = GOLDENS_DIR, machine: str | None = None) -> Path:
    return (root / machine / f"{suite}.json") if machine else (root / f"{suite}.json")


def load_goldens(suite: str, root: Path = GOLDENS_DIR) -> tuple[dict, Path]:
    """The machine's own override when present, else the shared file."""
    override = golden_path(suite, root, machine_key())
    path = override if override.exists() else golden_path(suite, root)
    return json.loads(path.read_text()), path
