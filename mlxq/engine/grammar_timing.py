"""Host time spent computing structured outputs' token masks, summed over both lanes.

No MLX here: the engine holds one and /stats reads it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass
class GrammarTiming:
    """Host time spent computing masks (reported in /stats; the decode loop overlaps it with the forward)."""

    masks: int = 0
    seconds: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, seconds: float) -> None:
        with self.lock:
            self.masks += 1
            self.seconds += seconds

    def as_dict(self) -> dict:
        return {"masks": self.masks, "mask_ms_mean": 1e3 * self.seconds / self.masks if self.masks else 0.0}
