"""The SSD tier's settings (no MLX import: the server's config is built before MLX loads)."""

from __future__ import annotations

import re
from dataclasses import dataclass

CHECKPOINT_DIR = "checkpoints"  # beside the namespace directories: generation checkpoints, one file per request key
_RANK_DIR = re.compile(r"(?:tp|pp)(\d+)-rank(\d+)")
_MODE_PREFIX = {"tensor": "tp", "pipeline": "pp"}


def rank_dir(rank: int, size: int, mode: str = "tensor") -> str:
    """Where rank ``rank`` of ``size`` keeps its part of every entry, beside the namespace directories:
    DIR/<fingerprint>-<scheme>/tp<size>-rank<rank>/<namespace>/<digest>.mlxkv (tensor parallel: its share
    of every layer's KV heads), or ``pp<size>-rank<rank>`` (pipeline parallel: its own layers' KV)."""
    return f"{_MODE_PREFIX[mode]}{size}-rank{rank}"


def parse_rank_dir(name: str) -> tuple[int, int] | None:
    """(rank, size) of a rank directory's name; None for any other directory."""
    match = _RANK_DIR.fullmatch(name)
    if match is None:
        return None
    size, rank = int(match.group(1)), int(match.group(2))
    return (rank, size) if 0 <= rank < size else None


@dataclass(frozen=True)
class SsdConfig:
    """--ssd-cache and its sub-flags."""

    directory: str
    max_bytes: int | None = None  # None: unlimited
    verify: bool = False  # check every tensor checksum at start-up (restores always check)
    demote_idle_s: float = 300.0
    spill_queue_bytes: int = 2 * 2**30
    write_behind: bool = True
    checkpoint_interval: int = 256  # tokens between generation checkpoints (store/checkpoints.py); 0 = off

    def __post_init__(self):
        if self.max_bytes is not None and self.max_bytes <= 0:
            raise ValueError("ssd_cache_max must be > 0")
        if self.demote_idle_s < 0:
            raise ValueError("ssd_demote_idle must be >= 0")
        if self.checkpoint_interval < 0:
            raise ValueError("checkpoint_interval must be >= 0")
