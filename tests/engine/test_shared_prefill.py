"""Joiners that arrive together with a long shared prefix prefill it once, and still match the serial lane."""

from __future__ import annotations

import pytest

from mlxq.engine.faults import Evaluator, FaultInjector
from mlxq.engine.scheduler import BatchScheduler, SchedulerConfig
from mlxq.engine.serial import run_serial
from mlxq.engine.types import Request, SamplingParams
from mlxq.golden.cases import LONG
from mlxq.kv.projection import measure_footprint
from mlxq.store.prompt_cache import PromptCache


def requests(tokenizer, snapshot: bool) -> list[Request]:
    shared = tokenizer.encode(LONG + " " + LONG)
    questions = ["What is it?", "Who are you today?", "Tell me more, please.", "Why?"]
    out = []
    for i, q in enumerate(questions):
        prompt = shared + tokenizer.encode(" " + q)
        out.append(Request(f"agent-{i}", prompt, SamplingParams(), 12, snapshot_at=len(shared) if snapshot else None))
    return out


def serial_with_cache(model, tokenizer, reqs: list[Request]) -> dict[str, tuple[list[int], int]]:
    """The serial lane, one after another, sharing one prompt cache: the same prefix geometry."""
    cache = PromptCache(1 << 30)
    out = {}
    for r in reqs:
        fresh = Request(r.request_id, r.prompt_ids, r.params, r.max_tokens, snapshot_at=r.snapshot_at)
        o = run_serial(model, tokenizer, fresh, lambda e: None, prefill_step_size=2048, prompt_cache=cache)
        out[r.request_id] = (o.tokens, o.cached_tokens)
    return out


def recording_scheduler(model, tokenizer, config: SchedulerConfig):
    """A batch scheduler on a fresh prompt cache, and the (tokens, cached tokens) of each row it finishes."""
    finished: dict[str, tuple[list[int], int]] = {}
    scheduler = BatchScheduler(
        model, tokenizer, measure_footprint(model), config, prompt_cache=PromptCache(1 << 30),
        on_finish=lambda row: finished.__setitem__(row.request.request_id,
                                                   (row.output.tokens, row.output.cached_tokens)))
    return scheduler, finished


@pytest.mark.parametrize("arch, snapshot", [("llama", False), ("gemma3_text", True), ("qwen3_next", True)])
def test_a_burst_of_agents_prefills_the_shared_prompt_once(load_tiny, arch, snapshot):
    model, tokenizer = load_tiny(arch)
    reqs = requests(tokenizer, snapshot)
    scheduler, finished = recording_scheduler(model, tokenizer, SchedulerConfig(8, 4, 2048, None))
    for r in reqs:  # all at once, before any step
        scheduler.add(Request(r.request_id, r.prompt_ids, r.params, r.max_tokens, snapshot_at=r.snapshot_at),
                      lambda e: None)
    assert scheduler.shared_prefills == len(reqs) - 1
    while not scheduler.is_idle:
        scheduler.step()
    shared = reqs[0].snapshot_at or 0
    for r in reqs[1:]:
        assert finished[r.request_id][1] >= max(shared, 64), r.request_id  # took the leader's prefix
    assert finished[reqs[0].request_id][1] == 0
    expected = serial_with_cache(model, tokenizer, reqs)
    for r in reqs:
        assert finished[r.request_id][0] == expected[r.request_id][0], r.request_id


def test_a_burst_larger_than_the_prompt_concurrency_waits_on_one_leader_and_its_tails_prefill_together(load_tiny):
    model, tokenizer = load_tiny("llama")
    shared = tokenizer.encode(LONG + " " + LONG)
    reqs = [Request(f"agent-{i}", shared + tokenizer.encode(f" Question number {i} of the burst?"), SamplingParams(),
                    8) for i in range(7)]
    scheduler, finished = recording_scheduler(model, tokenizer, SchedulerConfig(8, 2, 2048, None))
    admitted = 0
    for r in reqs:  # the engine's admission loop: the head joins while can_admit says so
        if not scheduler.can_admit(r):
            break
        scheduler.add(r, lambda e: None)
        admitted += 1
    assert admitted == len(reqs) and scheduler.shared_prefills == len(reqs) - 1  # followers take no slot
    prefilling_steps = []
    while not scheduler.is_idle:
        before = scheduler.num_prefilling
        scheduler.step()
        if scheduler.num_prefilling < before:
            prefilling_steps.append(before - scheduler.num_prefilling)
    assert prefilling_steps == [1, len(reqs) - 1]  # the leader, then every tail in one step
    assert all(finished[r.request_id][1] >= len(shared) for r in reqs[1:])
    expected = serial_with_cache(model, tokenizer, reqs)
    for r in reqs:
        assert finished[r.request_id][0] == expected[r.request_id][0], r.request_id
    # Once the prefix is cached, a burst's short tails all join at once, beyond the prompt concurrency.
    again = [Request(f"again-{i}", shared + tokenizer.encode(f" Another question, {i}?"), SamplingParams(), 4)
             for i in range(6)]
    for r in again:
        assert scheduler.can_admit(r)
        scheduler.add(r, lambda e: None)
    scheduler.step()
    assert scheduler.num_prefilling == 0 and scheduler.num_rows == len(again)


