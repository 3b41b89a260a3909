"""Which adapter each row of the next forward uses, decided once for every adapted layer.

The engine names each row's adapter ("" for the base model) around every model
call (``multi_lora.adapter_rows``); ``AdapterRouting`` turns the names into a
``Route``: plain data the layers read (models/lora_shrink.py, lora_linear.py).
A batch repeats its composition step after step, so routes are kept for the
compositions seen last, with the arrays they need built once.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

RECENT_ROUTES = 16


@dataclass(frozen=True)
class Route:
    """The adapters of the rows of one forward.

    ``slot`` None and ``indices`` None: every row on the base (the base layers alone). Otherwise
    ``indices`` holds each row's adapter slot (len(adapters) for a base row), and ``slot`` is the
    one adapter every row uses, or None when rows differ; ``mask`` (rows differ) is 1 on each
    row's own adapter's columns of every adapter's shrink, 0 elsewhere."""

    slot: int | None = None
    indices: mx.array | None = None  # [rows] uint32
    row_index: mx.array | None = None  # [rows] uint32, 0..rows-1: gather_mm's input rows, built once
    mask: mx.array | None = None  # rows differ: [rows, 1, R]
    flat: dict = field(default_factory=dict, compare=False)  # (members, tokens) -> the mask for a flat shrink

    @property
    def is_base(self) -> bool:
        return self.indices is None

    def flat_mask(self, members: int, tokens: int) -> mx.array:
        """The mask of a shrink of ``members`` siblings, ``tokens`` a row: ``[rows * tokens, members * R]``."""
        if (members, tokens) not in self.flat:
            if len(self.flat) >= RECENT_ROUTES:  # prefill chunks of many lengths
                self.flat.clear()
            rows, _, width = self.mask.shape
            tiled = mx.tile(self.mask, (1, tokens, members)) if tokens * members > 1 else self.mask
            self.flat[members, tokens] = tiled.reshape(rows * tokens, members * width)
        return self.flat[members, tokens]


BASE = Route()


class AdapterRouting:
    """Adapter name per row -> Route; the engine sets it around each model call."""

    def __init__(self, names: Sequence[str], ranks: Sequence[int], dtype):
        self.slots = {name: i for i, name in enumerate(names)}
        self.ranks = list(ranks)
        self.offsets = [int(o) for o in np.cumsum([0, *ranks])[:-1]]
        self.dtype = dtype  # the adapted layers' dtype: the mask must not promote their products
        self.route = BASE
        # Recent compositions: decode steps repeat the batch's, joiners' prefills interleave their own.
        self._recent: dict[tuple[str, ...], Route] = {}

    def route_for(self, names: Sequence[str]) -> Route:
        key = tuple(names)
        if key not in self._recent:
            if len(self._recent) >= RECENT_ROUTES:
                self._recent.pop(next(iter(self._recent)))
            route = self._decide(key)
            mx.eval([a for a in (route.indices, route.row_index, route.mask) if a is not None])  # once, not per step
            self._recent[key] = route
        return self._recent[key]

    def _decide(self, names: tuple[str, ...]) -> Route:
        slots = [self.slots[name] if name else None for name in names]
        if all(s is None for s in slots):
            return BASE
        none = len(self.ranks)
        indices = mx.array([none if s is None else s for s in slots], dtype=mx.uint32)
        row_index = mx.arange(len(slots), dtype=mx.uint32)
        if all(s == slots[0] for s in slots):
            return Route(slot=slots[0], indices=indices, row_index=row_index)
        mask = np.zeros((len(slots), 1, sum(self.ranks)), dtype=np.float32)
        for row, slot in enumerate(slots):
            if slot is not None:
                mask[row, 0, self.offsets[slot] : self.offsets[slot] + self.ranks[slot]] = 1.0
        return Route(indices=indices, row_index=row_index, mask=mx.array(mask).astype(self.dtype))

    @contextmanager
    def rows(self, names: Sequence[str]):
        previous, self.route = self.route, self.route_for(names)
        try:
            yield
        finally:
            self.route = previous
