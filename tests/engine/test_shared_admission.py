"""The KV budget counts a shared prefix once for rows that read it by reference.

Agents on one cached system prompt: under ``--shared-prefix-attention on``
a budget that holds the prefix once plus every agent's tail admits them
all together (they form one group), under ``off`` the same budget holds
per-row copies and queues most of them; either way each agent's greedy
tokens equal the serial lane's (CPU float32).
"""

from __future__ import annotations

import pytest

from mlxq.engine.prefix_sharing import SharingPolicy
from mlxq.engine.scheduler import BatchScheduler, SchedulerConfig
from mlxq.engine.step_plan import Extent
from mlxq.engine.types import Request, SamplingParams
from mlxq.golden.cases import LONG
from mlxq.kv import attention_route
from mlxq.kv.projection import measure_footprint
from mlxq.kv.sharing_plan import plan_sharing
from mlxq.store.prompt_cache import PromptCache
from tests.engine.test_shared_prefill import serial_with_cache

AGENTS = 6
MAX_TOKENS = 8


@pytest.fixture(autouse=True)
def routed():
    yield
    attention_route.uninstall()


def agents(tokenizer) -> tuple[int, list[Request]]:
    shared = tokenizer.encode(LONG + " " + LONG + " " + LONG)
    reqs = [Request(f"agent-{i}", shared + tokenizer.encode(f" Agent {i}, what now?"), SamplingParams(), MAX_TOKENS)
            for i in range(AGENTS + 1)]
    return len(shared), reqs


def budget_between(model, shared: int, reqs: list[Request]) -> int:
    """Bytes that hold the prefix once plus every agent's tail, but not four agents' copies."""
    footprint = measure_footprint(model)
    per_token = sum(layer.bytes_per_token for layer in footprint.layers)
    longest = max(len(r.prompt_ids) for r in reqs) + MAX_TOKENS
    once = footprint.grouped_bytes([longest] * AGENTS, [shared] * AGENTS, [shared], plan_sharing(model).shared)
    copies = footprint.batch_bytes([longest] * 4)
    budget = once + 64 * per_token  # the group's prefix runs a few tokens past the system prompt
    assert budget < copies, (budget, copies)
    return budget


def run(model, tokenizer, mode: str, budget: int, reqs: list[Request]) -> tuple[int, dict[str, list[int]], dict]:
    """The warm-up agent alone, then the engine's admission loop for the rest: (admitted at once, tokens)."""
    finished: dict[str, list[int]] = {}
    policy = SharingPolicy(mode, plan_sharing(model) if mode != "off" else None)
    scheduler = BatchScheduler(model, tokenizer, measure_footprint(model), SchedulerConfig(8, 8, 2048, budget),
                               on_finish=lambda row: finished.__setitem__(row.request.request_id, row.output.tokens),
                               prompt_cache=PromptCache(1 << 30), sharing=policy)
    scheduler.add(reqs[0], lambda e: None)  # stores the system prompt in the prompt cache
    while not scheduler.is_idle:
        scheduler.step()
    waiting = list(reqs[1:])
    admitted = 0
    while waiting and scheduler.can_admit(waiting[0]):
        scheduler.add(waiting.pop(0), lambda e: None)
        admitted += 1
    projected = scheduler.projected_bytes()
    while waiting or not scheduler.is_idle:
        while waiting and scheduler.can_admit(waiting[0]):
            scheduler.add(waiting.pop(0), lambda e: None)
        scheduler.step()
    stats = {"projected": projected, "groups": scheduler.sharing_stats.groups, "steps": scheduler.sharing_stats.steps}
    return admitted, finished, stats


def test_agents_on_a_shared_prefix_are_admitted_together_only_when_it_is_shared(load_tiny):
    model, tokenizer = load_tiny("llama")
    shared, reqs = agents(tokenizer)
    budget = budget_between(model, shared, reqs)
    want = {rid: tokens for rid, (tokens, _) in serial_with_cache(model, tokenizer, reqs).items()}

    admitted_on, got_on, on = run(model, tokenizer, "on", budget, reqs)
    assert admitted_on == AGENTS and on["projected"] <= budget
    assert on["groups"] >= 1 and on["steps"] > 0, on  # they decoded as one group
    assert got_on == want

    admitted_off, got_off, off = run(model, tokenizer, "off", budget, reqs)
    assert admitted_off < 4 and off["groups"] == 0, off  # per-row copies: the same budget queues them
    assert got_off == want


