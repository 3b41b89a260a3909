"""A restore along a chain of node files, one layer per step, reading only what RAM lacks.

The restore builds on a *base*: the first ``base.n`` tokens of the prompt,
held by the RAM tier (a node's chain) or by another restore that finished.
Every file of the chain beyond the base is loaded by MLX's own loader
(store/tensor_view.py: on CUDA straight into device memory, the reads spread
over threads), one layer per engine step; a full-attention tensor is the
base's rows, then each file's rows up to its child's fork point, joined on
the device. Rings and recurrent layers come whole from the last file. Every
tensor's checksum is computed by a thread pool from its own read of the
file while the layers load (store/verify_pool.py), and the result is used
only once all of them matched: a bad file is a clean miss.

Restores that arrive together for one shared prefix do not read it twice:
the later ones wait for the first (``leader``) and build on its result.
"""

from __future__ import annotations

import os
import time
from collections.abc import Generator
from dataclasses import dataclass, field

import mlx.core as mx
from mlx.utils import tree_map

from mlxq.store.entries import CacheEntry
from mlxq.store.mlxkv import EntryHeader, MlxkvError, decode_layer
from mlxq.store.prefix import common_prefix
from mlxq.store.prefix_tree import Node
from mlxq.store.ssd_tree import FileNode
from mlxq.store.tensor_view import TensorPiece, load_pieces, read_pool
from mlxq.store.verify_pool import TensorCheck, Verification

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
            return [(0, _cut((c.keys, c.values), 0, self.n))]
        return [(node.depth, _cut(node.spans[layer], 0, min(node.end, self.n) - node.depth))
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
        except _FileFailed as exc:
            self.failed = (exc.node, exc.error)
        finally:
            self.busy_s += time.perf_counter() - start
        self.done = True
        return True


class StaleRead(MlxkvError):
    """A file of the chain was split or rewritten after the restore was planned: not a bad file."""


class _FileFailed(Exception):
    def __init__(self, node: FileNode, error: Exception):
        super().__init__(str(error))
        self.node, self.error = node, error


def files_to_read(chain: list[FileNode], base_n: int) -> list[FileNode]:
    """The chain's files whose part (up to the next file's fork point) reaches past ``base_n``."""
    ends = [child.start for child in chain[1:]] + [chain[-1].end]
    return [node for node, end in zip(chain, ends, strict=True) if end > base_n]


def restore_steps(pending: PendingRestore, checked_header) -> Generator[None, None, CacheEntry]:
    """Load ``pending.files`` into the result, one layer per step, while a thread pool checks every tensor's
    checksum (store/verify_pool.py); the result is returned only once all of them matched.
    ``checked_header(node)``: the file's header, checked against the store's index (MlxkvError if not)."""
    headers: dict[FileNode, EntryHeader] = {}
    for node in pending.files:
        try:
            if pending.spans[node] != (node.start, node.tokens):
                raise StaleRead("the file was split after the restore was planned")
            headers[node] = checked_header(node)
        except (MlxkvError, OSError) as exc:
            raise _FileFailed(node, exc) from None
    last = pending.chain[-1]
    last_start, last_tokens = pending.spans[last]
    end = last_start + len(last_tokens)
    fds, checks = {}, None
    try:
        for node in pending.files:
            fds[node] = os.open(node.path, os.O_RDONLY)
        checks = Verification([TensorCheck(node, f"{t['name']} of layer {i}", fds[node],
                                           headers[node].data_start + t["offset"], t["nbytes"], t["xxh3"])
                               for node in pending.files for i, layer in enumerate(headers[node].layers)
                               for t in layer["tensors"]])
        caches = []
        for i, layer in enumerate(headers[last].layers):
            _raise_failure(checks.failure())
            if layer["kind"] not in SPAN_KINDS:
                tensors = _load(last, fds[last], headers[last], i)
                caches.append(decode_layer(layer["kind"], layer["meta"], tensors))
            else:
                tensors = _assemble_layer(pending, headers, fds, i, end)
                caches.append(decode_layer(layer["kind"], dict(layer["meta"], offset=end), tensors))
            mx.eval(list(tensors.values()))
            yield
        waited = time.perf_counter()
        _raise_failure(checks.wait())
        pending.verify_wait_s = time.perf_counter() - waited
    finally:
        if checks is not None:
            checks.close()
        for fd in fds.values():
            os.close(fd)
    tokens = tuple(pending.prompt[:last_start]) + last_tokens
    return CacheEntry(tokens, caches, sum(c.nbytes for c in caches), last.trimmable, pending.namespace)


def _raise_failure(failure: tuple[FileNode, str] | None) -> None:
    if failure is not None:
        raise _FileFailed(failure[0], MlxkvError(failure[1]))


def _load(node: FileNode, fd: int, header: EntryHeader, layer: int) -> dict[str, mx.array]:
    """One layer's tensors of one file, by MLX's own loader (store/tensor_view.py)."""
    pieces = [TensorPiece(t["name"], fd, header.data_start + t["offset"], t["nbytes"], tuple(t["shape"]),
                          t["dtype"]) for t in header.layers[layer]["tensors"]]
    arrays, short = load_pieces(pieces, read_pool())
    if short:
        raise _FileFailed(node, MlxkvError(f"tensor {short[0]!r} of layer {layer} is truncated"))
    return arrays


def _assemble_layer(pending: PendingRestore, headers: dict, fds: dict, layer: int, end: int) -> dict:
    """One full-attention layer's tensors ([..., tokens, width]) of ``end`` tokens: the base's rows up to
    the first file read, then each file's rows up to the next file's fork point (or ``end``)."""
    loaded = {node: _load(node, fds[node], headers[node], layer) for node in pending.files}
    starts = [pending.spans[node][0] for node in pending.files] + [end]
    names = [t["name"] for t in headers[pending.files[-1]].layers[layer]["tensors"]]
    base = [(first, span) for first, span in pending.base.pieces(layer) if first < starts[0]]
    out = {}
    for k, name in enumerate(names):
        parts = [_cut(_part(span, k), 0, min(starts[0] - first, _part(span, k).shape[-2])) for first, span in base]
        parts += [_cut(loaded[node][name], 0, starts[j + 1] - starts[j]) for j, node in enumerate(pending.files)]
        out[name] = mx.contiguous(parts[0]) if len(parts) == 1 else mx.concatenate(parts, axis=-2)
    return out


def _part(span, k: int) -> mx.array:
    """The k-th tensor of a span in file order: keys, values; or keys.data/scales/biases, values.*."""
    flat = [a for side in span for a in (side if isinstance(side, tuple | list) else (side,))]
    return flat[k]


def _cut(span, lo: int, hi: int):
    """Rows [lo, hi) of every tensor of a span (a view: no copy until the layer is concatenated)."""
    return tree_map(lambda a: a if lo == 0 and a.shape[-2] == hi else a[..., lo:hi, :], span)
