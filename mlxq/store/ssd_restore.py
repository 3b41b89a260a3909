"""A restore along a chain of node files, one tensor per step, reading only what RAM lacks.

The RAM tier already holds the first ``base_n`` tokens of the prompt (its
nodes are referenced, never copied); the files whose part of the chain lies
beyond them are read, each tensor straight into its MLX array. Restores that
arrive together share their reads (``FileRead``): agents restarting on one
system prompt read its file once. The row's caches are the RAM spans, then
each file's span cut at its child's fork point; rings and recurrent layers
come whole from the last file's snapshot.
"""

from __future__ import annotations

import time
from collections.abc import Generator
from dataclasses import dataclass, field

from mlx.utils import tree_map

from mlxq.store import kv_spans
from mlxq.store.entries import CacheEntry
from mlxq.store.mlxkv import EntryHeader, decode_layer
from mlxq.store.prefix_tree import Node
from mlxq.store.ssd_tree import FileNode


@dataclass(eq=False)
class FileRead:
    """One file being read (or read): shared by every restore that needs it while any holds it."""

    node: FileNode
    steps: Generator  # yields per tensor; returns (header, [{name: array}] per layer)
    result: tuple[EntryHeader, list[dict]] | None = None
    error: Exception | None = None
    busy_s: float = 0.0  # time spent reading, not waiting between steps

    @property
    def done(self) -> bool:
        return self.result is not None or self.error is not None

    def advance(self) -> None:
        start = time.perf_counter()
        try:
            next(self.steps)
        except StopIteration as stop:
            self.result = stop.value
        except Exception as exc:  # any failure: the file is bad; the caller removes it
            self.error = exc
        self.busy_s += time.perf_counter() - start


@dataclass
class PendingRestore:
    """A restore in progress: one tensor per engine step (so decoding rows never wait for all of it)."""

    chain: list[FileNode]  # root excluded
    n: int  # prompt tokens it will serve
    namespace: str
    prompt: tuple[int, ...]
    base: Node | None  # the RAM node whose chain holds the first base_n tokens (a split may insert nodes
    # above it, but never changes where it ends, so its chain is read when the restore is built)
    base_n: int
    reads: list[FileRead]  # the files of the chain beyond base_n, in chain order
    entry: CacheEntry | None = None  # set when done and good
    failed: FileRead | None = None  # set when done and a file was bad
    started: float = field(default_factory=time.perf_counter)

    @property
    def read_bytes(self) -> int:
        return sum(r.node.nbytes for r in self.reads)

    def step(self) -> bool:
        """Advance the first unfinished read by one tensor; True once every read is done."""
        for read in self.reads:
            if read.error is not None:
                self.failed = read
                return True
            if not read.done:
                read.advance()
                return False
        return True


def files_to_read(chain: list[FileNode], base_n: int) -> list[FileNode]:
    """The chain's files whose part (up to the next file's fork point) reaches past ``base_n``."""
    ends = [child.start for child in chain[1:]] + [chain[-1].end]
    return [node for node, end in zip(chain, ends, strict=True) if end > base_n]


def build_entry(pending: PendingRestore) -> CacheEntry:
    """The restored prefix as whole caches: RAM spans + each file's part, and the last file's snapshots."""
    chain, last = pending.chain, pending.chain[-1]
    tokens = tuple(pending.prompt[: last.start]) + last.tokens
    headers = {read.node: read.result[0] for read in pending.reads}
    decoded = {read.node: [decode_layer(layer["kind"], layer["meta"], t)
                           for layer, t in zip(read.result[0].layers, read.result[1], strict=True)]
               for read in pending.reads}
    ends = {node: end for node, end in zip(chain, [c.start for c in chain[1:]] + [last.end], strict=True)}
    caches = []
    for i, layer in enumerate(headers[last].layers):
        if layer["kind"] not in ("kv", "qkv"):
            caches.append(decoded[last][i])
            continue
        base = pending.base.chain() if pending.base is not None else []
        pieces = [_cut(node.spans[i], 0, min(node.end, pending.base_n) - node.depth)
                  for node in base if node.depth < pending.base_n]
        for read in pending.reads:
            node, cache = read.node, decoded[read.node][i]
            lo = max(node.start, pending.base_n) - node.start
            pieces.append(_cut((cache.keys, cache.values), lo, ends[node] - node.start))
        layout = kv_spans.layout_of([decoded[last][i]])[0]
        caches.append(kv_spans.assemble_layer(layout, pieces, len(tokens)))
    return CacheEntry(tokens, caches, sum(c.nbytes for c in caches), last.trimmable, pending.namespace)


def _cut(span, lo: int, hi: int):
    return tree_map(lambda a: a[..., lo:hi, :], span)
