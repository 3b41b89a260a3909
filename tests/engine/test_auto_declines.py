"""``--shared-prefix-attention auto`` says in /stats why it left agents on one prefix ungrouped.

Where ``on`` would group rows on a stored prefix and ``auto``'s gate
(``shared_prefix_decode.worth_sharing``) says no, each such join is
counted and its reason kept (``SharingStats.auto_declined``): on the CPU
the kernels are off; with them on, a group below the measured group
tokens. Rows that share nothing are not counted.
"""

from __future__ import annotations

import pytest

from mlxq.engine.prefix_sharing import SharingPolicy
from mlxq.engine.scheduler import BatchScheduler, SchedulerConfig
from mlxq.engine.types import Request, SamplingParams
from mlxq.kv import attention_route, shared_prefix_decode
from mlxq.kv.projection import measure_footprint
from mlxq.kv.sharing_plan import plan_sharing
from mlxq.store.prompt_cache import PromptCache

SYSTEM = [1000 + (j * 13) % 4000 for j in range(96)]


@pytest.fixture(autouse=True)
def routed():
    yield
    attention_route.uninstall()


def run(sched: BatchScheduler, prompts: list[list[int]]) -> None:
    for i, prompt in enumerate(prompts):
        sched.add(Request(f"r{sched.timing.steps}-{i}", prompt, SamplingParams(), 6, ignore_eos=True), lambda e: None)
    while not sched.is_idle:
        sched.step()


def scheduler(model, tokenizer) -> BatchScheduler:
    return BatchScheduler(model, tokenizer, measure_footprint(model), SchedulerConfig(8, 8, 2048, None),
                          prompt_cache=PromptCache(1 << 28), sharing=SharingPolicy("auto", plan_sharing(model)))


def agents(n: int) -> list[list[int]]:
    return [SYSTEM + [2000 + 17 * a + j for j in range(5 + a)] for a in range(n)]


def test_auto_counts_the_joins_it_left_ungrouped_and_says_why(load_tiny, monkeypatch):
    model, tokenizer = load_tiny("llama")
    sched = scheduler(model, tokenizer)
    run(sched, [[3000 + (i * 7 + j) % 900 for j in range(40 + i)] for i in range(4)])  # nothing shared
    assert sched.sharing_stats.auto_declined == 0
    run(sched, [SYSTEM + [5, 6]])  # the system prompt stored
    run(sched, agents(4))
    stats = sched.sharing_stats
    assert stats.steps == 0 and stats.auto_declined >= 1
    assert stats.auto_last_declined.startswith("the shared-prefix kernels are off")
    as_dict = stats.as_dict(sched.sharing, 1, ())
    assert as_dict["auto_declined_joins"] == stats.auto_declined and as_dict["declined"] is None

    monkeypatch.setattr(shared_prefix_decode, "_kernels", frozenset({"full", "split"}))  # as if on CUDA
    declined = stats.auto_declined
    run(sched, [prompt + [7] for prompt in agents(3)])
    assert stats.steps == 0 and stats.auto_declined > declined
    assert "rows x 9" in stats.auto_last_declined and "below the 131072 group tokens" in stats.auto_last_declined
    assert shared_prefix_decode.not_worth_sharing(64, 2048) is None
