"""Who gives way on a memory fault, and the fault hook's spec: plain data, no model."""

from __future__ import annotations

import pytest

from mlxq.engine.faults import Evaluator, FaultInjector, MemoryFault, is_allocation_failure, parse_fault_spec
from mlxq.engine.preempt import (
    MAX_PREEMPTIONS,
    RECOVER_AFTER_STEPS,
    LoadCaps,
    plan_decode_preemption,
    split_prefill_group,
)


def test_the_most_recently_admitted_rows_wait_and_the_cap_halves():
    plan = plan_decode_preemption([0] * 8, row_cap=8)
    assert plan.resume_first == (0, 1, 2, 3) and plan.held_back == (4, 5, 6, 7) and plan.row_cap == 4
    assert plan_decode_preemption([0] * 8, row_cap=2).resume_first == (0, 1)  # never above the current cap
    lone = plan_decode_preemption([0], row_cap=1)
    assert lone.resume_first == (0,) and lone.row_cap == 1


def test_a_row_preempted_too_often_fails_instead_of_looping():
    plan = plan_decode_preemption([MAX_PREEMPTIONS, 0, MAX_PREEMPTIONS - 1], row_cap=3)
    assert plan.failed == (0,) and plan.resume_first == (1,) and plan.held_back == (2,)


def test_a_failed_batched_prefill_keeps_the_older_half():
    assert split_prefill_group(8) == (4, 4)
    assert split_prefill_group(3) == (1, 2)
    assert split_prefill_group(1) == (1, 0)


def test_caps_grow_back_slowly_and_reset_when_the_batch_drains():
    caps = LoadCaps(max_rows=64, max_group=8)
    caps.lower_rows(16)
    caps.lower_group(2)
    assert caps.lowered and (caps.rows, caps.group) == (16, 2)
    for _ in range(RECOVER_AFTER_STEPS):
        caps.step_ok()
    assert (caps.rows, caps.group) == (18, 3)
    caps.lower_rows(40)  # lowering never raises a cap
    assert caps.rows == 18
    caps.reset()
    assert not caps.lowered


def test_fault_spec():
    assert parse_fault_spec("decode:3-4, prefill:2,decode:9") == {"decode": {3, 4, 9}, "prefill": {2}}
    assert parse_fault_spec("") == {}
    for bad in ("decode", "gpu:1", "decode:0", "decode:4-3", "decode:x"):
        with pytest.raises(ValueError, match="MLXQ_FAULT_INJECT"):
            parse_fault_spec(bad)


def test_mlx_allocation_messages_are_recognised():
    assert is_allocation_failure(RuntimeError("cudaMallocAsync(&data, size, stream) failed: out of memory"))
    assert is_allocation_failure(RuntimeError("[metal::malloc] Attempting to allocate 9 bytes which is greater"))
    assert is_allocation_failure(RuntimeError("[malloc] Unable to allocate 1024 bytes."))
    assert not is_allocation_failure(RuntimeError("[matmul] shapes (2,3) and (4,5) cannot be multiplied"))
    assert not is_allocation_failure(ValueError("out of memory"))  # MLX raises RuntimeError


def test_evaluator_retries_once_then_gives_up():
    calls = []
    evaluator = Evaluator(FaultInjector(parse_fault_spec("decode:1,decode:3-4")))
    assert evaluator.run("decode", lambda: calls.append(1) or "ok") == "ok"  # attempt 1 fails, 2 passes
    with pytest.raises(MemoryFault) as raised:
        evaluator.run("decode", lambda: calls.append(1))  # attempts 3 and 4 fail
    assert raised.value.site == "decode" and "out of memory" in str(raised.value.cause)
    assert len(calls) == 1
    counters = evaluator.counters
    assert (counters.memory_faults, counters.retried_ok) == (3, 1)
    with pytest.raises(ZeroDivisionError):  # anything else passes through untouched, at once
        evaluator.run("prefill", lambda: 1 / 0)


def test_the_newest_rows_give_way_before_a_step_passes_the_limit():
    from mlxq.engine.preempt import SHED_AT, rows_that_fit

    gb = 10**9
    # 16 GB of weights and 64 GB of KV over 64 rows; the next step adds a 2 GB block and 10 MB a row.
    assert rows_that_fit(80 * gb, 100 * gb, 64, 64 * gb, 2 * gb, 10**7) == 64  # fits: nobody moves
    keep = rows_that_fit(80 * gb, 84 * gb, 64, 64 * gb, 2 * gb, 10**7)
    assert 1 < keep < 64
    share = keep / 64
    assert 80 * gb - 64 * gb * (1 - share) + 2 * gb * share + 10**7 * keep <= 84 * gb * SHED_AT
    assert rows_that_fit(80 * gb, 10 * gb, 64, 64 * gb, 2 * gb, 10**7) == 1  # one row always runs
