"""A batch joiner reads its prefix from the SSD tier a layer per step: running rows keep decoding."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlxq.engine.scheduler import BatchScheduler, SchedulerConfig
from mlxq.engine.serial import run_serial
from mlxq.engine.types import Request, SamplingParams
from mlxq.golden.cases import LONG, SHORT
from mlxq.kv.projection import measure_footprint
from mlxq.store.cold_tier import ColdTier
from mlxq.store.mlxkv import Identity
from mlxq.store.prompt_cache import PromptCache
from mlxq.store.ssd_store import SsdStore
from tests.store.conftest import restore_placement  # noqa: F401  (a fixture: host reads, then device loads)

IDENTITY = Identity("e" * 16, "native", "")
pytestmark = pytest.mark.usefixtures("restore_placement")


def restarted(root: Path) -> PromptCache:
    """An empty RAM tier over the SSD directory, as after a restart."""
    store = SsdStore(root, IDENTITY)
    store.scan()
    ram = PromptCache(1 << 30)
    ColdTier(store, ram)
    return ram


def test_rows_keep_decoding_while_a_joiner_restores(load_tiny, tmp_path):
    model, tokenizer = load_tiny("llama")
    greedy = SamplingParams()
    long = tokenizer.encode(LONG + " " + LONG + " " + LONG)
    ram = PromptCache(1 << 30)
    tier = ColdTier(SsdStore(tmp_path, IDENTITY), ram)
    run_serial(model, tokenizer, Request("seed", long, greedy, 4), lambda e: None, prefill_step_size=2048,
               prompt_cache=ram)
    tier.begin_flush()
    while tier.has_work(flushing=True):
        tier.step()
    assert tier.flush_result().durable

    follow_up = long + tokenizer.encode(" And then?")
    reference = run_serial(model, tokenizer, Request("ref", follow_up, greedy, 10), lambda e: None,
                           prefill_step_size=2048, prompt_cache=restarted(tmp_path))

    ram = restarted(tmp_path)
    finished = {}
    scheduler = BatchScheduler(model, tokenizer, measure_footprint(model), SchedulerConfig(8, 4, 2048, None),
                               prompt_cache=ram, on_finish=lambda row: finished.__setitem__(row.request.request_id,
                                                                                            row.output))
    emitted = []
    scheduler.add(Request("a", tokenizer.encode(SHORT), greedy, 60, ignore_eos=True),
                  lambda e: emitted.append(e) if e.token_id is not None else None)
    while len(emitted) < 3:
        scheduler.step()
    scheduler.add(Request("b", follow_up, greedy, 10), lambda e: None)
    joiner = scheduler.joiners[-1]
    assert joiner.restore is not None
    restoring_steps = 0
    while joiner.restore is not None:
        before = len(emitted)
        scheduler.step()
        assert len(emitted) == before + 1  # the running row got its token this step
        restoring_steps += 1
    assert restoring_steps >= 4  # 4 layers, one per step
    while not scheduler.is_idle:
        scheduler.step()
    b = finished["b"]
    assert b.cached_tokens == reference.cached_tokens >= len(long) - 1
    assert b.tokens == reference.tokens
    assert ram.cold.store.stats.restores == 1
