"""Joiners: rows prefilling their prompt on their own (solo) caches before they join the batch.

A joiner starts from the longest prefix the prompt cache lends it (and holds
that lease until the row finishes), may read a longer prefix from the SSD
tier a tensor per step, or wait for another joiner that is prefilling the
same long prefix (its *leader*). The planner (engine/step_plan.py) sees each
one through a ``JoinerView``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import mlx.core as mx

from mlxq.engine.rows import Row
from mlxq.engine.step_plan import Extent, JoinerView, PrefixView
from mlxq.kv.capabilities import is_trimmable

if TYPE_CHECKING:
    from mlxq.store.cold_tier import PendingRestore
    from mlxq.store.lease import Lease


@dataclass(eq=False)
class Joiner:
    row: Row
    _caches: list  # its solo caches (read them as ``caches``)
    done: int = 0  # prompt tokens already prefilled
    leader: Joiner | None = None  # prefilling the prefix this joiner shares: wait for it, then take
    wait_until: int = 0  # the leader's ``done`` at which the shared prefix is in the prompt cache
    shared: int = 0  # prompt tokens the leader prefills for it
    followers: int = 0  # joiners waiting on this one
    restore: PendingRestore | None = None  # reading a longer prefix from disk
    resumed: bool = False  # a preempted row recomputing its KV: its usage keeps its first cached count
    admitted_at: float = field(default_factory=time.monotonic)  # when the scheduler took it in
    # (id of the caches list, is_trimmable): the planner asks per joiner per admission and step
    _trimmable: tuple[int, bool] | None = field(default=None, repr=False)
    # ((done, id of its caches), tokens): its next chunk's length as last worked out (Prefilling._chunk_len)
    next_chunk: tuple[tuple[int, int], int] | None = field(default=None, repr=False)
    # (rows, index): its caches are that row of a kept plain full-attention batch, built when first read
    _row_of: tuple | None = field(default=None, repr=False)
    # the lease whose caches it holds as lent (built when first read): the stored chain's spans hold them
    _lent: Lease | None = field(default=None, repr=False)

    @property
    def caches(self) -> list:
        if self._row_of is not None:
            rows, index = self._row_of
            self._caches, self._row_of = rows.row(index), None
        if self._caches is None and self._lent is not None:
            self._caches = self._lent.caches
        return self._caches

    @caches.setter
    def caches(self, caches: list) -> None:
        self._caches, self._row_of, self._lent = caches, None, None

    @property
    def caches_id(self) -> int:
        """Names its caches without building them (changes whenever they are replaced)."""
        return id(self._lent) if self._lent is not None else id(self._caches)

    def holds_lent(self, lease: Lease) -> bool:
        """Its caches are the ones ``lease`` lent (whether or not it computed on them since: ``done``
        says), so the lease's stored spans hold what they hold."""
        return self._lent is lease

    def read_row(self, rows, index: int) -> None:
        """Its caches become row ``index`` of ``rows`` (tail_placement.PlacedRows), built only if read: a
        burst whose rows join in the batch they prefilled in never builds them."""
        self._row_of, self._lent = (rows, index), None

    @property
    def trimmable(self) -> bool:
        """Every layer of its caches full attention (``is_trimmable``), computed once per caches list."""
        if self._row_of is not None:
            return True  # a row of a plain full-attention batch (the only ones kept as rows)
        if self._caches is None and self._lent is not None:
            return self._lent.trimmable  # known without building them
        if self._trimmable is None or self._trimmable[0] != id(self.caches):
            self._trimmable = (id(self.caches), is_trimmable(self.caches))
        return self._trimmable[1]

    def start_from(self, caches: list, cached: int) -> None:
        """Continue from a cached prefix of ``cached`` tokens. Only before the joiner advanced:
        its own caches are then untouched and can simply be replaced."""
        prompt = self.row.request.prompt_ids
        if cached > self.done and self.row.processors:  # processors see the whole prompt
            # Only for them: on CUDA building the array from the list waits for the decode step in
            # flight, which spaced a cold burst's followers ~10 ms apart at admission on the H200.
            self.row.feed_history(mx.array(prompt[self.done : cached]))
        self.caches, self.done = caches, cached
        if not self.resumed:
            self.row.output.cached_tokens = cached

    def start_from_lease(self, lease: Lease) -> None:
        """``start_from`` the prefix ``lease`` lent, its caches built only if read."""
        self.start_from(None, lease.cached)
        self._lent = lease

    def lent_by(self, lease: Lease) -> None:
        """``lease`` lends the caches it holds (a lease on what it just stored from them)."""
        self._lent = lease

    @property
    def prompt(self) -> list[int]:
        return self.row.request.prompt_ids

    @property
    def is_prefilled(self) -> bool:
        """All but the last prompt token are in the caches: ready for token 0."""
        return self.done >= len(self.prompt) - 1

    @property
    def is_ready(self) -> bool:
        """Prefilled, and neither waiting for a leader nor reading from disk: it joins this step."""
        return self.is_prefilled and self.leader is None and self.restore is None

    def extent(self) -> Extent:
        return Extent(len(self.prompt), self.row.request.max_tokens)

    def prefix_view(self) -> PrefixView:
        request = self.row.request
        return PrefixView(request.namespace, self.prompt, self.done, self.trimmable, request.snapshot_at,
                          can_lead=self.leader is None and self.restore is None)


class Joiners:
    """The joiners in arrival order (FIFO): the order they advance, lead and join in."""

    def __init__(self):
        self._items: list[Joiner] = []
        # Bumped by every change but an append (and by ``touch``): admission's terms of the joiners so far
        # stay valid while it holds (BatchScheduler._between_steps).
        self.version = 0

    def __iter__(self) -> Iterator[Joiner]:
        return iter(list(self._items))

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, index: int) -> Joiner:
        return self._items[index]

    def __contains__(self, joiner: Joiner) -> bool:
        return joiner in self._items

    def add(self, joiner: Joiner) -> None:
        self._items.append(joiner)

    def since(self, index: int) -> list[Joiner]:
        """The joiners from ``index`` on (those added after the first ``index``)."""
        return self._items[index:]

    def touch(self) -> None:
        """A joiner changed in a way admission reads (a follower now waits on it)."""
        self.version += 1

    def remove(self, joiner: Joiner) -> None:
        if joiner in self._items:
            self._items.remove(joiner)
            self.version += 1

    def clear(self) -> list[Joiner]:
        items, self._items = self._items, []
        self.version += 1
        return items

    def take_ready(self) -> list[Joiner]:
        """Remove and return the joiners that join this step, in order."""
        ready = [j for j in self._items if j.is_ready]
        self._items = [j for j in self._items if not j.is_ready]
        self.version += 1
        return ready

    def views(self, chunk_len) -> list[JoinerView]:
        """What the planner sees; ``chunk_len(joiner)``: its next chunk's tokens."""
        index = {id(j): i for i, j in enumerate(self._items)}
        return [JoinerView(j.extent(), j.done, 0 if j.is_prefilled else chunk_len(j),
                           cancelled=j.row.request.cancelled.is_set(), restoring=j.restore is not None,
                           leader=None if j.leader is None else index.get(id(j.leader)),
                           following=j.leader is not None, wait_until=j.wait_until, shared=j.shared,
                           admitted_at=j.admitted_at)
                for j in self._items]
