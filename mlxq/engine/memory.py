"""How much memory the machine has, and the defaults derived from it.

- ``--prompt-cache auto``: a quarter of what the weights leave of the
  device's memory, at most 8 GB and at least 256 MiB (a fixed 8 GB is too
  much next to an 8B model on a 16 GB Mac).
- ``--kv-budget auto``: 70% of what the weights and the prompt cache leave,
  so a burst of long requests queues instead of exhausting memory (the rest
  is headroom for activations, prefill transients and the allocator).
"""

from __future__ import annotations

import os

AUTO_MAX_BYTES = 8 * 10**9
AUTO_MIN_BYTES = 256 * 2**20


def device_memory_bytes() -> int | None:
    """The default device's memory: the GPU's when MLX reports it, else the machine's RAM."""
    import mlx.core as mx

    info = mx.device_info() if hasattr(mx, "device_info") else {}
    if info.get("memory_size"):
        return int(info["memory_size"])
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def weight_bytes(model) -> int:
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def auto_prompt_cache_bytes(total_memory: int | None, weights: int) -> int:
    if total_memory is None:
        return AUTO_MAX_BYTES
    return int(max(AUTO_MIN_BYTES, min(AUTO_MAX_BYTES, max(total_memory - weights, 0) // 4)))


KV_BUDGET_SHARE = 0.7


def auto_kv_budget_bytes(total_memory: int | None, weights: int, prompt_cache: int) -> int | None:
    """None (unlimited) when the device's memory is unknown."""
    if total_memory is None:
        return None
    return int(max(AUTO_MIN_BYTES, KV_BUDGET_SHARE * max(total_memory - weights - prompt_cache, 0)))
