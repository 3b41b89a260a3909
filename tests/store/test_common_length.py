"""The common prefix of two token tuples (store/prefix_tree.common_length), against a plain loop."""

from __future__ import annotations

import random

from mlxq.store.prefix_tree import COMPARE_BLOCK, common_length


def reference(a: tuple, b: tuple) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_every_divergence_point_around_the_block_edges():
    rng = random.Random(0)
    base = tuple(rng.randrange(128000) for _ in range(3 * COMPARE_BLOCK + 7))
    points = {0, 1, len(base) - 1, len(base)} | {k * COMPARE_BLOCK + d for k in range(4) for d in (-1, 0, 1)}
    for at in sorted(p for p in points if 0 <= p <= len(base)):
        other = base[:at] + tuple(t + 1 for t in base[at:])  # differs from ``at`` on
        assert common_length(base, other) == reference(base, other) == at
        assert common_length(other[:at + 5], base) == reference(other[:at + 5], base)
    assert common_length(base, base[:100]) == 100 and common_length((), base) == 0
    assert common_length(base, base) == len(base)


def test_random_tuples_of_few_tokens():
    rng = random.Random(1)
    for _ in range(200):
        n = rng.randrange(0, 2 * COMPARE_BLOCK)
        a = tuple(rng.randrange(2) for _ in range(n))
        b = a[: rng.randrange(0, n + 1)] + tuple(rng.randrange(2) for _ in range(rng.randrange(0, 40)))
        assert common_length(a, b) == reference(a, b)
