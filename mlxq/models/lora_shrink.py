"""The shrink ``h = x @ A`` of sibling layers that read one input (q/k/v, gate/up), once per input.

On a GPU the adapter step is host-bound: every graph node costs host time
whatever its size, and a cuBLAS matmul costs most (MLX builds its plan and
asks cuBLAS for a heuristic on every call). So the siblings' A blocks sit
side by side and the first sibling called with an input computes every
sibling's shrink at once, in the layout the expand reads: ``h`` is
``[..., members * R]``, member m's columns of adapter k at
``m * R + offsets[k]`` (R: every adapter's rank summed), each row's own
adapter's columns and zeros elsewhere. How:

- one token a row (decode), rows on any adapters: one ``gather_mm`` over a
  stack of per-adapter A (each adapter's columns, zeros elsewhere; the last
  slot all zeros for base rows). With one token a row MLX runs it as a
  gathered matrix-vector kernel, not cuBLAS, and the per-row choice needs
  no mask;
- several tokens a row (prefill), where a node's cost spreads over the
  tokens: every row on adapter k: ``x @ A_k`` (the stack's slot k); rows
  differ: ``(x @ A) * mask``.

Dense siblings then read ``[x | h]`` (``extended``), one concatenation per
input, against their weight extended by B (models/lora_linear.py): the
expand rides in the base matmul. The input is held by a weak reference and
what was computed from it only as long as it lives (the caller's forward): a
cache that kept them would keep a prefill chunk's activations of every layer
alive through the chunk's evaluation (gigabytes on an 8B model).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from mlxq.models.lora_routing import AdapterRouting, Route


class SharedShrink:
    def __init__(self, a_blocks: Sequence[mx.array], routing: AdapterRouting):
        """``a_blocks``: per member ``[R, input_dims]``, every adapter's rows (zeros where it leaves the layer)."""
        self.members = len(a_blocks)
        every = mx.concatenate(a_blocks)  # [members * R, input_dims]
        own = _own_columns(routing, self.members)
        stack = mx.stack([every * mx.array(keep, dtype=every.dtype)[:, None] for keep in own]
                         + [mx.zeros_like(every)])
        # Transposed views, evaluated once (not a node in every step's graph): gather_mm with a
        # transposed right operand and one token a row takes MLX's gathered matrix-vector path.
        self.every = every.T
        self.stack = stack.transpose(0, 2, 1)
        self.alone = [self.stack[k] for k in range(len(own))]
        mx.eval(self.every, self.stack, self.alone)
        self._key: tuple = (lambda: None, None)  # (weak reference to the input, route)
        self._made: dict[str, mx.array] = {}  # what was computed from the input, dropped with it

    def of(self, x: mx.array, route: Route) -> mx.array:
        """The shrink of ``x`` ``[..., input_dims]`` for ``route``: ``[..., members * R]``."""
        return self._made["h"] if self._holds(x, route) else self._compute(x, route)

    def extended(self, x: mx.array, route: Route) -> mx.array:
        """``[x | h]``: the input of the dense siblings' extended weights."""
        h = self.of(x, route)
        if "extended" not in self._made:
            self._made["extended"] = mx.concatenate([x, h], axis=-1)
        return self._made["extended"]

    def flat(self, x: mx.array, route: Route) -> tuple[mx.array, mx.array]:
        """``x`` and its shrink as 2-D ``[rows * tokens, ...]`` operands (an addmm's)."""
        h = self.of(x, route)
        if "rows" not in self._made:
            self._made["rows"] = x.reshape(-1, x.shape[-1])
            self._made["h_rows"] = h.reshape(-1, h.shape[-1])
        return self._made["rows"], self._made["h_rows"]

    def _holds(self, x: mx.array, route: Route) -> bool:
        return "h" in self._made and self._key[0]() is x and self._key[1] is route

    def _compute(self, x: mx.array, route: Route) -> mx.array:
        rows = x.shape[0]
        if x.ndim == 3 and x.shape[1] == 1 and rows == route.indices.shape[0]:
            h = mx.gather_mm(x, self.stack, route.row_index, route.indices)
        elif route.mask is None:  # every row on one adapter
            h = x @ self.alone[route.slot]
        elif x.ndim == 3 and rows == route.mask.shape[0]:
            flat = x.reshape(-1, x.shape[-1]) @ self.every
            h = (flat * route.flat_mask(self.members, x.shape[1])).reshape(*x.shape[:-1], flat.shape[-1])
        else:
            raise RuntimeError(f"adapter routing for {route.mask.shape[0]} rows met an input of shape {x.shape}")
        self._key = (weakref.ref(x, self._input_gone), route)
        self._made = {"h": h}
        return h

    def _input_gone(self, _reference) -> None:
        self._made = {}


def _own_columns(routing: AdapterRouting, members: int) -> list[np.ndarray]:
    """Per adapter: 1 on its columns of each member's block of the shrink, 0 elsewhere."""
    width = sum(routing.ranks)
    own = []
    for offset, rank in zip(routing.offsets, routing.ranks, strict=True):
        keep = np.zeros(members * width, dtype=np.float32)
        for member in range(members):
            keep[member * width + offset : member * width + offset + rank] = 1.0
        own.append(keep)
    return own
