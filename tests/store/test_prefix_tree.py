"""The prefix tree on real mlx-lm caches of tiny models: one copy per span, pins, LRU leaves, snapshots."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from mlxq.kv.capabilities import is_spans
from mlxq.kv.projection import measure_footprint
from mlxq.kv.sharing_plan import prefix_from_spans
from mlxq.store.prompt_cache import PromptCache, is_trimmable

PREFIX = [(7 * i) % 200 + 3 for i in range(120)]  # a shared "system prompt"


def tail(agent: int, n: int = 12) -> list[int]:
    return [(agent * 31 + 5 * i) % 200 + 3 for i in range(n)]


def prefilled(model, tokens: list[int], caches=None) -> list:
    caches = make_prompt_cache(model) if caches is None else caches
    model(mx.array(tokens)[None], cache=caches)
    mx.eval([c.state for c in caches])
    return caches


def state_arrays(caches: list) -> list:
    """Every layer's state, full-attention layers cut to their offset: what attention reads."""
    out = []
    for c in caches:
        if is_spans(c):
            out += [a[..., : c.offset, :] for _, a in tree_flatten((c.keys, c.values))]
        else:
            out += [a for _, a in tree_flatten(c.state) if isinstance(a, mx.array)]
    return out


def same_state(a: list, b: list) -> bool:
    xs, ys = state_arrays(a), state_arrays(b)
    if len(xs) != len(ys):
        return False
    return all(x.shape == y.shape and mx.array_equal(x, y).item() for x, y in zip(xs, ys, strict=True))


def per_token_bytes(model) -> int:
    return sum(layer.bytes_per_token for layer in measure_footprint(model).layers)


def test_agents_sharing_a_prefix_hold_it_once_and_get_their_own_state_back(load_tiny):
    model, _ = load_tiny("llama")
    per_token = per_token_bytes(model)
    pc = PromptCache(1 << 30)
    rows = {agent: prefilled(model, PREFIX + tail(agent)) for agent in range(5)}
    for agent, caches in rows.items():
        pc.put("", PREFIX + tail(agent), caches)
    assert len(pc) == 5 and pc.nodes == 6  # the prefix node and five tails
    assert pc.bytes == per_token * (len(PREFIX) + 5 * 12)  # shared bytes counted once
    assert pc.as_dict()["entry_bytes"] == 5 * per_token * (len(PREFIX) + 12)  # what five copies would hold
    caches, n = pc.take("", PREFIX + tail(3) + [9])
    assert n == len(PREFIX) + 12 and same_state(caches, rows[3])
    newcomer, n = pc.take("", PREFIX + tail(3)[:5] + [1, 2])  # diverges inside agent 3's tail
    assert n == len(PREFIX) + 5 and same_state(newcomer, prefilled(model, PREFIX + tail(3)[:5]))


def test_quantized_spans_round_trip_exactly(load_tiny):
    model, _ = load_tiny("llama")
    pc = PromptCache(1 << 30)
    rows = {}
    for agent in range(3):
        rows[agent] = [c.to_quantized(group_size=32, bits=8) for c in prefilled(model, PREFIX + tail(agent))]
        pc.put("", PREFIX + tail(agent), rows[agent])
    caches, n = pc.take("", PREFIX + tail(1) + [4])
    assert n == len(PREFIX) + 12 and type(caches[0]) is type(rows[1][0]) and caches[0].bits == 8
    assert same_state(caches, rows[1])
    one_copy = sum(a.nbytes for c in rows[0] for _, a in tree_flatten((c.keys, c.values)))
    assert pc.bytes < 2 * one_copy  # three entries, the prefix once


def test_pinned_entries_survive_eviction_and_unpinning_lets_them_go(load_tiny):
    model, _ = load_tiny("llama")
    per_token = per_token_bytes(model)
    pc = PromptCache(per_token * (len(PREFIX) + 2 * 12))  # the prefix and two tails
    pc.put("", PREFIX + tail(0), prefilled(model, PREFIX + tail(0)))
    pin = pc.pin("", PREFIX + tail(0))
    for agent in range(1, 5):
        pc.put("", PREFIX + tail(agent), prefilled(model, PREFIX + tail(agent)))
    assert pc.take("", PREFIX + tail(0) + [1])[1] == len(PREFIX) + 12  # pinned: never evicted
    assert pc.take("", PREFIX + tail(4) + [1])[1] == len(PREFIX) + 12  # the newest
    assert pc.take("", PREFIX + tail(2) + [1])[1] == len(PREFIX)  # evicted: only the prefix is left of it
    assert pc.stats.evictions == 3 and pc.bytes <= pc.max_bytes
    pc.unpin(pin)
    pc.put("", PREFIX + tail(5), prefilled(model, PREFIX + tail(5)))
    assert pc.take("", PREFIX + tail(0) + [1])[1] == len(PREFIX)  # once unpinned it ages out like the rest