def test_a_row_outside_the_group_is_counted_whole(load_tiny):
    """The accounting marks only rows whose leases reach the group's prefix: a fresh prompt pays in full."""
    model, tokenizer = load_tiny("llama")
    shared, reqs = agents(tokenizer)
    policy = SharingPolicy("on", plan_sharing(model))
    cache = PromptCache(1 << 30)
    scheduler = BatchScheduler(model, tokenizer, measure_footprint(model), SchedulerConfig(8, 8, 2048, None),
                               prompt_cache=cache, sharing=policy)
    scheduler.add(reqs[0], lambda e: None)
    while not scheduler.is_idle:
        scheduler.step()
    for r in reqs[1:3]:
        scheduler.add(r, lambda e: None)
    fresh = Request("fresh", tokenizer.encode("Something else entirely, with no shared start."), SamplingParams(), 4)
    held = cache.held_path(fresh.namespace, fresh.prompt_ids)
    load, extent = scheduler._kv_load(Extent(len(fresh.prompt_ids), 4), held)
    assert [e.prefix for e in load.prefilling] == [0, 0] and min(e.shared for e in load.prefilling) >= shared
    assert extent.prefix is None and extent.shared == 0


@pytest.mark.parametrize("token0_in_decode", [True, False])
def test_a_burst_on_a_cached_prefix_joins_at_once_in_a_memory_room_without_its_copies(load_tiny, token0_in_decode):
    """Agents whose own part is a short tail prefill it on the stored prefix by reference
    (engine/shared_tails.py), so the memory room does not hold them back for copies they never make:
    a room with space for one newcomer but not for another agent's copy admits them all at once.
    Where that path declines them (token 0 from a forward of their own: ``TailTerms``), each
    prefills on a copy, and the same room holds fewer of them."""
    import dataclasses

    import mlx.core as mx

    from mlxq.engine.preempt import SHED_AT
    from mlxq.engine.transient import ModelShape, joiners_transient

    model, tokenizer = load_tiny("llama")
    shared, reqs = agents(tokenizer)
    footprint = measure_footprint(model)
    config = SchedulerConfig(8, 8, 2048, None, shape=ModelShape.of(model), token0_in_decode=token0_in_decode)
    finished: dict[str, list[int]] = {}
    scheduler = BatchScheduler(model, tokenizer, footprint, config, prompt_cache=PromptCache(1 << 30),
                               sharing=SharingPolicy("on", plan_sharing(model)),
                               on_finish=lambda row: finished.__setitem__(row.request.request_id, row.output.tokens))
    scheduler.add(reqs[0], lambda e: None)  # stores the system prompt
    while not scheduler.is_idle:
        scheduler.step()
    longest = max(len(r.prompt_ids) for r in reqs)
    transient = joiners_transient(config.shape, [longest] * AGENTS, 2048, 8)
    room = footprint.row_bytes(longest + MAX_TOKENS, longest) + transient + footprint.batch_bytes([longest]) // 2
    scheduler.config = dataclasses.replace(config, memory_limit_bytes=int((mx.get_active_memory() + room) / SHED_AT))
    scheduler.add(reqs[1], lambda e: None)  # something runs: the room is checked from here on
    admitted = 1
    while admitted < AGENTS and scheduler.can_admit(reqs[admitted + 1]):
        scheduler.add(reqs[admitted + 1], lambda e: None)
        admitted += 1
    assert [e.on_copy for e in scheduler._kv_load()[0].prefilling] == [not token0_in_decode] * admitted
    assert admitted == AGENTS if token0_in_decode else admitted < AGENTS  # the copies fill the room
    for r in reqs[admitted + 1 :]:
        while not scheduler.can_admit(r):
            scheduler.step()
        scheduler.add(r, lambda e: None)
    while not scheduler.is_idle:
        scheduler.step()
    assert (scheduler.batch.copies.referenced > 0) == token0_in_decode
    want = {rid: tokens for rid, (tokens, _) in serial_with_cache(model, tokenizer, reqs).items()}
    assert finished == want
