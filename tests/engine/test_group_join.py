"""Rows join and leave a running shared-prefix group without rebuilding it or copying the prefix.

RunningBatch.join_group appends the joiners' tails to the group's caches
(a joiner on another prompt rides along as a stray) and keep() filters
rows out; through both, every row's greedy tokens equal its solo
generate_step run (CPU float32), the group's prefix arrays stay the very
arrays it started with, and no tail ever holds the prefix.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlxq.engine.prefix_sharing import Group
from mlxq.engine.running_batch import Pending, RunningBatch
from mlxq.kv import attention_route
from mlxq.kv.shared_prefix_cache import SharedPrefixBatchCache
from mlxq.kv.sharing_plan import plan_sharing, share_prefix
from tests.kv.test_shared_prefix_parity import prefilled, prompts, solo


@pytest.fixture(autouse=True)
def routed():
    yield
    attention_route.uninstall()


def step(model, batch: RunningBatch) -> list[int]:
    """One greedy decode step of the whole batch; returns each row's new token."""
    logits = batch.pending.tokens[:, None]
    logits = model(logits, cache=batch.caches)[:, -1, :]
    tokens = logits.argmax(axis=-1).astype(mx.uint32)
    mx.eval(tokens)
    n = len(batch)
    batch.pending = Pending(tokens, [None] * n, [False] * n)
    return tokens.tolist()


def pending(prompts_: list[list[int]]) -> Pending:
    return Pending(mx.array([p[-1] for p in prompts_], dtype=mx.uint32), [None] * len(prompts_),
                   [True] * len(prompts_))


def shared_layers(batch: RunningBatch) -> list[SharedPrefixBatchCache]:
    return [c for c in batch.caches if isinstance(c, SharedPrefixBatchCache)]


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_joiners_and_leavers_keep_the_group_and_equal_solo(load_tiny, arch):
    model, tokenizer = load_tiny(arch)
    prefix_length, rows = prompts(tokenizer)
    stray = tokenizer.encode("An unrelated request with a prompt of its own.")
    plan = plan_sharing(model)
    batch = RunningBatch()
    batch.join(["r0", "r1"], share_prefix(plan, [prefilled(model, p) for p in rows[:2]], prefix_length), True,
               pending(rows[:2]))
    batch.set_groups((Group(None, prefix_length, (True, True)),))
    layers = shared_layers(batch)
    assert layers, "the plan shares at least one layer"
    prefix = [(c.prefix_keys, c.prefix_values) for c in layers]
    out = {0: [], 1: []}
    for _ in range(2):
        for row, token in zip((0, 1), step(model, batch), strict=True):
            out[row].append(token)

    # Two joiners on the prefix and one stray join the running group in place.
    joiners = [rows[2], stray, rows[3]]
    batch.join_group(["r2", "s", "r3"], [prefilled(model, p) for p in joiners], (0, -1, 0),
                     pending(joiners), plan)
    assert batch.groups[0].shares == (True, True, True, False, True)
    ids = {0: 0, 1: 1, 2: 2, "s": 3, 3: 4}
    out |= {2: [], "s": [], 3: []}
    for _ in range(3):
        tokens = step(model, batch)
        for row, index in ids.items():
            out[row].append(tokens[index])

    # Row 1 leaves; the others go on over the same prefix arrays.
    batch.keep([0, 2, 3, 4])
    ids = {0: 0, 2: 1, "s": 2, 3: 3}
    for _ in range(2):
        tokens = step(model, batch)
        for row, index in ids.items():
            out[row].append(tokens[index])

    assert shared_layers(batch) == layers  # the same cache objects: never rebuilt
    for cache, (keys, values) in zip(layers, prefix, strict=True):
        assert cache.prefix_keys is keys and cache.prefix_values is values
        assert cache.tail.size() < prefix_length  # no row's tail holds a copy of the prefix
    assert batch.groups[0].shares == (True, True, False, True)
    for row, prompt in ((0, rows[0]), (1, rows[1]), (2, rows[2]), ("s", stray), (3, rows[3])):
        assert out[row] == solo(model, prompt, len(out[row])), row


