"""The SSD cold tier behind the RAM prompt cache: write-behind, spills, demotion, durability.

State, per prompt-cache key (namespace, tokens):

- *dirty*: in RAM, not yet on disk. Every RAM put makes its key dirty;
  write-behind persists dirty entries, oldest first, while the engine is idle.
- *spilled*: evicted from RAM while dirty. The entry's arrays stay pinned in
  a bounded queue (``spill_queue_bytes``) until written; over the cap the
  oldest spill is dropped (a future cache miss, never a wrong result) and
  counted as *lost* until the next flush reports it.
- *failed*: a write the disk refused. Not retried in the background (a full
  disk must not turn into a busy loop); the next flush retries it once.

All of it runs on the engine thread, one tensor per ``step()``: a request
that arrives mid-write waits at most one tensor's write, and write-behind
never runs between decode steps. A flush runs steps even while requests are
running (one tensor per engine iteration) until nothing is pending.

Entries in RAM are immutable (the prompt cache copies in and lends views),
so persisting one needs no clone: the job holds a reference.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from mlxq.store.cold_tier_state import MIN_PREFILL_SAMPLE_TOKENS, ColdTierCounters, FlushResult, smooth
from mlxq.store.fingerprint import FINGERPRINT_MEMO, model_fingerprint
from mlxq.store.layout import layout_of
from mlxq.store.mlxkv import Identity
from mlxq.store.prompt_cache import CacheEntry, Key, PromptCache
from mlxq.store.rank_restore import Ranks, restore_together
from mlxq.store.ssd_config import SsdConfig, rank_dir
from mlxq.store.ssd_restore import Base, PendingRestore, StaleRead, restore_steps
from mlxq.store.ssd_store import SsdStore

log = logging.getLogger("mlxq.ssd")

DEMOTE_CHECK_EVERY_S = 1.0


def open_cold_tier(config: SsdConfig, ram: PromptCache, model_dir: Path, model_name: str,
                   kv_scheme: str = "native", prototype: list | None = None, ranks: Ranks | None = None) -> ColdTier:
    """Fingerprint the model, scan its directory, and bind the tier to ``ram`` (engine thread).

    ``prototype``: the model's populated caches in the stored representation; files whose
    layers do not match them are removed instead of restored (store/layout.py). ``ranks``: tensor or
    pipeline parallel, this rank's folder and the ranks' agreement on every restore (store/rank_restore.py);
    idle demotion is off there (each rank's clock would drop other entries).
    """
    root = Path(config.directory).expanduser()
    identity = Identity(model_fingerprint(model_dir, root / FINGERPRINT_MEMO), kv_scheme, "")
    store = SsdStore(root, identity, config.max_bytes, model_name,
                     layout=layout_of(prototype) if prototype else None,
                     rank_dir=rank_dir(ranks.rank, ranks.size, ranks.mode) if ranks else "")
    try:
        store.scan(verify=config.verify)
    except OSError as exc:
        log.warning("SSD cache %s cannot be read (%s); starting empty", store.directory, exc)
    return ColdTier(store, ram, config.spill_queue_bytes, 0.0 if ranks else config.demote_idle_s,
                    config.write_behind, ranks=ranks)


@dataclass
class _Job:
    key: Key
    entry: CacheEntry
    steps: Iterator[None]


@dataclass
class ColdTier:
    store: SsdStore
    ram: PromptCache
    spill_queue_bytes: int = 2 * 2**30
    demote_idle_s: float = 300.0  # 0 disables idle demotion
    write_behind: bool = True  # False: persist only on flush, shutdown, and eviction
    counters: ColdTierCounters = field(default_factory=ColdTierCounters)
    _dirty: OrderedDict = field(default_factory=OrderedDict)  # Key -> CacheEntry, oldest first
    _spills: OrderedDict = field(default_factory=OrderedDict)  # Key -> CacheEntry (pinned)
    _failed: set = field(default_factory=set)  # keys whose last write failed
    _lost: int = 0  # spills dropped since the last flush
    _job: _Job | None = None
    _last_demote_check: float = 0.0
    _flush_failures_at: int = 0
    _flush_started: float = 0.0
    last_flush_durable: bool = True  # the last reported flush's answer (several ranks: rank 0 asks the others)
    read_bytes_per_s: float | None = None  # measured on restores
    prefill_tok_s: float | None = None  # measured on cold prefills (note_prefill)
    _restoring: weakref.WeakSet = field(default_factory=weakref.WeakSet)  # PendingRestores in progress
    ranks: Ranks | None = None  # several ranks: restores are agreed (store/rank_restore.py)

    def __post_init__(self):
        self.ram.cold = self

    # --- hooks from the prompt cache (engine thread) ----------------------------------
    def on_put(self, key: Key, entry: CacheEntry) -> None:
        if self._already_durable(key):
            self._spills.pop(key, None)
            return  # an exact repeat: writing the same state again would only queue ahead of new entries
        self._dirty[key] = entry
        self._dirty.move_to_end(key)
        self._failed.discard(key)
        self._spills.pop(key, None)  # a newer copy of the same prefix is in RAM again

    def _already_durable(self, key: Key) -> bool:
        """On disk (exactly, or inside a longer trimmable file), or being written right now."""
        if self._job is not None and self._job.key == key and key not in self._failed:
            return True
        return self.store.covers(key[0], key[1])

    def on_removed(self, key: Key, entry: CacheEntry, reason: str) -> None:
        if self._dirty.get(key) is not entry:
            return  # already durable (or replaced): nothing to do
        del self._dirty[key]
        if reason != "evicted":
            return  # superseded: the entry that replaced it is dirty and covers it
        self._spills[key] = entry
        self.counters.spills += 1
        while self.pending_spill_bytes > self.spill_queue_bytes and len(self._spills) > 1:
            victim = next(k for k in self._spills if self._job is None or k != self._job.key)
            if victim == key:
                break  # the newest spill is never its own victim
            del self._spills[victim]
            self._failed.discard(victim)
            self.counters.dropped += 1
            self._lost += 1

    def note_prefill(self, tokens: int, seconds: float) -> None:
        """A prefill of ``tokens`` uncached tokens took ``seconds``: the recompute side of the trade."""
        if tokens >= MIN_PREFILL_SAMPLE_TOKENS and seconds > 0:
            self.prefill_tok_s = smooth(self.prefill_tok_s, tokens / seconds)

    def _slower_than_recompute(self, nbytes: int, tokens: int) -> bool:
        """Would reading ``nbytes`` take longer than prefilling ``tokens``? (False until both rates are known.)

        On a machine with a fast prefill and a slow disk (an H200 next to a ~1.5 GB/s volume,
        docs/benchmarks.md) a restore can lose to recomputing; then the tier steps aside.
        """
        if not self.read_bytes_per_s or not self.prefill_tok_s:
            return False
        return nbytes / self.read_bytes_per_s > tokens / self.prefill_tok_s

    def begin_restore(self, namespace: str, prompt: list[int], better_than: int) -> PendingRestore | None:
        """A restore of the longest usable prefix on disk, if longer than ``better_than`` (what RAM lends) and
        not predicted to lose to recomputing it; advance it with ``advance_restore``. Only the files beyond
        what RAM holds are read, and a file another restore is reading is not read twice.

        Several ranks: a collective. Every rank reads its part at once, and the restore is done on all of
        them or on none (store/rank_restore.py)."""
        pending = self._plan_restore(namespace, prompt, better_than)
        return pending if self.ranks is None else restore_together(self, pending, self.ranks.gather)

    def _plan_restore(self, namespace: str, prompt: list[int], better_than: int) -> PendingRestore | None:
        found = self.store.find(namespace, prompt, better_than)
        if found is None:
            return None
        nodes, held = self.ram.held_path(namespace, prompt)
        base = Base(held, node=nodes[-1]) if nodes and held == better_than and held < found.n else Base()
        pending = PendingRestore(found.chain, found.n, namespace, tuple(prompt), base)
        pending.plan(self._read_steps)
        if self._slower_than_recompute(pending.read_bytes, found.n - better_than):
            self.counters.restores_skipped_slower += 1
            return None
        first = pending.files[0]
        pending.leader = next((other for other in self._restoring
                               if not other.done and other.namespace == namespace and first in other.files), None)
        if pending.leader is not None:
            self.counters.restores_joined += 1
        self._restoring.add(pending)
        return pending

    def abandon_restore(self, pending: PendingRestore) -> None:
        """Forget a restore that will not be read to its end (its request left, a read raised, or not every
        rank found it): it counts as done with nothing read, so a restore that follows it reads the shared
        files itself instead of waiting for it forever."""
        self._restoring.discard(pending)
        if pending.steps is not None:
            pending.steps.close()  # its open file goes now, not at the next garbage collection
        pending.done, pending.entry = True, None

    def _read_steps(self, pending: PendingRestore):
        return restore_steps(pending, self.store.checked_header)

    def advance_restore(self, pending: PendingRestore) -> bool:
        """Read one more tensor; True once done (``pending.entry`` is None if a file was bad)."""
        if pending.done:
            return True  # read at once (several ranks)
        if pending.leader is not None:
            if pending.follow():
                return False  # the leader is still reading what both need
            pending.plan(self._read_steps)
        if not pending.step():
            return False
        self._restoring.discard(pending)
        if pending.failed is not None:
            node, error = pending.failed
            if node.in_tree and not isinstance(error, StaleRead):
                self.store.discard(node, error)
            return True
        stats = self.store.stats
        stats.read_files += len(pending.files)
        stats.read_bytes += pending.read_bytes
        for node in pending.files:
            stats.reread_bytes += node.nbytes if node.reads else 0
            node.reads += 1
        stats.restores += 1
        stats.restored_tokens += pending.n - pending.base.n
        stats.restore_ms_last = round(pending.busy_s * 1000, 3)
        stats.restore_verify_wait_ms_last = round(pending.verify_wait_s * 1000, 3)
        self.read_bytes_per_s = smooth(self.read_bytes_per_s, pending.read_bytes / max(pending.busy_s, 1e-6))
        self.store.touch(pending.chain)
        return True

    def restore(self, namespace: str, prompt: list[int], better_than: int) -> tuple[CacheEntry, int] | None:
        """``begin_restore`` run to the end at once (a bad file is removed and the next candidate tried)."""
        while (pending := self.begin_restore(namespace, prompt, better_than)) is not None:
            while not self.advance_restore(pending):
                pass
            if pending.entry is not None:
                return pending.entry, pending.n
        return None

    # --- background work (engine thread) ------------------------------------------------
    @property
    def pending_spill_bytes(self) -> int:
        return sum(e.nbytes for e in list(self._spills.values()))

    def has_work(self, *, flushing: bool = False) -> bool:
        if self._job is not None or self._spills:
            return True
        if not (self.write_behind or flushing):
            return False
        return any(k not in self._failed for k in self._dirty)

    def step(self) -> None:
        """Advance the current write by one tensor (starting the next one if needed)."""
        if self._job is None:
            self._job = self._next_job()
            if self._job is None:
                return
        job = self._job
        try:
            next(job.steps)
            return
        except StopIteration:
            self._settle(job.key, job.entry)
        except Exception as exc:  # OSError from the disk; anything else is logged the same way
            if not isinstance(exc, OSError):
                log.exception("SSD cache write failed")
            self.counters.failed += 1
            self._failed.add(job.key)
            if self._spills.pop(job.key, None) is not None:
                self._lost += 1  # a spilled entry's only copy is gone
        self._job = None

    def _next_job(self) -> _Job | None:
        for source in (self._spills, self._dirty):
            for key, entry in list(source.items()):
                if key not in self._failed:
                    steps = self.store.write_steps(key[0], key[1], entry.caches_from, entry.trimmable)
                    return _Job(key, entry, steps)
        return None

    def _settle(self, key: Key, entry: CacheEntry) -> None:
        if self._dirty.get(key) is entry:
            del self._dirty[key]
        if self._spills.get(key) is entry:
            del self._spills[key]

    def housekeep(self, now: float | None = None) -> None:
        """Release RAM entries idle longer than ``demote_idle_s`` once they are on disk."""
        now = time.monotonic() if now is None else now
        if self.demote_idle_s <= 0 or now - self._last_demote_check < DEMOTE_CHECK_EVERY_S:
            return
        self._last_demote_check = now
        for key in self.ram.idle_keys(now - self.demote_idle_s):
            if key not in self._dirty and self.store.covers(key[0], key[1]):
                self.ram.drop(key)
                self.counters.demotions += 1

    # --- durability -------------------------------------------------------------------
    def begin_flush(self) -> None:
        self._failed.clear()  # retry what failed before, once
        self._flush_failures_at = self.counters.failed
        self._flush_started = time.monotonic()
        self.last_flush_durable = True

    def durable_now(self) -> bool:
        """Nothing pending, being written, dropped or failed since the flush began."""
        return not (self._dirty or self._spills or self._lost or self._job is not None
                    or self.counters.failed > self._flush_failures_at)

    def flush_result(self, *, timed_out: bool = False, report: bool = True) -> FlushResult:
        """The state of durability now; ``report`` also resets the lost-since-last-flush count."""
        if report:  # the engine thread: forget files removed under the server (cache prune), claim only what is there
            self.store.forget_vanished()
        pending = len(self._dirty) + len(self._spills)
        failed = self.counters.failed - self._flush_failures_at
        lost, durable = self._lost, not timed_out and self.durable_now()
        if report:
            self._lost = 0
        result = FlushResult(
            durable=durable,
            pending=pending, dropped=lost, failed=failed, entries=len(self.store.files),
            longest_durable_prefix_tokens=self.store.longest_prefix,
            elapsed_s=round(time.monotonic() - self._flush_started, 3), timed_out=timed_out,
        )
        if report:
            self.last_flush_durable = result.durable
        return result

    def as_dict(self) -> dict:
        store = self.store
        return {
            "enabled": True,
            "directory": str(store.directory),
            "fingerprint": store.identity.fingerprint,
            "entries": len(store.files),
            "bytes": store.bytes,
            "max_bytes": store.max_bytes,
            "write_behind": self.write_behind,
            "pending": len(self._dirty) + len(self._spills),
            "pending_spills": len(self._spills),
            "pending_spill_bytes": self.pending_spill_bytes,
            "longest_durable_prefix_tokens": store.longest_prefix,
            "read_gb_s": round(self.read_bytes_per_s / 1e9, 3) if self.read_bytes_per_s else None,
            "prefill_tok_s": round(self.prefill_tok_s, 1) if self.prefill_tok_s else None,
            **asdict(self.counters),
            **asdict(store.stats),
        }
