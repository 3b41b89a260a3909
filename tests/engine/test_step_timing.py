"""The decode-step split (/stats.batch.decode_timing): parts add up, cycles skip interruptions."""

from __future__ import annotations

import pytest

from mlxq.engine.scheduler import BatchScheduler, SchedulerConfig
from mlxq.engine.types import Request, SamplingParams
from mlxq.kv.projection import measure_footprint


def _scheduler(load_tiny, token0_in_decode: bool = True) -> tuple[BatchScheduler, object]:
    model, tokenizer = load_tiny("llama")
    config = SchedulerConfig(8, 4, 2048, None, token0_in_decode=token0_in_decode)
    return BatchScheduler(model, tokenizer, measure_footprint(model), config), tokenizer


def _run(scheduler: BatchScheduler, steps_before_second: int | None, tokenizer) -> None:
    scheduler.add(Request("a", tokenizer.encode("A first prompt."), SamplingParams(), 24, ignore_eos=True),
                  lambda e: None)
    n = 0
    while not scheduler.is_idle:
        if n == steps_before_second:
            scheduler.add(Request("b", tokenizer.encode("A second prompt, later."), SamplingParams(), 8,
                                  ignore_eos=True), lambda e: None)
        scheduler.step()
        n += 1


@pytest.mark.parametrize("token0_in_decode", [True, False])
def test_one_row_every_step_is_a_cycle_and_the_parts_add_up(load_tiny, token0_in_decode):
    scheduler, tokenizer = _scheduler(load_tiny, token0_in_decode)
    _run(scheduler, None, tokenizer)
    timing = scheduler.timing
    # A step emits the token the step before computed, so 24 tokens take 24 steps (the last
    # one computes a token nobody needs); computing token 0 in a decode step adds that step.
    steps = 24 + token0_in_decode
    assert timing.steps == steps
    # The first step shares its iteration with the prefill; every later one follows a step.
    assert timing.cycles == timing.steps - 1
    parts = timing.build_s + timing.submit_s + timing.device_wait_s
    assert 0 < parts <= timing.step_s
    doc = timing.as_dict()
    assert doc["steps"] == steps and doc["output_ms"] >= 0
    assert abs(doc["step_ms"] - 1000 * timing.step_s / steps) < 1e-3
    assert doc["cycle_ms"] >= doc["step_ms"] * 0.5


def test_a_joiner_prefilling_between_steps_is_not_counted_as_a_cycle(load_tiny):
    scheduler, tokenizer = _scheduler(load_tiny)
    _run(scheduler, 5, tokenizer)
    timing = scheduler.timing
    assert timing.steps >= 24
    # The step that ran the second prompt's prefill and its successor's gap are left out.
    assert timing.cycles == timing.steps - 2


def test_an_idle_scheduler_reports_no_split(load_tiny):
    scheduler, _ = _scheduler(load_tiny)
    doc = scheduler.timing.as_dict()
    assert doc["steps"] == 0 and doc["step_ms"] is None and doc["cycle_ms"] is None


def test_prefill_and_joins_are_timed_and_shares_add_up(load_tiny):
    scheduler, tokenizer = _scheduler(load_tiny)
    _run(scheduler, 5, tokenizer)
    phases = scheduler.phases
    # Two short prompts: one prefill chunk each (in different steps), one join each.
    assert phases.prefill_iterations == 2 and phases.joins == 2
    assert phases.prefill_s > 0 and phases.join_s > 0
    doc = phases.as_dict(scheduler.timing)
    assert abs(sum(doc["busy_share"].values()) - 1) < 1e-3
    assert doc["busy_share"]["decode"] > 0
    # Each prompt prefilled alone: no batched forward, no padding share to report.
    assert doc["batched_prefill"] == {"forwards": 0, "tokens": 0, "positions": 0, "padding_share": None}


@pytest.mark.parametrize("token0_in_decode", [True, False])
def test_a_batched_prefill_counts_its_prompt_tokens_and_the_padded_grid(load_tiny, token0_in_decode):
    """Three fresh prompts of 5, 9 and 3 tokens prefill together: one forward of every prompt but its
    last token (4 + 8 + 2), left-padded to the longest (3 rows x 8 positions)."""
    scheduler, _ = _scheduler(load_tiny, token0_in_decode)
    for i, prompt in enumerate([list(range(10, 15)), list(range(100, 109)), [3, 4, 5]]):
        scheduler.add(Request(f"r{i}", prompt, SamplingParams(), 3, ignore_eos=True), lambda e: None)
    while not scheduler.is_idle:
        scheduler.step()
    assert scheduler.phases.prefill_iterations == 1
    assert scheduler.phases.as_dict(scheduler.timing)["batched_prefill"] == {
        "forwards": 1, "tokens": 14, "positions": 24, "padding_share": round(1 - 14 / 24, 4)}
