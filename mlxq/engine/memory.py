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
from dataclasses import dataclass

AUTO_MAX_BYTES = 8 * 10**9
AUTO_MIN_BYTES = 256 * 2**20


def device_memory_bytes() -> int | None:
    """The default device's memory: the GPU's when MLX reports it, else the machine's RAM."""
    import mlx.core as mx

    info = mx.device_info() if hasattr(mx, "device_info") else {}
    size = info.get("total_memory") or info.get("memory_size")  # CUDA names it total_memory, Metal memory_size
    if size:
        return int(size)
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


# --- the device's share: MLX's memory and cache limits ----------------------------------------------
DEVICE_SHARE = 0.9  # of the device's memory, the most mlxq plans to use (CUDA context, libraries, pool slack)


@dataclass(frozen=True)
class DeviceMemory:
    """What the device holds and what is free, read once after the weights are loaded."""

    total: int | None  # the device's memory (the machine's RAM on the CPU)
    free: int | None  # free now, beside what this process already holds
    held: int  # what this process's MLX holds now (the weights, mostly)
    source: str  # "cuda", "metal" or "ram"


def read_device_memory() -> DeviceMemory:
    import mlx.core as mx

    info = mx.device_info() if hasattr(mx, "device_info") else {}
    held = mx.get_active_memory()
    if info.get("total_memory"):  # CUDA: free memory is fresh on every read
        return DeviceMemory(int(info["total_memory"]), int(info.get("free_memory") or 0) or None, held, "cuda")
    if info.get("memory_size"):  # Metal: unified memory; macOS's recommended working set is what is usable
        total = int(info["memory_size"])
        working_set = int(info.get("max_recommended_working_set_size") or total)
        return DeviceMemory(total, max(working_set - held, 0), held, "metal")
    return DeviceMemory(device_memory_bytes(), _ram_available(), held, "ram")


def _ram_available() -> int | None:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def usable_bytes(device: DeviceMemory, share: float = DEVICE_SHARE) -> int | None:
    """The memory mlxq plans with: its share of the device, and of what is free beside what it holds.

    The share applies to the free memory too: planning with all of it left no room for the
    CUDA context, library workspaces and the allocator's fragmentation (H200, 70 GB held by
    another process: real allocation failures with MLX's active memory 3 GB under the limit)."""
    if device.total is None:
        return None
    usable = int(device.total * share)
    if device.free is not None:
        usable = min(usable, device.held + int(device.free * share))
    return usable


@dataclass(frozen=True)
class MemoryLimits:
    """MLX's allocator limits, from the same arithmetic as the KV budget and the prompt cache.

    ``memory_limit``: MLX reclaims its buffer cache before active + cached memory
    passes it (and waits on running work before going over it). ``cache_limit``:
    freed buffers MLX keeps for reuse, at most the headroom the budgets leave for
    transients (prefill activations, attention scores, logits); without it, MLX's
    cache defaults to the memory limit and held 104.6 GB on a 143 GB H200 while
    the KV budget assumed it free.
    """

    memory_limit: int
    cache_limit: int
    transient_reserve: int  # usable - weights - prompt cache - KV budget (>= 0)


def plan_limits(usable: int, weights: int, prompt_cache: int, kv_budget: int | None) -> MemoryLimits:
    kv = kv_budget if kv_budget is not None else max(usable - weights - prompt_cache, 0)
    reserve = max(usable - weights - prompt_cache - kv, 0)
    return MemoryLimits(memory_limit=usable, cache_limit=max(AUTO_MIN_BYTES, reserve), transient_reserve=reserve)


def apply_limits(limits: MemoryLimits) -> None:
    import mlx.core as mx

    mx.set_memory_limit(limits.memory_limit)
    mx.set_cache_limit(limits.cache_limit)
