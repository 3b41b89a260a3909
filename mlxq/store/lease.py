"""A row's hold on the stored prefix it started from (the prompt cache's ``lease``).

While a row runs, the node its prefix ends at is pinned, so the whole chain
from the root stays in the tree: eviction never drops a prefix a running
row uses, and the prefix's bytes stay counted once, by the tree. The row
releases the lease when it finishes, is cancelled, fails or is preempted
(a preempted row takes a new lease when it comes back).

What the row computes on (``caches``) is, for now, its own: full-attention
layers are the concatenation of the chain's spans (a copy), rings and
recurrent state copy-on-write views of the node's snapshot. A batch cache
kind that references the shared prefix instead of copying it reads the same
chain: ``chain()`` lists the nodes root-first; node ``k``'s ``spans[layer]``
holds the keys and values (each an array, or a quantized triple, shaped
[1, heads, tokens, dim]) of its own ``tokens``; the prefix is their
concatenation along the token axis, cut to ``cached`` tokens (a lease may end
inside its last node). Those arrays are immutable while the lease is held:
the tree only ever adds children, and a split replaces a node's spans by two
halves without changing the prefix it names.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from mlxq.store.prefix_tree import Node


@dataclass(eq=False)
class Lease:
    cached: int  # prompt tokens the prefix serves (0: nothing was found)
    caches: list | None  # the row's caches holding them (None when nothing was found)
    node: Node | None = None  # the pinned node: the chain ends at it (None: nothing pinned)
    _unpin: Callable[[Node], None] | None = field(default=None, repr=False)

    def chain(self) -> list[Node]:
        """The nodes whose spans hold the prefix, root first (empty when nothing is pinned)."""
        return [] if self.node is None else self.node.chain()

    @property
    def held(self) -> bool:
        return self.node is not None

    def release(self) -> None:
        """Let the chain be evicted again; a second call does nothing."""
        node, self.node = self.node, None
        if node is not None and self._unpin is not None:
            self._unpin(node)

