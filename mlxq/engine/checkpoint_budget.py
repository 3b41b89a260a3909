"""How many checkpoint bytes the batch lane may copy off the device per second of decoding.

On the H200 a batch's checkpoints cost decode time that neither their bytes
nor their host copies explain alone (docs/benchmarks.md, "CPU and H200:
generation checkpoints' cost on decode"): 32 rows of an 8B model publishing
every 256 tokens decoded ~20% slower both when each checkpoint rewrote the
row's whole KV (~5 GB per round) and with links of the span since the last
one (~3 GB per round, one host move per link instead of one per tensor),
while one serial row publishing as often as each of them cost under 2%. The
cost follows how often the lane publishes, and a batch multiplies that by
its rows. So the batch lane's rows share a budget: a token bucket filled at
``rate`` bytes per second, up to ``burst_s`` seconds of it (about one 8B
link of 256 tokens per second). A row whose interval is up publishes while
the bucket is not in debt (the publish may take it into debt: a row larger
than the bucket still gets its turn), else it stays due and waits for a
later step, the row longest without a checkpoint first; its next link then
covers every token since its last one, so no token's KV is copied twice. A
request that stops without finishing publishes its last checkpoint whatever
the bucket holds (it is charged all the same).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

BATCH_CHECKPOINT_BYTES_PER_S = 32 * 2**20
BURST_S = 4.0


@dataclass
class ByteBudget:
    rate: float = BATCH_CHECKPOINT_BYTES_PER_S  # bytes per second
    burst_s: float = BURST_S
    at: float = field(default_factory=time.monotonic)  # when the credit was last filled
    credit: float = field(init=False)  # bytes; negative: in debt

    def __post_init__(self) -> None:
        self.credit = self.rate * self.burst_s  # it starts full

    def allows(self, now: float | None = None) -> bool:
        """True while the bucket is not in debt (after filling it for the time since the last look)."""
        now = time.monotonic() if now is None else now
        self.credit = min(self.rate * self.burst_s, self.credit + (now - self.at) * self.rate)
        self.at = now
        return self.credit >= 0

    def spend(self, nbytes: int) -> None:
        self.credit -= nbytes
