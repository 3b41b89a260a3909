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


def test_the_usable_share_is_bounded_by_what_is_free():
    from mlxq.engine.memory import DeviceMemory, usable_bytes

    h200 = DeviceMemory(total=143 * 10**9, free=130 * 10**9, held=16 * 10**9, source="cuda")
    assert usable_bytes(h200) == int(0.9 * 143 * 10**9)  # 128.7 GB: less than held + 90% of free (133 GB)
    shared = DeviceMemory(total=143 * 10**9, free=40 * 10**9, held=16 * 10**9, source="cuda")
    assert usable_bytes(shared) == 52 * 10**9  # another process holds the rest: 16 + 90% of 40
    assert usable_bytes(DeviceMemory(None, None, 0, "ram")) is None


def test_mlx_limits_come_from_the_budget_arithmetic():
    from mlxq.engine.memory import AUTO_MIN_BYTES, auto_kv_budget_bytes, auto_prompt_cache_bytes, plan_limits

    usable, weights = 128 * 10**9, 16 * 10**9
    cache = auto_prompt_cache_bytes(usable, weights)
    kv = auto_kv_budget_bytes(usable, weights, cache)
    limits = plan_limits(usable, weights, cache, kv)
    assert limits.memory_limit == usable
    assert limits.transient_reserve == usable - weights - cache - kv  # the 30% the KV budget leaves
    assert limits.cache_limit == limits.transient_reserve  # MLX's cache never holds the budgets' memory
    over = plan_limits(usable, weights, cache, 200 * 10**9)  # a KV budget above what fits: no reserve left
    assert over.transient_reserve == 0 and over.cache_limit == AUTO_MIN_BYTES


def test_prefill_transients_grow_with_rows_chunk_and_context():
    from mlxq.engine.transient import ModelShape, joiners_transient

    llama8b = ModelShape(hidden=4096, intermediate=14336, heads=32, vocab=128256, dtype_bytes=2)
    one = llama8b.prefill_step_bytes(1, 2048, 2048)
    assert 1.2e9 < one < 1.4e9  # activations 0.24 + logits 0.53 + scores 0.54 GB
    assert llama8b.prefill_step_bytes(1, 2048, 32768) > 8e9  # a long context's score matrix
    assert joiners_transient(llama8b, [150] * 8, 2048, 8) == llama8b.prefill_step_bytes(8, 150, 150)
    assert joiners_transient(llama8b, [30000, 150], 2048, 8) == llama8b.prefill_step_bytes(2, 2048, 30000)
    assert joiners_transient(None, [150], 2048, 8) == 0
