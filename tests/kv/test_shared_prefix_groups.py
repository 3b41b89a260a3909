"""Several shared-prefix groups in one batch (agents of two system prompts, and a stray).

Each group's prefix is read once for its rows (grouped_prefix_partial); every row's greedy
tokens equal its solo generate_step run, and the logits stay within the unshared path's
1e-5 (CPU float32), for every tiny architecture (rings and recurrent layers stay per row).
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from mlxq.kv import attention_route
from mlxq.kv.batch_ops import extend_batch, keep_rows, merge_solo_rows
from mlxq.kv.shared_prefix_attention import (
    RowGroups,
    grouped_prefix_stats,
    grouped_shared_prefix_attention,
    shared_prefix_attention,
)
from mlxq.kv.shared_prefix_cache import SharedPrefixBatchCache
from mlxq.kv.sharing_plan import plan_sharing, share_prefix
from mlxq.models.presets import ARCHS
from tests.kv.test_shared_prefix_parity import LOGIT_BOUND, greedy, prefilled, solo


@pytest.fixture(autouse=True)
def routed():
    yield
    attention_route.uninstall()


def two_groups(tokenizer) -> tuple[list[int], list[list[int]], list[int | None]]:
    """Prefix lengths per group, the rows' prompts, and each row's group (None: a stray)."""
    a = tokenizer.encode("You are a careful agent. Tools: read, write, search. " * 3)
    b = tokenizer.encode("System: answer as a terse reviewer of pull requests and patches. " * 2)
    rows = [a + tokenizer.encode(" Fix the bug."), b + tokenizer.encode(" Review this."),
            tokenizer.encode("An unrelated request with a prompt of its own."),
            a + tokenizer.encode(" What is in the repo today?"), b + tokenizer.encode(" And this one, please.")]
    return [len(a), len(b)], rows, [0, 1, None, 0, 1]


def grouped_batch(model, plan, lengths, rows, groups) -> list:
    """Group 0's rows (with the stray) shared on prefix 0, then group 1's rows extended in: two groups."""
    first = [i for i, g in enumerate(groups) if g != 1]
    second = [i for i, g in enumerate(groups) if g == 1]
    batch = share_prefix(plan, [prefilled(model, rows[i]) for i in first], lengths[0],
                         shares=[groups[i] == 0 for i in first])
    extend_batch(batch, share_prefix(plan, [prefilled(model, rows[i]) for i in second], lengths[1]))
    return batch, first + second


@pytest.mark.parametrize("arch", ARCHS)
def test_two_groups_and_a_stray_equal_their_solo_runs(load_tiny, arch):
    model, tokenizer = load_tiny(arch)
    lengths, rows, groups = two_groups(tokenizer)
    plan = plan_sharing(model)
    batch, order = grouped_batch(model, plan, lengths, rows, groups)
    shared = [c for c in batch if isinstance(c, SharedPrefixBatchCache)]
    assert len(shared) == sum(plan.shared) and all(len(c.prefixes) == 2 for c in shared)
    assert shared[0].row_groups == [0, -1, 0, 1, 1]
    assert shared[0].offset.tolist() == [len(rows[i]) - 1 for i in order]
    last = [rows[i][-1] for i in order]
    tokens, logits = greedy(model, batch, last, 6)
    _, unshared_logits = greedy(model, merge_solo_rows([prefilled(model, rows[i]) for i in order]), last, 6)
    for position, i in enumerate(order):
        assert tokens[position] == solo(model, rows[i], 6), i
    assert max(mx.abs(a - b).max().item() for a, b in zip(logits, unshared_logits, strict=True)) < LOGIT_BOUND


def test_a_group_whose_rows_all_leave_is_dropped(load_tiny):
    model, tokenizer = load_tiny("llama")
    lengths, rows, groups = two_groups(tokenizer)
    batch, order = grouped_batch(model, plan_sharing(model), lengths, rows, groups)
    prefix_b = batch[0].prefixes[1]
    tokens, _ = greedy(model, batch, [rows[i][-1] for i in order], 2)
    keep_rows(batch, [0, 3, 4])  # row 0 of group 0, both of group 1: the stray and row 3 leave
    assert batch[0].row_groups == [0, 1, 1]
    keep_rows(batch, [1, 2])  # only group 1 is left: it becomes the one prefix
    assert batch[0].row_groups == [0, 0] and batch[0].prefixes == [prefix_b]
    assert type(batch[0].extract(0)) is KVCache
    more, _ = greedy(model, batch, [tokens[3][-1], tokens[4][-1]], 3)
    assert [tokens[3] + more[0], tokens[4] + more[1]] == [solo(model, rows[order[p]], 5) for p in (3, 4)]


def test_grouped_attention_equals_one_group_at_a_time():
    """The math alone: two prefixes of different lengths, a stray and padding, against the one-group
    function run per group (rows of other groups masked out)."""
    mx.random.seed(3)
    q = mx.random.normal((5, 8, 1, 16))
    prefixes = [tuple(mx.random.normal((1, 2, n, 16)) for _ in range(2)) for n in (7, 12)]
    tk, tv = (mx.random.normal((5, 2, 9, 16)) for _ in range(2))
    starts = mx.array([0, 3, 8, 1, 5])
    row_groups = [1, -1, 0, 1, 0]
    layout = RowGroups.of(row_groups, 2)
    assert layout.in_group.tolist() == [True, False, True, True, True] and layout.strays == 1
    got = grouped_shared_prefix_attention(q, prefixes, tk, tv, starts, 0.25, layout)
    stats = grouped_prefix_stats(q, prefixes, layout, 0.25)  # what the CUDA split path hands its kernel
    assert [x.shape for x in stats] == [(2, 20, 16), (2, 20, 1), (2, 20, 1)]
    assert mx.all(stats[1].reshape(2, 5, 4)[:, 1] == -float("inf")).item()  # the stray: an empty level
    for g, (pk, pv) in enumerate(prefixes):
        want = shared_prefix_attention(q, pk, pv, tk, tv, starts, 0.25, None, None,
                                       mx.array([x == g for x in row_groups]))
        rows = mx.array([b for b, x in enumerate(row_groups) if x in (g, -1)])
        assert mx.abs(got[rows] - want[rows]).max().item() < 1e-6
