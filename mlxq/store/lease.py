"""A row's hold on the stored prefix it started from (the prompt cache's ``lease``).

While a row runs, the node its prefix ends at is pinned, so the whole chain
from the root stays in the tree: eviction never drops a prefix a running
row uses, and the prefix's bytes stay counted once, by the tree. The row
releases the lease when it finishes, is cancelled, fails or is preempted
(a preempted row takes a new lease when it comes back).

What the row computes on (``caches``) is its own: full-attention layers
are the concatenation of the chain's spans (a copy), rings and recurrent
state copy-on-write views of the node's snapshot. A lease from the tree
builds them when first read: a burst's rows whose prefixes are gathered from
the spans themselves (engine/prefix_gather.py) never read them, and building
32 layers of lazy concatenations per row cost the H200's engine thread
~0.5-0.8 ms a lease. A batch cache kind that
references the shared prefix instead of copying it (kv/shared_prefix_cache.py)
reads the same chain: ``chain()`` lists the nodes root-first; node ``k``'s
``spans[layer]`` holds the keys and values (each an array, or a quantized
triple, shaped [1, heads, tokens, dim]) of its own ``tokens``; the prefix is
their concatenation along the token axis, cut to ``cached`` tokens (a lease
may end inside its last node); ``layer_spans()`` gives them per layer, cut,
for ``kv.sharing_plan.prefix_from_spans``. What they hold never changes
while the lease is held: the tree only adds children, and a split replaces
a node's spans by two halves holding the same values.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from mlx.utils import tree_map

from mlxq.kv.capabilities import is_trimmable
from mlxq.store.prefix_tree import Node


@dataclass(eq=False)
class Lease:
    cached: int  # prompt tokens the prefix serves (0: nothing was found)
    _caches: list | None  # the row's caches holding them (None when nothing was found); read ``caches``
    node: Node | None = None  # the pinned node: the chain ends at it (None: nothing pinned)
    _unpin: Callable[[Node], None] | None = field(default=None, repr=False)
    _build: Callable[[], list] | None = field(default=None, repr=False)  # makes ``caches`` when first read
    _all_spans: bool = field(default=False, repr=False)  # with ``_build``: every layer full attention

    @classmethod
    def deferred(cls, cached: int, build: Callable[[], list], all_spans: bool, node: Node,
                 unpin: Callable[[Node], None]) -> Lease:
        """A lease whose caches ``build()`` makes when first read; ``all_spans``: every layer of them
        full attention (what ``trimmable`` answers without building them)."""
        return cls(cached, None, node, unpin, build, all_spans)

    @property
    def caches(self) -> list | None:
        if self._build is not None:
            self._caches, self._build = self._build(), None
        return self._caches

    @property
    def trimmable(self) -> bool:
        """Every layer of its caches full attention (``is_trimmable``), known without building them."""
        return self._all_spans if self._build is not None else self._caches is not None and is_trimmable(self._caches)

    def chain(self) -> list[Node]:
        """The nodes whose spans hold the prefix, root first (empty when nothing is pinned)."""
        return [] if self.node is None else self.node.chain()

    def layer_spans(self) -> list[list | None]:
        """Per layer, the chain's spans root first, the last cut to ``cached`` tokens (a lazy slice,
        no copy); None for layers kept as snapshots. What kv/sharing_plan.prefix_from_spans takes."""
        chain = [node for node in self.chain() if node.depth < self.cached]  # a later split may add nodes past it
        if not chain:
            return []
        out = []
        for layer in range(len(chain[0].spans)):
            spans = [node.spans[layer] for node in chain]
            if spans[0] is None:
                out.append(None)
                continue
            keep = self.cached - chain[-1].depth  # tokens of the last node inside the prefix
            out.append(spans[:-1] + [tree_map(lambda a, k=keep: a[..., :k, :], spans[-1])])
        return out

    def joined(self) -> None:
        """The row left its own caches for the batch's: keep the pin, drop the caches (a lent prefix's
        concatenation, once evaluated, is a copy of it that nothing reads any more)."""
        self._caches, self._build = None, None

    @property
    def held(self) -> bool:
        return self.node is not None

    def release(self) -> None:
        """Let the chain be evicted again; a second call does nothing."""
        node, self.node = self.node, None
        if node is not None and self._unpin is not None:
            self._unpin(node)

