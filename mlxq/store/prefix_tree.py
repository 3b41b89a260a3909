"""A radix tree of token spans: each node holds one run of tokens and that run's KV, stored once.

The path from the root to a node spells a token prefix; a node's ``spans``
hold the full-attention KV of its own tokens only, so a system prompt shared
by a thousand agents is one node and a thousand short children. Layers that
cannot be cut into spans (rings, recurrent state) keep a ``snapshot`` at the
end of the nodes where one was captured.

Why radix rather than hash-chained fixed blocks (vLLM): the lanes store whole
prompts and continuations at arbitrary token counts, and snapshots must sit
at exact token boundaries (the end of a system prompt, the last-but-one
prompt token), which a radix node boundary gives for free; a block chain
would round them or need partial blocks. Lookup walks one node per shared
run: a dict lookup on the next token, then one slice comparison in C, so its
cost grows with the prompt's length and not with the number of entries.

Invariants the prompt cache keeps: a node object never changes which prefix
ends at it (a split makes the *new* node the upper half), so a reference to
a node is a stable name for "the prefix ending here", even after the node
leaves the tree; only leaves are removed, and only unpinned ones.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mlxq.store.kv_spans import Span, arrays, nbytes, snapshot_nbytes, split_span

if TYPE_CHECKING:
    from mlxq.store.entries import TreeEntry

_ticks = itertools.count(1)


@dataclass(eq=False)
class Node:
    tokens: tuple[int, ...]  # this node's own run (the root's is empty)
    parent: Node | None
    spans: list[Span | None]  # per layer: this run's K/V (full attention), None for snapshot layers
    depth: int = 0  # tokens before this node: its prefix ends at depth + len(tokens)
    children: dict[int, Node] = field(default_factory=dict)  # by first token
    snapshot: list | None = None  # per layer: ring / recurrent state at this node's end (None on span layers)
    pins: int = 0  # running rows and lent entries that need this node kept
    mark: TreeEntry | None = None  # the logical entry ending here, if any
    tick: int = 0  # LRU order
    last_used: float = field(default_factory=time.monotonic)
    in_tree: bool = True

    @property
    def end(self) -> int:
        return self.depth + len(self.tokens)

    @property
    def nbytes(self) -> int:
        return nbytes([s for s in self.spans if s is not None]) + snapshot_nbytes(self.snapshot or [])

    def touch(self) -> None:
        self.tick = next(_ticks)
        self.last_used = time.monotonic()

    def chain(self) -> list[Node]:
        """The nodes from the first below the root down to this one."""
        return chain_to(self)


def chain_to(node) -> list:
    """The nodes from the first below the root down to ``node``, in any tree whose nodes name their
    ``parent`` (the root's is None)."""
    out = []
    while node.parent is not None:
        out.append(node)
        node = node.parent
    return out[::-1]


COMPARE_BLOCK = 512  # tokens per slice comparison in ``common_length``


def common_length(a: tuple, b: tuple) -> int:
    """Length of the common prefix of two tuples: blocks compared as slices (in C), then one block
    element by element. A binary search over whole-prefix slices compared ~14 x the prefix for a
    16k-token prompt diverging near its end (an agent's question after a shared system prompt);
    this compares it about once (0.66 -> 0.06 ms)."""
    n = min(len(a), len(b))
    for lo in range(0, n, COMPARE_BLOCK):
        hi = min(n, lo + COMPARE_BLOCK)
        if a[lo:hi] != b[lo:hi]:
            return next(i for i in range(lo, hi) if a[i] != b[i])
    return n


@dataclass
class Match:
    path: list[Node]  # fully matched nodes, root excluded
    partial: Node | None  # the node the match ends inside of, if it stops mid-node
    length: int  # matched tokens


def match(root: Node, prompt: tuple[int, ...], limit: int) -> Match:
    """Walk ``prompt`` (at most ``limit`` tokens) down from ``root``."""
    node, depth, path = root, 0, []
    while depth < limit:
        child = node.children.get(prompt[depth])
        if child is None:
            break
        size = len(child.tokens)
        if size <= limit - depth and prompt[depth : depth + size] == child.tokens:
            path.append(child)
            depth += size
            node = child
            continue
        within = common_length(child.tokens, prompt[depth : min(limit, depth + size)])
        return Match(path, child, depth + within)
    return Match(path, None, depth)


def split(node: Node, at: int, evaluate: Callable[[list], None]) -> Node:
    """Cut ``node`` after ``at`` of its tokens; the new upper node is returned, ``node`` keeps the rest.
    ``evaluate(arrays)`` gets every layer's halves at once, before the tree changes."""
    heads, tails = [], []
    for span in node.spans:
        head, tail = (None, None) if span is None else split_span(span, at)
        heads.append(head)
        tails.append(tail)
    evaluate(arrays([s for s in heads + tails if s is not None]))
    upper = Node(node.tokens[:at], node.parent, heads, node.depth, tick=node.tick, last_used=node.last_used)
    node.parent.children[node.tokens[0]] = upper
    upper.children[node.tokens[at]] = node
    node.tokens, node.spans, node.parent, node.depth = node.tokens[at:], tails, upper, node.depth + at
    return upper


def add_child(parent: Node, tokens: tuple[int, ...], spans: list) -> Node:
    child = Node(tokens, parent, spans, parent.end)
    parent.children[tokens[0]] = child
    child.touch()
    return child


def detach(leaf: Node) -> None:
    """Take a leaf out of the tree (its arrays live on while something still references the node)."""
    assert not leaf.children and leaf.parent is not None
    del leaf.parent.children[leaf.tokens[0]]
    leaf.in_tree = False

