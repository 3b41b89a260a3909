"""The SSD tier's files: ``DIR/<fingerprint>-<kv-scheme>/<namespace-hash>/<id>.mlxkv``.

Files are the database. At start-up the store reads the headers (only) of
its own directory into an in-memory index; other directories belong to
other models, runtimes or KV schemes and are never touched.
Leftover ``.tmp`` files (a write cut by a crash) are removed; a file whose
header is corrupt or does not match this model is unlinked with a log line.
Every tensor carries an xxh3-128 checksum that is checked on every restore
(xxh3 runs at memory speed, so this costs little next to the read), so a
file with flipped bytes is never served: the restore fails, the file is
unlinked, and the request falls back to a shorter prefix or a cold prefill.

LRU is the file mtime (touched on every restore); the byte cap is enforced
after each write by removing the oldest files. Every failure degrades to
"not stored" or "no hit"; the tier never takes serving down.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from mlxq.store.fingerprint import namespace_dir
from mlxq.store.layout import check_layout
from mlxq.store.mlxkv import (
    EntryHeader,
    Identity,
    MlxkvError,
    encode_layer,
    read_caches_steps,
    read_header,
    verify_file,
)
from mlxq.store.mlxkv import write_steps as mlxkv_write_steps
from mlxq.store.prefix import usable_prefix

log = logging.getLogger("mlxq.ssd")


SIBLING_SHARE = 0.75  # a divergent entry sharing this much of a file on disk is not written again


def _common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@dataclass
class IndexEntry:
    path: Path
    namespace: str
    tokens: tuple[int, ...]
    nbytes: int  # file size
    mtime: float
    trimmable: bool


@dataclass
class SsdStats:
    restores: int = 0
    restored_tokens: int = 0
    restore_ms_last: float = 0.0
    writes: int = 0
    written_bytes: int = 0
    write_failures: int = 0
    corrupt_removed: int = 0  # files unlinked at scan or restore because they failed a check
    evicted_files: int = 0  # removed to stay under the byte cap or superseded by a longer entry
    reaped_tmp: int = 0


@dataclass
class SsdStore:
    root: Path
    identity: Identity  # fingerprint + kv scheme; namespace varies per entry
    max_bytes: int | None = None  # None: unlimited
    model_name: str = ""
    index: dict[Path, IndexEntry] = field(default_factory=dict)
    stats: SsdStats = field(default_factory=SsdStats)
    layout: list | None = None  # the model's own caches' layout (store.layout); None: not checked
    _warned_write: bool = False
    last_restore_s: float = 0.0  # reading time of the last restore

    @property
    def directory(self) -> Path:
        return self.root / self.identity.directory

    @property
    def bytes(self) -> int:
        return sum(e.nbytes for e in list(self.index.values()))

    @property
    def longest_prefix(self) -> int:
        return max((len(e.tokens) for e in list(self.index.values())), default=0)

    # --- start-up ---------------------------------------------------------------------
    def scan(self, *, verify: bool = False) -> None:
        """Index this fingerprint's files (headers only, or every tensor when ``verify``)."""
        self.index.clear()
        if not self.directory.is_dir():
            log.info("SSD cache %s: empty (new); prompts are written here", self.directory)
            return
        for path in sorted(self.directory.glob("*/*")):
            if path.name.endswith(".tmp"):
                self._unlink(path, "a write that never finished")
                self.stats.reaped_tmp += 1
            elif path.suffix == ".mlxkv":
                try:
                    header = verify_file(path) if verify else read_header(path)
                    self._check_identity(header)
                    self._check_layout(header)
                except (MlxkvError, OSError) as exc:
                    self._discard(path, exc)
                    continue
                self._add(path, header.identity.namespace, header.tokens, header.trimmable)
        self._enforce_cap(keep=None)  # a lowered --ssd-cache-max applies at once
        log.info("SSD cache %s: %d entries, %.1f MB", self.directory, len(self.index), self.bytes / 1e6)

    def _check_identity(self, header: EntryHeader) -> None:
        ours = self.identity
        if (header.identity.fingerprint, header.identity.kv_scheme) != (ours.fingerprint, ours.kv_scheme):
            raise MlxkvError(f"written for {header.identity.fingerprint}/{header.identity.kv_scheme}, "
                             f"not {ours.fingerprint}/{ours.kv_scheme}")

    def _check_layout(self, header: EntryHeader) -> None:
        if self.layout is not None:
            check_layout(self.layout, header.layers, len(header.tokens))

    def _add(self, path: Path, namespace: str, tokens: tuple[int, ...], trimmable: bool) -> IndexEntry:
        st = path.stat()
        entry = IndexEntry(path, namespace, tokens, st.st_size, st.st_mtime, trimmable)
        self.index[path] = entry
        return entry

    # --- lookup and restore -----------------------------------------------------------
    def find(self, namespace: str, prompt: list[int], better_than: int) -> tuple[IndexEntry, int] | None:
        """The entry with the longest usable prefix of ``prompt``, if longer than ``better_than``."""
        best, best_len = None, better_than
        for entry in self.index.values():
            if entry.namespace != namespace or len(entry.tokens) <= best_len:
                continue
            n = usable_prefix(entry.tokens, entry.trimmable, prompt)
            if n > best_len:
                best, best_len = entry, n
        return None if best is None else (best, best_len)

    def load_steps(self, entry: IndexEntry) -> Generator[None, None, list | None]:
        """The entry's caches, one tensor per step (every checksum verified); None after removing a bad file.

        ``last_restore_s`` is the time spent reading, not the time between steps.
        """
        busy = 0.0
        try:
            t = time.perf_counter()
            header = read_header(entry.path)
            self._check_identity(header)
            self._check_layout(header)
            if header.tokens != entry.tokens:
                raise MlxkvError("the file changed since it was indexed")
            steps = read_caches_steps(entry.path, header)
            busy += time.perf_counter() - t
            while True:
                t = time.perf_counter()
                try:
                    next(steps)
                except StopIteration as stop:
                    caches = stop.value
                    busy += time.perf_counter() - t
                    break
                busy += time.perf_counter() - t
                yield
        except Exception as exc:  # any failure: remove the file, and the request prefills instead
            self._discard(entry.path, exc)
            return None
        now = time.time()
        try:
            os.utime(entry.path, (now, now))
            entry.mtime = now
        except OSError:
            pass
        self.stats.restores += 1
        self.stats.restored_tokens += len(entry.tokens)
        self.stats.restore_ms_last = round(busy * 1000, 3)
        self.last_restore_s = busy
        return caches

    def covers(self, namespace: str, tokens: tuple[int, ...]) -> bool:
        """Is the state after ``tokens`` durable: an exact file, or a trimmable file extending it?"""
        n = len(tokens)
        return any(e.namespace == namespace and (e.tokens == tokens or (e.trimmable and e.tokens[:n] == tokens))
                   for e in self.index.values())

    def has_sibling(self, namespace: str, tokens: tuple[int, ...]) -> bool:
        """Does a trimmable file share at least ``SIBLING_SHARE`` of ``tokens`` and then diverge?

        The ``n`` choices of one prompt end as entries that differ only in their generated
        tails; one file serves the shared prompt to every later request. A file that is a
        prefix of ``tokens`` is not a sibling: ``tokens`` extends it (the next turn) and is new.
        """
        need = SIBLING_SHARE * len(tokens)
        for e in self.index.values():
            if e.namespace == namespace and e.trimmable and len(e.tokens) >= need:
                common = _common_prefix(e.tokens, tokens)
                if common >= need and common < len(e.tokens):
                    return True
        return False

    # --- writing ----------------------------------------------------------------------
    def write_steps(self, namespace: str, tokens: tuple[int, ...], caches: list, trimmable: bool) -> Iterator[None]:
        """Write one entry, one tensor per step; then index it, supersede its ancestors, enforce the cap.

        Raises OSError when the disk refuses (counted; the entry is simply not stored).
        """
        layers = [encode_layer(c) for c in caches]
        nbytes = sum(a.nbytes for _, _, named in layers for _, a in named)
        if self.max_bytes is not None and nbytes > self.max_bytes:
            raise OSError(f"entry of {nbytes} bytes exceeds --ssd-cache-max ({self.max_bytes} bytes)")
        directory = self.directory / namespace_dir(namespace)
        try:
            directory.mkdir(parents=True, exist_ok=True)
            path = directory / f"{uuid.uuid4().hex}.mlxkv"
            header = {"fingerprint": self.identity.fingerprint, "kv_scheme": self.identity.kv_scheme,
                      "namespace": namespace, "tokens": list(tokens), "trimmable": trimmable,
                      "created": time.time(), "model": self.model_name}
            yield from mlxkv_write_steps(path, header, layers)
        except OSError as exc:
            self.stats.write_failures += 1
            if not self._warned_write:
                self._warned_write = True
                log.warning("SSD cache write failed (%s); entries are not stored until writes succeed "
                            "(this warning is shown once; /stats.ssd_cache counts failures)", exc)
            raise
        entry = self._add(path, namespace, tuple(tokens), trimmable)  # we just wrote it: no need to read it back
        self.stats.writes += 1
        self.stats.written_bytes += entry.nbytes
        for other in list(self.index.values()):
            if other is entry or other.namespace != namespace or len(other.tokens) > len(tokens):
                continue
            same = other.tokens == tokens
            if same or (trimmable and other.trimmable and tokens[: len(other.tokens)] == other.tokens):
                self._remove(other)
        self._enforce_cap(keep=entry)

    def _enforce_cap(self, keep: IndexEntry | None) -> None:
        if self.max_bytes is None:
            return
        total = self.bytes
        for victim in sorted(self.index.values(), key=lambda e: e.mtime):
            if total <= self.max_bytes:
                break
            if victim is not keep:
                self._remove(victim)
                total -= victim.nbytes

    def _remove(self, entry: IndexEntry) -> None:
        self.index.pop(entry.path, None)
        self.stats.evicted_files += 1
        entry.path.unlink(missing_ok=True)

    def _discard(self, path: Path, why: Exception) -> None:
        self.index.pop(path, None)
        self.stats.corrupt_removed += 1
        self._unlink(path, f"not usable: {why}")

    @staticmethod
    def _unlink(path: Path, why: str) -> None:
        log.warning("SSD cache: removing %s (%s)", path, why)
        try:
            path.unlink(missing_ok=True)
        except OSError as exc:
            log.warning("SSD cache: could not remove %s: %s", path, exc)
