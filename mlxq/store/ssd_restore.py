"""A restore along a chain of node files, one layer per step, reading only what RAM lacks.

The restore builds on a *base*: the first ``base.n`` tokens of the prompt,
held by the RAM tier (a node's chain) or by another restore that finished.
Every file of the chain beyond the base is read, one layer per engine step
(store/restore_reads.py: straight into host arrays, or on CUDA by MLX's
loader into device memory); a full-attention tensor is the base's rows, then
each file's rows up to its child's fork point. Rings and recurrent layers
come whole from the last file. Every tensor's checksum is checked, and the
result is used only once all of them matched: a bad file is a clean miss.

Restores that arrive together for one shared prefix do not read it twice:
the later ones wait for the first (``leader``) and build on its result.
"""

from __future__ import annotations

import os
import time
from collections.abc import Generator
from dataclasses import dataclass, field

import mlx.core as mx

from mlxq.store.entries import CacheEntry
from mlxq.store.mlxkv import EntryHeader, MlxkvError, decode_layer
from mlxq.store.prefix import common_prefix
from mlxq.store.prefix_tree import Node
from mlxq.store.restore_reads import FileFailed, cut, placement
from mlxq.store.ssd_tree import FileNode

SPAN_KINDS = ("kv", "qkv")


@dataclass
class Base:
    """The first ``n`` tokens' full-attention spans, which the restore does not read."""

    n: int = 0
    node: Node | None = None  # a RAM node whose chain holds them (a split never moves a node's end)
    entry: CacheEntry | None = None  # or another restore's result

    def pieces(self, layer: int) -> list[tuple[int, object]]:
        """(first token, span) pieces covering [0, n) for one layer."""
        if self.n == 0:
            return []
        if self.entry is not None:
            c = self.entry.caches[layer]
            return [(0, cut((c.keys, c.values), 0, self.n))]
        return [(node.depth, cut(node.spans[layer], 0, min(node.end, self.n) - node.depth))
                for node in self.node.chain() if node.depth < self.n]


@dataclass(eq=False)
class PendingRestore:
    """A restore in progress: one layer per engine step (so decoding rows never wait for all of it)."""

    chain: list[FileNode]  # root excluded
    n: int  # prompt tokens it will serve
    namespace: str
    prompt: tuple[int, ...]
    base: Base
    leader: PendingRestore | None = None  # an earlier restore of a shared prefix, waited for
    files: list[FileNode] = field(default_factory=list)  # the chain's files it reads
    spans: dict = field(default_factory=dict)  # FileNode -> (start, tokens) when planned (a split moves them)
    steps: Generator | None = None
    entry: CacheEntry | None = None  # set when done and good
    failed: tuple[FileNode, Exception] | None = None  # set when done and a file was bad
    done: bool = False
    busy_s: float = 0.0  # time spent reading and copying, not waiting between steps
    verify_wait_s: float = 0.0  # of busy_s: waiting for the checksums after the last layer loaded

    @property
    def read_bytes(self) -> int:
        return sum(node.nbytes for node in self.files)

    def plan(self, read_steps) -> None:
        """Fix the files to read (those reaching past the base) and start reading. The chain is taken anew
        from its last file (whose end a split never moves)."""
        self.chain = self.chain[-1].chain()
        self.files = files_to_read(self.chain, self.base.n)
        self.spans = {node: (node.start, node.tokens) for node in self.chain}
        self.steps = read_steps(self)

    def follow(self) -> bool:
        """Still waiting for the leader? Once it is done, build on its result (or on the old base)."""
        leader = self.leader
        if leader is None:
            return False
        if not leader.done:
            return True
        self.leader = None
        if leader.entry is not None:
            shared = common_prefix(leader.entry.tokens, self.prompt, self.n)
            if shared > self.base.n:
                self.base = Base(shared, entry=leader.entry)
        return False

    def step(self) -> bool:
        """Load one more layer; True once done (``entry`` set, or ``failed``)."""
        start = time.perf_counter()
        try:
            next(self.steps)
            return False
        except StopIteration as stop:
            self.entry = stop.value
        except FileFailed as exc:
            self.failed = (exc.node, exc.error)
        finally:
            self.busy_s += time.perf_counter() - start
        self.done = True
        return True


class StaleRead(MlxkvError):
    """A file of the chain was split or rewritten after the restore was planned: not a bad file."""


def files_to_read(chain: list[FileNode], base_n: int) -> list[FileNode]:
    """The chain's files whose part (up to the next file's fork point) reaches past ``base_n``."""
    ends = [child.start for child in chain[1:]] + [chain[-1].end]
    return [node for node, end in zip(chain, ends, strict=True) if end > base_n]


def restore_steps(pending: PendingRestore, checked_header) -> Generator[None, None, CacheEntry]:
    """Read ``pending.files`` into the result, one layer per step (store/restore_reads.py: how, by device);
    the result is returned only once every tensor matched its checksum. ``checked_header(node)``: the
    file's header, checked against the store's index (MlxkvError if not)."""
    headers: dict[FileNode, EntryHeader] = {}
    for node in pending.files:
        try:
            if pending.spans[node] != (node.start, node.tokens):
                raise StaleRead("the file was split after the restore was planned")
            headers[node] = checked_header(node)
        except (MlxkvError, OSError) as exc:
            raise FileFailed(node, exc) from None
    last = pending.chain[-1]
    last_start, last_tokens = pending.spans[last]
    end = last_start + len(last_tokens)
    fds, reads = {}, None
    try:
        for node in pending.files:
            fds[node] = os.open(node.path, os.O_RDONLY)
        reads = placement()(pending, headers, fds, end)
        caches = []
        for i, layer in enumerate(headers[last].layers):
            reads.check()
            if layer["kind"] not in SPAN_KINDS:
                tensors = reads.whole(i)
                caches.append(decode_layer(layer["kind"], layer["meta"], tensors))
            else:
                tensors = reads.spans(i)
                caches.append(decode_layer(layer["kind"], dict(layer["meta"], offset=end), tensors))
            mx.eval(list(tensors.values()))
            yield
        waited = time.perf_counter()
        reads.finish()
        pending.verify_wait_s = time.perf_counter() - waited
    finally:
        if reads is not None:
            reads.close()
        for fd in fds.values():
            os.close(fd)
    tokens = tuple(pending.prompt[:last_start]) + last_tokens
    return CacheEntry(tokens, caches, sum(c.nbytes for c in caches), last.trimmable, pending.namespace)
