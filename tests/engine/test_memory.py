"""The automatic RAM prompt-cache size: a quarter of what the weights leave, within [256 MiB, 8 GB]."""

from __future__ import annotations

from mlxq.engine.memory import AUTO_MAX_BYTES, AUTO_MIN_BYTES, auto_prompt_cache_bytes, device_memory_bytes


def test_auto_size_follows_the_memory_the_weights_leave():
    assert auto_prompt_cache_bytes(16 * 10**9, 10 * 10**9) == 1.5 * 10**9  # an 8B bf16 model on 16 GB
    assert auto_prompt_cache_bytes(128 * 10**9, 16 * 10**9) == AUTO_MAX_BYTES
    assert auto_prompt_cache_bytes(10**9, 2 * 10**9) == AUTO_MIN_BYTES  # weights larger than memory
    assert auto_prompt_cache_bytes(None, 10**9) == AUTO_MAX_BYTES


def test_this_machine_reports_its_memory():
    total = device_memory_bytes()
    assert total is not None and total > 10**9


def test_auto_kv_budget_is_what_weights_and_cache_leave():
    from mlxq.engine.memory import auto_kv_budget_bytes

    assert auto_kv_budget_bytes(16 * 10**9, 4 * 10**9, 2 * 10**9) == int(0.7 * 10 * 10**9)
    assert auto_kv_budget_bytes(4 * 10**9, 5 * 10**9, 10**9) == AUTO_MIN_BYTES
    assert auto_kv_budget_bytes(None, 10**9, 10**9) is None