def test_a_join_that_cannot_extend_changes_nothing(load_tiny):
    """join_group checks every layer before it touches the batch: a failed join leaves it as it was."""
    model, tokenizer = load_tiny("llama")
    prefix_length, rows = prompts(tokenizer)
    plan = plan_sharing(model)
    batch = RunningBatch()
    batch.join(["r0", "r1"], share_prefix(plan, [prefilled(model, p) for p in rows[:2]], prefix_length), True,
               pending(rows[:2]))
    batch.set_groups((Group(None, prefix_length, (True, True)),))
    short = rows[2][: prefix_length - 3]  # holds fewer tokens than the prefix: cannot share it
    with pytest.raises(ValueError, match="fewer than"):
        batch.join_group(["r2"], [prefilled(model, short)], (0,), pending([short]), plan)
    assert len(batch) == 2 and batch.groups[0].shares == (True, True)
    assert [len(p) - 1 for p in rows[:2]] == shared_layers(batch)[0].offset.tolist()



def decode(model, batch: RunningBatch, out: dict, steps: int) -> None:
    """``steps`` greedy steps; each row's token appended under its name (batch.rows holds names)."""
    for _ in range(steps):
        for name, token in zip(batch.rows, step(model, batch), strict=True):
            out.setdefault(name, []).append(token)


def test_joiners_reach_each_of_two_groups_and_a_group_can_leave_whole(load_tiny):
    from mlxq.kv.sharing_plan import PrefixSpec, share_groups
    from tests.kv.test_shared_prefix_groups import two_groups

    model, tokenizer = load_tiny("llama")
    lengths, rows, _ = two_groups(tokenizer)  # rows 0, 3 on prefix A; 1, 4 on prefix B; 2 a stray
    plan = plan_sharing(model)
    batch, out = RunningBatch(), {}
    batch.join([0, 1], share_groups(plan, [prefilled(model, rows[i]) for i in (0, 1)],
                                    [PrefixSpec(n) for n in lengths], [0, 1]), True, pending([rows[0], rows[1]]))
    batch.set_groups((Group(None, lengths[0], (True, False)), Group(None, lengths[1], (False, True))))
    layers = shared_layers(batch)
    prefix_b = [c.prefixes[1] for c in layers]
    decode(model, batch, out, 2)

    joiners = [4, 3, 2]
    batch.join_group(joiners, [prefilled(model, rows[i]) for i in joiners], (1, 0, -1),
                     pending([rows[i] for i in joiners]), plan)
    assert [g.shares for g in batch.groups] == [(True, False, False, True, False), (False, True, True, False, False)]
    assert all(c.row_groups == [0, 1, 1, 0, -1] for c in layers)
    decode(model, batch, out, 2)

    batch.keep([1, 2, 4])  # both rows of group A leave: B and the stray go on
    assert [g.shares for g in batch.groups] == [(True, True, False)]
    assert shared_layers(batch) == layers
    for cache, prefix in zip(layers, prefix_b, strict=True):
        assert cache.prefixes == [prefix] and cache.row_groups == [0, 0, -1]  # B's arrays, by reference
    decode(model, batch, out, 2)
    for i, tokens in out.items():
        assert tokens == solo(model, rows[i], len(tokens)), i


def test_building_a_group_never_holds_the_batch_kv_twice(load_tiny):
    """share() takes the rows as views into the batch's arrays: the new caches copy only the tails,
    so building the group costs about the tails in transient memory (here ~23% of the batch's KV,
    rows' own tokens being ~15% of each prompt, plus padding). Extracting each row first costs a
    copy of every row's history (here 100% of the KV; 37% at 12 rows x 1,500 tokens of the small
    preset, against 0.1% with views)."""
    from mlxq.kv.batch_ops import merge_solo_rows
    from mlxq.store.prefix_tree import Node

    model, tokenizer = load_tiny("llama")
    prefix_length, rows = prompts(tokenizer)
    rows = [rows[i % len(rows)] + tokenizer.encode(f" again {i}") for i in range(8)]
    plan = plan_sharing(model)
    donor = prefilled(model, rows[0])
    root = Node((), None, [None] * len(donor))
    node = Node(tuple(rows[0][:prefix_length]), root,
                [(c.keys[:, :, :prefix_length], c.values[:, :, :prefix_length]) for c in donor], depth=0)
    batch = RunningBatch()
    batch.join(list(range(len(rows))), merge_solo_rows([prefilled(model, p) for p in rows]), True, pending(rows))
    mx.eval([(c.keys, c.values) for c in batch.caches])
    kv = sum(c.keys.nbytes + c.values.nbytes for c in batch.caches)
    mx.synchronize()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    batch.share((Group(node, prefix_length, (True,) * len(rows)),), plan)
    mx.eval([(c.tail.keys, c.tail.values) for c in shared_layers(batch)])
    assert mx.get_peak_memory() - base < 0.5 * kv
    out = {}
    decode(model, batch, out, 2)
    assert [out[i] for i in range(len(rows))] == [solo(model, p, 2) for p in rows]


