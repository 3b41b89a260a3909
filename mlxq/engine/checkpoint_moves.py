"""The batch lane's checkpoint links in flight: copied behind a decode step, moved to the host in bounded
slices over the next steps, then handed to the writer.

A publish that waited for its copy would drain the device's pipeline: the
engine thread, instead of building the next step while the device runs
the current one, would wait for the current one, then build the next while
the device idles. So a due row's link is only *staged* in the step that
drew its pending token (engine/checkpoint_rows.py): its copies are queued
on the generation stream right behind that step's forward (evaluated
asynchronously, with the pending tokens and the row's key), and nothing is
read. From the next step on, once that step's tokens were read (the
forward before the copies is done, so the copies are too), the engine
thread moves the links' Packs to the host (store/checkpoint_pack.py): at
most ``MOVE_BYTES_PER_STEP`` per step (at least one Pack), a copy that
overlaps the step in flight; a link whose Packs are all on the host is
published with its pending token and key, read then (already evaluated:
no wait). A row that ended meanwhile publishes nothing: it completed (its
checkpoint goes anyway) or was cancelled (its last checkpoint, taken at
the cancel, is newer).

Rows stage while fewer than ``IN_FLIGHT_BYTES`` are copied but not yet on
disk (these queued moves plus the writer's queue): a disk slower than the
lane makes due rows wait (their next link then covers every token since
their last one), never drops links.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

import mlx.core as mx

if TYPE_CHECKING:
    from mlxq.engine.checkpointing import RowCheckpoint, StagedLink

MOVE_BYTES_PER_STEP = 32 * 2**20  # host moves per decode step: about one 256-token link of an 8B model
IN_FLIGHT_BYTES = 512 * 2**20  # staged or queued for the writer: while more, due rows wait


@dataclass(eq=False)
class LinkInFlight:
    checkpoint: RowCheckpoint
    link: StagedLink
    next_tokens: mx.array  # the step's drawn tokens: the row's pending one at ``index``
    index: int
    key: mx.array | None  # the row's PRNG key before its next draw (seeded rows)
    pending: int | None = None
    rng_key: tuple[int, ...] | None = None

    def read_state(self, drawn: dict) -> None:
        """The pending token and the key, once the step that drew them is done (``drawn``: id of a step's
        tokens -> their list, so each step's tokens are read once)."""
        if self.pending is not None:
            return
        tokens = drawn.get(id(self.next_tokens))
        if tokens is None:
            tokens = drawn[id(self.next_tokens)] = self.next_tokens.tolist()
        self.pending = tokens[self.index]
        self.rng_key = None if self.key is None else tuple(self.key.tolist())
        self.next_tokens = self.key = None  # the step's arrays are not held longer than needed


class HostMoves:
    """Links staged and not yet published, oldest first."""

    def __init__(self) -> None:
        self._links: deque[LinkInFlight] = deque()

    def __len__(self) -> int:
        return len(self._links)

    def bytes(self) -> int:
        """Bytes of Packs not on the host yet."""
        return sum(p.nbytes for item in self._links for p in item.link.packs if not p.on_host)

    def add(self, item: LinkInFlight) -> None:
        self._links.append(item)

    def advance(self, limit: int = MOVE_BYTES_PER_STEP) -> list[LinkInFlight]:
        """Read the staged links' pending tokens and move Packs to the host, oldest first, until ``limit``
        bytes moved (at least one Pack); the links now wholly on the host, taken out of the queue. Links
        of rows that ended are dropped unpublished."""
        drawn: dict = {}
        for item in self._links:
            item.read_state(drawn)
        moved, ready = 0, []
        while self._links:
            item = self._links[0]
            if item.link.output.finished is not None:
                self._links.popleft()
                continue
            for pack in item.link.packs:
                if pack.on_host:
                    continue
                if moved and moved + pack.nbytes > limit:
                    return ready
                pack.host()
                moved += pack.nbytes
            ready.append(self._links.popleft())
        return ready
