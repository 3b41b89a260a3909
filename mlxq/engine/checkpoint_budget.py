"""How many checkpoint bytes the batch lane may copy off the device per second of decoding.

A checkpoint copies a row's whole KV and the writer thread moves it to the
host and the disk. On the H200 that costs decode time in proportion to the
bytes (docs/benchmarks.md, "CPU and H200: generation checkpoints' cost on
decode": 32 rows of an 8B model publishing every 256 tokens moved ~5 GB per
20 s and decoded 20% slower; one serial row moved ~1 GB per 23 s for 1.7%),
and a batch multiplies them by its rows. So the batch lane's rows share a
budget: a token bucket filled at ``rate`` bytes per second, up to
``burst_s`` seconds of it. A row whose interval is up publishes while the
bucket is not in debt (the publish may take it into debt: a row larger
than the bucket still gets its turn), else it stays due and waits for a
later step, the row longest without a checkpoint first. A request that
stops without finishing publishes its last checkpoint whatever the bucket
holds (it is charged all the same).
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
