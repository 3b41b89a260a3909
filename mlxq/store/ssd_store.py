"""The SSD tier's files: ``DIR/<fingerprint>-<kv-scheme>/<namespace-hash>/<digest>.mlxkv``, one per tree node.

Files are the database. At start-up the store reads the headers (only) of
its own directory into a tree of files (store.ssd_tree); other directories
belong to other models, runtimes or KV schemes and are never touched.
Leftover ``.tmp`` files (a write cut by a crash) are removed; a file whose
header is corrupt or does not match this model is unlinked with a log line,
and so is every file below it (a child is usable only through its parent).
Files of another format version are removed with one log line for all.

A write adds the part of an entry no file holds yet below the deepest file
chain that holds the rest, splitting a file the entry shares only in part
(store.ssd_writes). It starts only from files already renamed into place,
so a node's file is durable only after its parent's. Every tensor carries an
xxh3-128 checksum checked on every restore, so a file with flipped bytes is
never served: the restore fails, the file and its subtree are unlinked, and
the request falls back to a shorter prefix or a cold prefill.

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

from mlxq.store.cold_tier_state import SsdStats
from mlxq.store.fingerprint import namespace_dir
from mlxq.store.layout import check_layout
from mlxq.store.mlxkv import (
    EntryHeader,
    FormatVersionError,
    Identity,
    MlxkvError,
    extend,
    prefix_hasher,
    read_header,
    verify_file,
)
from mlxq.store.ssd_config import CHECKPOINT_DIR, parse_rank_dir
from mlxq.store.ssd_tree import (
    ChainMatch,
    FileNode,
    attach,
    detach,
    make_root,
    search,
    served_at_snapshots,
)
from mlxq.store.ssd_writes import entry_steps
from mlxq.store.vanished import forget_vanished

log = logging.getLogger("mlxq.ssd")


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
    rank_dir: str = ""  # tensor parallel: this rank's folder (ssd_config.rank_dir); "" alone
    _failing: bool = False  # the last write failed: the next failure is not logged again

    @property
    def directory(self) -> Path:
        return self.root / self.identity.directory / self.rank_dir  # "" (one process) adds nothing

    @property
    def bytes(self) -> int:
        return sum(node.nbytes for node in list(self.files.values()))

    @property
    def longest_prefix(self) -> int:
        return max((node.end for node in list(self.files.values())), default=0)

    def root_of(self, namespace: str) -> FileNode:
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
            if path.parent.name == CHECKPOINT_DIR or parse_rank_dir(path.parent.name) is not None:
                continue  # generation checkpoints (store/checkpoints.py); ranks' folders (tensor parallel)
            if path.name.endswith(".tmp"):
                self.unlink(path, "a write that never finished")
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
        """Parents before children. A file whose parent is missing, or whose digest does not name the prefix
        its chain spells, is removed with everything below it."""
        by_digest = {(h.identity.namespace, h.digest): (path, h) for path, h in headers.items()}
        linked: dict[tuple[str, str], tuple[FileNode, object] | None] = {}

        def node_of(key: tuple[str, str]) -> tuple[FileNode, object] | None:
            namespace, digest = key
            if digest == "":
                return self.root_of(namespace), prefix_hasher()
            if key in linked:
                return linked[key]
            if key not in by_digest:
                return None
            path, h = by_digest.pop(key)
            linked[key] = None  # a cycle of digests ends as a missing parent
            above = node_of((namespace, h.parent))
            if above is None or not above[0].in_tree or above[0].end != h.start:
                self._orphan(path, "its parent file is missing or does not end where it starts")
                return None
            hasher = extend(above[1].copy(), h.tokens)
            if hasher.hexdigest() != h.digest:
                self._discard_path(path, MlxkvError("its digest does not name the prefix its chain spells"))
                return None
            node = self._add(path, h, above[0])
            linked[key] = None if node is None else (node, hasher)
            return linked[key]

        for key in list(by_digest):
            node_of(key)

    def _add(self, path: Path, h: EntryHeader, parent: FileNode) -> FileNode | None:
        st = path.stat()
        node = FileNode(path, h.digest, parent, h.start, tuple(h.tokens), st.st_size, st.st_mtime, h.trimmable,
                        h.snapshot, h.identity.namespace)
        for other in attach(parent, node):
            # One span a prefix of its sibling's: the head of a split that a crash cut short (written, but
            # the split file not yet rewritten). The whole file stays; the split is redone when needed.
            short = min(node, other, key=lambda n: len(n.tokens))
            if (node.tokens if short is other else other.tokens)[: len(short.tokens)] != short.tokens:
                continue
            for each in short.subtree():
                self.files.pop(each.path, None)
                self.stats.unfinished_splits_removed += 1
                self.unlink(each.path, "the head of a split a crash cut short")
            detach(short)
            if short is node:
                return None
        self.files[path] = node
        return node

    def _orphan(self, path: Path, why: str) -> None:
        self.unlink(path, why)
        self.stats.orphans_removed += 1

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
        """Write the part of an entry no file holds yet, one tensor per step (store.ssd_writes); then
        enforce the cap.

        ``caches_from(m)``: the entry's caches holding only tokens [m, len(tokens)) on full-attention
        layers (and the whole state on the others). Raises OSError when the disk refuses (counted; the
        entry is simply not stored).
        """
        if self.covers(namespace, tokens):
            return  # already durable
        try:
            node = yield from entry_steps(self, namespace, tuple(tokens), caches_from, trimmable)
        except OSError as exc:
            self._count_failure(exc)
            raise
        self._count_success()
        if node is not None:
            self.touch(node.chain())  # a chain is never older than its newest file (LRU, prune --older-than)
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

    def forget_vanished(self) -> int:
        """Files another process removed (`mlxq cache prune` beside the server) leave the tree, with every
        file below them (unreachable now; a prune removes whole subtrees, so normally gone too)."""
        index = dict(self.files)
        gone = forget_vanished(index)
        for path in set(self.files) - set(index):
            node = self.files.get(path)
            if node is None:
                continue  # below another vanished file, already gone
            for each in node.subtree():
                self.files.pop(each.path, None)
                if each.path.exists():
                    self.unlink(each.path, "a file above it was removed")
            detach(node)
        return gone

    def discard(self, node: FileNode, why: Exception) -> None:
        """A file failed a check: unlink it and every file below it (they are reachable only through it)."""
        self.stats.corrupt_removed += 1
        self.unlink(node.path, f"not usable: {why}")
        for below in node.subtree()[1:]:
            self.stats.orphans_removed += 1
            self.unlink(below.path, "a file above it was not usable")
        for each in node.subtree():
            self.files.pop(each.path, None)
        detach(node)

    def _discard_path(self, path: Path, why: Exception) -> None:
        self.stats.corrupt_removed += 1
        self.unlink(path, f"not usable: {why}")

    @staticmethod
    def unlink(path: Path, why: str) -> None:
        log.warning("SSD cache: removing %s (%s)", path, why)
        try:
            path.unlink(missing_ok=True)
        except OSError as exc:
            log.warning("SSD cache: could not remove %s: %s", path, exc)
