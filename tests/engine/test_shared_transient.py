"""A burst of short tails on a shared prefix read by reference is held to its real prefill transient.

The transient reserve and the memory room size the joiners' worst prefill
step from the tokens each attends through a score matrix
(``Extent.attended``). A short tail on a shared prefix read by reference
attends the prefix through the shared path (tensor cores, or bounded blocks
of scores), so only its tail counts: on the 8B shape a 14.5k-token prefix
would otherwise count two 2,048-token chunks' scores over all of it (~10 GB),
more than the reserve a 55 GB limit leaves (~9.3 GB), and each agent of a
burst was admitted alone. One that prefills on a copy (``on_copy``) counts
its whole prompt, as before. A lease gives up its caches once its row joined.
"""

from __future__ import annotations

from mlxq.engine.step_plan import Extent, Limits, Load, Sizing, can_admit
from mlxq.engine.transient import ModelShape
from mlxq.kv.capabilities import CacheKind
from mlxq.kv.projection import KvFootprint, LayerFootprint

LLAMA_8B = ModelShape(hidden=4096, intermediate=14336, heads=32, vocab=128256, dtype_bytes=2)
FOOTPRINT = KvFootprint((LayerFootprint(CacheKind.FULL, 4096, 0, None),) * 32)  # 128 KiB per token
PREFIX, TAIL = 16160, 60


def burst_admitted(on_copy: bool, agents: int = 64) -> int:
    sizing = Sizing(FOOTPRINT, LLAMA_8B, (True,) * 32)
    limits = Limits(row_cap=64, prompt_concurrency=4, group_cap=64, prefill_budget=2048, kv_budget=int(21.7e9),
                    transient_budget=int(9.3e9), memory_room=int(28e9), tail_budget=4096)
    agent = Extent(PREFIX + TAIL, 128).sharing(PREFIX, 0, on_copy)
    load = Load((), ())
    while len(load.prefilling) < agents and can_admit(load, agent, limits, sizing, own_tokens=TAIL):
        load = load.with_joiner(agent, short=True)
    return len(load.prefilling)


def test_short_tails_by_reference_are_admitted_together_under_the_8b_reserve():
    assert Extent(PREFIX + TAIL, 128).sharing(PREFIX, 0).attended == TAIL
    assert burst_admitted(on_copy=False) == 64


def test_tails_on_copies_count_their_whole_prompts():
    assert Extent(PREFIX + TAIL, 128).sharing(PREFIX, 0, True).attended == PREFIX + TAIL
    assert Extent(PREFIX + TAIL, 128).attended == PREFIX + TAIL  # no shared prefix
    assert burst_admitted(on_copy=True) == 1  # two of them pass the reserve: one at a time


def test_a_joined_row_s_lease_keeps_its_pin_and_drops_its_caches(load_tiny):
    from mlxq.engine.prefix_sharing import SharingPolicy
    from mlxq.engine.scheduler import BatchScheduler, SchedulerConfig
    from mlxq.engine.types import Request, SamplingParams
    from mlxq.golden.cases import LONG
    from mlxq.kv.projection import measure_footprint
    from mlxq.kv.sharing_plan import plan_sharing
    from mlxq.store.prompt_cache import PromptCache

    model, tokenizer = load_tiny("llama")
    shared = tokenizer.encode(LONG + " " + LONG)
    scheduler = BatchScheduler(model, tokenizer, measure_footprint(model), SchedulerConfig(8, 4, 2048, None),
                               prompt_cache=PromptCache(1 << 30), sharing=SharingPolicy("on", plan_sharing(model)))
    first = Request("first", shared + tokenizer.encode(" one?"), SamplingParams(), 4, ignore_eos=True)
    scheduler.add(first, lambda e: None)
    while not scheduler.is_idle:
        scheduler.step()
    second = Request("second", shared + tokenizer.encode(" two?"), SamplingParams(), 4, ignore_eos=True)
    scheduler.add(second, lambda e: None)
    lease = scheduler._leases["second"]
    assert lease.cached >= len(shared) and lease.caches is not None
    scheduler.step()  # its tail, then it joins
    assert scheduler.num_rows == 1 and lease.held and lease.caches is None
    while not scheduler.is_idle:
        scheduler.step()
    assert not lease.held
