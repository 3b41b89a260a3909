"""The batch lane's checkpoint pacing: a byte budget (a token bucket that may go into debt, never beyond
its burst), and due rows spread over steps."""

from __future__ import annotations

import pytest

from mlxq.engine.checkpoint_budget import ByteBudget
from mlxq.engine.checkpoint_rows import SPREAD_STEPS, publishes_per_step


def test_the_bucket_starts_full_allows_a_publish_into_debt_and_refills_at_its_rate():
    budget = ByteBudget(rate=100.0, burst_s=2.0, at=0.0)
    assert budget.allows(0.0) and budget.credit == 200
    budget.spend(500)  # larger than the bucket: it still gets its turn, then the lane waits
    assert not budget.allows(1.0) and budget.credit == -200
    assert not budget.allows(2.9)
    assert budget.allows(4.0) and budget.credit == pytest.approx(100)
    assert budget.allows(1000.0) and budget.credit == 200  # idle time fills it to its burst, not beyond


def test_small_publishes_never_wait():
    """The tiny models' checkpoints (kilobytes every few tokens) stay far inside the default budget."""
    budget = ByteBudget(at=0.0)
    for step in range(1000):
        assert budget.allows(step * 0.01)
        budget.spend(200_000)


def test_a_batch_that_reaches_its_interval_at_once_publishes_over_eight_steps():
    assert SPREAD_STEPS == 8
    for rows in (1, 2, 8, 9, 32, 64, 100):
        per_step = publishes_per_step(rows)
        assert per_step >= 1 and per_step * SPREAD_STEPS >= rows > (per_step - 1) * SPREAD_STEPS
