"""Placement: which lane runs a request, decided once per request and never changed.

Two mechanisms exist: the strict serial lane (one request, nothing else in
flight) and the continuous batch. Placement is a support check, never a
downgrade: a request the batch lane cannot run exactly runs unchanged on
the serial lane, and the reason is counted in /stats.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from mlxq.engine.types import Request


class Lane(str, Enum):
    SERIAL = "serial"
    CONTINUOUS = "continuous"


@dataclass(frozen=True)
class RequestShape:
    """What placement looks at, derived from a request."""

    deterministic: bool  # the client asked for output independent of other requests
    seeded_xtc: bool  # seeded + XTC: XTC's hidden draw cannot use a per-row key

    @classmethod
    def of(cls, request: Request) -> RequestShape:
        p = request.params
        return cls(deterministic=request.deterministic,
                   seeded_xtc=p.seed is not None and p.xtc_probability > 0 and not p.is_greedy)


@dataclass(frozen=True)
class Placement:
    shape: RequestShape
    lane: Lane
    reason: str  # why this lane (a stable label, counted in /stats)


class GenerationGateway:
    """``batch_unavailable`` is None when the model can batch, else why it cannot."""

    def __init__(self, max_rows: int, batch_unavailable: str | None):
        self.max_rows = max_rows
        self.batch_unavailable = batch_unavailable

    @property
    def mode(self) -> str:
        """off: --batch 1; serial: the model cannot batch; batch: continuous batching is on."""
        if self.max_rows <= 1:
            return "off"
        return "serial" if self.batch_unavailable else "batch"

    def place(self, shape: RequestShape) -> Placement:
        if self.max_rows <= 1:
            return Placement(shape, Lane.SERIAL, "batch-off")
        if self.batch_unavailable:
            return Placement(shape, Lane.SERIAL, "model-not-batchable")
        if shape.deterministic:
            return Placement(shape, Lane.SERIAL, "deterministic-requested")
        if shape.seeded_xtc:
            return Placement(shape, Lane.SERIAL, "seeded-xtc")
        return Placement(shape, Lane.CONTINUOUS, "batchable")
