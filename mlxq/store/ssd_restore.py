"""A restore along a chain of node files, one tensor per step, reading only what RAM lacks.

The restore builds on a *base*: the first ``base.n`` tokens of the prompt,
held by the RAM tier (a node's chain) or by another restore that finished.
Each full-attention tensor of the result is allocated once at its final size;
the base is copied in, then every file of the chain beyond the base is read
straight from the file into its rows (one read per head, large and
sequential; each file's checksum is computed over the bytes as they land).
A file's rows past its child's fork point are overwritten by the child. No
tensor is read into a temporary and copied again, and nothing is
concatenated. Rings and recurrent layers come whole from the last file.

Restores that arrive together for one shared prefix do not read it twice:
the later ones wait for the first (``leader``) and build on its result.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Generator
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np
import xxhash
from mlx.utils import tree_map

from mlxq.store.entries import CacheEntry
from mlxq.store.mlxkv import DTYPES, EntryHeader, MlxkvError, decode_layer, read_exactly
from mlxq.store.prefix import common_prefix
from mlxq.store.prefix_tree import Node
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
            return [(0, _cut((c.keys, c.values), 0, self.n))]
        return [(node.depth, _cut(node.spans[layer], 0, min(node.end, self.n) - node.depth))
                for node in self.node.chain() if node.depth < self.n]


@dataclass(eq=False)
class PendingRestore:
    """A restore in progress: one tensor per engine step (so decoding rows never wait for all of it)."""

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
        """Read one more tensor; True once done (``entry`` set, or ``failed``)."""
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
    """Read ``pending.files`` into the result, one output tensor per step. ``checked_header(node)``:
    the file's header, checked against the store's index (MlxkvError if not)."""
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
    fds = {}
    try:
        for node in pending.files:
            fds[node] = os.open(node.path, os.O_RDONLY)
        caches = []
        for i, layer in enumerate(headers[last].layers):
            if layer["kind"] not in SPAN_KINDS:
                tensors = {}
                for t in layer["tensors"]:
                    tensors[t["name"]] = _read_whole(fds[last], headers[last], t, last)
                    yield
                caches.append(decode_layer(layer["kind"], layer["meta"], tensors))
                continue
            tensors = {}
            for k, t in enumerate(layer["tensors"]):
                tensors[t["name"]] = _assemble_tensor(pending, headers, fds, i, k, t, end)
                yield
            caches.append(decode_layer(layer["kind"], dict(layer["meta"], offset=end), tensors))
    finally:
        for fd in fds.values():
            os.close(fd)
    tokens = tuple(pending.prompt[:last_start]) + last_tokens
    return CacheEntry(tokens, caches, sum(c.nbytes for c in caches), last.trimmable, pending.namespace)


def _read_whole(fd: int, header: EntryHeader, t: dict, node: FileNode) -> mx.array:
    array = mx.zeros(t["shape"], DTYPES[t["dtype"]], stream=mx.cpu)  # filled and read on the host
    mx.eval(array)
    view = memoryview(array).cast("B") if t["nbytes"] else memoryview(bytearray())
    if read_exactly(fd, view, header.data_start + t["offset"]) != t["nbytes"]:
        raise _FileFailed(node, MlxkvError(f"tensor {t['name']!r} is truncated"))
    if xxhash.xxh3_128_hexdigest(view) != t["xxh3"]:
        raise _FileFailed(node, MlxkvError(f"tensor {t['name']!r} fails its checksum"))
    return array


def _assemble_tensor(pending: PendingRestore, headers: dict, fds: dict, layer: int, k: int, last_t: dict,
                     end: int) -> mx.array:
    """One full-attention tensor ([..., tokens, width]) of ``end`` tokens: base rows, then each file's rows."""
    shape = [*last_t["shape"][:-2], end, last_t["shape"][-1]]
    dtype = DTYPES[last_t["dtype"]]
    out = mx.zeros(shape, dtype, stream=mx.cpu)  # filled and read on the host
    mx.eval(out)
    outer, row = math.prod(shape[:-2]), shape[-1] * dtype.size
    rows = np.frombuffer(memoryview(out).cast("B"), dtype=np.uint8).reshape(outer, end * row) if out.nbytes \
        else np.zeros((outer, 0), np.uint8)
    for first, span in pending.base.pieces(layer):
        part = mx.contiguous(_part(span, k))
        mx.eval(part)
        n = part.shape[-2]
        src = np.frombuffer(memoryview(part).cast("B"), dtype=np.uint8).reshape(outer, n * row)
        rows[:, first * row : (first + n) * row] = src
    for node in pending.files:
        _read_rows(fds[node], headers[node], layer, k, node, pending.spans[node][0], rows, row, end)
    return out


def _part(span, k: int) -> mx.array:
    """The k-th tensor of a span in file order: keys, values; or keys.data/scales/biases, values.*."""
    flat = [a for side in span for a in (side if isinstance(side, tuple | list) else (side,))]
    return flat[k]


def _read_rows(fd: int, header: EntryHeader, layer: int, k: int, node: FileNode, start: int, rows: np.ndarray,
               row: int, end: int) -> None:
    """A file's k-th tensor of ``layer`` into rows [start, ...) of ``rows`` (what fits before ``end``),
    hashing every byte of it in file order."""
    t = header.layers[layer]["tensors"][k]
    span = t["shape"][-2]
    fits = min(span, end - start)
    hasher = xxhash.xxh3_128()
    at = header.data_start + t["offset"]
    spill = np.empty((span - fits) * row, np.uint8)
    for o in range(rows.shape[0]):
        into = rows[o, start * row : (start + fits) * row]
        for buf in (into, spill):
            if read_exactly(fd, memoryview(buf), at) != buf.nbytes:
                raise _FileFailed(node, MlxkvError(f"tensor {t['name']!r} of layer {layer} is truncated"))
            hasher.update(buf)
            at += buf.nbytes
    if hasher.hexdigest() != t["xxh3"]:
        raise _FileFailed(node, MlxkvError(f"tensor {t['name']!r} of layer {layer} fails its checksum"))


def _cut(span, lo: int, hi: int):
    return tree_map(lambda a: a[..., lo:hi, :], span)
