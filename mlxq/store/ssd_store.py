"""The SSD tier's files: ``DIR/<fingerprint>-<kv-scheme>/<namespace-hash>/<digest>.mlxkv``, one per tree node.

Files are the database. At start-up the store reads the headers (only) of
its own directory into a tree of files (store.ssd_tree); other directories
belong to other models, runtimes or KV schemes and are never touched.
Leftover ``.tmp`` files (a write cut by a crash) are removed; a file whose
header is corrupt or does not match this model is unlinked with a log line,
and so is every file below it (a child is usable only through its parent).
Files of another format version are removed with one log line for all.

A write adds one file: the tokens of an entry that no file holds yet, forked
from the deepest file chain that holds the rest. It starts only from files
already renamed into place, so a node's file is durable only after its
parent's. Every tensor carries an xxh3-128 checksum checked on every restore,
so a file with flipped bytes is never served: the restore fails, the file and
its subtree are unlinked, and the request falls back to a shorter prefix or a
cold prefill.

LRU is the file mtime (a restore touches its whole chain); the byte cap is
enforced after each write by removing the least recently used leaf files
(never a parent that children still need). Every failure degrades to "not
stored" or "no hit"; the tier never takes serving down.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from mlxq.store.fingerprint import namespace_dir
from mlxq.store.layout import check_layout
from mlxq.store.mlxkv import (
    ABSENT,
    EntryHeader,
    FormatVersionError,
    Identity,
    MlxkvError,
    encode_layer,
    node_digest,
    read_header,
    verify_file,
)
from mlxq.store.mlxkv import write_steps as mlxkv_write_steps
from mlxq.store.ssd_tree import (
    ChainMatch,
    FileNode,
    attach,
    detach,
    make_root,
    search,
    served_at_snapshots,
    served_by_any_prefix,
)

log = logging.getLogger("mlxq.ssd")


@dataclass
class SsdStats:
    restores: int = 0
    restored_tokens: int = 0
    restore_ms_last: float = 0.0
    read_files: int = 0  # node files read by restores (a prefix shared by many restores counts once)
    read_bytes: int = 0
    writes: int = 0  # node files written
    written_bytes: int = 0
    write_failures: int = 0
    corrupt_removed: int = 0  # files unlinked at scan or restore because they failed a check
    orphans_removed: int = 0  # files unlinked because a file above them was missing or bad
    old_format_removed: int = 0  # files of another format version, removed at scan
    evicted_files: int = 0  # removed to stay under the byte cap
    reaped_tmp: int = 0


@dataclass
class SsdStore:
    root: Path
    identity: Identity  # fingerprint + kv scheme; namespace varies per file
    max_bytes: int | None = None  # None: unlimited
    model_name: str = ""
    files: dict[Path, FileNode] = field(default_factory=dict)
    roots: dict[str, FileNode] = field(default_factory=dict)  # namespace -> its tree's root
    stats: SsdStats = field(default_factory=SsdStats)
    layout: list | None = None  # the model's own caches' layout (store.layout); None: not checked
    _failing: bool = False  # the last write failed: the next failure is not logged again

    @property
    def directory(self) -> Path:
        return self.root / self.identity.directory

    @property
    def bytes(self) -> int:
        return sum(node.nbytes for node in list(self.files.values()))

    @property
    def longest_prefix(self) -> int:
        return max((node.end for node in list(self.files.values())), default=0)

    def _root(self, namespace: str) -> FileNode:
        return self.roots.setdefault(namespace, make_root(namespace))

    # --- start-up ---------------------------------------------------------------------
    def scan(self, *, verify: bool = False) -> None:
        """Index this fingerprint's files as a tree (headers only, or every tensor when ``verify``)."""
        self.files.clear()
        self.roots.clear()
        if not self.directory.is_dir():
            log.info("SSD cache %s: empty (new); prompts are written here", self.directory)
            return
        headers: dict[Path, EntryHeader] = {}
        for path in sorted(self.directory.glob("*/*")):
            if path.name.endswith(".tmp"):
                self._unlink(path, "a write that never finished")
                self.stats.reaped_tmp += 1
            elif path.suffix == ".mlxkv":
                header = self._scan_one(path, verify)
                if header is not None:
                    headers[path] = header
        if self.stats.old_format_removed:
            log.warning("SSD cache %s: removed %d files of another .mlxkv format version "
                        "(written by another mlxq; they are regenerated as prompts arrive)",
                        self.directory, self.stats.old_format_removed)
        self._link(headers)
        self._enforce_cap(keep=None)  # a lowered --ssd-cache-max applies at once
        log.info("SSD cache %s: %d node files, %.1f MB", self.directory, len(self.files), self.bytes / 1e6)

    def _scan_one(self, path: Path, verify: bool) -> EntryHeader | None:
        try:
            header = verify_file(path) if verify else read_header(path)
            self._check(header, path)
            return header
        except FormatVersionError:
            self.stats.old_format_removed += 1
            path.unlink(missing_ok=True)
        except (MlxkvError, OSError) as exc:
            self._discard_path(path, exc)
        return None

    def _check(self, header: EntryHeader, path: Path) -> None:
        ours = self.identity
        if (header.identity.fingerprint, header.identity.kv_scheme) != (ours.fingerprint, ours.kv_scheme):
            raise MlxkvError(f"written for {header.identity.fingerprint}/{header.identity.kv_scheme}, "
                             f"not {ours.fingerprint}/{ours.kv_scheme}")
        if path.stem != header.digest or path.parent.name != namespace_dir(header.identity.namespace):
            raise MlxkvError("its name or directory does not match its header")
        if self.layout is not None:
            check_layout(self.layout, header.layers, len(header.tokens), header.end)

    def _link(self, headers: dict[Path, EntryHeader]) -> None:
        """Parents before children: a file whose parent is missing or bad is an orphan (removed)."""
        by_digest = {(h.identity.namespace, h.digest): (path, h) for path, h in headers.items()}
        linked: dict[tuple[str, str], FileNode] = {}

        def node_of(key: tuple[str, str]) -> FileNode | None:
            if key in linked:
                return linked[key]
            namespace, digest = key
            if digest == "":
                return self._root(namespace)
            if key not in by_digest:
                return None
            path, h = by_digest.pop(key)  # popped first: a cycle of digests ends as a missing parent
            parent = node_of((namespace, h.parent))
            if parent is None or not (parent.start <= h.start <= parent.end) or (not h.parent and h.start):
                self._unlink(path, "its parent file is missing or does not hold its fork point")
                self.stats.orphans_removed += 1
                return None
            linked[key] = self._add(path, h, parent)
            return linked[key]

        for key in list(by_digest):
            node_of(key)

    def _add(self, path: Path, h: EntryHeader, parent: FileNode) -> FileNode:
        st = path.stat()
        node = FileNode(path, h.digest, parent, h.start, tuple(h.tokens), st.st_size, st.st_mtime, h.trimmable,
                        h.snapshot, h.identity.namespace)
        if attach(parent, node) is not None:
            raise MlxkvError("a second file for the same branch")  # not reachable: content-addressed names
        self.files[path] = node
        return node

    # --- lookup -----------------------------------------------------------------------
    def find(self, namespace: str, prompt: list[int], better_than: int) -> ChainMatch | None:
        """The chain serving the longest usable prefix of ``prompt`` (all but its last token), if longer
        than ``better_than``."""
        root = self.roots.get(namespace)
        if root is None:
            return None
        found = search(root, prompt, len(prompt) - 1, served_at_snapshots)
        return found if found.n > better_than else None

    def covers(self, namespace: str, tokens: tuple[int, ...]) -> bool:
        """Is the state after ``tokens`` durable (a chain serves all of them)?"""
        root = self.roots.get(namespace)
        return root is not None and search(root, tokens, len(tokens), served_at_snapshots).n == len(tokens)

    def checked_header(self, node: FileNode) -> EntryHeader:
        """A node file's header, checked again before its tensors are read (the file may have changed)."""
        header = read_header(node.path)
        self._check(header, node.path)
        if (header.parent, header.start, header.tokens) != (node.parent.digest, node.start, node.tokens):
            raise MlxkvError("the file changed since it was indexed")
        return header

    def touch(self, chain: list[FileNode]) -> None:
        now = time.time()
        for node in chain:
            try:
                os.utime(node.path, (now, now))
                node.mtime = now
            except OSError:
                pass

    # --- writing ----------------------------------------------------------------------
    def write_steps(self, namespace: str, tokens: tuple[int, ...], caches_from: Callable[[int], list],
                    trimmable: bool) -> Iterator[None]:
        """Write the part of an entry no file holds yet, one tensor per step; then index it and enforce the cap.

        ``caches_from(m)``: the entry's caches holding only tokens [m, len(tokens)) on full-attention
        layers (and the whole state on the others). Raises OSError when the disk refuses (counted; the
        entry is simply not stored).
        """
        if self.covers(namespace, tokens):
            return  # already durable
        root = self._root(namespace)
        found = search(root, tokens, len(tokens), served_by_any_prefix)
        parent, fork = (found.chain[-1] if found.chain else root), found.n
        if found.chain and not parent.tokens:
            parent = parent.parent  # never fork from an empty span: attach beside it
        caches = caches_from(fork)
        layers = [ABSENT if c is None else encode_layer(c) for c in caches]
        nbytes = sum(a.nbytes for _, _, named in layers for _, a in named)
        if self.max_bytes is not None and nbytes > self.max_bytes:
            raise OSError(f"a node of {nbytes} bytes exceeds --ssd-cache-max ({self.max_bytes} bytes)")
        span = tuple(tokens[fork:])
        digest = node_digest(parent.digest, fork, span)
        directory = self.directory / namespace_dir(namespace)
        path = directory / f"{digest}.mlxkv"
        header = {"fingerprint": self.identity.fingerprint, "kv_scheme": self.identity.kv_scheme,
                  "namespace": namespace, "digest": digest, "parent": parent.digest, "start": fork,
                  "tokens": list(span), "trimmable": trimmable, "snapshot": True,
                  "created": time.time(), "model": self.model_name}
        try:
            directory.mkdir(parents=True, exist_ok=True)
            yield from mlxkv_write_steps(path, header, layers)
        except OSError as exc:
            self._count_failure(exc)
            raise
        if not parent.in_tree and parent.parent is not None:
            self._unlink(path, "its parent was removed while it was written")
            return
        node = self._add(path, EntryHeader(self.identity, digest, parent.digest, fork, span, trimmable, True, 0.0,
                                           [], ""), parent)
        self.stats.writes += 1
        self.stats.written_bytes += node.nbytes
        self._count_success()
        self.touch(parent.chain())  # a chain is never older than its newest file (LRU, prune --older-than)
        self._enforce_cap(keep=node)

    def _count_failure(self, exc: OSError) -> None:
        self.stats.write_failures += 1
        if not self._failing:
            self._failing = True
            log.warning("SSD cache write failed (%s); serving goes on from RAM and entries are not stored "
                        "until a write succeeds (logged once; /stats.ssd_cache counts failures)", exc)

    def _count_success(self) -> None:
        if self._failing:
            self._failing = False
            log.warning("SSD cache writes succeed again (%d failed in all; `mlxq cache flush` retries them)",
                        self.stats.write_failures)

    # --- removal ----------------------------------------------------------------------
    def _enforce_cap(self, keep: FileNode | None) -> None:
        """Remove least recently used leaf files (never ``keep``'s chain) until under the cap."""
        if self.max_bytes is None:
            return
        total, kept = self.bytes, set(keep.chain()) if keep is not None else set()
        while total > self.max_bytes:
            leaves = [n for n in self.files.values() if not n.children and n not in kept]
            if not leaves:
                return
            victim = min(leaves, key=lambda n: n.mtime)
            self._remove(victim)
            self.stats.evicted_files += 1
            total -= victim.nbytes

    def _remove(self, node: FileNode) -> None:
        detach(node)
        self.files.pop(node.path, None)
        node.path.unlink(missing_ok=True)

    def discard(self, node: FileNode, why: Exception) -> None:
        """A file failed a check: unlink it and every file below it (they are reachable only through it)."""
        self.stats.corrupt_removed += 1
        self._unlink(node.path, f"not usable: {why}")
        for below in node.subtree()[1:]:
            self.stats.orphans_removed += 1
            self._unlink(below.path, "a file above it was not usable")
        for each in node.subtree():
            self.files.pop(each.path, None)
        detach(node)

    def _discard_path(self, path: Path, why: Exception) -> None:
        self.stats.corrupt_removed += 1
        self._unlink(path, f"not usable: {why}")

    @staticmethod
    def _unlink(path: Path, why: str) -> None:
        log.warning("SSD cache: removing %s (%s)", path, why)
        try:
            path.unlink(missing_ok=True)
        except OSError as exc:
            log.warning("SSD cache: could not remove %s: %s", path, exc)
