"""Generation checkpoints on disk: ``DIR/<fingerprint>-<kv scheme>/checkpoints/<key digest>.mlxkv``.

One file per request key (engine/checkpoint_key.py), so only the newest
checkpoint of a request is kept: a new one is written to ``.tmp`` and renamed
over the old one, which stays valid until then (mlxkv's write: tmp, fsync,
rename, directory fsync). The file is an ordinary root ``.mlxkv`` node (the
whole row's caches, every layer's state at its end) whose header adds a
``checkpoint`` record: the key, the prompt length, the tokens generated,
the pending token and where the sampler stands (docs/mlxkv-format.md).

The engine thread only hands over arrays it owns (copies, evaluated); a
writer thread puts them on disk, so a decode step never waits for the disk.
A publish that finds the queue over its byte cap is dropped (the previous
checkpoint stays); a write the disk refuses (full, too large) is counted and
dropped; the request goes on either way. Completion retires a key at once
(no restore from it) and its removal is queued behind any write of it in
progress, so an older cleanup never erases a newer attempt's file. A
restore takes the newest publish of its key, from memory while it is still
queued or being written.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path

import mlx.core as mx

from mlxq.store.layer_codec import decode_layer
from mlxq.store.layout import check_layout
from mlxq.store.mlxkv import Identity, MlxkvError, read_caches, read_header
from mlxq.store.mlxkv import write_steps as mlxkv_write_steps

log = logging.getLogger("mlxq.checkpoints")

RECORD_VERSION = 1
DEFAULT_QUEUE_BYTES = 2 * 2**30  # arrays waiting for the writer; a publish beyond it is dropped


@dataclass(frozen=True)
class CheckpointRecord:
    """The header's ``checkpoint`` record: where a generation stood when its caches were taken."""

    key: str  # the request key's digest (the file's name)
    prompt_tokens: int  # the prompt's length; the caches cover prompt + emitted
    emitted: tuple[int, ...]  # tokens generated before ``pending`` (EOS never among them)
    pending: int  # the next token, sampled but not handed out (fed to the caches next)
    rng_key: tuple[int, ...] | None  # MLX's global key before the draw after ``pending`` (seeded rows)
    created: float = 0.0  # unix time

    def as_header(self) -> dict:
        return dict(asdict(self), version=RECORD_VERSION)

    @classmethod
    def from_header(cls, record: dict) -> CheckpointRecord:
        if record.get("version") != RECORD_VERSION:
            raise MlxkvError(f"checkpoint record version {record.get('version')!r}")
        try:
            rng = record["rng_key"]
            return cls(str(record["key"]), int(record["prompt_tokens"]), tuple(int(t) for t in record["emitted"]),
                       int(record["pending"]), None if rng is None else tuple(int(x) for x in rng),
                       float(record["created"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise MlxkvError(f"malformed checkpoint record: {exc}") from None


@dataclass
class CheckpointCounters:
    written: int = 0  # checkpoint files renamed into place
    written_bytes: int = 0
    restored: int = 0  # requests resumed from a checkpoint
    restored_tokens: int = 0  # completion tokens those resumes did not generate again
    dropped: int = 0  # publishes not written: queue over its cap, or the disk refused (full, too large)
    superseded: int = 0  # queued publishes replaced by a newer one of the same request before their write
    deleted: int = 0  # files removed because their request completed
    corrupt_removed: int = 0  # files unlinked at scan or restore because they failed a check


@dataclass
class _Job:
    key: str
    layers: list | None  # None: remove the key's file
    header: dict = field(default_factory=dict)
    nbytes: int = 0
    record: CheckpointRecord | None = None


@dataclass(frozen=True)
class CheckpointFlush:
    """A flush's answer for checkpoints: durable when everything published before it is on disk."""

    durable: bool
    pending: int  # publishes still queued or being written
    dropped: int  # publishes dropped since the last flush
    files: int  # checkpoint files on disk

    def as_dict(self) -> dict:
        return asdict(self)


class CheckpointStore:
    def __init__(self, directory: Path, identity: Identity, model_name: str = "", *, layout: list | None = None,
                 max_bytes: int | None = None, queue_bytes: int = DEFAULT_QUEUE_BYTES):
        self.directory = directory
        self.identity = identity
        self.model_name = model_name
        self.layout = layout  # the model's caches (store.layout): a file that does not match is removed
        self.max_bytes = max_bytes  # a checkpoint larger than the SSD tier's cap is never written
        self.queue_bytes = queue_bytes
        self.counters = CheckpointCounters()
        self._files: dict[str, Path] = {}  # key digest -> its durable file
        self._retired: set[str] = set()  # completed: never restored, removal queued
        self._queue: deque[_Job] = deque()
        self._busy = False
        self._current: str | None = None  # the key being written or removed
        self._writing: _Job | None = None  # the publish being written
        self._dropped_since_flush = 0
        self._cond = threading.Condition()
        self._writer: threading.Thread | None = None

    # --- start-up ---------------------------------------------------------------------
    def scan(self) -> None:
        """Index the directory's checkpoints (headers only); leftovers of cut writes and bad files go."""
        if not self.directory.is_dir():
            return
        for path in sorted(self.directory.iterdir()):
            if path.name.endswith(".tmp"):
                path.unlink(missing_ok=True)
            elif path.suffix == ".mlxkv":
                try:
                    self._check(path)
                    self._files[path.stem] = path
                except (MlxkvError, OSError) as exc:
                    self._remove_bad(path, exc)
        log.info("generation checkpoints in %s: %d", self.directory, len(self._files))

    def _check(self, path: Path) -> CheckpointRecord:
        header = read_header(path)
        if header.checkpoint is None:
            raise MlxkvError("not a checkpoint")
        record = CheckpointRecord.from_header(header.checkpoint)
        if (header.identity.fingerprint, header.identity.kv_scheme) != (self.identity.fingerprint,
                                                                        self.identity.kv_scheme):
            raise MlxkvError("written for another model or KV scheme")
        if record.key != path.stem or len(header.tokens) != record.prompt_tokens + len(record.emitted):
            raise MlxkvError("its name or token counts do not match its record")
        if self.layout is not None:
            check_layout(self.layout, header.layers, header.end, header.end)
        return record

    def _remove_bad(self, path: Path, exc: Exception) -> None:
        log.warning("removing checkpoint %s: %s", path, exc)
        path.unlink(missing_ok=True)
        self.counters.corrupt_removed += 1

    # --- the engine thread ------------------------------------------------------------
    def publish(self, record: CheckpointRecord, tokens: list[int], layers: list, trimmable: bool) -> bool:
        """Queue a checkpoint (``layers``: encoded, owned, evaluated arrays); False when dropped."""
        nbytes = sum(a.nbytes for _, _, named in layers for _, a in named)
        header = {"fingerprint": self.identity.fingerprint, "kv_scheme": self.identity.kv_scheme,
                  "namespace": self.identity.namespace, "digest": record.key, "parent": "", "start": 0,
                  "tokens": list(tokens), "trimmable": trimmable, "snapshot": True, "created": record.created,
                  "model": self.model_name, "checkpoint": record.as_header()}
        with self._cond:
            self._retired.discard(record.key)
            for job in [j for j in self._queue if j.key == record.key and j.layers is not None]:
                self._queue.remove(job)  # only the newest checkpoint of a request is worth writing
                self.counters.superseded += 1
            queued = sum(j.nbytes for j in self._queue)
            if queued + nbytes > self.queue_bytes or (self.max_bytes is not None and nbytes > self.max_bytes):
                self._drop()
                return False
            self._queue.append(_Job(record.key, layers, header, nbytes, record))
            self._start_writer()
            self._cond.notify_all()
        return True

    def retire(self, key: str) -> None:
        """The request completed: its checkpoint is never restored again, and its file goes (behind any
        write of it queued or in progress)."""
        with self._cond:
            if key not in self._files and key != self._current and all(j.key != key for j in self._queue):
                return  # never published: nothing to remove
            self._retired.add(key)
            for job in [j for j in self._queue if j.key == key]:
                self._queue.remove(job)
            self._queue.append(_Job(key, None))
            self._start_writer()
            self._cond.notify_all()

    def find(self, key: str) -> Path | None:
        with self._cond:
            return None if key in self._retired else self._files.get(key)

    def load(self, key: str) -> tuple[CheckpointRecord, list] | None:
        """The checkpoint's record and caches: the newest publish of ``key``, from memory while it is not
        written yet (a client that left and came back at once), else from its file, every tensor
        checked (a bad file is removed: None)."""
        unwritten = self._unwritten(key)
        if unwritten is not None:  # copies: the restored caches are updated in place, the writer reads these
            return unwritten.record, [decode_layer(kind, meta, {name: mx.array(a) for name, a in named})
                                      for kind, meta, named in unwritten.layers]
        path = self.find(key)
        if path is None:
            return None
        try:
            record = self._check(path)
            caches = read_caches(path, read_header(path))
        except (MlxkvError, OSError) as exc:
            with self._cond:
                self._files.pop(key, None)
            self._remove_bad(path, exc)
            return None
        return record, caches

    def _unwritten(self, key: str) -> _Job | None:
        with self._cond:
            if key in self._retired:
                return None
            queued = [j for j in self._queue if j.key == key and j.layers is not None]
            if queued:
                return queued[-1]
            writing = self._writing
            return writing if writing is not None and writing.key == key and writing.layers is not None else None

    def note_restored(self, tokens: int) -> None:
        self.counters.restored += 1
        self.counters.restored_tokens += tokens

    # --- durability (any thread) ------------------------------------------------------
    def flush(self, timeout: float) -> CheckpointFlush:
        """Wait until every publish queued so far is written (or ``timeout``)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while (self._queue or self._busy) and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(left)
            pending = len(self._queue) + (1 if self._busy else 0)
            dropped, self._dropped_since_flush = self._dropped_since_flush, 0
            return CheckpointFlush(pending == 0 and dropped == 0, pending, dropped, len(self._files))

    def as_dict(self) -> dict:
        with self._cond:
            pending = len(self._queue) + (1 if self._busy else 0)
            files = len(self._files)
            nbytes = sum(p.stat().st_size for p in self._files.values() if p.exists())
        return {"files": files, "bytes": nbytes, "pending": pending, **asdict(self.counters)}

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
                job = self._queue.popleft()
                self._busy, self._current, self._writing = True, job.key, job
            try:
                self._run(job)
            finally:
                with self._cond:
                    self._busy, self._current, self._writing = False, None, None
                    self._cond.notify_all()
                del job  # the arrays are released here, as soon as they are on disk

    def _run(self, job: _Job) -> None:
        path = self.directory / f"{job.key}.mlxkv"
        if job.layers is None:
            try:
                path.unlink(missing_ok=True)
            except OSError as exc:  # the file stays; it is retired, so never restored by this server
                log.warning("checkpoint %s not removed: %s", path, exc)
            with self._cond:
                self._retired.discard(job.key)
                if self._files.pop(job.key, None) is not None:
                    self.counters.deleted += 1
            return
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            for _ in mlxkv_write_steps(path, job.header, job.layers, host_bytes=_evaluated_bytes):
                pass
        except Exception as exc:  # OSError from the disk (full, refused); anything else is logged in full
            if isinstance(exc, OSError):
                log.warning("checkpoint of %s not written: %s", job.key, exc)
            else:
                log.exception("checkpoint of %s not written", job.key)
            with self._cond:
                self._drop()
            return
        with self._cond:
            self._files[job.key] = path
            self.counters.written += 1
            self.counters.written_bytes += path.stat().st_size


def _evaluated_bytes(array) -> memoryview:
    """An evaluated, contiguous array's bytes, read without an MLX operation (this is not the engine thread)."""
    return memoryview(array).cast("B")