def test_agents_arriving_after_the_first_one_prefilled_start_from_its_prompt(load_tiny):
    model, tokenizer = load_tiny("llama")
    reqs = requests(tokenizer, snapshot=True)  # the server marks where the system prompt ends
    scheduler, finished = recording_scheduler(model, tokenizer, SchedulerConfig(8, 4, 2048, None))
    scheduler.add(reqs[0], lambda e: None)
    scheduler.step()  # its whole prompt in one chunk, nobody waiting on it: it decodes now
    assert scheduler.num_prefilling == 0 and scheduler.num_rows == 1
    for r in reqs[1:]:  # they arrive during its prefill: the engine admits them after that step
        scheduler.add(r, lambda e: None)
    assert scheduler.shared_prefills == 0  # nothing to wait for: its prompt is stored already
    while not scheduler.is_idle:
        scheduler.step()
    shared = reqs[0].snapshot_at
    assert all(finished[r.request_id][1] >= shared for r in reqs[1:])
    expected = serial_with_cache(model, tokenizer, reqs)
    for r in reqs:
        assert finished[r.request_id][0] == expected[r.request_id][0], r.request_id


def test_no_waiting_without_a_long_enough_shared_prefix(load_tiny):
    model, tokenizer = load_tiny("llama")
    scheduler = BatchScheduler(model, tokenizer, measure_footprint(model), SchedulerConfig(8, 4, 2048, None),
                               prompt_cache=PromptCache(1 << 30))
    for i, text in enumerate(["A short prompt about cats.", "A short prompt about dogs."]):
        scheduler.add(Request(f"r{i}", tokenizer.encode(text), SamplingParams(), 4), lambda e: None)
    assert scheduler.shared_prefills == 0


def test_rows_pin_the_prefix_they_run_on_until_they_finish_or_are_cancelled(load_tiny):
    model, tokenizer = load_tiny("llama")
    reqs = requests(tokenizer, snapshot=False)
    cache = PromptCache(1 << 30)
    finished = {}
    scheduler = BatchScheduler(model, tokenizer, measure_footprint(model), SchedulerConfig(8, 4, 2048, None),
                               prompt_cache=cache,
                               on_finish=lambda row: finished.__setitem__(row.request.request_id, row.output))
    scheduler.add(reqs[0], lambda e: None)
    while not scheduler.is_idle:
        scheduler.step()
    assert not scheduler._leases  # a request that took nothing holds nothing
    long_run = Request("long", reqs[1].prompt_ids, SamplingParams(), 40, ignore_eos=True)
    scheduler.add(long_run, lambda e: None)
    scheduler.add(reqs[2], lambda e: None)
    leases = dict(scheduler._leases)
    assert set(leases) == {"long", reqs[2].request_id}
    pinned = [lease.chain()[-1] for lease in leases.values()]
    assert all(node.pins >= 1 for node in pinned)
    scheduler.step()
    assert scheduler.num_rows == 2
    long_run.cancelled.set()
    while not scheduler.is_idle:
        scheduler.step()
    assert finished["long"].cached_tokens >= 64 and finished[reqs[2].request_id].cached_tokens >= 64
    assert not scheduler._leases and all(not lease.held for lease in leases.values())
    assert all(node.pins == 0 for node in pinned)


def test_preempted_rows_let_go_of_their_prefix_and_lease_it_again(load_tiny):
    model, tokenizer = load_tiny("llama")
    reqs = requests(tokenizer, snapshot=False)

    def run(plan: dict) -> tuple[dict, BatchScheduler, list]:
        cache = PromptCache(1 << 30)
        finished = {}
        scheduler = BatchScheduler(model, tokenizer, measure_footprint(model), SchedulerConfig(8, 4, 2048, None),
                                   prompt_cache=cache, evaluator=Evaluator(FaultInjector()),
                                   on_finish=lambda row: finished.__setitem__(row.request.request_id,
                                                                              row.output.tokens))
        scheduler.add(reqs[0], lambda e: None)  # stores the shared prefix
        while not scheduler.is_idle:
            scheduler.step()
        scheduler.faults.injector.plan = plan  # counted from here: the agents' decode steps
        for r in reqs[1:]:
            scheduler.add(Request(r.request_id, r.prompt_ids, r.params, 24, ignore_eos=True), lambda e: None)
        pinned = [lease.chain()[-1] for lease in scheduler._leases.values()]
        held_while_preempted = []
        while not scheduler.is_idle:
            scheduler.step()
            if scheduler.num_preempted:
                held_while_preempted.append(sorted(scheduler._leases))
        assert not scheduler._leases and all(node.pins == 0 for node in pinned)
        return finished, scheduler, held_while_preempted

    undisturbed, _, _ = run({})
    disturbed, scheduler, held = run({"decode": frozenset({4, 5})})  # a step and its retry fail: all requeued
    assert scheduler.faults.counters.preemptions >= 2
    assert held and all(ids != sorted(r.request_id for r in reqs[1:]) for ids in held)  # requeued rows hold none
    assert disturbed == undisturbed
