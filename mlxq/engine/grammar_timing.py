"""Host time spent computing structured outputs' token masks, summed over both lanes.

No MLX here: the engine holds one and /stats reads it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass
class GrammarTiming:
    """Host time spent computing masks (reported in /stats; the decode loop overlaps it with the forward)."""

    masks: int = 0  # row-masks: one per grammar row per draw
    steps: int = 0  # times masks were computed: a batch step's grammar rows together, or one serial draw
    seconds: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, seconds: float, masks: int = 1) -> None:
        with self.lock:
            self.masks += masks
            self.steps += 1
            self.seconds += seconds

    def as_dict(self) -> dict:
        return {"masks": self.masks, "steps": self.steps, "seconds": self.seconds,
                "mask_ms_mean": 1e3 * self.seconds / self.masks if self.masks else 0.0,
                "mask_ms_per_step": 1e3 * self.seconds / self.steps if self.steps else 0.0}