def test_eviction_takes_the_least_recently_used_leaf_and_keeps_shared_parents(load_tiny):
    model, _ = load_tiny("llama")
    per_token = per_token_bytes(model)
    pc = PromptCache(per_token * (len(PREFIX) + 3 * 12))
    for agent in range(3):
        pc.put("", PREFIX + tail(agent), prefilled(model, PREFIX + tail(agent)))
    pc.take("", PREFIX + tail(0) + [1])  # agent 0 is now the most recently used; agent 1 the least
    pc.put("", PREFIX + tail(3), prefilled(model, PREFIX + tail(3)))
    served = {agent: pc.take("", PREFIX + tail(agent) + [1])[1] for agent in range(4)}
    assert served == {0: 132, 1: len(PREFIX), 2: 132, 3: 132}
    # A prompt with another prefix needs more room than the tails give: the whole old branch goes,
    # leaves first, then the prefix they shared once it is an unused leaf itself.
    other = [201 - t for t in PREFIX]
    pc.put("", other + tail(0), prefilled(model, other + tail(0)))
    assert pc.take("", other + tail(0) + [1])[1] == 132 and pc.bytes == per_token * 132
    assert pc.stats.evictions == 4 and len(pc) == 1 and pc.nodes == 1
    assert all(pc.take("", PREFIX + tail(a) + [1])[1] == 0 for a in range(4))


@pytest.mark.parametrize("arch", ["gemma3_text", "qwen3_next"])
def test_rings_and_recurrent_state_are_served_from_exact_snapshots(load_tiny, arch):
    model, _ = load_tiny(arch)
    pc = PromptCache(1 << 30)
    caches = prefilled(model, PREFIX)
    assert not is_trimmable(caches)
    pc.put("", PREFIX, caches)  # the end of the system prompt
    prompt = PREFIX + tail(1)
    prefilled(model, prompt[len(PREFIX) : -1], caches)
    pc.put("", prompt[:-1], caches)  # the prompt boundary (all but its last token)
    assert len(pc) == 2
    assert pc.take("", PREFIX[:100] + [1, 2])[1] == 0  # no snapshot inside the prefix
    # An agent with the same system prompt starts at its end, from exactly the state stored there.
    other = PREFIX + tail(2)
    lent, n = pc.take("", other)
    assert n == len(PREFIX) and same_state(lent, prefilled(model, PREFIX))
    # The next turn of agent 1 starts at its boundary: continuing it gives what the original row computed.
    lent, n = pc.take("", prompt + [5, 6])
    assert n == len(prompt) - 1
    assert mx.array_equal(model(mx.array(prompt[-1:] + [5])[None], cache=lent),
                          model(mx.array(prompt[-1:] + [5])[None], cache=caches)).item()
    again, _ = pc.take("", prompt + [5, 6])
    assert same_state(again, lent) is False  # the borrower wrote its own copy; the stored state is unchanged
    assert same_state(pc.take("", prompt + [7])[0], again)


def test_an_evicted_entry_spills_whole_from_its_detached_nodes_and_restores_exactly(load_tiny, tmp_path):
    from mlxq.store.cold_tier import ColdTier
    from mlxq.store.mlxkv import Identity
    from mlxq.store.ssd_store import SsdStore

    model, _ = load_tiny("llama")
    identity = Identity("b" * 16, "native", "")
    ram = PromptCache(per_token_bytes(model) * (len(PREFIX) + 12))  # one agent at a time
    tier = ColdTier(SsdStore(tmp_path, identity), ram, write_behind=False)
    rows = {agent: prefilled(model, PREFIX + tail(agent)) for agent in range(2)}
    ram.put("", PREFIX + tail(0), rows[0])
    ram.put("", PREFIX + tail(1), rows[1])  # splits the first entry's node, then evicts its tail
    assert tier.counters.spills == 1 and len(ram) == 1
    ram.put("", PREFIX[:50] + tail(2), prefilled(model, PREFIX[:50] + tail(2)))  # splits the shared node again
    tier.begin_flush()
    while tier.has_work(flushing=True):
        tier.step()
    assert tier.flush_result().durable
    store = SsdStore(tmp_path, identity)
    store.scan()
    again = PromptCache(1 << 30)
    ColdTier(store, again)
    caches, n = again.take("", PREFIX + tail(0) + [1])
    assert n == len(PREFIX) + 12 and same_state(caches, rows[0])


