"""Several ranks: each rank restores its part of an entry (tensor parallel: its share of every layer's KV
heads; pipeline parallel: its own layers), and either every rank restores it or none does; a flush is
durable once every rank's part is.

Each rank keeps its own files (its part) in its own folder, written while
the engine is idle, which every rank agrees on. They can still differ: a
write failed on one disk, a file was deleted or found corrupt, or (pipeline
parallel, where each rank's files hold other layers and other bytes) a byte
cap dropped an entry on one rank only. A
restore on some ranks only would leave the ranks' caches apart (and the
model's all_sum would mix a restored shard with a recomputed one), so the
ranks agree twice, through ``gather`` (a collective every rank calls in the
same order: the engine thread's lookups happen in lockstep):

1. on the lookup: each rank's prefix length, with 0 for no restore on that
   rank (a miss, or a read predicted slower than a prefill); unless every
   rank found the same, no rank restores: a clean miss everywhere;
2. after reading (at once, not a tensor per step: steps could end on
   different iterations): unless every rank read its files whole and
   checked, every rank drops what it read and prefills.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mlxq.store.cold_tier import ColdTier
    from mlxq.store.ssd_restore import PendingRestore


WRITING = 1  # flush_state: SSD writes still to do
NOT_DURABLE = 2  # flush_state: idle, but the last flush on this rank failed, dropped or timed out


def flush_state(tier: ColdTier | None, flushing: bool) -> int:
    """What this rank tells rank 0 at each iteration: WRITING, NOT_DURABLE or 0 (idle and durable)."""
    if tier is None:
        return 0
    if tier.has_work(flushing=flushing):
        return WRITING
    # Flushing: this iteration's answer (the rank resolves its flush after the exchange); else the last one's.
    return 0 if (tier.durable_now() if flushing else tier.last_flush_durable) else NOT_DURABLE


@dataclass(frozen=True)
class Ranks:
    rank: int
    size: int
    gather: Callable[[int], list[int]]  # this rank's value -> every rank's, by rank (a collective)
    mode: str = "tensor"  # tensor: each rank holds a share of every layer; pipeline: its own layers


def restore_together(tier: ColdTier, pending: PendingRestore | None,
                     gather: Callable[[int], list[int]]) -> PendingRestore | None:
    """``pending`` read to its end, if every rank found the same prefix and read it whole; else None."""
    found = gather(pending.n if pending is not None else 0)
    if len(set(found)) != 1 or pending is None:
        if pending is not None:
            tier.abandon_restore(pending)
            tier.counters.restores_ranks_apart += 1
        return None
    while not tier.advance_restore(pending):
        pass
    if min(gather(int(pending.entry is not None))) == 0:
        if pending.entry is not None:
            tier.counters.restores_ranks_apart += 1
        pending.entry = None
    return pending
