"""The RAM tier: a byte-capped prefix tree of KV spans, each span stored once (store.prefix_tree).

``take`` walks the prompt down the namespace's tree and hands the row caches
it owns for the longest usable prefix (capped at len(prompt) - 1, so at
least one token is always computed and sampled from fresh logits); the row
never writes what is stored. ``put`` adds only the tokens the tree does not
hold yet: the agents of one system prompt share its node, and the byte cap
counts it once.

Full-attention models (every layer a ``KVCache``) are *trimmable*: any
prefix along a stored path is usable. Sliding-window rings and recurrent
state cannot be cut back, so their lanes store *snapshots* at prompt
boundaries (the end of a system prompt, the last-but-one prompt token) and
a prompt is served only from a node that holds one.

Each put names a logical *entry* (namespace, tokens): what ``len()``
counts, what idle demotion and the SSD tier see (the SSD tier writes the
part of an entry its files lack). A
trimmable entry that a longer put extends is superseded; snapshot entries
keep their ancestors. Eviction removes the least recently used unpinned
leaf, then any ancestor left as an unmarked leaf. Pinned nodes (``pin``)
are never evicted.

With a cold tier attached (store.cold_tier), every put is reported to it
(write-behind to SSD), every removal says why (an evicted entry that is not
yet on disk is spilled: the entry still reaches its detached nodes), and
``take`` asks it for a strictly longer usable prefix than RAM holds, which
it restores into RAM before lending.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import mlx.core as mx

from mlxq.kv.capabilities import can_cache, is_spans, is_trimmable
from mlxq.store import kv_spans
from mlxq.store.charge import Charge
from mlxq.store.entries import CacheEntry, TreeEntry, assemble, holds, prefix_bytes
from mlxq.store.lease import Lease
from mlxq.store.prefix import MIN_SNAPSHOT_TOKENS
from mlxq.store.prefix_tree import Node, add_child, detach, match, split

__all__ = ["CacheEntry", "Key", "Lease", "PromptCache", "MIN_SNAPSHOT_TOKENS", "TreeEntry", "can_cache",
           "is_trimmable"]


@dataclass
class PromptCacheStats:
    queries: int = 0  # take() calls
    hits: int = 0  # take() calls that lent a prefix
    hit_tokens: int = 0  # prompt tokens served from the cache
    puts: int = 0
    evictions: int = 0  # entries evicted under the byte cap


@dataclass
class _Tree:
    layout: tuple
    root: Node = field(default_factory=lambda: Node((), None, []))

    @property
    def trimmable(self) -> bool:
        return all(layer.spans for layer in self.layout)




Key = tuple[str, tuple[int, ...]]  # (namespace, exact tokens)


@dataclass
class _Deferred:
    arrays: list = field(default_factory=list)  # spans cut or split since ``defer_evaluation``
    grown: list[Node] = field(default_factory=list)  # the leaves those puts added


def _assemble_to(layout: tuple, end: Node, snapshot: list | None, n: int) -> list:
    """A row's caches for the ``n`` tokens the chain ending at ``end`` serves (``snapshot`` for the
    layers kept as snapshots: the one found at the lookup, which a demotion may since have dropped
    from the node). The chain is walked when called: a split since the lookup made the *new* node
    the upper half, so the nodes named then may hold fewer tokens now."""
    chain = [node for node in end.chain() if node.depth < n]
    return assemble(layout, chain, snapshot, n)


class PromptCache:
    def __init__(self, max_bytes: int, charge: Charge | None = None):
        self.max_bytes = max_bytes
        self.charge = charge  # pipeline parallel: bytes counted alike on every rank (store/charge.py)
        self._trees: dict[str, _Tree] = {}
        self._entries: dict[Key, TreeEntry] = {}
        self._leaves: set[Node] = set()
        self.nodes = 0
        self.splits = 0  # nodes cut in two: the only change to a held lease's chain (admission's tallies)
        self.changes = 0  # stores, splits, removals, dropped snapshots: a lookup may find otherwise after one
        self._last_lookup: tuple | None = None  # (changes, prompt, its length, namespace, what _lookup found)
        self.bytes = 0  # what the tree holds: each span once
        self.entry_bytes = 0  # what the entries would hold as separate copies
        self.stats = PromptCacheStats()
        self.cold = None  # store.cold_tier.ColdTier, when an SSD tier is configured
        self._deferred: _Deferred | None = None  # after ``defer_evaluation``: the spans waiting

    def __len__(self) -> int:
        return len(self._entries)

    # --- lookups ----------------------------------------------------------------------
    def _lookup(self, namespace: str, prompt: list[int]) -> tuple[list[Node], Node | None, int]:
        """(nodes to assemble from, the snapshot node or None, tokens served) for the longest usable prefix."""
        memo = self._last_lookup
        if memo is not None and memo[0] == self.changes and memo[1] is prompt and memo[2] == len(prompt) \
                and memo[3] == namespace:
            nodes, holder, n = memo[4]
            return list(nodes), holder, n  # the caller's own list, as a walk gives it
        found = self._lookup_anew(namespace, prompt)
        # Admission asks for a request's path (``held_path``), then leases it: one walk of its 16k
        # tokens, not two. Kept for the same list object, unchanged in length, and an unchanged tree.
        self._last_lookup = (self.changes, prompt, len(prompt), namespace, found)
        return found

    def _lookup_anew(self, namespace: str, prompt: list[int]) -> tuple[list[Node], Node | None, int]:
        tree = self._trees.get(namespace)
        limit = len(prompt) - 1
        if tree is None or limit <= 0:
            return [], None, 0
        found = match(tree.root, tuple(prompt), limit)
        if tree.trimmable:
            nodes = found.path + ([found.partial] if found.partial is not None else [])
            return nodes, None, found.length
        for i in range(len(found.path) - 1, -1, -1):
            if found.path[i].snapshot is not None:
                return found.path[: i + 1], found.path[i], found.path[i].end
        return [], None, 0

    def held_path(self, namespace: str, prompt: list[int]) -> tuple[list[Node], int]:
        """The nodes (and token count) ``take`` would lend from, without counting a query: what an SSD
        restore builds on instead of reading it again."""
        nodes, _, n = self._lookup(namespace, prompt)
        return nodes, n

    def take(self, namespace: str, prompt: list[int], cold: bool = True) -> tuple[list | None, int]:
        """(caches the caller owns, cached token count) for the longest usable prefix, or (None, 0).

        ``cold=False`` looks in RAM only (the batch lane restores from disk step by step,
        then calls ``lease_restored``)."""
        build, n, _ = self._take(namespace, prompt, cold)
        return (None if build is None else build()), n

    def lease(self, namespace: str, prompt: list[int], cold: bool = True) -> Lease:
        """``take``, with the node chain the prefix came from pinned until ``Lease.release``; from RAM,
        the caches are built when the lease's are first read (``Lease.deferred``)."""
        build, n, node = self._take(namespace, prompt, cold)
        if node is not None:
            node.pins += 1
            return Lease.deferred(n, build, self._trees[namespace].trimmable, node, self.unpin)
        if n:  # read back from disk into the tree: pinned if it fit
            return Lease(n, build(), self.pin(namespace, prompt[:n]), self.unpin)
        return Lease(0, None, None, self.unpin)

    def lease_stored(self, namespace: str, tokens: list[int], caches: list) -> Lease:
        """A lease on what the caller just stored (``put`` of ``tokens`` from ``caches``), lending its own
        ``caches``: a row that prefilled a prefix others follow holds the chain they lease, so grouping
        sees them on one prefix (nothing pinned, an empty lease, when the tree did not keep it)."""
        node = self.pin(namespace, tokens)
        return Lease(len(tokens) if node is not None else 0, caches, node, self.unpin)

    def lease_restored(self, namespace: str, entry: CacheEntry, n: int, previous: int) -> Lease:
        """``adopt_restored``, with the stored prefix pinned (when it fit the tier)."""
        caches = self.adopt_restored(namespace, entry, n, previous)
        return Lease(n, caches, self.pin(namespace, list(entry.tokens[:n])), self.unpin)

    def _take(self, namespace: str, prompt: list[int], cold: bool
              ) -> tuple[Callable[[], list] | None, int, Node | None]:
        """(what builds the caches, cached tokens, the node the prefix ends at or inside of; None when
        it came from disk)."""
        self.stats.queries += 1
        nodes, holder, n = self._lookup(namespace, prompt)
        if self.cold is not None and cold:
            restored = self.cold.restore(namespace, prompt, better_than=n)
            if restored is not None:
                entry, m = restored
                caches = self.adopt_restored(namespace, entry, m, previous=0)
                return (lambda: caches), m, None
        if not n:
            return None, 0, None
        for node in nodes:
            node.touch()
        self.stats.hits += 1
        self.stats.hit_tokens += n
        end = holder or nodes[-1]
        snapshot = holder.snapshot if holder else None
        return partial(_assemble_to, self._trees[namespace].layout, end, snapshot, n), n, end

    def adopt_restored(self, namespace: str, entry: CacheEntry, n: int, previous: int) -> list:
        """Hold an entry read from disk (already durable; kept only if it fits the tier) and lend its
        first ``n`` tokens to the request that asked for it, which had ``previous`` tokens from RAM."""
        self._store(namespace, list(entry.tokens), entry.caches, durable=True)
        if not previous:
            self.stats.hits += 1
        self.stats.hit_tokens += n - previous
        return [kv_spans.lend(c, n) for c in entry.caches]

    # --- storing ----------------------------------------------------------------------
    def put(self, namespace: str, tokens: list[int], caches: list) -> None:
        """Store ``caches``' state after exactly ``tokens`` (KVCaches may hold more): only what is new."""
        if self._store(namespace, tokens, caches, durable=False):
            self.stats.puts += 1

    def _store(self, namespace: str, tokens: list[int], caches: list, *, durable: bool) -> bool:
        self.changes += 1
        n = len(tokens)
        if n == 0 or not all(holds(c, n) for c in caches) or self._entry_bytes(caches, n) > self.max_bytes:
            return False
        layout = kv_spans.layout_of(caches)
        tree = self._trees.setdefault(namespace, _Tree(layout))
        if tree.layout != layout:
            return False  # another cache structure under this namespace: never mix them
        key = (namespace, tuple(tokens))
        found = match(tree.root, key[1], n)
        if key in self._entries or (tree.trimmable and found.length == n):
            # An exact duplicate, or a prefix a longer stored path already serves.
            for node in found.path + ([found.partial] if found.partial is not None else []):
                node.touch()
            return True
        node = self._grow(tree, found, key[1], caches)
        self._mark(tree, node, key, caches, durable)
        for each in node.chain():
            each.touch()
        node.pins += 1  # the new entry is not its own eviction victim
        self._evict_to_cap()
        node.pins -= 1
        if self.bytes > self.max_bytes and not node.children and not node.pins:
            self._remove_leaf(node, "evicted")  # pinned entries leave no room for it
        return True

    def defer_evaluation(self) -> None:
        """Puts from here on leave the spans they cut (and split) unevaluated until ``evaluate_deferred``:
        a step's finishing rows' puts then cost one device sync, not one or more each. The caller's
        caches must stay as they are until then (views into a batch that nothing writes meanwhile)."""
        if self._deferred is None:
            self._deferred = _Deferred()

    def evaluate_deferred(self) -> None:
        """Evaluate what the puts since ``defer_evaluation`` cut, all at once, and put evaluation back
        to each put's own. If that fails, the leaves they grew are removed again (the newest first),
        and the error is raised."""
        deferred, self._deferred = self._deferred, None
        if deferred is None:
            return
        try:
            mx.eval(deferred.arrays)
        except Exception:
            for node in reversed(deferred.grown):
                if node.in_tree and not node.children and not node.pins:
                    self._remove_leaf(node, "failed")
            raise

    def _evaluate(self, arrays: list) -> None:
        """New spans evaluated in one call (one device sync), or with the deferred puts'."""
        if self._deferred is not None:
            self._deferred.arrays += arrays
        else:
            mx.eval(arrays)

    def _grow(self, tree: _Tree, found, tokens: tuple[int, ...], caches: list) -> Node:
        """The node ending exactly at len(tokens): an existing one, the upper half of a split, or a new leaf."""
        end = self._match_end(tree, found)
        if found.length == len(tokens):
            return end
        spans = [kv_spans.cut_span(c, found.length, len(tokens)) if layer.spans else None
                 for layer, c in zip(tree.layout, caches, strict=True)]
        self._evaluate(kv_spans.arrays([s for s in spans if s is not None]))  # a failure leaves the tree as it was
        child = add_child(end, tokens[found.length :], spans)
        if self._deferred is not None:
            self._deferred.grown.append(child)
        self._leaves.discard(end)
        self._leaves.add(child)
        self.nodes += 1
        self.bytes += self._bytes_of(child)
        return child

    def _match_end(self, tree: _Tree, found) -> Node:
        """The node ``found`` (a prefix_tree.Match) ends at: when it ends inside a node, the upper half
        of that node split there."""
        if found.partial is not None:
            self.nodes += 1
            self.splits += 1
            self.changes += 1
            return split(found.partial, found.length - found.partial.depth, self._evaluate)
        return found.path[-1] if found.path else tree.root

    def _mark(self, tree: _Tree, node: Node, key: Key, caches: list, durable: bool) -> None:
        """Name the entry ending at ``node`` (with its snapshot, for rings and recurrent state)."""
        snapshot = None
        if not tree.trimmable:
            snapshot = [None if layer.spans else kv_spans.take_snapshot(c)
                        for layer, c in zip(tree.layout, caches, strict=True)]
            mx.eval([kv_spans.snapshot_arrays(s) for s in snapshot if s is not None])
            self._set_snapshot(node, snapshot)
        entry = TreeEntry(key[1], node, snapshot, tree.layout, prefix_bytes(caches, len(key[1])),
                          tree.trimmable, key[0])
        node.mark = entry
        self._entries[key] = entry
        self.entry_bytes += entry.nbytes
        if tree.trimmable:
            for ancestor in node.chain()[:-1]:
                if ancestor.mark is not None:
                    self._unmark(ancestor, "superseded")  # the new entry serves every prompt it served
        if self.cold is not None and not durable:
            self.cold.on_put(key, entry)

    # --- removal ----------------------------------------------------------------------
    def _unmark(self, node: Node, reason: str) -> None:
        entry, node.mark = node.mark, None
        key = (entry.namespace, entry.tokens)
        del self._entries[key]
        self.entry_bytes -= entry.nbytes
        if self.cold is not None:
            self.cold.on_removed(key, entry, reason)

    def _remove_leaf(self, leaf: Node, reason: str) -> None:
        """Detach an unpinned leaf, then any ancestor it leaves as an unmarked, unpinned leaf."""
        self.changes += 1
        if leaf.mark is not None:
            if reason == "evicted":
                self.stats.evictions += 1
            self._unmark(leaf, reason)
        detach(leaf)
        self._leaves.discard(leaf)
        self.nodes -= 1
        self.bytes -= self._bytes_of(leaf)
        parent = leaf.parent
        if parent.parent is not None and not parent.children:
            self._leaves.add(parent)
            if parent.mark is None and not parent.pins:
                self._remove_leaf(parent, reason)

    def _bytes_of(self, node: Node) -> int:
        """What ``node`` counts against the cap: its own bytes, or under a charge (pipeline parallel, where
        each rank's nodes hold other layers) the figure every rank counts alike."""
        if self.charge is not None:
            return self.charge.node(len(node.tokens), node.snapshot is not None)
        return node.nbytes

    def _set_snapshot(self, node: Node, snapshot: list | None) -> None:
        """``node``'s snapshot replaced (None: dropped), the tree's byte count with it."""
        self.changes += 1
        self.bytes -= self._bytes_of(node)
        node.snapshot = snapshot
        self.bytes += self._bytes_of(node)

    def _entry_bytes(self, caches: list, n: int) -> int:
        if self.charge is not None:
            return self.charge.node(n, not all(is_spans(c) for c in caches))
        return prefix_bytes(caches, n)

    def _evict_to_cap(self) -> None:
        while self.bytes > self.max_bytes:
            victims = [leaf for leaf in self._leaves if not leaf.pins]
            if not victims:
                return
            self._remove_leaf(min(victims, key=lambda leaf: leaf.tick), "evicted")

    def drop(self, key: Key) -> None:
        """Let go of an entry that is safe on SSD (idle demotion)."""
        entry = self._entries.get(key)
        if entry is None:
            return
        node = entry.node
        if not node.children and not node.pins:
            self._remove_leaf(node, "demoted")
            return
        self._unmark(node, "demoted")
        if node.snapshot is not None:
            self._set_snapshot(node, None)

    # --- pins -------------------------------------------------------------------------
    def pin(self, namespace: str, tokens: list[int]) -> Node | None:
        """Keep the stored prefix ``tokens`` (and so its whole path) from eviction until ``unpin``;
        None when the tree does not hold all of it."""
        tree = self._trees.get(namespace)
        if tree is None or not tokens:
            return None
        found = match(tree.root, tuple(tokens), len(tokens))
        if found.length != len(tokens):
            return None
        node = self._match_end(tree, found)
        node.pins += 1
        return node

    def unpin(self, node: Node) -> None:
        node.pins -= 1
        if node.pins == 0 and node.in_tree and not node.children and node.mark is None:
            self._remove_leaf(node, "released")
        self._evict_to_cap()

    # --- reporting --------------------------------------------------------------------
    def idle_keys(self, older_than: float) -> list[Key]:
        """Keys of entries not taken or put since the monotonic time ``older_than``."""
        return [k for k, e in self._entries.items() if e.last_used < older_than]

    def as_dict(self) -> dict:
        s = self.stats
        return {"entries": len(self._entries), "bytes": self.bytes, "max_bytes": self.max_bytes,
                "nodes": self.nodes, "entry_bytes": self.entry_bytes,
                "queries": s.queries, "hits": s.hits, "hit_tokens": s.hit_tokens, "puts": s.puts,
                "evictions": s.evictions}