def test_strays_left_without_a_group_go_back_to_per_row_caches_and_unrouted_attention(load_tiny):
    """When every row of every group has left, the strays must not keep running on shared-prefix
    caches (attention through the seam, the grouped kernels): they return to per-row batched caches
    and the model's attention calls are those of ``off`` again."""
    from mlx_lm.models import llama

    from mlxq.kv.sharing_plan import PrefixSpec, share_groups
    from tests.kv.test_shared_prefix_groups import two_groups

    model, tokenizer = load_tiny("llama")
    lengths, rows, _ = two_groups(tokenizer)
    extra = tokenizer.encode("Another request that shares nothing with the others.")
    plan = plan_sharing(model)
    names = [0, 3, 2, "x"]  # rows 0 and 3 on prefix A; 2 and "x" strays
    prompts_ = [rows[0], rows[3], rows[2], extra]
    batch, out = RunningBatch(), {}
    batch.join(names, share_groups(plan, [prefilled(model, p) for p in prompts_], [PrefixSpec(lengths[0])],
                                   [0, 0, -1, -1]), True, pending(prompts_))
    batch.set_groups((Group(None, lengths[0], (True, True, False, False)),))
    assert llama.scaled_dot_product_attention is attention_route.route
    decode(model, batch, out, 2)

    batch.keep([2, 3])  # both group rows leave
    assert batch.groups == () and not shared_layers(batch)
    assert llama.scaled_dot_product_attention is not attention_route.route
    decode(model, batch, out, 2)
    for name, prompt in zip(names, prompts_, strict=True):
        assert out[name] == solo(model, prompt, len(out[name])), name


def test_a_burst_into_an_empty_batch_is_grouped_from_its_solo_caches(load_tiny):
    """start_grouped builds the group straight from the joiners' solo caches: the transient is their
    tails, not a merged batch of every row's whole history (which join + share would build first)."""
    from mlxq.store.prefix_tree import Node

    model, tokenizer = load_tiny("llama")
    prefix_length, rows = prompts(tokenizer)
    rows = [rows[i % len(rows)] + tokenizer.encode(f" once more {i}") for i in range(8)]
    plan = plan_sharing(model)
    donor = prefilled(model, rows[0])
    root = Node((), None, [None] * len(donor))
    node = Node(tuple(rows[0][:prefix_length]), root,
                [(c.keys[:, :, :prefix_length], c.values[:, :, :prefix_length]) for c in donor], depth=0)
    caches = [prefilled(model, p) for p in rows]
    mx.eval([(c.keys, c.values) for row in caches for c in row])
    kv = sum(c.keys.nbytes + c.values.nbytes for row in caches for c in row)
    mx.synchronize()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    batch = RunningBatch()
    batch.start_grouped(list(range(len(rows))), caches, (Group(node, prefix_length, (True,) * len(rows)),), plan,
                        pending(rows))
    mx.eval([(c.tail.keys, c.tail.values) for c in shared_layers(batch)])
    assert batch.groups and mx.get_peak_memory() - base < 0.5 * kv
    with pytest.raises(ValueError, match="empty batch"):
        batch.start_grouped([99], [prefilled(model, rows[0])], batch.groups, plan, pending(rows[:1]))
    out = {}
    decode(model, batch, out, 2)
    assert [out[i] for i in range(len(rows))] == [solo(model, p, 2) for p in rows]