def test_a_lease_pins_the_chain_it_was_served_from_until_released(load_tiny):
    model, _ = load_tiny("llama")
    per_token = per_token_bytes(model)
    pc = PromptCache(per_token * (len(PREFIX) + 2 * 12))  # the prefix and two tails
    pc.put("", PREFIX + tail(0), prefilled(model, PREFIX + tail(0)))
    lease = pc.lease("", PREFIX + tail(0)[:7] + [1])  # ends inside agent 0's tail node
    assert lease.cached == len(PREFIX) + 7 and lease.held
    assert same_state(lease.caches, prefilled(model, PREFIX + tail(0)[:7]))
    chain = lease.chain()
    assert [n.end for n in chain] == [len(PREFIX) + 12] and chain[-1].pins == 1
    # What a kind referencing the shared prefix reads: the chain's spans, cut to ``cached``.
    keys = mx.concatenate([n.spans[0][0] for n in chain], axis=-2)[..., : lease.cached, :]
    assert mx.array_equal(keys, lease.caches[0].keys[..., : lease.cached, :]).item()
    prefix = prefix_from_spans(lease.layer_spans())  # a group's shared prefix, as the batch kind builds it
    assert all(mx.array_equal(k, c.keys[..., : lease.cached, :]).item() and
               mx.array_equal(v, c.values[..., : lease.cached, :]).item()
               for (k, v), c in zip(prefix, lease.caches, strict=True))
    for agent in range(1, 5):
        pc.put("", PREFIX + tail(agent), prefilled(model, PREFIX + tail(agent)))
    assert pc.take("", PREFIX + tail(0) + [1])[1] == len(PREFIX) + 12  # leased: never evicted
    assert chain[-1].pins == 1  # ``take`` alone pins nothing
    lease.release()
    lease.release()  # a second release does nothing
    assert chain[-1].pins == 0
    assert pc.take("", PREFIX + tail(4) + [1])[1] == len(PREFIX) + 12  # agent 4 is now used more recently
    pc.put("", PREFIX + tail(5), prefilled(model, PREFIX + tail(5)))
    assert pc.take("", PREFIX + tail(0) + [1])[1] == len(PREFIX)  # released: it ages out like the rest
    miss = pc.lease("", [9, 9, 9])
    assert miss.cached == 0 and miss.caches is None and not miss.held


def test_a_lease_builds_its_caches_when_first_read_even_after_a_split_of_its_chain(load_tiny):
    model, _ = load_tiny("llama")
    pc = PromptCache(1 << 30)
    pc.put("", PREFIX + tail(0), prefilled(model, PREFIX + tail(0)))
    lease = pc.lease("", PREFIX + tail(0)[:7] + [1])  # ends inside the one node holding it all
    node = lease.node
    assert lease.trimmable and [n.end for n in lease.chain()] == [len(PREFIX) + 12]
    # Another agent's put splits that node twice, at the prefix's end and inside the tail: the node
    # named at the lookup keeps only the lower part.
    pc.put("", PREFIX + tail(1), prefilled(model, PREFIX + tail(1)))
    pc.put("", PREFIX + tail(0)[:3] + [1, 1], prefilled(model, PREFIX + tail(0)[:3] + [1, 1]))
    assert node.depth == len(PREFIX) + 3 and len(lease.chain()) == 3
    assert same_state(lease.caches, prefilled(model, PREFIX + tail(0)[:7]))
    assert lease.caches is lease.caches  # built once


def test_a_path_asked_twice_is_walked_once_and_anew_after_the_tree_changes(load_tiny):
    """Admission asks ``held_path`` then ``lease`` for one prompt: the second answer is the first's
    (one walk of the prompt), until a store or a removal changes the tree."""
    model, _ = load_tiny("llama")
    pc = PromptCache(1 << 30)
    pc.put("", PREFIX + tail(0), prefilled(model, PREFIX + tail(0)))
    prompt = PREFIX + tail(1)
    nodes, n = pc.held_path("", prompt)
    assert n == len(PREFIX) and pc._last_lookup[1] is prompt  # kept for the lease
    assert pc._lookup("", list(prompt))[2] == n  # another list: walked anew, same answer
    lease = pc.lease("", prompt)
    assert lease.cached == n and lease.node is nodes[-1]
    lease.release()
    pc.put("", prompt, prefilled(model, prompt))  # the tree changed: the prompt's own entry serves more
    assert pc.held_path("", prompt)[1] == len(prompt) - 1
    grown = prompt + [9]
    assert pc.held_path("", grown)[1] == len(prompt)
    grown.append(11)  # the same list, longer: walked anew
    assert pc.held_path("", grown)[1] == len(prompt)
