"""Small host values between ranks, over the group's own collectives.

Every function here is a collective: every rank must call it, in the same
order, or all of them wait. Values travel as ``all_sum`` / ``all_gather`` of
small integer arrays (the way mlx_lm.server shares requests), so any backend
that runs the model can carry them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def share_bytes(group: Any, data: bytes | None, root: int = 0) -> bytes:
    """``root``'s bytes on every rank (others pass anything; it is ignored)."""
    import mlx.core as mx

    mine = group.rank() == root
    size = mx.distributed.all_sum(mx.array([len(data) if mine else 0], dtype=mx.int32), group=group)
    return share_sized(group, data, int(size.item()), root)


def gather_ints(group: Any, values: list[int]) -> list[list[int]]:
    """Every rank's ``values`` (the same length on every rank), indexed by rank."""
    return start_gather(group, values)()


def start_gather(group: Any, values: list[int]) -> Callable[[], list[list[int]]]:
    """Queue the gather of every rank's ``values`` now; the function returned reads it (by rank).

    Queued behind the work already on the stream, the gather completes once that work has; read
    later (after the next decode step is queued), it costs the host no wait for that step."""
    import mlx.core as mx

    width = len(values)
    gathered = mx.distributed.all_gather(mx.array(values, dtype=mx.int64), group=group)
    mx.async_eval(gathered)

    def rows() -> list[list[int]]:
        flat = gathered.tolist()
        return [flat[r * width:(r + 1) * width] for r in range(group.size())]

    return rows


def agree_min(group: Any, value: int | None) -> int | None:
    """The smallest of the ranks' values (None on any rank: None everywhere)."""
    rows = gather_ints(group, [-1 if value is None else int(value)])
    values = [row[0] for row in rows]
    return None if min(values) < 0 else min(values)


def share_sized(group: Any, data: bytes | None, size: int, root: int = 0) -> bytes:
    """``root``'s ``size`` bytes on every rank, when every rank already knows ``size``."""
    return start_share_sized(group, data, size, root)() if size else b""


def start_share_sized(group: Any, data: bytes | None, size: int, root: int = 0) -> Callable[[], bytes]:
    """Queue sharing ``root``'s ``size`` bytes (``size`` > 0) now; the function returned reads them (as
    ``start_gather``: read after later work is queued, it does not wait for that work)."""
    import mlx.core as mx
    import numpy as np

    mine = group.rank() == root
    payload = mx.array(np.frombuffer(data, dtype=np.uint8)) if mine else mx.zeros((size,), dtype=mx.uint8)
    summed = mx.distributed.all_sum(payload, group=group)
    mx.async_eval(summed)
    return lambda: np.array(summed).tobytes()
