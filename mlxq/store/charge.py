"""What the RAM prompt cache counts against its cap when ranks hold different layers (pipeline parallel).

Each pipeline rank caches the KV of its own layers only, so each would
measure other bytes and evict other entries under one cap, and the ranks'
caches would serve different prefixes. With a charge every rank counts
alike: rank 0's bytes per token of its full-attention layers, and rank 0's
bytes per snapshot (rings, recurrent state) measured on its prototype
caches. Rank 0 holds the most layers, so its own cap is respected and the
others stay below theirs; eviction order is the tree's LRU ticks, the same on
every rank, so every rank keeps the same entries.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlxq.kv.capabilities import is_spans
from mlxq.store import kv_spans


@dataclass(frozen=True)
class Charge:
    per_token: int  # full-attention layers, per token
    per_snapshot: int  # the other layers' state, per snapshot

    def node(self, tokens: int, snapshot: bool) -> int:
        return self.per_token * tokens + (self.per_snapshot if snapshot else 0)


def measure_charge(caches: list) -> Charge:
    """The charge of ``caches`` (populated, in the stored representation)."""
    per_token = sum(a.nbytes // a.shape[-2] for c in caches if is_spans(c)
                    for a in kv_spans.arrays((c.keys, c.values)) if a.shape[-2])
    per_snapshot = sum(kv_spans.nbytes(kv_spans.snapshot_arrays(c)) for c in caches if not is_spans(c))
    return Charge(per_token, per_snapshot)
