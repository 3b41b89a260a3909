"""Generation checkpoints on disk: ``DIR/<fingerprint>-<kv scheme>/checkpoints/<key digest>-<end>.mlxkv``.

A request's checkpoint is a chain of links (store/checkpoint_links.py): each
publish writes only the span since the request's previous link, chained to
it by name, and the newest link is the request's current checkpoint. A link
is written to ``.tmp`` and renamed into place (mlxkv's write: tmp, fsync,
rename, directory fsync), after its parent: a link whose parent is gone by
then is dropped, and the request's next publish starts a new chain at token
0. Links of an older chain go once a new first link is durable; completion
retires the whole chain at once (no restore from it), its removal queued
behind any write of it in progress, so an older cleanup never erases a
newer attempt's files.

The engine thread only hands over arrays it owns (copies, evaluated or
scheduled by it: store/checkpoint_pack.py); a writer thread puts them on
disk, so a decode step never waits for the disk.
A publish that finds the queue over its byte cap is dropped; a write the
disk refuses (full, too large) is counted and dropped; the request goes on
either way. A restore walks the newest chain of its key, links still queued
or being written read from memory, and is all or nothing: a missing, torn
or corrupt link is a miss.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import asdict
from pathlib import Path

from mlxq.store.checkpoint_links import (
    CheckpointRecord,
    LinkLayers,
    join_chain,
    link_header,
    link_name,
    parse_link_name,
)
from mlxq.store.checkpoint_pack import PackedTensor
from mlxq.store.checkpoint_state import CheckpointCounters, CheckpointFlush, LinkJob, newest_chain, reaches_first
from mlxq.store.layout import check_layout
from mlxq.store.mlxkv import Identity, MlxkvError, read_arrays_steps, read_header, run_steps, write_file
from mlxq.store.spent_buffers import SpentBuffers

__all__ = ["CheckpointFlush", "CheckpointRecord", "CheckpointStore"]

log = logging.getLogger("mlxq.checkpoints")

DEFAULT_QUEUE_BYTES = 2 * 2**30  # arrays waiting for the writer; a publish beyond it is dropped


class CheckpointStore:
    def __init__(self, directory: Path, identity: Identity, model_name: str = "", *, layout: list | None = None,
                 max_bytes: int | None = None, queue_bytes: int = DEFAULT_QUEUE_BYTES):
        self.directory = directory
        self.identity = identity
        self.model_name = model_name
        self.layout = layout  # the model's caches (store.layout): a file that does not match is removed
        self.max_bytes = max_bytes  # a link larger than the SSD tier's cap is never written
        self.queue_bytes = queue_bytes
        self.counters = CheckpointCounters()
        self._links: dict[str, dict[int, int]] = {}  # key digest -> end -> start, of its durable links
        self._retired: set[str] = set()  # completed: never restored, removal queued
        self._queue: deque[LinkJob] = deque()
        self._writing: LinkJob | None = None  # the job being run
        self._dropped_since_flush = 0
        self._cond = threading.Condition()
        self._writer: threading.Thread | None = None
        self.spent = SpentBuffers()  # host-read buffers of links written, until the engine clears MLX's cache

    def _path(self, key: str, end: int) -> Path:
        return self.directory / f"{link_name(key, end)}.mlxkv"

    # --- start-up ---------------------------------------------------------------------
    def scan(self) -> None:
        """Index the directory's links (headers only); leftovers of cut writes, bad files and links that
        no longer reach a first link go."""
        if not self.directory.is_dir():
            return
        for path in sorted(self.directory.iterdir()):
            if path.name.endswith(".tmp"):
                path.unlink(missing_ok=True)
            elif path.suffix == ".mlxkv":
                try:
                    header, record = self._check(path)
                    self._links.setdefault(record.key, {})[record.end] = header.start
                except (MlxkvError, OSError) as exc:
                    self._remove_bad(path, exc)
        for key, links in self._links.items():
            for end in [e for e in links if not reaches_first(links, e)]:
                del links[end]
                self._remove_bad(self._path(key, end), MlxkvError("its chain does not reach a first link"))
        self._links = {key: links for key, links in self._links.items() if links}
        log.info("generation checkpoints in %s: %d", self.directory, len(self._links))

    def _check(self, path: Path):
        """The link's header and record, checked against its name, this model and the KV layout."""
        header = read_header(path)
        if header.checkpoint is None:
            raise MlxkvError("not a checkpoint")
        record = CheckpointRecord.from_header(header.checkpoint)
        if (header.identity.fingerprint, header.identity.kv_scheme) != (self.identity.fingerprint,
                                                                        self.identity.kv_scheme):
            raise MlxkvError("written for another model or KV scheme")
        if parse_link_name(path.stem) != (record.key, record.end) or header.end != record.end:
            raise MlxkvError("its name or token counts do not match its record")
        if self.layout is not None:
            check_layout(self.layout, header.layers, header.end - header.start, header.end)
        return header, record

    def _remove_bad(self, path: Path, exc: Exception) -> None:
        log.warning("removing checkpoint link %s: %s", path, exc)
        path.unlink(missing_ok=True)
        self.counters.corrupt_removed += 1

    # --- the engine thread ------------------------------------------------------------
    def is_link(self, key: str, end: int) -> bool:
        """Whether a publish may chain onto ``key``'s link ending at ``end``: durable, or queued to be written."""
        with self._cond:
            return key not in self._retired and self._parent_known(key, end)

    def publish(self, record: CheckpointRecord, tokens: list[int], layers: list, trimmable: bool,
                start: int = 0) -> bool:
        """Queue the link of ``record`` covering ``tokens[start:]`` (``layers``: encoded layers, span layers
        cut at ``start``, their tensors packed: store/checkpoint_pack.py), chained to the link ending at
        ``start``; False when dropped."""
        nbytes = sum(a.nbytes for _, _, named in layers for _, a in named)
        header = link_header(record, start, tokens, trimmable, self.identity, self.model_name)
        with self._cond:
            self._retired.discard(record.key)
            queued = sum(j.nbytes for j in self._queue)
            over = queued + nbytes > self.queue_bytes or (self.max_bytes is not None and nbytes > self.max_bytes)
            if over or (start and not self._parent_known(record.key, start)):
                self._drop()
                return False
            self._queue.append(LinkJob(record.key, layers, start, record.end, header, nbytes, record))
            self._start_writer()
            self._cond.notify_all()
        return True

    def note_dropped(self) -> None:
        """A link the engine could not copy (its staging failed): dropped, and the next flush says so."""
        with self._cond:
            self._drop()

    def queued_bytes(self) -> int:
        """Bytes of links queued or being written: copied off the device, not yet on disk."""
        with self._cond:
            return sum(job.nbytes for job in self._jobs())

    def _parent_known(self, key: str, end: int) -> bool:
        return end in self._links.get(key, {}) or any(j.key == key and j.end == end and j.layers is not None
                                                        for j in self._jobs())

    def _jobs(self) -> list[LinkJob]:
        return [*([self._writing] if self._writing is not None else []), *self._queue]

    def retire(self, key: str) -> None:
        """The request completed: its checkpoint is never restored again, and its links go (behind any
        write of them queued or in progress)."""
        with self._cond:
            if key not in self._links and all(j.key != key for j in self._jobs()):
                return  # never published: nothing to remove
            self._retired.add(key)
            for job in [j for j in self._queue if j.key == key]:
                self._queue.remove(job)
                self._let_go(job)
            self._queue.append(LinkJob(key, None))
            self._start_writer()
            self._cond.notify_all()

    def find(self, key: str) -> Path | None:
        """The newest durable link of ``key`` (None: none, or retired)."""
        with self._cond:
            links = {} if key in self._retired else self._links.get(key, {})
            return self._path(key, max(links)) if links else None

    def load(self, key: str) -> tuple[CheckpointRecord, list] | None:
        """The newest checkpoint's record and caches: its whole chain, links not written yet from memory
        (a client that left and came back at once), the others from their files, every tensor checked.
        A missing or bad link is a miss (a bad file is removed)."""
        with self._cond:
            if key in self._retired:
                return None
            chain = self._chain(key)
        if not chain:
            return None
        links = []
        for i, item in enumerate(chain):
            try:
                links.append(self._read_link(key, item))
            except (MlxkvError, OSError) as exc:
                log.warning("checkpoint of %s not restored: %s", key, exc)
                ends = [x[1] for x in chain[i:] if not isinstance(x, LinkJob)]
                if isinstance(exc, MlxkvError):
                    self._cut(key, ends, exc)
                else:  # a file that vanished (superseded meanwhile, or removed by hand): no longer indexed
                    self._forget(key, ends[:1])
                return None
        try:
            return links[-1][0], join_chain([link for _, link in links])
        except MlxkvError as exc:
            log.warning("checkpoint of %s not restored: %s", key, exc)
            return None

    def _forget(self, key: str, ends: list[int]) -> None:
        with self._cond:
            for end in ends:
                self._links.get(key, {}).pop(end, None)

    def _cut(self, key: str, ends: list[int], exc: Exception) -> None:
        """Remove the links ending at ``ends``: a bad one and those above it, which could never restore (the
        links below stay: an older checkpoint of the request)."""
        self._forget(key, ends)
        for end in ends:
            if (path := self._path(key, end)).exists():
                self._remove_bad(path, exc)

    def _chain(self, key: str) -> list:
        """The newest chain of ``key``, first link first: each a queued job or (start, end) of a file."""
        jobs = [j for j in self._jobs() if j.key == key and j.layers is not None]
        return newest_chain(self._links.get(key, {}), jobs)

    def _read_link(self, key: str, item) -> tuple[CheckpointRecord, LinkLayers]:
        if isinstance(item, LinkJob):  # copies: the restored caches are updated in place, the writer reads these
            layers = [(kind, meta, {name: a.array() for name, a in named}) for kind, meta, named in item.layers]
            return item.record, LinkLayers(item.start, item.end, layers)
        path = self._path(key, item[1])
        header, record = self._check(path)
        tensors = run_steps(read_arrays_steps(path, header))
        layers = [(layer["kind"], layer["meta"], tensors[i]) for i, layer in enumerate(header.layers)]
        return record, LinkLayers(header.start, header.end, layers)

    def note_restored(self, tokens: int) -> None:
        self.counters.restored += 1
        self.counters.restored_tokens += tokens

    # --- durability (any thread) ------------------------------------------------------
    def flush(self, timeout: float) -> CheckpointFlush:
        """Wait until every publish queued so far is written (or ``timeout``)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._jobs() and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(left)
            pending = len(self._jobs())
            dropped, self._dropped_since_flush = self._dropped_since_flush, 0
            return CheckpointFlush(pending == 0 and dropped == 0, pending, dropped, len(self._links),
                                   sum(len(links) for links in self._links.values()))

    def as_dict(self) -> dict:
        with self._cond:
            pending = len(self._jobs())
            paths = [self._path(key, end) for key, links in self._links.items() for end in links]
            requests = len(self._links)
        nbytes = sum(_size(p) for p in paths)
        return {"requests": requests, "files": len(paths), "bytes": nbytes, "pending": pending,
                **asdict(self.counters)}

    # --- the writer thread ------------------------------------------------------------
    def _drop(self) -> None:
        self.counters.dropped += 1
        self._dropped_since_flush += 1

    def _start_writer(self) -> None:
        if self._writer is None:
            self._writer = threading.Thread(target=self._write_loop, name="mlxq-checkpoints", daemon=True)
            self._writer.start()

    def _write_loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    self._cond.wait()
                job = self._writing = self._queue.popleft()
            try:
                self._run(job) if job.layers is not None else self._remove_chain(job.key)
            finally:
                with self._cond:
                    self._writing = None
                    self._cond.notify_all()
                self._let_go(job)
                del job  # the arrays are released here, as soon as they are on disk

    def _let_go(self, job: LinkJob) -> None:
        """A job done with: its Packs that the host read on MLX's CPU stream wait in ``spent`` (see
        store/spent_buffers.py); the others go with the job."""
        if job.layers is None:
            return
        packs = {id(t.pack): t.pack for _, _, named in job.layers for _, t in named if isinstance(t, PackedTensor)}
        moved = [pack for pack in packs.values() if pack.host_side and pack.on_host]
        if moved:
            self.spent.add(moved, sum(pack.nbytes for pack in moved))

    def _remove_chain(self, key: str) -> None:
        with self._cond:
            ends = list(self._links.pop(key, {}))
            self._retired.discard(key)
        self._unlink(key, ends)
        self.counters.deleted += bool(ends)

    def _unlink(self, key: str, ends: list[int]) -> None:
        for end in ends:
            try:
                self._path(key, end).unlink(missing_ok=True)
            except OSError as exc:  # the file stays; its chain is gone from the index, so never restored
                log.warning("checkpoint link %s not removed: %s", self._path(key, end), exc)

    def _run(self, job: LinkJob) -> None:
        with self._cond:
            orphan = job.start and job.start not in self._links.get(job.key, {})
        if orphan:  # its parent failed or was removed: this link could never restore
            with self._cond:
                self._drop()
            return
        path = self._path(job.key, job.end)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            write_file(path, job.header, job.layers, PackedTensor.host_bytes)
        except Exception as exc:  # OSError from the disk (full, refused); anything else is logged in full
            if isinstance(exc, OSError):
                log.warning("checkpoint link %s not written: %s", path.name, exc)
            else:
                log.exception("checkpoint link %s not written", path.name)
            with self._cond:
                self._drop()
            return
        self._register(job)

    def _register(self, job: LinkJob) -> None:
        """A link is durable; a first link supersedes every other link of its request (an older chain)."""
        with self._cond:
            links = self._links.setdefault(job.key, {})
            older = [end for end in links if end != job.end] if job.start == 0 else []
            for end in older:
                del links[end]
            links[job.end] = job.start
            self.counters.written += 1
            self.counters.written_bytes += job.nbytes
            self.counters.superseded += len(older)
        self._unlink(job.key, older)


def _size(path: Path) -> int:
    """A link file's size; 0 once it is gone (completion may remove it meanwhile): one stat per file."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0
