"""The SSD tier's settings (no MLX import: the server's config is built before MLX loads)."""

from __future__ import annotations

from dataclasses import dataclass

CHECKPOINT_DIR = "checkpoints"  # beside the namespace directories: generation checkpoints, one file per request key


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
