"""/stats.memory and /metrics: the device's memory, the plan made from it, and MLX's limits now."""

from __future__ import annotations


def memory_plan(engine) -> dict:
    """What the engine read at start-up and the limits it gave MLX (None before the model is loaded)."""
    import mlx.core as mx

    device, limits = engine.device_memory, engine.memory_limits
    ram = engine.prompt_cache
    return {
        "source": device.source if device else None,
        "device_total_bytes": device.total if device else None,
        "device_free_at_start_bytes": device.free if device else None,
        "held_at_start_bytes": device.held if device else None,  # the weights, once loaded
        "usable_bytes": engine.usable_memory,
        "prompt_cache_max_bytes": ram.max_bytes if ram is not None else 0,
        "kv_budget_bytes": engine.kv_budget_bytes,
        "transient_reserve_bytes": limits.transient_reserve if limits else None,
        "mlx_memory_limit_bytes": mx.get_memory_limit(),
        "mlx_cache_limit_bytes": limits.cache_limit if limits else None,
    }


def memory_gauges(engine) -> dict[str, float]:
    import mlx.core as mx

    limits = engine.memory_limits
    return {
        "memory_active_bytes": mx.get_active_memory(),
        "memory_cache_bytes": mx.get_cache_memory(),
        "memory_peak_bytes": mx.get_peak_memory(),
        "memory_limit_bytes": mx.get_memory_limit(),
        "memory_cache_limit_bytes": limits.cache_limit if limits else 0,
    }
