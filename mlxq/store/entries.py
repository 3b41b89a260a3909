"""What the RAM tier names and hands out: entries, and a row's caches assembled from tree nodes."""

from __future__ import annotations

from dataclasses import dataclass

from mlxq.kv.capabilities import is_spans, ops_of
from mlxq.store import kv_spans
from mlxq.store.prefix_tree import Node


@dataclass
class CacheEntry:
    """An entry read back from the SSD tier: its caches, whole."""

    tokens: tuple[int, ...]
    caches: list
    nbytes: int
    trimmable: bool
    namespace: str = ""


@dataclass(eq=False)
class TreeEntry:
    """A logical entry: the prefix ending at ``node``. Its caches are assembled when asked for
    (the SSD tier writes the part its files lack); detached nodes keep their arrays for it."""

    tokens: tuple[int, ...]
    node: Node
    snapshot: list | None
    layout: tuple
    nbytes: int  # the whole prefix: what one file of it holds
    trimmable: bool
    namespace: str = ""

    @property
    def caches(self) -> list:
        return assemble(self.layout, self.node.chain(), self.snapshot, len(self.tokens))

    @property
    def last_used(self) -> float:
        return self.node.last_used

    def caches_from(self, start: int) -> list:
        """Caches holding only tokens [start, n) on full-attention layers and the whole state on the
        others: what the SSD tier writes when its files already hold the first ``start`` tokens."""
        nodes = [node for node in self.node.chain() if node.end > start] or [self.node]
        skip, n = start - nodes[0].depth, len(self.tokens) - start
        return [kv_spans.assemble_layer(layer, [node.spans[i] for node in nodes], n, skip) if layer.spans
                else kv_spans.lend_snapshot(self.snapshot[i]) for i, layer in enumerate(self.layout)]


def assemble(layout: tuple, nodes: list[Node], snapshot: list | None, n: int) -> list:
    out = []
    for i, layer in enumerate(layout):
        if layer.spans:
            out.append(kv_spans.assemble_layer(layer, [node.spans[i] for node in nodes], n))
        else:
            out.append(kv_spans.lend_snapshot(snapshot[i]))
    return out


def holds(cache, n: int) -> bool:
    """Does ``cache`` hold state for exactly (untrimmable) or at least (KVCache) n tokens?"""
    return ops_of(cache).holds(getattr(cache, "offset", 0), n)


def prefix_bytes(caches: list, n: int) -> int:
    """Bytes of an entry of ``n`` tokens: full-attention layers scale with n, snapshots are whole."""
    total = 0
    for c in caches:
        if is_spans(c):
            total += sum(a.nbytes // a.shape[-2] * n for a in kv_spans.arrays((c.keys, c.values)))
        else:
            total += kv_spans.nbytes(kv_spans.snapshot_arrays(c))
    return total
