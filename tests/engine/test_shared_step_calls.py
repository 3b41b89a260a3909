"""``--shared-prefix-attention on`` costs rows that share nothing no host work per decode step.

Python function calls per steady decode step (cProfile: a count; the
fewest of four steps, so work on a timer does not count) of a batch of
rows on prompts of their own, with a prompt cache, are equal under ``on``
and ``off``; the model's attention is not routed through the
shared-prefix seam while no group runs.
"""

from __future__ import annotations

import cProfile
import pstats

import pytest
from mlx_lm.models import llama

from mlxq.engine.prefix_sharing import SharingPolicy
from mlxq.engine.scheduler import BatchScheduler, SchedulerConfig
from mlxq.engine.types import Request, SamplingParams
from mlxq.kv import attention_route
from mlxq.kv.projection import measure_footprint
from mlxq.kv.sharing_plan import plan_sharing
from mlxq.store.prompt_cache import PromptCache

ROWS = 4


@pytest.fixture(autouse=True)
def routed():
    yield
    attention_route.uninstall()


def calls_per_step(model, tokenizer, mode: str) -> tuple[int, bool]:
    """(calls in a steady decode step once every row joined, attention routed during those steps)."""
    policy = SharingPolicy(mode, plan_sharing(model) if mode != "off" else None)
    sched = BatchScheduler(model, tokenizer, measure_footprint(model), SchedulerConfig(ROWS, ROWS, 2048, None),
                           prompt_cache=PromptCache(1 << 30), sharing=policy)
    for i in range(ROWS):
        prompt = [1000 + (i * 31 + j * 7) % 5000 for j in range(32 + 8 * i)]
        sched.add(Request(f"r{i}", prompt, SamplingParams(), 8, ignore_eos=True), lambda e: None)
    while sched.num_rows < ROWS:
        sched.step()
    routed = llama.scaled_dot_product_attention is attention_route.route
    counts = []
    for _ in range(4):  # the fewest calls of four steps: work on a timer (stats, clocks) runs in some steps only
        profile = cProfile.Profile()
        profile.enable()
        sched.step()
        profile.disable()
        counts.append(pstats.Stats(profile).total_calls)
    assert sched.batch.groups == () and sched.sharing_stats.steps == 0
    return min(counts), routed


def test_on_without_a_group_costs_what_off_costs(load_tiny):
    model, tokenizer = load_tiny("llama")
    calls_per_step(model, tokenizer, "off")  # first uses in this process (lazy imports, caches) count once, here
    off, routed_off = calls_per_step(model, tokenizer, "off")
    on, routed_on = calls_per_step(model, tokenizer, "on")
    assert not routed_on and not routed_off
    assert on == off
