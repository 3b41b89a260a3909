"""A burst of agents on a system prompt nobody stored yet: one leader prefills it, the rest read it by reference.

The leader stores the prefix its followers wait for and holds a lease on
that chain itself (store/prompt_cache.py ``lease_stored``), so when the
followers' tails run, the grouping finds the leader on their prefix: it is
grouped first and the followers' tails run on the prefix by reference and
append to its group. Without it, the leader (decoding on its own caches,
leasing nothing) kept the followers out of any group: their tails were
merged with a copy of the prefix each, which a 14.5k-token prefix on an 8B
model cannot hold for 64 agents. Greedy tokens equal the serial lane's.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlxq.golden.cases import LONG
from mlxq.kv import attention_route
from tests.engine.test_shared_prefill import serial_with_cache
from tests.engine.test_shared_tails import counters, sharing_scheduler
from tests.engine.test_wave_join import run_wave, wave


@pytest.fixture(autouse=True)
def routed():
    yield
    attention_route.uninstall()


def test_a_cold_burst_follows_one_leader_and_joins_its_group_by_reference(load_tiny):
    model, tokenizer = load_tiny("llama")
    shared = tokenizer.encode(LONG + " " + LONG)
    scheduler, finished = sharing_scheduler(model, tokenizer)
    cold = wave(tokenizer, shared, "cold", 8, "Agent")
    run_wave(scheduler, cold)
    change = counters(scheduler)
    assert scheduler.shared_prefills == 7  # one prefill of the prompt, seven followers
    # The seven followers' tails on the stored prefix by reference, appended to the leader's group.
    assert change["referenced"] == 7 and change["broadcast"] == 0 and change["groups"] == 1, change
    assert scheduler.sharing_stats.steps > 0
    expected = serial_with_cache(model, tokenizer, cold)
    for r in cold:
        assert finished[r.request_id][0] == expected[r.request_id][0], r.request_id
    assert not scheduler._leases  # every lease, the leader's too, let go at finish


def test_agents_arriving_after_a_lone_agent_stored_the_prompt_group_with_it_by_reference(load_tiny):
    """The first agent computed the system prompt itself and stored it at its end (its snapshot point);
    a burst arriving while it still decodes starts from that entry and groups with it, no copies."""
    model, tokenizer = load_tiny("llama")
    shared = tokenizer.encode(LONG + " " + LONG)
    scheduler, finished = sharing_scheduler(model, tokenizer)
    first, burst = wave(tokenizer, shared, "first", 1, "Agent"), wave(tokenizer, shared, "burst", 6, "Please")
    scheduler.add(first[0], lambda e: None)
    while not scheduler.num_rows:
        scheduler.step()  # its prefill: nobody follows it
    assert scheduler.shared_prefills == 0 and not scheduler.batch.groups
    run_wave(scheduler, burst)
    change = counters(scheduler)
    assert change["referenced"] == 6 and change["broadcast"] == 0 and change["groups"] == 1, change
    expected = serial_with_cache(model, tokenizer, first + burst)
    for r in first + burst:
        assert finished[r.request_id][0] == expected[r.request_id][0], r.request_id


def test_rows_leaving_a_group_together_are_stored_one_at_a_time(load_tiny):
    """Each leaving row of a shared-prefix group is extracted whole (its prefix and tail joined) to
    be stored; the scheduler lets go of each once stored, so the device's active memory does not
    grow by one prefix copy per row while a group's rows finish in the same step."""
    model, tokenizer = load_tiny("llama")
    shared = tokenizer.encode(LONG + " " + LONG)
    scheduler, _ = sharing_scheduler(model, tokenizer)
    active: list[int] = []
    put = scheduler._put

    def measured_put(row, caches):
        put(row, caches)
        active.append(mx.get_active_memory())

    scheduler._put = measured_put
    run_wave(scheduler, wave(tokenizer, shared, "leave", 8, "Agent"))
    assert counters(scheduler)["referenced"] == 7
    layers = model.layers
    heads, dim = layers[0].self_attn.n_kv_heads, layers[0].self_attn.head_dim
    row_copy = len(shared) * len(layers) * 2 * heads * dim * 4  # float32 keys and values
    assert len(active) == 8
    # The seven followers finish in one step: without letting go, each put adds a row copy.
    assert max(active[1:]) - min(active[1:]) < 2 * row_copy, (active, row_copy)
